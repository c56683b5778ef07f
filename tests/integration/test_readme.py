"""The README's Quick start commands, run as written, so they cannot rot."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import pika
import pytest

from tests.support import LocalCluster, wait_for_amqp

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


def test_the_readme_example_config_runs_a_cluster_with_tls(
    tmp_path: Path, certs: tuple[Path, Path]
) -> None:
    """`tandem cluster up --config` with the README's own example, as written but for its
    certificate paths (the test's) and tls_port (a free one)."""
    cert, key = certs
    text = (ROOT / "README.md").read_text()
    example = re.search(r"Configure with a YAML file.*?```yaml\n(.+?)\n```", text, re.S)
    assert example is not None
    config = (
        example.group(1)
        .replace("/etc/tandem/cert.pem", str(cert))
        .replace("/etc/tandem/key.pem", str(key))
        .replace("tls_port: 5671", "tls_port: 0")
    )
    (tmp_path / "tandem.yaml").write_text(config)
    (tmp_path / "rabbitmq-definitions.json").write_text("{}")  # its optional migration
    c = LocalCluster(tmp_path / "cluster", 3, "--config", str(tmp_path / "tandem.yaml"))
    c.token = "change-me"
    c.start()
    try:
        amqps = json.loads((c.data_dir / "cluster.json").read_text())["amqps"]
        ctx = ssl.create_default_context(cafile=str(cert))
        params = pika.ConnectionParameters(
            "127.0.0.1",
            amqps,
            "prod",
            pika.PlainCredentials("app", "app-secret"),
            ssl_options=pika.SSLOptions(ctx, "localhost"),
        )
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("app.orders", durable=True)
        ch.exchange_declare("app.events", "fanout", durable=True)  # its permissions: ^app\.
        ch.queue_bind("app.orders", "app.events")
        ch.basic_publish("app.events", "", b"1", pika.BasicProperties(delivery_mode=2))
        _method, _props, body = ch.basic_get("app.orders", auto_ack=True)
        assert body == b"1"
        conn.close()
    finally:
        c.stop()
