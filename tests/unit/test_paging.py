"""Paging and checkpoints at the model and store level: logs written record by record, the
real Store recovering them with a memory budget of one byte (every persistent message after a
queue's first stays in the log, a page of its own)."""

from __future__ import annotations

import array
import asyncio
import errno
import json
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from tandem.broker.model import apply, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.message import Message
from tandem.broker.model.queue import Queue
from tandem.broker.model.shards import SHARDS, SPLIT_AT
from tandem.broker.store import log as log_mod
from tandem.broker.store.log import Recovered, Store
from tests.support import sleeps_here

PERSISTENT = b"\x10\x00\x02"  # property flags: delivery-mode present; delivery-mode 2


def declare(queue: str = "q") -> bytes:
    body = {"name": queue, "durable": True, "auto_delete": False, "arguments": {}}
    return records.frame(records.DEFINE, 1, 0, records.define("/", "queue.declare", body))


def enqueue(mid: int, queue: str = "q", body: bytes | None = None) -> bytes:
    if body is None:
        body = str(mid).encode().rjust(16, b"0")  # longer than the budget: no page in memory
    route = b"\x00" + bytes([len(queue)]) + queue.encode()
    m = Message("", queue, route, PERSISTENT, body, len(body))
    m.mid = records.mid(1, mid)
    return records.frame(records.ENQUEUE, 1, mid, records.enqueue("/", queue, m))


def expiring(mid: int) -> bytes:
    """An ENQUEUE to q of a message with an expiration: a checkpoint names such a message one
    by one, never in a page of the head around it."""
    body = str(mid).encode().rjust(16, b"0")
    m = Message("", "q", b"\x00\x01q", b"\x11\x00\x02\x0560000", body, len(body))
    m.mid = records.mid(1, mid)
    return records.frame(records.ENQUEUE, 1, mid, records.enqueue("/", "q", m))


def keyed(rtype: int, mid: int, queue: str = "q", offset: int = 0) -> bytes:
    key = records.key("/", queue, records.mid(1, mid))
    return records.frame(rtype, 1, offset or mid, key)


@pytest.fixture(autouse=True)
def loops() -> Iterator[list[asyncio.AbstractEventLoop]]:
    """The stores' loops (never run: a store only schedules its writes on one)."""
    made: list[asyncio.AbstractEventLoop] = []
    LOOPS.append(made)
    yield made
    LOOPS.remove(made)
    for loop in made:
        loop.close()


LOOPS: list[list[asyncio.AbstractEventLoop]] = []


def recover(
    tmp_path: Path,
    page_bytes: int = 1,
    clock: Callable[[], float] = time.monotonic,
    **settings: int,
) -> tuple[Store, Broker]:
    store, broker, _result = recovered(tmp_path, page_bytes, clock, **settings)
    return store, broker


def recovered(
    tmp_path: Path,
    page_bytes: int = 1,
    clock: Callable[[], float] = time.monotonic,
    stop_at_corrupt: bool = False,
    **settings: int,
) -> tuple[Store, Broker, Recovered]:
    """`recover`, with what the start says it did, as a lone node (or, `stop_at_corrupt`, a
    cluster member) starts."""
    seq = Sequencer()
    broker = Broker(seq)
    store = Store(tmp_path, fsync=False, page_bytes=page_bytes, clock=clock, **settings)
    seq.disk = store
    loop = asyncio.new_event_loop()
    LOOPS[-1].append(loop)
    told = store.predict()
    checkpoint = (store.dir / "checkpoint").exists()
    result = store.open(broker, seq, loop, stop_at_corrupt=stop_at_corrupt)
    # What a restarted member tells its primary before it loads (`Store.predict`): its start
    # recovers exactly that, unless it found its checkpoint unusable (it then says Hello
    # again), or it is not told.
    if told is not None and not (checkpoint and result.from_checkpoint is None):
        assert told == (seq.offset, seq.boundaries)
    return store, broker, result


def write_log(tmp_path: Path, *frames: bytes) -> Path:
    (tmp_path / "log").mkdir(exist_ok=True)
    seg = tmp_path / "log" / f"{1:020d}.seg"
    seg.write_bytes(b"".join(frames))
    return seg


def bodies(q: Queue) -> list[int]:
    return [int(m.body_bytes()) for m in q.all_ready()]


class Taker:
    """A consumer that takes everything (the model's Consumer port)."""

    tag = "taker"
    no_ack = True
    exclusive = False

    def __init__(self) -> None:
        self.got: list[int] = []

    def ready(self) -> bool:
        return True

    def deliver(self, queue: Queue, msg: Message) -> None:
        self.got.append(int(msg.body_bytes()))

    def cancelled_by_broker(self, queue: Queue) -> None:
        pass


def in_epoch(epoch: int, offset: int, more: bool = False) -> bytes:
    """An ENQUEUE to q at (`epoch`, `offset`); `more`: a transaction's record, not its last."""
    body = str(offset).encode().rjust(16, b"0")
    m = Message("", "q", b"\x00\x01q", PERSISTENT, body, len(body))
    m.mid = records.mid(epoch, offset)
    return records.frame(records.ENQUEUE, epoch, offset, records.enqueue("/", "q", m), more=more)


def test_a_start_recovers_the_end_and_epochs_it_predicted_before_loading(tmp_path: Path) -> None:
    """A restarted member tells its primary its log's end and where each epoch began before
    it loads its store (`Store.predict`), from the checkpoint's head and a scan of the
    records after it: the start then recovers exactly that, across epochs, with a checkpoint
    and records after it, and with a torn tail. Where the start would cut records off (a
    transaction cut short, a corrupt record) it predicts nothing."""
    seg = write_log(tmp_path, declare(), *(in_epoch(1, i) for i in range(1, 4)))
    seg.write_bytes(seg.read_bytes() + in_epoch(2, 4) + in_epoch(2, 5))
    told = Store(tmp_path, fsync=False, checkpoint_records=1000).predict()
    assert told == (5, [(1, 1), (2, 4)])
    store, _broker, _result = recovered(tmp_path, stop_at_corrupt=True, checkpoint_records=1)
    assert store.sequencer is not None and store.sequencer.offset == 5
    checkpointed(store)  # names offsets up to 5
    store.close()
    with seg.open("ab") as f:  # records after the checkpoint, in a later epoch, a torn tail
        f.write(in_epoch(2, 6) + in_epoch(4, 7) + in_epoch(4, 8)[:20])
    told = Store(tmp_path, fsync=False, checkpoint_records=1000).predict()
    assert told == (7, [(1, 1), (2, 4), (4, 7)])
    store, _broker, result = recovered(tmp_path, stop_at_corrupt=True, checkpoint_records=1000)
    assert result.from_checkpoint is not None  # the prediction read the checkpoint's head
    assert store.sequencer is not None
    assert (store.sequencer.offset, store.sequencer.boundaries) == told
    store.close()
    unfinished = in_epoch(4, 8, more=True)
    with seg.open("ab") as f:
        f.write(unfinished)
    assert Store(tmp_path, fsync=False, checkpoint_records=1000).predict() is None
    data = seg.read_bytes()
    cut = data[: len(data) - len(unfinished)]
    flipped = bytearray(in_epoch(4, 8))
    flipped[-1] ^= 0xFF
    seg.write_bytes(cut + bytes(flipped) + in_epoch(4, 9))
    assert Store(tmp_path, fsync=False, checkpoint_records=1000).predict() is None


