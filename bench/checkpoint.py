"""What a checkpoint costs for each message of a queue's head it names, on its thread.

    python bench/checkpoint.py [--messages 150000] [--runs 3] [--against TREE]

Builds, in this process, a queue's head of MESSAGES persistent 100-byte messages in memory
(a queue that pages names its head as pages of the log) and times the store's
`_checkpoint_bytes` on it twice: named anew, and after a FIFO step (a sixth of the head
consumed, as many added) with the pages the first one named. Prints ns a message for each,
best of RUNS. `--against TREE` runs the same in a child process with TREE's source first
on PYTHONPATH (a tree from before a checkpoint reused pages names the head anew both times).
The times include the thread's turns given to the loop (`give_way`: 0.1 ms every 16,384
messages, about 7 ns a message). Offline, the head's messages sit together in memory; in a
member under load, reading them misses the cache, and a member gains less than these figures
say (docs/performance.md, session 36).
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from typing import Any

import alone


def measure(count: int, runs: int) -> tuple[float, float]:
    """(ns a message named anew, ns a message after a FIFO step), best of `runs`."""
    from tandem.broker.model import records
    from tandem.broker.model.message import Message
    from tandem.broker.store import log as store_log

    key = ("/", "firehose")
    at_bits = store_log.AT_BITS

    def message(i: int) -> Message:
        m = Message("", "firehose", b"\x00\x08firehose", b"\x00\x00", b"x" * 100, 100)
        m.persistent = True
        m.mid = records.mid(1, 1000 + 2 * i)
        return m

    def named(msgs: list[Message], where: dict[int, int], pages: Any) -> tuple[float, Any]:
        """Seconds to name `msgs`, given the pages the last one named (as it returned them,
        None for none), and the pages it named."""
        fields = {f.name for f in dataclasses.fields(store_log._Captured)}
        extra: dict[str, Any] = {}
        if pages is not None and "named" in fields:
            extra["named"] = {key: pages}
        items: list[Any] = list(msgs)
        state = store_log._Captured({"epoch": 1}, {key: [where]}, [], [(key, items)], **extra)
        made = store_log._Made()
        start = time.perf_counter()
        store_log._checkpoint_bytes(state, made, "part-")
        return time.perf_counter() - start, getattr(made, "heads", {}).get(key)

    head = [message(i) for i in range(count)]
    places = {m.mid: (1 << at_bits) | (180 * i) for i, m in enumerate(head)}
    step = count // 6
    later = head[step:] + [message(count + i) for i in range(step)]
    later_places = {
        m.mid: places.get(m.mid, (1 << at_bits) | (180 * (count + i))) for i, m in enumerate(later)
    }
    anew, after = [], []
    for _ in range(runs):
        seconds, pages = named(head, dict(places), None)
        anew.append(seconds)
        after.append(named(later, dict(later_places), pages)[0])
    return 1e9 * min(anew) / count, 1e9 * min(after) / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--messages", type=int, default=150_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", metavar="TREE", help="also measure this source tree")
    ap.add_argument("--print", action="store_true", help=argparse.SUPPRESS)  # the child's
    args = ap.parse_args()
    if args.print:
        print(*measure(args.messages, args.runs))
        return 0
    builds = {"tandem": None} | (
        {"tandem@before": alone.source_env(args.against)} if args.against else {}
    )
    print(f"a head of {args.messages:,} messages; a FIFO step: a sixth consumed, a sixth added")
    for name, env in builds.items():
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--messages",
                str(args.messages),
                "--runs",
                str(args.runs),
                "--print",
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        anew, after = float(out[0]), float(out[1])
        print(
            f"{name:14} {alone.build(env)}: named anew {anew:.0f} ns a message, "
            f"after a FIFO step {after:.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
