"""A backup killed with a deep queue, under load: how long until it is back in the ISR.

    python bench/rejoin.py [--count 1000000] [--kills 3] [--runs 1] [--against TREE]

Per run, a fresh 3-member Tandem cluster (`tandem cluster up`): one durable queue filled
with COUNT persistent 100-byte messages (`bench/deep.js`), then a publisher that does not
wait for confirms and a consumer on another queue (`bench/firehose.js ... quorum`), then
KILLS times: kill -9 of a backup in the ISR, and `/cluster` polled every 50 ms until the
member is back in the ISR (the cluster restarts a killed member once its controller has
looked, within 0.1 s). Prints each kill, whether the primary changed meanwhile, and the
median; `--against TREE` alternates runs with a cluster from another source tree, as in
replicated.py. Issue 16 asks for 2 s.

Throughout, the primary's `/status` (what the controller polls) is asked every 0.1 s, and
the slowest answer during the fill and during the kills is printed: an answer later than
the failover delay (1 s) fails a live primary over. Each member's RSS after the fill and
after the kills is printed too: a member that grows while the primary does not holds what
it should have let go (a backup that kept every batch it wrote grew by 30 MB a second).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

import alone
from clusters import ROOT, TandemCluster
from firehose import rss_mb

POLL = 0.05  # seconds between looks at /cluster
LIMIT = 120.0  # a kill not back by then counts as this


def kill_one(cluster: TandemCluster) -> tuple[float, int, int]:
    """Kill a backup in the ISR; (seconds until it is back in the ISR, epoch before,
    epoch after)."""
    state = cluster.state()
    victim = next(m for m in state["members"] if m["role"] == "backup" and m["in_isr"])
    before = state["epoch"]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    left = False
    while time.monotonic() - killed < LIMIT:
        try:
            state = cluster.state()
        except OSError:
            state = {}
        if state:
            left = left or victim["node"] not in state["isr"]
            if left and victim["node"] in state["isr"]:
                return time.monotonic() - killed, before, state["epoch"]
        time.sleep(POLL)
    return LIMIT, before, cluster.state()["epoch"]


class Answers(threading.Thread):
    """Asks the primary's /status every 0.1 s, as the controller does; keeps the slowest
    answer since `slowest()` was last called."""

    def __init__(self, cluster: TandemCluster) -> None:
        super().__init__(daemon=True)
        data = cluster.dir / "data"
        node = cluster.state()["primary"]
        admin = json.loads((data / node / "ports.json").read_text())["admin"]
        self.request = urllib.request.Request(
            f"http://127.0.0.1:{admin}/status?brief=1",
            headers={"Authorization": f"Bearer {(data / 'cluster.key').read_text().strip()}"},
        )
        self.worst = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            asked = time.monotonic()
            # A primary that stepped down or died does not answer: the kills' lines say so.
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.request, timeout=10).read()
            self.worst = max(self.worst, time.monotonic() - asked)

    def slowest(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst


def memory(cluster: TandemCluster, before: dict[str, int] | None = None) -> dict[str, int]:
    """Each member's RSS, printed; its pid, returned. A member whose pid is not the one in
    `before` was restarted since."""
    pids = {}
    said = []
    for m in cluster.state()["members"]:
        pids[m["node"]] = pid = m["pid"]
        restarted = ", restarted" if before and before.get(m["node"]) != pid else ""
        with contextlib.suppress(OSError):  # gone meanwhile
            said.append(f"{m['node']} ({m['role']}{restarted}) {rss_mb(pid):,.0f} MB")
    print("    RSS: " + ", ".join(said))
    return pids


def run(name: str, env: dict[str, str] | None, count: int, kills: int) -> list[float]:
    cluster = TandemCluster(3, env)
    url = cluster.urls[0].removesuffix("/%2F")
    load = None
    failed = True
    answers = Answers(cluster)
    answers.start()
    try:
        subprocess.run(
            ["node", "bench/deep.js", url, "deepq", "fill", str(count), "100"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        print(f"  {name:14} fill: the primary's slowest answer {answers.slowest():.2f} s")
        pids = memory(cluster)
        load = subprocess.Popen(
            ["node", "bench/firehose.js", url, "quorum", "10000000", "1"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times = []
        for k in range(kills):
            time.sleep(5)  # the load runs, and the last member back settles
            back, before, after = kill_one(cluster)
            times.append(back)
            changed = "" if after == before else f", failed over (epoch {before} -> {after})"
            print(f"  {name:14} kill {k + 1}: back in the ISR after {back:.2f} s{changed}")
        print(f"  {name:14} kills: the primary's slowest answer {answers.slowest():.2f} s")
        memory(cluster, pids)
        failed = False
        return times
    finally:
        answers.done.set()
        if load is not None:
            load.kill()
            load.wait()
        cluster.stop(failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=1_000_000, help="messages queued")
    ap.add_argument("--kills", type=int, default=3, help="backups killed per run")
    ap.add_argument("--runs", type=int, default=1, help="fresh clusters per build")
    ap.add_argument("--against", metavar="TREE", help="also run Tandem from this source tree")
    args = ap.parse_args()
    builds = {"tandem": None} | (
        {"tandem@before": alone.source_env(args.against)} if args.against else {}
    )
    print(f"machine: {os.cpu_count()} cores; {args.count:,} persistent 100-byte messages queued")
    for name, env in builds.items():
        print(f"{name}: {alone.build(env)}")
    results: dict[str, list[float]] = {name: [] for name in builds}
    for turn in range(args.runs):
        for name in alone.in_turn(builds, turn):
            results[name] += run(name, builds[name], args.count, args.kills)
    print()
    for name, times in results.items():
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name:14} back in the ISR: median {statistics.median(times):.2f} s ({each})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
