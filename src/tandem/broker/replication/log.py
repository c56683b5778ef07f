"""The broker's log as the replication protocol sees it (`core.Log`).

Entries are record frames. The primary keeps the frames it shipped last in a window bounded
in bytes, so a member that comes back soon takes only what it lacks; one that has been away
longer, one whose log went past the primary's (it cannot be cut back: applied records are not
undone), and one that restarted (it lost what it held only in memory) take a full copy: the
replicated definitions, every message of every queue replicated `all` with its position, and
the marks of those delivered. A backup applies frames through the model's one apply path and
writes the durable ones to its own log as they came.
"""

from __future__ import annotations

import array
import base64
import binascii
import bisect
import collections
import functools
import heapq
import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from tandem.broker.model import apply, definitions, records
from tandem.broker.model import vhost as vhost_mod
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Page, Sequencer
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue
from tandem.broker.replication import core
from tandem.broker.store.files import sync_dir
from tandem.broker.store.log import Store, give_way

log = logging.getLogger(__name__)

WINDOW_BYTES: Final = 64 << 20
NOT_APPLIED_KEPT: Final = 20
# In the store's directory while a copy from the primary is written: a member killed before
# the copy is on disk recovers up to the copy's end but holds only part of it, so it must
# not say in brief what it holds (`digest`).
COPYING: Final = "copying"
# The first frame of a copy that is a difference, not everything.
DIFF: Final = records.define("", "difference", {})
_MESSAGE_RECORDS: Final = (records.ENQUEUE, records.DEQUEUE, records.MARK)


