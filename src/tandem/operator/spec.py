"""The BrokerCluster resource, typed: one pydantic model for the operator and for the CRD.

The CRD's OpenAPI schema is generated from these models (`tandem.operator.crd`), so what the
API server accepts and what the operator reads cannot drift apart. Field names are the
Kubernetes ones (camelCase); every number that must be positive says so, and the one
cross-field rule (the ISR minimum is at most the replicas) is both a model validator and a
CEL rule in the CRD.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GROUP = "tandem.dev"
VERSION = "v1alpha1"
KIND = "BrokerCluster"
PLURAL = "brokerclusters"
SHORT_NAMES = ["bc"]

# A Kubernetes quantity ("1Gi", "500m", "2"): checked by the API server's pattern.
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")]
Seconds = Annotated[float, Field(gt=0)]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Resources(Model):
    """CPU and memory for each broker container, as in a pod's `resources`."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class Storage(Model):
    size: Quantity = "1Gi"
    storage_class_name: str | None = Field(None, alias="storageClassName")
    # Keep the members' volumes when the BrokerCluster is deleted (Retain) or delete them.
    retention: Literal["Retain", "Delete"] = "Retain"


class Replication(Model):
    default: Literal["none", "configuration", "all"] = "all"
    # The in-sync set's minimum; unset: 2, or 1 for a one-member cluster.
    isr_min: int | None = Field(None, alias="isrMin", ge=1)


class Failover(Model):
    delay_seconds: Seconds = Field(1.0, alias="delaySeconds")
    poll_seconds: Seconds = Field(0.4, alias="pollSeconds")
    lease_seconds: Seconds = Field(10.0, alias="leaseSeconds")


class Service(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    annotations: dict[str, str] = Field(default_factory=dict)


class BrokerClusterSpec(Model):
    replicas: int = Field(3, ge=1)
    image: str = "tandem:dev"
    resources: Resources = Field(default_factory=Resources)
    storage: Storage = Field(default_factory=lambda: Storage.model_validate({}))
    replication: Replication = Field(default_factory=lambda: Replication.model_validate({}))
    failover: Failover = Field(default_factory=lambda: Failover.model_validate({}))
    users_secret: str | None = Field(None, alias="usersSecret")
    tls_secret: str | None = Field(None, alias="tlsSecret")
    service: Service = Field(default_factory=Service)
    # Merged into the StatefulSet's pod template (node selectors, tolerations, labels ...).
    pod_template: dict[str, Any] = Field(default_factory=dict, alias="podTemplate")

    @model_validator(mode="after")
    def _isr_min(self) -> BrokerClusterSpec:
        if self.replication.isr_min is not None and self.replication.isr_min > self.replicas:
            raise ValueError(
                f"replication.isrMin ({self.replication.isr_min}) must not exceed replicas "
                f"({self.replicas})"
            )
        return self

    @property
    def isr_min(self) -> int:
        return self.replication.isr_min or min(2, self.replicas)


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = Field(None, alias="lastTransitionTime")


class LastFailover(Model):
    time: str
    from_: str | None = Field(None, alias="from")
    to: str
    reason: str
    duration_seconds: float = Field(alias="durationSeconds")


class BrokerClusterStatus(Model):
    phase: Literal["Pending", "Running", "Failover", "Degraded", "Paused"] = "Pending"
    primary: str | None = None
    epoch: int = 0
    isr: list[str] = Field(default_factory=list)
    ready_members: int = Field(0, alias="readyMembers")
    conditions: list[Condition] = Field(default_factory=list)
    last_failover: LastFailover | None = Field(None, alias="lastFailover")
