"""Failover time: the longest gap between consecutive confirms a publisher sees when the
primary (Tandem) or the quorum queue's leader node (RabbitMQ) is killed with SIGKILL or paused
with SIGSTOP, side by side on this machine.

    python bench/failover.py [--kills 20] [--stops 10] [--pause 5] [--only tandem|rabbitmq]
                             [--stale-writer] [--every SECONDS]

The publisher is pika with publisher confirms, heartbeat 1 s and a 0.1 s retry delay; it
republishes an unconfirmed message after reconnecting. Tandem's clients use the front port
only; RabbitMQ's try its three nodes in turn. A paused process stays paused for PAUSE seconds
(longer than either system's failover), so the figure is what a client waits for when a
primary hangs. Prints each gap, then p50, p99 and max per fault and system, and the number of
confirmed messages that were not consumed afterwards (it must be 0).

With --stale-writer (Tandem), each paused primary has a second client connected straight to
it (not through the front port), which publishes as soon as the pause ends, while another
member already serves: writes nobody confirms, in a diverged suffix of the old primary's
log. They must not take the place of a confirmed message, nor stay in the queue once the
old primary has rejoined; the summary counts both.

With --every SECONDS (Tandem), the storm: the primary is killed every SECONDS whether or not
the last one killed is back, and each kill prints how long the killed member took to be in
the in-sync set again (the cluster restarts it). Without it, each fault waits for a full
in-sync set before the next.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import threading
import time

import alone
import pika
import pika.exceptions
from clusters import RabbitCluster, TandemCluster

QUEUE = "failover-probe"
STALE_IDS = 10**9  # the stale writer's ids, apart from the probe's


class Probe(threading.Thread):
    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.params = [
            pika.URLParameters(f"{u}?heartbeat=1&socket_timeout=0.5&stack_timeout=2") for u in urls
        ]
        self.confirms: list[float] = []
        self.confirmed: set[int] = set()
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        n = 0
        turn = 0
        while not self.halt.is_set():
            try:
                order = self.params[turn:] + self.params[:turn]
                turn = (turn + 1) % len(self.params)
                conn = pika.BlockingConnection(order)
                ch = conn.channel()
                ch.queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
                ch.confirm_delivery()
                while not self.halt.is_set():
                    ch.basic_publish(
                        "", QUEUE, str(n).encode(), pika.BasicProperties(delivery_mode=2)
                    )
                    with self.lock:
                        self.confirms.append(time.monotonic())
                        self.confirmed.add(n)
                    n += 1
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                time.sleep(0.1)  # the client's retry delay

    def gap_since(self, start: float) -> float:
        with self.lock:
            times = [t for t in self.confirms if t >= start - 0.5]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def count_since(self, start: float) -> int:
        with self.lock:
            return sum(1 for t in self.confirms if t >= start)


def drain(urls: list[str]) -> set[int]:
    conn = pika.BlockingConnection([pika.URLParameters(u) for u in urls])
    ch = conn.channel()
    got: set[int] = set()
    while True:
        method, _p, body = ch.basic_get(QUEUE, auto_ack=True)
        if method is None:
            break
        got.add(int(body))
    conn.close()
    return got


def steady(probe: Probe, seconds: float = 1.0) -> None:
    """Wait until the publisher has confirmed for `seconds` again (the end of the window)."""
    start = time.monotonic()
    while probe.count_since(start) < 10 or time.monotonic() - start < seconds:
        time.sleep(0.05)


def stale_client(cluster: TandemCluster) -> pika.BlockingConnection:
    """A client of the primary itself, made before it is paused."""
    s = cluster.state()
    port = next(m["amqp_port"] for m in s["members"] if m["node"] == s["primary"])
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))


def stale_writes(conn: pika.BlockingConnection, count: int = 100) -> int:
    sent = 0
    try:
        ch = conn.channel()
        for k in range(count):
            ch.basic_publish("", QUEUE, str(STALE_IDS + k).encode())
            sent += 1
        conn.close()
    except (pika.exceptions.AMQPError, OSError):
        pass  # the old primary closes its clients once it learns of the new epoch
    return sent


def measure(
    name: str,
    cluster: TandemCluster | RabbitCluster,
    kills: int,
    stops: int,
    pause: float,
    stale_writer: bool = False,
    every: float | None = None,
) -> dict[str, list[float]]:
    probe = Probe(cluster.urls)
    probe.start()
    steady(probe, 2.0)
    gaps: dict[str, list[float]] = {"kill -9": [], "SIGSTOP": []}
    stale_sent = 0
    for kind, times in (("kill -9", kills), ("SIGSTOP", stops)):
        for i in range(times):
            pid = (
                cluster.leader_pid()
                if isinstance(cluster, TandemCluster)
                else cluster.pid(cluster.leader(QUEUE))
            )
            start = time.monotonic()
            if kind == "kill -9" and every is not None and isinstance(cluster, TandemCluster):
                node = cluster.state()["primary"]
                os.kill(pid, signal.SIGKILL)
                back = cluster.rejoined(node, start + every)
                gaps.setdefault("rejoin", []).append(back if back is not None else every)
                rejoin = "not back" if back is None else f"back in the ISR after {back:.2f} s"
                time.sleep(max(0.0, start + every - time.monotonic()))  # the storm's pace
                gap = probe.gap_since(start)
                gaps[kind].append(gap)
                print(f"  {name:8} kill -9 {i + 1:2}: longest gap {gap:6.3f} s; {node} {rejoin}")
                continue
            if kind == "kill -9":
                os.kill(pid, signal.SIGKILL)
                steady(probe)
            else:
                stale = None
                if stale_writer and isinstance(cluster, TandemCluster):
                    stale = stale_client(cluster)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(pause)  # the length of the hang is the fault being measured
                os.kill(pid, signal.SIGCONT)
                if stale is not None:
                    stale_sent += stale_writes(stale)
                steady(probe)
            gap = probe.gap_since(start)
            gaps[kind].append(gap)
            print(
                f"  {name:8} {kind:8} {i + 1:2}: longest gap between confirms {gap:6.3f} s",
                flush=True,
            )
            cluster.recover(pid)
            steady(probe)
    probe.halt.set()
    probe.join(30)
    got = drain(cluster.urls)
    lost = probe.confirmed - got
    leftover = {i for i in got if i >= STALE_IDS}
    print(f"  {name}: {len(probe.confirmed)} confirmed, {len(lost)} not consumed afterwards")
    if stale_writer:
        print(f"  {name}: {stale_sent} stale publishes, {len(leftover)} left in the queue")
    gaps["lost"] = [float(len(lost))]
    return gaps


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--stops", type=int, default=10)
    ap.add_argument("--pause", type=float, default=5.0)
    ap.add_argument("--only", choices=("tandem", "rabbitmq"))
    ap.add_argument("--stale-writer", action="store_true", help="see the docstring")
    ap.add_argument("--every", type=float, help="the storm: kill every SECONDS (Tandem)")
    args = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    if args.only != "rabbitmq":
        print(f"tandem: {alone.build(None)}", flush=True)
    for name in ("tandem", "rabbitmq"):
        if args.only and name != args.only:
            continue
        cluster: TandemCluster | RabbitCluster = (
            TandemCluster() if name == "tandem" else RabbitCluster()
        )
        try:
            results[name] = measure(
                name, cluster, args.kills, args.stops, args.pause, args.stale_writer, args.every
            )
        finally:
            cluster.stop()
    print()
    print(f"{'system':10}{'fault':10}{'n':>4}{'p50 s':>8}{'p99 s':>8}{'max s':>8}{'lost':>6}")
    for name, gaps in results.items():
        for kind in ("kill -9", "SIGSTOP"):
            v = gaps[kind]
            if v:
                print(
                    f"{name:10}{kind:10}{len(v):4}{statistics.median(v):8.3f}{pct(v, 0.99):8.3f}"
                    f"{max(v):8.3f}{int(gaps['lost'][0]):6}"
                )
        if gaps.get("rejoin"):
            v = gaps["rejoin"]
            print(
                f"{name:10}{'rejoin':10}{len(v):4}{statistics.median(v):8.3f}{pct(v, 0.99):8.3f}"
                f"{max(v):8.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
