"""A primary's copies for its followers (replication/member.py), in one process: a copy is
made on another thread, what else goes to that follower waits for it, a Hello repeated
while it is made or travels gets no second one, and its bytes are no sign of a slow
reader. The follower's connection is a recording writer; everything else is real."""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pamqp import commands

from tandem.broker.model import message, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.message import Message
from tandem.broker.replication import core, member, wire
from tandem.broker.replication import log as log_mod
from tandem.broker.replication.link import Link
from tandem.broker.store.log import Store
from tandem.ha.model import ElectionRecord


class Hooks:
    def promoted(self, epoch: int) -> None: ...
    def demoted(self, epoch: int) -> None: ...
    def isr_blocked(self, reason: str | None) -> None: ...
    def flow(self, on: bool) -> None: ...
    def following(self, primary: str, amqp: str | None) -> None: ...
    def lease(self, lapsed: bool) -> None: ...


class Transport:
    """A connection's transport that keeps what the member wrote to it."""

    def __init__(self) -> None:
        self.unsent = 0  # bytes written and not yet taken by the peer
        self.aborted = False
        self.data = b""
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def write(self, data: bytes) -> None:
        self.unsent += len(data)
        self.data += data

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True


class Follower:
    """The primary's end of a follower's connection: a real Link over a Transport that
    keeps what it was sent, read back as wire kinds."""

    def __init__(self, transport: Transport | None = None) -> None:
        self.transport = transport or Transport()
        self.link = Link()
        self.link.transport = self.transport

    @property
    def data(self) -> bytes:
        return self.transport.data

    def kinds(self) -> list[int]:
        out, data = [], self.data
        while data:
            split = wire.split(data)
            assert split is not None
            out.append(split[0])
            data = data[split[1] :]
        return out


BODY = 1_000


@pytest.fixture
def slow_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(member, "SLOW_BYTES", 20 * BODY)  # a copy of 50 messages is over it
    yield member.SLOW_BYTES


def primary_with_follower() -> tuple[member.Member, Follower, Broker]:
    seq = Sequencer()
    b = Broker(seq)
    b.add_vhost("/")
    m = member.Member("a", b, seq, None, Hooks(), key=b"k" * 16, data_dir=None, isr_min=1)
    m.loop = asyncio.get_running_loop()
    m.promote(ElectionRecord("a", 1, frozenset({"a"}), 1))
    q, _ = b.vhost("/").declare_queue("q", durable=True)
    for _ in range(50):
        publish(q)
    m._flush(due=True)
    follower = Follower()
    m.peers["b"] = follower.link
    return m, follower, b


def publish(q: object) -> None:
    props = commands.Basic.Properties(delivery_mode=2).marshal()
    msg = Message("", "q", message.encode_route("", "q"), props, b"x" * BODY, BODY)
    message.scan(msg)
    q.enqueue(msg)  # type: ignore[attr-defined]


async def until(done: Callable[[], bool]) -> None:
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0.005)
    pytest.fail("not within 5 s")


async def copy_made(m: member.Member) -> None:
    await m.copying["b"].made  # its callback, registered first, has run


def test_one_copy_per_session_and_what_else_goes_follows_it(slow_bytes: int) -> None:
    async def run() -> None:
        m, follower, b = primary_with_follower()
        hello = core.Hello("b", 1, (5, 1), (), 0, False, None)
        m.on_peer(hello)
        m.on_peer(hello)  # repeated by the follower's tick while the copy is made
        publish(b.vhost("/").queues["q"])
        m._flush(due=True)  # an Append while the copy is made: it waits for the copy
        assert follower.data == b""
        await copy_made(m)
        assert follower.kinds() == [wire.SYNC, wire.APPEND]
        m.on_peer(hello)  # repeated again while the copy travels
        assert "b" not in m.copying and follower.kinds() == [wire.SYNC, wire.APPEND]
        assert m.log.captured == 1  # the queues were captured once
        m.on_peer(core.Hello("b", 1, (5, 2), (), 0, False, None))  # a new attempt
        await copy_made(m)
        assert follower.kinds() == [wire.SYNC, wire.APPEND, wire.SYNC]
        assert m.log.captured == 2
        assert not follower.transport.aborted

    asyncio.run(run())


