"""The status contract: what a member publishes (`GET /status`, and the answer to each `/ha/*`
command) and what a local cluster publishes (`GET /cluster`), as pydantic models.

The broker builds its answers from these models, and every reader parses them with the same
models: the HA observer (both controllers), the local cluster's `/cluster`, the audit and
`tandem cluster status`. A field renamed or retyped on one side fails the readers' tests,
rather than reading as a default. Unknown fields are kept (`extra="allow"`), so a newer
member can add one without breaking an older reader; fields a member does not have (a lone
node has no replication fields) are left out of its answer (`publish`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")

    def publish(self) -> dict[str, Any]:
        """The JSON answer: the fields set, as set."""
        return self.model_dump(mode="json", exclude_unset=True)


class MemberReport(_Model):
    """The primary's view of one other member, taken at one instant."""

    connected: bool = False
    caught_up: bool = False  # acked everything the primary has confirmed
    waited: bool = False  # the primary waits for its acks (ISR or tracked)
    lag_records: int = 0
    lag_seconds: float = 0.0
    # Confirmed records it has not acked; None until it acked over its current connection
    # (and from a primary of a version before this field).
    behind: int | None = None


class QueueStatus(_Model):
    vhost: str
    name: str
    depth: int
    ready: int
    unacked: int
    paged: int = 0  # ready messages in the log only (a queue deeper than its memory budget)
    consumers: int
    durable: bool
    replicate: str


class ReplicationStatus(_Model):
    """A cluster member's replication state: what each `/ha/*` command answers, and part of
    `/status`. The HA observer reads only this."""

    role: Literal["standalone", "primary", "backup"] = "standalone"
    epoch: int = 0  # the highest epoch adopted
    position: int = 0  # the offset of the last record held
    last_epoch: int = 0  # the epoch of that record
    whole: bool = True  # false while it lacks records it held only in memory
    diverged: str | None = None  # why a record from the primary did not apply, if one did not
    following: str | None = None
    synced: bool = False
    cluster: str | None = None
    replication_port: int | None = None
    refused: str | None = None
    failovers: int = 0
    catch_up_bytes: int = 0
    replication_rtt_seconds: float = 0.0
    lease_lapsed: bool = False
    # On the primary only:
    isr: list[str] | None = None
    tracking: list[str] | None = None
    applied_version: int = 0  # the election record version whose ISR it applied last
    confirmed: int | None = None
    accepting: bool | None = None
    # Flow control: publishers are not read while too much waits for the ISR's acks.
    flow: bool | None = None
    flow_episodes: int | None = None  # times it set in, since the start
    members: dict[str, MemberReport] = Field(default_factory=dict)


class NodeStatus(ReplicationStatus):
    """`GET /status` of any node: a lone broker, or a cluster member."""

    node: str = ""
    primary: str | None = None
    amqp_port: int = 0
    admin_port: int = 0
    connections: int = 0
    alarms: dict[str, str] = Field(default_factory=dict)
    store: dict[str, Any] | None = None
    queues: list[QueueStatus] = Field(default_factory=list)
    # Records this node could not apply (a bug; see model/apply.py), the last few.
    not_applied: list[str] = Field(default_factory=list)


class ClusterMember(_Model):
    """One member as the local cluster's `GET /cluster` shows it."""

    node: str
    pid: int | None = None
    amqp_port: int | None = None
    admin_port: int | None = None
    replication_port: int | None = None
    tls_port: int | None = None
    role: str = "down"  # standalone, primary, backup, or down (its process is not running)
    epoch: int | None = None
    position: int | None = None
    whole: bool | None = None
    diverged: str | None = None
    following: str | None = None
    restarts: int = 0
    lag_records: int = 0
    lag_seconds: float = 0.0
    in_isr: bool = False


class FrontAddress(_Model):
    host: str
    port: int
    tls_port: int | None = None


class ClusterStatus(_Model):
    """The local cluster's `GET /cluster`: its members, the election record, the front port
    and the controller's last decisions with their reasons."""

    epoch: int = 0
    primary: str | None = None
    isr: list[str] = Field(default_factory=list)
    serving: bool = False
    front: FrontAddress
    held_connections: int = 0
    last_decision: str | None = None
    last_change: str | None = None
    members: list[ClusterMember] = Field(default_factory=list)
