"""The replication core's message handling, one rule at a time (the simulation checks them
together)."""

from __future__ import annotations

import pytest

from tandem.broker.replication import core
from tandem.ha.model import ElectionRecord, Role
from tests.simulation.world import EpochLog


@pytest.mark.parametrize(
    ("mine", "theirs", "agree"),
    [
        ([], [], 0),
        ([1, 1, 1], [], 0),
        ([1, 1, 1], [1, 1, 1, 1], 3),
        ([1, 1, 2, 2], [1, 1, 3], 2),  # diverged at offset 3
        ([1, 1, 2, 2, 2], [1, 1, 2, 4], 3),  # epoch 2 ended earlier in theirs
        ([1, 3, 3], [1, 2, 2, 3], 1),  # epoch 3 starts at different offsets
        ([2, 2], [1, 1], 0),
    ],
)
def test_agreement_by_epoch_boundaries(mine: list[int], theirs: list[int], agree: int) -> None:
    got = core.agreement(core.boundaries(mine), len(mine), core.boundaries(theirs), len(theirs))
    assert got == agree
    assert mine[:got] == theirs[:got]
    symmetric = core.agreement(
        core.boundaries(theirs), len(theirs), core.boundaries(mine), len(mine)
    )
    assert symmetric == agree


def pair() -> tuple[core.Replica, core.Replica]:
    """A primary `a` at epoch 2 with `b` following it, synced."""
    record = ElectionRecord("a", 2, frozenset("ab"), version=1)
    a = core.Replica("a", EpochLog(), epoch=2)
    b = core.Replica("b", EpochLog(), epoch=2, incarnation=1)
    a.control(core.Promote(record))
    ((_, hello),) = b.control(core.Follow("a", 2))
    ((_, sync),) = a.peer(hello)
    ((_, ack),) = b.peer(sync)
    a.peer(ack)
    return a, b


def test_a_record_is_confirmed_once_the_isr_has_it() -> None:
    a, b = pair()
    ((_, append),) = a.append()
    assert a.confirmed == 0
    ((_, ack),) = b.peer(append)
    a.peer(ack)
    assert a.confirmed == 1 and b.log == a.log == [2]


def test_the_primary_reports_the_confirmed_records_a_follower_has_not_acked() -> None:
    """`behind`, which the controller tracks a catching-up member by (decide._near): None
    until the follower acked over its connection; once tracked, it holds back the confirms
    until it has acked them (rule 3), and it is caught up."""
    a, b = pair()
    c = core.Replica("c", EpochLog(), epoch=2, incarnation=1)
    ((_, hello),) = c.control(core.Follow("a", 2))
    ((_, sync),) = a.peer(hello)
    assert a.report("c") == (False, False, 0, None)  # joined, nothing acked yet
    ((_, ack),) = c.peer(sync)
    a.peer(ack)
    appends = [dict(a.append()) for _ in range(5)]
    for out in appends:
        ((_, ack),) = b.peer(out["b"])
        a.peer(ack)
    for out in appends[:2]:
        ((_, ack),) = c.peer(out["c"])
        a.peer(ack)
    assert a.confirmed == 5
    assert a.report("c") == (False, False, 3, 3)
    a.control(core.Inform(ElectionRecord("a", 2, frozenset("ab"), 2, frozenset("c"))))
    more = dict(a.append())
    ((_, ack),) = b.peer(more["b"])
    a.peer(ack)
    assert a.confirmed == 5  # the sixth waits for c
    for out in [*appends[2:], more]:
        ((_, ack),) = c.peer(out["c"])
        a.peer(ack)
    assert a.confirmed == 6 and a.report("c") == (True, True, 0, 0)


def test_a_late_sync_cannot_truncate_a_follower() -> None:
    _, b = pair()
    late = core.Sync("a", 2, (1, 0), 0, ())
    for _ in range(3):
        b.peer(core.Append("a", 2, len(b.log) + 1, (2,)))
    assert b.peer(late) == [] and b.log == [2, 2, 2]


def test_a_lower_epoch_is_refused_and_a_higher_one_steps_the_primary_down() -> None:
    a, b = pair()
    assert b.peer(core.Append("x", 1, 1, (1,))) == [("x", core.Stale("b", 2))]
    a.peer(core.Stale("b", 3))
    assert a.role is Role.BACKUP and a.epoch == 3


def test_an_ack_over_a_closed_connection_asks_to_rejoin() -> None:
    a, b = pair()
    a.disconnected("b")
    ((_, ack),) = b.tick()  # b repeats its ack
    assert a.peer(ack) == [("b", core.Rejoin("a", 2))]
    ((dest, hello),) = b.peer(core.Rejoin("a", 2))
    assert dest == "a" and isinstance(hello, core.Hello)


def test_a_repeated_promotion_keeps_the_followers() -> None:
    a, _ = pair()
    a.control(core.Promote(ElectionRecord("a", 2, frozenset("ab"), version=1)))
    assert "b" in a.peers and a.role is Role.PRIMARY


def test_below_the_isr_minimum_the_primary_takes_no_writes() -> None:
    a = core.Replica("a", EpochLog(), epoch=2)
    a.control(core.Promote(ElectionRecord("a", 2, frozenset("a"), version=1)))
    assert not a.accepting
    a.isr_min = 1
    assert a.accepting


class BriefLog(EpochLog):
    """A log whose digest can be brief, and whose copy cannot be made from it past
    `usable` (as the broker's, past what its window holds)."""

    usable = True
    digests: list[bool]
    copied_from: object = None

    def digest(self, brief: bool = False) -> object:
        self.digests.append(brief)
        return "brief" if brief else "whole"

    def snapshot(self, theirs: object = None, agree: int = 0) -> object:
        if theirs == "brief" and not self.usable:
            return None
        self.copied_from = theirs
        return tuple(self)


@pytest.mark.parametrize("usable", [True, False])
def test_a_brief_digest_the_primary_cannot_use_is_asked_for_in_full(usable: bool) -> None:
    """A restarted follower says what it holds in brief; a primary that can make the copy
    from that does, one that cannot answers Detail, and the follower's next Hello carries
    its whole digest (and its Hellos after a copy are brief again)."""
    record = ElectionRecord("a", 2, frozenset("ab"), version=1)
    primary_log, follower_log = BriefLog([2, 2]), BriefLog([2])
    primary_log.digests, follower_log.digests = [], []
    primary_log.usable = usable
    follower_log.lost = True
    a = core.Replica("a", primary_log, epoch=2)
    b = core.Replica("b", follower_log, epoch=2, incarnation=1)
    a.control(core.Promote(record))
    ((_, hello),) = b.control(core.Follow("a", 2))
    assert hello.digest == "brief"
    ((_, answer),) = a.peer(hello)
    if not usable:
        assert answer == core.Detail("a", 2, hello.session)
        assert b.peer(core.Detail("a", 2, (1, 0))) == []  # of an earlier attempt
        ((_, hello),) = b.peer(answer)
        assert hello.digest == "whole" and hello.session > answer.session
        assert b.tick() == [("a", hello)]  # repeated as it was
        ((_, answer),) = a.peer(hello)
    assert isinstance(answer, core.Sync) and answer.full == (2, 2)
    assert primary_log.copied_from == hello.digest
    ((_, ack),) = b.peer(answer)
    assert isinstance(ack, core.Ack) and b.synced and not b.detailed
    b.control(core.Follow("a", 2))
    assert follower_log.digests[-1] is True
