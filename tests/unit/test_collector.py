"""The broker's garbage-collection policy (`tandem.broker.collector`)."""

from __future__ import annotations

import gc

from tandem.broker.collector import THAW_SECONDS, LongLived


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
