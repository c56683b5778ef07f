"""The real operator (`tandem operator run`, kopf) against kmock's Kubernetes emulator.

kmock stands in for the API server: it stores objects, serves lists and watch streams, and
runs no controllers. So this test plays the kubelet: for each member pod of the StatefulSet
the operator created it starts a real `tandem broker` (with the operator's ConfigMap and
cluster-key Secret) and posts the Pod, running, with the broker's address. The operator then
elects, labels, fails over and reports through the API as it would in a cluster.

The emulator is kmock's with the API server's resourceVersions (tests/operator/emulator.py):
kopf 1.44+ patches with a JSON-patch test of the resourceVersion, and the operator's Lease
compare-and-set carries the version it read.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pika
import pytest
import pytest_asyncio
import yaml

from tandem.operator import builders
from tandem.operator.spec import BrokerClusterSpec, BrokerClusterStatus
from tests.operator.emulator import Emulator
from tests.support import BUG_PHRASE, Broker, chart_objects

pytestmark = pytest.mark.kmock(cls=Emulator)

NS = "test"
BC_PATH = f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/brokerclusters"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
ROLE = builders.ROLE_LABEL

RESOURCES = {
    "tandem.dev/v1alpha1/brokerclusters": ("BrokerCluster", {"status"}),
    "v1/pods": ("Pod", set()),
    "v1/secrets": ("Secret", set()),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/services": ("Service", set()),
    "v1/events": ("Event", set()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", set()),
    "apps/v1/statefulsets": ("StatefulSet", set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", set()),
    "coordination.k8s.io/v1/leases": ("Lease", set()),
}
CLUSTER_RESOURCES = {  # kopf's discovery waits for these before it watches anything
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
POD_LOCAL = {
    "host",
    "admin_host",
    "replication_host",
    "amqp_port",
    "admin_port",
    "replication_port",
    "data_dir",
    "cluster_key_file",
    "definitions",
}
KUBELET = "tandem.dev/test-kubelet"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class Api:
    """The test's own client of the emulator: JSON calls and watch streams."""

    def __init__(self, emulator: kmock.KubernetesEmulator) -> None:
        self.emulator = emulator

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.emulator.request(method, path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def get(self, path: str) -> Any:
        status, body = await self.call("GET", path)
        return body if status == 200 else None

    async def until(
        self, path: str, ok: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30
    ) -> dict[str, Any]:
        """The first object (listed, then watched) at `path` for which `ok` holds."""

        async def watch() -> dict[str, Any]:
            async with self.emulator.request("GET", f"{path}?watch=true") as resp:
                async for line in resp.content:
                    if line.strip():
                        event = json.loads(line)
                        if event.get("type") != "DELETED" and ok(event["object"]):
                            return event["object"]  # type: ignore[no-any-return]
            raise AssertionError(f"the watch of {path} ended")

        try:
            return await asyncio.wait_for(watch(), timeout)
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout} s") from None