class BrokerLog:
    """Implements core.Log over the node's Sequencer, model and store."""

    def __init__(
        self,
        broker: Broker,
        sequencer: Sequencer,
        store: Store | None,
        *,
        window_bytes: int = WINDOW_BYTES,
        clock: Callable[[], float] = time.monotonic,
        predicted: tuple[int, core.Boundaries] | None = None,
    ) -> None:
        self.broker = broker
        self.sequencer = sequencer
        self.store = store
        # Until the store is loaded (`Member.loaded`), the end and boundaries its start is to
        # recover (`Store.predict`): what a restarted member tells its primary meanwhile.
        self.predicted = predicted
        # Frames shipped (as one buffer or as parts) or applied, newest last: (offset, frame,
        # when kept, the bytes kept before it since the log began).
        self.window: collections.deque[tuple[int, records.Framed, float, int]] = collections.deque()
        self.window_bytes = 0
        self.kept_bytes = 0  # bytes of all the frames ever kept
        self.window_limit = window_bytes
        self.clock = clock
        # A log recovered from disk names records that were only in memory (transient
        # messages on replicated queues): it is whole again once it took a full copy.
        # `restarted`: that is all it lost, so it holds exactly what its own durable records
        # say (`digest`), until anything else makes it not whole (`lost`).
        self._lost = self.end > 0
        self.restarted = self._lost and not (store is not None and (store.dir / COPYING).exists())
        self.on_checkpoint: Callable[[int, int, dict[str, Any]], object] = lambda e, o, b: None
        self.on_auth: Callable[[], None] = lambda: None  # users changed: save them
        self.drop_enqueues_to: str | None = None  # a test-only fault (see `drop_enqueues`)
        self.group: list[bytes] = []  # the frames of a group not yet complete
        self.not_applied: list[tuple[int, int, str]] = []  # (epoch, offset, what), the last few
        self.not_applied_total = 0
        # Why this member's state is not the primary's (a record it could not apply), until a
        # copy from the primary replaces it: /status, /metrics, and the controller's reason.
        self.diverged: str | None = None
        self.said: set[str] = set()  # the failures already logged
        self.installed = 0  # copies taken: with `end`, what names the state a digest is of
        self.captured = 0  # copies made for followers (`snapshot`)
        self.digested: tuple[tuple[int, int], dict[str, dict[str, list[list[Any]]]]] | None = None
        if store is not None:
            store.on_short_page = self.page_short

    # -- what the protocol reads --

    @property
    def end(self) -> int:
        predicted = self.predicted
        return self.sequencer.offset if predicted is None else predicted[0]

    @property
    def last_epoch(self) -> int:
        bounds = self.boundaries()
        return bounds[-1][0] if bounds else 0

    @property
    def whole(self) -> bool:
        return not self._lost

    @property
    def lost(self) -> bool:
        return self._lost

    @lost.setter
    def lost(self, value: bool) -> None:
        self._lost = value
        self.restarted = False  # whatever else happened, its state is not its log's alone

    @property
    def truncates(self) -> bool:
        return False

    def boundaries(self) -> core.Boundaries:
        predicted = self.predicted
        return tuple(self.sequencer.boundaries) if predicted is None else predicted[1]

    def keep(self, offset: int, data: records.Framed) -> None:
        """A frame shipped (or applied) at `offset`: keep it for members catching up."""
        size = len(data) if isinstance(data, bytes) else records.framed_size(data)
        self.window.append((offset, data, self.clock(), self.kept_bytes))
        self.window_bytes += size
        self.kept_bytes += size
        window = self.window
        while self.window_bytes > self.window_limit and len(window) > 1:
            self.window_bytes -= records.framed_size(window.popleft()[1])

    def since(self, offset: int) -> Sequence[records.Framed] | None:
        if offset >= self.end:
            return ()
        window = self.window
        if not window or window[0][0] > offset + 1:
            return None
        start = offset + 1 - window[0][0]
        return [entry[1] for entry in itertools.islice(window, start, None)]

    def bytes_after(self, offset: int) -> int:
        """The bytes of the frames kept after `offset`; all the window holds if it starts
        after it."""
        entry = self._kept_after(offset)
        return 0 if entry is None else self.kept_bytes - entry[3]

    def age(self, offset: int) -> float:
        """Seconds since the record after `offset` was shipped (0 when there is none)."""
        entry = self._kept_after(offset)
        return 0.0 if entry is None else self.clock() - entry[2]

    def _kept_after(self, offset: int) -> tuple[int, records.Framed, float, int] | None:
        """The window's entry for the record after `offset`, its first if it starts after
        that one; None when the window holds nothing after `offset`."""
        window = self.window
        if not window or offset >= self.end:
            return None
        index = offset + 1 - window[0][0]
        return window[max(0, index)] if index < len(window) else None

    def digest(self, brief: bool = False) -> Any:
        """What this member holds. `brief`, after a restart that lost only what was in
        memory: [RESTARTED, its log's end], for it holds exactly the persistent messages of
        durable queues that were there at that end, which a primary that holds what came
        since knows without a million ids (`snapshot`). Otherwise: for each queue replicated
        `all`, its message ids (a
        restarted member holds its persistent messages; the primary sends the rest). Ids are
        (epoch, offset) (records.mid): a message of a diverged suffix never passes for the
        primary's message at the same offset of a later epoch. Each queue's are [epoch,
        offsets] pairs, the offsets sorted, unsigned 64-bit big-endian, in base64: with a
        million messages, made, sent and read in a fraction of the time [first, last] runs
        of consecutive ids took (a queue's ids are rarely consecutive), on the primary's loop
        among others (docs/performance.md)."""
        if brief and self.restarted:
            return [RESTARTED, self.end]
        if self.predicted is not None:
            return None  # nothing loaded yet to name: the member says Hello once loaded
        state = (self.end, self.installed)
        if self.digested is not None and self.digested[0] == state:
            return self.digested[1]  # a Hello repeated while the follower waits for its copy
        out: dict[str, dict[str, list[list[Any]]]] = {}
        for vh in self.broker.vhosts.values():
            for q in vh.queues.values():
                if q.replicate == "all":
                    held = _packed(sorted(map(_MID, q.in_memory())))
                    for page in q.pages():  # by the ids it knows, not read back
                        held += self._page_packed(page, q)
                    out.setdefault(vh.name, {})[q.name] = held
        self.digested = (state, out)
        return out

    def _page_packed(self, page: Page, q: Queue) -> list[list[Any]]:
        """A page's ids as the digest says them (`_packed`); the digest is read as a set, so
        pages follow the queue's messages in memory in any order."""
        if page.ids is not None and not page.gone:
            return [_pair(epoch, array.array("Q", offsets)) for epoch, offsets in page.ids]
        mids = page.mids()
        if mids is None:  # a page that does not know its ids (not made by a member): read
            mids = [m.mid for m in self.sequencer.page_in(page, q, keep=True)]
        return _packed(sorted(mids))

    def snapshot(self, theirs: Any = None, agree: int = 0) -> Copy | None:
        """A copy of the replicated state at `end`: all of it, or, given a follower's digest,
        the definitions and what differs from what it holds. What it copies is captured
        now, in a few C-speed copies of each queue's messages; its frames are made when it
        is iterated, which the member does on another thread (`Copy`). None for a brief
        digest this log cannot use (`_since_restart`)."""
        restarted_at = _brief(theirs)
        if restarted_at is not None:
            theirs = self._since_restart(restarted_at, agree)
            if theirs is None:
                log.info(
                    "a follower restarted at offset %d: its digest is needed (our logs agree "
                    "up to %d; our window, a deleted queue or vhost since)",
                    restarted_at,
                    agree,
                )
                return None
            log.info(
                "a follower restarted at offset %d: the difference from it and the %d "
                "dequeues since, without its digest",
                restarted_at,
                len(theirs.dequeues),
            )
        sequencer = self.sequencer
        epoch = self.last_epoch
        self.captured += 1
        head = [
            records.frame(
                records.SNAPSHOT,
                epoch,
                self.end,
                records.encode_body(apply.durable_definitions(self.broker)),
            )
        ]
        auth = records.define("", "auth", definitions.export_auth(self.broker))
        head.append(records.frame(records.DEFINE, epoch, self.end, auth, False))
        queues: list[_Captured] = []
        pinned: list[Page] = []
        for vh in self.broker.vhosts.values():
            for ex in vh.exchanges.values():
                if not ex.durable and ex.name:
                    body = records.define(vh.name, "exchange.declare", vh.exchange_body(ex))
                    head.append(records.frame(records.DEFINE, epoch, self.end, body, False))
            for q in vh.queues.values():
                if not q.durable and q.replicate != "none":
                    body = records.define(vh.name, "queue.declare", vh.queue_body(q))
                    head.append(records.frame(records.DEFINE, epoch, self.end, body, False))
            for b in vh.bindings():
                durable = b.source.durable and b.destination.durable
                if not durable and vhost_mod.replicated(b):
                    body = records.define(vh.name, "bind", vh.binding_body(b))
                    head.append(records.frame(records.DEFINE, epoch, self.end, body, False))
            for q in vh.queues.values():
                if q.replicate == "all":
                    # A page held in memory is copied as its messages; the others are read
                    # on the copy's thread, for what the follower lacks, their segments
                    # pinned meanwhile.
                    pages = [(p, _held(p)) for p in q.pages()]
                    pinned += [p for p, kept in pages if kept is None]
                    queues.append(
                        (vh.name, q.name, q.durable, q.in_memory(), dict(q.outstanding), pages, q)
                    )
        if self.store is not None:
            self.store.pin(pinned)
        bounds = tuple(sequencer.boundaries)
        return Copy(head, queues, theirs, bounds, epoch, self.end, self.store, pinned)

    def _since_restart(self, end: int, agree: int) -> Restarted | None:
        """What a follower that restarted at `end` lacks, told by this log: every message
        but the persistent ones of durable queues enqueued up to `end`, and of those, the
        ones removed since (the durable DEQUEUE records after `end`). None when that cannot
        be known here: its log went past the point where ours agrees with it, the window no
        longer holds what came after it, or a queue or vhost was deleted since (a queue of
        the same name may hold other messages now; its DEQUEUE records do not say). A
        message routed to several queues has the id of its first ENQUEUE record: the
        follower lacks it in the queues whose records came after `end` (its log may end
        between them), which the ENQUEUE records since say."""
        kept = self.since(end) if agree == end else None
        if kept is None:
            return None
        # A large record was kept as its parts (`records.Framed`): joined here, on a
        # member's return, not for each record shipped.
        frames = [data if isinstance(data, bytes) else b"".join(data) for data in kept]
        at = records.HDR_SIZE
        dequeues: list[bytes] = []
        enqueues: list[bytes] = []
        for data in frames:
            flags = data[at]
            rtype = flags & records.TYPE_MASK
            if rtype == records.DEQUEUE:
                if flags & records.DURABLE:
                    dequeues.append(data)
            elif rtype == records.ENQUEUE:
                enqueues.append(data)
            elif rtype == records.SNAPSHOT:
                return None
            elif rtype == records.DEFINE and b".delete" in data:
                op = records.decode_body(records.payload(data)).get("op")
                if op in ("queue.delete", "vhost.delete"):
                    return None
        return Restarted(end, dequeues, enqueues, frames)

    # -- what the protocol writes (on a backup) --

    def truncate(self, offset: int) -> None:
        if offset != self.end:
            raise AssertionError("a broker log is never cut back; the primary sends a full copy")

    def extend(self, entries: Sequence[bytes]) -> None:
        take, group = self._take, self.group
        for data in entries:
            if data[records.HDR_SIZE] & records.MORE:  # records.continues
                group.append(data)  # a group is applied once its last record came
            elif group:
                group.append(data)
                whole, self.group = group, []  # taken once, whatever happens while taking
                group = self.group
                for member in whole:
                    take(member)
            else:
                take(data)

    def drop_enqueues(self, queue: str) -> None:
        """A fault for tests of the audit: as a backup, take (and store) every enqueue to
        `queue` without applying it to the model, so this member's depth of it diverges from
        the primary's while its log position keeps up. Set by
        TANDEM_TEST_FAULT_DROP_ENQUEUES=node:queue (node `*`: any member); never in use."""
        log.warning("TEST FAULT: this member drops every enqueue to %r it takes", queue)
        self.drop_enqueues_to = queue

    def _dropped(self, rtype: int, payload: bytes) -> bool:
        return (
            self.drop_enqueues_to is not None
            and rtype == records.ENQUEUE
            and records.read_key(payload)[1] == self.drop_enqueues_to
        )

    def _take(self, data: bytes) -> None:
        """Store, apply and keep one of the primary's frames. A message record is read once,
        for the store's index and for apply; the others take the general path."""
        rtype, epoch, offset, durable = records.head(data)
        sequencer, store = self.sequencer, self.store
        bounds = sequencer.boundaries
        if store is not None and (not bounds or bounds[-1][0] != epoch):
            store.boundary(epoch, offset)
        # Only an enqueue the test fault may drop takes the general path (`_dropped`).
        if rtype in _MESSAGE_RECORDS and (
            self.drop_enqueues_to is None or rtype != records.ENQUEUE
        ):
            self._take_message(data, rtype, epoch, offset, durable)
        else:
            self._take_other(data, rtype, epoch, offset, durable)
        sequencer.follow(epoch, offset)
        self.keep(offset, data)

    def _take_message(
        self, data: bytes, rtype: int, epoch: int, offset: int, durable: bool
    ) -> None:
        payload = data[records.HEADER :]
        try:
            if rtype == records.ENQUEUE:
                fields = records.read_enqueue(payload)
                key: tuple[str, str, int] = fields[:3]
            else:
                key = records.read_key(payload)
        except Exception as exc:
            self._not_read(data, rtype, epoch, offset, durable, exc)
            return
        # An enqueue is stored first (the queue may leave the message in the log at once); a
        # dequeue after it applied (a paged message is read back first, and the store then
        # knows where its record is, which the dequeue cancels, as recovery does).
        store = self.store if durable else None
        if store is not None and rtype != records.DEQUEUE:
            store.write(rtype, offset, data, key)
        try:
            # Arguments named one by one: a call with *fields is a generic call when compiled.
            vhost, queue, mid = key
            if rtype == records.ENQUEUE:
                apply.enqueue(self.broker, vhost, queue, mid, fields[3], fields[4], fields[5])
            elif rtype == records.DEQUEUE:
                apply.dequeue(self.broker, vhost, queue, mid)
            else:
                apply.mark(self.broker, vhost, queue, mid)
        except Exception as exc:  # whatever failed, it is this record's failure
            self._not_applied(epoch, offset, rtype, payload, exc)
        if store is not None and rtype == records.DEQUEUE:
            store.write(rtype, offset, data, key)

    def _not_read(
        self, data: bytes, rtype: int, epoch: int, offset: int, durable: bool, exc: Exception
    ) -> None:
        """A message record that cannot be read, not a record of ours: written as it came,
        and set aside."""
        if durable and self.store is not None:
            self.store.write(rtype, offset, data, None)
        self._not_applied(epoch, offset, rtype, records.payload(data), exc)

    def _take_other(self, data: bytes, rtype: int, epoch: int, offset: int, durable: bool) -> None:
        payload = records.payload(data)
        # A definition's or a checkpoint's JSON, read once for the store and the hooks.
        rec = (
            records.decode_body(payload) if rtype in (records.DEFINE, records.CHECKPOINT) else None
        )
        store = self.store
        if durable and store is not None:
            key = None
            if rtype == records.ENQUEUE:
                key = records.read_key(payload)
            elif rec is not None and rec["op"] == "queue.delete":
                store.forget_queue(rec["vhost"], rec["body"]["name"])
            store.write(rtype, offset, data, key)
        if not self._dropped(rtype, payload):
            self._apply(epoch, offset, rtype, payload)
        if rtype == records.CHECKPOINT and rec is not None:
            self.on_checkpoint(epoch, offset, rec.get("body") or {})
        elif rec is not None and rec.get("op") == "auth":
            self.on_auth()

    def _apply(self, epoch: int, offset: int, rtype: int, payload: bytes) -> None:
        """Apply one of the primary's records; one that cannot be applied (a bug) is set
        aside."""
        try:
            apply.apply(self.broker, rtype, payload)
        except apply.NotApplied as exc:
            self._set_aside(epoch, offset, exc)

    def _not_applied(
        self, epoch: int, offset: int, rtype: int, payload: bytes, exc: Exception
    ) -> None:
        self._set_aside(epoch, offset, apply.failed(rtype, payload, exc))

    def page_short(self, what: str) -> None:
        """A page of this member's log read back short (a corrupt record): its state lacks
        messages the primary holds, and it is whole again once a copy brought them back."""
        if self.sequencer.shipper is not None:
            return  # the primary's: logged by the store; the backups hold the message
        log.error("%s; this member takes a copy from the primary", what)
        self.diverged = what
        self.lost = True
        self.digested = None  # it no longer holds what a digest made before says

    def _set_aside(self, epoch: int, offset: int, exc: apply.NotApplied) -> None:
        """Report a record that could not be applied once with its position, keep it in
        `not_applied` for /status, and make this member's state suspect: it is not whole
        until a copy from the primary replaces it."""
        said = str(exc) in self.said
        self.said.add(str(exc))
        # Said once: a copy that fails on the same record again is logged at debug level.
        log.log(
            logging.DEBUG if said else logging.ERROR,
            "record (%d, %d) from the primary not applied, set aside: %s; this member "
            "takes a copy from the primary",
            epoch,
            offset,
            exc,
        )
        self.not_applied.append((epoch, offset, str(exc)))
        del self.not_applied[:-NOT_APPLIED_KEPT]
        self.not_applied_total += 1
        self.diverged = f"record {epoch}:{offset} not applied: {exc}"
        self.lost = True

    def install(self, boundaries: core.Boundaries, end: int, snapshot: Any) -> None:
        """Take the primary's copy (made at `end`): the difference from what this member
        holds (its log is a prefix of the primary's), or everything."""
        frames: list[bytes] = list(snapshot)
        self.installed += 1
        self.lost = False  # unless a record of the copy does not apply
        self.diverged = None
        self._copying(True)
        if frames and records.payload(frames[0]) == DIFF:
            self._install_difference(boundaries, end, frames[1:])
        else:
            self._install_all(boundaries, end, frames)
        if self.store is not None:
            self.store.when_synced(lambda: self._copying(False))
        self.on_auth()

    def _copying(self, on: bool) -> None:
        """Mark the store as taking a copy (COPYING) until what it wrote is on disk."""
        store = self.store
        if store is None or store.closed:
            return
        marker = store.dir / COPYING
        if not on:
            marker.unlink(missing_ok=True)
            return
        marker.touch()
        if store.fsync:
            sync_dir(store.dir)  # on disk before any frame of the copy is

    def _install_difference(
        self, boundaries: core.Boundaries, end: int, frames: list[bytes]
    ) -> None:
        """Apply the difference on top of what this member holds. If its log is a prefix of
        the primary's, the durable part is written after it; if the log went past the point
        where the two agree, its records are not the cluster's history: the log starts over
        with what the member now holds, written here rather than sent."""
        diverged = core.agreement(self.boundaries(), self.end, boundaries, end) < self.end
        store = self.store
        self._apply_copy(frames)
        if store is not None:
            store.forget_gone()  # the queues the copy's definitions deleted
        self.sequencer.reset(boundaries, end)
        if store is not None and diverged:
            for vh in self.broker.vhosts.values():
                for q in vh.queues.values():
                    q.page_in_all()  # the log the pages are in starts over
            store.reset(list(boundaries))
            for data in self._durable_state(boundaries, end):
                rtype, _epoch, offset, _durable = records.head(data)
                payload = records.payload(data)
                key = records.read_key(payload) if rtype == records.ENQUEUE else None
                store.write(rtype, offset, data, key)
            store.checkpoint()  # or the next start replays all that again
        elif store is not None:
            store.set_boundaries(list(boundaries))
        log.info(
            "took the difference from the primary: %d records up to offset %d%s",
            len(frames),
            end,
            "; the log starts over from what this node holds" if diverged else "",
        )

    def _apply_copy(self, frames: list[bytes]) -> None:
        """Apply a copy's frames, writing the durable ones; what was kept for catch-up goes.
        A message's frame is read once, for the store and for the model, as the frames that
        follow the copy are (`_take_message`): read twice, an ENQUEUE's names were decoded
        twice, a hundred thousand times for a member that restarted under load."""
        self.window.clear()
        self.window_bytes = 0
        self.group.clear()
        # Dequeues, applied a queue at a time, then stored (see _take_message).
        gone: dict[tuple[str, str], list[int]] = {}
        unstored: list[tuple[int, bytes, tuple[str, str, int]]] = []
        store = self.store
        for data in frames:
            rtype, epoch, offset, durable = records.head(data)
            if rtype == records.DEQUEUE:
                try:
                    vhost, queue, mid = key = records.read_key(records.payload(data))
                except Exception as exc:
                    self._not_read(data, rtype, epoch, offset, durable, exc)
                    continue
                gone.setdefault((vhost, queue), []).append(mid)
                if durable and store is not None:
                    unstored.append((offset, data, key))
                continue
            self._dequeue_many(gone, unstored)
            if rtype in _MESSAGE_RECORDS:  # an ENQUEUE or a MARK: read once, as one shipped
                self._take_message(data, rtype, epoch, offset, durable)
                continue
            if durable and store is not None:
                store.write(rtype, offset, data, None)
            self._apply(epoch, offset, rtype, records.payload(data))
        self._dequeue_many(gone, unstored)

    def _dequeue_many(
        self,
        gone: dict[tuple[str, str], list[int]],
        unstored: list[tuple[int, bytes, tuple[str, str, int]]],
    ) -> None:
        """Apply a copy's dequeues gathered so far, then store them."""
        if gone:
            apply.dequeue_many(self.broker, gone)
            gone.clear()
        if unstored and self.store is not None:
            for offset, data, key in unstored:
                self.store.write(records.DEQUEUE, offset, data, key)
            unstored.clear()

    def _durable_state(self, boundaries: core.Boundaries, end: int) -> list[bytes]:
        """This member's durable state as frames: the durable definitions, then every
        persistent message of every durable queue at its own position."""
        last = boundaries[-1][0] if boundaries else 0
        body = records.encode_body(apply.durable_definitions(self.broker))
        out = [records.frame(records.SNAPSHOT, last, end, body)]
        for vh in self.broker.vhosts.values():
            for q in vh.queues.values():
                if not q.durable:
                    continue
                for m in sorted(q.in_memory(), key=lambda m: m.mid):
                    if m.persistent:
                        payload = records.enqueue(vh.name, q.name, m)
                        epoch, offset = _position_of(boundaries, m.mid, last)
                        out.append(records.frame(records.ENQUEUE, epoch, offset, payload))
        return out

    def _install_all(self, boundaries: core.Boundaries, end: int, snapshot: list[bytes]) -> None:
        """Replace the whole state and log with the primary's copy."""
        broker, sequencer = self.broker, self.sequencer
        for name in list(broker.vhosts):
            vh = broker.vhosts[name]
            for q in list(vh.queues.values()):
                vh.delete_queue(q)
            for ex in [
                e for e in vh.exchanges.values() if e.name and not e.name.startswith("amq.")
            ]:
                vh.remove_exchange(ex)
        if self.store is not None:
            self.store.reset(list(boundaries))
        self._apply_copy(snapshot)
        sequencer.reset(boundaries, end)
        if self.store is not None:
            self.store.checkpoint()  # or the next start replays the whole copy again
        log.info(
            "took a full copy from the primary: %d records up to offset %d", len(snapshot), end
        )


