"""The replication messages sent once per batch of records: APPEND and ACK with JSON headers
for a peer that reads only those, APPEND_B and ACK_B with packed ones for a peer that says it
takes them (replication/wire.py)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.broker.model import records
from tandem.broker.replication import core, wire
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


def test_a_primary_sends_a_follower_the_kinds_it_said_it_takes() -> None:
    """The same batch goes packed to a follower that takes APPEND_B and as JSON to one that
    said nothing: a cluster mid-upgrade keeps replicating."""

    async def run() -> None:
        m, old, b = primary_with_follower()
        new = Follower()
        new.link.takes = wire.TAKES
        m.peers["c"] = new.link
        for node in ("b", "c"):
            m.on_peer(core.Hello(node, 1, (5, 1), (), 0, False, None))
            await m.copying[node].made
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
