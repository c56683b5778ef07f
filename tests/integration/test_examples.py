"""The programs in examples/ run as a user runs them, against a real broker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support import Broker

ROOT = Path(__file__).resolve().parents[2]


def example(name: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / name), *args]


def test_reliable_publisher_survives_kill_9_and_consumer_gets_everything(broker: Broker) -> None:
    count = 3000
    pub = subprocess.Popen(
        example(
            "reliable_publisher.py",
            "--url",
            broker.url(),
            "--queue",
            "orders",
            "--count",
            str(count),
            "--max-wait",
            "60",
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while True:  # wait until publishing is under way, then kill the broker under it
        queues = {q["name"]: q for q in broker.status()["queues"]}
        if queues.get("orders", {}).get("depth", 0) > 200:
            break
        assert time.monotonic() < deadline, "publisher never got going"
        assert pub.poll() is None, "publisher finished before the broker was killed"
    broker.kill()
    broker.start()
    out, _ = pub.communicate(timeout=90)
    assert pub.returncode == 0, out
    assert f"published {count} messages, all confirmed" in out
    assert "connection lost" in out
    r = subprocess.run(
        example(
            "consumer.py",
            "--url",
            broker.url(),
            "--queue",
            "orders",
            "--expect",
            str(count),
            "--idle",
            "5",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"received {count} distinct messages" in r.stdout, r.stdout + r.stderr


def test_rpc_example(broker: Broker) -> None:
    server = subprocess.Popen(
        example("rpc.py", "server", "--url", broker.url(), "--limit", "1"),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "rpc server ready"
    r = subprocess.run(
        example("rpc.py", "client", "10", "--url", broker.url()),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.strip() == "fib(10) = 55", r.stdout + r.stderr
    assert server.wait(10) == 0