# A queue as a copy captures it: vhost, name, durable, its messages in memory, those
# delivered, its pages (each with its messages when it holds them in memory), the queue.
_Paged = list[tuple[Page, list[Message] | None]]
_Captured = tuple[str, str, bool, list[Message], dict[int, Message], _Paged, Queue]


class Copy:
    """A copy of the primary's replicated state at one offset, as frames once iterated.

    `BrokerLog.snapshot` captures, on the loop, what the copy is of: the definitions as
    frames, and each queue's messages and delivered messages in lists of their own. Making
    the frames (reading the follower's digest, sorting, encoding a million messages) then
    needs nothing the loop changes, so the member does it on another thread while the
    primary goes on serving: a copy of a deep queue took the loop seconds, long enough for
    the controller to fail the primary over, again at every copy (docs/failover.md). Each
    message's frame is made from the message itself, so a mark set after the capture may
    be in the copy as well as in the Append that follows it; marks are idempotent."""

    def __init__(
        self,
        head: list[bytes],
        queues: list[_Captured],
        theirs: Any,
        bounds: core.Boundaries,
        epoch: int,
        end: int,
        store: Store | None = None,
        pinned: list[Page] | None = None,
    ) -> None:
        self.head, self.queues, self.theirs = head, queues, theirs
        self.bounds, self.epoch, self.end = bounds, epoch, end
        # The store the pages are read from, and the pages pinned until the copy is made.
        self.store = store
        self.pinned = pinned or []

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.frames())

    def release(self) -> None:
        """The copy is made, or will not be: its pages' segments are unpinned, on the loop."""
        pinned, self.pinned = self.pinned, []
        store = self.store
        if not pinned or store is None:
            return
        loop = store.loop
        if loop is None or loop.is_closed():
            store.unpin(pinned)
        else:
            loop.call_soon_threadsafe(store.unpin, pinned)

    def frames(self) -> list[bytes]:
        try:
            return self._frames()
        finally:
            self.release()

    def _frames(self) -> list[bytes]:
        restarted = self.theirs if isinstance(self.theirs, Restarted) else None
        if restarted is not None:
            return self._restarted_frames(restarted)
        digest = _parse_digest(self.theirs)
        out = (
            []
            if digest is None
            else [records.frame(records.DEFINE, self.epoch, self.end, DIFF, False)]
        )
        out += self.head
        for vhost, queue, durable_q, messages, outstanding, pages, q in self.queues:
            theirs_q = None if digest is None else digest.get((vhost, queue), set())
            ours = messages + list(outstanding.values())
            paged: list[list[int]] = []  # each page's ids
            for page, kept in pages:
                _look(page.count)
                mids = page.mids()
                if kept is None and mids is not None and not page.marked and _holds(theirs_q, mids):
                    paged.append(mids)  # the follower holds all of it: not read
                    continue
                give_way(page.count)
                msgs = self._page_messages(page, kept, q)
                paged.append(mids if mids is not None else [m.mid for m in msgs])
                ours += msgs
            if theirs_q is not None:  # only what they lack or what carries a mark
                lacked: list[Message] = []
                for at in range(0, len(ours), _SLICE):
                    _look(min(_SLICE, len(ours) - at))
                    lacked += [
                        m
                        for m in ours[at : at + _SLICE]
                        if m.mid not in theirs_q or m.redelivered or m.mid in outstanding
                    ]
                ours = lacked
            held = None if theirs_q is None else _in(theirs_q)
            self._message_frames(out, vhost, queue, durable_q, ours, outstanding, held)
            if theirs_q:
                gone = theirs_q  # read no more: what is left of it is what went
                for at in range(0, len(messages), _SLICE):
                    _look(min(_SLICE, len(messages) - at))
                    gone.difference_update(map(_MID, messages[at : at + _SLICE]))
                gone.difference_update(outstanding)
                for mids in paged:
                    gone.difference_update(mids)
                self._dequeue_frames(out, vhost, queue, gone, durable_q)
        return out

    def _page_messages(self, page: Page, kept: list[Message] | None, q: Queue) -> list[Message]:
        """A captured page's messages: those it held in memory, or read on this thread."""
        if kept is not None:
            return kept
        assert self.store is not None
        return self.store.read_copy(page, q)

    def _message_frames(
        self,
        out: list[bytes],
        vhost: str,
        queue: str,
        durable_q: bool,
        msgs: list[Message],
        outstanding: dict[int, Message],
        held: Callable[[Message], bool] | None,
        restarted: Restarted | None = None,
    ) -> None:
        """Append the frames of one queue's `msgs`, in id order: an ENQUEUE at its own
        position for each the follower does not hold (`held`; None: it holds none), and a
        MARK for each delivered or redelivered. A follower that restarted (`restarted`) is
        sent the very frame this log shipped for a message enqueued after its end, where
        there is one (`Restarted.shipped`): what a frame says of its message never
        changes."""
        epoch, bounds = self.epoch, self.bounds
        where = records.place(vhost, queue)
        for i, m in enumerate(_by_mid(msgs)):
            if not i % _SLICE:
                give_way(min(_SLICE, len(msgs) - i))
            e, o = _position_of(bounds, m.mid, epoch)
            if held is None or not held(m):
                durable = m.persistent and durable_q
                data = None if restarted is None else restarted.shipped(where, e, o, durable)
                if data is None:
                    payload = records.enqueue_at(where, m)
                    data = records.frame(records.ENQUEUE, e, o, payload, durable)
                out.append(data)
            if m.redelivered or m.mid in outstanding:
                key = records.key_at(where, m.mid)
                out.append(records.frame(records.MARK, e, o, key, False))

    def _dequeue_frames(
        self, out: list[bytes], vhost: str, queue: str, mids: set[int], durable_q: bool
    ) -> None:
        """Append a DEQUEUE of each of `mids`, which the follower holds and we do not
        (consumed since its log ends), at the copy's end."""
        for mid in sorted(mids):
            key = records.key(vhost, queue, mid)
            out.append(records.frame(records.DEQUEUE, self.epoch, self.end, key, durable_q))

    def _restarted_frames(self, restarted: Restarted) -> list[bytes]:
        """The difference for a follower that restarted at `restarted.end`: it holds the
        persistent messages of durable queues enqueued up to there, less those removed
        since. A page (persistent messages of a durable queue only) it holds whole is not
        read."""
        upto = restarted.end
        gone, later = restarted.removed(), restarted.later()
        out = [records.frame(records.DEFINE, self.epoch, self.end, DIFF, False), *self.head]
        for vhost, queue, durable_q, messages, outstanding, pages, q in self.queues:
            ours = messages + list(outstanding.values())
            # Dropped at the follower's start, unrecorded (as RabbitMQ's): none of it held.
            kept_q = durable_q and q.exclusive_owner is None
            lacking = later.get((vhost, queue), set())
            for page, kept in pages:
                _look(page.count)
                mids = page.mids()
                if (
                    kept is None
                    and mids is not None
                    and kept_q
                    and not page.marked  # its marks are sent (read below)
                    and _before(mids, upto)
                    and lacking.isdisjoint(mids)
                ):
                    continue  # the follower holds all of it
                give_way(page.count)
                ours += self._page_messages(page, kept, q)
            lacked: list[Message] = []
            for at in range(0, len(ours), _SLICE):
                _look(min(_SLICE, len(ours) - at))
                part = ours[at : at + _SLICE]
                lacked += _lacked(part, upto, lacking, outstanding) if kept_q else part
            held = functools.partial(_kept, kept_q=kept_q, upto=upto, lacking=lacking)
            self._message_frames(out, vhost, queue, durable_q, lacked, outstanding, held, restarted)
            if kept_q:  # a durable queue: its DEQUEUE records are durable
                removed = gone.get((vhost, queue), set()) - lacking
                self._dequeue_frames(out, vhost, queue, removed, durable_q)
        return out


