"""The operator's failover loop, in memory: the role label's order, the pause annotation and
the status it publishes, with a recording fake of its API port (no server, no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from tandem.broker.ha_http import WakeableClock
from tandem.ha.model import ElectionRecord, Liveness, Member, Role
from tandem.operator.members import ClusterLoop, Pods
from tandem.operator.spec import BrokerClusterSpec

BODY = {
    "apiVersion": "tandem.dev/v1alpha1",
    "kind": "BrokerCluster",
    "metadata": {"name": "demo", "namespace": "ns", "uid": "u", "annotations": {}},
}


class Api:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        self.calls.append((f"{kind}/{name}", body))
        return body

    async def event(
        self, involved: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        self.calls.append(("Event", (reason, message)))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append((f"delete {kind}/{name}", None))


class Store:
    def __init__(self, record: ElectionRecord) -> None:
        self.record = record

    async def read(self) -> ElectionRecord:
        return self.record

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        return None


def loop(record: ElectionRecord) -> tuple[ClusterLoop, Api, Pods]:
    api = Api()
    pods = Pods(["demo-0", "demo-1"], WakeableClock())
    spec = BrokerClusterSpec.model_validate({"replicas": 2})
    return ClusterLoop(api, BODY, spec, Store(record), pods, None, "key"), api, pods


def serving(pods: Pods, node: str, epoch: int) -> tuple[Member, ...]:
    pods.by_node[node].status = {"role": "primary"}
    return tuple(
        Member(n, Liveness.UP, Role.PRIMARY if n == node else Role.BACKUP, epoch)
        for n in pods.by_node
    )


def test_the_label_leaves_the_old_pod_before_it_reaches_the_new_primary() -> None:
    record = ElectionRecord("demo-1", 2, frozenset({"demo-0", "demo-1"}))
    cl, api, pods = loop(record)
    pods.by_node["demo-0"].labelled = True  # the old primary still carries it
    asyncio.run(cl.after_look(record, serving(pods, "demo-1", 2)))
    labels = [(who, body["metadata"]["labels"]) for who, body in api.calls if who.startswith("Pod")]
    assert labels == [
        ("Pod/demo-0", {"tandem.dev/role": None}),
        ("Pod/demo-1", {"tandem.dev/role": "primary"}),
    ]


def test_no_serving_primary_means_no_label_and_the_status_says_failover() -> None:
    record = ElectionRecord("demo-0", 1, frozenset({"demo-0", "demo-1"}))
    cl, api, pods = loop(record)
    pods.by_node["demo-0"].labelled = True
    members = (Member("demo-0", Liveness.DOWN), Member("demo-1", Liveness.UP, Role.BACKUP, 1))
    asyncio.run(cl.after_look(record, members))
    assert ("Pod/demo-0", {"metadata": {"labels": {"tandem.dev/role": None}}}) in api.calls
    (status,) = [body["status"] for who, body in api.calls if who == "BrokerCluster/demo"]
    assert status["phase"] == "Failover" and status["primary"] is None
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert available["status"] == "False"


def test_the_pause_annotation_pauses_the_controller_and_shows_in_the_phase() -> None:
    record = ElectionRecord("demo-0", 1, frozenset({"demo-0", "demo-1"}))
    cl, api, pods = loop(record)
    BODY["metadata"]["annotations"]["tandem.dev/paused"] = "true"
    try:
        asyncio.run(cl.after_look(record, serving(pods, "demo-0", 1)))
    finally:
        BODY["metadata"]["annotations"].clear()
    assert cl.controller.paused
    (status,) = [body["status"] for who, body in api.calls if who == "BrokerCluster/demo"]
    assert status["phase"] == "Paused"


def test_a_diverged_member_is_one_warning_event_and_a_condition_until_it_is_whole() -> None:
    record = ElectionRecord("demo-0", 1, frozenset({"demo-0", "demo-1"}))
    cl, api, pods = loop(record)
    why = "record 1:7 not applied: define queue.declare 'q' in vhost '/'"
    healthy = serving(pods, "demo-0", 1)
    diverged = (
        healthy[0],
        Member("demo-1", Liveness.UP, Role.BACKUP, 1, whole=False, diverged=why),
    )

    def consistent() -> dict[str, Any]:
        status = [body["status"] for who, body in api.calls if who == "BrokerCluster/demo"][-1]
        return next(c for c in status["conditions"] if c["type"] == "Consistent")

    asyncio.run(cl.after_look(record, diverged))
    asyncio.run(cl.after_look(record, diverged))  # said once, not at every look
    events = [body for who, body in api.calls if who == "Event"]
    assert events == [("Diverged", events[0][1])] and why in events[0][1]
    assert consistent()["status"] == "False" and why in consistent()["message"]
    assert consistent()["reason"] == "RecordNotApplied"
    asyncio.run(cl.after_look(record, healthy))
    assert [body[0] for who, body in api.calls if who == "Event"] == ["Diverged", "Rejoined"]
    assert consistent()["status"] == "True"
