"""The README's Quick start commands, run as written, so they cannot rot."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pika
import pytest

from tests.support import wait_for_amqp

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", section)


def test_quick_start_has_exactly_two_one_line_commands() -> None:
    commands = quick_start()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start()[1] in ci.splitlines()


def test_first_command_runs_a_cluster_clients_can_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 5672)) == 0:
            pytest.skip("port 5672 is taken on this machine (a RabbitMQ for the benchmarks?)")
    data = ROOT / "tandem-data"
    existed = data.exists()
    proc = subprocess.Popen(
        ["bash", "-c", quick_start()[0]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_amqp(5672, timeout=120)
        conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/"))
        ch = conn.channel()
        ch.queue_declare("readme", durable=True)
        ch.basic_publish("", "readme", b"hello")
        assert ch.basic_get("readme", auto_ack=True)[2] == b"hello"
        conn.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        if not existed:
            shutil.rmtree(data, ignore_errors=True)
    assert "tandem cluster of 3 ready: amqp://guest:guest@127.0.0.1:5672/" in out
    assert "admin http://127.0.0.1:15672/cluster" in out
