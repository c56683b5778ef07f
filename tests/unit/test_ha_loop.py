"""The controller loop through its ports, with in-memory fakes of the store, the members and
the clock: no sockets, no processes, no sleeps."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import replace

import pytest

from tandem.ha.decide import Action
from tandem.ha.loop import BUG, REPEAT_SECONDS, Controller
from tandem.ha.model import ElectionRecord, Liveness, Member, Position, Role, Settings
from tandem.ha.ports import Unavailable


class Store:
    def __init__(self, record: ElectionRecord) -> None:
        self.record = record
        self.rival: ElectionRecord | None = None  # a write another controller slips in

    async def read(self) -> ElectionRecord:
        return self.record

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        if self.rival is not None:
            self.record, self.rival = self.rival, None
        if self.record.version != expected.version:
            return None
        self.record = replace(new, version=expected.version + 1)
        return self.record


class Cluster:
    """Members that obey the actuator's commands as brokers would."""

    def __init__(self, members: list[Member]) -> None:
        self.members = {m.node: m for m in members}
        self.calls: list[tuple[str, ...]] = []
        self.fail_next_observe = False
        self.unavailable_next_observe = False

    async def observe(self, record: ElectionRecord) -> tuple[Member, ...]:
        if self.fail_next_observe:
            self.fail_next_observe = False
            raise RuntimeError("observer broke")
        if self.unavailable_next_observe:
            self.unavailable_next_observe = False
            raise Unavailable("the API server did not answer")
        return tuple(self.members.values())

    def _set(self, node: str, **changes: object) -> None:
        self.members[node] = replace(self.members[node], **changes)  # type: ignore[arg-type]

    async def fence(self, node: str, epoch: int) -> None:
        self.calls.append(("fence", node, str(epoch)))
        role = Role.BACKUP  # a fenced primary stops serving
        self._set(node, epoch=epoch, role=role, following=None)

    async def promote(self, node: str, record: ElectionRecord) -> None:
        self.calls.append(("promote", node, str(record.epoch)))
        self._set(
            node,
            role=Role.PRIMARY,
            epoch=record.epoch,
            following=None,
            applied_version=record.version,
        )

    async def follow(self, node: str, primary: str, epoch: int) -> None:
        self.calls.append(("follow", node, primary))
        self._set(node, role=Role.BACKUP, epoch=epoch, following=primary)

    async def set_isr(self, primary: str, record: ElectionRecord, why: str = "") -> None:
        self.calls.append(("set_isr", primary, ",".join(sorted(record.isr))))
        self._set(primary, applied_version=record.version)

    async def renew(self, primary: str, record: ElectionRecord) -> None:
        self.calls.append(("renew", primary))
        self._set(primary, applied_version=record.version)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def healthy() -> tuple[Store, Cluster]:
    record = ElectionRecord("a", 3, frozenset("abc"), version=7, isr_min=Settings().isr_min)
    cluster = Cluster(
        [
            Member("a", Liveness.UP, Role.PRIMARY, 3, Position(3, 10), applied_version=7),
            Member("b", Liveness.UP, Role.BACKUP, 3, Position(3, 10), following="a"),
            Member("c", Liveness.UP, Role.BACKUP, 3, Position(3, 9), following="a"),
        ]
    )
    return Store(record), cluster


def controller(store: Store, cluster: Cluster) -> Controller:
    return Controller("demo", store, cluster, cluster, Clock(), Settings())


async def turns_until_hold(c: Controller, limit: int = 10) -> list[Action]:
    actions = []
    for _ in range(limit):
        d = await c.turn()
        actions.append(d.action)
        if d.action is Action.HOLD:
            return actions
    raise AssertionError(f"no HOLD after {limit} turns: {actions}")


def test_a_dead_primary_is_replaced_in_three_turns() -> None:
    store, cluster = healthy()
    cluster._set("a", liveness=Liveness.DOWN)
    actions = asyncio.run(turns_until_hold(controller(store, cluster)))
    assert actions == [Action.FENCE, Action.PROMOTE, Action.HOLD]
    assert store.record.holder == "b" and store.record.epoch == 4
    assert store.record.isr == frozenset("bc") and store.record.version == 8
    assert ("follow", "c", "b") in cluster.calls
    assert cluster.calls[-1] == ("renew", "b")


