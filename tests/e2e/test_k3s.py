"""End to end on a real single-node Kubernetes: k3s, as ../shared/k3s/up.sh runs it here
(issue 15). The image is built with deploy/build-image.sh and imported into k3s's containerd,
the CRD applied, the chart rendered by Helm's engine (tests.support.chart_objects: there is
no helm binary here) and applied, then BrokerClusters are made and changed while a confirmed
publisher runs through the client Service. After each operation: every confirmed message is
still there, and the Service never selected two pods.

Skipped, with the reason, where k3s is not up (no /var/lib/k3s-up/kubeconfig or a node that
is not Ready). What k3s v1.21 here cannot show: CEL rules (the API server drops
`x-kubernetes-validations`, so the CRD is applied with --validate=false; the emulator and
tests/unit/test_operator_crd.py cover them), NetworkPolicy (not enforced), DNS names (no
CoreDNS: clients use the Service's ClusterIP from this host).

    python3 -m pytest tests/e2e/test_k3s.py -s      (prints each operation's figures)
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import yaml

from tests.support import chart_objects

ROOT = Path(__file__).resolve().parents[2]
KUBECONFIG = Path(os.environ.get("TANDEM_K3S_KUBECONFIG", "/var/lib/k3s-up/kubeconfig"))
TOOLS = Path("/opt/k3s-build/bin")  # kubectl, built with k3s
CONTAINERD = "/run/k3s-up/containerd/containerd.sock"
IMAGE = "docker.io/library/tandem:dev"
NS = "tandem-e2e"
VOLUMES = Path("/var/lib/tandem-e2e-volumes")
RUN_AS = 10001  # the pods' uid (builders.RUN_AS)


def env() -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(KUBECONFIG), "PATH": f"{TOOLS}:{os.environ['PATH']}"}


def sh(*cmd: str, input: str | None = None, timeout: float = 600, check: bool = True) -> str:
    out = subprocess.run(
        cmd, capture_output=True, text=True, input=input, timeout=timeout, env=env()
    )
    if check:
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.stdout[-1000:]}{out.stderr[-2000:]}"
    return out.stdout


def kubectl(*args: str, **kw: Any) -> str:
    return sh("kubectl", *args, **kw)


def _why_skip() -> str | None:
    if not KUBECONFIG.exists():
        return (
            f"k3s is not up on this machine ({KUBECONFIG} is missing): start it with "
            "../shared/k3s/up.sh (see its README)"
        )
    for tool in ("podman", "ctr"):
        if shutil.which(tool) is None:
            return f"the k3s suite needs {tool}, not on this machine"
    out = subprocess.run(
        ["kubectl", "get", "nodes", "-o", "json"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=30,
    )
    if out.returncode != 0:
        return f"k3s does not answer: {out.stderr.strip()[:300]}"
    ready = [
        c
        for n in json.loads(out.stdout)["items"]
        for c in n["status"]["conditions"]
        if c["type"] == "Ready" and c["status"] == "True"
    ]
    return None if ready else "the k3s node is not Ready"


SKIP = _why_skip()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


def wait(ok: Any, what: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(AssertionError, KeyError, ValueError, IndexError):
            value = ok()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout}s")
        time.sleep(0.5)  # polling the cluster's observed state


def bc(name: str) -> dict[str, Any]:
    return json.loads(kubectl("-n", NS, "get", "bc", name, "-o", "json"))  # type: ignore[no-any-return]


def running(name: str, replicas: int) -> dict[str, Any]:
    def ok() -> dict[str, Any] | None:
        status = bc(name).get("status") or {}
        in_sync = status.get("phase") == "Running" and len(status.get("isr") or []) == replicas
        return status if in_sync and status.get("readyMembers") == replicas else None

    return wait(ok, f"{name} running with {replicas} members in sync", 600)  # type: ignore[no-any-return]


# -- the cluster's parts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> None:
    """tandem:dev built without a registry, and imported into k3s's containerd."""
    sh(str(ROOT / "deploy" / "build-image.sh"), timeout=1800)
    sh("podman", "tag", "tandem:dev", IMAGE)
    tar = VOLUMES.parent / "tandem-e2e-image.tar"
    tar.unlink(missing_ok=True)
    sh("podman", "save", "--format", "docker-archive", "-o", str(tar), IMAGE, timeout=600)
    sh(
        *("ctr", "--address", CONTAINERD, "-n", "k8s.io", "images", "import"),
        *("--snapshotter", "native", str(tar)),
        timeout=600,
    )
    tar.unlink()


