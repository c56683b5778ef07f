"""The election record on a `coordination.k8s.io/v1` Lease (DESIGN, "Election"), as the
`tandem.ha.ports.ElectionStore` the operator's loop uses.

The Lease holds the record: `holderIdentity` the primary, `leaseTransitions` the epoch, the
ISR and the tracked members in annotations, and the record's version counter in an
annotation too. A compare-and-set reads the Lease, checks the version, and replaces it with
the `resourceVersion` it read: the API server refuses the write (409) if anyone wrote in
between, so two operators (or one and its restarted self) cannot both win. The API itself is
a port (`LeaseApi`); the module that talks to Kubernetes implements it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from tandem.ha.model import ElectionRecord
from tandem.operator import builders

ISR = "tandem.dev/isr"
TRACKING = "tandem.dev/tracking"
VERSION = "tandem.dev/version"
ISR_MIN = "tandem.dev/isr-min"

Obj = dict[str, Any]


class Conflict(Exception):
    """The object changed since it was read (HTTP 409), or already exists on create."""


class LeaseApi(Protocol):
    async def read(self, name: str, namespace: str) -> Obj | None:
        """The Lease, or None when there is none."""

    async def create(self, namespace: str, body: Obj) -> Obj: ...

    async def replace(self, name: str, namespace: str, body: Obj) -> Obj:
        """Write `body` over the Lease; raises Conflict when body's metadata.resourceVersion
        is not the current one, or the Lease is gone."""


def _names(text: str) -> frozenset[str]:
    return frozenset(n for n in text.split(",") if n)


def record_of(lease: Obj) -> ElectionRecord:
    meta = lease.get("metadata", {})
    notes = meta.get("annotations") or {}
    spec = lease.get("spec") or {}
    return ElectionRecord(
        holder=spec.get("holderIdentity") or None,
        epoch=int(spec.get("leaseTransitions") or 0),
        isr=_names(notes.get(ISR, "")),
        version=int(notes.get(VERSION, "0")),
        tracking=_names(notes.get(TRACKING, "")),
        isr_min=int(notes[ISR_MIN]) if notes.get(ISR_MIN) else None,
    )


def body_of(name: str, namespace: str, record: ElectionRecord) -> Obj:
    lease = builders.lease(name, namespace, record.holder, record.epoch, sorted(record.isr))
    lease["metadata"]["annotations"].update(
        {TRACKING: ",".join(sorted(record.tracking)), VERSION: str(record.version)}
    )
    if record.isr_min is not None:
        lease["metadata"]["annotations"][ISR_MIN] = str(record.isr_min)
    return lease


class LeaseElectionStore:
    """Implements ha.ports.ElectionStore on a Lease named after the cluster."""

    def __init__(self, api: LeaseApi, name: str, namespace: str, nodes: list[str]) -> None:
        self.api, self.name, self.namespace, self.nodes = api, name, namespace, nodes

    async def read(self) -> ElectionRecord:
        lease = await self.api.read(self.name, self.namespace)
        return ElectionRecord.initial(self.nodes) if lease is None else record_of(lease)

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        stored = replace(new, version=expected.version + 1)
        body = body_of(self.name, self.namespace, stored)
        lease = await self.api.read(self.name, self.namespace)
        try:
            if lease is None:
                if expected.version != 0:
                    return None
                await self.api.create(self.namespace, body)
                return stored
            if record_of(lease).version != expected.version:
                return None
            version = lease["metadata"].get("resourceVersion")
            if version:  # the API server refuses the write if anyone wrote since
                body["metadata"]["resourceVersion"] = version
            await self.api.replace(self.name, self.namespace, body)
        except Conflict:
            return None  # another writer got there between our read and our write
        return stored