def test_a_record_carried_forward_lands_in_its_place_not_after_the_pages(tmp_path: Path) -> None:
    """Compaction wrote message 2 again after messages 3-8 (same frame, same position); the
    queue pages 4-8. Replay once put 2 after every page, and into a page whose id range then
    did not hold its members: reordered, and lost on reading back."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(3, 9)), enqueue(2))
    _store, broker = recover(tmp_path)
    q = broker.vhost("/").queues["q"]
    assert q.paged > 0
    assert bodies(q) == list(range(2, 9))


def test_a_queue_with_pages_and_an_empty_head_delivers_to_a_new_consumer(tmp_path: Path) -> None:
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 7)))
    _store, broker = recover(tmp_path)
    q = broker.vhost("/").queues["q"]
    got = q.get(no_ack=True)
    assert got is not None and int(got.body_bytes()) == 2
    q.settle_unacked_get(got)
    taker = Taker()
    q.add_consumer(taker)
    q.dispatch()
    assert taker.got == [3, 4, 5, 6]


def test_a_page_that_reads_back_nothing_is_passed_over(tmp_path: Path) -> None:
    seg = write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 6)))
    _store, broker = recover(tmp_path)
    q = broker.vhost("/").queues["q"]
    data = bytearray(seg.read_bytes())
    at = data.index(enqueue(3))
    data[at + len(enqueue(3)) - 5] ^= 0xFF  # message 3's body: its checksum fails
    seg.write_bytes(bytes(data))
    assert [int(q.get(no_ack=True).body_bytes()) for _ in range(3)] == [2, 4, 5]  # type: ignore[union-attr]


def test_the_first_pages_of_a_tail_stay_in_memory_up_to_the_budget(tmp_path: Path) -> None:
    """A queue a little deeper than its budget reads nothing back: with 64 bytes, the head
    holds message 2, and the page of 3 (16 bytes, a quarter of the budget) keeps its message;
    4, 5 and 6 are read from the log, where 3's and 5's records are now damaged."""
    seg = write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 7)))
    _store, broker = recover(tmp_path, page_bytes=64)
    q = broker.vhost("/").queues["q"]
    data = bytearray(seg.read_bytes())
    for mid in (3, 5):
        data[data.index(enqueue(mid)) + len(enqueue(mid)) - 5] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert [int(q.get(no_ack=True).body_bytes()) for _ in range(4)] == [2, 3, 4, 6]  # type: ignore[union-attr]


def test_a_queue_started_as_pages_keeps_new_messages_in_memory_while_its_budget_allows(
    tmp_path: Path,
) -> None:
    """A start leaves the head a checkpoint names in the log as pages, and a queue with pages
    takes each new message at their end, to keep its order. Those stay in memory while the
    budget allows (4 KiB: about seven 300-byte messages with their overhead); paged out and
    read back, a backup rejoining under load spent a fifth of its time on its busy queue's
    messages. Past the budget they page, a page filled before the next message stays."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 10)))
    store, broker = recover(tmp_path, page_bytes=4096, checkpoint_records=1)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    store, broker = recover(tmp_path, page_bytes=4096, checkpoint_records=1)
    q = broker.vhost("/").queues["q"]
    assert q.paged == 8

    def taken(mid: int) -> None:
        """Written and applied, as a backup takes an ENQUEUE."""
        m = Message("", "q", b"\x00\x01q", PERSISTENT, b"%0300d" % mid, 300)
        m.mid = records.mid(1, mid)
        data = records.frame(records.ENQUEUE, 1, mid, records.enqueue("/", "q", m))
        store.write(records.ENQUEUE, mid, data, ("/", "q", m.mid))
        apply.apply(broker, records.ENQUEUE, records.payload(data))

    for mid in range(10, 16):
        taken(mid)
    assert q.paged == 8 and q.ready == 14  # none paged: 6 x (300 + 256) bytes < 4 KiB
    for mid in range(16, 26):
        taken(mid)
    assert q.paged > 8  # past the budget
    apply.done(broker)
    taker = Taker()
    q.add_consumer(taker)
    q.dispatch()
    assert taker.got == list(range(2, 26))


def test_a_message_record_a_start_cannot_read_is_set_aside_and_the_rest_recovered(
    tmp_path: Path,
) -> None:
    """A replay reads each message record once, for the store and for the queue. One that
    cannot be read (a bug wrote it: its frame and checksum are whole) is set aside, with
    the words and the file a record the model cannot apply gets, and the start goes on."""
    bad_enqueue = records.frame(records.ENQUEUE, 1, 3, b"\x01/\x01q")
    bad_dequeue = records.frame(records.DEQUEUE, 1, 5, b"\x01/")
    write_log(tmp_path, declare(), enqueue(2), bad_enqueue, enqueue(4), bad_dequeue)
    store, broker = recover(tmp_path, page_bytes=1 << 20)
    assert bodies(broker.vhost("/").queues["q"]) == [2, 4]
    aside = tmp_path / "log" / "not-applied"
    assert sorted(p.name for p in aside.iterdir()) == ["1-3.rec", "1-5.rec"]
    assert (aside / "1-3.rec").read_bytes() == bad_enqueue
    assert len(store.where) == 2


def test_a_message_a_checkpoint_names_that_cannot_be_read_is_set_aside(tmp_path: Path) -> None:
    """The same for a message a checkpoint names, read at the start (no budget): its frame
    and checksum are whole, its route's length is past its end."""
    seg = write_log(tmp_path, declare(), enqueue(2), enqueue(3))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    good = records.payload(enqueue(3))
    bad = records.frame(records.ENQUEUE, 1, 3, good[:14] + b"\xff\xff" + good[16:])
    assert len(bad) == len(enqueue(3))
    seg.write_bytes(seg.read_bytes().replace(enqueue(3), bad))
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1)
    assert bodies(broker.vhost("/").queues["q"]) == [2]
    assert (tmp_path / "log" / "not-applied" / "1-3.rec").read_bytes() == bad


def test_a_members_start_checks_each_message_a_checkpoint_names_by_its_frame_alone(
    tmp_path: Path,
) -> None:
    """A member's start checks the checksum of each message of a pageable queue's head that a
    checkpoint names, reading its frame alone from the mapped segment (not the whole
    segment): one whose body was damaged is named corrupt at its place, for the primary to
    send; the others stay in the log, in order. (They expire: a checkpoint names such
    messages one by one, not as pages.)"""
    seg = write_log(tmp_path, declare(), *(expiring(i) for i in range(2, 7)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1, keep_ids=True)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    data = bytearray(seg.read_bytes())
    at = data.find(expiring(4))
    data[at + len(expiring(4)) - 1] ^= 0xFF  # the last byte of its body
    seg.write_bytes(bytes(data))
    _store, broker, result = recovered(
        tmp_path, 1 << 20, stop_at_corrupt=True, checkpoint_records=1, keep_ids=True
    )
    assert result.from_checkpoint == 4 and result.records == 0
    assert [(c.where, c.offset) for c in result.corrupt] == [(str(seg), at)]
    assert bodies(broker.vhost("/").queues["q"]) == [2, 3, 5, 6]


def test_pages_of_a_queue_deleted_and_declared_again_in_the_log_are_released(
    tmp_path: Path,
) -> None:
    delete = records.frame(records.DEFINE, 1, 0, records.define("/", "queue.delete", {"name": "q"}))
    write_log(
        tmp_path, declare(), *(enqueue(i) for i in range(2, 7)), delete, declare(), enqueue(9)
    )
    store, broker = recover(tmp_path)
    assert bodies(broker.vhost("/").queues["q"]) == [9]
    assert not store.pages and not store.pinned


def test_a_requeued_flag_replayed_survives_the_next_checkpoint(tmp_path: Path) -> None:
    write_log(tmp_path, declare(), enqueue(2), enqueue(3), keyed(records.MARK, 2))
    store, _broker = recover(tmp_path, checkpoint_records=1)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    store, broker = recover(tmp_path, checkpoint_records=1)
    q = broker.vhost("/").queues["q"]
    assert [(int(m.body_bytes()), m.redelivered) for m in q.all_ready()] == [(2, True), (3, False)]
    apply.done(broker)


def test_a_checkpoint_names_a_head_as_pages_of_exactly_its_messages(tmp_path: Path) -> None:
    """The head a checkpoint names is left in the log as pages, read when the queue gets to
    it: a start does no work for each message. Message 5 was consumed out of order; its
    record lies inside the runs of the page of 2-9, and must not come back."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 10)), keyed(records.DEQUEUE, 5))
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    assert broker.vhost("/").queues["q"].paged == 0  # within the budget: all in memory
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    q = broker.vhost("/").queues["q"]
    assert q.paged == 7 and not store.where  # nothing of the head was read at the start
    assert bodies(q) == [2, 3, 4, 6, 7, 8, 9]
    taker = Taker()
    q.add_consumer(taker)
    q.dispatch()
    assert taker.got == [2, 3, 4, 6, 7, 8, 9]


def test_a_checkpoint_gives_the_loop_its_turn_in_its_pass_over_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's bytes are made on the writer's thread, which holds the GIL until it
    gives way. Its pass over the where index once gave way only for messages named one by
    one: none when a queue's whole head was named as pages, which held a primary's loop past
    its controller's delay with a million messages. It gives way every YIELD_EVERY messages,
    with a sleep that is not of no time (`give_way`)."""
    count = 3 * log_mod.YIELD_EVERY
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(1, count + 1)))
    # No checkpoints: the start would make one on the executor's thread, giving way too.
    store, broker = recover(tmp_path, page_bytes=1 << 30, checkpoint_records=0)
    assert broker.vhost("/").queues["q"].paged == 0  # all in memory: the head names them all
    state = store._captured()
    given = sleeps_here(monkeypatch)
    by_queue, head_places = log_mod._split_where(state)
    assert not by_queue and len(head_places[("/", "q")]) == count  # all for the head to take
    assert len(given) == count // log_mod.YIELD_EVERY
    assert min(given) > 0  # a sleep of no time let the thread take the GIL straight back


