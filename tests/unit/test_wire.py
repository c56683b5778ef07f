"""The replication messages sent once per batch of records: APPEND and ACK with JSON headers
for a peer that reads only those, APPEND_B and ACK_B with packed ones for a peer that says it
takes them (replication/wire.py)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.broker.model import records
from tandem.broker.model.broker import Broker
from tandem.broker.replication import core, member, wire
from tests.unit.test_member_copy import Follower, primary_with_follower, publish

FRAMES = (
    records.frame(records.DEFINE, 3, 41, b"first"),
    records.frame(records.ENQUEUE, 3, 42, b"second" * 100),
)
MESSAGES: list[core.PeerMessage] = [
    core.Append("tandem-0", 3, 41, FRAMES),
    core.Append("p", 2**40, 2**50, ()),
    core.Ack("tandem-2", 3, (1_764_000_000_000_000_000, 7), 42),
    core.Ack("b", 0, (0, 0), 0),
]


@pytest.mark.parametrize("msg", MESSAGES)
def test_each_kind_reads_back_as_it_was_sent_with_either_header(msg: core.PeerMessage) -> None:
    packed = wire.encode(msg, wire.TAKES)
    plain = wire.encode(msg)
    assert packed[4] in (wire.APPEND_B, wire.ACK_B)
    assert plain[4] in (wire.APPEND, wire.ACK)
    assert len(packed) < len(plain)
    for data in (packed, plain):
        assert wire.split(data + b"next") == (data[4], len(data))
        got = wire.decode(data)
        assert got == msg if isinstance(msg, core.Ack) else _same_append(got, msg)
        assert wire.Upstream().take(data) == got


def _same_append(got: core.PeerMessage, sent: core.PeerMessage) -> bool:
    assert isinstance(got, core.Append) and isinstance(sent, core.Append)
    return (got.sender, got.epoch, got.start, list(got.entries)) == (
        sent.sender,
        sent.epoch,
        sent.start,
        list(sent.entries),
    )


def test_a_peer_gets_the_packed_kinds_only_when_it_said_it_takes_them() -> None:
    ack = core.Ack("b", 1, (5, 1), 9)
    assert wire.takes({"version": 1}) == ()  # a member from before they existed
    assert wire.takes({"takes": "all"}) == ()
    assert wire.takes({"takes": [wire.ACK_B, 99]}) == (wire.ACK_B,)
    assert wire.encode(ack, wire.takes({"takes": [wire.APPEND_B]}))[4] == wire.ACK
    assert wire.encode(ack, wire.takes({"takes": list(wire.TAKES)}))[4] == wire.ACK_B


@pytest.mark.parametrize("damage", ["sender length", "trailing bytes", "cut", "not utf-8"])
def test_a_packed_header_that_does_not_add_up_ends_the_link(damage: str) -> None:
    data = bytearray(wire.encode(core.Ack("b", 1, (5, 1), 9), wire.TAKES))
    if damage == "sender length":
        data[-2] += 1  # the sender's length (u16, before the one-byte name)
    elif damage == "trailing bytes":
        data += b"x"
        data[0:4] = (int.from_bytes(data[0:4], "big") + 1).to_bytes(4, "big")
    elif damage == "cut":
        data[0:4] = (9 + 10).to_bytes(4, "big")
        data[5:9] = (10).to_bytes(4, "big")
        del data[9 + 10 :]
    else:
        data[-1] = 0xFF
    with pytest.raises(wire.WireError, match="bad message of kind 9"):
        wire.decode(bytes(data))


def test_an_append_whose_header_runs_past_its_message_ends_the_link() -> None:
    data = bytearray(wire.encode(core.Append("prim", 1, 1, ()), wire.TAKES))
    data[5:9] = (len(data) - 9 + 1).to_bytes(4, "big")  # a header a byte longer than sent
    data[-5 - 2 : -5] = (5).to_bytes(2, "big")  # and a sender to fill it
    with pytest.raises(wire.WireError, match="bad message of kind 8"):
        wire.decode(bytes(data))


async def old_and_new_followers() -> tuple[member.Member, Follower, Follower, Broker]:
    """A primary with two synced followers: one from before the packed kinds (b), one that
    takes every kind this member reads (c)."""
    m, old, b = primary_with_follower()
    new = Follower()
    new.link.takes = wire.TAKES
    m.peers["c"] = new.link
    for node in ("b", "c"):
        m.on_peer(core.Hello(node, 1, (5, 1), (), 0, False, None))
        await m.copying[node].made
    return m, old, new, b


def test_a_primary_sends_a_follower_the_kinds_it_said_it_takes() -> None:
    """The same batch goes packed to a follower that takes APPEND_B and as JSON to one that
    said nothing: a cluster mid-upgrade keeps replicating."""

    async def run() -> None:
        m, old, new, b = await old_and_new_followers()
        publish(b.vhost("/").queues["q"])
        b.journal.when_done(lambda: None)  # a confirm waits for it: shipped at once
        m._flush()
        assert old.kinds() == [wire.SYNC, wire.APPEND]
        assert new.kinds() == [wire.SYNC, wire.APPEND_B]
        assert _same_append(wire.decode(_last(old)), wire.decode(_last(new)))

    asyncio.run(run())


def _last(follower: Follower) -> bytes:
    data = follower.data
    while True:
        split = wire.split(data)
        assert split is not None
        if split[1] == len(data):
            return data
        data = data[split[1] :]


@pytest.mark.parametrize(
    "msg",
    [
        core.Detail("a", 4, (1_764_000_000_000_000_000, 3)),
        core.Hello("b", 4, (5, 2), ((1, 1), (4, 9)), 12, False, ["restarted", 12]),
        core.Rejoin("a", 4),
        core.Stale("c", 9),
    ],
)
def test_the_other_kinds_read_back_as_they_were_sent(msg: core.PeerMessage) -> None:
    assert wire.decode(wire.encode(msg, wire.TAKES)) == msg


def _messages(data: bytes) -> list[bytes]:
    out = []
    while data:
        split = wire.split(data)
        assert split is not None
        out.append(data[: split[1]])
        data = data[split[1] :]
    return out


BODIES = [bytes([n]) * 9_000 for n in range(44, 50)]


def _large_append(start: int = 41) -> core.Append:
    """Small frames and large ones, as one turn's commit of a transaction: some large ones as
    their parts, the body as it came (`records.Framed`), as a primary ships them."""
    small = [records.frame(records.DEQUEUE, 3, start + n, b"ack %03d" % n) for n in range(3)]
    large: list[records.Framed] = []
    for n, body in enumerate(BODIES, start + 3):
        if n % 2:
            large.append(records.frame_parts(records.ENQUEUE, 3, n, [b"head", body]))
        else:
            large.append(records.frame(records.ENQUEUE, 3, n, body))
    after = [records.frame(records.DEQUEUE, 3, start + 9 + n, b"ack") for n in range(3)]
    return core.Append("tandem-0", 3, start, [*small, *large, *after])


def _joined(append: core.Append) -> list[bytes]:
    return [d if isinstance(d, bytes) else b"".join(d) for d in append.entries]


@pytest.mark.parametrize("cap", [20_000, 9_100, 1])
def test_a_large_append_goes_in_parts_a_receiver_takes_and_reads_as_one(
    monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    """An Append of more than APPEND_MESSAGE bytes of frames goes as APPEND_PART messages,
    then the APPEND_B, each at most that many bytes of frames or one larger frame: a
    transaction of eleven 100 MiB messages was one message over the 1 GiB a receiver takes,
    and the follower reconnected and took a copy at every commit. A follower reads them back
    as the one Append; one that does not take them gets the one message."""
    monkeypatch.setattr(wire, "APPEND_MESSAGE", cap)
    append = _large_append()
    parts = wire.encode_append(append, wire.TAKES)
    messages = _messages(b"".join(parts))
    assert [m[4] for m in messages] == [wire.APPEND_PART] * (len(messages) - 1) + [wire.APPEND_B]
    assert len(messages) > 1
    for data in messages:
        frames = wire.frames(data[wire.HEAD_SIZE + int.from_bytes(data[5:9], "big") :])
        assert sum(map(len, frames)) <= cap or len(frames) == 1
    as_parts = [d[-1] for d in append.entries if isinstance(d, list)]
    assert as_parts and all(b in BODIES for b in as_parts)
    assert all(any(p is body for p in parts) for body in as_parts)  # as they came, not copied
    whole = core.Append(append.sender, append.epoch, append.start, _joined(append))
    upstream = wire.Upstream()
    got = [upstream.take(m) for m in messages]
    assert got[:-1] == [None] * (len(messages) - 1)
    assert _same_append(got[-1], whole)
    assert upstream.take(wire.encode(whole, wire.TAKES)) is not None  # nothing left over
    before = wire.encode_append(append, (wire.APPEND_B, wire.ACK_B))  # a member from before
    assert _messages(b"".join(before))[0][4] == wire.APPEND_B
    assert _same_append(wire.decode(b"".join(before)), whole)  # one message, as before
    plain = wire.encode_append(append)  # a member from before APPEND_B
    assert len(plain) == 1 and _same_append(wire.decode(plain[0]), whole)
    with pytest.raises(wire.WireError):
        wire.decode(messages[0])  # a part alone, as a member from before reads it: refused


def test_an_append_of_up_to_the_limit_goes_as_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    append = _large_append()
    size = sum(map(records.framed_size, append.entries))
    monkeypatch.setattr(wire, "APPEND_MESSAGE", size)
    one = b"".join(wire.encode_append(append, wire.TAKES))
    assert one == wire.encode(append, wire.TAKES) and len(_messages(one)) == 1
    monkeypatch.setattr(wire, "APPEND_MESSAGE", size - 1)
    assert len(_messages(b"".join(wire.encode_append(append, wire.TAKES)))) == 2


@pytest.mark.parametrize("then", ["another append's part", "an ack", "another append"])
def test_the_parts_of_an_append_not_followed_by_its_end_end_the_link(
    monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A primary writes an Append's messages one after another: anything else between them
    is a broken stream, not a message to take with some of an Append's records."""
    monkeypatch.setattr(wire, "APPEND_MESSAGE", 20_000)
    first = _messages(b"".join(wire.encode_append(_large_append(), wire.TAKES)))[0]
    other = _large_append(60)
    after = {
        "another append's part": _messages(b"".join(wire.encode_append(other, wire.TAKES)))[0],
        "an ack": wire.encode(core.Ack("tandem-0", 3, (1, 1), 40), wire.TAKES),
        "another append": wire.encode(core.Append("tandem-0", 3, 60, FRAMES), wire.TAKES),
    }[then]
    upstream = wire.Upstream()
    assert upstream.take(first) is None
    with pytest.raises(wire.WireError, match="not followed by its end"):
        upstream.take(after)
    empty = wire._head(wire.APPEND_PART, first[wire.HEAD_SIZE : first.index(b"tandem-0") + 8], 0)
    upstream = wire.Upstream()
    assert upstream.take(empty) is None  # a part with no frames still begins an Append
    with pytest.raises(wire.WireError, match="not followed by its end"):
        upstream.take(after)


