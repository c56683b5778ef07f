"""The Sequencer and the one apply path: a backup that applies the primary's records, and a
node that recovers from its durable records, hold what the primary holds. Pure, no I/O."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pamqp import commands

from tandem.broker.model import apply, message, records
from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.model.message import Message
from tests.support import sleeps_here


class Disk:
    page_bytes = 0  # pages nothing: these tests compare states in memory

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.synced = 0
        self.epochs: list[tuple[int, int]] = []

    def write(self, rtype: int, offset: int, data: bytes | list[bytes], key: Any) -> None:
        self.frames.append(data if isinstance(data, bytes) else b"".join(data))

    def forget_queue(self, vhost: str, queue: str) -> None:
        pass

    def boundary(self, epoch: int, first: int) -> None:
        self.epochs.append((epoch, first))

    def soon(self) -> None:
        pass


class Wire:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.held = 0
        self.woken = False

    def ship(self, data: bytes, offset: int) -> None:
        self.frames.append(data)

    def soon(self) -> None:
        self.woken = True  # a member's loop would ship the turn's marks; tests call emit_marks


def primary() -> tuple[Broker, Sequencer, Disk, Wire, list[int]]:
    now = [0]
    disk, wire = Disk(), Wire()
    seq = Sequencer(disk)
    seq.shipper = wire
    b = Broker(seq, clock=lambda: now[0])
    b.add_vhost("/")
    return b, seq, disk, wire, now


def replay(frames: list[bytes]) -> tuple[Broker, Sequencer]:
    seq = Sequencer()
    b = Broker(seq)
    b.add_vhost("/")
    seq.applying = True
    grouper = records.Grouper()
    for data in frames:
        for record in records.scan(data)[0]:
            for rtype, epoch, offset, payload in grouper.add(record):
                seq.follow(epoch, offset)
                apply.apply(b, rtype, payload)
    apply.done(b)
    seq.applying = False
    return b, seq


def msg(persistent: bool, n: int, expiration: int | None = None) -> Message:
    props = commands.Basic.Properties(
        delivery_mode=2 if persistent else 1,
        expiration=None if expiration is None else str(expiration),
        message_id=str(n),
    )
    body = b"body-%d" % n
    m = Message("", "", message.encode_route("", ""), props.marshal(), body, len(body))
    message.scan(m)
    return m


QUEUES = ["a", "b", "dead"]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("declare"), st.sampled_from(QUEUES), st.booleans(), st.booleans()),
        st.tuples(st.just("publish"), st.sampled_from(QUEUES), st.booleans(), st.booleans()),
        st.tuples(st.just("get"), st.sampled_from(QUEUES)),
        st.tuples(st.just("ack"), st.integers(0, 5)),
        st.tuples(st.just("reject"), st.integers(0, 5), st.booleans()),
        st.tuples(st.just("purge"), st.sampled_from(QUEUES)),
        st.tuples(st.just("delete"), st.sampled_from(QUEUES)),
        st.tuples(st.just("tick"), st.integers(0, 200)),
        st.tuples(st.just("turn")),
    ),
    max_size=60,
)


def run(
    script: list[tuple[Any, ...]], cut: list[int] | None = None
) -> tuple[Broker, dict[str, list[Message]], Disk, Wire]:
    """Run `script` on a primary; with `cut` ([an index into it]), append how many frames
    were on its disk before that op."""
    b, seq, disk, wire, now = primary()
    vh = b.vhost("/")
    vh.declare_queue("dead", durable=True)
    unacked: list[tuple[Any, Message]] = []
    n = 0
    for i, op in enumerate(script):
        if cut is not None and i == cut[0]:
            seq.emit_marks()
            cut.append(len(disk.frames))
        kind = op[0]
        q = vh.queues.get(op[1]) if kind in ("publish", "get", "purge", "delete") else None
        if kind == "declare" and op[1] not in vh.queues:
            args: dict[str, Any] = {"x-dead-letter-exchange": ""}
            args["x-dead-letter-routing-key"] = "dead"
            if op[3]:
                args["x-message-ttl"] = 100
                args["x-max-length"] = 3
            vh.declare_queue(op[1], durable=op[2], arguments=args)
        elif kind == "publish" and q is not None:
            n += 1
            q.enqueue(msg(op[2], n, 50 if op[3] else None))
        elif kind == "get" and q is not None:
            got = q.get()
            if got is not None:
                q.unacked += 1
                unacked.append((q, got))
        elif kind in ("ack", "reject") and unacked:
            q, m = unacked.pop(op[1] % len(unacked))
            if kind == "ack":
                q.settle(m)
            else:
                q.reject(m, op[2])
        elif kind == "purge" and q is not None:
            q.purge()
        elif kind == "delete" and q is not None and q.name != "dead":
            vh.delete_queue(q)
            unacked = [(uq, m) for uq, m in unacked if uq is not q]
        elif kind == "tick":
            now[0] += op[1]
            b.sweep()
        elif kind == "turn":  # the end of a loop turn: the member ships the turn's marks
            seq.emit_marks()
    seq.emit_marks()
    held: dict[str, list[Message]] = {
        name: list(q.messages) + [m for uq, m in unacked if uq is q]
        for name, q in vh.queues.items()
    }
    return b, held, disk, wire


@settings(max_examples=300, deadline=None)
@given(ops)
def test_a_backup_holds_what_the_primary_holds(script: list[tuple[Any, ...]]) -> None:
    b, held, _disk, wire = run(script)
    backup, _ = replay(wire.frames)
    queues = backup.vhost("/").queues
    assert set(queues) == set(held)
    for name, msgs in held.items():
        assert sorted(m.mid for m in queues[name].messages) == sorted(m.mid for m in msgs)
        assert queues[name].depth == len(msgs)
        # Delivered (awaiting its ack) or requeued: after failover it goes out redelivered.
        outstanding = b.vhost("/").queues[name].outstanding
        want = {m.mid: m.redelivered or m.mid in outstanding for m in msgs}
        assert {m.mid: m.redelivered for m in queues[name].messages} == want


@settings(max_examples=300, deadline=None)
@given(ops, ops)
@example(  # a queue of the same name deleted and declared again: its messages went unsaid
    [("declare", "a", True, False), ("publish", "a", True, False)],
    [("delete", "a"), ("declare", "a", True, False), ("publish", "a", True, False)],
)
@example(  # acked, dead-lettered and delivered since the restart
    [
        ("declare", "a", True, True),
        ("publish", "a", True, False),
        ("publish", "a", False, False),
        ("publish", "a", True, False),
        ("get", "a"),
        ("get", "a"),
    ],
    [("ack", 0), ("get", "a"), ("tick", 150), ("publish", "b", True, False)],
)
def test_a_restarted_member_takes_what_it_lacks_from_the_primarys_window(
    before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]
) -> None:
    """A member restarted from its own durable records says so in brief (its log's end),
    and the primary makes the difference from that and its window of what came since, with
    no digest of ids: the member then holds what the primary holds. Where a queue was
    deleted since, the primary cannot, and says so (None: the member sends its digest)."""
    from tandem.broker.replication.log import BrokerLog

    cut = [len(before)]
    b, held, disk, wire = run([*before, *after, ("turn",)], cut)
    restarted, restarted_seq = replay(disk.frames[: cut[1]])
    member_log = BrokerLog(restarted, restarted_seq, None)
    end = member_log.end
    theirs = member_log.digest(brief=True)
    assert (theirs == ["restarted", end]) == (end > 0)
    seq = b.journal
    assert isinstance(seq, Sequencer)
    primary_log = BrokerLog(b, seq, None)
    deleted = False
    for frame in wire.frames:
        rtype, _epoch, offset, _durable = records.head(frame)
        primary_log.keep(offset, frame)
        if rtype == records.DEFINE and offset > end:
            deleted |= records.decode_body(records.payload(frame))["op"] == "queue.delete"
    copy = primary_log.snapshot(theirs, end)
    if copy is None:
        assert deleted and end > 0
        return
    member_log.install(primary_log.boundaries(), primary_log.end, copy.frames())
    assert member_log.whole and member_log.not_applied == []
    queues = restarted.vhost("/").queues
    assert set(queues) == set(held)
    for name, msgs in held.items():
        assert sorted(m.mid for m in queues[name].messages) == sorted(m.mid for m in msgs)
        outstanding = b.vhost("/").queues[name].outstanding
        want = {m.mid: m.redelivered or m.mid in outstanding for m in msgs}
        assert {m.mid: m.redelivered for m in queues[name].messages} == want


def restart_and_rejoin(b: Broker, frames_kept: list[bytes], wire: Wire) -> tuple[Broker, Any]:
    """A member that restarted from `frames_kept` (its disk), given the difference the
    primary `b` makes from its brief digest and the frames `wire` shipped."""
    from tandem.broker.replication.log import BrokerLog

    restarted, restarted_seq = replay(frames_kept)
    apply.drop_exclusive(restarted)  # as a start does
    member_log = BrokerLog(restarted, restarted_seq, None)
    seq = b.journal
    assert isinstance(seq, Sequencer)
    primary_log = BrokerLog(b, seq, None)
    for frame in wire.frames:
        primary_log.keep(records.head(frame)[2], frame)
    copy = primary_log.snapshot(member_log.digest(brief=True), member_log.end)
    assert copy is not None
    member_log.install(primary_log.boundaries(), primary_log.end, copy.frames())
    return restarted, member_log


def test_a_message_routed_to_two_queues_is_sent_where_the_restarted_log_ended_before_it() -> None:
    """One message routed to two queues has the id of its first ENQUEUE record; a member's
    log that ends between the two records (a torn tail cut back) holds it in the first queue
    only, and the difference sends it to the second."""
    b, _seq, disk, wire, _now = primary()
    vh = b.vhost("/")
    q1, _ = vh.declare_queue("q1", durable=True)
    q2, _ = vh.declare_queue("q2", durable=True)
    m = msg(True, 1)
    q1.enqueue(m)
    q2.enqueue(m)  # the same message, as routing hands it to each queue
    assert records.head(disk.frames[-1])[2] == records.head(disk.frames[-2])[2] + 1
    restarted, _log = restart_and_rejoin(b, disk.frames[:-1], wire)
    queues = restarted.vhost("/").queues
    assert [x.mid for x in queues["q1"].messages] == [m.mid]
    assert [x.mid for x in queues["q2"].messages] == [m.mid]


def test_a_restarted_member_is_sent_the_frames_shipped_after_its_end() -> None:
    """The difference for a member that restarted sends, for a message enqueued after its
    end, the very frame the primary shipped then, byte for byte what it would make again
    (made again, one cost a copy 2-4 microseconds, a hundred thousand at a time): not one
    that shipped in a group (it would wait for the rest), nor the second queue's record of a
    message routed to two (its id is the first's)."""
    from tandem.broker.replication.log import BrokerLog, Restarted

    b, seq, disk, wire, _now = primary()
    vh = b.vhost("/")
    q1, _ = vh.declare_queue("q1", durable=True)
    q2, _ = vh.declare_queue("q2", durable=True)
    q1.enqueue(msg(True, 1))
    kept = list(disk.frames)  # where the member's log ends
    q1.enqueue(msg(True, 2))
    q1.enqueue(msg(False, 3))  # shipped, not written: sent all the same
    both = msg(True, 4)
    q1.enqueue(both)
    q2.enqueue(both)
    seq.begin_group()
    q1.enqueue(msg(True, 5))
    q1.enqueue(msg(True, 6))
    seq.end_group()

    restarted, restarted_seq = replay(kept)
    member_log = BrokerLog(restarted, restarted_seq, None)
    primary_log = BrokerLog(b, seq, None)
    for frame in wire.frames:
        primary_log.keep(records.head(frame)[2], frame)

    def copy(reuse: bool) -> list[bytes]:
        made = primary_log.snapshot(member_log.digest(brief=True), member_log.end)
        assert made is not None and isinstance(made.theirs, Restarted)
        if not reuse:
            made.theirs.since = ()
        return made.frames()

    frames = copy(reuse=True)
    assert frames == copy(reuse=False)
    shipped = [
        records.read_key(records.payload(f))[1:]
        for f in frames
        if records.head(f)[0] == records.ENQUEUE and any(f is w for w in wire.frames)
    ]
    mids = [m.mid for m in q1.messages]
    assert shipped == [("q1", mid) for mid in mids[1:4]] + [("q1", mids[5])]
    member_log.install(primary_log.boundaries(), primary_log.end, frames)
    queues = restarted.vhost("/").queues
    assert [m.mid for m in queues["q1"].messages] == mids
    assert [m.mid for m in queues["q2"].messages] == [both.mid]


def test_an_exclusive_queue_a_start_dropped_is_sent_whole() -> None:
    """A start drops the exclusive queues (their connections died with the process) without
    a record; replicated `all`, such a queue's messages all come from the primary."""
    b, _seq, disk, wire, _now = primary()
    owner = object()
    q, _ = b.vhost("/").declare_queue(
        "x", durable=True, exclusive_owner=owner, arguments={"x-tandem-replicate": "all"}
    )
    q.enqueue(msg(True, 1))
    q.enqueue(msg(True, 2))
    restarted, _log = restart_and_rejoin(b, list(disk.frames), wire)
    assert len(restarted.vhost("/").queues["x"].messages) == 2


@settings(max_examples=300, deadline=None)
@given(ops)
def test_recovery_holds_the_durable_part(script: list[tuple[Any, ...]]) -> None:
    b, held, disk, _wire = run(script)
    recovered, _ = replay(disk.frames)
    queues = recovered.vhost("/").queues
    durable = {name for name, q in b.vhost("/").queues.items() if q.durable}
    assert set(queues) == durable
    for name in durable:
        want = sorted(m.mid for m in held[name] if m.persistent)
        assert sorted(m.mid for m in queues[name].messages) == want


def test_positions_are_one_sequence_and_epochs_have_boundaries() -> None:
    b, seq, disk, wire, _now = primary()
    vh = b.vhost("/")
    q, _ = vh.declare_queue("q", durable=True)
    q.enqueue(msg(True, 1))
    seq.begin_term(2)
    q.enqueue(msg(False, 2))
    offsets = [records.head(f)[2] for f in wire.frames]
    assert offsets == [1, 2, 3]
    assert [records.head(f)[1] for f in wire.frames] == [1, 1, 2]
    assert seq.boundaries == [(1, 1), (2, 3)] and disk.epochs == [(1, 1), (2, 3)]
    # The transient message is shipped, not written.
    assert [records.head(f)[3] for f in wire.frames] == [True, True, False]
    assert len(disk.frames) == 2


def test_a_turns_deliveries_to_a_queue_are_one_record() -> None:
    """A delivery is marked in the log (after failover it goes out redelivered), but not
    with a record of its own: the deliveries to a queue in one turn of the primary's loop
    are one MARKS record, shipped with the turn's other records. A queue deleted in the
    turn takes none."""
    b, seq, _disk, wire, _now = primary()
    vh = b.vhost("/")
    a, _ = vh.declare_queue("a", durable=True)
    gone, _ = vh.declare_queue("gone", durable=True)
    for n in range(4):
        a.enqueue(msg(True, n))
        gone.enqueue(msg(True, n))
    before = len(wire.frames)
    got = [a.get(), a.get(), gone.get()]
    assert wire.woken and len(wire.frames) == before  # asked to ship soon; nothing yet
    vh.delete_queue(gone)
    seq.emit_marks()
    marks = [f for f in wire.frames[before:] if records.head(f)[0] == records.MARKS]
    assert len(marks) == 1
    mids = [m.mid for m in got[:2] if m is not None]
    assert records.read_marks(records.payload(marks[0])) == ("/", "a", mids)
    backup, _ = replay(wire.frames)
    flags = [m.redelivered for m in backup.vhost("/").queues["a"].messages]
    assert flags == [True, True, False, False]


def test_a_durable_change_to_an_unreplicated_queue_ships_as_a_noop() -> None:
    b, _seq, disk, wire, _now = primary()
    q, _ = b.vhost("/").declare_queue(
        "local", durable=True, arguments={"x-tandem-replicate": "none"}
    )
    q.enqueue(msg(True, 1))
    kinds = [records.head(f)[0] for f in wire.frames]
    assert kinds == [records.NOOP, records.NOOP]
    assert [records.head(f)[0] for f in disk.frames] == [records.DEFINE, records.ENQUEUE]


def test_a_lone_node_gives_transient_changes_no_position() -> None:
    seq = Sequencer(Disk())
    b = Broker(seq)
    q, _ = b.add_vhost("/").declare_queue("q")
    q.enqueue(msg(False, 1))
    assert seq.offset == 0


def test_confirms_wait_for_the_disk_and_the_isr() -> None:
    _b, seq, disk, wire, _now = primary()
    q, _ = _b.vhost("/").declare_queue("q", durable=True)
    q.enqueue(msg(True, 1))
    done: list[int] = []
    seq.when_done(lambda: done.append(1))
    assert done == [] and seq.dirty()
    disk.synced = seq.offset
    seq.progress()
    assert done == []  # on disk, not yet held by the ISR
    wire.held = seq.offset
    seq.progress()
    assert done == [1] and not seq.dirty()


def test_a_transaction_is_one_group_of_records() -> None:
    """tx.commit's publishes and acks go out as one group: every record but the last says
    more follow, so a backup or a recovery applies all of them or none."""
    b, seq, disk, wire, _now = primary()
    q, _ = b.vhost("/").declare_queue("q", durable=True)
    before = len(wire.frames)
    seq.begin_group()
    q.enqueue(msg(True, 1))
    q.enqueue(msg(False, 2))
    assert len(wire.frames) == before  # held until the group ends
    seq.end_group()
    group = wire.frames[before:]
    assert [records.continues(f) for f in group] == [True, False]
    assert [records.continues(f) for f in disk.frames[-1:]] == [True]  # the durable one
    partial, _ = replay(wire.frames[:-1])
    assert partial.vhost("/").queues["q"].depth == 0  # an unfinished group: nothing
    whole, _ = replay(wire.frames)
    assert whole.vhost("/").queues["q"].depth == 2


# -- issue 14: records carry AMQP values as AMQP values; apply decides nothing --

field_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False),
        st.decimals(
            allow_nan=False, allow_infinity=False, places=3, min_value=-(10**6), max_value=10**6
        ),
        st.text(max_size=20),
        st.binary(max_size=20).map(bytearray),
        st.datetimes(
            min_value=datetime.datetime(1970, 1, 1),
            max_value=datetime.datetime(2100, 1, 1),  # pamqp reads later ones as ms
        ).map(lambda d: d.replace(microsecond=0, tzinfo=datetime.UTC)),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=12), field_values, max_size=6))
