"""The deterministic simulation in CI: 4,500 schedules of crashes, lost disks, pauses, lost,
duplicated, delayed and reordered messages, each checked after every step and required to
recover once the faults stop. A failing seed prints the command that replays it.
SIMULATION_SCALE=3 runs three times as many schedules of each kind (seeds from 0 still)."""

from __future__ import annotations

import os

import pytest

from tests.simulation.world import Violation, World

SCALE = float(os.environ.get("SIMULATION_SCALE", "1"))


def _scaled(shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [(nodes, isr_min, max(1, round(n * SCALE))) for nodes, isr_min, n in shapes]


# (members, ISR minimum, schedules): 4,500 in all, about 50 seconds here.
SHAPES = _scaled([(3, 2, 2500), (4, 2, 700), (5, 3, 500), (3, 1, 400), (2, 1, 400)])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("nodes", "isr_min", "schedules"), SHAPES)
def test_schedules_keep_every_rule_and_recover(nodes: int, isr_min: int, schedules: int) -> None:
    failovers = confirmed = 0
    for seed in range(schedules):
        world = World(seed, nodes, isr_min)
        try:
            world.run()
        except Violation as exc:
            replay = f"python -m tests.simulation --seed {seed} --nodes {nodes} --isr-min {isr_min}"
            pytest.fail(f"seed {seed}: {exc}\nreplay with: {replay} --trace", pytrace=False)
        failovers += world.record.epoch - 1
        confirmed += len(world.confirmed)
    # The schedules must have exercised something: failovers and confirmed writes.
    assert failovers >= schedules and confirmed >= schedules


def test_a_broken_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation check: confirming without every ISR member's ack (rule 3) fails."""
    from tandem.ha import fencing

    monkeypatch.setattr(fencing, "may_confirm", lambda isr, acked, isr_min, tracking=(): True)
    with pytest.raises(Violation, match="rule 3"):
        for seed in range(200):
            World(seed).run()


def test_the_isr_minimum_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """... and confirming below the ISR minimum fails too (a lost disk then loses data)."""
    from tandem.ha import fencing

    def without_minimum(isr, acked, isr_min, tracking=frozenset()):  # type: ignore[no-untyped-def]
        return isr <= acked and tracking <= acked

    monkeypatch.setattr(fencing, "may_confirm", without_minimum)
    with pytest.raises(Violation, match="rule 3"):
        for seed in range(3000):
            World(seed).run()


def test_a_member_that_lost_volatile_records_is_not_a_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 4: a controller that takes a restarted member's position at its word, though the
    member lost the records it held only in memory, promotes it and loses confirmed ones."""
    from tandem.ha import decide

    monkeypatch.setattr(decide, "_none_whole_left", lambda view: True)
    monkeypatch.setattr(decide, "_lost_store", lambda m, epoch: m.answering and m.epoch < epoch)
    with pytest.raises(Violation, match="rule 4"):
        for seed in range(200):
            World(seed).run()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("nodes", "isr_min", "schedules"), _scaled([(3, 2, 800), (3, 1, 400)]))
def test_members_that_catch_up_by_difference_keep_every_confirmed_message(
    nodes: int, isr_min: int, schedules: int
) -> None:
    """Logs as the broker keeps them (never cut back; a diverged member takes the difference
    by message id): stale writes to a resumed old primary, its catch-up, and its promotion
    later lose no confirmed message."""
    diverged = 0
    for seed in range(schedules):
        world = World(seed, nodes, isr_min, messages=True)
        try:
            world.run()
        except Violation as exc:
            replay = f"python -m tests.simulation --seed {seed} --nodes {nodes} --messages"
            pytest.fail(f"seed {seed}: {exc}\nreplay with: {replay} --trace", pytrace=False)
        diverged += sum("difference" in line for line in world.trace)
    assert diverged > 0, "no schedule made a member catch up by difference"


def test_message_ids_by_offset_alone_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14's mutation check: ids by offset alone let a stale message pass for the
    confirmed one at the same offset of a later epoch, and the simulation says so."""
    from tests.simulation import world as world_mod

    monkeypatch.setattr(world_mod, "message_id", lambda epoch, offset: offset)
    with pytest.raises(Violation, match="confirmed message lost"):
        for seed in range(1000):
            World(seed, messages=True).run()


def test_a_brief_digest_trusted_past_where_the_logs_agree_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted member says in brief that it holds the persistent messages up to its
    log's end. A primary that took that at its word where its log and the member's part
    (the member was an old primary with records of its own) would not send the messages
    it lacks, and the simulation says so."""
    from tests.simulation import world as world_mod

    snapshot = world_mod.MessageLog.snapshot

    def trusting(log: world_mod.MessageLog, theirs: object = None, agree: int = 0) -> object:
        if isinstance(theirs, tuple):
            agree = theirs[1]
        return snapshot(log, theirs, agree)

    monkeypatch.setattr(world_mod.MessageLog, "snapshot", trusting)
    with pytest.raises(Violation, match="confirmed message lost"):
        for seed in range(1500):
            World(seed, messages=True).run()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("nodes", "isr_min", "schedules"), _scaled([(3, 2, 600), (5, 3, 300), (3, 1, 200)])
)
def test_scaling_down_and_up_keeps_every_rule(nodes: int, isr_min: int, schedules: int) -> None:
    """Issue 15: scale-down decided in `tandem.ha` (the primary hands over, the leaving
    members leave the ISR, never below the minimum for the members that stay), and scale-up
    (the minimum rises only as the ISR does), among the faults."""
    scaled = {"down": 0, "up": 0}
    for seed in range(schedules):
        world = World(seed, nodes, isr_min, scale=True)
        try:
            world.run()
        except Violation as exc:
            replay = f"python -m tests.simulation --seed {seed} --nodes {nodes} --scale"
            pytest.fail(f"seed {seed}: {exc}\nreplay with: {replay} --trace", pytrace=False)
        for way, count in world.scaled.items():
            scaled[way] += count
    assert scaled["down"] >= schedules and scaled["up"] >= schedules // 2, scaled


def test_a_scale_down_that_keeps_the_old_minimum_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15's problem 3: members gone, the minimum left as it was, and publishers wait
    forever. A record minimum that never falls is caught as a cluster that cannot recover."""
    from tandem.ha import decide

    monkeypatch.setattr(decide, "isr_min", lambda record, settings: record.isr_min or 2)
    with pytest.raises(Violation, match="no recovery"):
        for seed in range(300):
            World(seed, 3, 2, scale=True).run()