class Labels:
    """Every pod event from the start, and which pods carried the role label when."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.labelled: set[str] = set()
        self.most_at_once = 0
        self.onto: list[tuple[float, str]] = []  # (monotonic time, pod) the label reached
        self.task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        async with self.api.emulator.request("GET", f"{PODS_PATH}?watch=true") as resp:
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event["object"]
                name = obj["metadata"]["name"]
                has = (obj["metadata"].get("labels") or {}).get(ROLE) == "primary"
                if has and event["type"] != "DELETED":
                    if name not in self.labelled:
                        self.onto.append((time.monotonic(), name))
                    self.labelled.add(name)
                else:
                    self.labelled.discard(name)
                self.most_at_once = max(self.most_at_once, len(self.labelled))

    def start(self) -> None:
        self.task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


class Kubelet:
    """Runs each member pod the StatefulSet asks for as a real broker, and posts the Pod."""

    def __init__(self, api: Api, tmp: Path, name: str) -> None:
        self.api, self.tmp, self.name = api, tmp, name
        self.brokers: dict[str, Broker] = {}
        # (pod, its role when its deletion began, its role when the broker was stopped)
        self.restarted: list[tuple[str, str, str]] = []
        self.restart = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def secret(self, name: str, key: str) -> str:
        found = await self.api.get(f"/api/v1/namespaces/{NS}/secrets/{name}")
        assert found, f"no Secret {name}"
        if key in found.get("stringData", {}):  # kmock keeps what was sent
            return str(found["stringData"][key])
        return base64.b64decode(found["data"][key]).decode()

    async def settings(self) -> tuple[dict[str, Any], str, dict[str, Any]]:
        cm = await self.api.get(f"/api/v1/namespaces/{NS}/configmaps/{self.name}-config")
        sts = await self.api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{self.name}")
        assert cm and sts, "the operator has not created the members' objects"
        key = await self.secret(f"{self.name}-cluster-key", "key")
        return yaml.safe_load(cm["data"]["tandem.yaml"]), key, sts

    async def run_pod(self, index: int) -> Broker:
        settings, key, sts = await self.settings()
        node = f"{self.name}-{index}"
        key_file = self.tmp / "cluster.key"
        key_file.write_text(key)
        # The pod's settings, but this machine's addresses, ports and paths.
        config = {k: v for k, v in settings.items() if k not in POD_LOCAL}
        config.update(cluster_key_file=str(key_file), replication_port=0)
        # The mounted users Secret, as the pod would see it.
        volumes = sts["spec"]["template"]["spec"]["volumes"]
        (users,) = [v["secret"]["secretName"] for v in volumes if v["name"] == "users"]
        users_file = self.tmp / "definitions.json"
        users_file.write_text(await self.secret(users, "definitions.json"))
        config["definitions"] = str(users_file)
        broker = self.brokers.get(node) or Broker(self.tmp / node, config, node_id=node)
        self.brokers[node] = broker
        # A new pod is a new address (its IP, in a cluster): here, new ports. The last
        # pod's ports, taken again, were once taken meanwhile by another socket, and the
        # member never came back.
        broker.amqp_port = broker.admin_port = 0
        await asyncio.to_thread(broker.start)
        template = sts["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": node,
                "namespace": NS,
                "uid": f"{node}-{broker.starts}",
                "labels": {
                    **template["metadata"]["labels"],
                    "controller-revision-hash": sts.get("status", {}).get("updateRevision", "r1"),
                },
                # Held until this kubelet has run the preStop and stopped the broker.
                "finalizers": [KUBELET],
            },
            "spec": {
                "containers": [
                    {
                        "name": "tandem",
                        "ports": [
                            {"name": "amqp", "containerPort": broker.amqp_port},
                            {"name": "admin", "containerPort": broker.admin_port},
                            {"name": "replication", "containerPort": broker.replication_port},
                        ],
                    }
                ]
            },
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "containerStatuses": [{"name": "tandem", "state": {"running": {}}}],
            },
        }
        status, body = await self.api.call("POST", PODS_PATH, pod)
        assert status in (200, 201), body
        return broker

    async def lose_pod(self, node: str) -> float:
        """The member's process dies, the kubelet lets the pod go and it is deleted (a lost
        node, a force delete); returns when the API took the deletion."""
        broker = self.brokers[node]
        if broker.proc is not None:
            await asyncio.to_thread(broker.kill)
        status, body = await self.api.call(
            "PATCH", f"{PODS_PATH}/{node}", {"metadata": {"finalizers": []}}
        )
        assert status == 200, body
        status, body = await self.api.call("DELETE", f"{PODS_PATH}/{node}")
        assert status == 200, body
        return time.monotonic()

    def run_pods(self) -> None:
        """From now on, act on deletions as the kubelet and the StatefulSet controller do:
        run the preStop hook, stop the broker, let the pod go, and create it again."""
        self.task = asyncio.create_task(self._controller())

    async def _controller(self) -> None:
        async with self.api.emulator.request("GET", f"{PODS_PATH}?watch=true") as resp:
            async for line in resp.content:
                if not line.strip():
                    continue
                obj = json.loads(line)["object"]
                meta = obj["metadata"]
                if meta.get("deletionTimestamp") and KUBELET in (meta.get("finalizers") or []):
                    await self._terminate(meta["name"])

    async def prestop(self, node: str) -> tuple[int, bytes]:
        """Run the preStop hook the StatefulSet names, for this machine's broker of `node`;
        its exit code and output."""
        sts = await self.api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{self.name}")
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["tandem", "handover"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tandem.cli",
            *hook[1:],
            "--admin-port",  # this machine's port instead of the pod's
            str(self.brokers[node].admin_port),
            "--key-file",
            str(self.tmp / "cluster.key"),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 40)
        assert proc.returncode is not None
        return proc.returncode, out

    async def _terminate(self, node: str) -> None:
        broker = self.brokers[node]
        role_before = (await asyncio.to_thread(broker.status))["role"]
        await self.prestop(node)
        role = (await asyncio.to_thread(broker.status))["role"]
        await asyncio.to_thread(broker.stop)
        status, body = await self.api.call(
            "PATCH", f"{PODS_PATH}/{node}", {"metadata": {"finalizers": []}}
        )
        assert status == 200, body
        await self.run_pod(int(node.rsplit("-", 1)[1]))
        self.restarted.append((node, role_before, role))
        self.restart.set()

    async def restarts(self, count: int, timeout: float = 120) -> None:
        async def enough() -> None:
            while len(self.restarted) < count:
                await self.restart.wait()
                self.restart.clear()

        await asyncio.wait_for(enough(), timeout)

    def stop(self) -> str:
        if self.task is not None:
            self.task.cancel()
        logs = ""
        for b in self.brokers.values():
            if b.proc is not None:
                b.stop()
            logs += b.log()
        return logs


class Operator:
    def __init__(self, tmp: Path, url: str) -> None:
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                    "users": [{"name": "test", "user": {"token": "test"}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}
                    ],
                    "current-context": "kmock",
                }
            )
        )
        self.log_path = tmp / "operator.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tandem.cli",
            "operator",
            "run",
            "--all-namespaces",  # as deploy/operator.yaml runs it
            env=env,
            stdout=log,
            stderr=log,
        )

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        self.proc = None

    async def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
            self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def brokercluster(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "BrokerCluster",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {"replicas": 3, "failover": {"pollSeconds": 0.1}, **spec},
    }


@pytest_asyncio.fixture
async def world(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> AsyncIterator[tuple[Api, Operator, Labels]]:
    for resource, (kind, subresources) in RESOURCES.items():
        kmock.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=VERBS, subresources=subresources
        )
    for resource, kind in CLUSTER_RESOURCES.items():
        kmock.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=False, verbs=VERBS)
    api = Api(kmock)
    labels = Labels(api)
    labels.start()
    operator = Operator(tmp_path, str(kmock.url).rstrip("/"))
    await operator.start()
    yield api, operator, labels
    labels.stop()
    await operator.stop()
    assert BUG_PHRASE not in operator.log(), operator.log()
    # Everything the operator asked of the API, its ClusterRole allows (least privilege
    # that is still enough: a missing verb would fail in a real cluster, not here).
    (role,) = [o for o in chart_objects() if o["kind"] == "ClusterRole"]
    denied = {
        f"{verb} {plural} ({group or 'core'})"
        for request in kmock
        if request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS)
        and request.resource is not None
        and request.resource.plural
        for verb, group, plural in [_verb_of(request)]
        if not _allowed(role["rules"], verb, group, plural)
    }
    assert not denied, f"the operator's ClusterRole lacks {sorted(denied)}"


OPERATOR_AGENTS = ("kopf/", "OpenAPI-Generator/")  # kopf's and the kubernetes client's


def _verb_of(request: kmock.Request) -> tuple[str, str, str]:
    assert request.resource is not None
    action = request.action.value.lower() if request.action is not None else ""
    verb = {"fetch": "get", "update": "patch" if request.method.value == "PATCH" else "update"}
    plural = request.resource.plural or ""
    if request.subresource:
        plural = f"{plural}/{request.subresource}"
    return verb.get(action, action), request.resource.group or "", plural


def _allowed(rules: list[dict[str, Any]], verb: str, group: str, plural: str) -> bool:
    return any(
        group in rule["apiGroups"] and plural in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


@pytest_asyncio.fixture
async def demo(
    world: tuple[Api, Operator, Labels], tmp_path: Path
) -> AsyncIterator[tuple[Api, Operator, Labels, Kubelet]]:
    """The BrokerCluster `demo`, running: three real brokers as its pods."""
    api, operator, labels = world
    kubelet = await up(api, tmp_path, "demo")
    yield api, operator, labels, kubelet
    assert BUG_PHRASE not in kubelet.stop()


async def up(api: Api, tmp: Path, name: str, **spec: Any) -> Kubelet:
    status, body = await api.call("POST", BC_PATH, brokercluster(name, **spec))
    assert status in (200, 201), body
    await api.until(f"/apis/apps/v1/namespaces/{NS}/statefulsets", lambda o: True, "StatefulSet")
    kubelet = Kubelet(api, tmp, name)
    for i in range(3):
        await kubelet.run_pod(i)
    await api.until(
        BC_PATH,
        lambda o: (o.get("status") or {}).get("phase") == "Running",
        "BrokerCluster Running",
    )
    return kubelet


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_operator_creates_the_cluster_and_fails_over(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    api, _, labels, kubelet = demo
    # Every object the builders describe is there, owned by the BrokerCluster.
    for path in (
        f"/api/v1/namespaces/{NS}/services/demo",
        f"/api/v1/namespaces/{NS}/services/demo-members",
        f"/api/v1/namespaces/{NS}/configmaps/demo-config",
        f"/api/v1/namespaces/{NS}/secrets/demo-cluster-key",
        f"/apis/apps/v1/namespaces/{NS}/statefulsets/demo",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/demo",
        f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/demo",
        f"{LEASE_PATH}/demo",
    ):
        obj = await api.get(path)
        assert obj is not None, f"{path} was not created"
        if "leases" not in path:
            owners = obj["metadata"].get("ownerReferences") or []
            assert [o["name"] for o in owners] == ["demo"], path
    bc = await api.get(f"{BC_PATH}/demo")
    lease = await api.get(f"{LEASE_PATH}/demo")
    primary, epoch = bc["status"]["primary"], bc["status"]["epoch"]
    assert lease["spec"]["holderIdentity"] == primary
    assert int(lease["spec"]["leaseTransitions"]) == epoch
    assert sorted(bc["status"]["isr"]) == ["demo-0", "demo-1", "demo-2"]
    assert bc["status"]["readyMembers"] == 3
    conditions = {c["type"]: c for c in bc["status"]["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["FullyReplicated"]["status"] == "True"
    BrokerClusterStatus.model_validate(bc["status"])  # what the CRD's schema describes
    assert labels.labelled == {primary}
    # The generated user works through the primary (where the Service would send it).
    url = await kubelet.secret("demo-default-user", "url")
    assert url.startswith("amqp://default:") and "@demo.test.svc:5672/" in url
    port = kubelet.brokers[primary].amqp_port
    params = pika.URLParameters(url.replace("demo.test.svc:5672", f"127.0.0.1:{port}"))
    conn = await asyncio.to_thread(pika.BlockingConnection, params)
    await asyncio.to_thread(conn.close)

    # The primary's pod goes: the label moves to another member within half a second.
    moves = len(labels.onto)
    deleted_at = await kubelet.lose_pod(primary)
    bc = await api.until(
        BC_PATH,
        lambda o: (
            (o.get("status") or {}).get("epoch") == epoch + 1
            and (o["status"].get("lastFailover") or {}).get("to") not in (None, primary)
        ),
        "a failover in the status",
    )
    new = bc["status"]["primary"]
    assert new != primary and new in ("demo-0", "demo-1", "demo-2")
    labelled_at, onto = next(m for m in labels.onto[moves:])
    assert onto == new
    took = labelled_at - deleted_at
    print(f"role label moved {primary} -> {new} {took * 1000:.0f} ms after the deletion")
    assert took < 0.5, f"the label moved {took:.3f} s after the primary pod's deletion"
    assert labels.most_at_once == 1, "two pods carried the role label at once"
    failover = bc["status"]["lastFailover"]
    assert failover["from"] == primary and "down" in failover["reason"]
    lease = await api.get(f"{LEASE_PATH}/demo")
    assert lease["spec"]["holderIdentity"] == new
    assert int(lease["spec"]["leaseTransitions"]) == epoch + 1
    events = (await api.get(f"/api/v1/namespaces/{NS}/events"))["items"]
    said = [e["message"] for e in events if e.get("reason") == "Failover"]
    assert any(new in m and primary in m for m in said), said

    # The member comes back (the StatefulSet recreates the pod) and rejoins the ISR.
    await kubelet.run_pod(int(primary.rsplit("-", 1)[1]))
    await api.until(
        BC_PATH,
        lambda o: len((o.get("status") or {}).get("isr") or []) == 3,
        "the returned member back in the ISR",
    )
    assert labels.labelled == {new}


async def _fence(broker: Broker, key: str, epoch: int) -> None:
    status, body = await asyncio.to_thread(broker.http, "POST", "/ha/fence", {"epoch": epoch}, key)
    assert status == 200, body


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_an_operator_restarted_mid_failover_completes_it(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    api, operator, labels, kubelet = demo
    bc = await api.get(f"{BC_PATH}/demo")
    primary, epoch = bc["status"]["primary"], bc["status"]["epoch"]
    # The operator dies after the first step of a failover: it fenced the backups at the
    # next epoch (done here as it would have), then the primary's pod went.
    await operator.kill()
    _, key, _ = await kubelet.settings()
    backups = [n for n in kubelet.brokers if n != primary]
    for node in backups:
        await _fence(kubelet.brokers[node], key, epoch + 1)
    await kubelet.lose_pod(primary)
    await operator.start()
    bc = await api.until(
        BC_PATH,
        lambda o: (
            (o.get("status") or {}).get("primary") in backups
            and o["status"].get("epoch") == epoch + 1
        ),
        "the failover completed by the restarted operator",
    )
    lease = await api.get(f"{LEASE_PATH}/demo")
    assert lease["spec"]["holderIdentity"] == bc["status"]["primary"]
    assert int(lease["spec"]["leaseTransitions"]) == epoch + 1
    await api.until(
        PODS_PATH,
        lambda o: (
            o["metadata"]["name"] == bc["status"]["primary"]
            and (o["metadata"].get("labels") or {}).get(ROLE) == "primary"
        ),
        "the role label on the new primary",
    )
    assert labels.most_at_once == 1


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_paused_cluster_is_not_failed_over_until_resumed(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    api, _, labels, kubelet = demo
    bc = await api.get(f"{BC_PATH}/demo")
    primary, epoch = bc["status"]["primary"], bc["status"]["epoch"]
    pause = {"metadata": {"annotations": {"tandem.dev/paused": "true"}}}
    status, body = await api.call("PATCH", f"{BC_PATH}/demo", pause)
    assert status == 200, body
    await api.until(BC_PATH, lambda o: o["status"]["phase"] == "Paused", "phase Paused")
    await kubelet.lose_pod(primary)
    # The loop saw the primary go (no primary in the status) and did not fail over.
    await api.until(
        BC_PATH,
        lambda o: o["status"]["phase"] == "Paused" and o["status"].get("primary") is None,
        "the loss seen while paused",
    )
    lease = await api.get(f"{LEASE_PATH}/demo")
    assert lease["spec"]["holderIdentity"] == primary
    assert int(lease["spec"]["leaseTransitions"]) == epoch
    assert labels.labelled == set()  # the label left the lost pod; no one has it
    resume = {"metadata": {"annotations": {"tandem.dev/paused": None}}}
    status, body = await api.call("PATCH", f"{BC_PATH}/demo", resume)
    assert status == 200, body
    bc = await api.until(
        BC_PATH,
        lambda o: o["status"]["epoch"] == epoch + 1 and o["status"].get("primary") is not None,
        "the failover once resumed",
    )
    assert bc["status"]["primary"] != primary


async def scale(api: Api, replicas: int) -> None:
    """Edit the demo cluster's replicas; returns once the operator scaled its StatefulSet."""
    status, body = await api.call("PATCH", f"{BC_PATH}/demo", {"spec": {"replicas": replicas}})
    assert status == 200, body
    await api.until(
        f"/apis/apps/v1/namespaces/{NS}/statefulsets",
        lambda o: o["spec"]["replicas"] == replicas,
        f"the StatefulSet scaled to {replicas}",
    )


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_scaling_up_adds_a_member_and_down_takes_it_out_of_the_isr_first(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    api, _, _, kubelet = demo
    await scale(api, 4)
    await kubelet.run_pod(3)  # the StatefulSet controller's new pod
    await api.until(
        BC_PATH,
        lambda o: len(o["status"].get("isr") or []) == 4 and o["status"]["readyMembers"] == 4,
        "the new member caught up and in the ISR",
    )
    await scale(api, 2)
    lease = await api.get(f"{LEASE_PATH}/demo")
    isr = set(lease["metadata"]["annotations"]["tandem.dev/isr"].split(","))
    assert not {"demo-2", "demo-3"} & isr and lease["spec"]["holderIdentity"] in isr


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_scaling_to_one_member_leaves_its_publishers_unblocked(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    """Issue 15: scaling 3 to 1 with isrMin unset once left the ISR at the primary alone
    while the brokers kept their minimum of 2: every publisher blocked. The minimum now
    travels in the election record: the controller writes 1, and the primary takes it."""
    api, _, _, kubelet = demo
    await scale(api, 1)
    lease = await api.until(
        LEASE_PATH,
        lambda o: (
            o["metadata"]["annotations"].get("tandem.dev/isr") == o["spec"]["holderIdentity"]
            and o["metadata"]["annotations"].get("tandem.dev/isr-min") == "1"
        ),
        "the ISR at the primary alone, with a minimum of 1",
    )
    primary = kubelet.brokers[lease["spec"]["holderIdentity"]]

    def took_it() -> dict[str, Any]:
        """The primary's status once it applied the record (the record first, then the
        primary: rule 2), or at the deadline."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = primary.status()
            if st["isr"] == [lease["spec"]["holderIdentity"]]:
                return st
            time.sleep(0.05)  # polling the primary's observed state
        return st

    st = await asyncio.to_thread(took_it)
    assert st["isr"] == [lease["spec"]["holderIdentity"]], st
    assert not st["alarms"], st["alarms"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_storage_edit_is_refused_once_with_a_condition_and_the_rest_applies(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    """Issue 15: a change of storage.* was sent to the API server, which refuses changes of
    a StatefulSet's claim templates, at every retry, forever."""
    api = demo[0]
    edit = {"spec": {"storage": {"size": "2Gi"}, "replication": {"default": "configuration"}}}
    status, body = await api.call("PATCH", f"{BC_PATH}/demo", edit)
    assert status == 200, body
    event = await api.until(
        f"/api/v1/namespaces/{NS}/events",
        lambda o: o.get("reason") == "StorageChangeRefused",
        "a StorageChangeRefused event",
    )
    assert "storage.size 1Gi -> 2Gi" in event["message"]
    sts = await api.until(
        f"/apis/apps/v1/namespaces/{NS}/statefulsets",
        lambda o: (
            o["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_CHECKSUM]
            == builders.config_checksum(
                BrokerClusterSpec.model_validate(
                    {"replicas": 3, "replication": {"default": "configuration"}}
                )
            )
        ),
        "the other edit applied to the StatefulSet",
    )
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "1Gi"
    bc = await api.until(
        BC_PATH,
        lambda o: any(
            c["type"] == "SpecApplied" and c["status"] == "False"
            for c in (o.get("status") or {}).get("conditions") or []
        ),
        "the SpecApplied condition False",
    )
    (applied,) = [c for c in bc["status"]["conditions"] if c["type"] == "SpecApplied"]
    assert applied["reason"] == "StorageChangeRefused"


@pytest.mark.asyncio
async def test_an_invalid_spec_creates_nothing_and_says_why(
    world: tuple[Api, Operator, Labels],
) -> None:
    api, _, _ = world
    bad = brokercluster("bad", replicas=2, replication={"isrMin": 3})
    status, body = await api.call("POST", BC_PATH, bad)
    assert status in (200, 201), body
    event = await api.until(
        f"/api/v1/namespaces/{NS}/events",
        lambda o: o.get("reason") == "InvalidSpec",
        "an InvalidSpec event",
    )
    assert "isrMin (3) must not exceed replicas (2)" in event["message"]
    assert event["involvedObject"]["name"] == "bad"
    assert await api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/bad") is None


@pytest.mark.asyncio
async def test_deleting_a_cluster_deletes_its_claims_when_retention_says_so(
    world: tuple[Api, Operator, Labels],
) -> None:
    api, _, _ = world
    for name, retention in (("keep", "Retain"), ("drop", "Delete")):
        status, body = await api.call(
            "POST", BC_PATH, brokercluster(name, storage={"retention": retention})
        )
        assert status in (200, 201), body
        await api.until(
            f"/apis/apps/v1/namespaces/{NS}/statefulsets",
            lambda o, name=name: o["metadata"]["name"] == name,
            f"the StatefulSet of {name}",
        )
        claim = {  # what the StatefulSet controller would have made for the first member
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": f"data-{name}-0",
                "namespace": NS,
                "labels": builders.selector(name),
            },
        }
        status, body = await api.call(
            "POST", f"/api/v1/namespaces/{NS}/persistentvolumeclaims", claim
        )
        assert status in (200, 201), body
        await put_lease(api, name, 4)  # what its failover loop would have written
        await api.until(
            BC_PATH,
            lambda o, name=name: (
                o["metadata"]["name"] == name
                and "tandem.dev/finalizer" in (o["metadata"].get("finalizers") or [])
            ),
            f"the finalizer on {name}",
        )
        if name == "drop":  # a member still in its preStop when the deletion starts
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-0",
                    "namespace": NS,
                    "labels": builders.selector(name),
                },
            }
            status, body = await api.call("POST", PODS_PATH, pod)
            assert status in (200, 201), body
        status, body = await api.call("DELETE", f"{BC_PATH}/{name}")
        assert status == 200, body

    async def gone(path: str) -> None:
        async with api.emulator.request("GET", f"{path}?watch=true") as resp:
            # Watching from now: an object the operator deleted before the watch began sends
            # no DELETED (the test starved of CPU beside others waited 30 s for it).
            if await api.get(path) is None:
                return
            async for line in resp.content:
                if line.strip() and json.loads(line)["type"] == "DELETED":
                    return

    # Issue 15: a cluster made again at once met its old pods still stopping, and the new
    # StatefulSet could not make pods of their names. The operator deletes the members
    # itself and lets the BrokerCluster go only once none is left.
    await asyncio.wait_for(gone(f"/apis/apps/v1/namespaces/{NS}/statefulsets/drop"), 30)
    assert await api.get(f"{BC_PATH}/drop") is not None, "deleted with a member pod left"
    bc_gone = asyncio.create_task(gone(f"{BC_PATH}/drop"))
    status, body = await api.call("DELETE", f"{PODS_PATH}/drop-0")
    assert status == 200, body
    await asyncio.wait_for(bc_gone, 30)
    claims = f"/api/v1/namespaces/{NS}/persistentvolumeclaims"
    assert await api.get(f"{claims}/data-drop-0") is None
    assert await api.get(f"{claims}/data-keep-0") is not None
    # The election record goes with the data it describes, and stays with kept data.
    assert await api.get(f"{LEASE_PATH}/drop") is None
    assert (await api.get(f"{LEASE_PATH}/keep"))["spec"]["leaseTransitions"] == 4
    # So does the key the kept stores were made with, out of the garbage collector's reach.
    deadline = time.monotonic() + 30
    while await api.get(f"{BC_PATH}/keep") is not None:  # its finalizer runs
        assert time.monotonic() < deadline, "the kept cluster was not deleted"
        await asyncio.sleep(0.1)  # polling the emulator's state
    secrets = f"/api/v1/namespaces/{NS}/secrets"
    for secret in ("cluster-key", "default-user"):  # ... and the user the stores hold
        kept = await api.get(f"{secrets}/keep-{secret}")
        assert kept is not None and not kept["metadata"].get("ownerReferences"), kept
        assert await api.get(f"{secrets}/drop-{secret}") is None


