"""The Lease compare-and-set, against a fake API server that models resourceVersion
conflicts (kmock's emulator does not)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from typing import Any

import pytest

from tandem.ha.model import ElectionRecord
from tandem.operator import lease as lease_mod


class FakeApi:
    """One Lease store with resourceVersions, as the API server keeps them; `meddle` lets a
    test write in between a read and a replace."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 0
        self.meddle: Any = None

    async def read(self, name: str, namespace: str) -> dict[str, Any] | None:
        obj = self.objects.get((namespace, name))
        out = copy.deepcopy(obj) if obj is not None else None
        if self.meddle is not None:
            meddle, self.meddle = self.meddle, None
            meddle()
        return out

    def _store(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[(namespace, body["metadata"]["name"])] = body
        return body

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if (namespace, body["metadata"]["name"]) in self.objects:
            raise lease_mod.Conflict("exists")
        return self._store(namespace, body)

    async def replace(self, name: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        current = self.objects.get((namespace, name))
        if current is None or current["metadata"]["resourceVersion"] != body["metadata"].get(
            "resourceVersion"
        ):
            raise lease_mod.Conflict("resourceVersion")
        return self._store(namespace, body)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def store(api: FakeApi) -> lease_mod.LeaseElectionStore:
    return lease_mod.LeaseElectionStore(api, "demo", "ns", ["demo-0", "demo-1", "demo-2"])


def test_a_new_cluster_reads_the_initial_record_and_creates_the_lease() -> None:
    api = FakeApi()
    s = store(api)
    first = run(s.read())
    assert first == ElectionRecord.initial(["demo-0", "demo-1", "demo-2"])
    new = replace(first, holder="demo-0", epoch=1)
    stored = run(s.compare_and_set(first, new))
    assert stored is not None and stored.version == 1
    assert run(s.read()) == stored
    lease = api.objects[("ns", "demo")]
    assert lease["spec"] == {"holderIdentity": "demo-0", "leaseTransitions": 1}
    assert lease["metadata"]["annotations"]["tandem.dev/isr"] == "demo-0,demo-1,demo-2"


def test_a_stale_version_loses() -> None:
    api = FakeApi()
    s = store(api)
    first = run(s.read())
    one = run(s.compare_and_set(first, replace(first, holder="demo-0", epoch=1)))
    assert one is not None
    assert run(s.compare_and_set(first, replace(first, holder="demo-1", epoch=1))) is None
    assert run(s.read()).holder == "demo-0"


def test_a_write_between_read_and_replace_is_refused_by_resource_version() -> None:
    api = FakeApi()
    s = store(api)
    first = run(s.read())
    rec = run(s.compare_and_set(first, replace(first, holder="demo-0", epoch=1)))
    assert rec is not None
    rival = replace(rec, holder="demo-1", epoch=2, isr=frozenset({"demo-1"}), version=2)
    # Another writer replaces the Lease after our read and before our replace.
    api.meddle = lambda: api._store("ns", lease_mod.body_of("demo", "ns", rival))
    mine = replace(rec, holder="demo-2", epoch=2, isr=frozenset({"demo-2"}))
    assert run(s.compare_and_set(rec, mine)) is None
    assert run(s.read()) == rival


@pytest.mark.parametrize("holder", [None, "demo-2"])
def test_the_record_round_trips_through_the_lease(holder: str | None) -> None:
    rec = ElectionRecord(
        holder=holder,
        epoch=7,
        isr=frozenset({"demo-2"} if holder else {"demo-0"}),
        version=12,
        tracking=frozenset({"demo-1"}),
    )
    assert lease_mod.record_of(lease_mod.body_of("demo", "ns", rec)) == rec
