"""The Journal port, where the model records its changes, and the Sequencer that implements it.

Every change to replicated state becomes a record with its (epoch, offset), given by the one
Sequencer of the node (DESIGN.md, "The log"). Each record says whether it is durable: the
store (the `Disk` port) writes the durable ones; replication (the `Shipper` port) ships them
all. A confirm waits, through `when_done`, until what it depends on is on disk and held by the
in-sync set.

Which changes take a position:
- a durable one (a persistent message on a durable queue, a durable declaration) always;
- on a node that ships (a cluster member), also every change to a queue replicated `all`
  (transient messages and delivery marks included) and every declaration. A durable change to
  a queue that is not replicated is shipped as a NOOP, so that positions stay the same on
  every member.
A lone node's transient changes take no position: nobody could ask for them.

While the model replays records (recovery, or a backup applying the primary's stream), the
Sequencer is `applying` and records nothing: the records already exist.
"""

from __future__ import annotations

import array
import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from tandem.broker.model import records

if TYPE_CHECKING:
    from tandem.broker.model.message import Message
    from tandem.broker.model.queue import Queue

log = logging.getLogger(__name__)

Boundaries = tuple[tuple[int, int], ...]  # (epoch, first offset), in order

NOOP_PAYLOAD: Final = b""
# A record of a group not yet emitted: type, offset, payload, durable, replicated, key.
Pending = tuple[int, int, bytes | list[bytes], bool, bool, tuple[str, str, int] | None]


class Page:
    """A run of a queue's ready messages that stay in the log, not in memory (a queue deeper
    than its memory budget): the store made it from the messages' ENQUEUE records and reads
    them back when the queue's head runs low. The queue sees its size and its first and last
    message ids; the rest is the store's.

    On a cluster member a page also knows its messages' ids (`ids`, 8 bytes each), which
    the member's digest and the primary's copy compare without reading the page back. A
    page that knows its ids (those, or a checkpoint's `only`) also takes a record that
    removes or marks one of them without being read (`forget`, `mark`): a backup applies
    the dequeues of messages its primary delivered from a deep queue, and a restarted member
    those of the busy queue its start left as pages, and read every page back to drop it.
    A message forgotten keeps its record in the log, and its bytes in `body_bytes`, until
    the page is read back or gone."""

    __slots__ = (
        "body_bytes",
        "count",
        "extents",
        "first_mid",
        "gone",
        "held",
        "ids",
        "key",
        "known",
        "last_mid",
        "marked",
        "only",
        "segs",
    )

    def __init__(
        self, key: tuple[str, str], count: int, body_bytes: int, first_mid: int, last_mid: int
    ) -> None:
        self.key = key  # (vhost, queue)
        self.count = count
        self.body_bytes = body_bytes
        self.first_mid = first_mid
        self.last_mid = last_mid
        # The store's: (segment, first byte, end byte) runs holding the records, the
        # records per segment, and the messages themselves until their records are written.
        self.extents: list[tuple[int, int, int]] = []
        self.segs: dict[int, int] = {}
        self.held: list[tuple[Message, int]] | None = None
        # A page made at recovery from a checkpoint's messages: exactly these ids (and their
        # places), where its runs may also hold records of messages consumed since.
        self.only: dict[int, int] | None = None
        # Its messages' ids as (epoch, offsets) pairs (`pack_ids`), where they are kept.
        self.ids: list[tuple[int, array.array[int]]] | None = None
        # The ids that left the queue (`forget`) or were delivered (`mark`) while here,
        # and `ids` as a set, made for the first of those.
        self.gone: set[int] | None = None
        self.marked: set[int] | None = None
        self.known: set[int] | None = None

    def mids(self) -> list[int] | None:
        """Its messages' ids, where it knows them (`ids`, or a checkpoint's `only`)."""
        if self.only is not None:
            out = list(self.only)
        elif self.ids is None:
            return None
        else:
            out = []
            for epoch, offsets in self.ids:
                high = epoch << records.OFFSET_BITS
                out += map(high.__or__, offsets)
        gone = self.gone
        return [mid for mid in out if mid not in gone] if gone else out

    def holds(self, mid: int) -> bool:
        """True when it knows it holds message `mid` (not forgotten), without a read; False
        too for a page that does not know its ids, or holds its messages in memory until
        their records are written (`held`: read back at no cost)."""
        if self.held is not None or not self.first_mid <= mid <= self.last_mid:
            return False
        if self.only is not None:
            found = mid in self.only
        elif self.ids is not None:
            if self.known is None:
                self.known = set(self.mids() or ())
            found = mid in self.known
        else:
            return False
        return found and not (self.gone and mid in self.gone)

    def forget(self, mid: int) -> bool:
        """Message `mid`, which it holds, left its queue (a record said so): True when it is
        forgotten without a read; False when the page must be read back for it."""
        if not self.holds(mid):
            return False
        if self.gone is None:
            self.gone = set()
        self.gone.add(mid)
        self.count -= 1
        if self.marked:
            self.marked.discard(mid)
        return True

    def mark(self, mid: int) -> bool:
        """Message `mid`, which it holds, was delivered: it comes back redelivered. False
        when the page must be read back for it."""
        if not self.holds(mid):
            return False
        if self.marked is None:
            self.marked = set()
        self.marked.add(mid)
        return True


