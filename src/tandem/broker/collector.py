"""Python's cyclic garbage collector, for a process that holds millions of messages.

A full collection (generation 2) walks every tracked object, and each queued message is one:
under ten publishers a primary with 600,000 messages queued paused up to 0.38 s per full
collection and freed nothing, long enough, with a busy loop, to miss its controller's polls
and be failed over. Messages and the other long-lived objects hold no reference cycles on
the hot path; what dies in a cycle (a closed connection's objects, say) mostly dies young.

So the survivors of each full collection are frozen (`gc.freeze`): later full collections
walk only what came since. Every THAW_SECONDS the frozen objects are handed back, and the
next full collection walks everything once, freeing any cycle that died among them; but only
while they are fewer than THAW_MAX_FROZEN and the node says it is `quiet` (its queues hold
few messages: a walk visits every entry of the indexes and every slot of the queues, which
the count of frozen objects does not show). A full walk with millions of messages queued
takes seconds, long enough for a controller to fail a primary over: the few cycles that die
among long-lived objects (a long-lived connection's, once closed) wait until the queues are
shallower.

Which makes a cycle on the hot path a leak. A backup's written batches, each held by a cycle
through its ack's callback, lived on with every record they held, and a backup under load
grew by 30 MB a second (issue 16). tests/unit/test_member_copy.py runs a primary and a backup
with the collector off and finds nothing for it to free.

Counting the frozen objects is itself a walk (`gc.get_freeze_count` follows a linked list of
all of them): 0.3 s with ten million, and it ran after every full collection once
THAW_SECONDS had passed, which made saturated runs fail over ten minutes in
(docs/performance.md). It is asked only once the node is quiet, and then at most every
RECHECK_SECONDS.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

THAW_SECONDS = 600.0
THAW_MAX_FROZEN = 500_000  # objects: a walk of all of them takes about 0.2 s
RECHECK_SECONDS = 10.0  # quiet, but too many frozen: count them again after this long


class LongLived:
    """A `gc.callbacks` entry: freeze after each full collection, thaw now and then."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_frozen: int = THAW_MAX_FROZEN
    ) -> None:
        self.clock = clock
        self.max_frozen = max_frozen
        self.quiet: Callable[[], bool] = lambda: True  # the node's say (Node.quiet)
        self.next_look = clock() + THAW_SECONDS

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = self.clock()
        if now >= self.next_look and self.quiet():
            if gc.get_freeze_count() <= self.max_frozen:  # a walk: only when quiet
                self.next_look = now + THAW_SECONDS
                gc.unfreeze()  # the next full collection walks everything
                return
            self.next_look = now + RECHECK_SECONDS
        gc.freeze()


def install() -> LongLived:
    """For the broker's process: from now on, full collections walk only new objects."""
    policy = LongLived()
    gc.callbacks.append(policy)
    return policy