def recycle_volumes(count: int = 6) -> None:
    """hostPath PersistentVolumes with no class (k3s here has no provisioner); a Released
    one (its claim deleted) is wiped and made Available again, as a fresh disk."""
    found = json.loads(kubectl("get", "pv", "-o", "json"))["items"]
    have = {pv["metadata"]["name"]: pv for pv in found}
    for i in range(count):
        name = f"tandem-e2e-{i}"
        path = VOLUMES / name
        pv = have.get(name)
        if pv is not None and pv["status"].get("phase") == "Released":
            shutil.rmtree(path, ignore_errors=True)
            unbind = '[{"op": "remove", "path": "/spec/claimRef"}]'
            kubectl("patch", "pv", name, "--type", "json", "-p", unbind)
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, RUN_AS, RUN_AS)
        if pv is None:
            kubectl("apply", "-f", "-", input=json.dumps(_volume(name, path)))


def _volume(name: str, path: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "5Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
        },
    }


@pytest.fixture(scope="module")
def operator(image: None) -> Iterator[None]:
    """The CRD (without its CEL rules: v1.21) and the chart, as docs/kubernetes.md installs
    them, the image named as k3s's containerd holds it."""
    kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))
    kubectl("create", "namespace", "tandem-system", check=False)  # helm's --create-namespace
    values = {"image": {"repository": "docker.io/library/tandem", "tag": "dev"}}
    objects = chart_objects(values)
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    # The tag stays tandem:dev: an operator already running from an earlier build restarts.
    kubectl("-n", "tandem-system", "rollout", "restart", "deployment/tandem-operator")
    kubectl(
        *("-n", "tandem-system", "rollout", "status", "deployment/tandem-operator"),
        "--timeout=300s",
        timeout=320,
    )
    kubectl("create", "namespace", NS, check=False)
    recycle_volumes()
    yield
    kubectl("delete", "namespace", NS, "--wait=true", timeout=300, check=False)


@contextlib.contextmanager
def cluster(name: str, replicas: int = 3, **spec: Any) -> Iterator[dict[str, Any]]:
    """A BrokerCluster running with its members in sync (its status); deleted after, with
    its claims (retention Delete), so that the next one finds free volumes."""
    make(name, replicas, **spec)
    try:
        yield running(name, replicas)
    finally:
        drop(name)


def drop(name: str) -> None:
    kubectl("-n", NS, "delete", "bc", name, "--wait=true", timeout=300)
    selector = f"app.kubernetes.io/instance={name}"
    wait(
        lambda: (
            not json.loads(kubectl("-n", NS, "get", "pvc", "-l", selector, "-o", "json"))["items"]
        ),
        f"the claims of {name} gone",
    )


def make(name: str, replicas: int = 3, **spec: Any) -> None:
    recycle_volumes()
    body = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "BrokerCluster",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "image": IMAGE,
            # Two cores hold three brokers, the operator and k3s itself.
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            "storage": {"size": "1Gi", "retention": "Delete"},
            "failover": {"pollSeconds": 0.4, "delaySeconds": 2.0},
            **spec,
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(body))


# -- a confirmed publisher and a watch on the Service ------------------------------------


