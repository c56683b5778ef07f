"""The node's log on disk: segmented, checksummed, group-committed.

Layout: `<data_dir>/log/<segment number, 20 digits>.seg`, each a run of record frames
(`tandem.broker.model.records`), or `.reused.seg` for one written over a consumed segment (its
records salted with its number, `_roll`); `<number>.spare`, consumed segments kept to be
written over (a start deletes them); and `<data_dir>/log/epochs`, one line "epoch
first-offset" per epoch the log holds records of (Kafka's leader-epoch checkpoint), kept for
truncation.

The Sequencer hands the store the frames of durable records in log order (the `Disk` port);
they go into a pending buffer, and a single writer thread writes and fsyncs a whole batch at a
time (group commit), then tells the Sequencer on the loop, which releases confirms and
tx.commit-ok. A small batch on a fast disk is written on the loop itself (`_write_here`).
Records nothing waits for (a consumer's acks, publishes without confirms) wait for the next
batch something does, or `LAZY_SECONDS`: a publisher waiting for each confirm then costs one
write and fsync per message, not a second one for its consumer's ack.

Housekeeping takes no position: a new segment starts with a SNAPSHOT of the durable
definitions stamped with the current position, so a segment is needed only for the persistent
messages still alive in it. The oldest segments are deleted once they hold no live message (or
kept as spares, `<number>.spare`, and written over by the next new segment, its records
salted: `_roll`, `REUSE_BYTES`);
when the log holds more than `max_segments`, the live messages of the oldest are written again
as they were (same frame, same position) and it is deleted, once few of them are live
(`CARRY_BELOW`) and those few have not been consumed for a while (`CARRY_PATIENCE`).
Recovery replays the segments in order through the model's one apply path.

Paging: a queue deeper than its memory budget leaves the messages after its head in the log
(`page_out`), and the store reads them back (`page_in`) by where their ENQUEUE records are: a
page is a few runs of bytes of the segments, read with one pread each. A segment a page reads
from is pinned: compaction never carries it forward, so its records stay where the page says;
it goes once the page is read back and its messages are consumed. A cluster member's pages
also know their messages' ids (`keep_ids`), of which its digest is made; a copy for a
follower pins the pages it reads on its own thread (`pin`, `read_copy`).

Checkpoints: a node (lone or a cluster member) writes `<data_dir>/log/checkpoint` every
`checkpoint_records` durable records, or every quarter as many as the next one would name
messages in memory anew when that is more (a checkpoint costs in proportion to them; a deep
queue that stopped changing is named anew once without that wait), once they are on disk.
A queue whose messages and their places did not change since the last checkpoint is
named by its part of that one, as it was: only the queues that changed cost their messages
again (the `where` index is kept by queue for this: `ByQueue`). The file is written beside
the checkpoint and renamed over it, without holding up the log's writer.
It holds the state at one point of the log (the resume point):
the position and epochs, the durable definitions (as a SNAPSHOT restates them), and where
each live message's record is (the `where` index, the pages, the requeued marks). Recovery
loads it, leaves the messages it names in the log as pages of exactly those messages
(`Page.only`; a queue that cannot page reads them), and replays only the log after the resume
point, so that a restart does not take longer as the log grows. Everything the
checkpoint names is at or before the resume point; what is gone from the log since (a segment
compaction deleted) was consumed or carried forward after it, which the replay applies. A
checkpoint that is unreadable, or whose resume point is not the end of a whole record on disk
(`_ends_at`), is not used: the whole log is replayed, as without one.
"""

from __future__ import annotations

import array
import asyncio
import base64
import binascii
import bisect
import collections
import contextlib
import gc
import itertools
import json
import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

from tandem.broker.model import apply, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Page, Sequencer, pack_ids
from tandem.broker.model.message import Message
from tandem.broker.model.queue import PAGE_BYTES, Queue
from tandem.broker.model.records import Corruption
from tandem.broker.model.shards import ByQueue, Key
from tandem.broker.store.files import replace_file, sync_dir, write_file

log = logging.getLogger(__name__)

Run = list[tuple[int, int, int, int]]  # messages: (id, place in the log, frame length, body)
# A head's messages as a checkpoint names them: ids (128 bits: a list), places in the log,
# frame lengths and bodies' lengths (C arrays). Not a tuple a message, nor lists of all: the
# cyclic collector walks those, and with a million messages its walks on the checkpoint's
# thread held the GIL 50-130 ms at a time.
Columns = tuple[list[int], "array.array[int]", "array.array[int]", "array.array[int]"]
# Where a record is, one int: its segment number, then its first byte in the segment.
AT_BITS: Final = 32
AT_MASK: Final = (1 << AT_BITS) - 1
# Compaction carries an old segment's live messages forward only once fewer than one in this
# many of its messages are live: a segment still mostly live empties as consumers go on.
CARRY_BELOW: Final = 8
# ... and once they have stopped being consumed for this long: the oldest segment of a deep
# queue being drained is its head, emptied by the consumers faster than a carry reads it (a
# 64 MiB segment read, scanned and carried "0 live messages" every seven seconds under a
# saturated run, on every member).
CARRY_PATIENCE: Final = 2.0  # seconds
CARRY_LIMIT: Final = 30.0  # seconds: however slowly they are consumed, carried after this long
CARRY_BYTES: Final = 1 << 20  # of a segment carried forward in one turn of the loop
CHECKPOINT_MAGIC: Final = b"TANDEM-CHECKPOINT-1\n"
INLINE_BYTES: Final = 16 << 10  # a batch this small is written on the loop when the disk is fast
# ... and when recent batches' writes and fsyncs took less than this. A batch handed to the
# writer's thread costs the loop and the thread the GIL back and forth and a wake-up each way:
# on a 2-core machine, 3 members under a publisher waiting for each confirm, the cluster spent
# 872 against 952 µs of CPU a message with 1 ms here instead of 0.5 ms, and 284 against 358 with
# ten such publishers (9 of 10 runs faster, 3,440 against 3,089 msg/s); there 5-13% of the
# fsyncs took over 0.5 ms (1-3% over 1), and each sent the next few batches to the thread.
# A stalled disk still sends them there after its first slow write.
INLINE_SECONDS: Final = 0.001
LAZY_SECONDS: Final = 0.01  # records nothing waits for are written within this
LAZY_BYTES: Final = 1 << 20  # ... or once this many of them are pending
RETRY_SECONDS: Final = 1.0  # a write that failed (a full disk) is tried again after this
# Consumed segments kept to be written over (`_roll`), not deleted: 512 MiB of disk at most,
# held while idle. A queue running thousands of 64 KiB messages deep leaves most of a burst's
# segments new with two (eight ABBA cycles of 20,000 such messages: 88.5 against 67.0 µs of
# CPU a message, 9,310 against 10,672 msg/s, for two against eight).
SPARES: Final = 8
# A consumed segment is kept for that when its messages averaged this many bytes or more:
# each record of a reused segment costs a header written anew (`records.salted`, 0.22 µs),
# each page of a new one the kernel's allocating it (64 KiB messages: 78.5 against 70.2 µs
# of the broker's CPU a message); 100-byte messages would pay the first for nothing.
REUSE_BYTES: Final = 8192
SPARE_SUFFIX: Final = ".spare"
# A segment written over a spare says so in its name, which a rename sets at once and no
# bit rot in its bytes can change: its records are read with its salt (`records.salted`).
REUSED_SUFFIX: Final = ".reused.seg"


@dataclass(slots=True)
class Recovered:
    records: int = 0
    messages: int = 0
    truncated: list[str] = field(default_factory=list)
    corrupt: list[Corruption] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    # Records that could not be applied (a bug): "epoch:offset what", each written as it was
    # to not-applied/ in the data dir, where an operator can read it.
    not_applied: list[str] = field(default_factory=list)
    exclusive_dropped: list[str] = field(default_factory=list)
    # Messages a checkpoint named (in memory or in pages), or None when none was used.
    from_checkpoint: int | None = None
    # Seconds taken: before the replay (reading and loading the checkpoint, mostly), by the
    # replay of the log after it, and in all (what is left: the live index made from what
    # was replayed, and the first checkpoint after a long replay).
    checkpoint_seconds: float = 0.0
    replay_seconds: float = 0.0
    seconds: float = 0.0


class _Carry:
    """A segment being carried forward a chunk at a time (`Store._carry_step`)."""

    __slots__ = ("data", "generation", "moved", "pos", "seg", "turns")

    def __init__(self, seg: int, generation: int) -> None:
        self.seg = seg
        self.generation = generation  # the log it belongs to (a reset starts another)
        self.data = b""
        self.pos = 0
        self.moved = 0
        self.turns = 0


Chunk = bytes | memoryview  # a frame or a part of one (a large body, as it came)


class _Batch:
    __slots__ = (
        "callbacks",
        "chunks",
        "deletes",
        "epochs",
        "generation",
        "number",
        "size",
        "spares",
        "through",
    )

    def __init__(self, generation: int = 0, number: int = 0) -> None:
        self.generation = generation  # the log it belongs to (a reset starts another)
        self.number = number  # batches are numbered in the order they are made (`sync_point`)
        self.chunks: list[tuple[int, Chunk]] = []  # (segment, a frame or a part of one)
        self.size = 0  # bytes of the chunks appended (`_append`)
        self.callbacks: list[Callable[[], None]] = []
        self.deletes: list[int] = []
        self.spares: list[int] = []  # of the deletes, those kept to be written over
        self.epochs: list[tuple[int, int]] = []  # boundaries to add to the epochs file
        self.through = 0  # every durable record up to this offset is in this batch or before