class Restarted:
    """What a primary knows of a follower that restarted at `end` (`BrokerLog.digest`,
    brief): the durable DEQUEUE records it took since, read on the copy's thread."""

    def __init__(
        self, end: int, dequeues: list[bytes], enqueues: list[bytes], since: Sequence[bytes]
    ) -> None:
        self.end = end
        self.dequeues = dequeues
        self.enqueues = enqueues
        self.since = since  # every frame after `end`, the one at offset end + 1 first

    def shipped(self, where: bytes, epoch: int, offset: int, durable: bool) -> bytes | None:
        """The ENQUEUE frame this log shipped at (`epoch`, `offset`) to the queue at `where`
        (`records.place`), when it is what the copy would make again for the message whose
        id is that position: framed alone (not in a group) and `durable` as the copy says.
        None otherwise (a message routed to several queues has one id and a record for
        each; the record at its id is the first queue's). Made again, such a frame cost a
        copy 2-4 microseconds a message, and a member that restarted under load lacks a
        hundred thousand of them (docs/performance.md)."""
        at = offset - self.end - 1
        if at < 0 or at >= len(self.since):
            return None
        data = self.since[at]
        rtype, e, o, d = records.head(data)
        if (
            rtype != records.ENQUEUE
            or e != epoch
            or o != offset
            or d != durable
            or records.continues(data)
            or not data.startswith(where, records.HEADER)
            or records.id_offset(data) != offset  # a message's id is its first record's
        ):
            return None
        return data

    def removed(self) -> dict[tuple[str, str], set[int]]:
        """By queue, the messages the follower held at its end that are gone since."""
        return self._before_end(self.dequeues)

    def later(self) -> dict[tuple[str, str], set[int]]:
        """By queue, the messages with ids from before the follower's end that entered it
        after: routed to several queues, the follower holds them in the first only."""
        return self._before_end(self.enqueues)

    def _before_end(self, frames: list[bytes]) -> dict[tuple[str, str], set[int]]:
        """By queue, the ids up to the follower's end that `frames` (message records)
        name."""
        out: dict[tuple[str, str], set[int]] = {}
        upto = self.end
        for i, data in enumerate(frames):
            if not i % _SLICE:
                give_way(min(_SLICE, len(frames) - i))
            if records.id_offset(data) > upto:
                continue  # most: the follower never held it (read in place, not decoded)
            vhost, queue, mid = records.read_key(records.payload(data))
            out.setdefault((vhost, queue), set()).add(mid)
        return out