def test_a_structured_payload_round_trips_every_field_type(arguments: dict[str, Any]) -> None:
    payload = records.define("/", "queue.declare", {"name": "q", "arguments": arguments})
    assert records.decode_body(payload)["body"]["arguments"] == arguments


def test_a_payload_written_as_json_by_an_older_version_is_still_read() -> None:
    old = b'{"vhost":"/","op":"queue.declare","body":{"name":"q","arguments":{"x-a":1}}}'
    assert records.decode_body(old)["body"] == {"name": "q", "arguments": {"x-a": 1}}


def test_a_message_id_holds_its_epoch_and_a_key_without_one_reads_as_epoch_0() -> None:
    m = records.mid(7, 42)
    assert (records.mid_epoch(m), records.mid_offset(m)) == (7, 42)
    assert records.mid(7, 42) > records.mid(6, 10**12) > records.mid(0, 10**15)
    assert records.read_key(records.key("/", "q", m)) == ("/", "q", m)
    legacy = records.key("/", "q", 42)[: -records.U32.size]  # as written before epochs
    assert records.read_key(legacy) == ("/", "q", 42)


def declare_record(name: str, **body: Any) -> bytes:
    full = {"name": name, "durable": True, "auto_delete": False, "arguments": {}, **body}
    return records.define("/", "queue.declare", full)


