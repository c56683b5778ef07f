"""docs/kubernetes.md, checked here as far as a machine without Kubernetes can: its commands
that need no cluster run as written, and what the others send (manifests, patches,
annotations, the users file) is valid for the operator. tests/e2e/test_kind.py runs every
`sh` block in order on a real cluster."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tandem.broker.model import definitions
from tandem.operator import crd
from tandem.operator.members import PAUSE_ANNOTATION
from tandem.operator.spec import BrokerClusterSpec

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kubernetes.md"


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.+?)\n```", DOC.read_text(), re.S)


def commands() -> list[str]:
    text = "\n".join(sh_blocks())
    text = re.sub(r"<<'EOF'\n.*?\nEOF", "<<'EOF'", text, flags=re.S)  # heredoc bodies aside
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_the_users_file_is_a_valid_definitions_export(tmp_path: Path) -> None:
    (heredoc,) = re.findall(r"<<'EOF'\n(.+?)\nEOF", "\n".join(sh_blocks()), re.S)
    data = definitions.validate(json.loads(heredoc), "docs/kubernetes.md")
    assert [u["name"] for u in data["users"]] == ["app"]
    assert "--from-file=definitions.json=" in " ".join(commands())  # the key the pods read


def test_the_sample_with_users_is_a_valid_brokercluster() -> None:
    (line,) = [c for c in commands() if c.startswith("sed ")]
    sed = line.split(" | ")[0]
    out = subprocess.run(["bash", "-c", sed], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    spec = BrokerClusterSpec.model_validate(doc["spec"])
    assert spec.users_secret == "demo-users" and doc["metadata"]["name"] == "demo"


def test_every_patch_and_annotation_is_one_the_operator_takes() -> None:
    sample = yaml.safe_load((ROOT / "deploy" / "brokercluster.yaml").read_text())["spec"]
    patches = [re.search(r"-p '(.+)'", c) for c in commands() if "kubectl patch" in c]
    assert patches
    for found in patches:
        assert found is not None
        change = json.loads(found.group(1))["spec"]
        BrokerClusterSpec.model_validate({**sample, **change})
    annotations = [c for c in commands() if "kubectl annotate" in c]
    assert annotations and all(PAUSE_ANNOTATION in a for a in annotations)


def test_every_file_the_commands_name_exists() -> None:
    named = re.findall(r"(?:-f |\s)((?:deploy|crds|charts)/[\w./-]*)", " ".join(commands()))
    assert named
    for path in named:
        assert (ROOT / path).exists(), path


def test_the_spec_table_names_every_field() -> None:
    text = DOC.read_text()
    schema = crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for field in schema["properties"]["spec"]["properties"]:
        assert f"`{field}" in text, f"docs/kubernetes.md does not describe spec.{field}"