def test_a_copy_is_no_sign_of_a_slow_reader_until_it_has_left(slow_bytes: int) -> None:
    async def run() -> None:
        m, follower, b = primary_with_follower()
        m.on_peer(core.Hello("b", 1, (5, 1), (), 0, False, None))
        await copy_made(m)
        assert follower.transport.unsent > slow_bytes and not follower.transport.aborted
        q = b.vhost("/").queues["q"]
        for _ in range(10):  # behind the copy, under the limit
            publish(q)
            m._flush(due=True)
        assert not follower.transport.aborted
        follower.transport.unsent = BODY  # the copy has left; what follows has not
        publish(q)
        m._flush(due=True)
        assert follower.link.largest_unsent() < 2 * BODY  # no allowance for the copy now
        for _ in range(25):  # past the limit, with no copy before it: a slow reader
            publish(q)
            m._flush(due=True)
        assert follower.transport.aborted

    asyncio.run(run())


def test_one_message_larger_than_the_limit_is_no_sign_of_a_slow_reader(slow_bytes: int) -> None:
    """A message larger than SLOW_BYTES (up to max_message_size) goes to a follower that
    reads; what waits behind it still counts. One of 100 MiB got a follower cut off at every
    connection, for ever."""

    async def run() -> None:
        m, follower, _b = primary_with_follower()
        big = 3 * slow_bytes
        m._write("b", b"x" * big)
        assert not follower.transport.aborted
        for _ in range(20):  # the limit's worth behind it
            m._write("b", b"y" * BODY)
        assert not follower.transport.aborted
        follower.transport.unsent -= big // 2  # half of it taken, none of what follows
        m._write("b", b"y" * BODY)  # one more behind it, past the limit: a slow reader
        assert follower.transport.aborted

    asyncio.run(run())


def test_a_repeated_hello_gets_the_records_it_lacks_once(slow_bytes: int) -> None:
    """A follower's tick repeats its Hello until the Sync answering it arrives: the records
    it lacks go once per session. Sent again behind a large message still on its way, they
    got the follower cut off, and again at every connection."""

    async def run() -> None:
        m, follower, _b = primary_with_follower()
        hello = core.Hello("b", 1, (5, 1), (), 0, True, None)  # holds nothing, whole
        m.on_peer(hello)
        assert follower.kinds() == [wire.SYNC] and "b" not in m.copying  # not a copy
        m.on_peer(hello)  # repeated while the Sync travels
        assert follower.kinds() == [wire.SYNC]
        m.on_peer(core.Hello("b", 1, (5, 2), (), 0, True, None))  # a new attempt
        assert follower.kinds() == [wire.SYNC, wire.SYNC]

    asyncio.run(run())