def test_apply_makes_a_declaration_so_without_a_clients_checks() -> None:
    """A server-named queue and arguments the edge would refuse now are what the primary
    decided (or an older version did): apply creates them, it does not judge them."""
    b = Broker(Sequencer())
    b.add_vhost("/")
    apply.apply(b, records.DEFINE, declare_record("amq.gen-x1"))
    apply.apply(b, records.DEFINE, declare_record("odd", arguments={"x-max-length": "ten"}))
    queues = b.vhost("/").queues
    assert {"amq.gen-x1", "odd"} <= set(queues) and queues["odd"].max_length is None


def test_a_declaration_over_a_queue_with_other_properties_replaces_it() -> None:
    """A copy restating a queue that was deleted and declared again with other arguments."""
    b = Broker(Sequencer())
    vh = b.add_vhost("/")
    apply.apply(b, records.DEFINE, declare_record("q", arguments={"x-max-length": 1}))
    apply.apply(b, records.DEFINE, declare_record("q", arguments={"x-max-length": 5}))
    assert vh.queues["q"].max_length == 5
    exchange = {"name": "x", "durable": True, "auto_delete": False, "internal": False}
    apply.apply(
        b,
        records.DEFINE,
        records.define("/", "exchange.declare", {**exchange, "type": "fanout", "arguments": {}}),
    )
    apply.apply(
        b,
        records.DEFINE,
        records.define("/", "exchange.declare", {**exchange, "type": "topic", "arguments": {}}),
    )
    assert vh.exchanges["x"].kind == "topic"