def test_a_primary_writes_a_large_append_in_parts_as_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower that takes APPEND_PART gets a large Append in parts, one that does not as
    one message; for the slow-reader limit the parts are one write, as that message is."""
    monkeypatch.setattr(wire, "APPEND_MESSAGE", 3_000)

    async def run() -> None:
        m, old, new, b = await old_and_new_followers()
        new.transport.unsent = 0  # the copy has left
        q = b.vhost("/").queues["q"]
        for _ in range(10):
            publish(q)  # 1,000-byte bodies: a few records to a part
        b.journal.when_done(lambda: None)
        m._flush()
        assert old.kinds() == [wire.SYNC, wire.APPEND]
        kinds = new.kinds()
        assert kinds[0] == wire.SYNC and kinds[-1] == wire.APPEND_B
        assert kinds[1:-1] == [wire.APPEND_PART] * (len(kinds) - 2) and len(kinds) > 3
        upstream = wire.Upstream()
        messages = _messages(new.data)[1:]
        got = [upstream.take(data) for data in messages][-1]
        assert _same_append(got, wire.decode(_last(old)))
        sent = sum(map(len, messages))
        assert new.link.largest_unsent() == sent  # the parts, counted as one write

    asyncio.run(run())


def test_a_large_body_is_shipped_as_it_came_not_joined_into_its_frame() -> None:
    """A record with a large body is kept and shipped as its parts, the body the one the
    client sent: joined for shipping, a transaction of eleven 100 MiB messages held the
    primary's loop for seconds. Followers old and new read the record whole."""
    from pamqp import commands

    from tandem.broker.model import message
    from tandem.broker.model.message import Message

    async def run() -> None:
        m, old, new, b = await old_and_new_followers()
        body = b"z" * (4 * records.BIG)
        props = commands.Basic.Properties(delivery_mode=2).marshal()
        msg = Message("", "q", message.encode_route("", "q"), props, body, len(body))
        message.scan(msg)
        b.vhost("/").queues["q"].enqueue(msg)
        b.journal.when_done(lambda: None)
        m._flush()
        kept = m.log.window[-1][1]
        assert isinstance(kept, list) and any(part is body for part in kept)
        for follower in (old, new):
            got = wire.decode(_last(follower))
            assert isinstance(got, core.Append)
            frame = got.entries[-1]
            assert frame == b"".join(kept) and records.problem_at(frame, 0) is None
            assert records.read_enqueue(records.payload(frame))[5] == body
        publish(b.vhost("/").queues["q"])  # a small body: its frame one buffer, as before
        m._flush(due=True)
        assert isinstance(m.log.window[-1][1], bytes)

    asyncio.run(run())
