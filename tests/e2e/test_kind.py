"""End to end on a real Kubernetes (kind): install the chart, create a BrokerCluster, run a
confirmed publisher through the client Service, delete the primary pod mid-stream, and check
that every confirmed message is still there.

Needs docker (with a running daemon), kind, kubectl and helm; where any is missing the suite
is skipped and says which. .github/workflows/e2e-kind.yml runs it on a runner that has them.
KIND_CLUSTER names an existing cluster to use instead of creating `tandem-e2e`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("docker", "kind", "kubectl", "helm")
COUNT = 20_000


def _missing() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the kind suite needs {', '.join(missing)}, not on this machine"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "the kind suite needs a running Docker daemon"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def sh(*cmd: str, input: str | None = None, timeout: float = 600) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr[-2000:]}"
    return out.stdout


def kubectl(*args: str, **kw: object) -> str:
    return sh("kubectl", "--context", f"kind-{CLUSTER}", *args, **kw)  # type: ignore[arg-type]


CLUSTER = os.environ.get("KIND_CLUSTER", "tandem-e2e")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    created = False
    if CLUSTER not in sh("kind", "get", "clusters").split():
        sh("kind", "create", "cluster", "--name", CLUSTER, "--wait", "180s", timeout=900)
        created = True
    sh("kubectl", "config", "use-context", f"kind-{CLUSTER}")
    try:
        yield
    finally:
        if created and not os.environ.get("KEEP_KIND"):
            sh("kind", "delete", "cluster", "--name", CLUSTER)


@pytest.mark.timeout(2400)
def test_docs_kubernetes_md_runs_as_written(cluster: None) -> None:
    """Every `sh` block of docs/kubernetes.md, in order: build, install, users, a cluster,
    a failover, day 2, deletion."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    env = {**os.environ, "KIND_CLUSTER": CLUSTER}
    for block in re.findall(r"```sh\n(.+?)\n```", text, re.S):
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert out.returncode == 0, f"{block}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


@pytest.fixture(scope="module")
def installed(cluster: None) -> None:
    sh("docker", "build", "-t", "tandem:dev", str(ROOT), timeout=1200)
    sh("kind", "load", "docker-image", "tandem:dev", "--name", CLUSTER)
    sh(
        "helm", "upgrade", "--install", "tandem", str(ROOT / "charts" / "tandem"),
        "--kube-context", f"kind-{CLUSTER}", "--namespace", "tandem-system",
        "--create-namespace", "--wait", "--timeout", "5m",
    )  # fmt: skip


def _job(name: str, script: str, args: list[str]) -> str:
    return json.dumps(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": name,
                                "image": "python:3.11-slim",
                                "command": [
                                    "sh",
                                    "-c",
                                    f"pip install -q pika && python {script} " + " ".join(args),
                                ],
                                "volumeMounts": [{"name": "examples", "mountPath": "/examples"}],
                            }
                        ],
                        "volumes": [{"name": "examples", "configMap": {"name": "examples"}}],
                    }
                },
            },
        }
    )


@pytest.mark.timeout(1800)
def test_a_confirmed_publisher_loses_nothing_when_the_primary_pod_is_deleted(
    installed: None, tmp_path: Path
) -> None:
    users = {
        "users": [{"name": "app", "password": "app-secret", "tags": []}],
        "vhosts": [{"name": "/"}],
        "permissions": [
            {"user": "app", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
        ],
    }
    (tmp_path / "definitions.json").write_text(json.dumps(users))
    secret = kubectl(
        *("create", "secret", "generic", "orders-users", "--dry-run=client", "-o", "yaml"),
        f"--from-file=definitions.json={tmp_path / 'definitions.json'}",
    )
    kubectl("apply", "-f", "-", input=secret)
    # A name of its own: the docs test leaves demo's retained volume claims behind.
    sample = (ROOT / "deploy" / "brokercluster.yaml").read_text()
    orders = sample.replace("name: demo", "name: orders")
    orders = orders.replace("spec:\n", "spec:\n  usersSecret: orders-users\n", 1)
    kubectl("apply", "-f", "-", input=orders)
    kubectl("wait", "--for=jsonpath={.status.phase}=Running", "bc/orders", "--timeout=300s")
    examples = kubectl(
        *("create", "configmap", "examples", "--dry-run=client", "-o", "yaml"),
        f"--from-file={ROOT / 'examples' / 'reliable_publisher.py'}",
        f"--from-file={ROOT / 'examples' / 'consumer.py'}",
    )
    kubectl("apply", "-f", "-", input=examples)
    url = "amqp://app:app-secret@orders:5672/%2F"
    publisher = ["--url", url, "--count", str(COUNT)]
    kubectl(
        "apply", "-f", "-", input=_job("publisher", "/examples/reliable_publisher.py", publisher)
    )
    kubectl("wait", "--for=condition=Ready", "pod", "-l", "job-name=publisher", "--timeout=300s")
    primary = kubectl("get", "bc", "orders", "-o", "jsonpath={.status.primary}")
    epoch = int(kubectl("get", "bc", "orders", "-o", "jsonpath={.status.epoch}"))
    kubectl("delete", "pod", primary, "--wait=false")
    kubectl("wait", f"--for=jsonpath={{.status.epoch}}={epoch + 1}", "bc/orders", "--timeout=120s")
    kubectl("wait", "--for=condition=complete", "job/publisher", "--timeout=600s")
    assert "all confirmed" in kubectl("logs", "job/publisher")
    consumer = ["--url", url, "--expect", str(COUNT), "--idle", "30"]
    kubectl("apply", "-f", "-", input=_job("consumer", "/examples/consumer.py", consumer))
    kubectl("wait", "--for=condition=complete", "job/consumer", "--timeout=600s")
    assert f"received {COUNT} distinct messages" in kubectl("logs", "job/consumer")
    status = json.loads(kubectl("get", "bc", "orders", "-o", "json"))["status"]
    assert status["lastFailover"]["from"] == primary and status["epoch"] == epoch + 1
