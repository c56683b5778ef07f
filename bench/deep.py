"""Deep queues: a queue far deeper than memory, filled, recovered after kill -9, drained.

    python bench/deep.py [--count 2000000] [--size 1024] [--rabbitmq] [--rabbitmq-url URL]

Tandem (a lone node, default settings) takes COUNT persistent messages of SIZE bytes into one
durable queue with confirms (bench/deep.js fill), is killed with SIGKILL, starts again, and the
queue is consumed in order (bench/deep.js drain); every message is checked to arrive once and
in order, and the queue to be empty after. Printed for each phase: its rate, the broker's
largest RSS during it (sampled every 0.2 s), and the log's size on disk at its end (after the
drain, again a second later, once the consumed segments are deleted); and the time from the
restart to a client reading the queue's depth. `--rabbitmq` runs the same fill and drain on
RabbitMQ (a classic queue, version 2, which keeps a deep queue on disk), alone on the machine,
for the rates side by side (no kill there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import alone
import pika
from clusters import keep_if_failed
from firehose import ensure_rabbitmq, node, rabbitmq_pid, rss_mb


class Sampler(threading.Thread):
    """The largest RSS of a process while a phase runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except OSError:
                return

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak


class LoneTandem:
    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start, and return the seconds until it serves (its ports file is written once it
        has recovered its log and listens)."""
        ports = self.dir / "ports.json"
        ports.unlink(missing_ok=True)
        start = time.monotonic()
        with open(self.dir / "broker.out", "ab") as out:  # shown if the run fails
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tandem.cli", "broker"),
                    *("--amqp-port", "0", "--admin-port", "0", "--data-dir", str(self.dir)),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        while not ports.exists():
            if self.proc.poll() is not None:
                raise SystemExit("tandem broker did not start")
            time.sleep(0.01)
        self.url = f"amqp://guest:guest@127.0.0.1:{json.loads(ports.read_text())['amqp']}"
        return time.monotonic() - start

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(60)


def log_mb(data_dir: Path) -> float:
    log_dir = data_dir / "log"  # spares too: consumed segments kept to be written over
    return sum(p.stat().st_size for p in [*log_dir.glob("*.seg"), *log_dir.glob("*.spare")]) / 2**20


def depth(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    n = conn.channel().queue_declare(queue, durable=True, passive=True).method.message_count
    conn.close()
    return int(n)


def phase(url: str, pid: int, queue: str, *args: str) -> tuple[dict[str, object], float]:
    sampler = Sampler(pid)
    sampler.start()
    result = node("deep.js", url, queue, *args, timeout=7200)
    return result, sampler.stop()


def run_tandem(count: int, size: int) -> None:
    # A source file changed since the last install runs it all as pure Python, slower.
    print(f"tandem: {alone.build(None)}", flush=True)
    data_dir = Path(tempfile.mkdtemp(prefix="tandem-deep-"))
    broker = LoneTandem(data_dir)
    failed = True
    try:
        broker.start()
        assert broker.proc is not None
        filled, fill_rss = phase(broker.url, broker.proc.pid, "deep", "fill", str(count), str(size))
        full_mb = log_mb(data_dir)
        broker.kill()
        took = broker.start()
        assert broker.proc is not None
        after_rss = rss_mb(broker.proc.pid)
        queued = depth(broker.url, "deep")
        if queued != count:
            raise SystemExit(f"after kill -9 the queue holds {queued} of {count}")
        drained, drain_rss = phase(broker.url, broker.proc.pid, "deep", "drain", str(count))
        left = depth(broker.url, "deep")  # a round trip after the last acks: written
        if left:
            raise SystemExit(f"drained, the queue still holds {left} messages")
        empty_mb = log_mb(data_dir)
        time.sleep(1.0)  # the writer's thread deletes the last consumed segments
        later_mb = log_mb(data_dir)
        print(f"tandem: {count:,} persistent messages of {size} bytes")
        print(
            f"  fill   {filled['rate']:>9,.0f} msg/s   peak RSS {fill_rss:>7,.0f} MB"
            f"   log {full_mb:>9,.0f} MB"
        )
        print(f"  kill -9, start again: serving in {took:.2f} s, RSS {after_rss:,.0f} MB")
        print(
            f"  drain  {drained['rate']:>9,.0f} msg/s   peak RSS {drain_rss:>7,.0f} MB"
            f"   log {empty_mb:>9,.0f} MB ({later_mb:,.0f} MB a second later)"
        )
        failed = False
    finally:
        broker.stop()
        keep_if_failed(data_dir, data_dir / "broker.out", "tandem broker's output", failed, 30)


def run_rabbitmq(url: str, count: int, size: int) -> None:
    started = ensure_rabbitmq(url)
    try:
        pid = rabbitmq_pid()
        queue = f"deep-{os.getpid()}"
        filled, fill_rss = phase(url, pid, queue, "fill", str(count), str(size))
        drained, drain_rss = phase(url, pid, queue, "drain", str(count))
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_delete(queue)
        conn.close()
        print(f"rabbitmq: {count:,} persistent messages of {size} bytes (classic queue v2)")
        print(f"  fill   {filled['rate']:>9,.0f} msg/s   peak RSS {fill_rss:>7,.0f} MB")
        print(f"  drain  {drained['rate']:>9,.0f} msg/s   peak RSS {drain_rss:>7,.0f} MB")
    finally:
        if started:
            subprocess.run(["rabbitmqctl", "stop"], capture_output=True, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=2_000_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rabbitmq", action="store_true", help="also fill and drain RabbitMQ")
    ap.add_argument("--rabbitmq-url", default="amqp://guest:guest@127.0.0.1:5672")
    args = ap.parse_args()
    run_tandem(args.count, args.size)
    if args.rabbitmq:
        run_rabbitmq(args.rabbitmq_url, args.count, args.size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
