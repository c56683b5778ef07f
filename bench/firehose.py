"""Firehose: Tandem against RabbitMQ, same client (amqplib), same machine, one run.

    python bench/firehose.py [--runs 5] [--workloads NAME,...] [--rss-count 1000000]
                             [--rabbitmq-url URL] [--against TREE]

The workloads (WORKLOADS below; `--workloads` picks some), each with one warm-up, then RUNS
runs alternating Tandem and RabbitMQ; medians and the ratio Tandem/RabbitMQ:

- transient: 100-byte messages without confirms, one publisher, one consumer;
- persistent: 100-byte persistent messages on a durable queue, publisher confirms;
- fanout-8: transient, to a fanout exchange bound to 8 queues, each consumed;
- pairs-4: transient, 4 publisher/consumer pairs, each on its own queue;
- topic-50: transient, to a topic exchange with 50 pattern bindings (one queue each);
- each of those five with the consumer acking one by one (most consumers) and, as `-batched`,
  with `multiple` every 500 (fast consumers): ratios are claimed only per pattern measured;
- persistent-64k: 64 KiB persistent messages with confirms;
- persistent-10: ten publisher connections of persistent messages with confirms.

Then the RSS of each broker after 1,000,000 transient 100-byte messages are queued and
confirmed. RabbitMQ is started with `rabbitmq-server -detached` if nothing answers on its URL.
Every message is checked to arrive, once and in order.

RabbitMQ is paused (SIGSTOP) while Tandem runs, so each broker is alone on the machine; each
run prints the broker's CPU time per message, and how busy the client was: its JavaScript
runs on one thread, and near 100% the client, not the broker, set the rate. `--against TREE`
also runs Tandem from another source tree (`git worktree add /tmp/before <commit>`), as
`tandem@before`, alternating with the others: a change measured before and after in one run.
The two builds swap places every other run (`alone.in_turn`): the run right after
RabbitMQ's costs more.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import alone

ROOT = Path(__file__).resolve().parent.parent

# name: (firehose.js mode, messages, publishers, options)
WORKLOADS: dict[str, tuple[str, int, int, tuple[str, ...]]] = {}
for _name, _mode, _count, _pubs, _opts in (
    ("transient", "transient", 100_000, 1, ()),
    ("persistent", "persistent", 50_000, 1, ()),
    ("fanout-8", "transient", 20_000, 1, ("fanout=8",)),
    ("pairs-4", "transient", 100_000, 4, ("pairs=4",)),
    ("topic-50", "transient", 100_000, 1, ("topic=50",)),
):
    WORKLOADS[_name] = (_mode, _count, _pubs, _opts)
    WORKLOADS[f"{_name}-batched"] = (_mode, _count, _pubs, (*_opts, "ack=500"))
WORKLOADS["persistent-64k"] = ("persistent", 20_000, 1, ("size=65536",))
WORKLOADS["persistent-10"] = ("persistent", 50_000, 10, ())


def node(script: str, *args: str, timeout: float = 600) -> dict[str, object]:
    out = subprocess.run(
        ["node", str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"{script} {' '.join(args)} failed: {out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def reachable(url: str) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 5672), timeout=1):
            return True
    except OSError:
        return False


def ensure_rabbitmq(url: str) -> bool:
    """Start RabbitMQ unless it answers on `url`; True when this call started it (and the
    caller stops it: an idle Erlang node left running takes CPU from whatever runs next)."""
    if reachable(url):
        return False
    if shutil.which("rabbitmq-server") is None:
        raise SystemExit(
            "RabbitMQ is not running and rabbitmq-server is not installed "
            "(apt-get install rabbitmq-server)"
        )
    subprocess.run(["rabbitmq-server", "-detached"], check=False)
    # await_startup fails at once while the new node has not yet registered with epmd.
    deadline = time.monotonic() + 120
    while subprocess.run(
        ["rabbitmqctl", "await_startup", "--timeout", "120"], capture_output=True
    ).returncode:
        if time.monotonic() > deadline:
            raise SystemExit("RabbitMQ did not start in 120 s")
        time.sleep(0.5)
    return True


def rabbitmq_pid() -> int:
    out = subprocess.run(["pgrep", "-f", "beam.smp.*rabbit"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Tandem:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
        self.env = env
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "broker",
                "--amqp-port",
                "0",
                "--admin-port",
                "0",
                "--data-dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        ports = self.dir / "ports.json"
        deadline = time.monotonic() + 30
        while not ports.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("tandem broker did not start")
            time.sleep(0.05)
        self.url = f"amqp://guest:guest@127.0.0.1:{json.loads(ports.read_text())['amqp']}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rss-count", type=int, default=1_000_000)
    ap.add_argument("--rabbitmq-url", default="amqp://guest:guest@127.0.0.1:5672")
    ap.add_argument("--against", metavar="TREE", help="also run Tandem from this source tree")
    ap.add_argument(
        "--workloads", "--modes", default=",".join(WORKLOADS), help="a comma-separated subset"
    )
    args = ap.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"no workload {', '.join(sorted(unknown))}; known: {', '.join(WORKLOADS)}")
    modes = {m: WORKLOADS[m] for m in args.workloads.split(",")}
    started = ensure_rabbitmq(args.rabbitmq_url)
    tandems: dict[str, Tandem] = {}
    try:  # whatever started is stopped, whatever fails to start
        rabbit = [rabbitmq_pid()]
        tandems["tandem"] = Tandem()
        if args.against:
            tandems["tandem@before"] = Tandem(alone.source_env(args.against))
        brokers = {name: t.url for name, t in tandems.items()} | {"rabbitmq": args.rabbitmq_url}
        pids = {name: [t.proc.pid] for name, t in tandems.items()} | {"rabbitmq": rabbit}
        print(f"machine: {os.cpu_count()} cores; client: amqplib; runs: {args.runs}")
        for name, t in tandems.items():
            print(f"{name}: {alone.build(t.env)}")
        tally = Tally()
        for mode, (kind, count, publishers, options) in modes.items():
            for run in range(-1, args.runs):  # run -1: the warm-up
                for name in alone.in_turn(brokers, run):
                    url = brokers[name]
                    idle = [] if name == "rabbitmq" else rabbit
                    with alone.paused(idle):
                        cpu = alone.cpu_seconds(pids[name])
                        r = node("firehose.js", url, kind, str(count), str(publishers), *options)
                        cpu = alone.cpu_seconds(pids[name]) - cpu
                    if run >= 0:
                        figures = tally.add(name, mode, r, cpu, count)
                        print(f"  {mode:18} run {run + 1} {name:14} {figures}", flush=True)
        print()
        report(list(brokers), list(modes), tally)
        print()
        if args.rss_count:
            for t in tandems.values():
                t.stop()
            tandem = Tandem()
            tandems = {"tandem": tandem}
            rss_brokers = {"tandem": tandem.url, "rabbitmq": args.rabbitmq_url}
            rss_pids = {"tandem": tandem.proc.pid, "rabbitmq": rabbit[0]}
            rss: dict[str, float] = {}
            for name, url in rss_brokers.items():
                queue = f"rss-{os.getpid()}"
                before = rss_mb(rss_pids[name])
                with alone.paused([] if name == "rabbitmq" else rabbit):
                    node("fill.js", url, queue, str(args.rss_count), timeout=1800)
                rss[name] = rss_mb(rss_pids[name])
                print(
                    f"RSS {name:8} {before:8.0f} MB idle, {rss[name]:8.0f} MB with "
                    f"{args.rss_count:,} queued transient 100-byte messages",
                    flush=True,
                )
                subprocess.run(["node", "-e", _DELETE, url, queue], check=True, cwd=ROOT)
            print(f"RSS ratio tandem/rabbitmq: {rss['tandem'] / rss['rabbitmq']:.2f}")
    finally:
        for t in tandems.values():
            t.stop()
        if started:
            subprocess.run(["rabbitmqctl", "stop"], capture_output=True, check=False)
    return 0


class Tally:
    """Each run's figures by broker and workload: the rate, the broker's CPU per message, and
    how busy the client was (its CPU over the run's time)."""

    def __init__(self) -> None:
        self.results: dict[tuple[str, str], list[float]] = {}
        self.costs: dict[tuple[str, str], list[float]] = {}
        self.clients: dict[tuple[str, str], list[float]] = {}

    def add(self, name: str, mode: str, r: dict[str, object], cpu: float, count: int) -> str:
        """One run's figures (`r`: firehose.js's result), returned as a line's end."""
        rate = float(r["rate"])  # type: ignore[arg-type]
        us = cpu / count * 1e6
        busy = float(r["clientCpu"]) / float(r["seconds"])  # type: ignore[arg-type]
        self.results.setdefault((name, mode), []).append(rate)
        self.costs.setdefault((name, mode), []).append(us)
        self.clients.setdefault((name, mode), []).append(busy)
        return f"{rate:9.0f} msg/s {us:6.1f} µs CPU/msg; client busy {busy:4.0%}"


def report(brokers: list[str], modes: list[str], tally: Tally) -> None:
    """Medians per broker and mode, each Tandem's ratio to RabbitMQ, and (with two Tandems)
    the change from before to after; then CPU per message, and how busy the client was."""
    tandems = [b for b in brokers if b != "rabbitmq"]
    head = "".join(f"{b:>15}" for b in brokers)
    ratios = "".join(f"{b + '/rmq':>18}" for b in tandems)
    change = f"{'after/before':>14}" if "tandem@before" in tandems else ""
    print(f"{'workload':20}{head}{ratios}{change}   (median msg/s)")
    for mode in modes:
        med = {b: statistics.median(tally.results[(b, mode)]) for b in brokers}
        line = f"{mode:20}" + "".join(f"{med[b]:15.0f}" for b in brokers)
        line += "".join(f"{med[b] / med['rabbitmq']:18.2f}" for b in tandems)
        if change:
            line += f"{med['tandem'] / med['tandem@before']:14.3f}"
        print(line)
    print(f"{'workload':20}" + "".join(f"{b:>15}" for b in brokers) + "   (median µs CPU/msg)")
    for mode in modes:
        costs = [statistics.median(tally.costs[(b, mode)]) for b in brokers]
        print(f"{mode:20}" + "".join(f"{x:15.1f}" for x in costs))
    # The client's JavaScript runs on one thread: near 100%, the client, not the broker, set
    # the rate, and a ratio between brokers is bounded by it.
    print(f"{'workload':20}" + "".join(f"{b:>15}" for b in brokers) + "   (median client busy)")
    for mode in modes:
        busy = [statistics.median(tally.clients[(b, mode)]) for b in brokers]
        print(f"{mode:20}" + "".join(f"{x:15.0%}" for x in busy))


_DELETE = """
const amqp = require('amqplib');
(async () => { const c = await amqp.connect(process.argv[1]);
  const ch = await c.createChannel(); await ch.deleteQueue(process.argv[2]); await c.close(); })();
"""

if __name__ == "__main__":
    raise SystemExit(main())
