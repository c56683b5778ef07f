"""A replication connection's protocol (replication/link.py): whatever the reads' sizes, the
handshake reads and the callback after it get every message whole, once and in order; a bad
length or a callback's error ends the connection with that error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.broker.replication import core, wire
from tandem.broker.replication.link import HANDSHAKE_BYTES, SLICE_SECONDS, Link
from tests.unit.test_member_copy import Transport


def _messages(count: int, sizes: list[int]) -> list[bytes]:
    return [
        wire.pack(wire.CHALLENGE, {"n": n}, [bytes([n % 251]) * sizes[n % len(sizes)]])
        for n in range(count)
    ]


def _opened() -> tuple[Link, Transport]:
    link, transport = Link(), Transport()
    link.connection_made(transport)  # type: ignore[arg-type]
    return link, transport


async def _serving() -> tuple[Link, Transport, list[bytes], asyncio.Task[None]]:
    """A link past its handshake: what it hands on, and the task serving it."""
    link, transport = _opened()
    got: list[bytes] = []
    serving = asyncio.create_task(link.serve(got.append))
    await asyncio.sleep(0)  # serve has begun
    return link, transport, got, serving


@settings(max_examples=100, deadline=None)
@given(
    count=st.integers(1, 12),
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    handshake=st.integers(0, 3),
    reads=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
)
def test_messages_arrive_whole_and_in_order_whatever_the_reads(
    count: int, sizes: list[int], handshake: int, reads: list[int]
) -> None:
    sent = _messages(count, sizes)
    data = b"".join(sent)

    async def run() -> list[bytes]:
        link, _ = _opened()
        got: list[bytes] = []

        async def far_end() -> None:
            pos, i = 0, 0
            while pos < len(data):
                n = reads[i % len(reads)]
                link.data_received(data[pos : pos + n])
                pos, i = pos + n, i + 1
                await asyncio.sleep(0)
            link.connection_lost(None)

        feeding = asyncio.create_task(far_end())
        for _ in range(min(handshake, count)):
            got.append(await link.read())
        with pytest.raises(ConnectionError):
            await link.serve(got.append)
        await feeding
        with pytest.raises(ConnectionError):
            await link.read()  # ended: a read says so rather than waiting
        return got

    assert asyncio.run(run()) == sent


def test_a_bad_length_ends_the_connection_and_nothing_after_it_is_taken() -> None:
    async def run() -> None:
        link, transport, got, serving = await _serving()
        good = wire.encode(core.Ack("b", 1, (5, 1), 9), wire.TAKES)
        link.data_received(good + (3).to_bytes(4, "big") + good)
        with pytest.raises(wire.WireError, match="bad message length 3"):
            await serving
        assert got == [good] and transport.aborted
        link.data_received(good)  # what the transport still hands in is not read
        assert got == [good]

    asyncio.run(run())


def test_a_callbacks_error_ends_the_connection_with_that_error() -> None:
    async def run() -> None:
        link, transport = _opened()
        taken: list[core.PeerMessage] = []

        def take(data: bytes) -> None:
            taken.append(wire.decode(data))

        good = wire.encode(core.Ack("b", 1, (5, 1), 9))
        link.data_received(good + good[:4] + bytes([wire.ACK]) + good[5:-2] + b"}}")
        with pytest.raises(wire.WireError, match="bad message header"):
            await link.serve(take)  # the messages read before serve are taken first
        assert len(taken) == 1 and transport.aborted

    asyncio.run(run())


def test_a_connection_lost_mid_message_ends_a_read() -> None:
    async def run() -> None:
        link, _ = _opened()
        reading = asyncio.create_task(link.read())
        link.data_received(wire.pack(wire.CHALLENGE, {"node": "a"})[:-1])
        await asyncio.sleep(0)
        assert not reading.done()
        link.connection_lost(OSError("reset"))
        with pytest.raises(OSError, match="reset"):
            await reading

    asyncio.run(run())


def test_before_the_handshake_ends_a_message_may_not_be_large() -> None:
    """A peer that has not yet proved the cluster key is owed no more memory than a
    challenge or an answer takes; after it, a message may be as large as a copy's."""

    async def run() -> None:
        link, transport = _opened()
        big = wire.pack(wire.CHALLENGE, {}, [b"x" * (HANDSHAKE_BYTES + 1)])
        link.data_received(big[:1000])
        with pytest.raises(wire.WireError, match="a handshake message of"):
            await link.read()
        assert transport.aborted

        link, transport, got, serving = await _serving()
        link.data_received(big)
        link.connection_lost(None)
        with pytest.raises(ConnectionError):
            await serving
        assert got == [big] and not transport.aborted

    asyncio.run(run())


