"""Replicated firehose: a 3-member Tandem cluster against a quorum queue on a 3-node RabbitMQ,
same client (amqplib), same machine, one run.

    python bench/replicated.py [--runs 5] [--count 50000]

Persistent 100-byte messages with publisher confirms on a durable queue declared
`x-queue-type: quorum` (on Tandem every queue is replicated `all`, so the same declaration is
a replicated queue there), from one publisher connection and from ten; one warm-up each, then
RUNS runs alternating Tandem and RabbitMQ; medians and the ratio Tandem/RabbitMQ. The client
connects to Tandem's front port and to RabbitMQ's first node (the queue's leader, as it is
declared there). Every message is checked to arrive once and in order.
"""

from __future__ import annotations

import argparse
import os
import statistics

from clusters import RabbitCluster, TandemCluster
from firehose import node


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=50_000)
    args = ap.parse_args()
    tandem = TandemCluster()
    rabbit = RabbitCluster()
    try:
        urls = {
            "tandem": tandem.urls[0].removesuffix("/%2F"),
            "rabbitmq": rabbit.urls[0].removesuffix("/%2F"),
        }
        print(f"machine: {os.cpu_count()} cores; client: amqplib; runs: {args.runs}")
        print("tandem: 3 members, ISR minimum 2; rabbitmq 3.10: 3 nodes, quorum queue")
        results: dict[tuple[str, str], list[float]] = {}
        for publishers in ("1", "10"):
            for url in urls.values():
                node("firehose.js", url, "quorum", str(args.count), publishers)  # warm-up
            for run in range(args.runs):
                for name, url in urls.items():
                    r = node("firehose.js", url, "quorum", str(args.count), publishers)
                    rate = float(r["rate"])  # type: ignore[arg-type]
                    results.setdefault((name, publishers), []).append(rate)
                    print(f"  {publishers:>2} publishers run {run + 1} {name:8} {rate:9.0f} msg/s")
        print()
        print(f"{'publishers':12}{'tandem':>10}{'rabbitmq':>10}{'ratio':>8}   (median msg/s)")
        for publishers in ("1", "10"):
            t = statistics.median(results[("tandem", publishers)])
            r = statistics.median(results[("rabbitmq", publishers)])
            print(f"{publishers:12}{t:10.0f}{r:10.0f}{t / r:8.2f}")
    finally:
        tandem.stop()
        rabbit.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