def pack_ids(mids: list[int]) -> list[tuple[int, array.array[int]]]:
    """Message ids as (epoch, offsets) pairs, one per run of one epoch: 8 bytes an id."""
    out: list[tuple[int, array.array[int]]] = []
    mask = records.OFFSET_MASK
    for mid in mids:
        epoch = mid >> records.OFFSET_BITS
        if not out or out[-1][0] != epoch:
            out.append((epoch, array.array("Q")))
        out[-1][1].append(mid & mask)
    return out


class Journal(Protocol):
    epoch: int
    offset: int

    @property
    def shipping(self) -> bool:
        """True on a cluster member: changes to replicated queues are shipped."""

    def define(
        self, vhost: str, op: str, body: dict[str, Any], durable: bool, replicated: bool = True
    ) -> int:
        """A declaration, deletion, binding or unbinding. Each call returns the position
        of its record (0 when the change takes none)."""

    def enqueue(self, queue: Queue, msg: Message) -> int:
        """A message entered a queue; sets msg.mid (records.mid) on its first record."""

    def dequeue(self, queue: Queue, msg: Message) -> int:
        """A message left a queue for good (ack, drop, expiry, purge)."""

    def mark(self, queue: Queue, msg: Message) -> None:
        """A message was delivered to a consumer and awaits its ack (recorded with the
        turn's other deliveries to its queue, before the turn's records are shipped)."""

    def requeued(self, queue: Queue, msg: Message) -> int:
        """A delivered message went back to its queue, flagged redelivered."""

    def must_wait(self, queue: Queue, msg: Message) -> bool:
        """True when a confirm of msg on queue waits for `when_done`."""

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call back once everything recorded so far is on disk and held by the ISR."""

    def dirty(self) -> bool:
        """True when something recorded is not yet done."""

    def begin_group(self) -> None:
        """The records until `end_group` are one group (a transaction): applied whole."""

    def end_group(self) -> None: ...

    @property
    def page_budget(self) -> int:
        """Body bytes a queue keeps in memory before its later messages stay in the log
        (0: every message stays in memory)."""

    def page_out(self, queue: Queue, msgs: list[Message]) -> Page | None:
        """Leave these ready messages (the end of the queue, in order, each persistent and
        its ENQUEUE record handed to the disk) in the log; None when they cannot be."""

    def page_in(self, page: Page, queue: Queue, keep: bool = False) -> list[Message]:
        """A page's messages, read back; the page is gone from the store unless `keep`."""

    def page_drop(self, page: Page) -> None:
        """A page's messages are gone (their queue was deleted, or each was forgotten)."""

    def page_forget(self, page: Page, mid: int) -> bool:
        """Message `mid` of `page` left its queue (a record the model applies said so):
        True when the page forgets it unread (`Page.forget`), False when it must be read
        back first."""


