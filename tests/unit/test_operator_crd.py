"""The BrokerCluster resource: one typed model, and the CRD generated from it (drift-tested)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tandem.operator import crd, spec

ROOT = Path(__file__).resolve().parents[2]


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for k, v in node.items():
            out += walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += walk(v, f"{path}[{i}]")
    return out


def test_the_crd_file_is_what_the_model_generates() -> None:
    assert (ROOT / "crds" / "brokercluster.yaml").read_text() == crd.render(), (
        "crds/brokercluster.yaml is out of date: tandem operator crd > crds/brokercluster.yaml"
    )


def test_the_schema_is_structural() -> None:
    """What the API server requires of a CRD schema: no references, no unions, no titles,
    a type on every node, and `additionalProperties` never beside `properties`."""
    schema = crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        if path.endswith(".properties") or path.endswith(".x-kubernetes-validations[0]"):
            continue
        assert not {"$ref", "$defs", "anyOf", "oneOf", "title"} & set(node), path
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if isinstance(node.get("exclusiveMinimum"), bool):
            assert "minimum" in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path


def test_the_crd_names_and_columns() -> None:
    c = crd.build()
    assert c["metadata"]["name"] == "brokerclusters.tandem.dev"
    names = c["spec"]["names"]
    assert (names["kind"], names["shortNames"]) == ("BrokerCluster", ["bc"])
    version = c["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    columns = [col["name"] for col in version["additionalPrinterColumns"]]
    assert columns == ["Primary", "Epoch", "ISR", "Ready", "Age"]


def test_the_sample_is_a_valid_broker_cluster() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "brokercluster.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == (f"{spec.GROUP}/{spec.VERSION}", spec.KIND)
    s = spec.BrokerClusterSpec.model_validate(doc["spec"])
    assert s.replicas == 3 and s.isr_min == 2 and s.resources.requests["cpu"] == "500m"


def test_defaults() -> None:
    s = spec.BrokerClusterSpec.model_validate({})
    assert (s.replicas, s.isr_min, s.replication.default) == (3, 2, "all")
    assert spec.BrokerClusterSpec.model_validate({"replicas": 1}).isr_min == 1


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2, "replication": {"isrMin": 3}}, "must not exceed replicas"),
        ({"replication": {"isrMin": 0}}, "isrMin"),
        ({"failover": {"delaySeconds": 0}}, "delaySeconds"),
        ({"failover": {"leaseSeconds": -1}}, "leaseSeconds"),
        ({"replication": {"default": "some"}}, "default"),
        ({"storage": {"size": "lots"}}, "size"),
        ({"storage": {"retention": "Keep"}}, "retention"),
        ({"service": {"type": "Ingress"}}, "type"),
        ({"replicaz": 3}, "replicaz"),
    ],
)
def test_an_invalid_spec_is_refused_naming_the_field(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as err:
        spec.BrokerClusterSpec.model_validate(body)
    assert says in str(err.value)


def test_the_cel_rule_matches_the_model_rule() -> None:
    """The API server checks the ISR rule with CEL; the operator with the model. Both name
    the same fields and the same comparison."""
    rule = crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"
    ][0]["rule"]
    assert "self.replication.isrMin <= self.replicas" in rule
    ok = spec.BrokerClusterSpec.model_validate({"replicas": 3, "replication": {"isrMin": 3}})
    assert ok.isr_min == 3