# A brief digest (`BrokerLog.digest`): a list, which a primary that does not read it takes
# for no digest at all (a full copy).
RESTARTED: Final = "restarted"


def _brief(theirs: Any) -> int | None:
    """The end of a brief digest's log, or None when `theirs` is not one."""
    if (
        isinstance(theirs, list)
        and len(theirs) == 2
        and theirs[0] == RESTARTED
        and isinstance(theirs[1], int)
        and theirs[1] >= 0
    ):
        return theirs[1]
    return None


def _kept(m: Message, kept_q: bool, upto: int, lacking: set[int]) -> bool:
    """True when a follower that restarted at `upto` holds `m` (`Copy._restarted_frames`):
    persistent, in a durable queue its start kept, and enqueued there by then."""
    return kept_q and m.persistent and m.mid & records.OFFSET_MASK <= upto and m.mid not in lacking


def _lacked(
    msgs: list[Message], upto: int, lacking: set[int], outstanding: dict[int, Message]
) -> list[Message]:
    """Those of a durable queue's `msgs` that a follower restarted at `upto` does not hold
    (`_kept`), or holds without the mark it should have. A message at a time, a million
    for a deep queue: an id's offset is not taken out of it (a new int each), but the id
    compared with the ids of its epoch held, which change only with the epoch."""
    out: list[Message] = []
    low = top = high = -1  # the ids of the epoch of the message before: [low, top), held to high
    for m in msgs:
        mid = m.mid
        if mid < low or mid >= top:
            low = mid >> records.OFFSET_BITS << records.OFFSET_BITS
            top = low + (1 << records.OFFSET_BITS)
            high = low | upto
        if (
            mid > high
            or not m.persistent
            or m.redelivered
            or (lacking and mid in lacking)
            or (outstanding and mid in outstanding)
        ):
            out.append(m)
    return out