class Load:
    """A publisher with confirms through the client Service (its ClusterIP: this host
    reaches it), reconnecting after a failover; and a watch that records the most pods the
    Service ever selected at once."""

    def __init__(self, name: str, first: int = 0) -> None:
        self.name, self.first = name, first  # the number the first message carries
        secret = json.loads(
            kubectl("-n", NS, "get", "secret", f"{name}-default-user", "-o", "json")
        )
        user = base64.b64decode(secret["data"]["username"]).decode()
        password = base64.b64decode(secret["data"]["password"]).decode()
        ip = kubectl("-n", NS, "get", "svc", name, "-o", "jsonpath={.spec.clusterIP}")
        self.params = pika.ConnectionParameters(
            ip, 5672, "/", pika.PlainCredentials(user, password), heartbeat=10
        )
        self.queue = f"e2e-{name}"
        self.confirmed: list[int] = []
        self.longest_gap = 0.0
        self.most_endpoints = 0
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        wait(lambda: len(self.confirmed) > 100, "the publisher under way", 120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        """Stop publishing; once this returns, `confirmed` no longer grows."""
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _publish(self) -> None:
        n, last = self.first, time.monotonic()
        while not self.stop.is_set():
            try:
                conn = pika.BlockingConnection(self.params)
                ch = conn.channel()
                ch.confirm_delivery()
                ch.queue_declare(self.queue, durable=True)
                while not self.stop.is_set():
                    ch.basic_publish(
                        "", self.queue, str(n).encode(), pika.BasicProperties(delivery_mode=2)
                    )
                    now = time.monotonic()
                    self.longest_gap = max(self.longest_gap, now - last)
                    self.confirmed.append(n)
                    n, last = n + 1, now
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                n += 1  # that one may or may not have been taken: never counted as confirmed
                time.sleep(0.2)  # the client's reconnect delay

    def _watch(self) -> None:
        while not self.stop.is_set():
            out = subprocess.run(
                ["kubectl", "-n", NS, "get", "endpoints", self.name, "-o", "json"],
                capture_output=True,
                text=True,
                env=env(),
                timeout=30,
            )
            if out.returncode == 0:
                subsets = json.loads(out.stdout).get("subsets") or []
                ready = sum(len(s.get("addresses") or []) for s in subsets)
                self.most_endpoints = max(self.most_endpoints, ready)
            time.sleep(0.2)  # polling the Service's endpoints

    def more(self, count: int = 100) -> None:
        """Wait until `count` more publishes are confirmed (on whichever primary serves)."""
        before = len(self.confirmed)
        wait(lambda: len(self.confirmed) >= before + count, f"{count} more confirms", 120)

    def check(self, operation: str) -> None:
        """Every confirmed message is in the queue: drained, and put back for the next."""
        received: set[int] = set()
        deadline = time.monotonic() + 120
        while True:
            try:
                conn = pika.BlockingConnection(self.params)
                ch = conn.channel()
                while True:
                    method, _props, body = ch.basic_get(self.queue, auto_ack=True)
                    if method is None:
                        break
                    received.add(int(body))
                conn.close()
                break
            except (pika.exceptions.AMQPError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        lost = sorted(set(self.confirmed) - received)
        print(
            f"\n{operation}: {len(self.confirmed)} confirmed, {len(lost)} lost, longest "
            f"confirm gap {self.longest_gap:.2f}s, most Service endpoints {self.most_endpoints}"
        )
        assert not lost, f"{operation}: {len(lost)} confirmed messages lost: {lost[:20]}"
        assert self.most_endpoints <= 1, f"{operation}: the Service selected two pods"


# -- the operations ----------------------------------------------------------------------


@pytest.mark.timeout(1800)
def test_the_primary_pod_deleted_under_load_loses_nothing(operator: None) -> None:
    with cluster("orders") as status, Load("orders") as load:
        kubectl("-n", NS, "delete", "pod", status["primary"], "--wait=false")
        wait(lambda: bc("orders")["status"]["epoch"] > status["epoch"], "a failover", 120)
        running("orders", 3)
        load.more()  # confirms on the new primary
        load.finish()
        load.check("delete the primary pod")


@pytest.mark.timeout(3600)
def test_scaling_3_5_3_1_3_under_load_loses_nothing(operator: None) -> None:
    with cluster("scaled") as status:
        for replicas in (5, 3, 1, 3):
            with Load("scaled") as load:
                patch = json.dumps({"spec": {"replicas": replicas}})
                kubectl("-n", NS, "patch", "bc", "scaled", "--type", "merge", "-p", patch)
                status = running("scaled", replicas)
                load.more()
                load.finish()
                load.check(f"scale to {replicas}")
        assert status["isr"] == ["scaled-0", "scaled-1", "scaled-2"]


def node_name() -> str:
    return kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}")


def drain(pod: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`kubectl drain` of the node's one pod `pod`: an eviction, which the PodDisruptionBudget
    allows or refuses. The node stays cordoned until `uncordon`."""
    selector = f"statefulset.kubernetes.io/pod-name={pod}"
    return subprocess.run(
        [
            *("kubectl", "drain", node_name(), "--pod-selector", selector),
            *("--ignore-daemonsets", "--delete-emptydir-data", f"--timeout={timeout}s"),
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout + 60,
    )


def edit(name: str, patch: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`kubectl patch` of a BrokerCluster's spec, by merge; the caller reads the outcome."""
    cmd = ["kubectl", "-n", NS, "patch", "bc", name, "--type", "merge", "-p", json.dumps(patch)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=60)


def settle(load: Load, name: str, operation: str) -> dict[str, Any]:
    """After an operation: the cluster running in sync, confirms again, then the check."""
    status = running(name, 3)
    load.more()
    load.finish()
    load.check(operation)
    return status


def logs_in(params: pika.ConnectionParameters) -> bool:
    try:
        pika.BlockingConnection(params).close()
    except pika.exceptions.AMQPError:
        return False
    return True


def lease_seconds(seconds: float) -> str:
    return json.dumps({"spec": {"failover": {"leaseSeconds": seconds}}})


@pytest.mark.timeout(3600)
def test_day_two_operations_under_load_lose_nothing(operator: None) -> None:
    """One cluster through the operations a user performs on it, each under a confirmed
    publisher, each checked (nothing confirmed lost, never two pods behind the Service)."""
    name = "day2"
    with cluster(name) as status:
        # A broker setting edited: the pods roll, backups first, the primary after a
        # switchover, so that no pod stops while it serves.
        with Load(name) as load:
            kubectl("-n", NS, "patch", "bc", name, "--type", "merge", "-p", lease_seconds(12))

            def rolled() -> bool:
                sts = json.loads(kubectl("-n", NS, "get", "sts", name, "-o", "json"))["status"]
                pods = json.loads(
                    kubectl(
                        "-n",
                        NS,
                        "get",
                        "pods",
                        "-l",
                        f"app.kubernetes.io/instance={name}",
                        "-o",
                        "json",
                    )
                )["items"]
                want = sts.get("updateRevision")
                return len(pods) == 3 and all(
                    p["metadata"]["labels"].get("controller-revision-hash") == want for p in pods
                )

            wait(rolled, "every pod on the new revision", 900)
            status = settle(load, name, "edit a broker setting: rolling restart")
        events = kubectl("-n", NS, "get", "events", "--field-selector", "reason=RollingUpgrade")
        assert events.count("restarting backup") == 3, events

        # The node drained of the cluster's pods one at a time, through the budget: while one
        # is down, the next eviction is refused.
        with Load(name) as load:
            for i in range(3):
                pod = f"{name}-{i}"
                try:
                    done = drain(pod, 300)
                    assert done.returncode == 0, done.stderr[-2000:]
                    if i == 0:
                        refused = drain(f"{name}-1", 15)
                        assert refused.returncode != 0
                        assert "disruption budget" in refused.stderr, refused.stderr[-2000:]
                finally:
                    kubectl("uncordon", node_name())
                running(name, 3)
                load.more()
            load.finish()
            load.check("drain the node's pods one by one")

        # Paused: the primary's pod deleted, and no failover until the pause ends.
        with Load(name) as load:
            status = running(name, 3)
            kubectl("-n", NS, "annotate", "bc", name, "tandem.dev/paused=true", "--overwrite")
            wait(lambda: bc(name)["status"]["phase"] == "Paused", "the Paused phase", 60)
            kubectl("-n", NS, "delete", "pod", status["primary"], "--wait=false")
            wait(lambda: bc(name)["status"].get("primary") is None, "no primary", 120)
            assert bc(name)["status"]["epoch"] == status["epoch"]  # nobody failed over
            kubectl("-n", NS, "annotate", "bc", name, "tandem.dev/paused-")
            wait(lambda: bc(name)["status"]["epoch"] > status["epoch"], "a failover", 180)
            status = settle(load, name, "paused, primary deleted, resumed")

        # The operator restarted in the middle of a failover.
        with Load(name) as load:
            kubectl("-n", NS, "delete", "pod", status["primary"], "--wait=false")
            kubectl(
                "-n",
                "tandem-system",
                "delete",
                "pod",
                "-l",
                "app.kubernetes.io/name=tandem-operator",
                "--wait=false",
            )
            wait(lambda: bc(name)["status"]["epoch"] > status["epoch"], "a failover", 300)
            status = settle(load, name, "operator restarted mid-failover")

        # The operator down for a minute while the primary dies: no failover meanwhile, and
        # the one that follows loses nothing.
        with Load(name) as load:
            scale = ("-n", "tandem-system", "scale", "deployment/tandem-operator")
            kubectl(*scale, "--replicas=0")
            wait(
                lambda: (
                    not json.loads(
                        kubectl(
                            "-n",
                            "tandem-system",
                            "get",
                            "pods",
                            "-l",
                            "app.kubernetes.io/name=tandem-operator",
                            "-o",
                            "json",
                        )
                    )["items"]
                ),
                "the operator gone",
                120,
            )
            kubectl("-n", NS, "delete", "pod", status["primary"], "--grace-period=0", "--force")
            time.sleep(60)  # the outage itself, not a synchronisation
            assert bc(name)["status"]["epoch"] == status["epoch"]
            kubectl(*scale, "--replicas=1")
            wait(lambda: bc(name)["status"]["epoch"] > status["epoch"], "a failover", 300)
            status = settle(load, name, "operator down a minute while the primary died")

        # Invalid edits: refused at the API (replicas -1: the schema) or by the operator
        # (isrMin above replicas: a CEL rule, which k3s v1.21 does not run), the cluster left
        # as it was.
        out = edit(name, {"spec": {"replicas": -1}})
        assert out.returncode != 0 and "replicas" in out.stderr, out.stderr
        assert edit(name, {"spec": {"replication": {"isrMin": 5}}}).returncode == 0
        wait(
            lambda: (
                "isrMin"
                in kubectl("-n", NS, "get", "events", "--field-selector", "reason=InvalidSpec")
            ),
            "the operator's refusal",
            120,
        )
        sts = json.loads(kubectl("-n", NS, "get", "sts", name, "-o", "json"))
        assert sts["spec"]["replicas"] == 3
        kubectl(
            "-n",
            NS,
            "patch",
            "bc",
            name,
            "--type",
            "json",
            "-p",
            '[{"op":"remove","path":"/spec/replication/isrMin"}]',
        )
        with Load(name) as load:
            status = settle(load, name, "invalid edits refused")

        # Secrets: a user's password rotated through its Secret, the Secrets deleted.
        with Load(name) as load:
            patch = json.dumps({"stringData": {"password": "rotated-e2e"}})
            kubectl("-n", NS, "patch", "secret", f"{name}-default-user", "-p", patch)
            rotated = pika.ConnectionParameters(
                load.params.host, 5672, "/", pika.PlainCredentials("default", "rotated-e2e")
            )
            wait(lambda: logs_in(rotated), "the new password in use", 120)
            key = kubectl(
                "-n", NS, "get", "secret", f"{name}-cluster-key", "-o", "jsonpath={.data.key}"
            )
            kubectl("-n", NS, "delete", "secret", f"{name}-cluster-key", f"{name}-default-user")
            wait(
                lambda: (
                    kubectl(
                        "-n",
                        NS,
                        "get",
                        "secret",
                        f"{name}-cluster-key",
                        "-o",
                        "jsonpath={.data.key}",
                    )
                    == key
                ),
                "the same cluster key back",
                120,
            )
            wait(
                lambda: (
                    base64.b64decode(
                        kubectl(
                            "-n",
                            NS,
                            "get",
                            "secret",
                            f"{name}-default-user",
                            "-o",
                            "jsonpath={.data.password}",
                        )
                    ).decode()
                    == "rotated-e2e"
                ),
                "the default user's Secret back with the password in use",
                120,
            )
            load.params = rotated  # a reconnect uses the new password
            load.more()
            load.finish()
            load.check("rotate a password, delete the Secrets")


@pytest.mark.timeout(2400)
def test_a_cluster_deleted_with_its_claims_and_made_again_serves(operator: None) -> None:
    make("again")
    running("again", 3)
    drop("again")  # the claims go, and with them the Lease
    with cluster("again"), Load("again") as load:
        load.more()  # confirms on the new incarnation
        load.finish()
        load.check("delete and make again, claims deleted")


@pytest.mark.timeout(2400)
def test_a_cluster_deleted_with_its_claims_kept_and_made_again_resumes_on_its_data(
    operator: None,
) -> None:
    """Retention Retain: the claims, the Lease and the cluster key stay; the BrokerCluster
    made again resumes on that data, with every confirmed message still queued."""
    name = "kept"
    make(name, storage={"size": "1Gi", "retention": "Retain"})
    running(name, 3)
    with Load(name) as load:
        load.more()
        load.finish()
    kubectl("-n", NS, "delete", "bc", name, "--wait=true", timeout=300)
    selector = f"app.kubernetes.io/instance={name}"
    claims = json.loads(kubectl("-n", NS, "get", "pvc", "-l", selector, "-o", "json"))["items"]
    assert len(claims) == 3, "the claims were not kept"
    try:
        make(name, storage={"size": "1Gi", "retention": "Delete"})
        running(name, 3)
        # The Service is new (its address), the user the same; the second life publishes
        # on, numbered after the first.
        with Load(name, first=max(load.confirmed) + 1) as again:
            assert again.params.credentials.password == load.params.credentials.password
            again.more()
            again.finish()
        again.confirmed = load.confirmed + again.confirmed  # both lives' messages
        again.check("delete and make again, claims kept")
    finally:
        drop(name)


@pytest.mark.timeout(2400)
def test_spec_edits_take_effect_live_and_a_key_edit_is_refused(operator: None) -> None:
    """Failover settings and the ISR minimum reach the running cluster without a restart (the
    minimum through the Lease, which the brokers read); a storage edit and an edit of the
    cluster key are refused with a reason, and publishing goes on through all of it."""
    name = "edits"
    with cluster(name) as status, Load(name) as load:
        selector = f"app.kubernetes.io/instance={name}"
        uids = "jsonpath={.items[*].metadata.uid}"
        pods = kubectl("-n", NS, "get", "pods", "-l", selector, "-o", uids)
        edit = {"spec": {"replication": {"isrMin": 3}, "failover": {"delaySeconds": 3.0}}}
        kubectl("-n", NS, "patch", "bc", name, "--type", "merge", "-p", json.dumps(edit))

        def isr_min() -> str:
            return kubectl(
                *("-n", NS, "get", "lease", name),
                "-o",
                "jsonpath={.metadata.annotations.tandem\\.dev/isr-min}",
            )

        wait(lambda: isr_min() == "3", "the ISR minimum 3 in the Lease", 120)
        load.more()  # confirmed with the new minimum, on the same pods
        storage = {"spec": {"storage": {"size": "2Gi"}}}
        kubectl("-n", NS, "patch", "bc", name, "--type", "merge", "-p", json.dumps(storage))

        def spec_applied() -> str:
            conditions = bc(name)["status"]["conditions"]
            return next(c["reason"] for c in conditions if c["type"] == "SpecApplied")

        wait(lambda: spec_applied() == "StorageChangeRefused", "the storage edit refused", 120)
        secret = f"{name}-cluster-key"
        key = kubectl("-n", NS, "get", "secret", secret, "-o", "jsonpath={.data.key}")
        bad = json.dumps({"stringData": {"key": "y" * 32}})
        kubectl("-n", NS, "patch", "secret", secret, "-p", bad)
        wait(
            lambda: kubectl("-n", NS, "get", "secret", secret, "-o", "jsonpath={.data.key}") == key,
            "the cluster key put back",
            120,
        )
        load.more()
        assert bc(name)["status"]["epoch"] == status["epoch"]  # no failover, no restart
        assert kubectl("-n", NS, "get", "pods", "-l", selector, "-o", uids) == pods
        load.finish()
        load.check("edit isrMin and the failover delay live; storage and key edits refused")
