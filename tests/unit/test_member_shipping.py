"""When a primary ships its records (replication/member.py): at once what a confirm or a
reply waits for, with everything before it; what nothing waits for yet (a consumer's acks,
delivery marks, publishes without confirms) with the next that something does, or after
LAZY_SECONDS. The follower's connection is a recording writer; everything else is real."""

from __future__ import annotations

import asyncio

from tandem.broker.model.broker import Broker
from tandem.broker.model.journal import Sequencer
from tandem.broker.replication import core, member, wire
from tests.unit.test_member_copy import Follower, copy_made, primary_with_follower, publish


async def synced_follower() -> tuple[member.Member, Follower, Broker]:
    m, follower, b = primary_with_follower()
    m.on_peer(core.Hello("b", 1, (5, 1), (), 0, False, None))
    await copy_made(m)
    assert follower.kinds() == [wire.SYNC]
    return m, follower, b


def test_what_nothing_waits_for_goes_with_the_next_that_something_does() -> None:
    async def run() -> None:
        m, follower, b = await synced_follower()
        q = b.vhost("/").queues["q"]
        publish(q)  # nobody waits for it
        m._flush()
        assert follower.kinds() == [wire.SYNC] and m.lazy is not None
        publish(q)
        confirmed = asyncio.get_running_loop().create_future()
        b.journal.when_done(lambda: confirmed.set_result(None))  # a confirm waits for it
        m._flush()
        assert follower.kinds() == [wire.SYNC, wire.APPEND]  # both records, in one
        assert m.shipped == m.sequencer.offset and not m.pending and m.lazy is None
        assert confirmed.done()  # an ISR of the primary alone: held once shipped

    asyncio.run(run())


def test_what_nothing_waits_for_goes_within_the_lazy_delay() -> None:
    async def run() -> None:
        m, follower, b = await synced_follower()
        sent = asyncio.get_running_loop().create_future()
        write = follower.transport.write

        def recorded(data: bytes) -> None:
            write(data)
            if not sent.done():
                sent.set_result(None)

        follower.transport.write = recorded  # type: ignore[method-assign]
        publish(b.vhost("/").queues["q"])
        m._flush()
        assert follower.kinds() == [wire.SYNC]
        await asyncio.wait_for(sent, 10 * member.LAZY_SECONDS + 5)  # no flush but the timer's
        assert follower.kinds() == [wire.SYNC, wire.APPEND] and m.lazy is None

    asyncio.run(run())


def test_a_primary_that_steps_down_drops_what_it_held_back() -> None:
    async def run() -> None:
        m, follower, b = await synced_follower()
        publish(b.vhost("/").queues["q"])
        m._flush()
        assert m.lazy is not None
        m.fence(2)  # a higher epoch: it is a primary no more
        assert m.lazy is None and not m.pending and m.shipped == 0
        assert follower.kinds() == [wire.SYNC]

    asyncio.run(run())


class Shipped:
    """A shipper whose followers hold everything up to offset 5."""

    held = 5

    def ship(self, data: bytes, offset: int) -> None: ...
    def soon(self) -> None: ...


def test_a_waiter_after_a_copy_took_the_log_back_needs_nothing_past_its_end() -> None:
    """A member that shipped up to offset 10 as primary, then as a backup took a full copy
    of a log ending at 5, and is promoted again: a reply waits for what the log holds, not
    for offsets that a new record must first reach."""
    seq = Sequencer()
    seq.offset = seq.last_shipped = 10
    seq.reset(((2, 1),), 5)
    seq.begin_term(3)
    seq.shipper = Shipped()
    called: list[bool] = []
    seq.when_done(lambda: called.append(True))
    assert called == [True]