def test_a_lost_compare_and_set_promotes_nobody() -> None:
    store, cluster = healthy()
    cluster._set("a", liveness=Liveness.DOWN)
    c = controller(store, cluster)
    assert asyncio.run(c.turn()).action is Action.FENCE
    store.rival = replace(store.record, version=99)  # another controller wrote meanwhile
    assert asyncio.run(c.turn()).action is Action.PROMOTE
    assert not any(call[0] == "promote" for call in cluster.calls)
    assert store.record.holder == "a"  # the rival's record stands; the next turn reads it
    asyncio.run(turns_until_hold(c))
    assert store.record.holder == "b" and store.record.version == 100


def test_switchover_fences_the_old_primary_and_clears_once_done() -> None:
    store, cluster = healthy()
    c = controller(store, cluster)
    c.switchover_to = "c"
    actions = asyncio.run(turns_until_hold(c))
    assert actions == [Action.FENCE, Action.PROMOTE, Action.HOLD]
    assert ("fence", "a", "4") in cluster.calls
    assert store.record.holder == "c" and c.switchover_to is None
    assert ("follow", "a", "c") in cluster.calls


def test_shrink_writes_the_record_before_telling_the_primary() -> None:
    store, cluster = healthy()
    cluster._set("c", liveness=Liveness.DOWN)
    c = controller(store, cluster)
    assert asyncio.run(c.turn()).action is Action.SHRINK_ISR
    assert store.record.isr == frozenset("ab")
    assert cluster.calls == [("set_isr", "a", "a,b")]


def test_a_member_joins_the_isr_only_after_the_primary_waits_for_it() -> None:
    store, cluster = healthy()
    store.record = replace(store.record, isr=frozenset("ab"))
    cluster._set("c", caught_up=True)
    c = controller(store, cluster)
    assert asyncio.run(c.turn()).action is Action.TRACK
    assert store.record.tracking == {"c"} and store.record.isr == {"a", "b"}
    # The primary applied the record but does not report waiting for c yet: no grow.
    assert asyncio.run(c.turn()).action is Action.HOLD
    cluster._set("c", waited=True)
    assert asyncio.run(c.turn()).action is Action.GROW_ISR
    assert store.record.isr == frozenset("abc") and not store.record.tracking


def test_an_unexpected_error_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, cluster = healthy()
    cluster.fail_next_observe = True
    c = controller(store, cluster)

    class StopAfter:
        def __init__(self, turns: int) -> None:
            self.left = turns

        def is_set(self) -> bool:
            self.left -= 1
            return self.left < 0

    with caplog.at_level(logging.ERROR):
        asyncio.run(c.run(StopAfter(3)))
    assert BUG in caplog.text and "observer broke" in caplog.text
    assert ("renew", "a") in cluster.calls  # the turns after the error went on
    assert c.clock.monotonic() == pytest.approx(0.3)  # it slept between turns, on its clock


def test_a_paused_controller_decides_but_fails_nobody_over() -> None:
    store, cluster = healthy()
    cluster._set("a", liveness=Liveness.DOWN)
    c = controller(store, cluster)
    c.paused = True
    for _ in range(3):
        assert asyncio.run(c.turn()).action is Action.FENCE
    assert cluster.calls == [] and store.record.holder == "a" and store.record.version == 7
    c.paused = False
    asyncio.run(turns_until_hold(c))
    assert store.record.holder == "b"


def test_an_unreachable_world_is_a_warning_not_a_bug(caplog: pytest.LogCaptureFixture) -> None:
    store, cluster = healthy()
    cluster.unavailable_next_observe = True
    c = controller(store, cluster)
    turns = iter([False, False, True])
    with caplog.at_level(logging.WARNING):
        asyncio.run(c.run(type("Stop", (), {"is_set": lambda self: next(turns)})()))
    assert "did not answer" in caplog.text and BUG not in caplog.text
    assert ("renew", "a") in cluster.calls