def test_what_arrives_after_this_end_closed_is_not_handed_on() -> None:
    async def run() -> None:
        link, _, got, serving = await _serving()
        message = wire.pack(wire.CHALLENGE, {"n": 1})
        link.data_received(message)
        link.close()
        link.data_received(message)
        with pytest.raises(ConnectionAbortedError):
            await serving
        assert got == [message]

    asyncio.run(run())


def test_messages_read_before_the_end_are_handed_on_before_it_is_said() -> None:
    async def run() -> None:
        link, _ = _opened()
        messages = _messages(3, [10])
        link.data_received(b"".join(messages))
        link.connection_lost(None)
        got: list[bytes] = []
        with pytest.raises(ConnectionResetError):
            await link.serve(got.append)
        assert got == messages

    asyncio.run(run())


def test_a_peer_silent_in_the_handshake_is_closed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection to the replication port that never answers the challenge does not hold
    a socket and a task for good."""
    from tandem.broker.replication import member
    from tests.unit.test_member_copy import primary_with_follower

    monkeypatch.setattr(member, "HANDSHAKE_SECONDS", 0.05)

    async def run() -> None:
        m, _, _ = primary_with_follower()
        link, transport = Link(m._opened), Transport()
        link.connection_made(transport)  # type: ignore[arg-type]
        (task,) = m.accepted
        await asyncio.wait_for(task, 5)
        assert wire.split(transport.data) is not None  # the challenge went out
        assert transport.aborted  # closed
        assert "no answer to the challenge within" in caplog.text

    asyncio.run(run())


def _slow(got: list[bytes]) -> Callable[[bytes], None]:
    """A handler that takes longer than a slice with each message (a backup applying a
    large append)."""

    def take(message: bytes) -> None:
        time.sleep(SLICE_SECONDS * 1.5)
        got.append(message)

    return take


def test_a_read_that_takes_longer_than_a_slice_goes_on_in_later_turns() -> None:
    """Issue 16: a lagging backup applied a whole 256 KiB read in one turn (60-75 ms), and
    its answers to the controller's polls waited several such turns. Past a slice, reading
    is paused and the rest goes on in the next turn, in order, then reading resumes."""

    async def run() -> None:
        link, transport = _opened()
        got: list[bytes] = []
        serving = asyncio.create_task(link.serve(_slow(got)))
        await asyncio.sleep(0)  # serve has begun
        messages = _messages(3, [10])
        link.data_received(b"".join(messages))
        assert got == messages[:1] and not transport.reading
        await asyncio.sleep(0)  # the next turn
        assert got == messages[:2] and not transport.reading
        await asyncio.sleep(0)
        assert got == messages and transport.reading
        link.close()
        with pytest.raises(ConnectionAbortedError):
            await serving

    asyncio.run(run())


def test_messages_read_before_an_end_that_came_during_a_rest_are_handed_on() -> None:
    """Over TLS the peer's close is read though reading is paused: what was whole in the
    buffer was received, and is handed on before the end is said."""

    async def run() -> None:
        link, _transport = _opened()
        got: list[bytes] = []
        serving = asyncio.create_task(link.serve(_slow(got)))
        await asyncio.sleep(0)
        messages = _messages(3, [10])
        link.data_received(b"".join(messages))
        assert got == messages[:1]
        link.connection_lost(None)
        with pytest.raises(ConnectionResetError):
            await serving
        assert got == messages

    asyncio.run(run())