def _in(mids: set[int]) -> Callable[[Message], bool]:
    """Whether a message is one of `mids` (a follower's digest of a queue)."""
    return lambda m: m.mid in mids


def _before(mids: list[int], upto: int) -> bool:
    """True when every one of `mids` was enqueued at or before offset `upto`."""
    return all(mid & records.OFFSET_MASK <= upto for mid in mids)


def _holds(theirs: set[int] | None, mids: list[int]) -> bool:
    """True when a follower's digest (`theirs`) names every one of `mids`."""
    return theirs is not None and all(map(theirs.__contains__, mids))


def _held(page: Page) -> list[Message] | None:
    """A page's messages when the store holds them in memory."""
    return None if page.held is None else [m for m, _at in page.held]


def _by_mid(messages: list[Message]) -> list[Message]:
    """`messages` in id order, a slice at a time (see _SLICE): a queue's messages usually
    are already, and one sort of a million held the loop a tenth of a second."""
    for at in range(0, len(messages), _SLICE):
        give_way(min(_SLICE, len(messages) - at))
        part = messages[at : at + _SLICE + 1]
        if not all(a.mid < b.mid for a, b in itertools.pairwise(part)):
            break
    else:
        return messages
    runs = [sorted(messages[at : at + _SLICE], key=_MID) for at in range(0, len(messages), _SLICE)]
    return runs[0] if len(runs) == 1 else list(heapq.merge(*runs, key=_MID))


