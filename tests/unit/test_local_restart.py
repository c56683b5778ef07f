"""When the local cluster starts a member again after it exited (`restart_delay`), and
when it makes the spare process the next restart takes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from tandem.local import members
from tandem.local.members import MAX_RESTART_DELAY, RESTART_DELAY, Supervisor, restart_delay

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


class Started:
    """A process made (asyncio.create_subprocess_exec's stand-in): alive, told nothing."""

    returncode = None
    stdin = None


def spare_made(monkeypatch: pytest.MonkeyPatch, settled_from: int | None) -> list[int]:
    """How many times the supervisor had looked at the cluster when it made the spare; the
    cluster is settled from its look number `settled_from` (None: never)."""
    looks: list[bool] = []
    made: list[int] = []

    async def started(*args: Any, **kwargs: Any) -> Started:
        made.append(len(looks))
        return Started()

    def settled() -> bool:
        looks.append(True)
        return settled_from is not None and len(looks) >= settled_from

    async def main() -> None:
        supervisor = Supervisor({}, Path("key"), {}, lambda p: None, settled=settled)
        supervisor.spare_soon()
        assert supervisor.making_spare is not None
        await supervisor.making_spare

    monkeypatch.setattr(members, "SPARE_DELAY", 0)
    monkeypatch.setattr(members, "SPARE_LOOK", 0)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", started)
    asyncio.run(main())
    return made


def test_the_next_spare_is_made_once_every_member_is_in_the_isr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spare's import takes its share of the cores: a backup rejoining with a deep queue
    under load was still catching up when the spare made after it started importing."""
    assert spare_made(monkeypatch, settled_from=5) == [5]


def test_the_next_spare_waits_for_a_settled_cluster_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(members, "SPARE_MOST_DELAY", 0)
    assert spare_made(monkeypatch, settled_from=None) == [1]
