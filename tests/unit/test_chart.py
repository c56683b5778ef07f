"""The Helm chart, rendered by Helm's own engine in process (helm-python-sdk), with default and
non-default values; what it must agree with is drift-tested:

- charts/tandem/crds/ holds the same CRD as crds/ (generated from the model);
- values.schema.json is `crd.values_schema()` (its BrokerCluster part is the CRD's schema);
- deploy/operator.yaml is the chart rendered with its defaults.

    TANDEM_UPDATE_GOLDEN=1 python3 -m pytest tests/unit/test_chart.py

rewrites the three after an intended change; review the diff."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tandem.operator import crd
from tandem.operator.spec import BrokerClusterSpec
from tests.support import chart_objects

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
K8S = "1.33"
OPERATOR_YAML_HEADER = (
    "# The operator, rendered from charts/tandem with its default values (tests/unit/"
    "test_chart.py\n# keeps it so). kubectl apply -f crds/ -f deploy/operator.yaml\n"
)


def _same(path: Path, text: str, how: str) -> None:
    if os.environ.get("TANDEM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"{path.relative_to(ROOT)} is out of date: {how}"


def test_the_chart_carries_the_generated_crd() -> None:
    how = "cp crds/brokercluster.yaml charts/tandem/crds/"
    _same(CHART / "crds" / "brokercluster.yaml", crd.render(), how)


def test_values_schema_is_generated_from_the_model() -> None:
    text = json.dumps(crd.values_schema(), indent=2) + "\n"
    _same(CHART / "values.schema.json", text, "TANDEM_UPDATE_GOLDEN=1 pytest tests/unit")


def operator_yaml() -> str:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tandem-system"}}
    docs = [namespace, *chart_objects()]
    return OPERATOR_YAML_HEADER + "".join(
        "---\n" + yaml.safe_dump(d, sort_keys=False, width=100) for d in docs
    )


def test_deploy_operator_yaml_is_the_chart_rendered() -> None:
    text = operator_yaml()
    _same(ROOT / "deploy" / "operator.yaml", text, "TANDEM_UPDATE_GOLDEN=1 pytest tests/unit")
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
    ]
    for d in docs:
        kubernetes_validate.validate(d, K8S, strict=True)


def test_the_chart_lints_clean() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version="v1.33.0")
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def test_non_default_values_render_valid_objects() -> None:
    values = {
        "image": {"repository": "registry.example/tandem", "tag": "0.1.0"},
        "operator": {"watchNamespaces": ["queues", "billing"], "logLevel": "debug"},
        "brokerCluster": {"enabled": True, "name": "orders", "spec": {"replicas": 5}},
        "metrics": {"serviceMonitor": {"enabled": True}, "dashboard": {"enabled": True}},
    }
    objects = {o["kind"]: o for o in chart_objects(values, namespace="queues")}
    assert set(objects) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "BrokerCluster",
        "ServiceMonitor",
        "ConfigMap",
    }
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/tandem:0.1.0"
    assert "--namespace=queues" in container["args"] and "--namespace=billing" in container["args"]
    assert "--all-namespaces" not in container["args"]
    bc = objects["BrokerCluster"]
    assert bc["metadata"] == {"name": "orders", "namespace": "queues"}
    parsed = BrokerClusterSpec.model_validate(bc["spec"])
    assert parsed.replicas == 5 and parsed.image == "registry.example/tandem:0.1.0"
    monitor = objects["ServiceMonitor"]["spec"]
    assert monitor["namespaceSelector"] == {"matchNames": ["queues", "billing"]}
    assert monitor["endpoints"][0]["port"] == "admin"
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ConfigMap"):
        kubernetes_validate.validate(objects[kind], K8S, strict=True)


def test_the_dashboard_asks_only_for_metrics_the_brokers_export() -> None:
    (cm,) = [
        o
        for o in chart_objects({"metrics": {"dashboard": {"enabled": True}}})
        if o["kind"] == "ConfigMap"
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["tandem.json"])
    exported = set(
        re.findall(r'"(tandem_[a-z_]+)"', (ROOT / "src/tandem/broker/admin.py").read_text())
    )
    asked = {
        re.sub(r"_total$", "", name)
        for p in dashboard["panels"]
        for t in p["targets"]
        for name in re.findall(r"tandem_[a-z_]+", t["expr"])
    }
    assert asked and asked <= exported, asked - exported


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"brokerCluster": {"spec": {"replicas": 0}}}, "/brokerCluster/spec/replicas"),
        ({"brokerCluster": {"spec": {"failover": {"delaySeconds": 0}}}}, "delaySeconds"),
        ({"brokerCluster": {"spec": {"service": {"type": "Ingress"}}}}, "/service/type"),
        ({"brokerCluster": {"name": "Not_A_Name"}}, "/brokerCluster/name"),
        ({"image": {"repository": "", "tag": "dev"}}, "/image/repository"),
        ({"operator": {"watchNamespace": ["a"]}}, "watchNamespace"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/interval"),
    ],
)
def test_values_the_schema_refuses(values: dict[str, Any], complaint: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmValuesError, match=re.escape(complaint)):
        chart.validate_schema(values)


def test_the_operator_may_touch_only_what_it_manages() -> None:
    (role,) = [o for o in chart_objects() if o["kind"] == "ClusterRole"]
    rules = role["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert ("", "pods") in granted and ("coordination.k8s.io", "leases") in granted
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in rules)
    pods = next(r for r in rules if r["resources"] == ["pods"])
    # labels, and deletes in a rolling upgrade; never creates (the StatefulSet does)
    assert set(pods["verbs"]) == {"get", "list", "watch", "patch", "delete"}


SPARK_CRDS = ROOT / "tests" / "data" / "spark-operator"  # the spark-operator's, Apache-2.0
AUDIT_MANIFESTS = {
    "sparkapplication.yaml": {"audit": {"enabled": True, "clusterNamespace": "default"}},
    "scheduledsparkapplication.yaml": {
        "audit": {"enabled": True, "clusterNamespace": "default", "schedule": "0 * * * *"}
    },
}


def audit_yaml(values: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    docs = [
        o
        for o in chart_objects(values, namespace="tandem-system")
        if (o.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/name")
        == "tandem-audit"
    ]
    header = (
        "# The Spark audit of BrokerCluster demo (namespace default), rendered from "
        "charts/tandem\n# (tests/unit/test_chart.py keeps it so). Needs the Kubeflow "
        "spark-operator: docs/audit.md.\n"
    )
    text = header + "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)
    return text, docs


def _strict(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Keys the schema does not know (the API server would prune them silently)."""
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        return (
            [p for k, v in value.items() for p in _strict(extra, v, f"{path}.{k}")]
            if (isinstance(extra, dict))
            else []
        )
    out = []
    for k, v in value.items():
        if k not in props:
            out.append(f"{path}.{k}")
        else:
            out += _strict(props[k], v, f"{path}.{k}")
    return out