def test_a_record_that_cannot_apply_is_named_and_the_backup_asks_for_a_copy() -> None:
    """Issue 14: said once, with its position; the frame is not taken twice; the member is
    no longer whole (it takes a copy), and nothing escapes to the replication link."""
    from tandem.broker.replication import core
    from tandem.broker.replication.log import BrokerLog

    seq = Sequencer()
    b = Broker(seq)
    b.add_vhost("/")
    log = BrokerLog(b, seq, None)
    log.lost = False
    bad = records.frame(records.ENQUEUE, 1, 1, b"\x00\x01/", durable=False)
    good = records.frame(records.DEFINE, 1, 2, declare_record("q"), durable=False)
    replica = core.Replica("b", log=log)
    replica.following, replica.synced, replica.epoch = "a", True, 1
    out = replica.peer(core.Append("a", 1, 1, (bad, good)))
    assert [type(m).__name__ for _dest, m in out] == ["Hello"]
    assert [(e, o) for e, o, _what in log.not_applied] == [(1, 1)]
    assert "enqueue" in log.not_applied[0][2] and not log.whole
    assert "q" in b.vhost("/").queues and log.end == 2


@given(
    priorities=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    drop=st.sets(st.integers(1, 60)),
    max_priority=st.sampled_from([None, 3]),
)
def test_many_messages_removed_at_once_leave_the_queue_as_one_by_one_would(
    priorities: list[int], drop: set[int], max_priority: int | None
) -> None:
    """A copy from the primary drops what a member holds and the primary does not, all at
    once (`remove_many`): the queue keeps the same messages, in the same order, with the same
    byte count, as removing them one by one, which searched the queue for each and took
    minutes for a diverged suffix of 50,000 messages."""
    queues = []
    for _ in range(2):
        b = Broker()
        vh = b.add_vhost("/")
        args = {} if max_priority is None else {"x-max-priority": max_priority}
        q, _ = vh.declare_queue("q", durable=True, arguments=args)
        for mid, priority in enumerate(priorities, 1):
            m = Message("", "q", message.encode_route("", "q"), b"\x00\x00", b"x" * mid, mid)
            m.mid, m.priority = mid, priority
            q.restore(m)
        queues.append(q)
    one_by_one, at_once = queues
    for mid in sorted(drop):
        one_by_one.remove(mid)
    at_once.remove_many(sorted(drop))
    assert [m.mid for m in at_once.messages] == [m.mid for m in one_by_one.messages]
    assert (
        at_once.bytes
        == one_by_one.bytes
        == sum(mid for mid in range(1, len(priorities) + 1) if mid not in drop)
    )
    assert all(at_once.holds(m.mid) for m in at_once.messages)
    assert not any(at_once.holds(mid) for mid in drop)