def test_what_waited_for_a_copy_goes_with_it_however_large(slow_bytes: int) -> None:
    """Records for a follower held while its copy is made go out with the copy, as one
    write: held, they were bounded at SLOW_BYTES beside the largest of them, and written
    one by one after the copy they got the follower cut off."""

    async def run() -> None:
        m, follower, _b = primary_with_follower()
        m.on_peer(core.Hello("b", 1, (5, 1), (), 0, False, None))
        making = m.copying["b"]
        m._write("b", b"x" * (2 * slow_bytes))  # an Append of a large message, held
        m._write("b", b"y" * (slow_bytes // 2))
        assert not follower.transport.aborted and len(making.held) == 2
        await copy_made(m)
        assert not follower.transport.aborted
        assert follower.transport.data.endswith(b"x" * (2 * slow_bytes) + b"y" * (slow_bytes // 2))

    asyncio.run(run())


def test_a_copy_made_for_a_primary_that_stepped_down_is_not_sent(slow_bytes: int) -> None:
    async def run() -> None:
        m, follower, _b = primary_with_follower()
        m.on_peer(core.Hello("b", 1, (5, 1), (), 0, False, None))
        made = m.copying["b"].made
        m.fence(2)  # a higher epoch: no longer the primary
        await made
        assert follower.data == b"" and m.copying == {} and m.copied == {}

    asyncio.run(run())


class Primary(Transport):
    """A backup's end of its link to the primary: each ack it sends, with how far the
    backup's store had synced when it went."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.acks: list[tuple[int, int]] = []  # (offset acked, offset on disk)

    def write(self, data: bytes) -> None:
        super().write(data)
        msg = wire.decode(data)
        if isinstance(msg, core.Ack):
            self.acks.append((msg.offset, self.store.synced))


def opened(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> tuple[log_mod.BrokerLog, Store]:
    """A member's log over a store on disk in `tmp_path`, opened (recovered) on `loop`."""
    seq = Sequencer()
    broker = Broker(seq)
    store = Store(tmp_path, fsync=False)
    seq.disk = store
    store.open(broker, seq, loop)
    return log_mod.BrokerLog(broker, seq, store), store


async def backup_behind_a_slow_disk(
    tmp_path: Path,
) -> tuple[member.Member, Follower, Broker, member.Member, Store, Primary]:
    """A primary `a` (its link to b, its broker) and a backup b with a store on disk, synced
    and acked, whose batches go to the writer's thread (held by taking `store.lock`), and
    b's end of its link to `a`, which records b's acks."""
    a, to_b, b_primary = primary_with_follower()
    opened_log, store = opened(tmp_path, asyncio.get_running_loop())
    broker, seq = opened_log.broker, opened_log.sequencer
    b = member.Member("b", broker, seq, store, Hooks(), key=b"k" * 16, data_dir=None, isr_min=1)
    b.loop = asyncio.get_running_loop()
    upstream = Primary(store)
    b.upstream = Follower(upstream).link
    b._control(core.Follow("a", 1))
    a.on_peer(wire.decode(upstream.data))  # its Hello: a Sync of the 50 messages
    b.on_peer(wire.decode(to_b.data))
    assert b.replica.synced
    await until(lambda: b.ack is None)  # the copy written, and acked
    store.write_recent = 1.0  # batches go to the writer's thread
    return a, to_b, b_primary, b, store, upstream


def last_ack_is(upstream: Primary, offset: int) -> bool:
    """Whether the last ack the backup sent `upstream` acks `offset`."""
    return bool(upstream.acks) and upstream.acks[-1][0] == offset


async def publish_while_writing(
    a: member.Member,
    to_b: Follower,
    b_primary: Broker,
    b: member.Member,
    store: Store,
    times: int = 2,
) -> list[int]:
    """Messages published on `a` and taken by b while b's writer is held mid-batch (as by
    a slow disk): the first batch goes to the writer, the others wait in the next. b's log
    end after each."""
    q = b_primary.vhost("/").queues["q"]
    ends = []
    with store.lock:
        for _ in range(times):
            sent = len(to_b.data)
            publish(q)
            a._flush(due=True)
            b.on_peer(wire.decode(to_b.data[sent:]))
            await asyncio.sleep(0)
            ends.append(b.log.end)
    return ends


def test_a_backup_acks_records_only_once_they_are_on_its_disk(tmp_path: Path) -> None:
    """Records that arrive while the batch before them is being written are acked once
    they are written too, not when that batch is (rule 3)."""

    async def run() -> None:
        a, to_b, b_primary, b, store, upstream = await backup_behind_a_slow_disk(tmp_path)
        await publish_while_writing(a, to_b, b_primary, b, store)
        await until(functools.partial(last_ack_is, upstream, b.log.end))
        store.close()
        assert all(acked <= synced for acked, synced in upstream.acks), upstream.acks

    asyncio.run(run())


def test_each_write_done_sends_the_ack_of_what_it_wrote(tmp_path: Path) -> None:
    """The records of a batch are acked once it is written, though newer records wait for
    the next batch: an ack that waited for the newest records was put off at every write
    while they kept coming, and a backup under load acked nothing for a second or more."""

    async def run() -> None:
        a, to_b, b_primary, b, store, upstream = await backup_behind_a_slow_disk(tmp_path)
        first, second = await publish_while_writing(a, to_b, b_primary, b, store)
        await until(functools.partial(last_ack_is, upstream, second))
        store.close()
        acked = [offset for offset, _synced in upstream.acks]
        assert first in acked, acked
        assert all(acked <= synced for acked, synced in upstream.acks), upstream.acks

    asyncio.run(run())


def test_acks_whose_records_go_in_one_write_go_as_one(tmp_path: Path) -> None:
    """While a write is under way, the records that come wait for the next one, and so do
    their acks: the newest of them goes once that write is done, the others not at all."""

    async def run() -> None:
        a, to_b, b_primary, b, store, upstream = await backup_behind_a_slow_disk(tmp_path)
        first, second, third = await publish_while_writing(a, to_b, b_primary, b, store, 3)
        await until(functools.partial(last_ack_is, upstream, third))
        store.close()
        acked = [offset for offset, _synced in upstream.acks]
        assert first in acked and second not in acked, acked
        assert all(acked <= synced for acked, synced in upstream.acks), upstream.acks

    asyncio.run(run())


def test_shipping_taking_and_acking_leave_nothing_for_the_cycle_collector(
    tmp_path: Path,
) -> None:
    """What a primary ships and a backup takes, writes and acks is freed as soon as it is
    done with, by reference counting. A node freezes what survives a full collection
    (collector.py), and full collections are rare with millions of messages queued: a batch
    that held its ack's callback, which held the batch, lived on with every record it wrote,
    a backup under load grew by 30 MB a second, and zeroing its new pages took a fifth of
    its CPU (issue 16)."""

    async def run() -> None:
        a, to_b, b_primary, b, store, upstream = await backup_behind_a_slow_disk(tmp_path)
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                ends = await publish_while_writing(a, to_b, b_primary, b, store, 3)
                await until(functools.partial(last_ack_is, upstream, ends[-1]))
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept, to be named
            gc.collect()
            left = sorted({type(o).__name__ for o in gc.garbage})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        store.close()
        assert left == [], left

    asyncio.run(run())


QUEUE_Q = {"name": "q", "durable": True, "auto_delete": False, "arguments": {}}


def test_records_of_a_difference_that_cannot_be_read_are_set_aside_and_the_rest_taken(
    tmp_path: Path,
) -> None:
    """A durable ENQUEUE or DEQUEUE in a copy that cannot be read is written as it came and
    set aside, as one shipped would be; the member takes the rest and asks for a copy again.
    Such a record raised out of the install (its key for the store was read outside the
    record's own failure)."""
    loop = asyncio.new_event_loop()
    log, store = opened(tmp_path, loop)
    b = log.broker
    try:
        bad = records.frame(records.ENQUEUE, 1, 1, b"\x00\x01/", durable=True)
        declare = records.define("/", "queue.declare", QUEUE_Q)
        good = records.frame(records.DEFINE, 1, 2, declare, durable=True)
        gone = records.frame(records.DEQUEUE, 1, 3, b"\x00\x01/", durable=True)
        head = records.frame(records.DEFINE, 1, 3, log_mod.DIFF, False)
        log.install(((1, 1),), 3, [head, bad, good, gone])
        assert [(e, o) for e, o, _what in log.not_applied] == [(1, 1), (1, 3)]
        assert not log.whole and "q" in b.vhost("/").queues
    finally:
        store.close()
        loop.close()


class FlowHooks(Hooks):
    def __init__(self) -> None:
        self.flows: list[bool] = []

    def flow(self, on: bool) -> None:
        self.flows.append(on)


def test_flow_control_sets_in_past_the_record_bound_of_this_term_and_ends_at_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Publishers wait while more than FLOW_RECORDS of this term's records are not
    confirmed, and are read again once that is down to half of it: not at the bound, or
    each ack would turn them on and off. What came before the term waits on no one."""
    monkeypatch.setattr(member, "FLOW_RECORDS", 20)

    async def run() -> None:
        seq = Sequencer()
        b = Broker(seq)
        b.add_vhost("/")
        hooks = FlowHooks()
        m = member.Member("a", b, seq, None, hooks, key=b"k" * 16, data_dir=None, isr_min=2)
        m.loop = asyncio.get_running_loop()
        isr = frozenset({"a", "b"})
        m.promote(ElectionRecord("a", 1, isr, 1))
        q, _ = b.vhost("/").declare_queue("q", durable=True)
        for _ in range(15):  # b acks none of them: under the bound
            publish(q)
            m._flush(due=True)
        assert hooks.flows == [] and m.replica.confirmed == 0
        m.fence(2)
        m.promote(ElectionRecord("a", 2, isr, 2))  # 16 records from the first term
        term_start = m.log.end
        for _ in range(20):  # 36 not confirmed, 20 of this term
            publish(q)
            m._flush(due=True)
        assert hooks.flows == [], "records from before the term counted"
        publish(q)
        m._flush(due=True)
        assert hooks.flows == [True] and m.flowing and m.flow_episodes == 1
        end = m.log.end
        assert end - term_start == 21
        follower = Follower()
        m.peers["b"] = follower.link
        m.on_peer(core.Hello("b", 2, (5, 1), m.log.boundaries(), 0))
        assert follower.kinds() == [wire.SYNC]

        def ack(offset: int) -> None:
            m.on_peer(core.Ack("b", 2, (5, 1), offset))
            assert m.replica.confirmed == offset

        ack(end - 19)  # 19 not confirmed: under the bound, over its half
        ack(end - 11)
        assert hooks.flows == [True], "read again before the half"
        ack(end - 10)
        assert hooks.flows == [True, False] and not m.flowing
        for _ in range(10):  # 20: at the bound, not past it
            publish(q)
            m._flush(due=True)
        assert hooks.flows == [True, False]
        publish(q)
        m._flush(due=True)
        assert hooks.flows == [True, False, True] and m.flow_episodes == 2
        m.fence(3)  # stepped down: its publishers are closed, not held
        assert hooks.flows == [True, False, True, False]

    asyncio.run(run())


def test_a_member_that_was_taking_a_copy_says_its_ids_after_a_restart(tmp_path: Path) -> None:
    """A copy's first durable record names its end, so a member killed while writing a copy
    recovers up to that end holding only part of it: it must say its ids, not its log's end
    (`BrokerLog.digest`, brief). The store is marked while the copy is written, until it is
    on disk."""

    async def run() -> None:
        a, _to_b, _b = primary_with_follower()
        copy = a.log.snapshot()
        assert copy is not None
        loop = asyncio.get_running_loop()

        member_log, store = opened(tmp_path, loop)
        marker = store.dir / log_mod.COPYING
        member_log.install(a.log.boundaries(), a.log.end, copy.frames())
        assert marker.exists()
        await until(lambda: not marker.exists())  # the copy is on disk
        assert store.synced >= a.log.end
        store.close()
        member_log, store = opened(tmp_path, loop)  # a restart that lost nothing else
        assert member_log.end == a.log.end
        assert member_log.digest(brief=True) == [log_mod.RESTARTED, a.log.end]
        store.close()
        marker.touch()  # as a kill while the copy was written leaves it
        member_log, store = opened(tmp_path, loop)
        assert member_log.end == a.log.end and not member_log.whole
        assert isinstance(member_log.digest(brief=True), dict)  # its ids
        store.close()

    asyncio.run(run())


def test_a_follower_that_connects_again_is_no_longer_reported_by_what_it_acked_before() -> None:
    """A follower's new connection replaces its old one (a half-open link the primary has
    not seen end): what it acked over the old one goes with it, as when a connection ends,
    so the controller does not read the member as caught up, or a few records short, until
    its next Hello."""

    async def go() -> None:
        seq = Sequencer()
        b = Broker(seq)
        key = b"k" * 16
        m = member.Member("a", b, seq, None, Hooks(), key=key, data_dir=None, isr_min=1)
        m.host = "127.0.0.1"
        m.promote(ElectionRecord("a", 1, frozenset({"a"}), 1))
        port = await m.start()

        async def join() -> asyncio.StreamWriter:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            kind, challenge, _ = wire.header(await read(reader))
            assert kind == wire.CHALLENGE
            answer = {
                "version": wire.VERSION,
                "node": "b",
                "cluster": "",
                "proof": wire.proof(key, challenge["nonce"], "b"),
                "takes": [],
            }
            writer.write(wire.pack(wire.ANSWER, answer))
            kind, _welcome, _ = wire.header(await read(reader))
            assert kind == wire.WELCOME
            return writer

        first = await join()
        await until(lambda: "b" in m.peers)
        m.replica.peers["b"], m.replica.acked["b"] = (1, 1), 0  # as after its copy's ack
        assert m.replica.report("b")[::3] == (True, 0)
        second = await join()
        await until(lambda: "b" not in m.replica.acked)
        assert m.replica.report("b") == (False, False, 0, None)
        for writer in (first, second):
            writer.close()
        m.server.close()

    asyncio.run(go())


async def read(reader: asyncio.StreamReader) -> bytes:
    """One whole replication message."""
    head = await reader.readexactly(4)
    return head + await reader.readexactly(wire.size(head) - 4)
