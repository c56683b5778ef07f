"""Replicated firehose: a 3-member Tandem cluster against a quorum queue on a 3-node RabbitMQ,
same client (amqplib), same machine, one run.

    python bench/replicated.py [--runs 5] [--count 50000] [--windows none,1,100,1000]
                               [--publishers 1,10] [--size 100] [--against TREE]

Persistent 100-byte messages (`--size` bytes) with publisher confirms on a durable queue declared
`x-queue-type: quorum` (on Tandem every queue is replicated `all`, so the same declaration is
a replicated queue there), a consumer running, from one publisher connection and from ten,
each publisher keeping at most WINDOW publishes unconfirmed (`none`: only the socket's
backpressure); one warm-up each, then
RUNS runs alternating Tandem and RabbitMQ; medians and the ratio Tandem/RabbitMQ. The client
connects to Tandem's front port and to RabbitMQ's first node (the queue's leader, as it is
declared there). Every message is checked to arrive once and in order. RabbitMQ's nodes are
paused while Tandem runs; `--against TREE` adds a cluster run from another source tree, as in
firehose.py.
"""

from __future__ import annotations

import argparse
import os

import alone
from clusters import RabbitCluster, TandemCluster
from firehose import Tally, node, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=50_000)
    ap.add_argument("--against", metavar="TREE", help="also run Tandem from this source tree")
    ap.add_argument(
        "--failover-delay",
        default="1.0",
        help="Tandem's (the default's, 1 s, once failed over spuriously under this load)",
    )
    ap.add_argument("--windows", default="none,1,100,1000", help="confirm windows")
    ap.add_argument("--publishers", default="1,10", help="publisher connections")
    ap.add_argument("--size", type=int, default=100, help="message bytes")
    args = ap.parse_args()
    extra = ("--failover-delay", args.failover_delay)
    failed = False
    tandems: dict[str, TandemCluster] = {}
    rabbit: RabbitCluster | None = None
    try:  # whatever started is stopped, whatever fails to start
        rabbit = RabbitCluster()
        tandems["tandem"] = TandemCluster(3, None, *extra)
        if args.against:
            tandems["tandem@before"] = TandemCluster(3, alone.source_env(args.against), *extra)
        urls = {n: t.urls[0].removesuffix("/%2F") for n, t in tandems.items()}
        urls["rabbitmq"] = rabbit.urls[0].removesuffix("/%2F")
        pids = {n: [t.proc.pid] for n, t in tandems.items()} | {"rabbitmq": rabbit.pids}
        print(f"machine: {os.cpu_count()} cores; client: amqplib; runs: {args.runs}")
        print(
            f"tandem: 3 members, ISR minimum 2, failover delay {args.failover_delay} s; "
            "rabbitmq 3.10: 3 nodes, quorum queue"
        )
        print("rabbitmq's nodes are paused (SIGSTOP) while a tandem cluster runs")
        for name, t in tandems.items():
            print(f"{name}: {alone.build(t.env)}")
        tally = Tally()  # the CPU is all members' (or all nodes')
        modes = [
            (f"{p} pub, window {w}", p, w)
            for p in args.publishers.split(",")
            for w in args.windows.split(",")
        ]
        for mode, publishers, window in modes:
            count = args.count if window not in ("1",) else args.count // 10  # one at a time
            options = () if window == "none" else (f"window={window}",)
            if args.size != 100:
                options = (*options, f"size={args.size}")
            for run in range(-1, args.runs):  # run -1: the warm-up
                for name in alone.in_turn(urls, run):
                    url = urls[name]
                    with alone.paused([] if name == "rabbitmq" else rabbit.pids):
                        cpu = alone.cpu_seconds(pids[name])
                        r = node("firehose.js", url, "quorum", str(count), publishers, *options)
                        cpu = alone.cpu_seconds(pids[name]) - cpu
                    if run >= 0:
                        figures = tally.add(name, mode, r, cpu, count)
                        print(f"  {mode:20} run {run + 1} {name:14} {figures}", flush=True)
        print()
        report(list(urls), [m for m, _, _ in modes], tally)
    except BaseException:
        failed = True
        raise
    finally:
        for t in tandems.values():
            t.stop(failed)
        if rabbit is not None:
            rabbit.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