@given(
    held=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2**64 - 1)), unique=True, max_size=40
    ),
    lacking=st.sets(st.integers(0, 39)),
)
def test_a_digest_names_exactly_the_ids_a_member_holds(
    held: list[tuple[int, int]], lacking: set[int]
) -> None:
    """A member's digest (its ids, packed per epoch) reads back as exactly its ids, across
    epochs and up to the largest offset; the runs an earlier version sends read as before."""
    from tandem.broker.replication import log as log_mod

    mids = sorted(records.mid(e, o) for e, o in held)
    theirs = {"/": {"q": log_mod._packed([m for i, m in enumerate(mids) if i not in lacking])}}
    parsed = log_mod._parse_digest(json.loads(json.dumps(theirs)))
    assert parsed == {("/", "q"): {m for i, m in enumerate(mids) if i not in lacking}}
    runs = {"/": {"q": [[5, 7], [10, 10]]}}
    assert log_mod._parse_digest(runs) == {("/", "q"): {5, 6, 7, 10}}
    for bad in (
        [[1, "not base64!"]],
        [[-1, "AAAAAAAAAAE="]],
        [[2**32, ""]],
        [[3, 2]],
        [[1e309, 2]],
    ):
        assert log_mod._parse_digest({"/": {"q": bad}}) is None, bad


