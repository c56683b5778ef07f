"""The broker's garbage-collection policy (`tandem.broker.collector`)."""

from __future__ import annotations

import gc

import pytest

from tandem.broker.collector import RECHECK_SECONDS, THAW_SECONDS, LongLived


def test_full_collections_freeze_their_survivors_and_a_thaw_comes_now_and_then() -> None:
    now = [0.0]
    policy = LongLived(lambda: now[0])
    kept = [object() for _ in range(10)]  # survivors of some collection
    try:
        gc.unfreeze()
        policy("stop", {"generation": 1, "collected": 0})
        assert gc.get_freeze_count() == 0  # a young collection changes nothing
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() > 0  # later full collections skip them
        now[0] = THAW_SECONDS
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() == 0  # the next one walks everything again
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        del kept


def test_no_thaw_while_the_frozen_objects_are_many() -> None:
    """A walk of everything with millions of messages queued held a primary for 3 s: the
    thaw waits until fewer objects are frozen."""
    now = [0.0]
    kept = [object() for _ in range(10)]
    try:
        gc.unfreeze()
        policy = LongLived(lambda: now[0], max_frozen=0)  # anything frozen is too much
        policy("stop", {"generation": 2, "collected": 0})
        frozen = gc.get_freeze_count()
        assert frozen > 0
        now[0] = THAW_SECONDS
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() >= frozen  # still frozen: no walk of everything
        policy.max_frozen = gc.get_freeze_count()  # the queues drained
        now[0] += RECHECK_SECONDS  # counted again only after a while
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        del kept


def test_no_thaw_while_the_node_is_not_quiet() -> None:
    """The count of frozen objects does not show what a walk visits (every index entry and
    queue slot): the node says when its queues are shallow enough."""
    now = [0.0]
    kept = [object() for _ in range(10)]
    busy = [True]
    try:
        gc.unfreeze()
        policy = LongLived(lambda: now[0])
        policy.quiet = lambda: not busy[0]
        policy("stop", {"generation": 2, "collected": 0})
        now[0] = THAW_SECONDS
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() > 0  # many messages queued: no walk of everything
        busy[0] = False
        policy("stop", {"generation": 2, "collected": 0})
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        del kept


def test_the_frozen_objects_are_counted_only_when_quiet_and_then_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counting them walks them all (0.3 s with ten million): asked after every full
    collection once THAW_SECONDS had passed, it failed saturated runs over ten minutes in."""
    now = [0.0]
    counted = []
    real_count = gc.get_freeze_count

    def count() -> int:
        counted.append(now[0])
        return real_count()

    monkeypatch.setattr(gc, "get_freeze_count", count)
    busy = [True]
    kept = [object() for _ in range(10)]
    try:
        gc.unfreeze()
        policy = LongLived(lambda: now[0], max_frozen=0)
        policy.quiet = lambda: not busy[0]
        for step in range(100):  # busy for a long while: full collections, no count
            now[0] = THAW_SECONDS * step / 10
            policy("stop", {"generation": 2, "collected": 0})
        assert counted == [] and real_count() > 0
        busy[0] = False
        start = now[0]
        for step in range(100):  # quiet, too many frozen: counted every RECHECK_SECONDS
            now[0] = start + RECHECK_SECONDS * step / 10
            policy("stop", {"generation": 2, "collected": 0})
        assert len(counted) == 10 and real_count() > 0
        policy.max_frozen = real_count()
        now[0] += RECHECK_SECONDS
        policy("stop", {"generation": 2, "collected": 0})
        assert real_count() == 0  # few enough now: thawed
    finally:
        gc.unfreeze()
        del kept