def _position_of(bounds: core.Boundaries, message_id: int, default: int) -> tuple[int, int]:
    """The (epoch, offset) of the record that enqueued a message: its id says both, but an
    id from before epochs were part of it (epoch 0) says only the offset."""
    offset = records.mid_offset(message_id)
    return records.mid_epoch(message_id) or _epoch_at(bounds, offset, default), offset


def _epoch_at(bounds: core.Boundaries, offset: int, default: int) -> int:
    """The epoch of the record at `offset`, by where each epoch began."""
    found = bounds[0][0] if bounds else default
    for e, first in bounds:
        if first > offset:
            break
        found = e
    return found


_MID: Final = operator.attrgetter("mid")
# A copy is made on another thread, and a thread lets the loop run only between bytecodes:
# a set built from two million ids in one call held the loop 0.2-0.4 s. Such calls take
# this many at a time, and between them the thread gives the loop its turn (`give_way`,
# which counts the work: a queue or page of a few messages is not a turn of its own). Not
# Final, as the other constants are: a test makes it small to cross slices.
_SLICE = 1 << 16
# A message only looked at (its id compared, or put in a set or taken out), not encoded or
# read back, counts as this share of one (`give_way`). Counted whole, a copy for a member
# that restarted with a deep queue, which looks at each of its million messages and encodes
# few, gave the loop 25 turns of 11 ms each: 0.3 s of its 0.45.
_LOOKED: Final = 16
_looked = 0  # messages looked at and not yet counted (`_look`)