def test_a_copy_is_of_the_state_when_it_was_asked_for_whenever_its_frames_are_made() -> None:
    """A member makes a copy's frames on another thread while its primary goes on serving
    (`Copy`): what was published, consumed or acked after the copy was asked for is not
    in it (the Appends after it carry that), and what was delivered then is marked."""
    from tandem.broker.replication.log import BrokerLog

    b, seq, _disk, _wire, _now = primary()
    q, _ = b.vhost("/").declare_queue("q", durable=True)
    for n in range(10):
        q.enqueue(msg(True, n))
    delivered = [q.get(), q.get()]
    assert all(m is not None for m in delivered)
    primary_log = BrokerLog(b, seq, None)
    whole, difference = primary_log.snapshot(), primary_log.snapshot({"/": {"q": []}})
    end, bounds = primary_log.end, primary_log.boundaries()
    held = [m.mid for m in q.messages] + [m.mid for m in delivered if m is not None]
    for n in range(10, 15):  # the primary goes on
        q.enqueue(msg(True, n))
    for _ in range(3):
        got = q.get()
        assert got is not None
        q.settle(got)
    for copy in (whole, difference):
        seq2 = Sequencer()
        b2 = Broker(seq2)
        b2.add_vhost("/")
        backup_log = BrokerLog(b2, seq2, None)
        backup_log.install(bounds, end, copy.frames())
        q2 = b2.vhost("/").queues["q"]
        assert sorted(m.mid for m in q2.messages) == sorted(held)
        assert {m.mid for m in q2.messages if m.redelivered} == {
            m.mid for m in delivered if m is not None
        }
        assert backup_log.end == end
    # The difference for a member that holds the first five and one consumed since: what it
    # lacks of what was there when asked, the marks of what was delivered, and the removal.
    from tandem.broker.replication import log as log_mod

    gone = records.mid(1, 10_000)
    theirs = [*sorted(held)[:5], gone]
    diff = primary_log.snapshot({"/": {"q": log_mod._packed(sorted(theirs))}})
    there = {m.mid for m in q.messages} | set(q.outstanding)
    delivered_then = set(q.outstanding)
    q.enqueue(msg(True, 99))  # after the capture: not in it
    q.get()
    by_type: dict[int, set[int]] = {}
    for frame in diff.frames()[1:]:
        rtype, epoch, offset, _durable = records.head(frame)
        payload = records.payload(frame)
        if rtype == records.ENQUEUE:  # at its own position, which its id names
            by_type.setdefault(rtype, set()).add(records.mid(epoch, offset))
        elif rtype in (records.DEQUEUE, records.MARK):
            by_type.setdefault(rtype, set()).add(records.read_key(payload)[2])
    assert by_type[records.ENQUEUE] == there - set(theirs)
    assert gone in by_type[records.DEQUEUE]
    assert by_type[records.DEQUEUE] == set(theirs) - there  # and those acked since `held`
    assert by_type[records.MARK] == delivered_then