class Store:
    """Implements the Sequencer's Disk port."""

    def __init__(
        self,
        data_dir: Path,
        *,
        fsync: bool = True,
        segment_bytes: int = 64 << 20,
        max_segments: int = 16,
        page_bytes: int = 0,
        keep_ids: bool = False,
        checkpoint_records: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dir = Path(data_dir) / "log"
        self.clock = clock
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.broker: Broker | None = None
        self.sequencer: Sequencer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.carrying: _Carry | None = None  # a large segment being carried forward
        # The oldest segment as compaction last saw it (_draining): its number, its live
        # messages, since when they have not fallen, and since when it has been watched.
        self.watched: tuple[int, int, float, float] = (-1, 0, 0.0, 0.0)
        self.look_again: asyncio.TimerHandle | None = None  # compaction, once patience ends
        self.segments: collections.OrderedDict[int, int] = collections.OrderedDict()  # live
        self.active = 0  # number of the active segment
        # Segments written over (`_roll`): each one's salt (`records.salted`), the active
        # one's, the consumed segments kept as spares, and each segment being written into
        # a spare until the spare is renamed to it.
        self.salts: dict[int, int] = {}
        self.salt = 0
        self.spares: collections.deque[int] = collections.deque()
        self.spare_for: dict[int, int] = {}
        self.written_over = 0  # segments begun over a spare since the start (`stats`)
        self.active_size = 0
        self.last_at = -1  # where the active segment's last record begins; -1: not known
        # Each live message in memory -> where its ENQUEUE record is (AT_BITS), by queue; a
        # paged one is its page's instead.
        self.where = ByQueue()  # model/shards.py: millions, at times
        self.page_bytes = page_bytes
        # A cluster member's pages know their messages' ids (`Page.ids`): its digest and the
        # primary's copy are made of them, a page read back only for what a follower lacks.
        self.keep_ids = keep_ids
        self.pages: dict[tuple[str, str], set[Page]] = {}  # each queue's pages
        self.pinned: collections.Counter[int] = collections.Counter()  # pages per segment
        self.unwritten: collections.deque[Page] = collections.deque()  # held, not yet written
        # Body bytes of each queue's pages held in memory: the first pages of a tail stay
        # (up to a quarter of page_bytes), so that a queue a little deeper than its budget
        # reads nothing back.
        self.held_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.enqueued: collections.Counter[int] = collections.Counter()  # records per segment
        self.marked: set[Key] = set()  # live messages with a durable MARK (requeued)
        self.checkpoint_records = checkpoint_records  # 0: no checkpoints
        self.since_checkpoint = 0
        # Records until the next checkpoint (`_due`): checkpoint_records, a quarter of the
        # messages in memory the next one would name anew, or the bytes of the last one's
        # file and of the part files it would write again over CHECKPOINT_BYTES_A_RECORD,
        # whichever is most. A checkpoint costs about 1.3 µs per message it names anew (a
        # million: 1.2-1.3 s of the writer thread's time, the GIL shared with the loop); a
        # queue it names by an earlier part (`sections`) costs no copy of its entries and no
        # pass over them, and a deep one (PART_BYTES) not even its bytes: its part is a
        # file the checkpoint names. This keeps it under about 5 µs a record. A restart,
        # which reads those messages, replays at most about a quarter as many records after
        # them; a deep queue left alone costs nothing (a member beside a million messages: a
        # checkpoint every 50,000 records, where its part written again each time made it
        # every 170,000, and a restart replayed up to 320,000). `checkpoint_due` is when to
        # look next.
        self.checkpoint_due = checkpoint_records
        # A deep queue that stopped changing is named once more without that wait (`_due`):
        # it must be named anew once anyway, and from then on it costs nothing. Once only
        # until a checkpoint that is not early (by the rule above, a start's, a copy's): a
        # deep queue that changes now and then could otherwise be named anew every
        # checkpoint_records records.
        self.settle_once = False
        self.early = False  # the checkpoint scheduled is the early one
        self.checkpoint_scheduled = False
        # One is being made: the next waits for it to end. Two at once shared the GIL with
        # the loop and each other, took longer, and the one written fell further behind.
        self.checkpoint_running = False
        self.checkpoints_made = 0  # the newest checkpoint written wins, whichever thread ends first
        self.checkpoint_written = 0
        # Bytes of the last one's file, written whole each time; not its parts' files,
        # written again only for the queues that change (`_cost`).
        self.checkpoint_size = 0
        # Each queue's part of the last checkpoint written (its JSON object), and the queues
        # whose messages or their places changed since the last capture, each with the
        # records since it when it last did: a checkpoint names a queue that did not change
        # with its part of an earlier one, which costs nothing.
        self.sections: dict[tuple[str, str], bytes] = {}
        self.changed: dict[tuple[str, str], int] = {}
        # A part of PART_BYTES or more is a file of its own, which the checkpoints that name
        # the queue by it leave as it is (`sections` holds the reference): the part file of
        # each such section, the part files the checkpoint on disk names, and this process's
        # token in the names of those it writes (a restart numbers checkpoints from 1 again).
        self.section_parts: dict[tuple[str, str], str] = {}
        self.parts_on_disk: set[str] = set()
        # The pages the last checkpoint named each queue's head by: the next one names
        # those whose messages the head still holds where they were as they were named.
        self.named_heads: dict[tuple[str, str], list[_Named]] = {}
        self.token = os.urandom(8).hex()
        # At a start: each queue the checkpoint named by a part file, as (its reference, the
        # file, the messages it names), and the queues the records replayed after it name.
        self.loaded_parts: dict[tuple[str, str], tuple[bytes, str, int]] = {}
        self.touched: set[tuple[str, str]] = set()
        self.pending = _Batch()
        self.inflight: _Batch | None = None
        self.flush_scheduled = False
        self.lazy: asyncio.TimerHandle | None = None  # writes what nothing waits for (_flush)
        self.handed = 0  # offset of the last durable record handed to the store
        self._synced = 0
        self.write_error: OSError | None = None
        self.retry_seconds = RETRY_SECONDS  # after a failed write, before the next try
        self.on_write_error: Callable[[OSError | None], None] = lambda err: None
        # A page read back short (a corrupt record): a cluster member takes a copy.
        self.on_short_page: Callable[[str], None] = lambda what: None
        self.fds: dict[int, int] = {}
        self.lock = threading.Lock()
        self.synced_batches = 0
        self.fsync_seconds: Callable[[float], None] = lambda s: None
        # From a checkpoint's capture to its file written (admin.py's histogram).
        self.checkpoint_seconds: Callable[[float], None] = lambda s: None
        self.write_recent = INLINE_SECONDS  # moving average; the first batches go to the thread
        self.written_here = 0  # batches written on the loop (`_write_here`)
        self.sizes: dict[int, int] = {}  # bytes of each segment known to be written
        self.allocate_failed = False  # said once (`_allocate`)
        self.grouped: collections.deque[int] = collections.deque()  # replay: records' places
        self.recovering = False
        self.generation = 0
        self.closed = False  # the node stopped: nothing more is written or read

    # -- the Disk port --

    @property
    def synced(self) -> int:
        inflight = self.inflight
        if not self.pending.chunks and (inflight is None or not inflight.chunks):
            return self.handed  # as when_synced sees it: nothing handed waits for the disk
        return self._synced

    def write(self, rtype: int, offset: int, data: bytes | list[bytes], key: Key | None) -> None:
        self.handed = max(self.handed, offset)
        if rtype == records.ENQUEUE and key is not None:
            self.where[key] = (self.active << AT_BITS) | self.active_size
            self.segments[self.active] += 1
            self.enqueued[self.active] += 1
            self._change(key)
        elif rtype == records.DEQUEUE and key is not None:
            # Not in the index: a paged message its page forgot unread (`page_forget`), which
            # its page's records count until the page goes.
            at = self.where.pop(key)
            if at is not None:
                self.segments[at >> AT_BITS] -= 1
            self._change(key)
            if self.marked:
                self.marked.discard(key)
        elif rtype == records.MARK and key is not None:
            self.marked.add(key)
        self._append(data)
        if self.checkpoint_records:
            self.since_checkpoint += 1
            if self.since_checkpoint >= self.checkpoint_due:
                self._due()

    def _change(self, key: Key) -> None:
        """The messages of `key`'s queue, or where they are, changed: the next checkpoint
        names them anew (`_captured`)."""
        if self.sections or self.checkpoint_running:
            self.changed[(key[0], key[1])] = self.since_checkpoint

    def forget_queue(self, vhost: str, queue: str) -> None:
        self._forget({(vhost, queue)})

    def forget_gone(self) -> None:
        """Forget the messages of every durable queue the broker no longer has. A backup
        calls it after applying a copy's definitions, which delete queues without a record
        of each: a checkpoint must not name their messages, which a later queue of the same
        name would take back at the next start."""
        assert self.broker is not None
        vhosts = self.broker.vhosts
        gone = set()
        for vhost, queue in self.where.queues.keys() | self.pages.keys():
            vh = vhosts.get(vhost)
            q = vh.queues.get(queue) if vh is not None else None
            if q is None or not q.durable:
                gone.add((vhost, queue))
        if gone:
            self._forget(gone)

    def _forget(self, queues: set[tuple[str, str]]) -> None:
        """The messages of `queues` are no longer live."""
        for name in queues:
            self.changed[name] = self.since_checkpoint
        for vhost, queue in queues:
            self.named_heads.pop((vhost, queue), None)
            index = self.where.drop(vhost, queue)
            if index is not None:
                for shard in index.dicts():
                    for place in shard.values():
                        self.segments[place >> AT_BITS] -= 1
        if self.marked:
            self.marked = {key for key in self.marked if (key[0], key[1]) not in queues}
        for name in queues:
            for page in list(self.pages.get(name, ())):
                self.page_drop(page)

    def page_drop(self, page: Page) -> None:
        """A page's messages are gone with their queue (Journal.page_drop)."""
        pages = self.pages.get(page.key)
        if pages is None or page not in pages:
            return
        self._release(page)
        if not self.recovering:  # recovery counts what is live once it is over
            for seg, n in page.segs.items():
                self.segments[seg] -= n

    # -- pages --

    def page_out(self, key: tuple[str, str], place: bytes, msgs: list[Message]) -> Page | None:
        """Leave a queue's messages in the log (Journal.page_out): their records' places
        become the page's, held in memory until the records are written."""
        vhost, queue = key
        where = self.where.of(vhost, queue)
        ats = []
        for m in msgs:
            at = where.get(m.mid)
            if at is None:
                return None
            ats.append(at)
        page = Page(key, len(msgs), sum(m.body_size for m in msgs), msgs[0].mid, msgs[-1].mid)
        self.changed[key] = self.since_checkpoint
        if self.keep_ids:
            page.ids = pack_ids([m.mid for m in msgs])
        extents: list[list[int]] = []
        # In the order of the log: compaction may have carried a record forward, past later
        # ones (`_read` puts them back in order).
        for at, m in sorted(zip(ats, msgs, strict=True), key=lambda pair: pair[0]):
            seg, pos = at >> AT_BITS, at & AT_MASK
            end = pos + records.enqueue_size(place, m)
            if extents and extents[-1][0] == seg:
                extents[-1][2] = end
            else:
                extents.append([seg, pos, end])
            page.segs[seg] = page.segs.get(seg, 0) + 1
            del where[m.mid]
        page.extents = [(seg, start, end) for seg, start, end in extents]
        for seg in page.segs:
            self.pinned[seg] += 1
        self.pages.setdefault(key, set()).add(page)
        written = self._on_disk(page)
        if not written or self.held_bytes[key] + page.body_bytes <= self.page_bytes // 4:
            page.held = list(zip(msgs, ats, strict=True))
            self.held_bytes[key] += page.body_bytes
            if not written:
                self.unwritten.append(page)
        return page

    def page_in(self, page: Page, queue: Queue, keep: bool) -> list[Message]:
        """A page's messages (Journal.page_in): the ones held, or read from the log. Unless
        `keep`, they are the queue's in memory again and the page is gone."""
        found = page.held if page.held is not None else self._read(page, queue)
        if not keep:
            self._release(page)
            where = self.where.of(*page.key)
            for m, at in found:
                where[m.mid] = at
            if len(found) < sum(page.segs.values()) and not self.recovering:
                # Its records of messages forgotten (or read back short) are no longer live.
                back = collections.Counter(at >> AT_BITS for _m, at in found)
                for seg, n in page.segs.items():
                    if n > back[seg]:
                        self.segments[seg] -= n - back[seg]
        return [m for m, _at in found]

    def _live_marks(self) -> set[Key]:
        """The requeued marks of messages that are live: in the index, or in a page that
        knows it holds them (a mark on a paged message does not read it back). A queue's
        pages hold runs of ids that do not overlap: each mark looks at one page."""
        live = {key for key in self.marked if key in self.where}
        by_queue: dict[tuple[str, str], list[int]] = {}
        for vhost, queue, mid in self.marked - live:
            by_queue.setdefault((vhost, queue), []).append(mid)
        for name, mids in by_queue.items():
            pages = sorted(self.pages.get(name, ()), key=lambda page: page.first_mid)
            firsts = [page.first_mid for page in pages]
            for mid in mids:
                i = bisect.bisect_right(firsts, mid) - 1
                if i >= 0 and pages[i].holds(mid):
                    live.add((name[0], name[1], mid))
        return live

    def page_forget(self, page: Page, mid: int) -> bool:
        """See Journal.page_forget. The message's record stays live in the log, counted by
        its page's records, until the page is read back or gone."""
        if not page.forget(mid):
            return False
        self._change((page.key[0], page.key[1], mid))
        return True

    def pin(self, pages: list[Page]) -> None:
        """Keep these pages' segments where they are while a copy reads them on another
        thread (`read_copy`), whether or not their queue takes them back meanwhile:
        compaction carries no pinned segment forward."""
        for page in pages:
            for seg in page.segs:
                self.pinned[seg] += 1

    def unpin(self, pages: list[Page]) -> None:
        """The copy that pinned these pages is made (on the loop)."""
        for page in pages:
            for seg in page.segs:
                self.pinned[seg] -= 1
                if self.pinned[seg] <= 0:
                    del self.pinned[seg]

    def read_copy(self, page: Page, queue: Queue) -> list[Message]:
        """A pinned page's messages for a copy, read on the copy's thread. Those consumed
        since (their segment deleted) are left out: the copy's Appends say they went."""
        return [m for m, _at in self._read(page, queue, whole=False)]

    def _on_disk(self, page: Page) -> bool:
        return all(end <= self.sizes.get(seg, 0) for seg, _start, end in page.extents)

    def _release(self, page: Page) -> None:
        pages = self.pages.get(page.key)
        if pages is None or page not in pages:
            return
        pages.discard(page)
        self.changed[page.key] = self.since_checkpoint
        if not pages:
            del self.pages[page.key]
        for seg in page.segs:
            self.pinned[seg] -= 1
            if not self.pinned[seg]:
                del self.pinned[seg]
        if page.held is not None:
            page.held = None
            self.held_bytes[page.key] -= page.body_bytes
            if not self.held_bytes[page.key]:
                del self.held_bytes[page.key]
            if page in self.unwritten:
                self.unwritten.remove(page)

    def _read(self, page: Page, queue: Queue, whole: bool = True) -> list[tuple[Message, int]]:
        """Read a page's messages back from its runs of the log: the queue's ENQUEUE records
        there with the page's ids (a record carried forward, or a message of the queue kept
        in memory, lies between pages). Unless `whole`, a run whose segment is gone is
        skipped (its messages were consumed)."""
        place = records.place(*page.key)
        out: dict[int, tuple[Message, int]] = {}  # by id: a copy carried forward counts once
        # A page of a checkpoint's head names its ids: its runs of the log may also hold
        # records of messages consumed out of order, whose ids are within its range.
        mids = page.mids() if page.only is None else None
        exact = None if mids is None else set(mids)
        gone, marked = page.gone, page.marked
        for seg, start, end in page.extents:
            salt = self.salts.get(seg, 0)  # then its path: a copy's thread reads as it goes
            path = self._named(seg, bool(salt))
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if whole:
                    raise
                continue  # its messages were consumed, and compaction deleted it
            try:
                data = os.pread(fd, end - start, start)
            finally:
                os.close(fd)
            positions: list[int] = []
            found, _good, corrupt, _torn = records.scan(
                data, str(path), positions=positions, salt=salt
            )
            for c in corrupt:
                c.offset += start
                log.error("corrupt record in the log, skipped: %s (queue '%s')", c, page.key[1])
            for (rtype, _epoch, _offset, payload), pos in zip(found, positions, strict=True):
                if rtype & records.TYPE_MASK != records.ENQUEUE or not payload.startswith(place):
                    continue
                _v, _q, mid, route, props, body = records.read_enqueue(payload)
                at = (seg << AT_BITS) | (start + pos)
                if page.only is not None:
                    member = page.only.get(mid) == at and not (gone and mid in gone)
                elif exact is not None:
                    member = mid in exact
                else:
                    member = page.first_mid <= mid <= page.last_mid
                if member and mid not in out:
                    msg = apply.message(queue, mid, route, props, body)
                    if marked and mid in marked:
                        msg.redelivered = True  # delivered while paged (`Page.mark`)
                    out[mid] = (msg, at)
        if whole and len(out) != page.count:
            what = (
                f"a page of queue '{page.key[1]}' in vhost '{page.key[0]}' read back "
                f"{len(out)} of its {page.count} messages"
            )
            log.error("%s", what)
            # What it knows it held and could not read is lost here: forgotten, it is not in
            # the digest of the copy this member asks for, which brings it back, nor in the
            # next checkpoint.
            for mid in page.mids() or ():
                if mid not in out:
                    self.page_forget(page, mid)
            self.on_short_page(what)
        return [out[mid] for mid in sorted(out)]

    def boundary(self, epoch: int, first: int) -> None:
        self.pending.epochs.append((epoch, first))
        self._schedule()

    def reset(self, boundaries: list[tuple[int, int]]) -> None:
        """Start the log over (a backup takes a full copy): every segment goes, and the
        epochs file holds `boundaries`."""
        with self.lock:  # the writer is not in the middle of a batch
            self.generation += 1
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
            for path in [*self.dir.glob("*.seg"), *self.dir.glob(f"*{SPARE_SUFFIX}")]:
                path.unlink()
            (self.dir / "checkpoint").unlink(missing_ok=True)
            for part in self.dir.glob(f"{PART_PREFIX}*"):
                part.unlink(missing_ok=True)  # `_drop_parts` may be deleting it too
            self.parts_on_disk = set()
            self._rewrite_epochs(boundaries)
        self.pending.chunks.clear()
        self.pending.deletes.clear()
        self.pending.spares.clear()
        self.pending.epochs.clear()
        self.spares.clear()
        self.spare_for.clear()
        self.salts.clear()
        self.salt = 0
        self.pending.size = 0
        self.pending.generation = self.generation
        # Nothing of the log is on disk now; the copy's records are handed next, at offsets
        # that may be below the old log's end (a member that went past the agreement point).
        self.handed = self._synced = 0
        self.checkpoint_due = self.checkpoint_records
        self.checkpoint_size = 0
        self.settle_once = self.early = False
        self.sections.clear()
        self.section_parts.clear()
        self.named_heads.clear()
        self.changed.clear()
        self.where.clear()
        self.pages.clear()
        self.pinned.clear()
        self.unwritten.clear()
        self.held_bytes.clear()
        self.enqueued.clear()
        self.marked.clear()
        self.segments.clear()
        self.sizes.clear()
        self.active += 1
        self.segments[self.active] = 0
        self.active_size = 0
        self.last_at = -1

    def set_boundaries(self, boundaries: list[tuple[int, int]]) -> None:
        """The log's epochs are now these (a backup took a difference from its primary)."""
        with self.lock:
            self.pending.epochs.clear()
            self._rewrite_epochs(boundaries)

    def _unsynced(self) -> _Batch | None:
        """The batch whose write puts everything handed so far on disk: the one being
        filled, or the one being written; None when it is all there."""
        if self.pending.chunks:
            return self.pending
        inflight = self.inflight
        if inflight is not None and inflight.chunks:
            return inflight
        return None

    def sync_point(self) -> int | None:
        """What `when_synced` would wait for now, by the batch's number; None when
        everything handed is on disk. Two calls that return the same number are answered by
        the same write. A number, not the batch: a callback that held its batch made a cycle
        that kept the batch's records after its write, until a full collection
        (collector.py)."""
        batch = self._unsynced()
        return None if batch is None else batch.number

    def when_synced(self, callback: Callable[[], None]) -> None:
        """Call back once everything handed so far is on disk."""
        batch = self._unsynced()
        if batch is None:
            callback()
            return
        batch.callbacks.append(callback)
        if batch is self.pending:
            self._schedule()  # written this turn, not lazily

    # -- appending and the writer --

    def _append(self, data: bytes | list[bytes]) -> None:
        """Append a record's frame, whole or as parts (a large body in its own buffer: the
        writer writes them with one writev, `_write_all`); salted in a reused segment."""
        chunks, active = self.pending.chunks, self.active
        if self.salt:
            first = data if isinstance(data, bytes) else data[0]
            size = 0
            for chunk in records.salted(data, self.salt):
                chunks.append((active, chunk))
                size += len(chunk)
        elif isinstance(data, bytes):
            chunks.append((active, data))
            size = len(data)
            first = data
        else:
            size = 0
            for part in data:
                chunks.append((active, part))
                size += len(part)
            first = data[0]
        self.pending.size += size
        self.last_at = self.active_size
        self.active_size += size
        self._schedule()
        if self.active_size >= self.segment_bytes and not records.continues(first):
            self._roll()  # never inside a group: a group stays in one segment

    def soon(self) -> None:
        """Something waits for what is pending (a confirm, a durable reply): write it
        before this turn ends."""
        self._schedule()

    def _schedule(self) -> None:
        if not self.flush_scheduled and self.loop is not None:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _roll(self) -> None:
        """Start a new segment, beginning with a snapshot of the durable definitions stamped
        with the current position (it takes none of its own). Written over a spare (a
        consumed segment) when there is one: overwriting pages the kernel holds costs less
        than allocating new ones (`REUSE_BYTES`). The spare becomes the segment once its
        first records are on disk (`_write_locked`); its records are salted with the new
        number, so that those of its last life past the new end never count."""
        self.active += 1
        self.segments[self.active] = 0
        self.active_size = 0
        self.salt = 0
        self.salts.pop(self.active, None)  # a number set aside at the start may come again
        if self.spares:
            self.spare_for[self.active] = self.spares.popleft()
            self.written_over += 1
            self.salt = self.salts[self.active] = records.salt(self.active)
        epoch = self.sequencer.epoch if self.sequencer is not None else 0
        body = apply.durable_definitions(self.broker) if self.broker is not None else {}
        snapshot = records.encode_body(body)
        data = records.frame(records.SNAPSHOT, epoch, self.handed, snapshot)
        for chunk in records.salted(data, self.salt) if self.salt else [data]:
            self.pending.chunks.append((self.active, chunk))
            self.active_size += len(chunk)
        self.last_at = 0

    def _compact(self) -> None:
        """Delete the oldest segments that hold no live message; carry forward the live
        messages of the oldest while there are too many segments. Runs after a batch is on
        disk and only over segments the writer is done with. A segment larger than
        CARRY_BYTES is read by the writer's thread and carried a CARRY_BYTES chunk a turn:
        in one go, a 64 MiB segment held every member's loop for two seconds (they compact
        in step), and the controller failed the primary over."""
        if self.carrying is not None or self.closed:
            return  # one carry at a time; it compacts again when it is done
        busy = {seg for seg, _ in self.pending.chunks}
        while len(self.segments) > self.max_segments:
            oldest = next(iter(self.segments))
            if oldest == self.active or oldest in busy or oldest in self.pinned:
                break  # a page reads from it: the log holds a deep queue
            if self.segments[oldest] * CARRY_BELOW > self.enqueued[oldest]:
                break  # mostly live still: consumers will empty it, copying it would not
            if self.segments[oldest] and self._draining(oldest):
                self._look_again()
                break  # its few live messages are being consumed: they go without a copy
            if not self.segments[oldest] and not self.marked:
                self._carried(oldest)  # nothing live in it, and no requeued flag to keep
                continue
            path = self._path(oldest)
            # Its records only: a segment written over holds its last life's after them.
            size = self.sizes.get(oldest)
            if size is None:
                size = path.stat().st_size
            if self.loop is not None and size > CARRY_BYTES:
                self.carrying = _Carry(oldest, self.generation)
                fut = self.loop.run_in_executor(None, _read_head, path, size)
                fut.add_done_callback(self._carry_read)
                return
            _whole, moved = self._carry_forward(oldest, _read_head(path, size))
            log.info("compaction: carried %d live messages out of segment %d", moved, oldest)
            self._carried(oldest)
        for seg in list(self.segments):
            if seg == self.active or seg in busy or self.segments[seg] > 0:
                break
            self._delete(seg)

    def _delete(self, seg: int) -> None:
        """Segment `seg` holds nothing live: it goes with the next batch, kept as a spare to
        be written over when its messages were large (`REUSE_BYTES`) and spares are few."""
        del self.segments[seg]
        enqueued = self.enqueued.pop(seg, 0)
        self.pending.deletes.append(seg)
        kept = len(self.spares) + len(self.pending.spares)
        if self.inflight is not None:
            kept += len(self.inflight.spares)
        if (
            records.CRC32C_IN_C
            and kept < SPARES
            and seg not in self.pinned  # a copy may be reading it: not written over
            and 0 < enqueued * REUSE_BYTES <= self.sizes.get(seg, 0)
        ):
            self.pending.spares.append(seg)

    def _draining(self, seg: int) -> bool:
        """True while segment `seg`'s live messages are being consumed: their number fell
        less than CARRY_PATIENCE ago (or it was first seen that recently), and it has been
        watched for less than CARRY_LIMIT."""
        live, now = self.segments[seg], self.clock()
        watched_seg, watched_live, fell, first = self.watched
        if watched_seg != seg:
            self.watched = (seg, live, now, now)
            return True
        if live < watched_live:
            self.watched = (seg, live, now, first)
            return now - first < CARRY_LIMIT
        return now - fell < CARRY_PATIENCE and now - first < CARRY_LIMIT

    def _look_again(self) -> None:
        """Compact again once the patience is over, whether or not anything is written."""
        if self.look_again is None and self.loop is not None:
            self.look_again = self.loop.call_later(CARRY_PATIENCE, self._looked_again)

    def _looked_again(self) -> None:
        self.look_again = None
        self._compact()

    def _carried(self, seg: int) -> None:
        """A segment's live messages are written again: it goes once that is on disk."""
        self._delete(seg)
        self._schedule()

    def _carry_read(self, fut: asyncio.Future[bytes]) -> None:
        carry = self.carrying
        assert carry is not None and self.loop is not None
        if fut.exception() is not None or carry.generation != self.generation:
            if fut.exception() is not None:
                log.warning("compaction: cannot read segment %d: %s", carry.seg, fut.exception())
            self.carrying = None  # tried again after a later write
            return
        carry.data = fut.result()
        self.loop.call_soon(self._carry_step)

    def _carry_step(self) -> None:
        """Carry one chunk of the segment being compacted, whole records only."""
        carry = self.carrying
        assert carry is not None and self.loop is not None
        if carry.generation != self.generation or carry.seg not in self.segments or self.closed:
            self.carrying = None  # the log was reset (a backup took a full copy), or closed
            return
        data, pos = carry.data, carry.pos
        size = CARRY_BYTES
        while True:
            end = min(len(data), pos + size)
            good, moved = self._carry_forward(carry.seg, data[pos:end])
            carry.moved += moved
            if end == len(data):
                good = end - pos  # the segment's end: what is not whole is a torn tail
                break
            if good:
                break
            size *= 2  # no whole record in the chunk: a large one (or damage) spans it
        carry.pos = pos + good
        carry.turns += 1
        if carry.pos < len(data):
            self.loop.call_soon(self._carry_step)
            return
        log.info(
            "compaction: carried %d live messages out of segment %d (%d bytes, in %d turns)",
            carry.moved,
            carry.seg,
            len(data),
            carry.turns,
        )
        self.carrying = None
        self._carried(carry.seg)
        self._compact()

    def _carry_forward(self, seg: int, data: bytes) -> tuple[int, int]:
        """Write again, as they were, the enqueue records in `data` (a segment, or a chunk
        of one) of the segment's live messages, and the durable marks (a requeued message's
        redelivered flag) of live messages. Returns the bytes of whole records read (a record
        cut at the end of `data` is left for the next chunk) and the messages carried."""
        found, good_end, _corrupt, _torn = records.scan(data, str(seg), salt=self.salts.get(seg, 0))
        moved = 0
        for rtype, epoch, offset, payload in found:
            kind = rtype & records.TYPE_MASK
            if kind == records.MARK:
                if records.read_key(payload) in self.marked:  # in memory or in a page
                    self._append(records.frame(records.MARK, epoch, offset, payload))
                continue
            if kind != records.ENQUEUE:
                continue
            vhost, queue, mid = records.read_key(payload)
            key = (vhost, queue, mid)
            at = self.where.get(key)
            if at is None or at >> AT_BITS != seg:
                continue
            self.where[key] = (self.active << AT_BITS) | self.active_size
            self.segments[self.active] += 1
            self.enqueued[self.active] += 1
            self._change(key)
            self._append(records.frame(records.ENQUEUE, epoch, offset, payload))
            moved += 1
        return good_end, moved

    def _flush(self, due: bool = False) -> None:
        self.flush_scheduled = False
        if due:
            self.lazy = None
        pending = self.pending
        if self.inflight is not None or not (pending.chunks or pending.deletes or pending.epochs):
            return
        if self.closed:  # what the node's last turns added (a chunk carried, say): not written
            return
        assert self.loop is not None
        if not due and self._may_wait(pending):
            if self.lazy is None:
                self.lazy = self.loop.call_later(LAZY_SECONDS, self._flush, True)
            return
        if self.lazy is not None:
            self.lazy.cancel()
            self.lazy = None
        batch, self.pending = pending, _Batch(self.generation, pending.number + 1)
        batch.through = self.handed
        self.inflight = batch
        if self._small(batch):
            # After what this turn sends: the records reach the backups, the deliveries
            # their consumers, before the loop waits for the disk.
            self.loop.call_soon(self._write_here, batch)
            return
        self._write_there(batch)

    def _may_wait(self, pending: _Batch) -> bool:
        """Whether nothing waits for `pending` yet: no callback, no confirm or durable reply
        (the Sequencer's waiters ask for offsets in order), no segment to delete or epoch to
        add, and not much of it."""
        if pending.callbacks or pending.deletes or pending.epochs or self.write_error:
            return False
        if pending.size >= LAZY_BYTES:
            return False
        sequencer = self.sequencer
        waiters = sequencer.waiters if sequencer is not None else None
        return not (waiters and waiters[-1][0] > self._synced)

    def _small(self, batch: _Batch) -> bool:
        """Whether `batch` is written on the loop: a few records appended to segments
        already open, on a disk whose recent writes were fast. Deleting segments, a new
        segment (its directory is fsynced) and the epochs file go to the thread."""
        if self.write_recent >= INLINE_SECONDS or batch.deletes or batch.epochs:
            return False
        size = 0
        for seg, data in batch.chunks:
            if seg not in self.fds:
                return False
            size += len(data)
        return size <= INLINE_BYTES

    def _write_there(self, batch: _Batch) -> None:
        assert self.loop is not None
        fut = self.loop.run_in_executor(None, self._write_batch, batch)
        fut.add_done_callback(lambda f: self._written(batch, f))

    def _write_here(self, batch: _Batch) -> None:
        """Write and fsync a small batch (`_small`) on the loop itself: under a light load
        (a publisher waiting for each confirm) handing it to the writer thread and back
        costs more than the write does, in thread switches. While a checkpoint being written
        holds the log, it goes to the thread."""
        if not self.lock.acquire(blocking=False):
            self._write_there(batch)
            return
        assert self.loop is not None
        fut: asyncio.Future[tuple[float, float] | None] = self.loop.create_future()
        try:
            fut.set_result(self._write_locked(batch))
            self.written_here += 1
        except Exception as exc:
            fut.set_exception(exc)
        finally:
            self.lock.release()
        self._written(batch, fut)

    def _write_batch(self, batch: _Batch) -> tuple[float, float] | None:
        with self.lock:
            return self._write_locked(batch)

    def _write_locked(self, batch: _Batch) -> tuple[float, float] | None:
        """Write and fsync `batch`; the seconds that writing and fsyncing its records took,
        and fsyncing alone, or None when it held no records."""
        if batch.generation != self.generation or self.closed:
            return None  # written for a log that was reset meanwhile, or closed
        if batch.epochs:
            self._write_epochs(batch.epochs)
            batch.epochs = []  # on disk: a retry after a failed write must not add them again
        touched: dict[int, int] = {}
        groups: dict[int, list[Chunk]] = {}
        for seg, data in batch.chunks:
            groups.setdefault(seg, []).append(data)
            if seg not in touched:
                touched[seg] = self._fd(seg)
        start = time.perf_counter()
        for seg, parts in groups.items():
            _write_all(touched[seg], parts)
        written = time.perf_counter()
        if self.fsync:
            for fd in touched.values():
                _datasync(fd)  # the space is allocated (`_allocate`): the data is what changed
        end = time.perf_counter()
        took = (end - start, end - written) if touched else None
        # A spare written into becomes its segment now that its first records are on disk:
        # a start never reads it under the new number with its last life's records in front.
        # Until the rename and its directory are on disk, the batch has failed, and it is
        # written again (from where `sizes` says) and renamed again.
        renamed = [seg for seg in touched if seg in self.spare_for]
        for seg in renamed:
            _rename_once(self._spare_path(self.spare_for[seg]), self._path(seg))
        if renamed and self.fsync:
            sync_dir(self.dir)
        for seg in renamed:
            del self.spare_for[seg]
        for seg, parts in groups.items():
            self.sizes[seg] = self.sizes.get(seg, 0) + sum(len(p) for p in parts)
        self._delete_consumed(batch)
        return took

    def _delete_consumed(self, batch: _Batch) -> None:
        """Delete the batch's consumed segments, or rename them to spares, the directory
        synced before anything is written into one. The batch's records are on disk: a
        failure here only leaves space unfreed or a spare unkept, never fails the batch."""
        kept: list[int] = []
        for seg in batch.deletes:
            fd_or_none = self.fds.pop(seg, None)
            try:
                if fd_or_none is not None:
                    os.close(fd_or_none)
                if seg in batch.spares:
                    _rename_once(self._path(seg), self._spare_path(seg))
                    kept.append(seg)
                else:
                    self._path(seg).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot delete the consumed segment %d: %s", seg, exc)
        if kept and self.fsync:
            try:
                sync_dir(self.dir)
            except OSError as exc:  # not known to be renamed: not written into
                log.warning("consumed segments %s not kept to write over: %s", kept, exc)
                for seg in kept:
                    with contextlib.suppress(OSError):
                        self._spare_path(seg).unlink()
                kept = []
        batch.spares = kept

    def _write_epochs(self, added: list[tuple[int, int]]) -> None:
        path = self.dir / "epochs"
        with open(path, "a") as f:
            f.write("".join(f"{e} {o}\n" for e, o in added))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _written(self, batch: _Batch, fut: asyncio.Future[tuple[float, float] | None]) -> None:
        if self.closed:
            return  # the node is stopping; what this batch waited for is not done
        exc = fut.exception()
        if exc is not None:
            if not isinstance(exc, OSError):
                log.error("unexpected error, please report it as a bug: store writer: %r", exc)
            log.error(
                "cannot write the log in %s: %s; holding %d bytes of records and their "
                "confirms until it can",
                self.dir,
                exc,
                sum(len(data) for _, data in batch.chunks),
            )
            self.write_error = exc if isinstance(exc, OSError) else OSError(str(exc))
            self.on_write_error(self.write_error)
            self.write_recent = float("inf")  # tried again on the thread, never on the loop
            # Keep the batch: it goes first when the writer tries again. Not the records of a
            # log that started over since (a backup took a copy): they would go into a
            # segment of the old log, which a start replays before the new one's.
            assert self.loop is not None
            if batch.generation == self.generation:
                self.pending.chunks[:0] = self._unwritten(batch)
                self.pending.deletes[:0] = batch.deletes
                self.pending.spares[:0] = batch.spares
                self.pending.epochs[:0] = batch.epochs
            self.pending.callbacks[:0] = batch.callbacks
            self.inflight = None
            self.loop.call_later(self.retry_seconds, self._retry)
            return
        if self.write_error is not None:
            log.warning("the log in %s is writable again", self.dir)
            self.write_error = None
            self.write_recent = INLINE_SECONDS  # as at the start: measured again
            self.on_write_error(None)
        self.inflight = None
        if batch.generation == self.generation:  # not a batch of the log a reset replaced
            self._synced = max(self._synced, batch.through)
            self.spares.extend(batch.spares)
            for seg in batch.deletes:
                self.salts.pop(seg, None)  # gone: its name is no longer asked for
        self.synced_batches += 1
        took = fut.result()
        if took is not None:
            # One slow write sends the next batches to the thread at once; fast ones bring
            # them back by degrees. (Averaging all but stalls kept more batches on the loop
            # beside other members' fsyncs, and ten publishers lost 15%: the thread lets
            # the loop go on while it waits.)
            recent, fsync = took
            self.write_recent = max(recent, 0.8 * self.write_recent + 0.2 * recent)
            self.fsync_seconds(fsync)
        while self.unwritten and self._on_disk(self.unwritten[0]):
            page = self.unwritten.popleft()
            if self.held_bytes[page.key] > self.page_bytes // 4:  # read back from the log
                page.held = None
                self.held_bytes[page.key] -= page.body_bytes
        for cb in batch.callbacks:
            try:
                cb()
            except Exception:
                log.exception("unexpected error, please report it as a bug: sync callback")
        if self.sequencer is not None:
            self.sequencer.progress()
        if len(self.segments) > 1:
            self._compact()
        if self.pending.chunks or self.pending.deletes or self.pending.epochs:
            self._flush()

    def _unwritten(self, batch: _Batch) -> list[tuple[int, Chunk]]:
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
        return self._named(seg, seg in self.salts)

    def _named(self, seg: int, reused: bool) -> Path:
        """Segment `seg`'s file: `.reused.seg` when it was written over a spare."""
        return self.dir / f"{seg:020d}{REUSED_SUFFIX if reused else '.seg'}"

    def _spare_path(self, seg: int) -> Path:
        return self.dir / f"{seg:020d}{SPARE_SUFFIX}"

    def _fd(self, seg: int) -> int:
        """Segment `seg` open for writing after its last record, with its space up to
        `segment_bytes` allocated ahead (`_allocate`); under the lock."""
        fd = self.fds.get(seg)
        if fd is None and seg in self.spare_for:
            try:  # written over from its start; renamed once that is on disk
                fd = os.open(self._spare_path(self.spare_for[seg]), os.O_WRONLY)
            except OSError as exc:
                log.warning("segment %d: its spare is gone (%s); a new file instead", seg, exc)
                del self.spare_for[seg]
            else:
                self.fds[seg] = fd
        if fd is None:
            fd = os.open(self._path(seg), os.O_WRONLY | os.O_CREAT, 0o644)
            try:  # kept only once it is where the next record goes, and its entry on disk
                end = self.sizes.get(seg, 0)
                os.lseek(fd, end, os.SEEK_SET)
                self._allocate(fd, end)
                if self.fsync:
                    sync_dir(self.dir)
            except BaseException:
                os.close(fd)
                raise
            self.fds[seg] = fd
        return fd

    def _allocate(self, fd: int, end: int) -> None:
        """Allocate the segment's space after `end` ahead of its records, as etcd's WAL does:
        a write into space already allocated leaves the file's size as it is, so
        `fdatasync` mostly flushes the data alone, where each append's sync wrote the inode
        too (ext4: a publisher waiting for each confirm, 3 members, 0.93 ms a message against
        1.01). A start after a crash reads the zeros left as the log's end (`records.scan`)
        and cuts them off; a stop cuts them off itself (`close`). Where the file system
        cannot, the segment grows as it is written, as before."""
        if end >= self.segment_bytes or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, end, self.segment_bytes - end)
        except OSError as exc:
            os.ftruncate(fd, end)  # whatever it allocated before failing
            if not self.allocate_failed:
                self.allocate_failed = True
                log.info("segments are not allocated ahead in %s: %s", self.dir, exc)

    # -- checkpoints --

    def _checkpoint_soon(self) -> None:
        if not self.checkpoint_scheduled and not self.checkpoint_running:
            self.checkpoint_scheduled = True
            assert self.loop is not None
            self.loop.call_soon(self.checkpoint)  # once the change under way is whole

    def _checkpoint_ended(
        self,
        done: asyncio.Future[_Made | None],
        started: float,
        generation: int,
        number: int,
    ) -> None:
        # A later capture may be under way (a member checkpoints at once after a copy reset
        # its log): it alone ends the run, and its parts are the ones kept. This one's are
        # older than its capture, which took the changes since out of `changed`.
        newest = number == self.checkpoints_made
        if newest:
            self.checkpoint_running = False
        if not done.cancelled() and done.exception() is not None:
            log.warning("a checkpoint was not written: %s", done.exception())
        elif not done.cancelled() and (made := done.result()) is not None:
            self.checkpoint_seconds(time.monotonic() - started)
            # Each is the queue's part as it was at the capture; one that changed since is
            # in `changed`, and the next capture drops it. A log reset since names nothing.
            if newest and generation == self.generation:
                # The heads named now, and those of the queues named by their parts (the
                # sections that the capture kept): the others' pages are of no use now.
                for key in self.named_heads.keys() - made.heads.keys() - self.sections.keys():
                    del self.named_heads[key]
                self.named_heads.update(made.heads)
                self.sections.update(made.sections)
                self.section_parts.update(made.parts)
        if newest and self.since_checkpoint >= self.checkpoint_due and not self.closed:
            self._due()

    def _due(self) -> None:
        """Enough records for a checkpoint, if what it would name anew allows (`_cost`): it
        is taken, or looked at again after an eighth of checkpoint_records more."""
        if self.checkpoint_scheduled or self.checkpoint_running:
            return  # looked at when the one being made ends
        since, least = self.since_checkpoint, self.checkpoint_records
        wait = max(least, self.checkpoint_size // CHECKPOINT_BYTES_A_RECORD)
        if since < wait:
            self.checkpoint_due = wait
        elif since >= self._cost(wait):
            self._checkpoint_soon()
        elif self.settle_once and since >= self._cost(wait, since - least // 2):
            self.early = True  # the queues still changing allow it
            self._checkpoint_soon()
        else:
            self.checkpoint_due = since + max(1, least // 8)

    def _cost(self, wait: int, after: int = -1) -> int:
        """The records the next checkpoint waits for, at least `wait`, for the queues that
        changed later than `after` records since the last (the others are named by their
        parts, or named anew at most once since a checkpoint by the rule, `settle_once`): a
        quarter of their messages in memory, and the bytes of the file and of their part
        files over CHECKPOINT_BYTES_A_RECORD. Pages are not counted as messages: a page
        costs its ids at most, and a queue far deeper than memory would leave no checkpoint
        for millions of records; a member's pages, named by their ids, are in its part's
        bytes."""
        queues = self.where.queues
        if not self.sections:  # none written, or a reset since: all of them, in memory
            return max(wait, sum(len(index) for index in queues.values()) // DUE_SHARE)
        messages = written = 0
        for key, at in self.changed.items():
            if at <= after:
                continue
            index = queues.get(key)
            if index is not None:
                messages += len(index)
            part = self.section_parts.get(key)
            if part is not None:  # written again, as big as it was
                with contextlib.suppress(OSError):
                    written += (self.dir / part).stat().st_size
        return max(
            wait,
            messages // DUE_SHARE,
            (self.checkpoint_size + written) // CHECKPOINT_BYTES_A_RECORD,
        )

    def checkpoint(self) -> None:
        """Take a checkpoint of the state now; written once every record it names is on
        disk. What it names is captured here, on the loop, in a few C-speed copies; its bytes
        are made on the writer's thread, which gives the loop its turn as it goes: with a
        million messages in memory (a cluster member's queues), made here they held the loop
        2.5 s."""
        self.checkpoint_scheduled = False
        self.since_checkpoint = 0
        if not self.checkpoint_records:
            return  # checkpoints are off
        if self.broker is None or self.sequencer is None or self.loop is None or self.closed:
            return
        self.checkpoints_made += 1
        # The capture refers to the live messages and index keys of the queues that changed
        # until its bytes are made, and a collection meanwhile walked all of it, on the
        # loop: 0.3-0.5 s with a million messages under load. Frozen at once (a splice of
        # lists), the collector leaves it be. The young garbage is collected before it is
        # made, not after: that collection would walk it too. What else lives then is
        # frozen too, as the next full collection would have frozen it (collector.py), a
        # little earlier: a cycle that dies meanwhile waits for collector.py's thaw, which
        # comes only once the queues are shallow.
        started = time.monotonic()
        gc.collect(1)
        state, number, generation = self._captured(), self.checkpoints_made, self.generation
        self.checkpoint_due = self.checkpoint_records  # then as `_due` finds
        self.settle_once, self.early = not self.early, False
        gc.freeze()
        loop = self.loop
        self.checkpoint_running = True

        def write() -> None:
            made = loop.run_in_executor(None, self._write_checkpoint, state, number, generation)
            made.add_done_callback(
                lambda done: self._checkpoint_ended(done, started, generation, number)
            )

        self.when_synced(write)

    def _captured(self) -> _Captured:
        assert self.broker is not None and self.sequencer is not None
        sequencer = self.sequencer
        sections = self.sections
        for key in self.changed:
            sections.pop(key, None)
            self.section_parts.pop(key, None)
        self.changed = {}
        reused = dict(sections)
        parts = {self.section_parts[key] for key in reused if key in self.section_parts}
        pages = [
            (
                key,
                [
                    (
                        p.count,
                        p.body_bytes,
                        p.first_mid,
                        p.last_mid,
                        [*p.extents],
                        dict(p.segs),
                        # Packed, never changed once made; a page that forgot some, or one a
                        # start made of a checkpoint's messages (`only`), gives its ids as
                        # a list, packed on the writer's thread (`_page_ids`). Named by its
                        # messages one by one, as it once was, a busy queue a member's start
                        # left as pages was named so until it was read back, and the next
                        # start read each message's record: 0.4-1.2 s of a rejoin.
                        p.mids() if p.gone or p.only is not None else p.ids,
                    )
                    for p in key_pages
                ],
            )
            for key, key_pages in self.pages.items()
            if key not in reused
        ]
        head = {
            "epoch": sequencer.epoch,
            "offset": sequencer.offset,
            "boundaries": [*sequencer.boundaries],
            "resume": [self.active, self.active_size],
            "last": self.last_at,  # the record that ends at the resume point (`_ends_at`)
            "definitions": base64.b64encode(
                records.encode_body(apply.durable_definitions(self.broker))
            ).decode(),
            "marked": [list(k) for k in self.marked],
            "enqueued": dict(self.enqueued),
        }
        # The messages in memory of the queues that page, in order, with the pages between
        # them: the writer's thread names each run between two pages as pages of the log,
        # so that a start reads none of them (`_head_pages`). A queue with pages takes its
        # new messages into its tail (`Queue._to_tail`), which a member restarted under
        # load has for as long as the load goes on: named one by one, its messages were
        # each read at the next start.
        heads = []
        named: dict[tuple[str, str], list[_Named]] = {}
        if self.page_bytes:
            for vh in self.broker.vhosts.values():
                for q in vh.queues.values():
                    key = (vh.name, q.name)
                    if q.pageable and (q.messages or q.tail_count) and key not in reused:
                        heads.append((key, [*q.messages, *q.tail, *q.filling]))
                        named[key] = self.named_heads.get(key, [])
        # The entries of each queue not named by its part of the last checkpoint, in a copy
        # of each of its dicts. An emptied queue's index goes: its next message makes one.
        where: dict[tuple[str, str], list[dict[int, int]]] = {}
        for key, index in list(self.where.queues.items()):
            if not index:
                del self.where.queues[key]
            elif key not in reused:
                where[key] = [dict(shard) for shard in index.dicts()]
        return _Captured(head, where, pages, heads, reused, parts, named)

    def _write_checkpoint(self, state: _Captured, number: int, generation: int) -> _Made | None:
        """Write the checkpoint, and return each queue's part of it; None when it is not
        written (stopped, the log reset since, or a newer one written already)."""
        if generation != self.generation or number <= self.checkpoint_written:
            return None
        made = _Made()
        # Without the lock: the writer goes on meanwhile.
        data = _checkpoint_bytes(state, made, f"{PART_PREFIX}{self.token}-{number}-")
        # Its parts' files count only when their queue changes again (`_cost`).
        self.checkpoint_size = len(data)
        # Written and synced beside it without the lock too: the log's writer takes the lock
        # for each batch, and waited for the whole file (11 MB with a million messages) and
        # its fsync. Only the rename is under it, after the checks. Two may be in flight.
        tmp = self.dir / f"checkpoint.{number}{TMP_SUFFIX}"
        written = [tmp]
        try:
            for name, part in made.files.items():
                written.append(self.dir / name)
                write_file(self.dir / name, part, durable=self.fsync)
            write_file(tmp, data, durable=self.fsync)
            if made.files and self.fsync:
                sync_dir(self.dir)  # the parts' names on disk before the rename that names them
        except OSError:
            for path in written:  # a full disk keeps no part of it
                path.unlink(missing_ok=True)
            raise
        with self.lock:
            if self.closed or generation != self.generation or number <= self.checkpoint_written:
                for path in written:
                    path.unlink(missing_ok=True)
                return None
            os.replace(tmp, self.dir / "checkpoint")
            self.checkpoint_written = number
            named = state.parts | set(made.files)
            gone, self.parts_on_disk = self.parts_on_disk - named, named
        self._drop_parts(gone)
        return made

    def _drop_parts(self, names: set[str]) -> None:
        """Delete the part files the checkpoint on disk no longer names, once its rename is
        on disk: a crash before would leave the one before, which names them."""
        if not names:
            return
        try:
            if self.fsync:
                sync_dir(self.dir)
            for name in names:
                (self.dir / name).unlink(missing_ok=True)
        except OSError as exc:  # only their space is not freed; the next start deletes them
            log.warning("cannot delete the parts of an old checkpoint in %s: %s", self.dir, exc)

    def predict(self) -> tuple[int, list[tuple[int, int]]] | None:
        """The end and the epoch boundaries a start (`open`) is to recover, told before it
        loads anything: the checkpoint's head, then the records after its resume point,
        scanned (their checksums checked) and not applied. A cluster member that restarted
        tells its primary these at once, and the primary makes the member's copy while the
        member loads (`Member`). A guess, which the member checks against what it loaded; None
        where the start would cut something short (a corrupt record, an unfinished
        transaction), where the checkpoint's head cannot be used, and where more than two
        segments follow it (no checkpoint: the whole log), which a prediction would read
        twice. Called before `open`."""
        paths = sorted(self.dir.glob("*.seg"))
        self.salts = _salts(paths)  # as `open` sets them again
        boundaries: list[tuple[int, int]] = []
        end = resume_seg = resume_pos = 0
        if self.checkpoint_records and (self.dir / "checkpoint").exists():
            try:
                body = _checkpoint_body((self.dir / "checkpoint").read_bytes())
                end = int(body["offset"])
                boundaries = [(int(e), int(o)) for e, o in body["boundaries"]]
                resume_seg, resume_pos = (int(x) for x in body["resume"])
                self._check_resume(body)  # else the start replays the whole log
            except (ValueError, KeyError, TypeError):
                return None
        after = [p for p in paths if _number(p) >= resume_seg]
        if sum(p.stat().st_size for p in after) - resume_pos > 2 * self.segment_bytes:
            return None  # read twice, more would slow the start down (sizes: with the space
            # allocated ahead of the records, `_allocate`)
        for path in after:
            seg = _number(path)
            base = resume_pos if seg == resume_seg else 0
            _data, _more, (found, _good_end, corrupt, _torn) = _scanned(
                path, base, True, None, self.salts.get(seg, 0)
            )
            if corrupt:
                return None
            for _rtype, epoch, offset, _payload in found:
                if offset > end:  # as the replay follows them (`_replay_one`)
                    if not boundaries or boundaries[-1][0] != epoch:
                        boundaries.append((epoch, offset))
                    end = offset
            if found and found[-1][0] & records.MORE:
                return None  # a transaction cut short: the start cuts it off
        return end, _with_epochs(boundaries, self._read_epochs(), end)

    def _read_checkpoint(self) -> dict[str, Any] | None:
        path = self.dir / "checkpoint"
        if not path.exists():
            return None
        try:
            body = _checkpoint_body(path.read_bytes())
            parts = set()
            loaded = {}
            for i, entry in enumerate(body["queues"]):
                if "part" in entry:
                    body["queues"][i] = self._read_part(entry)
                    parts.add(entry["part"])
                    key = (entry["vhost"], entry["queue"])
                    ref = _part_ref(key, entry["part"], entry["size"], entry["crc"])
                    loaded[key] = (ref, entry["part"], 0)  # its messages counted below
            # Whole, before anything of it is applied. Its arrays are decoded once, here,
            # for the load to take: decoded again there, a million ids took a fifth of a
            # start.
            for entry in body["queues"]:
                for typecode, name in (("Q", "offsets"), ("L", "epochs"), ("Q", "at")):
                    entry[name] = _unpacked(typecode, entry[name])
                if not len(entry["offsets"]) == len(entry["epochs"]) == len(entry["at"]):
                    raise ValueError(f"queue '{entry['queue']}': arrays of unequal length")
                key = (entry["vhost"], entry["queue"])
                if key in loaded and not entry["pages"]:  # reused only if held in memory
                    loaded[key] = (*loaded[key][:2], len(entry["offsets"]))
                for page in entry["pages"]:
                    count, _b, _first, _last, extents, segs, *ids = page
                    [(int(a), int(b), int(c)) for a, b, c in extents]
                    {int(k): int(v) for k, v in segs.items()}
                    if ids:
                        page[6] = [(int(e), _unpacked("Q", o)) for e, o in ids[0]]
                        if sum(len(o) for _e, o in page[6]) != count:
                            raise ValueError(f"queue '{entry['queue']}': a page's ids miscounted")
            self._check_resume(body)
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
            log.warning("checkpoint %s not used (%s): replaying the whole log", path, exc)
            return None
        self.parts_on_disk, self.loaded_parts = parts, loaded
        return body

    def _check_resume(self, body: dict[str, Any]) -> None:
        """Raise ValueError unless a whole record of the log ends at checkpoint `body`'s
        resume point."""
        seg, pos = body["resume"]
        if not self._path(seg).exists() or self._path(seg).stat().st_size < pos:
            raise ValueError(f"its resume point, segment {seg} byte {pos}, is gone")
        last = body.get("last", -1)  # checkpoints before 2026-11-28 do not say
        if pos and last >= 0 and not self._ends_at(seg, last, pos):
            raise ValueError(f"no record ends at its resume point, segment {seg} byte {pos}")

    def _reuse_loaded_parts(self) -> None:
        """After a start, the next checkpoint names a queue by the part file it was loaded
        from, as a checkpoint names a queue that did not change since the last: the first
        checkpoint after a restart named a million messages held in memory anew (1.3 s of
        the writer's thread). Only a queue the records replayed did not name, held in
        memory as the part named it: every message in the index at its place (none left
        out as corrupt). A queue that pages (the default budget) is not: its part names
        pages, which a start makes again in its own way, and it is named anew."""
        loaded, self.loaded_parts = self.loaded_parts, {}
        touched, self.touched = self.touched, set()
        for key, (ref, name, count) in loaded.items():
            index = self.where.queues.get(key)
            if count and key not in touched and index is not None and len(index) == count:
                self.sections[key] = ref
                self.section_parts[key] = name

    def _read_part(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A queue's part of a checkpoint that is a file of its own, whole and checked."""
        name = entry["part"]
        if not isinstance(name, str) or not name.startswith(PART_PREFIX) or "/" in name:
            raise ValueError(f"queue '{entry['queue']}': its part is named {name!r}")
        try:
            raw = (self.dir / name).read_bytes()
        except OSError as unread:
            raise ValueError(f"queue '{entry['queue']}': its part {name}: {unread}") from None
        if len(raw) != entry["size"] or zlib.crc32(raw) != entry["crc"]:
            raise ValueError(f"queue '{entry['queue']}': its part {name} is damaged")
        section: dict[str, Any] = json.loads(raw)
        if (section["vhost"], section["queue"]) != (entry["vhost"], entry["queue"]):
            raise ValueError(f"queue '{entry['queue']}': its part {name} is another queue's")
        return section

    def _ends_at(self, seg: int, at: int, end: int) -> bool:
        """Whether the record at byte `at` of segment `seg` is whole and ends at `end`. A
        segment's size cannot say that the records a checkpoint names are there: its space
        is allocated ahead (`_allocate`), and lost writes would read as zeros."""
        if not 0 <= at < end:
            return False
        fd = os.open(self._path(seg), os.O_RDONLY)
        try:
            data = os.pread(fd, end - at, at)
        finally:
            os.close(fd)
        if records.problem_at(data, 0, self.salts.get(seg, 0)) is not None:
            return False
        length: int = records.REC_HDR.unpack_from(data, 0)[1]
        return records.REC_HDR.size + length == len(data)

    def _load_checkpoint(
        self,
        body: dict[str, Any],
        broker: Broker,
        sequencer: Sequencer,
        result: Recovered,
        stop_at_corrupt: bool,
    ) -> int:
        """Make the state the checkpoint names; returns the messages it named that are in
        memory now or in pages. A message whose record is corrupt is left out: a lone node
        says it skipped it; a cluster member, whose state after a restart is not whole until
        the primary sent what it lacks, gets it back from the primary."""
        sequencer.boundaries = [(e, o) for e, o in body["boundaries"]]
        sequencer.offset = body["offset"]
        sequencer.epoch = max(sequencer.epoch, body["epoch"])
        apply.apply(broker, records.SNAPSHOT, base64.b64decode(body["definitions"]))
        self.enqueued.update({int(seg): n for seg, n in body["enqueued"].items()})
        wanted: dict[int, list[tuple[Queue, int, int]]] = {}  # segment -> (queue, mid, pos)
        pages: dict[Queue, list[Page]] = {}
        for entry in body["queues"]:
            vh = broker.vhosts.get(entry["vhost"])
            q = vh.queues.get(entry["queue"]) if vh is not None else None
            if q is None:
                continue
            for offset, epoch, at in zip(
                entry["offsets"], entry["epochs"], entry["at"], strict=True
            ):
                wanted.setdefault(at >> AT_BITS, []).append(
                    (q, records.mid(epoch, offset), at & AT_MASK)
                )
            for count, body_bytes, first, last, extents, segs, *ids in entry["pages"]:
                page = Page((q.vhost.name, q.name), count, body_bytes, first, last)
                page.extents = [(seg, start, end) for seg, start, end in extents]
                page.segs = {int(seg): n for seg, n in segs.items()}
                if ids:
                    page.ids = ids[0]  # decoded by `_read_checkpoint`
                pages.setdefault(q, []).append(page)
        items: dict[Queue, list[tuple[int, Message | Page | tuple[int, int, int]]]] = {}
        for seg, entries in wanted.items():
            salt = self.salts.get(seg, 0)
            path = self._path(seg)
            if not path.exists():
                continue  # consumed, or carried forward, after the resume point
            with _Mapped(path) as mapped:
                for q, mid, pos in entries:
                    # Each message's frame alone, from the page cache: reading the whole
                    # segment (64 MiB) had the kernel zero and fill pages for bytes the start
                    # mostly did not use, a third of the checkpoint's CPU (issue 16).
                    data = mapped.frame(pos)
                    if self.page_bytes and q.pageable:
                        # Left in the log, read when the queue gets to it: a start need not
                        # read and decode the head of every deep queue.
                        sizes = records.enqueue_sizes(data, 0)
                        # A member's digest will say it holds these: their checksums are
                        # checked now (a corrupt one is left out, and the primary sends it).
                        if sizes is not None and (
                            not self.keep_ids or records.problem_at(data, 0, salt) is None
                        ):
                            at = (seg << AT_BITS) | pos
                            items.setdefault(q, []).append((mid, (at, sizes[0], sizes[1])))
                            continue
                    problem = records.problem_at(data, 0, salt)
                    if problem is not None:
                        corrupt = Corruption(str(path), pos, problem)
                        if stop_at_corrupt:
                            log.error(
                                "corrupt record in the log; the primary sends it: %s", corrupt
                            )
                        else:
                            log.error("corrupt record in the log, skipped: %s", corrupt)
                        result.corrupt.append(corrupt)
                        continue
                    rtype, epoch, offset, payload = records.read_at(data, 0)
                    try:
                        _v, _q, _mid, route, props, body_ = records.read_enqueue(payload)
                    except Exception as exc:  # whole and checked, but not a record it can read
                        self._not_applied(epoch, offset, rtype, payload, exc, result)
                        continue
                    self.where[(q.vhost.name, q.name, mid)] = (seg << AT_BITS) | pos
                    message = apply.message(q, mid, route, props, body_)
                    items.setdefault(q, []).append((mid, message))
        for q, queue_pages in pages.items():
            for page in queue_pages:
                # A member's page must know its ids (a checkpoint of an earlier version's
                # does not): read back, as is one a consumer took part of.
                # With no budget (queue_memory_bytes 0 since the checkpoint), every message
                # is in memory: the pages are read back too.
                known = page.ids is not None or not self.keep_ids
                if (
                    known
                    and self.page_bytes
                    and all(self._path(seg).exists() for seg, _s, _e in page.extents)
                ):
                    items.setdefault(q, []).append((page.first_mid, page))
                    continue
                # Part of it consumed since (or no budget, or no ids): what is left comes
                # back as messages.
                for msg, at in self._read(page, q, whole=False):
                    self.where[(q.vhost.name, q.name, msg.mid)] = at
                    items.setdefault(q, []).append((msg.mid, msg))
        count = 0
        for q, queue_items in items.items():
            queue_items.sort(key=lambda item: item[0])
            lazy: Run = []
            lazy_bytes = 0
            for mid, item in queue_items:
                if isinstance(item, tuple):
                    lazy.append((mid, *item))
                    lazy_bytes += item[2]
                    if lazy_bytes < PAGE_BYTES:
                        continue
                    item = self._lazy_page(q, lazy)
                    lazy, lazy_bytes = [], 0
                elif lazy:
                    page = self._lazy_page(q, lazy)
                    self._restore_page(q, page)
                    count += page.count
                    lazy, lazy_bytes = [], 0
                if isinstance(item, Page):
                    self._restore_page(q, item)
                else:
                    q.restore(item)
                count += 1 if isinstance(item, Message) else item.count
            if lazy:
                page = self._lazy_page(q, lazy)
                self._restore_page(q, page)
                count += page.count
        for vhost, queue, mid in body["marked"]:
            vh = broker.vhosts.get(vhost)
            q = vh.queues.get(queue) if vh is not None else None
            if q is not None:
                q.mark(mid)
                self.marked.add((vhost, queue, mid))
        return count

    def _lazy_page(self, q: Queue, lazy: Run) -> Page:
        """A page of a checkpoint's messages, left in the log (`Page.only`)."""
        page = Page(
            (q.vhost.name, q.name),
            len(lazy),
            sum(body for *_x, body in lazy),
            lazy[0][0],
            lazy[-1][0],
        )
        page.only = {mid: at for mid, at, _length, _body in lazy}
        page.extents, page.segs = _extents(lazy)
        return page

    def _restore_page(self, q: Queue, page: Page) -> None:
        self.pages.setdefault(page.key, set()).add(page)
        for seg in page.segs:
            self.pinned[seg] += 1
        q.restore_page(page)

    # -- open and recover --

    def open(
        self,
        broker: Broker,
        sequencer: Sequencer,
        loop: asyncio.AbstractEventLoop,
        *,
        stop_at_corrupt: bool = False,
    ) -> Recovered:
        """Recover the broker's state from the log through the apply path, then start
        appending. A lone node skips a corrupt record and says so; a cluster member
        (`stop_at_corrupt`) keeps the log up to it, sets the rest aside and takes it from
        the primary."""
        self.broker, self.sequencer, self.loop = broker, sequencer, loop
        self.dir.mkdir(parents=True, exist_ok=True)
        result = Recovered()
        began = time.monotonic()
        paths = sorted(self.dir.glob("*.seg"))
        # A reused segment is known by its name (`REUSED_SUFFIX`), and read with its salt. A
        # spare is a consumed segment: written into or not, it holds nothing the log needs.
        self.salts = _salts(paths)
        for spare in self.dir.glob(f"*{SPARE_SUFFIX}"):
            spare.unlink()
        epochs = self._read_epochs()
        grouper = records.Grouper()
        if self.checkpoint_records:
            checkpoint = self._read_checkpoint()
        else:  # checkpoints off: one from before would not follow what the log does now
            (self.dir / "checkpoint").unlink(missing_ok=True)
            checkpoint = None
        # What a crash left: a checkpoint before its rename, a part no checkpoint names.
        left = list(self.dir.glob(f"checkpoint*{TMP_SUFFIX}"))
        left += [p for p in self.dir.glob(f"{PART_PREFIX}*") if p.name not in self.parts_on_disk]
        for path in left:
            try:
                path.unlink()
            except OSError as kept:  # only its space is not freed
                log.warning("cannot delete %s, part of a checkpoint a crash left: %s", path, kept)
        sequencer.applying = self.recovering = True
        try:
            resume_seg = resume_pos = 0
            lasts: dict[int, int] = {}  # where each segment's last record begins, if known
            if checkpoint is not None:
                for path in paths:  # the records it names are on disk
                    self.sizes[_number(path)] = path.stat().st_size
                try:
                    result.from_checkpoint = self._load_checkpoint(
                        checkpoint, broker, sequencer, result, stop_at_corrupt
                    )
                    resume_seg, resume_pos = checkpoint["resume"]
                    lasts[resume_seg] = checkpoint.get("last", -1)
                except apply.NotApplied as exc:
                    log.error("checkpoint not applied (%s): replaying the whole log", exc)
            replaying = time.monotonic()
            result.checkpoint_seconds = replaying - began
            for i, path in enumerate(paths):
                seg = _number(path)
                self.segments[seg] = 0
                if seg < resume_seg:  # the checkpoint holds what it says
                    self.sizes[seg] = path.stat().st_size
                    continue
                base = resume_pos if seg == resume_seg else 0
                positions: list[int] = []
                data, more, (found, good_end, corrupt, torn) = _scanned(
                    path, base, stop_at_corrupt, positions, self.salts.get(seg, 0)
                )
                if base:
                    positions = [base + p for p in positions]
                    good_end += base
                    for c in corrupt:
                        c.offset += base
                if torn or (stop_at_corrupt and corrupt):
                    why = "torn tail" if torn else "corrupt part"
                    if torn and seg in self.salts:
                        why = "torn tail, or the records of its last life,"  # written over
                    self._cut(path, good_end, result, why)
                elif more or good_end < base + len(data):  # zeros: allocated, never written
                    os.truncate(path, good_end)
                # What a page made while replaying reads back is on disk already.
                self.sizes[seg] = path.stat().st_size
                for c in corrupt:
                    if stop_at_corrupt:
                        log.error(
                            "corrupt record in the log; the rest comes from the primary: %s", c
                        )
                    else:
                        log.error("corrupt record in the log, skipped: %s", c)
                result.corrupt.extend(corrupt)
                self._replay(broker, sequencer, seg, found, positions, result, grouper)
                if positions:
                    lasts[seg] = positions[-1]
                if grouper.pending and i == len(paths) - 1:
                    # A transaction cut short by a crash: none of it happened.
                    size = sum(records.HEADER + len(r[3]) for r in grouper.pending)
                    self._cut(path, good_end - size, result, "unfinished transaction")
                    grouper.pending = []
                    lasts[seg] = -1  # somewhere before the transaction
                    self.grouped.clear()
                if stop_at_corrupt and corrupt:
                    for later in paths[i + 1 :]:
                        aside = later.with_suffix(".seg.bad")
                        later.rename(aside)
                        self.salts.pop(_number(later), None)
                        result.set_aside.append(str(aside))
                    break
            result.replay_seconds = time.monotonic() - replaying
            # Their owners' connections died with the process (as RabbitMQ deletes them).
            result.exclusive_dropped = apply.drop_exclusive(broker)
            # What is live: the messages the queues hold in memory, and their pages.
            replayed, self.where = self.where, ByQueue()
            for (vhost, queue), index in replayed.queues.items():
                vh = broker.vhosts.get(vhost)
                q = vh.queues.get(queue) if vh is not None else None
                if q is None:
                    continue
                into = self.where.of(vhost, queue)
                for mid, at in index.items():
                    if q.holds(mid):
                        into[mid] = at
                        self.segments[at >> AT_BITS] += 1
            for (vhost, queue), pages in list(self.pages.items()):
                vh = broker.vhosts.get(vhost)
                if vh is None or queue not in vh.queues:  # deleted with its vhost
                    for page in list(pages):
                        self._release(page)
                    continue
                for page in pages:
                    for seg, n in page.segs.items():
                        self.segments[seg] += n
            self.marked = self._live_marks()
            apply.done(broker)
            self._reuse_loaded_parts()
        finally:
            sequencer.applying = self.recovering = False
        result.messages = len(self.where) + sum(
            p.count for pages in self.pages.values() for p in pages
        )
        sequencer.boundaries = _with_epochs(sequencer.boundaries, epochs, sequencer.offset)
        if sequencer.boundaries:
            sequencer.epoch = max(sequencer.epoch, sequencer.boundaries[-1][0])
        self.handed = self._synced = sequencer.offset
        self._rewrite_epochs(sequencer.boundaries)
        self.sizes = {_number(p): p.stat().st_size for p in self.dir.glob("*.seg")}
        if self.segments:
            self.active = next(reversed(self.segments))
            self.active_size = self.sizes.get(self.active, 0)
            self.last_at = lasts.get(self.active, -1) if self.active_size else -1
            self.salt = self.salts.get(self.active, 0)
        else:
            self.active = 1
            self.segments[self.active] = 0
        if self.checkpoint_records and result.records >= self.checkpoint_records:
            self.checkpoint()  # the next start need not replay all that again
        result.seconds = time.monotonic() - began
        return result

    def _cut(self, path: Path, at: int, result: Recovered, why: str) -> None:
        size = path.stat().st_size
        if at >= size:
            return
        log.warning("cutting a %s off %s at byte %d (%d bytes)", why, path, at, size - at)
        with open(path, "r+b") as f:
            f.truncate(at)
        result.truncated.append(f"{path}@{at}")

    def _replay(
        self,
        broker: Broker,
        sequencer: Sequencer,
        seg: int,
        found: list[records.Scanned],
        positions: list[int],
        result: Recovered,
        grouper: records.Grouper,
    ) -> None:
        grouped = self.grouped
        for record, pos in zip(found, positions, strict=True):
            grouped.append((seg << AT_BITS) | pos)
            for rec in grouper.add(record):
                self._replay_one(broker, sequencer, grouped.popleft(), rec, result)

    def _replay_one(
        self,
        broker: Broker,
        sequencer: Sequencer,
        at: int,
        record: records.Scanned,
        result: Recovered,
    ) -> None:
        rtype, epoch, offset, payload = record
        result.records += 1
        if offset > sequencer.offset:  # a snapshot restates the position it was made at
            sequencer.follow(epoch, offset)
        where = self.where
        # A message record is read once, for the store and for the model (as a backup
        # takes one): read twice, its key took an eighth of a replay.
        if rtype == records.ENQUEUE:
            try:
                vhost, queue, mid, route, props, body = records.read_enqueue(payload)
            except Exception as exc:  # not a record it can apply: as apply.apply says
                self._not_applied(epoch, offset, rtype, payload, exc, result)
                return
            # Its place is known before it applies: the queue may page it at once. The last
            # copy of a record carried forward is the one that counts.
            key = (vhost, queue, mid)
            before = where.get(key)
            where[key] = at
            self.enqueued[at >> AT_BITS] += 1
            if self.loaded_parts:
                self.touched.add((vhost, queue))
            try:
                apply.enqueue(broker, vhost, queue, mid, route, props, body)
            except Exception as exc:  # whatever failed, it is this record's failure
                if before is None:
                    where.pop(key)
                else:
                    where[key] = before
                self._not_applied(epoch, offset, rtype, payload, exc, result)
            return
        if rtype == records.DEQUEUE or rtype == records.MARK:
            try:
                vhost, queue, mid = key = records.read_key(payload)
                if rtype == records.DEQUEUE:
                    apply.dequeue(broker, vhost, queue, mid)
                else:
                    apply.mark(broker, vhost, queue, mid)
            except Exception as exc:  # whatever failed, it is this record's failure
                self._not_applied(epoch, offset, rtype, payload, exc, result)
                return
            if rtype == records.MARK:
                self.marked.add(key)
                return
            where.pop(key)
            self.marked.discard(key)
            if self.loaded_parts:
                self.touched.add((vhost, queue))
            return
        try:
            apply.apply(broker, rtype, payload)
        except apply.NotApplied as why:
            self._set_aside(epoch, offset, rtype, payload, str(why), result)

    def _not_applied(
        self,
        epoch: int,
        offset: int,
        rtype: int,
        payload: bytes,
        exc: Exception,
        result: Recovered,
    ) -> None:
        """A message record read here and applied with what was read failed: set aside,
        in the words apply.apply's failure has (`apply.failed`)."""
        self._set_aside(
            epoch, offset, rtype, payload, str(apply.failed(rtype, payload, exc)), result
        )

    def _set_aside(
        self, epoch: int, offset: int, rtype: int, payload: bytes, why: str, result: Recovered
    ) -> None:
        """A record this node wrote and cannot apply (a bug): the node starts all the same,
        serving everything else; the record is named once in the log and in /status, and
        kept as it was in not-applied/<epoch>-<offset>.rec for whoever looks into it."""
        aside = self.dir / "not-applied"
        aside.mkdir(exist_ok=True)
        path = aside / f"{epoch}-{offset}.rec"
        path.write_bytes(records.frame(rtype, epoch, offset, payload))
        log.error(
            "record (%d, %d) in the log could not be applied and is set aside in %s: %s",
            epoch,
            offset,
            path,
            why,
        )
        result.not_applied.append(f"{epoch}:{offset} {why}")

    def _read_epochs(self) -> list[tuple[int, int]]:
        path = self.dir / "epochs"
        out: list[tuple[int, int]] = []
        if not path.exists():
            return out
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                epoch, first = (int(x) for x in line.split())
            except ValueError:
                log.error("%s line %d is not 'epoch first-offset'; ignored: %r", path, n, line)
                continue
            out.append((epoch, first))
        return out

    def _rewrite_epochs(self, boundaries: list[tuple[int, int]]) -> None:
        replace_file(self.dir / "epochs", "".join(f"{e} {o}\n" for e, o in boundaries))

    def close(self) -> None:
        """Stop; a last checkpoint if anything changed since one and all of it is on disk
        (the next start then replays nothing)."""
        if (
            self.checkpoint_records
            and self.since_checkpoint
            and self.broker is not None
            and self.write_error is None
            and self.inflight is None
            and not self.pending.chunks
        ):
            self.checkpoints_made += 1
            self._write_checkpoint(self._captured(), self.checkpoints_made, self.generation)
        if self.look_again is not None:
            self.look_again.cancel()
        if self.lazy is not None:
            self.lazy.cancel()
        with self.lock:
            self.closed = True
            for seg, fd in self.fds.items():
                with contextlib.suppress(OSError):  # the space allocated ahead (`_allocate`)
                    os.ftruncate(fd, self.sizes.get(seg, 0))
                os.close(fd)
            self.fds.clear()

    def stats(self) -> dict[str, object]:
        paged = sum(p.count for pages in self.pages.values() for p in pages)
        return {
            "segments": len(self.segments),
            "segments_written_over": self.written_over,
            "live_messages": len(self.where) + paged,
            "paged_messages": paged,
            "position": self.handed,
            "synced": self.synced,
        }


@dataclass
class _Captured:
    """What a checkpoint names, as the loop saw it: the small parts as they are written, the
    `where` index's shards and the pages copied, of the queues that changed."""

    head: dict[str, Any]
    where: dict[tuple[str, str], list[dict[int, int]]]  # each queue's: id -> place
    # (queue, its pages as (count, body bytes, first, last, extents, segments, ids packed,
    # or as a list to pack, or None))
    pages: list[tuple[tuple[str, str], list[Any]]]
    # Each queue that pages: its messages in memory and its pages, in order.
    heads: list[tuple[tuple[str, str], list[Message | Page]]] = field(default_factory=list)
    # The queues that did not change since an earlier checkpoint: named by their part of it.
    reused: dict[tuple[str, str], bytes] = field(default_factory=dict)
    parts: set[str] = field(default_factory=set)  # the part files of the queues reused
    # Each head's pages of the last checkpoint that named it (`Store.named_heads`).
    named: dict[tuple[str, str], list[_Named]] = field(default_factory=dict)


@dataclass
class _Made:
    """What a checkpoint's writer made: each queue's part as the checkpoint names it (its
    JSON object, or a reference to its file), the file of each queue's part that has one,
    and those files' bytes, written beside the checkpoint."""

    sections: dict[tuple[str, str], bytes] = field(default_factory=dict)
    parts: dict[tuple[str, str], str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    heads: dict[tuple[str, str], list[_Named]] = field(default_factory=dict)


class _Named:
    """A page of a queue's messages in memory (its head, or a run of its tail) as a
    checkpoint named it: its ids, rising, their places, and its JSON. The next checkpoint
    names it with the same JSON while the queue holds exactly those messages one after the
    other, each in the same place (`_head_run`)."""

    __slots__ = ("ats", "mids", "text")

    def __init__(self, mids: list[int], ats: array.array[int], text: bytes) -> None:
        self.mids = mids
        self.ats = ats
        self.text = text


TMP_SUFFIX: Final = ".tmp"  # a checkpoint being written: checkpoint.<number>.tmp
# A queue's part of a checkpoint this large or larger is a file of its own: a deep queue that
# does not change is named by it, not written again (a million messages: 11 MB).
PART_BYTES: Final = 1 << 18
PART_PREFIX: Final = "checkpoint-part."  # checkpoint-part.<token>-<number>-<n>
# A checkpoint's file is written whole each time: at most this many bytes of it for each
# record since the last, under half of what the log writes for a record of a 100-byte
# message. It bounds what the parts too small for a file of their own (PART_BYTES), written
# again each time, cost: 10,000 queues of 20 messages, say. A part file is written only for
# a queue named anew, and counted when its queue changes again (`_cost`).
CHECKPOINT_BYTES_A_RECORD: Final = 64
DUE_SHARE: Final = 4  # a checkpoint every at least this share of the messages it names (`_due`)
# Messages between two turns given to the loop (`give_way`): 8-30 ms of work. Fewer gave
# the loop more of the GIL and the checkpoint less: with 1,024, a lone node filling 2,000,000
# messages ran 1.3 times as fast, but the checkpoint written lagged, and a restart after
# kill -9 replayed more (serving in 2.8-5.1 s, not 1.8; docs/performance.md).
YIELD_EVERY: Final = 1 << 14
GIVE_WAY_SECONDS: Final = 0.0001


_owed = 0  # work done since the last turn given, in messages (`give_way`)


def give_way(work: int = YIELD_EVERY) -> None:
    """Count `work` (about as much as that many messages) done on a thread that works for
    the loop (a checkpoint's, a copy's), and once YIELD_EVERY are done, let the loop take
    the GIL. Compiled code never gives it up by itself, and a sleep of no time gave it up
    only to take it straight back, unless the loop had been waiting a whole switch interval
    (5 ms) and asked for it: under load on two cores, a primary's answers to its controller
    came up to 0.95 s late while a checkpoint was made. Asleep for a tenth of a millisecond,
    the thread leaves the GIL to the loop, if it wants it, at once. Counted, not given per
    queue or page: a sleep each of 10,000 queues doubled a checkpoint's time."""
    global _owed
    _owed += work
    if _owed >= YIELD_EVERY:
        _owed = 0
        time.sleep(GIVE_WAY_SECONDS)


def _checkpoint_bytes(state: _Captured, made: _Made, prefix: str) -> bytes:
    """A checkpoint's bytes, on the writer's thread: every YIELD_EVERY messages it gives the
    loop its turn (`give_way`). Each queue's part made anew goes into `made`, and one of
    PART_BYTES or more into a file of its own, named `prefix` and a number, which the
    checkpoint names; a queue in `state.reused` is named by the part it had."""
    by_queue, head_places = _split_where(state)
    runs = {key: _message_runs(items) for key, items in state.heads}
    pieces_of = {
        key: _head_runs(key, key_runs, head_places[key], state.named.get(key, []))
        for key, key_runs in runs.items()
    }
    pages: dict[tuple[str, str], list[Any]] = {}
    for key, key_pages in state.pages:
        by_queue.setdefault(key, ([], [], []))  # a queue with pages has its part
        # A page's ids (a cluster member's) as [epoch, offsets as a C array in base64] pairs.
        pages[key] = [
            [*page[:6], [[e, b"".join(_packed("Q", o)).decode()] for e, o in ids]]
            if (ids := _page_ids(page[6])) is not None
            else [*page[:6]]
            for page in key_pages
        ]
    seen = 0
    for key, pieces in pieces_of.items():
        # No head page's range holds an id named one by one.
        left = head_places[key]
        cuts = sorted(left)
        give_way(len(cuts))
        if _cut_inside(pieces, cuts):  # one named alone in a page's range: all anew
            left = head_places[key] = _merged(state.where.get(key, []))
            pieces = _head_runs(key, runs[key], left, [])
            cuts = sorted(left)
        named = _head_pages(pieces, cuts)
        made.heads[key] = named
        pages.setdefault(key, []).extend(named)
        held = by_queue.setdefault(key, ([], [], []))
        for mid, at in left.items():  # named one by one
            seen += 1
            if seen % YIELD_EVERY == 0:
                give_way()
            held[0].append(records.mid_offset(mid))
            held[1].append(records.mid_epoch(mid))
            held[2].append(at)
    # The JSON is put together here: json.dumps scanned every character of the arrays'
    # base64 (which needs no escapes), 150 ms with a million messages, holding the GIL.
    texts = []
    for key, (offsets, epochs, places) in by_queue.items():
        give_way(1)
        section = b"".join(
            [
                b'{"vhost":',
                json.dumps(key[0]).encode(),
                b',"queue":',
                json.dumps(key[1]).encode(),
                # Ids as (offset, epoch) and places, as arrays: a queue may hold millions.
                b',"offsets":"',
                *_packed("Q", offsets),
                b'","epochs":"',
                *_packed("L", epochs),
                b'","at":"',
                *_packed("Q", places),
                b'","pages":[',
                *_dumped(pages.get(key, [])),
                b"]}",
            ]
        )
        if len(section) >= PART_BYTES:
            name = f"{prefix}{len(made.files)}"
            made.files[name] = section
            made.parts[key] = name
            section = _part_ref(key, name, len(section), zlib.crc32(section))
        made.sections[key] = section
        texts.append(section)
    texts += state.reused.values()
    head = json.dumps(state.head, separators=(",", ":")).encode()
    text = b"".join([head[:-1], b',"queues":[', b",".join(texts), b"]}"])
    return CHECKPOINT_MAGIC + zlib.crc32(text).to_bytes(4, "big") + text


def _part_ref(key: tuple[str, str], name: str, size: int, crc: int) -> bytes:
    """How a checkpoint names a queue's part that is a file of its own."""
    return b"".join(
        [
            b'{"vhost":',
            json.dumps(key[0]).encode(),
            b',"queue":',
            json.dumps(key[1]).encode(),
            b',"part":',
            json.dumps(name).encode(),
            b',"size":%d,"crc":%d}' % (size, crc),
        ]
    )


Rows = tuple[list[int], list[int], list[int]]  # messages named one by one: offsets, epochs, places


def _split_where(
    state: _Captured,
) -> tuple[dict[tuple[str, str], Rows], dict[tuple[str, str], dict[int, int]]]:
    """The where index's messages by queue (the queues that changed): named one by one, or,
    in a queue that pages, by id with their places, for its head to take (`_head_run`). It
    gives way every YIELD_EVERY of them."""
    by_queue: dict[tuple[str, str], Rows] = {}
    head_places: dict[tuple[str, str], dict[int, int]] = {key: {} for key, _m in state.heads}
    seen = 0
    for key, shards in state.where.items():
        if key in head_places:
            head_places[key] = _merged(shards)
            continue
        offsets, epochs, places = by_queue.setdefault(key, ([], [], []))
        for shard in shards:
            for mid, at in shard.items():
                seen += 1
                if seen == YIELD_EVERY:
                    give_way()
                    seen = 0
                offsets.append(records.mid_offset(mid))
                epochs.append(records.mid_epoch(mid))
                places.append(at)
    return by_queue, head_places


def _merged(shards: list[dict[int, int]]) -> dict[int, int]:
    """A queue's index captured in shards, as one dict, a shard at a time: one copy in C (a
    shard of ten million messages' is 2%). It gives the loop a turn for every YIELD_EVERY
    messages, as a pass over them one by one does, and counts what is left with the work
    that follows (`give_way` counts a call once at most: the copies for followers count
    theirs a slice at a time, and more turns made them slower)."""
    out: dict[int, int] = {}
    seen = 0
    for shard in shards:
        out.update(shard)
        seen += len(shard)
        while seen >= YIELD_EVERY:
            give_way()
            seen -= YIELD_EVERY
    give_way(seen)
    return out


def _dumped(pages: list[Any]) -> list[bytes]:
    """A queue's `pages` as the parts of a JSON array's inside, a page at a time, each
    counted as the messages it holds (see `_checkpoint_bytes`): they carry their ids in
    base64, 11 MB with a million messages, which one call of json.dumps would scan holding
    the GIL."""
    out = []
    for i, page in enumerate(pages):
        if i:
            out.append(b",")
        if isinstance(page, _Named):  # a head's page, made into JSON as it was named
            out.append(page.text)
            continue
        out.append(json.dumps(page, separators=(",", ":")).encode())
        give_way(int(page[0]))
    return out


def _page_ids(ids: Any) -> list[tuple[int, array.array[int]]] | None:
    """A captured page's ids packed (`pack_ids`): they are, or are a list of ids to pack
    (a page that forgot some, or a start made of a checkpoint's messages), or None."""
    if ids and isinstance(ids[0], int):
        give_way(len(ids))
        return pack_ids(ids)
    return cast("list[tuple[int, array.array[int]]] | None", ids)


def _message_runs(items: list[Message | Page]) -> list[list[Message]]:
    """A queue's messages in memory, in order, as the runs between its pages."""
    runs: list[list[Message]] = []
    start = 0
    for i, item in enumerate(items):
        if isinstance(item, Page):
            if i > start:
                runs.append(cast(list[Message], items[start:i]))
            start = i + 1
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            give_way()
    if start < len(items):
        runs.append(cast(list[Message], items[start:]))
    give_way(len(items) % YIELD_EVERY)
    return runs


def _head_runs(
    key: tuple[str, str], runs: list[list[Message]], where: dict[int, int], named: list[_Named]
) -> list[Columns | _Named]:
    """A queue's runs of messages in memory as a checkpoint names them (`_head_run`): no
    page of them holds messages on both sides of a page of the queue."""
    return [piece for run in runs for piece in _head_run(key, run, where, named)]


def _head_run(
    key: tuple[str, str], msgs: list[Message], where: dict[int, int], named: list[_Named]
) -> list[Columns | _Named]:
    """A run of a queue's messages in memory (its head, or a run of its tail between two
    of its pages) as a checkpoint names it in pages (on the writer's thread): the
    messages whose ENQUEUE record `where` names (taken from it) and that stay in the log as
    they are (persistent, no expiration), in the head's order, each with a higher id than the
    one before (a message requeued out of order is named one by one). A page of the last
    checkpoint (`named`) whose messages come next, exactly, in order and each in its place,
    is named as it was: a FIFO queue's head is mostly what it held at the last checkpoint.
    The rest is in columns, which grow by a slice of lists at a time: compiled, an array's
    append is a method call."""
    place = records.place(*key)
    starts = {page.mids[0]: page for page in named}
    pieces: list[Columns | _Named] = []
    mids: list[int] = []
    ats: list[int] = []
    lengths: list[int] = []
    bodies: list[int] = []
    run: Columns = (mids, array.array("q"), array.array("q"), array.array("q"))
    last = -1
    i = count = 0
    while i < len(msgs):
        m = msgs[i]
        mid = m.mid
        page = starts.get(mid) if starts else None
        if page is not None and mid > last and _holds(msgs, i, page, where):
            _grown(run, ats, lengths, bodies)
            if mids:
                pieces.append(run)
                mids = []
                run = (mids, array.array("q"), array.array("q"), array.array("q"))
            pieces.append(page)
            i += len(page.mids)
            last = page.mids[-1]
            give_way(len(page.mids))
            continue
        i += 1
        count += 1
        if count == YIELD_EVERY:
            _grown(run, ats, lengths, bodies)
            give_way()
            count = 0
        if not m.persistent or m.expiration is not None or mid <= last:
            continue
        at = where.pop(mid, None)
        if at is None:
            continue
        mids.append(mid)
        ats.append(at)
        lengths.append(records.enqueue_size(place, m))
        bodies.append(m.body_size)
        last = mid
    _grown(run, ats, lengths, bodies)
    give_way(count)
    if mids:
        pieces.append(run)
    return pieces


def _holds(msgs: list[Message], i: int, page: _Named, where: dict[int, int]) -> bool:
    """Whether the head's messages from `i` on are exactly `page`'s, each still where the
    page says (in `where`, which gives them up): compaction moves records, and a page that
    names an old place would send a start to a segment since deleted."""
    mids = page.mids
    if [m.mid for m in msgs[i : i + len(mids)]] != mids:
        return False
    ats: list[int | None] = list(map(where.pop, mids, itertools.repeat(None)))
    if None not in ats and array.array("q", cast(list[int], ats)) == page.ats:
        return True
    for mid, at in zip(mids, ats, strict=True):  # named as the rest are
        if at is not None:
            where[mid] = at
    return False


def _grown(run: Columns, ats: list[int], lengths: list[int], bodies: list[int]) -> None:
    """Move the lists' values to the run's columns."""
    run[1].fromlist(ats)
    run[2].fromlist(lengths)
    run[3].fromlist(bodies)
    ats.clear()
    lengths.clear()
    bodies.clear()


def _cut_inside(pieces: list[Columns | _Named], others: list[int]) -> bool:
    """Whether one of `others` (sorted) falls inside a named page's range of ids."""
    for piece in pieces:
        if isinstance(piece, _Named):
            at = bisect.bisect_right(others, piece.mids[0])
            if at < len(others) and others[at] < piece.mids[-1]:
                return True
    return False


def _head_pages(pieces: list[Columns | _Named], others: list[int]) -> list[_Named]:
    """A head's pieces as pages (`_page_entry`), a named one as it was: a run's cut every
    PAGE_BYTES of bodies and wherever one of `others` (the queue's ids named one by one,
    sorted) falls between two of its messages. Each page says exactly which ids it holds
    (its runs of the log may hold records of messages consumed out of order), and no page's
    range holds an id it does not: a start puts pages and messages back in id order."""
    entries: list[_Named] = []
    for piece in pieces:
        if isinstance(piece, _Named):
            entries.append(piece)
            continue
        mids, _ats, _lengths, bodies = piece
        start = size = j = 0
        give_way(len(mids) % YIELD_EVERY)  # whole slices, below
        for i in range(len(mids)):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                give_way()
            mid = mids[i]
            while j < len(others) and others[j] < mid:
                if i > start and others[j] > mids[i - 1]:
                    entries.append(_page_entry(piece, start, i))
                    start, size = i, 0
                j += 1
            size += bodies[i]
            if size >= PAGE_BYTES:
                entries.append(_page_entry(piece, start, i + 1))
                start, size = i + 1, 0
        if start < len(mids):
            entries.append(_page_entry(piece, start, len(mids)))
    return entries


def _page_entry(run: Columns, start: int, end: int) -> _Named:
    """Messages `start` to `end` of `run` as a page, as a checkpoint names it: count, body
    bytes, first and last ids, extents, records per segment, and its ids (a run's rise) as
    [epoch, offsets as a C array in base64] pairs."""
    mids, ats, lengths, bodies = run
    extents, segs = _spans(list(ats[start:end]), list(lengths[start:end]))
    ids = mids[start:end]
    packed = [[e, b"".join(_packed("Q", o)).decode()] for e, o in pack_ids(ids)]
    entry = [end - start, sum(bodies[start:end]), ids[0], ids[-1], extents, segs, packed]
    return _Named(ids, ats[start:end], json.dumps(entry, separators=(",", ":")).encode())


def _extents(run: Run) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """Where the records of `run` (id, place, frame length, body length) are (`_spans`)."""
    return _spans([at for _m, at, _l, _b in run], [length for _m, _a, length, _b in run])


def _spans(ats: list[int], lengths: list[int]) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """Where the records at `ats` of `lengths` are: for each segment, one (segment, first
    byte, end byte) run of it holding them all, and how many it holds. Records of one
    segment mostly follow each other: each stretch of them is measured in local variables,
    and only its sum goes into the dicts."""
    spans: dict[int, list[int]] = {}
    segs: dict[int, int] = {}
    seg = first = end = count = -1
    for at, length in zip(ats, lengths, strict=True):
        pos = at & AT_MASK
        if at >> AT_BITS == seg:
            first, end, count = min(first, pos), max(end, pos + length), count + 1
            continue
        if count > 0:
            _span(spans, segs, seg, first, end, count)
        seg, first, end, count = at >> AT_BITS, pos, pos + length, 1
    if count > 0:
        _span(spans, segs, seg, first, end, count)
    return [(seg, start, end) for seg, (start, end) in sorted(spans.items())], segs


def _span(
    spans: dict[int, list[int]], segs: dict[int, int], seg: int, first: int, end: int, count: int
) -> None:
    """Add a stretch of `count` records of segment `seg`, bytes `first` to `end`."""
    span = spans.setdefault(seg, [first, end])
    span[0], span[1] = min(span[0], first), max(span[1], end)
    segs[seg] = segs.get(seg, 0) + count


PACK_EVERY: Final = 3 << 13  # values packed at a time: a whole number of base64's 3-byte groups


def _packed(typecode: str, values: Sequence[int]) -> list[bytes]:
    """`values` as a C array in base64, a piece at a time (see `_checkpoint_bytes`)."""
    out = []
    for start in range(0, len(values), PACK_EVERY):
        out.append(base64.b64encode(array.array(typecode, values[start : start + PACK_EVERY])))
        give_way(min(PACK_EVERY, len(values) - start))
    return out


def _unpacked(typecode: str, text: str) -> array.array[int]:
    out = array.array(typecode)
    out.frombytes(base64.b64decode(text))
    return out


READ_CHUNK: Final = 1 << 20  # a start reads a segment this much at a time (`_read_from`)


def _number(path: Path) -> int:
    """A segment's number, from its file's name (`<number>.seg`, `<number>.reused.seg`)."""
    return int(path.name.partition(".")[0])


def _read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of `path`."""
    with open(path, "rb") as f:
        return f.read(size)


def _rename_once(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, unless an earlier try did (and failed only after it)."""
    if not src.exists() and dst.exists():
        return
    os.rename(src, dst)


class _Mapped:
    """A segment mapped for reading frames here and there in it (`frame`). A disk that
    cannot read a mapped page ends the process (SIGBUS) where a read raised OSError; a start
    that meets such a disk would not get far either. Nothing truncates the segment while it
    is mapped: the start maps it before its replay cuts anything, and holds the data dir's
    lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.map: mmap.mmap | None = None

    def __enter__(self) -> _Mapped:
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.map is not None:
            self.map.close()

    def frame(self, pos: int) -> bytes:
        """The bytes of the frame at `pos`, as long as its header says (at most to the end
        of the segment): what `records.problem_at` and its kin check, at position 0."""
        mapped = self.map
        if mapped is None:
            return b""
        head = mapped[pos : pos + records.HDR_SIZE]
        if len(head) < records.HDR_SIZE:
            return head
        length: int = records.REC_HDR.unpack(head)[1]
        end = pos + records.HDR_SIZE + length
        if end > len(mapped):
            return head  # past the end: `problem_at` says so from the header alone
        return mapped[pos:end]


def _checkpoint_body(raw: bytes) -> dict[str, Any]:
    """A checkpoint file's JSON, its magic and checksum checked (ValueError if not)."""
    head = len(CHECKPOINT_MAGIC)
    text = raw[head + 4 :]
    if raw[:head] != CHECKPOINT_MAGIC or zlib.crc32(text) != int.from_bytes(
        raw[head : head + 4], "big"
    ):
        raise ValueError("not a checkpoint, or a damaged one")
    body: dict[str, Any] = json.loads(text)
    return body


def _salts(paths: list[Path]) -> dict[int, int]:
    """Each reused segment's salt, by number: a reused segment is known by its name
    (`REUSED_SUFFIX`)."""
    return {_number(p): records.salt(_number(p)) for p in paths if p.name.endswith(REUSED_SUFFIX)}


def _scanned(
    path: Path, base: int, stop_at_corrupt: bool, positions: list[int] | None, salt: int
) -> tuple[bytes, bool, tuple[list[records.Scanned], int, list[Corruption], bool]]:
    """Segment `path`'s bytes from `base` (`_read_from`), whether more follow them, and its
    records as `records.scan` reads them. A record that runs on into a stretch of zeros
    reads as torn where the reading stopped: the segment is then read whole."""
    for whole in (False, True):
        if positions is not None:
            positions.clear()
        data, more = _read_from(path, base, whole)
        scanned = records.scan(data, str(path), stop_at_corrupt, positions, salt)
        if not (scanned[3] and more):
            break
    return data, more, scanned


def _with_epochs(
    boundaries: list[tuple[int, int]], epochs: list[tuple[int, int]], end: int
) -> list[tuple[int, int]]:
    """`boundaries` merged with where each epoch began as the epochs file knows it (it
    does even when compaction deleted the segment that held that record), less what a torn
    or cut tail took away (after `end`)."""
    known = [(e, o) for e, o in epochs if o <= end]
    if not known:
        return boundaries
    merged = dict(known)
    merged.update((e, o) for e, o in boundaries if e not in merged)
    return sorted(merged.items(), key=lambda eo: (eo[1], eo[0]))


def _read_from(path: Path, base: int, whole: bool) -> tuple[bytes, bool]:
    """The bytes of segment `path` from `base`, and whether more follow them: unless
    `whole`, reading stops at a chunk of zeros, as the space allocated ahead of the records
    is (`Store._allocate`): after kill -9, reading all 64 MiB of it and looking through
    them took a restart 85-140 ms. A record that runs on into such a chunk (a body of
    zeros) reads as torn where the reading stopped, and is read again whole."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        f.seek(base)
        if whole or end - base <= READ_CHUNK or os.pread(f.fileno(), 1, end - 1) != b"\0":
            return f.read(), False  # no zeros at its end: a segment written to its end
        parts: list[bytes] = []
        while True:
            chunk = f.read(READ_CHUNK)
            if not chunk:
                return b"".join(parts), False
            if chunk.count(0) == len(chunk):
                return b"".join(parts), True
            parts.append(chunk)


IOV_MAX: Final = 1024  # what Linux takes in one writev
_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def _write_all(fd: int, parts: Sequence[Chunk]) -> None:
    """Every part, in order, by writev of a few buffers: runs of small records joined (a
    writev of many small buffers costs more than one copy), large ones (64 KiB messages) from
    their own buffers, not copied into one first."""
    views: list[memoryview] = []
    small: list[Chunk] = []
    for p in parts:
        if len(p) < records.BIG:
            small.append(p)
            continue
        if small:
            views.append(memoryview(b"".join(small)))
            small = []
        views.append(memoryview(p))
    if small:
        views.append(memoryview(b"".join(small)))
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + IOV_MAX])
        while written:
            first = views[i]
            if written >= len(first):
                written -= len(first)
                i += 1
            else:
                views[i] = first[written:]
                written = 0