async def put_lease(api: Api, name: str, epoch: int) -> None:
    lease = builders.lease(name, NS, f"{name}-0", epoch, [f"{name}-0", f"{name}-1"])
    status, body = await api.call("POST", LEASE_PATH, lease)
    if status == 409:  # the failover loop made one first: replace it
        status, body = await api.call("PATCH", f"{LEASE_PATH}/{name}", lease)
    assert status in (200, 201), body


@pytest.mark.asyncio
async def test_a_cluster_made_again_without_its_data_does_not_wait_on_the_old_lease(
    world: tuple[Api, Operator, Labels],
) -> None:
    """Issue 15: a BrokerCluster deleted with its claims (or whose claims were deleted by
    hand), then applied again, waited forever for the members the old Lease named. With no
    claim, that Lease belongs to data that is gone: the operator deletes it."""
    api, _, _ = world
    await put_lease(api, "again", 5)
    status, body = await api.call("POST", BC_PATH, brokercluster("again"))
    assert status in (200, 201), body
    await api.until(
        f"/apis/apps/v1/namespaces/{NS}/statefulsets",
        lambda o: o["metadata"]["name"] == "again",
        "the StatefulSet of the new cluster",
    )
    lease = await api.get(f"{LEASE_PATH}/again")
    assert lease is None or int(lease["spec"].get("leaseTransitions") or 0) < 5, lease


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_deleted_cluster_key_comes_back_with_the_key_the_members_use(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    """Issue 15: a deleted cluster-key Secret came back with a new random key, which the
    running members did not have."""
    api, _, _, kubelet = demo
    before = await kubelet.secret("demo-cluster-key", "key")
    path = f"/api/v1/namespaces/{NS}/secrets/demo-cluster-key"
    status, body = await api.call("DELETE", path)
    assert status == 200, body
    # Any spec edit makes the operator reconcile (here: a longer failover delay).
    edit = {"spec": {"failover": {"pollSeconds": 0.1, "delaySeconds": 2.0}}}
    status, body = await api.call("PATCH", f"{BC_PATH}/demo", edit)
    assert status == 200, body
    await api.until(
        f"/api/v1/namespaces/{NS}/secrets",
        lambda o: o["metadata"]["name"] == "demo-cluster-key",
        "the cluster key Secret back",
    )
    assert await kubelet.secret("demo-cluster-key", "key") == before
    # Edited, it is put back, with an Event that says why: the members keep their key.
    path = f"/api/v1/namespaces/{NS}/secrets/demo-cluster-key"
    status, body = await api.call("PATCH", path, {"stringData": {"key": "x" * 32}})
    assert status == 200, body
    await api.until(
        f"/api/v1/namespaces/{NS}/events",
        lambda o: o.get("reason") == "ClusterKeyChangeRefused",
        "the refusal",
    )
    assert await kubelet.secret("demo-cluster-key", "key") == before


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_terminating_primary_hands_over_in_its_prestop(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    """A graceful pod deletion: the API server marks the pod, the kubelet runs the preStop
    (`tandem handover`, as the StatefulSet names it) and stops the container only after."""
    api, _, labels, kubelet = demo
    bc = await api.get(f"{BC_PATH}/demo")
    primary, epoch = bc["status"]["primary"], bc["status"]["epoch"]
    status, body = await api.call("DELETE", f"{PODS_PATH}/{primary}")
    assert status == 200 and body["metadata"].get("deletionTimestamp"), body
    code, out = await kubelet.prestop(primary)
    assert code == 0
    assert b"this node is backup" in out, out
    bc = await api.until(
        BC_PATH,
        lambda o: (
            o["status"].get("epoch") == epoch + 1
            and o["status"].get("primary") not in (None, primary)
        ),
        "the switchover in the status",
    )
    assert "is stopping: switching over" in bc["status"]["lastFailover"]["reason"]
    assert labels.labelled == {bc["status"]["primary"]} and labels.most_at_once == 1
    # The kubelet stops the container and lets the pod go.
    await asyncio.to_thread(kubelet.brokers[primary].stop)
    status, body = await api.call(
        "PATCH", f"{PODS_PATH}/{primary}", {"metadata": {"finalizers": []}}
    )
    assert status == 200, body


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_rolling_upgrade_restarts_backups_first_and_the_primary_last(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    api, _, labels, kubelet = demo
    kubelet.run_pods()
    bc = await api.get(f"{BC_PATH}/demo")
    primary, epoch = bc["status"]["primary"], bc["status"]["epoch"]
    # A new image: the StatefulSet controller computes a new revision (OnDelete: it
    # replaces no pod itself).
    status, body = await api.call(
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/statefulsets/demo",
        {"status": {"updateRevision": "r2"}},
    )
    assert status == 200, body
    bc = await api.until(
        BC_PATH,
        lambda o: (
            len(kubelet.restarted) == 3
            and o["status"].get("phase") == "Running"
            and o["status"].get("epoch") == epoch + 1
        ),
        "every pod on the new revision, the cluster running",
        timeout=120,
    )
    # Backups first; the primary last, after a switchover away from it: every pod was a
    # backup when it was deleted, so no pod stopped while clients depended on it.
    assert [before for _, before, _ in kubelet.restarted] == ["backup"] * 3
    assert kubelet.restarted[-1][0] == primary
    assert [stopped for _, _, stopped in kubelet.restarted] == ["backup"] * 3
    reason = bc["status"]["lastFailover"]["reason"]
    assert f"primary {primary} is the last member on the old revision: switching" in reason
    assert labels.most_at_once == 1
    pods = (await api.get(PODS_PATH))["items"]
    assert {p["metadata"]["labels"]["controller-revision-hash"] for p in pods} == {"r2"}


async def _connects(port: int, password: str) -> bool:
    params = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials(builders.DEFAULT_USER, password)
    )
    try:
        conn = await asyncio.to_thread(pika.BlockingConnection, params)
    except pika.exceptions.AMQPError:
        return False
    await asyncio.to_thread(conn.close)
    return True


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_rotated_user_password_reaches_the_running_cluster_and_survives_deletion(
    demo: tuple[Api, Operator, Labels, Kubelet],
) -> None:
    """Issue 15: an edit of the users Secret was ignored once the members had joined, and a
    deleted default-user Secret came back with a password no broker accepted."""
    api, _, _, kubelet = demo
    bc = await api.get(f"{BC_PATH}/demo")
    port = kubelet.brokers[bc["status"]["primary"]].amqp_port
    old = await kubelet.secret("demo-default-user", "password")
    path = f"/api/v1/namespaces/{NS}/secrets/demo-default-user"
    status, body = await api.call("PATCH", path, {"stringData": {"password": "rotated-1"}})
    assert status == 200, body
    # The operator carries the password into the Secret's url and definitions ...
    await api.until(
        f"/api/v1/namespaces/{NS}/secrets",
        lambda o: ":rotated-1@" in (o.get("stringData") or {}).get("url", ""),
        "the url following the new password",
    )
    # ... and onto the cluster, whose primary records it: the new password works, the old
    # one no longer does.
    await api.until(
        f"/api/v1/namespaces/{NS}/events",
        lambda o: o.get("reason") == "UsersApplied",
        "the users applied",
    )
    assert await _connects(port, "rotated-1")
    assert not await _connects(port, old)
    # Deleted, the Secret comes back with the password the cluster uses, not a new one.
    status, body = await api.call("DELETE", path)
    assert status == 200, body
    await api.until(
        f"/api/v1/namespaces/{NS}/secrets",
        lambda o: o["metadata"]["name"] == "demo-default-user",
        "the default-user Secret back",
    )
    assert await kubelet.secret("demo-default-user", "password") == "rotated-1"
    assert await _connects(port, "rotated-1")