def _look(count: int) -> None:
    """Count `count` messages only looked at, a sixteenth each, for `give_way`; what is
    left over is counted with the next ones, so that ten thousand queues of ten messages
    count as a hundred thousand messages do."""
    global _looked
    _looked += count
    if _looked >= _LOOKED:
        give_way(_looked // _LOOKED)
        _looked %= _LOOKED


_BIG: Final = array.array("H", [1]).tobytes() == b"\x00\x01"
_EPOCHS: Final = 1 << 32  # a record's epoch is an unsigned 32-bit field (records.key)


def _packed(mids: list[int]) -> list[list[Any]]:
    """Sorted ids as [epoch, base64 of its offsets as big-endian uint64] pairs."""
    out: list[list[Any]] = []
    start, mask = 0, records.OFFSET_MASK
    while start < len(mids):
        epoch = records.mid_epoch(mids[start])
        end = bisect.bisect_left(mids, (epoch + 1) << records.OFFSET_BITS, start)
        out.append(_pair(epoch, array.array("Q", [m & mask for m in mids[start:end]])))
        start = end
    return out


def _pair(epoch: int, offsets: array.array[int]) -> list[Any]:
    """[epoch, base64 of `offsets` as big-endian uint64], as a digest says ids; `offsets`
    may be changed."""
    if not _BIG:
        offsets.byteswap()
    return [epoch, base64.b64encode(offsets).decode()]


def _parse_digest(theirs: Any) -> dict[tuple[str, str], set[int]] | None:
    """A follower's digest as sets of ids per queue; None (send everything) when absent or
    not as `BrokerLog.digest` writes it. A member of an earlier version sends [first, last]
    runs of ids, read as such."""
    if not isinstance(theirs, dict):
        return None
    out: dict[tuple[str, str], set[int]] = {}
    try:
        for vhost, queues in theirs.items():
            for queue, held in queues.items():
                ids: set[int] = set()
                for first, rest in held:
                    if isinstance(rest, str):  # an epoch and its offsets
                        epoch = int(first)
                        if not 0 <= epoch < _EPOCHS:
                            return None
                        offsets = array.array("Q", base64.b64decode(rest, validate=True))
                        if not _BIG:
                            offsets.byteswap()
                        high = epoch << records.OFFSET_BITS
                        for at in range(0, len(offsets), _SLICE):  # see _SLICE
                            give_way(min(_SLICE, len(offsets) - at))
                            ids.update(map(high.__or__, offsets[at : at + _SLICE]))
                    else:
                        low, high = int(first), int(rest)
                        if not 0 <= low <= high < _EPOCHS << records.OFFSET_BITS:
                            return None
                        ids.update(range(low, high + 1))
                out[(str(vhost), str(queue))] = ids
    except (AttributeError, TypeError, ValueError, OverflowError, binascii.Error):
        return None
    return out