def test_a_copy_that_only_looks_at_messages_gives_the_loop_few_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy is made on another thread, which gives the loop a turn every YIELD_EVERY
    messages of work (`give_way`), 11 ms each under load. A member that restarted holds the
    persistent messages of a durable queue up to its end: the copy looks at each, encodes
    none, and counts them at a sixteenth. Counted whole, a million queued gave 25 turns,
    0.3 s of a 0.45 s copy."""

    from tandem.broker.replication.log import BrokerLog
    from tandem.broker.store import log as store_log

    count = 5 * store_log.YIELD_EVERY
    b, seq, disk, _wire, _now = primary()
    q, _created = b.vhost("/").declare_queue("q", durable=True)
    for n in range(count):
        q.enqueue(msg(True, n))
    restarted, restarted_seq = replay(disk.frames)
    member_log = BrokerLog(restarted, restarted_seq, None)
    primary_log = BrokerLog(b, seq, None)
    copy = primary_log.snapshot(member_log.digest(brief=True), member_log.end)
    assert copy is not None
    given = sleeps_here(monkeypatch)
    frames = copy.frames()
    assert not [f for f in frames if records.head(f)[0] == records.ENQUEUE]  # all held
    assert len(given) <= 1  # two, counted whole


def test_messages_looked_at_a_few_at_a_time_count_as_many_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hundred thousand queues of ten messages, each looked at by a copy, count as a
    million messages do: counted a queue at a time, each was rounded down to nothing, and
    the copy never gave the loop its turn."""

    from tandem.broker.replication import log as log_mod
    from tandem.broker.store import log as store_log

    given = sleeps_here(monkeypatch)
    monkeypatch.setattr(log_mod, "_looked", 0)
    monkeypatch.setattr(store_log, "_owed", 0)
    for _queue in range(100_000):
        log_mod._look(10)
    assert len(given) == 1_000_000 // log_mod._LOOKED // store_log.YIELD_EVERY


