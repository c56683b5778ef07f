"""The operator's pure builders: golden files for the sample BrokerCluster, and the
properties that matter whatever the spec (pod security, the role selector, retention).

    TANDEM_UPDATE_GOLDEN=1 python3 -m pytest tests/unit/test_operator_builders.py

rewrites the golden files after an intended change; review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tandem.broker.model import definitions
from tandem.operator import builders
from tandem.operator.spec import BrokerClusterSpec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"


def sample() -> BrokerClusterSpec:
    doc = yaml.safe_load((ROOT / "deploy" / "brokercluster.yaml").read_text())
    return BrokerClusterSpec.model_validate(doc["spec"])


def objects() -> list[dict[str, Any]]:
    return builders.all_objects(
        "demo", "default", sample(), "golden-test-key-0123456789", "golden-test-password"
    )


@pytest.mark.parametrize("index", range(9))
def test_golden(index: int) -> None:
    obj = objects()[index]
    path = GOLDEN / f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
    text = yaml.safe_dump(obj, sort_keys=True)
    if os.environ.get("TANDEM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"{path.name} differs from the builder's output"


def test_every_golden_file_is_built() -> None:
    built = {f"{o['kind'].lower()}-{o['metadata']['name']}.yaml" for o in objects()}
    assert {p.name for p in GOLDEN.glob("*.yaml")} == built


def test_pods_run_restricted() -> None:
    pod = builders.stateful_set("demo", "ns", sample())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/tandem", "/tmp"} <= mounts  # the only writable places


def test_the_client_service_follows_the_primary_label() -> None:
    svc = builders.client_service("demo", "ns", sample())
    assert svc["spec"]["selector"][builders.ROLE_LABEL] == "primary"
    members = builders.members_service("demo", "ns")
    assert builders.ROLE_LABEL not in members["spec"]["selector"]


def test_storage_retention_and_class() -> None:
    spec = BrokerClusterSpec.model_validate(
        {"storage": {"retention": "Delete", "storageClassName": "fast", "size": "5Gi"}}
    )
    sts = builders.stateful_set("demo", "ns", spec)["spec"]
    assert sts["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    (claim,) = sts["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"


def test_pod_template_overrides_merge_into_the_pod() -> None:
    spec = BrokerClusterSpec.model_validate(
        {
            "podTemplate": {
                "metadata": {"labels": {"team": "payments"}},
                "spec": {
                    "nodeSelector": {"disk": "ssd"},
                    "containers": [{"name": "tandem", "env": [{"name": "X", "value": "1"}]}],
                },
            }
        }
    )
    pod = builders.stateful_set("demo", "ns", spec)["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "payments"
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert pod["spec"]["nodeSelector"] == {"disk": "ssd"}
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "tandem:dev"  # the container merged by name, not replaced
    assert [e["name"] for e in c["env"]] == ["POD_NAME", "X"]


def test_member_settings_are_valid_node_settings() -> None:
    """The ConfigMap's tandem.yaml is what `tandem broker --config` accepts."""
    from tandem.broker import config

    cm = builders.config_map("demo", "ns", sample())
    cfg = config.parse(yaml.safe_load(cm["data"]["tandem.yaml"]), "configmap")
    assert cfg.replication_port == builders.REPLICATION_PORT and cfg.isr_min == 2


def test_the_lease_holds_the_election_record() -> None:
    lease = builders.lease("demo", "ns", "demo-1", 4, ["demo-1", "demo-0"])
    assert lease["spec"] == {"leaseTransitions": 4, "holderIdentity": "demo-1"}
    assert lease["metadata"]["annotations"]["tandem.dev/isr"] == "demo-0,demo-1"


K8S = "1.33"  # a current Kubernetes; kubernetes-validate bundles its schemas


@pytest.mark.parametrize("index", range(9))
def test_every_object_is_valid_for_kubernetes(index: int) -> None:
    kubernetes_validate.validate(objects()[index], K8S, strict=True)


def test_the_crd_is_valid_for_kubernetes() -> None:
    from tandem.operator import crd

    kubernetes_validate.validate(crd.build(), K8S, strict=True)


def test_the_validation_would_catch_a_mistake() -> None:
    sts = builders.stateful_set("demo", "ns", sample())
    sts["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S, strict=True)


def test_tls_and_users_secrets_reach_the_members() -> None:
    spec = sample().model_copy(update={"tls_secret": "demo-tls", "users_secret": "demo-users"})
    settings = builders.member_settings(spec)
    assert settings["tls_port"] == builders.AMQPS_PORT
    assert settings["tls_certfile"].startswith(builders.TLS_DIR)
    assert settings["definitions"] == f"{builders.USERS_DIR}/definitions.json"
    pod = builders.stateful_set("demo", "ns", spec)["spec"]["template"]["spec"]
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert {"demo-tls", "demo-users"} <= secrets
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {builders.TLS_DIR, builders.USERS_DIR} <= mounts
    service = builders.client_service("demo", "ns", spec)
    assert {"name": "amqps", "port": 5671, "targetPort": "amqps"} in service["spec"]["ports"]
    kubernetes_validate.validate(builders.stateful_set("demo", "ns", spec), K8S, strict=True)


def test_without_a_users_secret_a_default_user_is_generated() -> None:
    spec = sample()
    assert spec.users_secret is None
    (secret,) = [o for o in objects() if o["metadata"]["name"] == "demo-default-user"]
    data = secret["stringData"]
    assert data["url"] == f"amqp://default:{data['password']}@demo.default.svc:5672/%2F"
    users = definitions.validate(json.loads(data["definitions.json"]), "the default user")
    assert [u["name"] for u in users["users"]] == ["default"]
    pod = builders.stateful_set("demo", "default", spec)["spec"]["template"]["spec"]
    assert {"name": "users", "secret": {"secretName": "demo-default-user"}} in pod["volumes"]
    own = spec.model_copy(update={"users_secret": "mine"})
    names = [o["metadata"]["name"] for o in builders.all_objects("demo", "d", own, "k", "p")]
    assert "demo-default-user" not in names


def test_a_change_of_the_members_settings_changes_the_pod_template_but_isr_min_does_not() -> None:
    """Issue 15: replication.default, leaseSeconds and TLS once never reached the brokers (the
    template did not change, so no pod restarted). The ISR minimum takes effect live."""
    base = {"replicas": 3}
    sums = {
        what: builders.config_checksum(BrokerClusterSpec.model_validate({**base, **change}))
        for what, change in {
            "base": {},
            "default": {"replication": {"default": "configuration"}},
            "lease": {"failover": {"leaseSeconds": 20.0}},
            "tls": {"tlsSecret": "demo-tls"},
            "isr_min": {"replication": {"isrMin": 3}},
        }.items()
    }
    assert len({sums["base"], sums["default"], sums["lease"], sums["tls"]}) == 4
    assert sums["isr_min"] == sums["base"]
    sts = builders.stateful_set("demo", "ns", BrokerClusterSpec.model_validate(base))
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations[builders.CONFIG_CHECKSUM] == sums["base"]