def test_a_port_unavailable_for_the_same_reason_is_said_again_only_now_and_then(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A data dir deleted under a running cluster made the controller log every 0.1 s."""

    class Gone(Store):
        reason = "the cluster's data directory /d is gone"

        async def read(self) -> ElectionRecord:
            raise Unavailable(self.reason)

    store, cluster = healthy()
    gone = Gone(store.record)
    c = Controller("demo", gone, cluster, cluster, Clock(), Settings())
    turns = int(REPEAT_SECONDS / c.poll_interval) * 2 + 5  # two and a bit repeat periods
    left = iter(range(turns, -1, -1))
    with caplog.at_level(logging.WARNING):
        asyncio.run(c.run(type("Stop", (), {"is_set": lambda self: next(left) == 0})()))
    said = [r.getMessage() for r in caplog.records if "/d is gone" in r.getMessage()]
    assert len(said) == 3, said
    assert re.search(r"still, 30\d turns since", said[1]), said[1]
    gone.reason = "something else"
    asyncio.run(c.run(type("Stop", (), {"is_set": iter([False, True]).__next__})()))
    assert "something else" in caplog.records[-1].getMessage()
    assert BUG not in caplog.text


def test_a_reason_that_comes_back_after_a_good_turn_is_said_again_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, cluster = healthy()
    c = controller(store, cluster)
    once = [True, False, True]  # unavailable, a good turn, unavailable again
    turns = iter([False, False, False, True])

    async def observe(record: ElectionRecord) -> tuple[Member, ...]:
        if once.pop(0):
            raise Unavailable("the API server did not answer")
        return tuple(cluster.members.values())

    cluster.observe = observe  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        asyncio.run(c.run(type("Stop", (), {"is_set": lambda self: next(turns)})()))
    said = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(said) == 2 and "still" not in said[1], said


def test_a_changed_isr_minimum_is_written_to_the_record_and_sent_to_the_primary() -> None:
    """Issue 15: the minimum travels in the election record, so the brokers take a change of
    it (a spec edit, a scale to one member) without a restart, and agree with the controller."""
    store, cluster = healthy()
    c = Controller("demo", store, cluster, cluster, Clock(), Settings(isr_min=1))
    d = asyncio.run(c.turn())
    assert d.action is Action.SET_MIN and "ISR minimum is 1 (the record says 2)" in d.reason
    assert store.record.isr_min == 1 and store.record.isr == frozenset("abc")
    assert ("set_isr", "a", "a,b,c") in cluster.calls
    assert asyncio.run(c.turn()).action is Action.HOLD  # once written, nothing more to do


def test_a_record_written_after_a_scale_up_keeps_the_minimum_its_isr_reaches() -> None:
    """Found by the simulation's scale-ups: every record write stamped the settings' minimum,
    so tracking a new member raised it to 2 while the ISR was the primary alone, and every
    publisher waited until the new member was in sync."""
    store, cluster = healthy()
    store.record = replace(store.record, isr=frozenset("a"), isr_min=1)
    cluster._set("b", caught_up=True)
    c = controller(store, cluster)  # the settings' minimum is 2 again
    assert asyncio.run(c.turn()).action is Action.TRACK
    assert store.record.tracking == {"b"} and store.record.isr_min == 1


def test_a_rolling_upgrade_restarts_through_the_restarter_one_member_at_a_time() -> None:
    store, cluster = healthy()
    restarted: list[str] = []

    class Restarter:
        async def restart(self, node: str, why: str) -> None:
            restarted.append(node)
            cluster._set(node, liveness=Liveness.DOWN)  # its pod goes

    c = controller(store, cluster)
    c.restarter, c.stale = Restarter(), frozenset("abc")
    d = asyncio.run(c.turn())
    assert d.action is Action.RESTART and restarted == ["b"] and "backup b" in d.reason
    # b is not running: nothing more until it is back, in sync, on the new revision.
    assert asyncio.run(c.turn()).action is Action.SHRINK_ISR  # b is down: out of the ISR
    assert restarted == ["b"]
    c.paused = True
    cluster._set("b", liveness=Liveness.UP)
    store.record = replace(store.record, isr=frozenset("abc"))
    c.stale = frozenset("ac")
    assert asyncio.run(c.turn()).action is Action.RESTART  # decided, but paused: not done
    assert restarted == ["b"]