@given(mids=st.lists(st.integers(0, 2**40), unique=True, max_size=40))
def test_a_copy_orders_and_reads_a_slice_at_a_time_as_all_at_once(mids: list[int]) -> None:
    """A copy is made on another thread a slice at a time (`_SLICE`, small here), so as not
    to hold the loop; the slices give what one call over everything gives."""
    from unittest import mock

    from tandem.broker.replication import log as log_mod

    messages = []
    for mid in mids:
        m = Message("", "q", message.encode_route("", "q"), b"\x00\x00", b"", 0)
        m.mid = mid
        messages.append(m)
    with mock.patch.object(log_mod, "_SLICE", 3):
        assert [m.mid for m in log_mod._by_mid(messages)] == sorted(mids)
        digest = {"/": {"q": log_mod._packed(sorted(mids))}}
        assert log_mod._parse_digest(digest) == {("/", "q"): set(mids)}


_MESSAGE = st.tuples(
    st.integers(0, 3),  # epoch (0: an id from before epochs were part of it)
    st.integers(0, 6),  # offset
    st.booleans(),  # persistent
    st.booleans(),  # redelivered
    st.booleans(),  # routed to this queue after the follower's end (`lacking`)
    st.booleans(),  # delivered, not acked (`outstanding`)
)


@given(messages=st.lists(_MESSAGE, max_size=30), upto=st.integers(0, 6))
def test_what_a_restarted_follower_lacks_is_told_without_taking_the_ids_apart(
    messages: list[tuple[int, int, bool, bool, bool, bool]], upto: int
) -> None:
    """A copy for a follower that restarted passes over every message of a durable queue,
    a million for a deep one, comparing each id with the epoch's ids it holds
    (`_lacked`), not taking each id's offset out of it (`_kept`): the two tell the same."""
    from tandem.broker.replication import log as log_mod

    q = apply_queue()
    msgs, lacking, outstanding = [], set(), {}
    for epoch, offset, persistent, redelivered, later, delivered in messages:
        props = b"\x10\x00\x02" if persistent else b"\x00\x00"
        m = apply.message(q, records.mid(epoch, offset), message.encode_route("", "q"), props, b"")
        m.redelivered = redelivered
        msgs.append(m)
        if later:
            lacking.add(m.mid)
        if delivered:
            outstanding[m.mid] = m
    expected = [
        m
        for m in msgs
        if not log_mod._kept(m, True, upto, lacking) or m.redelivered or m.mid in outstanding
    ]
    assert log_mod._lacked(msgs, upto, lacking, outstanding) == expected


def apply_queue() -> Any:
    b = Broker(Sequencer())
    b.add_vhost("/")
    body = {"name": "q", "durable": True, "auto_delete": False, "arguments": {}}
    apply.apply(b, records.DEFINE, records.define("/", "queue.declare", body))
    return b.vhost("/").queues["q"]


def test_the_bytes_held_after_an_offset_are_those_of_the_frames_after_it() -> None:
    """Flow control weighs what the ISR has not confirmed by its frames' bytes; before the
    window's first frame, it is all the window holds (the window is bounded)."""
    from tandem.broker.replication.log import BrokerLog

    seq = Sequencer()
    log = BrokerLog(Broker(seq), seq, None, window_bytes=250)
    for offset in range(1, 6):
        log.keep(offset, bytes(100))
    seq.offset = 5
    assert [log.bytes_after(o) for o in (5, 4, 3, 2, 0)] == [0, 100, 200, 200, 200]


def test_a_member_whose_page_read_back_short_makes_its_digest_again() -> None:
    """A backup repeats the digest it made for a Hello while its log's end stays put (an idle
    cluster). A page read back short (a corrupt record) loses a message without moving that
    end: the digest of the copy the member then asks for must not name it, or the primary
    leaves it out of the copy."""
    from tandem.broker.replication.log import BrokerLog

    b, _seq, _disk, wire, _now = primary()
    q, _ = b.vhost("/").declare_queue("q", durable=True)
    for n in range(3):
        q.enqueue(msg(True, n))
    backup, backup_seq = replay(wire.frames)
    member_log = BrokerLog(backup, backup_seq, None)
    before = member_log.digest()
    lost = backup.vhost("/").queues["q"].in_memory()[1]
    backup.vhost("/").queues["q"].remove(lost.mid)  # as a read back short leaves it
    assert member_log.digest() == before  # the end did not move: made once
    member_log.page_short("a page read back 2 of its 3 messages")
    assert member_log.lost and member_log.digest() != before