@pytest.mark.parametrize("name", sorted(AUDIT_MANIFESTS))
def test_the_audit_manifests_are_the_chart_rendered_and_valid(name: str) -> None:
    import jsonschema

    text, docs = audit_yaml(AUDIT_MANIFESTS[name])
    _same(ROOT / "deploy" / name, text, "TANDEM_UPDATE_GOLDEN=1 pytest tests/unit")
    (app,) = [d for d in docs if d["apiVersion"] == "sparkoperator.k8s.io/v1beta2"]
    plural = app["kind"].lower() + "s"
    crd_doc = yaml.safe_load((SPARK_CRDS / f"sparkoperator.k8s.io_{plural}.yaml").read_text())
    schema = crd_doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(app, schema)
    assert not _strict(schema, app, ""), _strict(schema, app, "")
    spec = app["spec"].get("template", app["spec"])
    assert spec["type"] == "Python"
    for side in ("driver", "executor"):
        pod = spec[side]
        assert pod["cores"] == 1
        assert pod["labels"]["tandem.dev/admin-access"] == "true"  # members admit it
        assert pod["podSecurityContext"]["runAsNonRoot"] is True
    assert "--kubernetes" in spec["arguments"] and "demo.default" in spec["arguments"]
    if app["kind"] == "ScheduledSparkApplication":
        assert app["spec"]["timeZone"] == "UTC" and app["spec"]["schedule"] == "0 * * * *"
    for d in docs:
        if d is not app:
            kubernetes_validate.validate(d, K8S, strict=True)


def test_the_audit_reaches_only_the_members_admin_port_and_dns_and_the_api() -> None:
    _, docs = audit_yaml(AUDIT_MANIFESTS["sparkapplication.yaml"])
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ports = sorted(p["port"] for rule in policy["spec"]["egress"] for p in rule.get("ports", []))
    assert ports == [53, 53, 443, 6443, 15672]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert {r for rule in role["rules"] for r in rule["resources"]} <= {
        "pods",
        "services",
        "configmaps",
        "persistentvolumeclaims",
    }


def test_the_sample_brokercluster_is_what_the_chart_renders_from_it() -> None:
    sample = yaml.safe_load((ROOT / "deploy" / "brokercluster.yaml").read_text())
    values = {
        "brokerCluster": {"enabled": True, "name": "demo", "spec": sample["spec"]},
        "image": {"repository": "tandem", "tag": "dev"},
    }
    (bc,) = [o for o in chart_objects(values, namespace="default") if o["kind"] == "BrokerCluster"]
    assert bc == {**sample, "metadata": {**sample["metadata"], "namespace": "default"}}
