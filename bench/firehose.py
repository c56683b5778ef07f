"""Firehose: Tandem against RabbitMQ, same client (amqplib), same machine, one run.

    python bench/firehose.py [--runs 5] [--rss-count 1000000] [--rabbitmq-url URL]

(a) 100,000 transient 100-byte messages without confirms, (b) 50,000 persistent messages on a
durable queue with publisher confirms, from one publisher and (c) from ten publisher
connections at once; one warm-up each, then RUNS runs alternating Tandem and RabbitMQ; medians
and the ratio Tandem/RabbitMQ. Then the RSS of each broker after 1,000,000
transient 100-byte messages are queued and confirmed. RabbitMQ is started with
`rabbitmq-server -detached` if nothing answers on its URL. Every message is checked to arrive.
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

ROOT = Path(__file__).resolve().parent.parent


def node(script: str, *args: str, timeout: float = 600) -> dict[str, object]:
    out = subprocess.run(
        ["node", str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"{script} failed: {out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def reachable(url: str) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 5672), timeout=1):
            return True
    except OSError:
        return False


def ensure_rabbitmq(url: str) -> None:
    if reachable(url):
        return
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


def rabbitmq_pid() -> int:
    out = subprocess.run(["pgrep", "-f", "beam.smp.*rabbit"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Tandem:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
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
    args = ap.parse_args()
    ensure_rabbitmq(args.rabbitmq_url)
    tandem = Tandem()
    brokers = {"tandem": tandem.url, "rabbitmq": args.rabbitmq_url}
    modes = {
        "transient": ("100000", "1"),
        "persistent": ("50000", "1"),
        "persistent-10": ("50000", "10"),
    }
    print(f"machine: {os.cpu_count()} cores; client: amqplib; runs: {args.runs}")
    try:
        results: dict[tuple[str, str], list[float]] = {}
        for mode, (count, publishers) in modes.items():
            kind = mode.split("-")[0]
            for url in brokers.values():
                node("firehose.js", url, kind, count, publishers)  # warm-up
            for run in range(args.runs):
                for name, url in brokers.items():
                    r = node("firehose.js", url, kind, count, publishers)
                    results.setdefault((name, mode), []).append(float(r["rate"]))  # type: ignore[arg-type]
                    print(
                        f"  {mode:13} run {run + 1} {name:8} {float(r['rate']):9.0f} msg/s",
                        flush=True,
                    )
        print()
        print(f"{'mode':15}{'tandem':>10}{'rabbitmq':>10}{'ratio':>8}   (median msg/s)")
        for mode in modes:
            t = statistics.median(results[("tandem", mode)])
            r = statistics.median(results[("rabbitmq", mode)])
            print(f"{mode:15}{t:10.0f}{r:10.0f}{t / r:8.2f}")
        print()
        if args.rss_count:
            tandem.stop()
            tandem = Tandem()
            brokers["tandem"] = tandem.url
            pids = {"tandem": tandem.proc.pid, "rabbitmq": rabbitmq_pid()}
            rss: dict[str, float] = {}
            for name, url in brokers.items():
                queue = f"rss-{os.getpid()}"
                before = rss_mb(pids[name])
                node("fill.js", url, queue, str(args.rss_count), timeout=1800)
                rss[name] = rss_mb(pids[name])
                print(
                    f"RSS {name:8} {before:8.0f} MB idle, {rss[name]:8.0f} MB with "
                    f"{args.rss_count:,} queued transient 100-byte messages",
                    flush=True,
                )
                subprocess.run(["node", "-e", _DELETE, url, queue], check=True, cwd=ROOT)
            print(f"RSS ratio tandem/rabbitmq: {rss['tandem'] / rss['rabbitmq']:.2f}")
    finally:
        tandem.stop()
    return 0


_DELETE = """
const amqp = require('amqplib');
(async () => { const c = await amqp.connect(process.argv[1]);
  const ch = await c.createChannel(); await ch.deleteQueue(process.argv[2]); await c.close(); })();
"""

if __name__ == "__main__":
    raise SystemExit(main())
