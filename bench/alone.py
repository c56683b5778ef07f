"""Each broker alone on the machine, and what it cost: the side-by-side benchmarks share these.

- `paused(pids)`: SIGSTOP a broker's processes while another one is measured, SIGCONT after.
  Idle Erlang nodes spin (busy-wait schedulers, distribution ticks) and take CPU from the
  broker under test; a stopped process takes none. Only RabbitMQ is paused this way: its nodes
  are all stopped and resumed together, so none of them sees another go quiet.
- `cpu_seconds(pids)`: user + system CPU time of processes and all their descendants, read
  from /proc, to report each broker's CPU use and µs per message.
- `source_env(tree)`: the environment that runs Tandem from another source tree (a git
  worktree of an older commit, say), to measure a change before and after in one run.
- `build(env)`: whether Tandem runs compiled (mypyc) in that environment, for the report.
- `in_turn(names, run)`: the order the brokers run in, run after run: two Tandem builds
  swap places every other run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()  # fields after "pid (comm)"


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time (user + system) used so far by `pids` and their descendants."""
    total = 0
    for root in pids:
        for p in descendants(root):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = _stat(p)
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


@contextlib.contextmanager
def paused(pids: Iterable[int]) -> Iterator[None]:
    stopped = list(pids)
    for p in stopped:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in stopped:
            os.kill(p, signal.SIGCONT)


def source_env(tree: str | None) -> dict[str, str] | None:
    """None (this checkout), or an environment whose PYTHONPATH puts `tree`/src first."""
    if tree is None:
        return None
    src = Path(tree).resolve() / "src"
    if not (src / "tandem").is_dir():
        raise SystemExit(f"{tree} is not a Tandem source tree (no src/tandem)")
    return {**os.environ, "PYTHONPATH": str(src)}


def in_turn(names: Iterable[str], run: int) -> list[str]:
    """`names` (broker names, Tandem's builds named `tandem...`) in the order they run in
    `run`: two Tandem builds swap places every other run, the others keep theirs. So over
    an even number of runs each build runs right after RabbitMQ, or right after the other
    build, as often as the other does (with an odd number, the first one once more): a lone
    broker's run right after RabbitMQ's took up to half as much CPU again a message as its
    next runs (docs/performance.md, 64 KiB, 2026-12-04), which with a fixed order counted
    against the build that always came first."""
    names = list(names)
    tandems = [n for n in names if n.startswith("tandem")]
    if run % 2:
        tandems.reverse()
    swapped = iter(tandems)
    return [next(swapped) if n.startswith("tandem") else n for n in names]


def build(env: dict[str, str] | None) -> str:
    """'compiled', or 'pure Python' and why, as a broker started with `env` would run."""
    probe = "import tandem._compiled as c; print(c.WHY_NOT or '')"
    try:
        why = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "pure Python (before tandem._compiled)"
    return f"pure Python ({why})" if why else "compiled (mypyc)"