class Disk(Protocol):
    """The store, as the Sequencer sees it."""

    @property
    def synced(self) -> int:
        """Every durable record up to this offset is on disk."""

    def write(
        self, rtype: int, offset: int, data: bytes | list[bytes], key: tuple[str, str, int] | None
    ) -> None:
        """Append a durable record's frame, whole or as parts (`records.frame_parts`); `key`
        names the message of an enqueue, a dequeue or a mark."""

    def forget_queue(self, vhost: str, queue: str) -> None:
        """A durable queue was deleted: its messages are no longer live."""

    def boundary(self, epoch: int, first: int) -> None:
        """The log's first record of `epoch` is at `first` (kept for truncation)."""

    def soon(self) -> None:
        """Something waits for the records handed: write them before this turn ends (what
        nothing waits for may be written later)."""

    page_bytes: int  # a queue's memory budget (Journal.page_budget); 0 pages nothing

    def page_out(self, key: tuple[str, str], place: bytes, msgs: list[Message]) -> Page | None:
        """See Journal.page_out."""

    def page_in(self, page: Page, queue: Queue, keep: bool) -> list[Message]:
        """See Journal.page_in."""

    def page_drop(self, page: Page) -> None:
        """See Journal.page_drop."""

    def page_forget(self, page: Page, mid: int) -> bool:
        """See Journal.page_forget."""


class Shipper(Protocol):
    """Replication, as the Sequencer sees it."""

    @property
    def held(self) -> int:
        """Every shipped record up to this offset is held by the ISR."""

    def ship(self, data: records.Framed, offset: int) -> None:
        """Send a record's frame (or its parts) to the followers."""

    def soon(self) -> None:
        """Records are waiting (`Sequencer.marks`): ship them before this turn ends."""


