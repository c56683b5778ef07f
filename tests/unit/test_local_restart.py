"""When the local cluster starts a member again after it exited (`restart_delay`)."""

from __future__ import annotations

import signal

import pytest

from tandem.local.members import MAX_RESTART_DELAY, RESTART_DELAY, restart_delay

KILLED = -signal.SIGKILL


@pytest.mark.parametrize(
    ("previous", "code", "ran", "expected"),
    [
        (None, 1, 0.2, RESTART_DELAY),  # its first exit
        (RESTART_DELAY, 1, 0.2, 2 * RESTART_DELAY),  # fails on its own, again: slower
        (8.0, 1, 0.2, MAX_RESTART_DELAY),  # ... up to the most
        (MAX_RESTART_DELAY, -signal.SIGSEGV, 3.0, MAX_RESTART_DELAY),  # a crash is its own
        (8.0, 1, 45.0, RESTART_DELAY),  # it ran a while: not a loop
        # Issue 16: killed every 4 s, members waited up to 10 s, the in-sync set shrank to
        # one and the next kill stopped confirms for as long. A kill -9 is not the member's.
        (8.0, KILLED, 3.0, RESTART_DELAY),
        (None, KILLED, 0.5, RESTART_DELAY),
    ],
)
def test_a_member_restarts_slower_only_when_it_keeps_failing_on_its_own(
    previous: float | None, code: int, ran: float, expected: float
) -> None:
    assert restart_delay(previous, code, ran) == expected
