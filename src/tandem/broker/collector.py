"""Python's cyclic garbage collector, for a process that holds millions of messages.

A full collection (generation 2) walks every tracked object, and each queued message is one:
under ten publishers a primary with 600,000 messages queued paused up to 0.38 s per full
collection and freed nothing, long enough, with a busy loop, to miss its controller's polls
and be failed over. Messages and the other long-lived objects hold no reference cycles on
the hot path; what dies in a cycle (a closed connection's objects, say) mostly dies young.

So the survivors of each full collection are frozen (`gc.freeze`): later full collections
walk only what came since. Every THAW_SECONDS the frozen objects are handed back, and the
next full collection walks everything once, freeing any cycle that died among them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

THAW_SECONDS = 600.0


class LongLived:
    """A `gc.callbacks` entry: freeze after each full collection, thaw now and then."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.thawed = clock()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = self.clock()
        if now - self.thawed >= THAW_SECONDS:
            self.thawed = now
            gc.unfreeze()  # the next full collection walks everything
        else:
            gc.freeze()


def install() -> LongLived:
    """For the broker's process: from now on, full collections walk only new objects."""
    policy = LongLived()
    gc.callbacks.append(policy)
    return policy
