"""The emulator keeps resourceVersions as an API server does, and the operator's own client
and Lease compare-and-set meet its refusals: a stale write is refused with 409, a JSON patch
whose `test` of the resourceVersion fails is refused with 422 (what kopf 1.44+ relies on)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kmock
import kubernetes
import pytest

from tandem.operator import kube as kube_mod
from tandem.operator import lease as lease_mod
from tests.operator.emulator import Emulator

pytestmark = pytest.mark.kmock(cls=Emulator)

NS = "test"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"


def client(emulator: Emulator) -> kube_mod.Kube:
    config = kubernetes.client.Configuration()
    config.host = str(emulator.url).rstrip("/")
    config.api_key = {"BearerToken": "test"}
    return kube_mod.Kube(kubernetes.client.ApiClient(config))


def register(emulator: Emulator) -> None:
    emulator.resources["coordination.k8s.io/v1/leases"] = kmock.ResourceInfo(
        kind="Lease", namespaced=True, verbs={"get", "list", "watch", "create", "patch"}
    )


async def call(emulator: Emulator, method: str, path: str, body: Any, ctype: str) -> Any:
    async with emulator.request(method, path, json=body, headers={"Content-Type": ctype}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.asyncio
async def test_every_write_takes_a_new_resource_version_and_a_stale_one_is_refused(
    kmock: Emulator,
) -> None:
    register(kmock)
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
    status, made = await call(
        kmock, "POST", LEASES, {**lease, "metadata": {"name": "a"}}, "application/json"
    )
    assert status in (200, 201), made
    first = made["metadata"]["resourceVersion"]

    async def merge_patch(version: str, holder: str) -> tuple[int, Any]:
        body = {"metadata": {"resourceVersion": version}, "spec": {"holderIdentity": holder}}
        return await call(kmock, "PATCH", f"{LEASES}/a", body, "application/merge-patch+json")

    status, patched = await merge_patch(first, "x")
    assert status == 200, patched
    second = patched["metadata"]["resourceVersion"]
    assert second != first and patched["spec"]["holderIdentity"] == "x"

    # The same write again carries the version it read before: refused, nothing changed.
    status, refused = await merge_patch(first, "y")
    assert status == 409 and refused["reason"] == "Conflict", refused

    jsonpatch = "application/json-patch+json"
    stale_test = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": first},
        {"op": "add", "path": "/spec/holderIdentity", "value": "z"},
    ]
    status, refused = await call(kmock, "PATCH", f"{LEASES}/a", stale_test, jsonpatch)
    assert status == 422, refused
    fresh_test = [{**stale_test[0], "value": second}, stale_test[1]]
    status, patched = await call(kmock, "PATCH", f"{LEASES}/a", fresh_test, jsonpatch)
    assert status == 200, patched
    assert patched["spec"]["holderIdentity"] == "z"
    assert patched["metadata"]["resourceVersion"] not in (first, second)
    assert [m for m, _ in kmock.conflicts] == ["PATCH", "PATCH"]


@pytest.mark.asyncio
async def test_the_lease_compare_and_set_loses_to_a_write_between_its_read_and_its_write(
    kmock: Emulator,
) -> None:
    register(kmock)
    api = client(kmock)
    nodes = ["demo-0", "demo-1", "demo-2"]
    store = lease_mod.LeaseElectionStore(api, "demo", NS, nodes)
    first = await store.read()
    rec = await store.compare_and_set(first, replace(first, holder="demo-0", epoch=1))
    assert rec is not None

    class Meddling:
        """The operator's client, but another writer replaces the Lease right after each
        read (a second operator, or a user's kubectl)."""

        async def read(self, name: str, namespace: str) -> Any:
            lease = await api.read(name, namespace)
            rival = replace(rec, holder="demo-1", epoch=2, version=rec.version + 1)
            await api.patch(
                "coordination.k8s.io/v1",
                "Lease",
                namespace,
                name,
                lease_mod.body_of(name, namespace, rival),
            )
            return lease

        async def create(self, namespace: str, body: Any) -> Any:
            return await api.create(namespace, body)

        async def replace(self, name: str, namespace: str, body: Any) -> Any:
            return await api.replace(name, namespace, body)

    loser = lease_mod.LeaseElectionStore(Meddling(), "demo", NS, nodes)
    mine = replace(rec, holder="demo-2", epoch=2)
    assert await loser.compare_and_set(rec, mine) is None
    assert kmock.conflicts == [("PATCH", f"{LEASES}/demo")]
    now = await store.read()
    assert (now.holder, now.epoch) == ("demo-1", 2)