class Sequencer:
    """Implements the Journal port: gives each change its (epoch, offset) and hands the
    record to the disk and to replication."""

    def __init__(self, disk: Disk | None = None) -> None:
        self.epoch = 1
        self.offset = 0
        self.boundaries: list[tuple[int, int]] = []
        self.disk = disk
        self.shipper: Shipper | None = None
        self.applying = False
        self.last_durable = 0  # offset of the last durable record handed to the disk
        self.last_shipped = 0
        self.waiters: collections.deque[tuple[int, int, Callable[[], None]]] = collections.deque()
        self.group: list[Pending] | None = None  # records held back until the group ends
        # Deliveries not recorded yet, by queue: one MARKS record each when the turn's
        # records are shipped (`emit_marks`), not a MARK per delivery.
        self.marks: dict[Queue, list[int]] = {}

    @property
    def shipping(self) -> bool:
        return self.shipper is not None

    # -- positions and epochs --

    def begin_term(self, epoch: int) -> None:
        """This node produces records in `epoch` from now on (a new primary term)."""
        self.epoch = epoch
        # A full copy may have taken the log back (`reset`): what a waiter needs shipped is
        # never past the log's end, or it would wait for offsets not made yet.
        self.last_shipped = min(self.last_shipped, self.offset)

    def _next(self) -> int:
        self.offset += 1
        if not self.boundaries or self.boundaries[-1][0] != self.epoch:
            self.boundaries.append((self.epoch, self.offset))
            if self.disk is not None:
                self.disk.boundary(self.epoch, self.offset)
        return self.offset

    def follow(self, epoch: int, offset: int) -> None:
        """A record (epoch, offset) made elsewhere was applied here (a backup, recovery)."""
        if not self.boundaries or self.boundaries[-1][0] != epoch:
            self.boundaries.append((epoch, offset))
        self.epoch = max(self.epoch, epoch)
        self.offset = max(self.offset, offset)

    def reset(self, boundaries: Boundaries, offset: int) -> None:
        """The log was replaced (a backup took a full copy). What this node handed before
        may have gone past `offset`: nothing waits for offsets the log no longer has (the
        waiters of a term it served as primary, whose clients were closed)."""
        self.boundaries = list(boundaries)
        self.offset = offset
        self.last_durable = min(self.last_durable, offset)
        self.last_shipped = min(self.last_shipped, offset)
        if self.waiters:
            self.waiters = collections.deque(
                (min(disk, offset), min(held, offset), callback)
                for disk, held, callback in self.waiters
            )
        if boundaries:
            self.epoch = max(self.epoch, boundaries[-1][0])

    # -- the Journal port --

    def define(
        self, vhost: str, op: str, body: dict[str, Any], durable: bool, replicated: bool = True
    ) -> int:
        if self.applying:
            return 0
        shipped = self.shipper is not None
        if not durable and not (shipped and replicated):
            return 0
        if durable and op == "queue.delete" and self.disk is not None:
            self.disk.forget_queue(vhost, body["name"])
        return self._record(
            records.DEFINE, records.define(vhost, op, body), durable, replicated, None
        )

    def _message_change(self, queue: Queue, msg: Message) -> tuple[bool, bool] | None:
        """(durable, replicated) of a change to `msg` on `queue`, or None when the change
        takes no position (see the module's docstring)."""
        if self.applying:
            return None
        durable = msg.persistent and queue.durable
        replicated = queue.replicate == "all"
        if not durable and not (replicated and self.shipper is not None):
            return None
        return durable, replicated

    def enqueue(self, queue: Queue, msg: Message) -> int:
        change = self._message_change(queue, msg)
        if change is None:
            return 0
        durable, replicated = change
        offset = self._next()
        if not msg.mid:  # its first queue: the id is this record's (epoch, offset)
            msg.mid = (self.epoch << records.OFFSET_BITS) | offset  # records.mid, inlined
        where = _place(queue)
        self._emit(
            records.ENQUEUE,
            offset,
            # A large body is framed from its parts: written from its own buffer.
            records.enqueue_at(where, msg)
            if msg.body_size < records.BIG
            else records.enqueue_parts(where, msg),
            durable,
            replicated,
            (queue.vhost.name, queue.name, msg.mid),
        )
        return offset

    def dequeue(self, queue: Queue, msg: Message) -> int:
        change = self._message_change(queue, msg)
        if change is None:
            return 0
        durable, replicated = change
        return self._record(
            records.DEQUEUE,
            records.key_at(_place(queue), msg.mid),
            durable,
            replicated,
            (queue.vhost.name, queue.name, msg.mid),
        )

    def mark(self, queue: Queue, msg: Message) -> None:
        if self.applying or self.shipper is None or queue.replicate != "all":
            return
        marks = self.marks
        pending = marks.get(queue)
        if pending is not None:
            pending.append(msg.mid)
            return
        if not marks:
            self.shipper.soon()
        marks[queue] = [msg.mid]

    def emit_marks(self) -> None:
        """Record the deliveries marked since the last time (the shipper calls this before
        it ships a turn's records): one MARKS record per queue."""
        marks, self.marks = self.marks, {}
        for queue, mids in marks.items():
            if not queue.deleted:
                payload = records.marks_at(_place(queue), mids)
                self._record(records.MARKS, payload, False, True, None)

    def requeued(self, queue: Queue, msg: Message) -> int:
        """A persistent message on a durable queue was requeued: its redelivered flag is
        recorded (a durable MARK), so that it survives a restart. Requeues are rare, so the
        cost stays off the hot path; a delivery alone is marked only for replication."""
        if self.applying or not (msg.persistent and queue.durable):
            return 0
        key = records.key_at(_place(queue), msg.mid)
        which = (queue.vhost.name, queue.name, msg.mid)
        return self._record(records.MARK, key, True, queue.replicate == "all", which)

    def checkpoint(self, body: dict[str, Any]) -> int:
        """An audit marker in the replicated stream; returns its offset."""
        return self._record(
            records.CHECKPOINT, records.define("", "checkpoint", body), False, True, None
        )

    def must_wait(self, queue: Queue, msg: Message) -> bool:
        return (msg.persistent and queue.durable) or (
            self.shipper is not None and queue.replicate == "all"
        )

    def _record(
        self,
        rtype: int,
        payload: bytes,
        durable: bool,
        replicated: bool,
        key: tuple[str, str, int] | None,
    ) -> int:
        offset = self._next()
        self._emit(rtype, offset, payload, durable, replicated, key)
        return offset

    def _emit(
        self,
        rtype: int,
        offset: int,
        payload: bytes | list[bytes],
        durable: bool,
        replicated: bool,
        key: tuple[str, str, int] | None,
        more: bool = False,
    ) -> None:
        if self.group is not None:
            self.group.append((rtype, offset, payload, durable, replicated, key))
            return
        data: bytes | list[bytes] = (
            records.frame(rtype, self.epoch, offset, payload, durable, more)
            if isinstance(payload, bytes)
            else records.frame_parts(rtype, self.epoch, offset, payload, durable, more)
        )
        if durable and self.disk is not None:
            self.disk.write(rtype, offset, data, key)
            self.last_durable = offset
        if self.shipper is not None:
            if not replicated:
                data = records.frame(records.NOOP, self.epoch, offset, NOOP_PAYLOAD, False, more)
            elif not isinstance(data, bytes) and len(data) == 1:
                data = data[0]  # no large body: one buffer, as a frame
            self.shipper.ship(data, offset)  # a large body's parts as they are, not joined
            self.last_shipped = offset

    def begin_group(self) -> None:
        self.group = []

    @property
    def page_budget(self) -> int:
        disk = self.disk
        return disk.page_bytes if disk is not None else 0

    def page_out(self, queue: Queue, msgs: list[Message]) -> Page | None:
        if self.disk is None or self.group is not None:
            return None
        return self.disk.page_out((queue.vhost.name, queue.name), _place(queue), msgs)

    def page_in(self, page: Page, queue: Queue, keep: bool = False) -> list[Message]:
        assert self.disk is not None
        return self.disk.page_in(page, queue, keep)

    def page_drop(self, page: Page) -> None:
        if self.disk is not None:
            self.disk.page_drop(page)

    def page_forget(self, page: Page, mid: int) -> bool:
        return self.disk is not None and self.disk.page_forget(page, mid)

    def end_group(self) -> None:
        """Emit the group's records, each but the last marked MORE."""
        group = self.group or []
        self.group = None
        last = len(group) - 1
        for i, (rtype, offset, payload, durable, replicated, key) in enumerate(group):
            self._emit(rtype, offset, payload, durable, replicated, key, i < last)

    # -- completion --

    def _done(self, need_disk: int, need_held: int) -> bool:
        disk, shipper = self.disk, self.shipper
        return (disk is None or disk.synced >= need_disk) and (
            shipper is None or shipper.held >= need_held
        )

    def when_done(self, callback: Callable[[], None]) -> None:
        if not self.waiters and self._done(self.last_durable, self.last_shipped):
            callback()
        else:
            self.waiters.append((self.last_durable, self.last_shipped, callback))
            if self.disk is not None:
                self.disk.soon()  # what it waits for may be held back (Store._flush)
            if self.shipper is not None:
                self.shipper.soon()  # ... and here (Member._flush)

    def dirty(self) -> bool:
        return bool(self.waiters) or not self._done(self.last_durable, self.last_shipped)

    def progress(self) -> None:
        """The disk synced or the ISR acked more: call back the waiters that are done."""
        waiters = self.waiters
        while waiters and self._done(waiters[0][0], waiters[0][1]):
            callback = waiters.popleft()[2]
            try:
                callback()
            except Exception:
                log.exception("unexpected error, please report it as a bug: a done callback")


def _place(queue: Queue) -> bytes:
    """The queue's records.place, made at its first message record and kept on it."""
    where = queue.place
    if not where:
        where = queue.place = records.place(queue.vhost.name, queue.name)
    return where


if TYPE_CHECKING:
    # The model holds its Sequencer as that, not as the Journal port, so that compiled code
    # calls it directly; mypy checks here that it still implements the port.
    _SEQUENCER_IS_A_JOURNAL: type[Journal] = Sequencer