def test_an_index_merged_a_shard_at_a_time_gives_way_as_a_pass_over_its_messages_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_merged` copies each shard in one call and gives the loop a turn for every
    YIELD_EVERY messages: a shard of two and a half times that gives it two, and its last
    half with the next shard's half one more (counted by one call of `give_way` each, as
    the copies count their slices, they gave two)."""
    given = sleeps_here(monkeypatch)
    monkeypatch.setattr(log_mod, "_owed", 0)
    every = log_mod.YIELD_EVERY
    big = {i: i for i in range(2 * every + every // 2)}
    small = {-i: i for i in range(1, every // 2 + 1)}
    merged = log_mod._merged([big, small])
    assert merged == big | small
    assert len(given) == 3


def test_a_message_named_alone_inside_a_head_keeps_its_place_after_a_start(tmp_path: Path) -> None:
    """Message 3 has an expiration, so the checkpoint names it one by one, not in a page of
    the head around it: the head's pages are cut there, and a start puts 3 back between 2
    and 4 (a page of 2-9 had put it after 9)."""
    write_log(tmp_path, declare(), enqueue(2), expiring(3), *(enqueue(i) for i in range(4, 10)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    _store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    q = broker.vhost("/").queues["q"]
    assert q.paged >= 7
    taker = Taker()
    q.add_consumer(taker)
    q.dispatch()
    assert taker.got == list(range(2, 10))


def test_a_start_with_no_budget_reads_a_checkpoints_pages_back(tmp_path: Path) -> None:
    """queue_memory_bytes set to 0 after a checkpoint named a head as pages: every message
    is in memory again, not a page of its own for each message after."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 10)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1)
    q = broker.vhost("/").queues["q"]
    assert q.paged == 0 and not store.pages and len(store.where) == 8
    assert bodies(q) == list(range(2, 10))


def test_a_checkpoint_whose_last_record_is_not_on_disk_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A segment's size says nothing of its records (its space is allocated ahead): a
    checkpoint is used only if the record it says ends at its resume point is there, whole.
    Here the last record's bytes read as zeros, as a write the disk lost would: the whole log
    is replayed, and the message is not named by a checkpoint that cannot be read back."""
    seg = write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 6)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    assert store.last_at == seg.stat().st_size - len(enqueue(5))
    store._write_checkpoint(store._captured(), 1, store.generation)
    store.close()
    with open(seg, "r+b") as f:
        f.seek(store.last_at)
        f.write(bytes(len(enqueue(5))))
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1)
    assert "no record ends at its resume point" in caplog.text
    assert bodies(broker.vhost("/").queues["q"]) == [2, 3, 4]
    assert store.last_at == seg.stat().st_size - len(enqueue(4))


def test_a_message_of_zeros_longer_than_a_read_comes_back_whole(tmp_path: Path) -> None:
    """A start reads a segment whose end is zeros (space allocated ahead, after kill -9)
    until the first chunk of zeros. A body of zeros longer than a chunk looks like one: the
    record runs on past where the reading stopped, and the segment is read again whole."""
    body = bytes(3 * log_mod.READ_CHUNK)
    m = Message("", "q", b"\x00\x01q", PERSISTENT, body, len(body))
    m.mid = records.mid(1, 2)
    zeros = records.frame(records.ENQUEUE, 1, 2, records.enqueue("/", "q", m))
    seg = write_log(tmp_path, declare(), zeros, enqueue(3), bytes(2 * log_mod.READ_CHUNK))
    _store, broker = recover(tmp_path, page_bytes=0)
    q = broker.vhost("/").queues["q"]
    assert [len(m.body_bytes()) for m in q.all_ready()] == [len(body), 16]
    assert seg.stat().st_size == len(declare() + zeros + enqueue(3))  # the zeros after: cut


def test_compaction_leaves_an_oldest_segment_whose_live_messages_are_being_consumed(
    tmp_path: Path,
) -> None:
    """The oldest segment of a deep queue being drained is the queue's head: under a
    saturated run every member read, scanned and "carried 0 live messages" out of a 64 MiB
    segment every seven seconds, the consumers having acked them meanwhile. It is carried
    once its live messages have not fallen for store.CARRY_PATIENCE."""
    from collections import Counter, OrderedDict

    from tandem.broker.store import log as log_mod

    write_log(tmp_path, enqueue(2))
    now = [0.0]
    store = Store(tmp_path, fsync=False, max_segments=2, clock=lambda: now[0])
    store.where[("/", "q", records.mid(1, 2))] = 1 << log_mod.AT_BITS  # segment 1, byte 0
    store.segments = OrderedDict([(1, 5), (2, 0), (3, 0)])  # 5 of segment 1's 100 live
    store.enqueued = Counter({1: 100, 2: 1, 3: 1})
    store.active = 3

    def look(live: int, at: float) -> bool:
        """Compact at time `at` with `live` messages left in segment 1: is it carried?"""
        now[0] = at
        if 1 in store.segments:
            store.segments[1] = live
        store._compact()
        return 1 not in store.segments

    patience = log_mod.CARRY_PATIENCE
    assert not look(5, 0.0)  # first seen
    assert not look(4, 1.0)  # consumed from
    assert not look(3, 1.0 + patience - 0.1)  # and again
    assert not look(3, 1.0 + 2 * patience - 0.2)  # not for a while yet
    assert look(3, 1.0 + 2 * patience)  # stuck: carried
    assert [seg for seg, _ in store.pending.chunks] == [3]  # message 2, written again


def test_compaction_carries_a_segment_consumed_too_slowly_after_a_limit(tmp_path: Path) -> None:
    """A consumer taking one message a second from the oldest segment would otherwise hold
    compaction (and the deletion of every younger empty segment) for hours."""
    from collections import Counter, OrderedDict

    from tandem.broker.store import log as log_mod

    write_log(tmp_path, enqueue(2))
    now = [0.0]
    store = Store(tmp_path, fsync=False, max_segments=2, clock=lambda: now[0])
    store.where[("/", "q", records.mid(1, 2))] = 1 << log_mod.AT_BITS
    store.segments = OrderedDict([(1, 10_000), (2, 0), (3, 0)])
    store.enqueued = Counter({1: 100_000, 2: 1, 3: 1})
    store.active = 3
    while 1 in store.segments:
        assert now[0] <= log_mod.CARRY_LIMIT + 1
        store.segments[1] -= 1  # one consumed a second
        store._compact()
        now[0] += 1.0
    assert now[0] >= log_mod.CARRY_LIMIT


def test_compaction_looks_again_once_its_patience_is_over_without_a_write(
    tmp_path: Path,
) -> None:
    """A node that goes idle right after the last ack would otherwise keep a segment to
    carry until something was written."""
    from collections import Counter, OrderedDict

    from tandem.broker.store import log as log_mod

    write_log(tmp_path, enqueue(2))
    now = [0.0]
    store = Store(tmp_path, fsync=False, max_segments=2, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    LOOPS[-1].append(loop)
    store.loop = loop
    store.where[("/", "q", records.mid(1, 2))] = 1 << log_mod.AT_BITS
    store.segments = OrderedDict([(1, 5), (2, 0), (3, 0)])
    store.enqueued = Counter({1: 100, 2: 1, 3: 1})
    store.active = 3
    store._compact()
    timer = store.look_again
    assert 1 in store.segments and timer is not None
    assert timer.when() - loop.time() == pytest.approx(log_mod.CARRY_PATIENCE, abs=0.5)
    now[0] = log_mod.CARRY_PATIENCE  # nothing written meanwhile
    store._looked_again()  # what the timer calls
    assert 1 not in store.segments and store.look_again is None


def test_a_closed_store_writes_nothing_more_and_raises_nothing(tmp_path: Path) -> None:
    """A node's last turns after the store closed (a chunk being carried forward, a record
    come in) scheduled a write on the stopped executor: "Executor shutdown has been called",
    logged as an unexpected error at every stop under load."""
    seg = write_log(tmp_path, declare(), enqueue(2))
    store, _broker = recover(tmp_path, page_bytes=0)
    loop = LOOPS[-1][-1]
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    store.close()
    loop.run_until_complete(loop.shutdown_default_executor())
    before = seg.read_bytes()
    store._append(enqueue(3))
    store._compact()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert errors == [] and seg.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "log").glob("*.seg")) == [seg.name]


def due_after(store: Store, queue: str, mids: Iterable[int]) -> int:
    """Hand the store an ENQUEUE of each of `mids` to `queue` (offset = id), each consumed
    at once if `queue` is "busy" (it stays shallow: its part of a checkpoint stays small);
    the records since the last checkpoint once one is scheduled (a test fails if none is)."""
    for mid in mids:
        written(store, records.ENQUEUE, queue, mid, mid)
        if not store.checkpoint_scheduled and queue == "busy":
            written(store, records.DEQUEUE, queue, mid, mid)
        if store.checkpoint_scheduled:
            return store.since_checkpoint
    raise AssertionError("no checkpoint scheduled")


def test_a_checkpoint_written_again_whole_waits_for_records_in_proportion_to_its_bytes(
    tmp_path: Path,
) -> None:
    """A checkpoint's file is written whole, the parts too small for a file of their own
    too: the next waits for its bytes over CHECKPOINT_BYTES_A_RECORD records, so that
    checkpoints add a bounded share to the disk's writes."""
    deep = [enqueue(i, "deep") for i in range(1, 801)]
    write_log(tmp_path, declare("deep"), declare("busy"), *deep)
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    store.checkpoint_records = 1
    checkpointed(store)
    size = store.checkpoint_size
    assert size == (tmp_path / "log" / "checkpoint").stat().st_size
    written(store, records.ENQUEUE, "busy", 801, 801)
    checkpointed(store)  # the deep queue by its part: nothing of it named anew
    since = due_after(store, "busy", range(802, 10_000))
    assert since == store.checkpoint_size // log_mod.CHECKPOINT_BYTES_A_RECORD > 1


def test_an_emptied_queue_leaves_no_index_behind_at_the_next_capture(tmp_path: Path) -> None:
    """Each queue's messages have their own index: one that emptied goes at the next
    checkpoint (a checkpoint and the status count over them), made again by its next
    message."""
    write_log(tmp_path, declare(), enqueue(1), enqueue(2))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert ("/", "q") in store.where.queues
    written(store, records.DEQUEUE, "q", 1, 3)
    written(store, records.DEQUEUE, "q", 2, 4)
    checkpointed(store)
    assert ("/", "q") not in store.where.queues and len(store.where) == 0
    written(store, records.ENQUEUE, "q", 5, 5)
    assert len(store.where) == 1


def test_a_queue_past_one_dict_of_index_comes_back_whole_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    """A queue's index splits into shards past SPLIT_AT messages; a checkpoint names every
    one of them, and a start finds them all."""
    count = SPLIT_AT + 100
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(1, count + 1)))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert len(store.where.of("/", "q").dicts()) == SHARDS
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert bodies(broker.vhost("/").queues["q"]) == list(range(1, count + 1))


def test_a_checkpoint_is_written_without_the_log_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's writer takes the store's lock for each batch: a checkpoint holding it while
    its file (11 MB with a million messages) was written and synced held up every confirm
    and every ack behind it. Only the rename is made under the lock."""
    write_log(tmp_path, declare(), *[enqueue(i) for i in range(1, 5)])
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    held_while_written: list[bool] = []
    real = log_mod.write_file

    def write_file(path: Path, data: bytes, *, durable: bool = False) -> None:
        held_while_written.append(store.lock.locked())
        real(path, data, durable=durable)

    monkeypatch.setattr(log_mod, "write_file", write_file)
    checkpointed(store)
    assert held_while_written == [False]
    assert sorted(p.name for p in (tmp_path / "log").glob("checkpoint*")) == ["checkpoint"]
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert held(broker) == {"q": [1, 2, 3, 4]}


def checkpoint_on_a_full_disk(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Take a checkpoint whose every file write stops half way on ENOSPC, and run the
    store's loop until it has failed."""
    real = log_mod.write_file

    def full(path: Path, data: bytes, *, durable: bool = False) -> None:
        real(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log_mod, "write_file", full)
    assert store.loop is not None
    store.checkpoint()
    while store.checkpoint_running:
        store.loop.run_until_complete(asyncio.sleep(0.01))


def test_a_checkpoint_the_disk_cannot_take_leaves_the_last_one_and_no_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk fails the checkpoint's write: the last checkpoint stays as it was, no
    part of the new one is left beside it, and the node goes on (a warning)."""
    write_log(tmp_path, declare(), *[enqueue(i) for i in range(1, 5)])
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    checkpointed(store)
    before = (tmp_path / "log" / "checkpoint").read_bytes()
    written(store, records.ENQUEUE, "q", 5, 5)
    checkpoint_on_a_full_disk(store, monkeypatch)
    assert (tmp_path / "log" / "checkpoint").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "log").glob("checkpoint*")) == ["checkpoint"]


def test_a_checkpoint_cut_short_by_a_crash_is_removed_at_the_start(tmp_path: Path) -> None:
    """A crash between writing a checkpoint and its rename leaves it beside the last one:
    the next start removes it."""
    write_log(tmp_path, declare(), *[enqueue(i) for i in range(1, 5)])
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    checkpointed(store)
    store.close()
    (tmp_path / "log" / "checkpoint.7.tmp").write_bytes(b"half a checkpoint")
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert not list((tmp_path / "log").glob("*.tmp"))
    assert held(broker) == {"q": [1, 2, 3, 4]}


def ended(store: Store) -> None:
    """The checkpoint being made is written (its executor's future done, on the loop)."""
    assert store.loop is not None and store.checkpoint_running
    done: asyncio.Future[log_mod._Made | None] = store.loop.create_future()
    done.set_result(log_mod._Made())
    store._checkpoint_ended(done, 0.0, store.generation, store.checkpoints_made)


def test_a_checkpoint_due_while_one_is_being_made_waits_for_it(tmp_path: Path) -> None:
    """Two checkpoints made at once share the GIL with the loop and each other: each takes
    longer, and the one last written falls further behind (a restart replays more). The
    next waits for the one being made, and is taken as soon as it ends."""
    write_log(tmp_path, declare(), *[enqueue(i) for i in range(1, 5)])
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=4)
    store.checkpoint()
    for i in range(5, 20):
        store.write(records.ENQUEUE, i, enqueue(i), ("/", "q", records.mid(1, i)))
    assert store.since_checkpoint >= store.checkpoint_due and not store.checkpoint_scheduled
    ended(store)
    assert store.checkpoint_scheduled


def test_a_queue_deleted_without_a_record_is_forgotten_by_the_store(tmp_path: Path) -> None:
    """A copy's definitions delete a backup's queue without a record of its own: the store
    forgets its messages once told (`forget_gone`), so that no checkpoint names them."""
    write_log(tmp_path, declare(), *[enqueue(i) for i in range(1, 4)])
    store, broker = recover(tmp_path, page_bytes=0)
    assert len(store.where) == 3
    store.forget_gone()
    assert len(store.where) == 3  # the queue is there: nothing to forget
    broker.vhost("/").queues.pop("q")
    store.forget_gone()
    assert len(store.where) == 0 and not store.pages


def test_a_page_that_cannot_be_read_stays_in_its_place(tmp_path: Path) -> None:
    """A read that fails (an I/O error, the segment gone) raises, and the page stays where it
    was with the queue's counts: it was taken off the tail first, and its messages were lost
    to the queue though still in the log."""
    seg = write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, 6)))
    _store, broker = recover(tmp_path)
    q = broker.vhost("/").queues["q"]
    first = q.get(no_ack=True)
    assert first is not None and int(first.body_bytes()) == 2
    depth, paged = q.depth, q.paged
    hidden = seg.with_name("hidden")
    seg.rename(hidden)
    with pytest.raises(OSError):
        q.get(no_ack=True)
    assert (q.depth, q.paged) == (depth, paged)
    hidden.rename(seg)
    assert [int(q.get(no_ack=True).body_bytes()) for _ in range(3)] == [3, 4, 5]  # type: ignore[union-attr]


def checkpointed(store: Store, scheduled: bool = False) -> None:
    """Take a checkpoint as the node does (once what it names is on disk, its bytes made on
    the executor's thread), or the one `scheduled`, and run the store's loop until it is
    written."""
    assert store.loop is not None
    written: asyncio.Future[float] = store.loop.create_future()
    store.checkpoint_seconds = written.set_result
    if not scheduled:
        store.checkpoint()
    store.loop.run_until_complete(written)


def written(store: Store, rtype: int, queue: str, mid: int, offset: int) -> None:
    """An ENQUEUE or DEQUEUE record handed to the store, as the Sequencer hands them."""
    data = enqueue(mid, queue) if rtype == records.ENQUEUE else keyed(rtype, mid, queue, offset)
    store.write(rtype, offset, data, ("/", queue, records.mid(1, mid)))


def held(broker: Broker) -> dict[str, list[int]]:
    queues = broker.vhost("/").queues
    return {name: bodies(q) for name, q in sorted(queues.items())}


@pytest.mark.parametrize("page_bytes", [0, 1 << 20], ids=["one by one", "heads as pages"])
def test_a_checkpoint_names_a_queue_that_did_not_change_by_its_part_of_the_last_one(
    tmp_path: Path, page_bytes: int
) -> None:
    """A checkpoint costs each message it names (a million in memory: over a second of the
    thread's time), so a deep queue left alone is named by its part of the last checkpoint,
    as it was. Queues b (6 published) and c (4 consumed) changed in between and are named
    anew: taken from the last checkpoint, a start would lose 6 and bring 4 back. With a
    budget, each queue's head is named as pages of the log."""
    write_log(
        tmp_path,
        declare("a"),
        declare("b"),
        declare("c"),
        *(enqueue(i, "a") for i in (1, 2)),
        enqueue(3, "b"),
        *(enqueue(i, "c") for i in (4, 5)),
    )
    store, _broker = recover(tmp_path, page_bytes=page_bytes, checkpoint_records=1000)
    checkpointed(store)
    first = dict(store.sections)
    assert set(first) == {("/", "a"), ("/", "b"), ("/", "c")}
    written(store, records.ENQUEUE, "b", 6, 6)
    written(store, records.DEQUEUE, "c", 4, 7)
    checkpointed(store)
    second = dict(store.sections)
    store.close()
    store, broker = recover(tmp_path, page_bytes=page_bytes, checkpoint_records=1000)
    assert held(broker) == {"a": [1, 2], "b": [3, 6], "c": [5]}
    assert second[("/", "a")] is first[("/", "a")]  # the same bytes, not made again
    assert all(second[("/", q)] is not first[("/", q)] for q in "bc")
    assert store.sections == {}  # what a start loads is named anew by its first checkpoint


def test_a_queue_forgotten_after_a_checkpoint_is_not_named_by_its_part_of_it(
    tmp_path: Path,
) -> None:
    """A copy's definitions deleted queue b on a backup without a record (`forget_gone`):
    the next checkpoint must not name b's messages from the last one, which a queue of the
    same name would take back at the next start."""
    write_log(tmp_path, declare("a"), declare("b"), enqueue(1, "a"), enqueue(2, "b"))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    checkpointed(store)
    store.forget_queue("/", "b")
    written(store, records.ENQUEUE, "a", 3, 3)  # a record for the checkpoint to wait for
    checkpointed(store)
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert held(broker) == {"a": [1, 3], "b": []}


def test_a_queue_whose_records_compaction_carried_is_named_where_they_are_now(
    tmp_path: Path,
) -> None:
    """Compaction wrote queue a's live messages again in the active segment and deleted the
    old one: a checkpoint that named them by its earlier part would name places in a segment
    that is gone, and a start would lose them."""
    seg = write_log(tmp_path, declare("a"), enqueue(1, "a"), enqueue(2, "a"))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    checkpointed(store)
    assert carried_forward(store) == 2
    checkpointed(store)
    assert not seg.exists()
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert held(broker) == {"a": [1, 2]}


def test_a_queue_that_paged_after_a_checkpoint_is_named_by_its_pages(tmp_path: Path) -> None:
    """Paging moves a queue's messages from the index to pages, and reading a page back moves
    them again: each changes how a checkpoint names the queue."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(1, 6)))
    store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    checkpointed(store)
    q = broker.vhost("/").queues["q"]
    msgs = list(q.messages)[1:3]
    page = store.page_out(("/", "q"), records.place("/", "q"), msgs)
    assert page is not None and ("/", "q") in store.changed
    written(store, records.ENQUEUE, "q", 6, 6)
    checkpointed(store)
    assert ("/", "q") in store.sections and not store.changed
    store.page_in(page, q, keep=False)
    assert ("/", "q") in store.changed
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert held(broker) == {"q": [1, 2, 3, 4, 5, 6]}


def test_a_checkpoint_that_ends_after_a_later_capture_keeps_none_of_its_parts(
    tmp_path: Path,
) -> None:
    """A member checkpoints at once after a copy reset its log, while the last checkpoint
    may still be being made. The one that ends first must not end the run: a change while
    the later one is made must be noted (or that one's part of the queue would be reused
    after it), and its own parts, older than the later capture, must not be kept."""
    write_log(tmp_path, declare("a"), enqueue(1, "a"))
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1000)
    assert store.loop is not None
    store.checkpoints_made = 2  # the first captured, then the second
    store.checkpoint_running = True
    assert not store.sections
    written(store, records.ENQUEUE, "a", 2, 2)
    assert ("/", "a") in store.changed  # noted though no part is kept yet
    store.changed.clear()
    done: asyncio.Future[log_mod._Made | None] = store.loop.create_future()
    done.set_result(log_mod._Made(sections={("/", "a"): b"{}"}))
    store._checkpoint_ended(done, 0.0, store.generation, 1)
    assert store.checkpoint_running and not store.sections
    written(store, records.ENQUEUE, "a", 3, 3)
    assert ("/", "a") in store.changed
    store._checkpoint_ended(done, 0.0, store.generation, 2)
    assert not store.checkpoint_running and ("/", "a") in store.sections


DEEP = 12_000  # messages: a queue's part of a checkpoint past PART_BYTES (a file of its own)


def parts(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "log").glob(f"{log_mod.PART_PREFIX}*"))


def deep_store(tmp_path: Path) -> Store:
    write_log(
        tmp_path, declare("deep"), declare("busy"), *(enqueue(i, "deep") for i in range(1, DEEP))
    )
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    store.checkpoint_records = 1  # set after the start, which would have made one
    return store


def part_bytes(store: Store) -> int:
    """The size of the deep queue's part file."""
    return (store.dir / store.section_parts[("/", "deep")]).stat().st_size


def renamed(store: Store, part: int) -> int:
    """When a checkpoint is due that names the deep queue anew: a quarter of the messages in
    memory, or the bytes of the file and of the part written again over 64."""
    return max(
        len(store.where) // 4,
        (store.checkpoint_size + part) // log_mod.CHECKPOINT_BYTES_A_RECORD,
    )


def test_a_deep_queue_left_alone_is_not_counted_as_named_anew(tmp_path: Path) -> None:
    """A checkpoint that names a deep queue by its part of the last one neither copies nor
    passes over its messages: the next is due after checkpoint_records (or the bytes its
    file took over CHECKPOINT_BYTES_A_RECORD), not after a quarter of the deep queue's
    messages again (nor its part's bytes over 64), so that a start replays less. Once the
    deep queue changes, and goes on changing, it is named anew, and counted again."""
    store = deep_store(tmp_path)
    store.checkpoint_records = 64
    checkpointed(store)
    first = store.sections[("/", "deep")]
    assert store.checkpoint_size // log_mod.CHECKPOINT_BYTES_A_RECORD < 64
    assert due_after(store, "busy", range(DEEP, 2 * DEEP)) == 64
    checkpointed(store, scheduled=True)  # the deep queue by its part of the last one
    assert store.sections[("/", "deep")] is first
    part = part_bytes(store)
    since = due_after(store, "deep", range(DEEP, 2 * DEEP))
    assert renamed(store, part) <= since < renamed(store, part) + 64 // 8  # looked at every 8
    assert since > 64
    checkpointed(store, scheduled=True)
    assert store.sections[("/", "deep")] is not first


def test_a_deep_queue_that_stopped_changing_is_named_anew_once_without_waiting(
    tmp_path: Path,
) -> None:
    """A deep queue filled, then left alone, is named anew once more; waiting a quarter of
    its messages for that, as for a queue that keeps changing, only lengthened a restart's
    replay (a member killed five seconds after a fill of a million replayed 260,000-370,000
    records). Once it has not changed for half of checkpoint_records records, the next
    checkpoint is due after checkpoint_records; the one after names it by its part. Not
    twice in a row: a deep queue that changes now and then would be named anew every
    checkpoint_records records."""
    store = deep_store(tmp_path)
    store.checkpoint_records = 64
    checkpointed(store)
    written(store, records.ENQUEUE, "deep", DEEP, DEEP)  # the fill's last message
    assert due_after(store, "busy", range(DEEP + 1, 2 * DEEP)) == 64  # not DEEP // 4
    checkpointed(store, scheduled=True)  # names the deep queue anew, early
    first = store.sections[("/", "deep")]
    assert due_after(store, "busy", range(2 * DEEP, 3 * DEEP)) == 64
    checkpointed(store, scheduled=True)
    assert store.sections[("/", "deep")] is first  # by its part, as it did not change
    # A change, and then none: early again, but only after one by the rule...
    written(store, records.ENQUEUE, "deep", 3 * DEEP, 3 * DEEP)
    assert due_after(store, "busy", range(3 * DEEP + 1, 4 * DEEP)) == 64
    checkpointed(store, scheduled=True)
    assert store.sections[("/", "deep")] is not first
    # ...not after an early one: the deep queue changes, and waits a quarter of its messages.
    written(store, records.ENQUEUE, "deep", 4 * DEEP, 4 * DEEP)
    part = part_bytes(store)
    since = due_after(store, "busy", range(4 * DEEP + 1, 5 * DEEP))
    assert renamed(store, part) <= since < renamed(store, part) + 64 // 8


def test_a_deep_queue_that_did_not_change_is_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deep queue's part of a checkpoint is a file of its own. A checkpoint that names the
    queue as it was names that file and writes none of it: it writes its own small file
    only, and the next is due after checkpoint_records again, not after its bytes over
    CHECKPOINT_BYTES_A_RECORD. A start reads the part back."""
    store = deep_store(tmp_path)
    files: list[tuple[str, int]] = []
    real = log_mod.write_file

    def write_file(path: Path, data: bytes, *, durable: bool = False) -> None:
        files.append((path.name, len(data)))
        real(path, data, durable=durable)

    monkeypatch.setattr(log_mod, "write_file", write_file)
    checkpointed(store)
    [part] = parts(tmp_path)
    assert [name for name, _size in files] == [part, "checkpoint.1.tmp"]
    assert dict(files)[part] >= log_mod.PART_BYTES
    files.clear()
    written(store, records.ENQUEUE, "busy", DEEP, DEEP)
    checkpointed(store)
    assert [name for name, _size in files] == ["checkpoint.2.tmp"]
    size = store.checkpoint_size
    assert size == files[0][1] < 1024 and parts(tmp_path) == [part]
    written(store, records.ENQUEUE, "busy", DEEP + 1, DEEP + 1)
    checkpointed(store)
    # Due after the bytes of the last one's file over 64, not its part's.
    since = due_after(store, "busy", range(DEEP + 2, 2 * DEEP))
    assert since == max(1, size // log_mod.CHECKPOINT_BYTES_A_RECORD) < 16
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert held(broker)["deep"] == list(range(1, DEEP))
    assert held(broker)["busy"][:2] == [DEEP, DEEP + 1]


def test_a_deep_queue_that_changed_gets_a_new_part_and_the_old_one_goes(tmp_path: Path) -> None:
    """A deep queue that changed is written anew, to a part file of another name; the old
    one goes once the checkpoint that no longer names it is in place, and a start finds
    the queue as it is now."""
    store = deep_store(tmp_path)
    checkpointed(store)
    [first] = parts(tmp_path)
    written(store, records.DEQUEUE, "deep", 1, DEEP)
    written(store, records.ENQUEUE, "deep", DEEP + 1, DEEP + 1)
    checkpointed(store)
    [second] = parts(tmp_path)
    assert second != first
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert held(broker)["deep"] == [*range(2, DEEP), DEEP + 1]


@pytest.mark.parametrize("damage", ["gone", "cut short", "altered"])
def test_a_checkpoint_whose_part_is_gone_or_damaged_is_not_used(
    tmp_path: Path, damage: str
) -> None:
    """A checkpoint whose part file is missing, shorter than it says, or altered (another
    queue's name in it) is not used: the whole log is replayed, and the part files go."""
    store = deep_store(tmp_path)
    written(store, records.ENQUEUE, "busy", DEEP, DEEP)
    checkpointed(store)
    store.close()
    [part] = parts(tmp_path)
    path = tmp_path / "log" / part
    if damage == "gone":
        path.unlink()
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:-1])
    else:
        path.write_bytes(path.read_bytes().replace(b"deep", b"busy", 1))
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert held(broker) == {"busy": [DEEP], "deep": list(range(1, DEEP))}
    assert parts(tmp_path) == []


def test_a_part_no_checkpoint_names_is_removed_at_the_start(tmp_path: Path) -> None:
    """A crash after a part file was written, before its checkpoint's rename, leaves it
    beside the last checkpoint, which does not name it: the next start removes it, and
    keeps the one the checkpoint names."""
    store = deep_store(tmp_path)
    checkpointed(store)
    store.close()
    [kept] = parts(tmp_path)
    (tmp_path / "log" / f"{log_mod.PART_PREFIX}0badf00d-9-0").write_bytes(b"half a part")
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert parts(tmp_path) == [kept]
    assert held(broker)["deep"] == list(range(1, DEEP))


def test_a_part_the_disk_cannot_take_leaves_the_last_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while a deep queue's new part is written: no part of the new checkpoint
    is left, and the last one and the part it names stay as they were."""
    store = deep_store(tmp_path)
    checkpointed(store)
    [part] = parts(tmp_path)
    before = (tmp_path / "log" / "checkpoint").read_bytes()
    written(store, records.ENQUEUE, "deep", DEEP, DEEP)
    checkpoint_on_a_full_disk(store, monkeypatch)
    assert (tmp_path / "log" / "checkpoint").read_bytes() == before
    assert parts(tmp_path) == [part]
    assert sorted(p.name for p in (tmp_path / "log").glob("checkpoint.*")) == []
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert held(broker)["deep"] == list(range(1, DEEP + 1))


def test_a_log_started_over_takes_the_parts_with_its_checkpoint(tmp_path: Path) -> None:
    """A member that takes a full copy starts its log over: the checkpoint goes, and the
    part files it named with it."""
    store = deep_store(tmp_path)
    checkpointed(store)
    assert parts(tmp_path)
    store.reset([(1, 1)])
    assert parts(tmp_path) == [] and not (tmp_path / "log" / "checkpoint").exists()


@pytest.mark.parametrize("replayed", ["busy", "deep"])
def test_a_start_names_a_deep_queue_by_the_part_it_was_loaded_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replayed: str
) -> None:
    """After a start, the first checkpoint names a deep queue by the part file it was
    loaded from, unless a record replayed after the checkpoint named that queue: it writes
    no part then, and the next start finds the queue whole."""
    store = deep_store(tmp_path)
    checkpointed(store)
    [part] = parts(tmp_path)
    written(store, records.ENQUEUE, replayed, DEEP, DEEP)
    assert store.loop is not None
    on_disk: asyncio.Future[None] = store.loop.create_future()
    store.when_synced(lambda: on_disk.set_result(None))
    store.loop.run_until_complete(on_disk)
    store.checkpoint_records = 0  # no last checkpoint: the start replays the record
    store.close()
    store, _broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    assert (("/", "deep") in store.sections) == (replayed == "busy")
    files: list[str] = []
    real = log_mod.write_file

    def write_file(path: Path, data: bytes, *, durable: bool = False) -> None:
        files.append(path.name)
        real(path, data, durable=durable)

    monkeypatch.setattr(log_mod, "write_file", write_file)
    checkpointed(store)
    assert (files == ["checkpoint.1.tmp"]) == (replayed == "busy")
    assert (parts(tmp_path) == [part]) == (replayed == "busy")
    store.close()
    _store, broker = recover(tmp_path, page_bytes=0, checkpoint_records=1 << 20)
    deep = list(range(1, DEEP + (replayed == "deep")))
    assert held(broker) == {"busy": [DEEP] if replayed == "busy" else [], "deep": deep}


def on_disk(store: Store) -> None:
    """Run the store's loop until what it was handed is written."""
    assert store.loop is not None
    done: asyncio.Future[None] = store.loop.create_future()
    store.when_synced(lambda: done.set_result(None))
    store.loop.run_until_complete(done)


def started_as_a_page(tmp_path: Path, last: int = 9) -> tuple[Store, Broker, Queue]:
    """Messages 2..last named by a checkpoint, so that a start leaves them in the log as one
    page that knows its ids."""
    write_log(tmp_path, declare(), *(enqueue(i) for i in range(2, last + 1)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert q.paged == last - 1 and not store.where
    return store, broker, q


def taken(store: Store, broker: Broker, rtype: int, mid: int, offset: int) -> None:
    """A DEQUEUE or MARK as a backup takes one: a dequeue is applied, then stored."""
    data = keyed(rtype, mid, offset=offset)
    key = ("/", "q", records.mid(1, mid))
    if rtype != records.DEQUEUE:
        store.write(rtype, offset, data, key)
    apply.apply(broker, rtype, records.payload(data))
    if rtype == records.DEQUEUE:
        store.write(rtype, offset, data, key)


class Redelivered(Taker):
    def __init__(self) -> None:
        super().__init__()
        self.flags: list[bool] = []

    def deliver(self, queue: Queue, msg: Message) -> None:
        super().deliver(queue, msg)
        self.flags.append(msg.redelivered)


def delivered(broker: Broker, q: Queue) -> list[tuple[int, bool]]:
    """Applying is over and a consumer takes every message: each one's body and flag."""
    apply.done(broker)
    taker = Redelivered()
    q.add_consumer(taker)
    q.dispatch()
    return list(zip(taker.got, taker.flags, strict=True))


def test_a_page_forgets_a_message_that_leaves_it_without_being_read(tmp_path: Path) -> None:
    """A backup applies the dequeue of each message its primary delivered, and a restarted
    member those of the busy queue its start left as pages: each page was read back only to
    drop its messages one by one (a seventh of a rejoining member's time). A page that knows
    its ids forgets a message unread, takes a mark the same way, and goes, records and all,
    once it holds nothing."""
    store, broker, q = started_as_a_page(tmp_path)
    taken(store, broker, records.DEQUEUE, 2, 10)
    taken(store, broker, records.MARK, 3, 11)
    assert (q.paged, q.ready, store.where.queues) == (7, 7, {})  # nothing read back
    assert store.segments[1] == 8  # the page's records are live until it goes
    for mid in range(3, 10):
        taken(store, broker, records.DEQUEUE, mid, 9 + mid)
    assert (q.paged, q.ready, q.bytes, q.tail_bytes) == (0, 0, 0, 0)
    assert not store.pages and store.segments[1] == 0  # the segment can go
    on_disk(store)
    store.close()
    _store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    assert broker.vhost("/").queues["q"].depth == 0  # each dequeue was written


def test_a_page_read_back_after_it_forgot_some_brings_back_the_rest_marked(
    tmp_path: Path,
) -> None:
    """The page is read back when the queue gets to it: what it forgot stays gone, a message
    marked while paged goes out redelivered, and the records of those forgotten are no
    longer live."""
    store, broker, q = started_as_a_page(tmp_path)
    taken(store, broker, records.DEQUEUE, 2, 10)
    taken(store, broker, records.DEQUEUE, 4, 11)
    taken(store, broker, records.MARK, 5, 12)
    assert delivered(broker, q) == [
        (3, False),
        (5, True),
        (6, False),
        (7, False),
        (8, False),
        (9, False),
    ]
    assert store.segments[1] == 0  # delivered without acks, and 2 and 4 dequeued


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint", "replay"])
def test_what_a_page_forgot_stays_gone_after_a_restart(tmp_path: Path, checkpoint: bool) -> None:
    """After a restart, from a checkpoint taken since (which names the page without what it
    forgot) or by replaying the dequeues (which the page forgets again, unread): the rest
    come back, a message requeued while paged (a durable mark) redelivered."""
    store, broker, q = started_as_a_page(tmp_path)
    taken(store, broker, records.DEQUEUE, 2, 10)
    taken(store, broker, records.DEQUEUE, 3, 11)
    key = ("/", "q", records.mid(1, 6))
    store.write(records.MARK, 12, keyed(records.MARK, 6, offset=12), key)
    apply.mark(broker, "/", "q", records.mid(1, 6))
    assert not store.where and q.paged == 6
    if checkpoint:
        checkpointed(store)
    else:
        on_disk(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert q.paged == 6 and not store.where  # the dequeues replayed read nothing back
    assert key in store.marked  # a later checkpoint names the mark still
    assert delivered(broker, q) == [
        (4, False),
        (5, False),
        (6, True),
        (7, False),
        (8, False),
        (9, False),
    ]


def test_requeued_marks_on_the_pages_of_a_queue_survive_two_starts(tmp_path: Path) -> None:
    """Messages 3 and 6, requeued (a durable mark) in two pages of their queue, stay in the
    log; a start keeps their marks (`_live_marks`), so the checkpoint it takes names them
    again, and after a second start both still go out redelivered."""

    def large(mid: int) -> bytes:
        body = str(mid).encode().rjust(100_000)  # three make a page (PAGE_BYTES)
        m = Message("", "q", b"\x00\x01q", PERSISTENT, body, len(body))
        m.mid = records.mid(1, mid)
        return records.frame(records.ENQUEUE, 1, mid, records.enqueue("/", "q", m))

    write_log(tmp_path, declare(), *(large(i) for i in range(2, 9)))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    assert len(broker.vhost("/").queues["q"].pages()) >= 2
    for offset, mid in ((10, 3), (11, 6)):
        store.write(records.MARK, offset, keyed(records.MARK, mid, offset=offset), None)
        store.marked.add(("/", "q", records.mid(1, mid)))
        apply.mark(broker, "/", "q", records.mid(1, mid))
    for _start in range(2):
        checkpointed(store)
        store.close()
        store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert not store.where  # nothing read back to take the marks
    assert delivered(broker, q) == [(mid, mid in (3, 6)) for mid in range(2, 9)]


def test_pages_of_named_messages_forget_too_and_a_copys_dequeues_in_one_pass(
    tmp_path: Path,
) -> None:
    """Messages 10-13, with an expiration, were in memory at the end of the tail when the
    checkpoint was taken, so it names them one by one and a start leaves them as a page of
    exactly those (`Page.only`). A copy's dequeues (`remove_many`) forget messages of both
    kinds of page unread; a checkpoint names what is left, as pages, and a start brings back
    only that."""
    store, broker, q = started_as_a_page(tmp_path)
    for mid in range(10, 14):
        data = expiring(mid)
        store.write(records.ENQUEUE, mid, data, ("/", "q", records.mid(1, mid)))
        apply.apply(broker, records.ENQUEUE, records.payload(data))
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert [p.only is not None for p in q.pages()] == [False, True]  # ids, then names
    gone = [2, 3, 10, 11]
    apply.dequeue_many(broker, {("/", "q"): [records.mid(1, mid) for mid in gone]})
    for offset, mid in enumerate(gone, start=20):
        store.write(records.DEQUEUE, offset, keyed(records.DEQUEUE, mid, offset=offset), None)
    assert (q.paged, q.ready, store.where.queues) == (8, 8, {})  # nothing read back
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert [p.only is not None for p in q.pages()] == [False, False]  # both named as pages
    assert bodies(q) == [4, 5, 6, 7, 8, 9, 12, 13]


def test_messages_in_memory_after_a_page_are_named_as_a_page_too(tmp_path: Path) -> None:
    """A queue with a page takes its new messages into its tail, in memory while its budget
    allows (`Queue._to_tail`): a checkpoint names them as pages of the log, as it names a
    head, not one by one. Named one by one, a member restarted under load had its busy
    queue named so for as long as the load went on, and its next start read each message's
    record: 0.4-1.2 s of a rejoin."""
    store, broker, q = started_as_a_page(tmp_path)
    for mid in range(10, 14):
        data = enqueue(mid)
        store.write(records.ENQUEUE, mid, data, ("/", "q", records.mid(1, mid)))
        apply.apply(broker, records.ENQUEUE, records.payload(data))
    assert (q.paged, len(q.in_memory())) == (8, 4)
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    q = broker.vhost("/").queues["q"]
    assert [(p.count, p.only is not None) for p in q.pages()] == [(8, False), (4, False)]
    assert bodies(q) == list(range(2, 14))


def test_a_requeued_mark_of_a_paged_message_is_carried_forward(tmp_path: Path) -> None:
    """Compaction writes again the durable marks of live messages: a requeued message that
    is in a page (its mark taken without a read) is live, and its mark goes on with it."""
    seg = write_log(tmp_path, declare(), enqueue(2), enqueue(3), keyed(records.MARK, 3, offset=4))
    store, _broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    checkpointed(store)
    store.close()
    store, broker = recover(tmp_path, page_bytes=1 << 20, checkpoint_records=1000)
    assert broker.vhost("/").queues["q"].paged == 2 and not store.where
    assert ("/", "q", records.mid(1, 3)) in store.marked
    before = store.active_size
    store._carry_forward(1, seg.read_bytes())
    on_disk(store)
    written = (tmp_path / "log" / f"{store.active:020d}.seg").read_bytes()[before:]
    assert keyed(records.MARK, 3, offset=4) in written


def test_the_extents_of_records_across_segments_out_of_order_hold_every_record() -> None:
    """A head's places rise within a segment but not across them once compaction carried a
    few forward: each segment's extent covers all its records, however they interleave."""
    places = [(1, 100, 20), (1, 120, 20), (3, 0, 30), (1, 140, 10), (2, 50, 5), (3, 40, 8)]
    places += [(1, 10, 5), (2, 0, 10)]
    ats = [(seg << log_mod.AT_BITS) | pos for seg, pos, _n in places]
    extents, segs = log_mod._spans(ats, [n for _s, _p, n in places])
    assert extents == [(1, 10, 150), (2, 0, 55), (3, 0, 48)]
    assert segs == {1: 4, 2: 2, 3: 2}


def large(mid: int, queue: str = "q") -> bytes:
    """An ENQUEUE of 100 KB: three fill a checkpoint's page of a head (PAGE_BYTES)."""
    return enqueue(mid, queue, str(mid).encode().rjust(100_000))


def consumed(store: Store, broker: Broker, mids: list[int], offset: int) -> None:
    """Messages taken off the head of queue q and acked: the model's change and its records."""
    apply.dequeue_many(broker, {("/", "q"): [records.mid(1, mid) for mid in mids]})
    for at, mid in enumerate(mids, start=offset):
        written(store, records.DEQUEUE, "q", mid, at)


def test_a_checkpoint_names_the_pages_of_a_head_that_still_holds_them_as_it_named_them(
    tmp_path: Path,
) -> None:
    """A FIFO queue's head changes at its ends between two checkpoints: the pages between
    are named as the last one named them, not made again message by message, and the
    messages taken off the first page and those added after the last come back right."""
    write_log(tmp_path, declare(), *(large(i) for i in range(1, 13)))
    store, broker = recover(tmp_path, page_bytes=1 << 30, checkpoint_records=1000)
    checkpointed(store)
    before = store.named_heads[("/", "q")]
    assert [page.mids for page in before] == [
        [records.mid(1, i) for i in range(first, first + 3)] for first in (1, 4, 7, 10)
    ]
    consumed(store, broker, [1, 2], offset=20)
    written(store, records.ENQUEUE, "q", 13, 22)  # in the index only: named one by one
    checkpointed(store)
    after = store.named_heads[("/", "q")]
    assert after[0].mids == [records.mid(1, 3)]
    assert all(a is b for a, b in zip(after[1:], before[1:], strict=True))
    store.close()
    _store, broker = recover(tmp_path, page_bytes=1 << 30, checkpoint_records=1000)
    assert held(broker) == {"q": list(range(3, 14))}


def test_pages_of_a_head_whose_records_compaction_moved_are_named_anew(tmp_path: Path) -> None:
    """Compaction wrote the head's records again in the active segment and deleted the old
    one: pages named as the last checkpoint named them would send a start to a segment that
    is gone, and it would lose them. A page is named as it was only with every message in
    the place it names."""
    seg = write_log(tmp_path, declare(), *(large(i) for i in range(1, 7)))
    store, _broker = recover(tmp_path, page_bytes=1 << 30, checkpoint_records=1000)
    checkpointed(store)
    before = store.named_heads[("/", "q")]
    assert carried_forward(store) == 6
    checkpointed(store)
    assert not seg.exists()
    after = store.named_heads[("/", "q")]
    assert [page.mids for page in after] == [page.mids for page in before]
    assert not any(a is b for a, b in zip(after, before, strict=True))
    store.close()
    _store, broker = recover(tmp_path, page_bytes=1 << 30, checkpoint_records=1000)
    assert held(broker) == {"q": [1, 2, 3, 4, 5, 6]}


def test_a_message_named_alone_in_a_named_pages_range_has_the_head_named_anew() -> None:
    """Message 4 was not in the head when the last checkpoint named the page of 2, 3, 5 and
    6; now it is delivered (in the index, not in the head), so it is named alone, and inside
    that page's range: the page is not named as it was, and no page holds 4 in its range."""
    key = ("/", "q")
    place = records.place(*key)
    msgs = {}
    for i in range(1, 9):
        m = Message("", "q", b"\x00\x01q", PERSISTENT, b"x" * 100, 100)
        m.persistent, m.mid = True, records.mid(1, i)
        msgs[i] = m
    where = {records.mid(1, i): (1 << log_mod.AT_BITS) | (200 * i) for i in msgs}
    ids = [2, 3, 5, 6]
    run = (
        [records.mid(1, i) for i in ids],
        array.array("q", [where[records.mid(1, i)] for i in ids]),
        array.array("q", [records.enqueue_size(place, msgs[i]) for i in ids]),
        array.array("q", [100] * len(ids)),
    )
    page = log_mod._page_entry(run, 0, len(ids))
    head = [msgs[i] for i in (1, 2, 3, 5, 6, 7, 8)]
    state = log_mod._Captured({"epoch": 1}, {key: [where]}, [], [(key, head)], named={key: [page]})
    made = log_mod._Made()
    data = log_mod._checkpoint_bytes(state, made, "part-")
    assert not any(named is page for named in made.heads[key])
    (queue,) = json.loads(data[len(log_mod.CHECKPOINT_MAGIC) + 4 :])["queues"]
    alone = [records.mid(1, offset) for offset in log_mod._unpacked("Q", queue["offsets"])]
    assert alone == [records.mid(1, 4)]
    ranges = [(entry[2], entry[3]) for entry in queue["pages"]]
    assert not any(first < alone[0] < last for first, last in ranges)
    assert sum(entry[0] for entry in queue["pages"]) == 7


@pytest.mark.parametrize("seed", range(4))
def test_a_start_from_any_checkpoint_of_random_traffic_holds_every_message(
    tmp_path: Path, seed: int
) -> None:
    """Two queues take random traffic: publishes (mostly persistent, a few transient or
    with a TTL, bodies of 100 B to 60 KB), gets, acks, requeues, and compaction carrying
    the records of the oldest segment forward. After each checkpoint, a start from a copy of
    the directory holds exactly the persistent messages the queues hold then, ready or
    delivered: whether each head's pages were named anew or as the last checkpoint named
    them (`_head_run`)."""
    rnd = random.Random(seed)
    write_log(tmp_path, declare("q"), declare("r"))
    store, broker = started(tmp_path)
    delivered: dict[str, list[Message]] = {"q": [], "r": []}
    named_as_before = checkpoints = carried = 0
    for _step in range(200):
        name = rnd.choice(["q", "q", "r"])
        q = broker.vhost("/").queues[name]
        op = rnd.random()
        if op < 0.45:
            for _ in range(rnd.randint(1, 6)):
                size = rnd.choice([100, 20_000, 60_000])
                route = b"\x00" + bytes([len(name)]) + name.encode()
                m = Message("", name, route, PERSISTENT, b"x" * size, size)
                m.persistent = rnd.random() > 0.05
                m.expiration = 10**9 if rnd.random() < 0.05 else None
                q.enqueue(m)
        elif op < 0.6 and (m := q.get()) is not None:
            q.unacked += 1
            delivered[name].append(m)
        elif op < 0.7 and delivered[name]:
            q.settle(delivered[name].pop(rnd.randrange(len(delivered[name]))))
        elif op < 0.8 and delivered[name]:
            q.reject(delivered[name].pop(rnd.randrange(len(delivered[name]))), True)
        elif op < 0.85 and (m := q.get(no_ack=True)) is not None:
            q.settle_unacked_get(m)
        elif op < 0.9:
            carried += compacted(store)
        elif op < 0.97:
            on_disk(store)
            before = dict(store.named_heads)
            checkpointed(store)
            checkpoints += 1
            named_as_before += sum(  # of the heads this checkpoint named
                any(page is old for old in before.get(key, []))
                for key, pages in store.named_heads.items()
                if pages is not before.get(key)
                for page in pages
            )
            copy = tmp_path / f"copy-{checkpoints}"
            shutil.copytree(tmp_path / "log", copy / "log")
            held = {
                n: sorted(
                    m.mid
                    for m in [*broker.vhost("/").queues[n].all_ready(), *delivered[n]]
                    if m.persistent
                )
                for n in ("q", "r")
            }
            other, recovered = started(copy)
            assert {n: drained(recovered, n) for n in ("q", "r")} == held
            other.close()
        else:
            on_disk(store)
    store.close()
    assert checkpoints and named_as_before and carried  # what the test is about happened


def started(path: Path) -> tuple[Store, Broker]:
    """A store with a memory budget for a few large messages a queue and segments of
    200 KB, of which it keeps two before compaction carries records forward."""
    now = [0.0]

    def clock() -> float:
        now[0] += 3.0  # each look at the clock is later than compaction's patience
        return now[0]

    return recover(
        path,
        page_bytes=1_000_000,
        clock=clock,
        checkpoint_records=10**9,
        segment_bytes=200_000,
        max_segments=2,
    )


def compacted(store: Store) -> int:
    """`carried_forward` on the oldest segment, unless a page reads from it."""
    on_disk(store)
    oldest = next(iter(store.segments))
    if oldest in store.pinned:
        return 0
    moved = carried_forward(store, oldest)
    on_disk(store)
    return moved


def carried_forward(store: Store, seg: int = 1) -> int:
    """Compaction's step on segment `seg` whatever its share of live records: they are
    written again in a new segment, and it goes. Returns how many were."""
    store._roll()
    path = store._path(seg)
    size = store.sizes.get(seg, path.stat().st_size)  # a spare's last life lies after it
    good, moved = store._carry_forward(seg, log_mod._read_head(path, size))
    assert good == size
    store._carried(seg)
    return moved


def drained(broker: Broker, name: str) -> list[int]:
    """The ids of every message the queue hands out, sorted."""
    q = broker.vhost("/").queues[name]
    out = []
    while (m := q.get(no_ack=True)) is not None:
        out.append(m.mid)
    return sorted(out)
