"""A queue deeper than memory drained from a 3-member cluster: what each member reads and spends.

    python bench/drain_replicated.py [--count 500000] [--size 1024] [--budget 16777216]
                                     [--runs 2] [--against TREE]

Per run, a fresh 3-member Tandem cluster (`tandem cluster up --config`, each member's queue
memory budget BUDGET bytes) takes COUNT persistent messages of SIZE bytes into one durable
queue (`bench/deep.js fill`, confirms), the page cache is dropped, and the queue is drained
in order (`bench/deep.js drain`: prefetch 2,000, acks every 500). Printed per run: the drain's
rate, and for each member the bytes it read from disk (`/proc/PID/io` read_bytes) and the CPU
time it spent (user + system) during the drain. The primary reads the bodies it delivers; a
backup needs none of them. `--against TREE` alternates runs with a cluster from another
source tree, as rejoin.py does. Tandem only: the question is what a backup spends while its
primary drains a deep queue. Run as root (dropping the page cache needs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import alone
from clusters import ROOT, TandemCluster


def usage(cluster: TandemCluster) -> dict[str, tuple[int, float]]:
    """Per member ("node/role"): bytes read from disk so far, CPU seconds so far."""
    out = {}
    for m in cluster.state()["members"]:
        io = Path(f"/proc/{m['pid']}/io").read_text().splitlines()
        read = next(int(line.split()[1]) for line in io if line.startswith("read_bytes"))
        out[f"{m['node']}/{m['role']}"] = (read, alone.cpu_seconds([m["pid"]]))
    return out


def run(name: str, env: dict[str, str] | None, args: argparse.Namespace) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as cfg:
        cfg.write(f"queue_memory_bytes: {args.budget}\n")
    cluster = TandemCluster(3, env, "--config", cfg.name)
    failed = True
    try:
        url = cluster.urls[0].removesuffix("/%2F")
        fill = ["node", "bench/deep.js", url, "dq", "fill", str(args.count), str(args.size)]
        subprocess.run(fill, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")  # reads come from the disk
        before = usage(cluster)
        drain = ["node", "bench/deep.js", url, "dq", "drain", str(args.count)]
        done = subprocess.run(drain, cwd=ROOT, check=True, capture_output=True, text=True)
        after = usage(cluster)
        rate = float(json.loads(done.stdout)["rate"])
        print(f"  {name:14} drain {rate:,.0f} msg/s")
        for member in sorted(before):
            read = (after[member][0] - before[member][0]) / 1e6
            cpu = after[member][1] - before[member][1]
            print(f"  {name:14}   {member:18} read {read:8.1f} MB   CPU {cpu:5.2f} s")
        failed = False
        return rate
    finally:
        cluster.stop(failed)
        os.unlink(cfg.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=500_000, help="messages queued")
    ap.add_argument("--size", type=int, default=1024, help="body bytes")
    ap.add_argument("--budget", type=int, default=16 << 20, help="queue memory bytes")
    ap.add_argument("--runs", type=int, default=2, help="fresh clusters per build")
    ap.add_argument("--against", metavar="TREE", help="also run Tandem from this source tree")
    args = ap.parse_args()
    builds = {"tandem": None} | (
        {"tandem@before": alone.source_env(args.against)} if args.against else {}
    )
    print(
        f"machine: {os.cpu_count()} cores; {args.count:,} persistent {args.size}-byte "
        f"messages, {args.budget:,} bytes of queue memory a member"
    )
    for name, env in builds.items():
        print(f"{name}: {alone.build(env)}")
    rates: dict[str, list[float]] = {name: [] for name in builds}
    for turn in range(args.runs):
        for name in alone.in_turn(builds, turn):
            rates[name].append(run(name, builds[name], args))
    print()
    for name, each in rates.items():
        print(f"{name:14} drain: median {statistics.median(each):,.0f} msg/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
