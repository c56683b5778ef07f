"""kmock's Kubernetes emulator with the API server's optimistic concurrency.

kmock 0.8 stores objects as plain merged dicts and keeps no `metadata.resourceVersion`; its
docstring asks a test that needs more of the API server to subclass it. This one does what a
real API server does with resource versions (and what kopf 1.44+ and the operator's Lease
compare-and-set rely on):

- every write (create, patch, delete that only marks) gives the object a new resourceVersion,
  one counter for the whole server, as etcd's revision is;
- a JSON patch's `test` on `/metadata/resourceVersion` is checked: a stale one fails the
  whole patch with 422, as the API server answers a failed JSON-patch test;
- a merge patch or a create body that carries a resourceVersion other than the stored one is
  refused with 409 Conflict, as the API server refuses a stale update.

- a list says the revision it was taken at, and a watch from that revision sends what changed
  since; a watch takes its place in the event stream and its snapshot of the objects at one
  instant, so no change falls between the two. (kmock's own watch snapshots first and
  subscribes after, and a write in between is never sent: with kopf 1.44's tested patches that
  lost event leaves an object unprocessed for good.)

The check and the write happen under one lock, so two writers cannot both pass the check.
A deletion between a list and the watch that follows it is not replayed (there is no event
history); the tests here never race a deletion against the operator's start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import attrs
import kmock


@attrs.frozen
class Conflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = (
        "Operation cannot be fulfilled: the object has been modified; "
        "please apply your changes to the latest version and try again"
    )


@attrs.frozen
class PatchTestFailed(kmock.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = "the JSON patch's test operation failed: the object has been modified"


RV_PATH = "/metadata/resourceVersion"
WRITES = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """The emulator, with resourceVersion semantics (see the module's docstring)."""

    _revision: int = attrs.field(default=0, init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    conflicts: list[tuple[str, str]] = attrs.field(factory=list, init=False)  # (method, path)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is None or request.action not in WRITES:
            return await super()._handle(request)
        async with self._writes:
            try:
                self._check_and_stamp(request)
            except (Conflict, PatchTestFailed):
                self.conflicts.append((request.method.value, request.url.path))
                raise
            return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        async with self._writes:
            listed = await super()._serve_list(request)
            listed["metadata"]["resourceVersion"] = str(self._revision)
        return listed

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # the headers go out now, as kmock's own watch does
        since = _revision_of(request.params.get("resourceVersion"))
        assert request.resource is not None
        bus = self._buses[request.resource]
        async with self._writes:  # no write between the mark and the snapshot
            mark = await bus.mark()
            current = [
                obj.raw
                for (resource, namespace, name), obj in self.objects.items()
                if not obj.deleted and _selects(request, resource, namespace, name)
            ]
        try:
            for raw in current:
                version = _revision_of((raw.get("metadata") or {}).get("resourceVersion"))
                if since is None:
                    yield {"type": "ADDED", "object": raw}
                elif version is None or version > since:
                    yield {"type": "MODIFIED", "object": raw}
            async for event in mark:
                meta = event.get("object", {}).get("metadata", {})
                if _selects(request, request.resource, meta.get("namespace"), meta.get("name")):
                    yield event
        finally:
            await bus.unmark(mark)

    def _check_and_stamp(self, request: kmock.Request) -> None:
        """Refuse a stale write; give the write the next resourceVersion (in the request's
        own body, so the stored object, the response and the watch event all carry it)."""
        data = request.data
        if request.action == kmock.action.CREATE:
            if isinstance(data, dict):
                data.setdefault("metadata", {})["resourceVersion"] = self._next()
            return
        found, current = self._stored_version(request)
        if not found:
            return  # kmock answers 404
        if request.action == kmock.action.DELETE:
            return  # a delete that only marks (finalizers) stamps nothing we check
        if isinstance(data, list):  # JSON patch
            tests = [op for op in data if op.get("op") == "test" and op.get("path") == RV_PATH]
            if any(op.get("value") != current for op in tests):
                raise PatchTestFailed()
            data.append({"op": "add", "path": RV_PATH, "value": self._next()})
        elif isinstance(data, dict):  # merge patch
            meta = data.setdefault("metadata", {})
            sent = meta.get("resourceVersion")
            if sent is not None and sent != current:
                raise Conflict()
            meta["resourceVersion"] = self._next()

    def _stored_version(self, request: kmock.Request) -> tuple[bool, str | None]:
        """Whether the object exists, and its resourceVersion (None for an object a test
        put in place without one)."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return False, None
        return True, (self.objects[key].get("metadata") or {}).get("resourceVersion")

    def _next(self) -> str:
        self._revision += 1
        return str(self._revision)


def _revision_of(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _selects(request: kmock.Request, resource: Any, namespace: str | None, name: str) -> bool:
    return (
        resource == request.resource
        and (request.namespace is None or namespace == request.namespace)
        and (request.name is None or name == request.name)
    )
