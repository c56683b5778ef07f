"""When the local cluster starts a member again after it exited (`restart_delay`), and
when it makes the spare process the next restart takes."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

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


class Exits:
    """A member's process (asyncio.subprocess.Process's stand-in) that exits with `code`."""

    def __init__(self, code: int) -> None:
        self.returncode = code

    async def wait(self) -> int:
        return self.returncode


def restarted(
    monkeypatch: pytest.MonkeyPatch, code: int, starts: list[OSError | None]
) -> list[tuple[str, float]]:
    """What the supervisor did, in order, for a member that exited with `code`, its
    restarts failing or starting as `starts` says (None: started): how it waited (the
    controller's look, or a sleep), each start, and its wake-up of the controller."""
    seen: list[tuple[str, float]] = []

    async def looked(most: float) -> None:
        seen.append(("looked", most))

    async def slept(seconds: float) -> None:
        seen.append(("slept", seconds))

    async def main() -> None:
        supervisor = Supervisor(
            {},
            Path("key"),
            {},
            lambda p: None,
            looked=looked,
            on_back=lambda p: seen.append(("back", 0.0)),
        )
        script = iter(starts)

        async def start(proc: members.Proc, held: object = None) -> None:
            assert held is None  # no spare made
            failure = next(script)
            if failure is not None:
                seen.append(("failed", 0.0))
                raise failure
            seen.append(("started", 0.0))
            supervisor.stopping = True

        monkeypatch.setattr(supervisor, "start", start)
        proc = members.Proc("tandem-1", Path("d"), process=Exits(code))  # type: ignore[arg-type]
        await supervisor.keep(proc)

    monkeypatch.setattr(members.asyncio, "sleep", slept)
    asyncio.run(main())
    return seen


@pytest.mark.parametrize(("code", "waited"), [(KILLED, "looked"), (1, "slept")])
def test_a_killed_member_comes_back_once_the_controller_has_seen_it_gone(
    monkeypatch: pytest.MonkeyPatch, code: int, waited: str
) -> None:
    """Restarted before the controller's next look, a killed primary answered there as a
    backup, and the failover took a turn longer: 0.25 s without confirms a kill, not 0.12.
    A member that failed on its own waits its whole delay. Either, once started, wakes the
    controller (`on_back`) to be told whom to follow at once, not at its next poll."""
    assert restarted(monkeypatch, code, [None]) == [
        (waited, RESTART_DELAY),
        ("started", 0.0),
        ("back", 0.0),
    ]


def test_a_restart_that_fails_to_start_waits_longer_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A killed member whose restart fails (a full disk, no file descriptors) is tried again
    after a doubling sleep, not at the controller's next look: those came every few
    milliseconds, and so did the attempts, each logged."""
    full, no_fds = OSError(28, "No space left on device"), OSError(24, "Too many open files")
    assert restarted(monkeypatch, KILLED, [full, no_fds, None]) == [
        ("looked", RESTART_DELAY),
        ("failed", 0.0),
        ("slept", 2 * RESTART_DELAY),
        ("failed", 0.0),
        ("slept", 4 * RESTART_DELAY),
        ("started", 0.0),
        ("back", 0.0),
    ]


def test_looked_returns_after_a_turn_that_began_after_it() -> None:
    """WakeableClock.looked: a loop asleep when asked wakes, takes its turn and sleeps again;
    a loop in a turn when asked may have looked before, so the turn after counts."""
    from tandem.broker.ha_http import WakeableClock

    async def main() -> list[str]:
        clock = WakeableClock()
        said: list[str] = []
        turn = asyncio.Event()

        async def loop() -> None:  # the HA loop: a turn, then a sleep, until told to stop
            for n in range(3):
                await turn.wait()
                turn.clear()
                said.append(f"turn {n}")
                await clock.sleep(30)

        async def asker(name: str) -> None:
            await clock.looked(30)
            said.append(name)

        running = asyncio.create_task(loop())
        mid_turn = asyncio.create_task(asker("asked mid-turn"))
        await asyncio.sleep(0)  # it waits for a turn begun after it: the one after next
        turn.set()
        for _ in range(3):
            await asyncio.sleep(0)  # turn 0 ends: the loop sleeps
        asleep = asyncio.create_task(asker("asked asleep"))
        await asyncio.sleep(0)
        clock.wake.set()  # a member exited: the loop's sleep ends
        turn.set()
        await asyncio.wait_for(asyncio.gather(mid_turn, asleep), 5)
        running.cancel()
        return said

    assert asyncio.run(main()) == ["turn 0", "turn 1", "asked mid-turn", "asked asleep"]


def test_looked_waits_no_longer_than_it_is_told() -> None:
    from tandem.broker.ha_http import WakeableClock

    async def main() -> float:
        start = asyncio.get_running_loop().time()
        await WakeableClock().looked(0.05)  # no loop runs: nothing looks
        return asyncio.get_running_loop().time() - start

    assert 0.05 <= asyncio.run(main()) < 5


class Spare(Exits):
    """A spare process's stand-in: what the supervisor writes to its input goes to `seen`."""

    def __init__(self, seen: list[tuple[str, Any]]) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.stdin = self
        self.seen = seen

    def write(self, data: bytes) -> None:
        self.seen.append(("told", data))

    def close(self) -> None:
        self.seen.append(("closed", None))
        self.returncode = 0  # a spare ends at the end of its input, told nothing more

    def is_closing(self) -> bool:
        return self.returncode is not None


def test_a_killed_member_s_spare_reads_its_log_while_the_controller_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spare is told at once which member it becomes, and to hold: it reads its log's
    end (`Node.prepare`) while the controller is to see the member gone, and starts, told
    a second line, once it has. Told only after the look, a restarted backup said Hello
    0.03-0.12 s later under load."""
    seen: list[tuple[str, Any]] = []

    async def looked(most: float) -> None:
        seen.append(("looked", most))

    async def main() -> None:
        supervisor = Supervisor({}, tmp_path / "key", {}, lambda p: None, looked=looked)
        spare = supervisor.spare = Spare(seen)  # type: ignore[assignment]

        async def started(proc: members.Proc) -> None:
            seen.append(("started", proc.process is spare))
            supervisor.stopping = True

        monkeypatch.setattr(supervisor, "_started", started)
        proc = members.Proc("tandem-2", tmp_path / "d", process=Exits(KILLED))  # type: ignore[arg-type]
        await supervisor.keep(proc)

    asyncio.run(main())
    told = json.loads(seen[0][1])
    assert told == {
        "config": str(tmp_path / "d" / "member.yaml"),
        "output": str(tmp_path / "d" / "broker.log"),
        "hold": True,
    }
    assert yaml.safe_load((tmp_path / "d" / "member.yaml").read_text())["node_id"] == "tandem-2"
    assert seen[1:] == [
        ("looked", RESTART_DELAY),
        ("told", b"go\n"),
        ("closed", None),
        ("started", True),
    ]


def test_a_spare_held_for_a_member_ends_when_the_cluster_stops_meanwhile(
    tmp_path: Path,
) -> None:
    """A cluster stopping while its spare waits to start closes the spare's input: told
    nothing more, it ends (`cli._broker`), and no member is started."""
    seen: list[tuple[str, Any]] = []

    async def main() -> None:
        async def looked(most: float) -> None:
            supervisor.stopping = True

        supervisor = Supervisor({}, tmp_path / "key", {}, lambda p: None, looked=looked)
        spare = supervisor.spare = Spare(seen)  # type: ignore[assignment]
        proc = members.Proc("tandem-2", tmp_path / "d", process=Exits(KILLED))  # type: ignore[arg-type]
        await supervisor.keep(proc)
        assert proc.process is not spare

    asyncio.run(main())
    assert [what for what, _ in seen] == ["told", "closed"]


def test_a_member_that_exits_on_its_own_leaves_the_spare_for_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that failed waits its whole delay (up to 10 s when it keeps failing): it
    does not hold the spare meanwhile, which a member killed then needs."""
    seen: list[tuple[str, Any]] = []
    supervisor = Supervisor({}, tmp_path / "key", {}, lambda p: None)
    spare = supervisor.spare = Spare(seen)  # type: ignore[assignment]

    async def slept(seconds: float) -> None:
        supervisor.stopping = True

    monkeypatch.setattr(members.asyncio, "sleep", slept)
    proc = members.Proc("tandem-2", tmp_path / "d", process=Exits(1))  # type: ignore[arg-type]
    asyncio.run(supervisor.keep(proc))
    assert (seen, supervisor.spare) == ([], spare)
