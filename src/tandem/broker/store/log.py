"""The node's log on disk: segmented, checksummed, group-committed.

Layout: `<data_dir>/log/<first offset, 20 digits>.seg`. A record is

    magic "TL" | length u32 | crc32 u32 | type u8 | epoch u32 | offset u64 | payload

and the crc covers everything after it. Records are appended in log order by the event loop
into a pending buffer; a single writer thread writes and fsyncs a whole batch at a time (group
commit), then calls back on the loop (confirms, tx.commit-ok). Every change advances the
offset; only changes to durable state are written.

Compaction: a new segment starts with a snapshot of the durable definitions, so a segment is
needed only for the persistent messages still alive in it. The oldest segments are deleted once
they hold no live message; when the log holds more than `max_segments`, the live messages of
the oldest are appended again (same message id, so order is kept) and it is deleted.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.broker.model.broker import Broker
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue

log = logging.getLogger(__name__)

MAGIC = b"TL"
REC_HDR = struct.Struct(">2sII")  # magic, length of the rest, crc32 of the rest
REC_META = struct.Struct(">BIQ")  # type, epoch, offset
STR16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
MAX_RECORD = 1 << 31

DEFINE = 1
ENQUEUE = 2
DEQUEUE = 3
SNAPSHOT = 4  # a DEFINE whose body is every durable definition at this point


def _str(value: str) -> bytes:
    raw = value.encode()
    return STR16.pack(len(raw)) + raw


def _bytes(value: bytes) -> bytes:
    return U32.pack(len(value)) + value


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def str(self) -> str:
        (n,) = STR16.unpack_from(self.data, self.pos)
        self.pos += 2 + n
        return self.data[self.pos - n : self.pos].decode()

    def bytes(self) -> bytes:
        (n,) = U32.unpack_from(self.data, self.pos)
        self.pos += 4 + n
        if self.pos > len(self.data):
            raise ValueError("truncated field")
        return self.data[self.pos - n : self.pos]

    def u64(self) -> int:
        (v,) = U64.unpack_from(self.data, self.pos)
        self.pos += 8
        return int(v)


def encode_record(rtype: int, epoch: int, offset: int, payload: bytes) -> bytes:
    rest = REC_META.pack(rtype, epoch, offset) + payload
    return REC_HDR.pack(MAGIC, len(rest), zlib.crc32(rest)) + rest


@dataclass(slots=True)
class Corruption:
    path: Path
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.reason}"


@dataclass(slots=True)
class Recovered:
    records: int = 0
    messages: int = 0
    truncated: list[str] = field(default_factory=list)
    corrupt: list[Corruption] = field(default_factory=list)


def scan_segment(
    path: Path, last: bool
) -> tuple[list[tuple[int, int, int, bytes]], int, list[Corruption], int | None]:
    """Read a segment's records: (type, epoch, offset, payload) in order.

    Returns the records, the byte length of the valid data, the corrupt spots skipped, and,
    for the last segment, where a torn tail starts (None if there is none).
    """
    data = path.read_bytes()
    records: list[tuple[int, int, int, bytes]] = []
    corrupt: list[Corruption] = []
    pos = 0
    n = len(data)
    good_end = 0
    while pos < n:
        problem = None
        if n - pos < REC_HDR.size:
            problem = "truncated record header"
        else:
            magic, length, crc = REC_HDR.unpack_from(data, pos)
            end = pos + REC_HDR.size + length
            if magic != MAGIC:
                problem = "bad record magic"
            elif length < REC_META.size or length > MAX_RECORD:
                problem = f"bad record length {length}"
            elif end > n:
                problem = "record runs past the end of the file"
            else:
                rest = data[pos + REC_HDR.size : end]
                if zlib.crc32(rest) != crc:
                    problem = "checksum mismatch"
                else:
                    rtype, epoch, offset = REC_META.unpack_from(rest, 0)
                    records.append((rtype, epoch, offset, rest[REC_META.size :]))
                    pos = end
                    good_end = end
                    continue
        # Look for the next record that checks out; none means the rest is a torn tail.
        nxt = _next_valid(data, pos + 1)
        if nxt is None:
            return records, good_end, corrupt, (good_end if last else None)
        corrupt.append(Corruption(path, pos, problem))
        pos = nxt
    return records, good_end, corrupt, None


def _next_valid(data: bytes, start: int) -> int | None:
    n = len(data)
    pos = data.find(MAGIC, start)
    while pos != -1:
        if n - pos >= REC_HDR.size:
            _m, length, crc = REC_HDR.unpack_from(data, pos)
            end = pos + REC_HDR.size + length
            if (
                REC_META.size <= length <= MAX_RECORD
                and end <= n
                and zlib.crc32(data[pos + REC_HDR.size : end]) == crc
            ):
                return pos
        pos = data.find(MAGIC, pos + 1)
    return None


class _Batch:
    __slots__ = ("callbacks", "chunks", "deletes")

    def __init__(self) -> None:
        self.chunks: list[tuple[int, bytes]] = []  # (segment, bytes)
        self.callbacks: list[Callable[[], None]] = []
        self.deletes: list[int] = []


class Store:
    """Implements the model's Journal port on disk."""

    def __init__(
        self,
        data_dir: Path,
        *,
        fsync: bool = True,
        segment_bytes: int = 64 << 20,
        max_segments: int = 16,
    ) -> None:
        self.dir = Path(data_dir) / "log"
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.epoch = 1
        self.offset = 0
        self.broker: Broker | None = None
        self.recovering = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.segments: collections.OrderedDict[int, int] = collections.OrderedDict()  # live
        self.active = 0  # first offset of the active segment
        self.active_size = 0
        self.where: dict[tuple[str, str, int], int] = {}  # (vhost, queue, mid) -> segment
        self.pending = _Batch()
        self.inflight: _Batch | None = None
        self.flush_scheduled = False
        self.write_error: OSError | None = None
        self.on_write_error: Callable[[OSError | None], None] = lambda err: None
        self.fds: dict[int, int] = {}
        self.lock = threading.Lock()
        self.synced_batches = 0
        self.fsync_seconds: Callable[[float], None] = lambda s: None
        self.sizes: dict[int, int] = {}  # bytes of each segment known to be written

    # -- the Journal port --

    # While recovering, the model replays the log through this port: nothing is new, so
    # nothing advances the position or is written again.

    def define(self, vhost: str, op: str, body: dict[str, Any], durable: bool) -> None:
        if self.recovering:
            return
        self.offset += 1
        if op == "queue.delete" and durable:
            self._forget_queue(vhost, body["name"])
        if durable:
            payload = json.dumps(
                {"vhost": vhost, "op": op, "body": body}, separators=(",", ":")
            ).encode()
            self._append(encode_record(DEFINE, self.epoch, self.offset, payload))

    def enqueue(self, queue: Queue, msg: Message) -> None:
        if self.recovering:
            return
        self.offset += 1
        if not msg.mid:
            msg.mid = self.offset
        self._write_enqueue(queue.vhost.name, queue.name, msg)

    def _write_enqueue(self, vhost: str, queue: str, msg: Message) -> None:
        payload = b"".join(
            (
                _str(vhost),
                _str(queue),
                U64.pack(msg.mid),
                _bytes(msg.route),
                _bytes(msg.props),
                _bytes(msg.body_bytes()),
            )
        )
        self._append(encode_record(ENQUEUE, self.epoch, self.offset, payload))
        self.where[(vhost, queue, msg.mid)] = self.active
        self.segments[self.active] += 1

    def _forget_queue(self, vhost: str, queue: str) -> None:
        """A deleted queue's messages are no longer live: their segments can go."""
        for key in [k for k in self.where if k[0] == vhost and k[1] == queue]:
            self.segments[self.where.pop(key)] -= 1

    def dequeue(self, queue: Queue, msg: Message) -> None:
        if self.recovering:
            return
        self.offset += 1
        key = (queue.vhost.name, queue.name, msg.mid)
        seg = self.where.pop(key, None)
        if seg is None:
            return
        self.segments[seg] -= 1
        payload = _str(key[0]) + _str(key[1]) + U64.pack(msg.mid)
        self._append(encode_record(DEQUEUE, self.epoch, self.offset, payload))

    def when_synced(self, callback: Callable[[], None]) -> None:
        if self.pending.chunks:
            self.pending.callbacks.append(callback)
        elif self.inflight is not None and self.inflight.chunks:
            self.inflight.callbacks.append(callback)
        else:
            callback()

    def dirty(self) -> bool:
        return bool(self.pending.chunks) or self.inflight is not None

    # -- appending and the writer --

    def _append(self, record: bytes) -> None:
        self.pending.chunks.append((self.active, record))
        self.active_size += len(record)
        if not self.flush_scheduled and self.loop is not None:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)
        if self.active_size >= self.segment_bytes:
            self._roll()

    def _roll(self) -> None:
        """Start a new segment, beginning with a snapshot of the durable definitions (a record
        of its own, with its own offset, that names the segment)."""
        self.offset += 1
        self.active = self.offset
        self.segments[self.active] = 0
        self.active_size = 0
        snapshot = json.dumps(self._definitions(), separators=(",", ":")).encode()
        record = encode_record(SNAPSHOT, self.epoch, self.offset, snapshot)
        self.pending.chunks.append((self.active, record))
        self.active_size += len(record)

    def _compact(self) -> None:
        """Delete the oldest segments that hold no live message; carry forward the live
        messages of the oldest while there are too many segments. Runs after a batch is on
        disk and only over segments the writer is done with."""
        busy = {seg for seg, _ in self.pending.chunks}
        while len(self.segments) > self.max_segments:
            oldest = next(iter(self.segments))
            if oldest == self.active or oldest in busy:
                break
            self._carry_forward(oldest)
            # Deleted only after the batch holding the carried records is on disk.
            del self.segments[oldest]
            self.pending.deletes.append(oldest)
        for seg in list(self.segments):
            if seg == self.active or seg in busy or self.segments[seg] > 0:
                break
            del self.segments[seg]
            self.pending.deletes.append(seg)

    def _carry_forward(self, seg: int) -> None:
        """Append again the records of the live messages (ready or unacked) of a segment."""
        records, _end, _corrupt, _torn = scan_segment(self._path(seg), False)
        moved = 0
        for rtype, _epoch, _offset, payload in records:
            if rtype != ENQUEUE:
                continue
            r = _Reader(payload)
            key = (r.str(), r.str(), r.u64())
            if self.where.get(key) != seg:
                continue
            self.offset += 1
            self._append(encode_record(ENQUEUE, self.epoch, self.offset, payload))
            self.where[key] = self.active
            self.segments[self.active] += 1
            moved += 1
        log.info("compaction: carried %d live messages out of segment %d", moved, seg)
        self.segments[seg] = 0

    def _definitions(self) -> dict[str, Any]:
        if self.broker is None:
            return {}
        out: dict[str, Any] = {"vhosts": {}}
        for vh in self.broker.vhosts.values():
            out["vhosts"][vh.name] = {
                "exchanges": [
                    vh.exchange_body(e)
                    for e in vh.exchanges.values()
                    if e.durable and e.name and not e.name.startswith("amq.")
                ],
                "queues": [vh.queue_body(q) for q in vh.queues.values() if q.durable],
                "bindings": [
                    vh.binding_body(b)
                    for b in vh.bindings()
                    if b.source.durable and b.destination.durable
                ],
            }
        return out

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.inflight is not None or not (self.pending.chunks or self.pending.deletes):
            return
        batch, self.pending = self.pending, _Batch()
        self.inflight = batch
        assert self.loop is not None
        fut = self.loop.run_in_executor(None, self._write_batch, batch)
        fut.add_done_callback(lambda f: self._written(batch, f))

    def _write_batch(self, batch: _Batch) -> float:
        with self.lock:
            touched: dict[int, int] = {}
            groups: dict[int, list[bytes]] = {}
            for seg, data in batch.chunks:
                groups.setdefault(seg, []).append(data)
            for seg, parts in groups.items():
                fd = self._fd(seg)
                data = b"".join(parts)
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                touched[seg] = fd
            start = time.perf_counter()
            if self.fsync:
                for fd in touched.values():
                    os.fsync(fd)
            took = time.perf_counter() - start
            for seg, parts in groups.items():
                self.sizes[seg] = self.sizes.get(seg, 0) + sum(len(p) for p in parts)
            for seg in batch.deletes:
                fd_or_none = self.fds.pop(seg, None)
                if fd_or_none is not None:
                    fd = fd_or_none
                    os.close(fd)
                path = self._path(seg)
                if path.exists():
                    path.unlink()
            return took

    def _written(self, batch: _Batch, fut: asyncio.Future[float]) -> None:
        exc = fut.exception()
        if exc is not None:
            if not isinstance(exc, OSError):
                log.error("unexpected error, please report it as a bug: store writer: %r", exc)
            log.error(
                "cannot write the log in %s: %s; holding %d records and their confirms "
                "until it can",
                self.dir,
                exc,
                len(batch.chunks),
            )
            self.write_error = exc if isinstance(exc, OSError) else OSError(str(exc))
            self.on_write_error(self.write_error)
            # Keep the batch: it goes first when the writer tries again.
            assert self.loop is not None
            self.pending.chunks[:0] = self._unwritten(batch)
            self.pending.callbacks[:0] = batch.callbacks
            self.pending.deletes[:0] = batch.deletes
            self.inflight = None
            self.loop.call_later(1.0, self._retry)
            return
        if self.write_error is not None:
            log.warning("the log in %s is writable again", self.dir)
            self.write_error = None
            self.on_write_error(None)
        self.inflight = None
        self.synced_batches += 1
        self.fsync_seconds(fut.result())
        for cb in batch.callbacks:
            try:
                cb()
            except Exception:
                log.exception("unexpected error, please report it as a bug: sync callback")
        if len(self.segments) > 1:
            self._compact()
        if self.pending.chunks or self.pending.deletes:
            self._flush()

    def _unwritten(self, batch: _Batch) -> list[tuple[int, bytes]]:
        """After a failed write, truncate each touched segment to what was synced before and
        return the batch to write again."""
        with self.lock:
            for seg in {s for s, _ in batch.chunks}:
                fd = self.fds.get(seg)
                if fd is not None:
                    size = self.sizes.get(seg, 0)
                    os.ftruncate(fd, size)
                    os.lseek(fd, size, os.SEEK_SET)
        return batch.chunks

    def _retry(self) -> None:
        if self.inflight is None:
            self._flush()

    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:020d}.seg"

    def _fd(self, seg: int) -> int:
        fd = self.fds.get(seg)
        if fd is None:
            fd = os.open(self._path(seg), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self.fds[seg] = fd
            if self.fsync:
                dfd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        return fd

    # -- open and recover --

    def open(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> Recovered:
        """Recover the broker's durable state from the log, then start appending."""
        self.broker = broker
        self.loop = loop
        self.dir.mkdir(parents=True, exist_ok=True)
        result = Recovered()
        paths = sorted(self.dir.glob("*.seg"))
        live: dict[tuple[str, str, int], tuple[int, bytes, bytes, bytes]] = {}
        self.recovering = True
        try:
            for i, path in enumerate(paths):
                seg = int(path.stem)
                records, _good_end, corrupt, torn = scan_segment(path, i == len(paths) - 1)
                for c in corrupt:
                    log.error("corrupt record in the log, skipped: %s", c)
                result.corrupt.extend(corrupt)
                if torn is not None and torn < path.stat().st_size:
                    log.warning(
                        "cutting a torn tail off %s at byte %d (%d bytes)",
                        path,
                        torn,
                        path.stat().st_size - torn,
                    )
                    with open(path, "r+b") as f:
                        f.truncate(torn)
                    result.truncated.append(f"{path}@{torn}")
                self.segments[seg] = 0
                for rtype, epoch, offset, payload in records:
                    self.epoch = max(self.epoch, epoch)
                    self.offset = max(self.offset, offset)
                    result.records += 1
                    self._replay(broker, seg, rtype, payload, live)
            self._restore_messages(broker, live)
            result.messages = len(live)
        finally:
            self.recovering = False
        self.sizes = {int(p.stem): p.stat().st_size for p in self.dir.glob("*.seg")}
        if self.segments:
            self.active = next(reversed(self.segments))
            self.active_size = self.sizes.get(self.active, 0)
        else:
            self.active = self.offset + 1
            self.segments[self.active] = 0
        return result

    def _replay(
        self,
        broker: Broker,
        seg: int,
        rtype: int,
        payload: bytes,
        live: dict[tuple[str, str, int], tuple[int, bytes, bytes, bytes]],
    ) -> None:
        if rtype == DEFINE:
            rec = json.loads(payload)
            self._apply_define(broker, rec["vhost"], rec["op"], rec["body"], live)
        elif rtype == SNAPSHOT:
            self._apply_snapshot(broker, json.loads(payload), live)
        elif rtype == ENQUEUE:
            r = _Reader(payload)
            vhost, queue, mid = r.str(), r.str(), r.u64()
            route, props, body = r.bytes(), r.bytes(), r.bytes()
            live[(vhost, queue, mid)] = (seg, route, props, body)
        elif rtype == DEQUEUE:
            r = _Reader(payload)
            live.pop((r.str(), r.str(), r.u64()), None)
        else:
            log.error("unknown record type %d in the log, skipped", rtype)

    def _apply_define(
        self,
        broker: Broker,
        vhost_name: str,
        op: str,
        body: dict[str, Any],
        live: dict[tuple[str, str, int], Any],
    ) -> None:
        vh = broker.add_vhost(vhost_name)
        if op == "exchange.declare":
            if body["name"] not in vh.exchanges:
                vh.declare_exchange(
                    body["name"],
                    body["type"],
                    durable=True,
                    auto_delete=body["auto_delete"],
                    internal=body["internal"],
                    arguments=body["arguments"],
                )
        elif op == "exchange.delete":
            ex = vh.exchanges.get(body["name"])
            if ex is not None:
                vh.remove_exchange(ex)
        elif op == "queue.declare":
            if body["name"] not in vh.queues:
                vh.declare_queue(
                    body["name"],
                    durable=True,
                    auto_delete=body["auto_delete"],
                    arguments=body["arguments"],
                )
        elif op == "queue.delete":
            q = vh.queues.get(body["name"])
            if q is not None:
                vh.delete_queue(q)
            for key in [k for k in live if k[0] == vhost_name and k[1] == body["name"]]:
                del live[key]
        elif op in ("bind", "unbind"):
            dest = (vh.queues if body["destination_type"] == "queue" else vh.exchanges).get(
                body["destination"]
            )
            if dest is None or body["source"] not in vh.exchanges:
                return
            if op == "bind":
                vh.bind(body["source"], dest, body["routing_key"], body["arguments"])
            else:
                vh.unbind(body["source"], dest, body["routing_key"], body["arguments"])

    def _apply_snapshot(
        self, broker: Broker, snap: dict[str, Any], live: dict[tuple[str, str, int], Any]
    ) -> None:
        """A snapshot is authoritative: what it does not list was deleted."""
        for vname, defs in snap.get("vhosts", {}).items():
            vh = broker.add_vhost(vname)
            names = {q["name"] for q in defs["queues"]}
            for q in [q for q in vh.queues.values() if q.durable and q.name not in names]:
                self._apply_define(broker, vname, "queue.delete", {"name": q.name}, live)
            exnames = {e["name"] for e in defs["exchanges"]}
            for ex in [
                e
                for e in vh.exchanges.values()
                if e.durable and e.name and not e.name.startswith("amq.") and e.name not in exnames
            ]:
                vh.remove_exchange(ex)
            for e in defs["exchanges"]:
                self._apply_define(broker, vname, "exchange.declare", e, live)
            for q in defs["queues"]:
                self._apply_define(broker, vname, "queue.declare", q, live)
            for b in defs["bindings"]:
                self._apply_define(broker, vname, "bind", b, live)

    def _restore_messages(
        self, broker: Broker, live: dict[tuple[str, str, int], tuple[int, bytes, bytes, bytes]]
    ) -> None:
        from tandem.broker.model import message as message_mod

        for (vhost, queue, mid), (seg, route, props, body) in sorted(
            live.items(), key=lambda kv: kv[0][2]
        ):
            vh = broker.vhosts.get(vhost)
            q = vh.queues.get(queue) if vh is not None else None
            if q is None:
                continue
            elen = route[0]
            exchange = route[1 : 1 + elen].decode()
            rk = route[2 + elen :].decode()
            msg = Message(exchange, rk, route, props, body, len(body))
            try:
                message_mod.scan(msg)
            except ValueError:
                log.error(
                    "recovered message %d on queue '%s' has invalid properties; kept as it is",
                    mid,
                    queue,
                )
            msg.mid = mid
            msg.ts = q.vhost.clock()
            q.enqueue(msg)
            self.where[(vhost, queue, mid)] = seg
            self.segments[seg] = self.segments.get(seg, 0) + 1

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "segments": len(self.segments),
            "live_messages": len(self.where),
            "position": self.offset,
            "epoch": self.epoch,
        }
