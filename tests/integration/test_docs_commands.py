"""Every command the README, docs/configuration.md and the examples' usage show, run as written
against a real broker, so that none of them can rot. Only the addresses are rewritten to the
test broker's ports (and the docs' `$TOKEN` is set); the benchmark commands of
docs/performance.md need RabbitMQ and live in bench/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pika
import pytest
import yaml

from tandem.broker import config
from tests.support import Broker, LocalCluster

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "docs-token"


def blocks(path: Path, lang: str, after: str = "") -> list[str]:
    text = path.read_text()
    if after:
        text = text.split(after, 1)[1]
    return re.findall(rf"```{lang}\n(.+?)\n```", text, re.S)


def shell_lines(block: str) -> list[str]:
    """The commands of a shell block: comments dropped, continuation lines joined."""
    joined = block.replace("\\\n", " ")
    commands = (" ".join(line.split(" #")[0].split()) for line in joined.splitlines())
    return [c for c in commands if c]


def pointed_at(line: str, b: Broker | LocalCluster) -> str:
    return line.replace("127.0.0.1:15672", f"127.0.0.1:{b.admin_port}").replace(
        "127.0.0.1:5672", f"127.0.0.1:{b.amqp_port}"
    )


def run(
    line: str, b: Broker | LocalCluster, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TANDEM_ADMIN_URL": f"http://127.0.0.1:{b.admin_port}",
        "TANDEM_CLUSTER_URL": f"http://127.0.0.1:{b.admin_port}",
        "TANDEM_ADMIN_TOKEN": TOKEN,
        "TOKEN": TOKEN,
        "AMQP_URL": b.url(),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    r = subprocess.run(
        ["bash", "-c", pointed_at(line, b)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture
def docs_broker(broker_factory: Any) -> Broker:
    return broker_factory({"admin_token": TOKEN})  # type: ignore[no-any-return]


def test_readme_tour_python_snippet(cluster: LocalCluster) -> None:
    (snippet,) = blocks(ROOT / "README.md", "python", after="## A five-minute tour")
    out = subprocess.run(
        [sys.executable, "-c", pointed_at(snippet, cluster)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "b'order 1'", out.stderr


def test_readme_tour_failover(cluster: LocalCluster) -> None:
    """The tour's failover, run as one script as a user pastes it."""
    failover = blocks(ROOT / "README.md", "sh", after="## A five-minute tour")[0]
    first = cluster.cluster()
    out = run(failover, cluster, timeout=240).stdout
    assert "published 10000 messages, all confirmed" in out
    assert "received 10000 distinct messages" in out
    after = cluster.cluster()
    assert after["epoch"] > first["epoch"] and after["primary"] != first["primary"]
    assert out.count("primary: ") == 2  # the status before and after


def test_readme_tour_admin_commands(cluster: LocalCluster) -> None:
    """The tour's admin lines run against the cluster's admin address: no admin token."""
    admin = blocks(ROOT / "README.md", "sh", after="## A five-minute tour")[1]
    lines = shell_lines(admin)
    assert any(line.startswith("curl") for line in lines)
    assert any(line.startswith("tandem ctl") for line in lines)
    before = cluster.cluster()["primary"]
    outputs = {line: run(line, cluster).stdout for line in lines}
    assert '"members"' in outputs["curl -s http://127.0.0.1:15672/cluster"]
    assert '"role": "primary"' in outputs["curl -s http://127.0.0.1:15672/status"]
    assert "tandem_connections" in outputs["curl -s http://127.0.0.1:15672/metrics"]
    cluster.wait_for(lambda c: c["primary"] != before and c["serving"], "the switchover")
    url = f"amqp://carol:s3cret@127.0.0.1:{cluster.amqp_port}/staging"
    pika.BlockingConnection(pika.URLParameters(url)).close()


def test_readme_yaml_config_is_valid() -> None:
    (example,) = blocks(ROOT / "README.md", "yaml")
    cfg = config.parse(yaml.safe_load(example), "README")
    assert cfg.tls and cfg.amqps_port == 5671 and cfg.permissions[0].read == "^app\\."


def test_configuration_doc_commands(docs_broker: Broker) -> None:
    lines = [
        line
        for block in blocks(ROOT / "docs" / "configuration.md", "sh")
        for line in shell_lines(block)
    ]
    assert len(lines) >= 4
    outputs = [run(line, docs_broker).stdout for line in lines]
    assert any("carol\tstaging\t^carol\\.\t.*\t.*" in out for out in outputs)
    assert docs_broker.http("GET", "/api/vhosts", token=TOKEN)[1] == [{"name": "/"}]


def usage(example: str) -> list[str]:
    doc = (ROOT / "examples" / example).read_text().split('"""')[1]
    return [line for line in shell_lines(doc) if line.startswith("python3 examples/")]


def test_examples_usage_lines_run_as_written(docs_broker: Broker) -> None:
    b = docs_broker
    (publish,) = usage("reliable_publisher.py")
    (consume,) = usage("consumer.py")
    server, client = usage("rpc.py")
    assert "published 1000 messages, all confirmed" in run(publish, b).stdout
    assert "received 1000 distinct messages" in run(consume, b).stdout
    rpc_server = subprocess.Popen(
        ["bash", "-c", f"exec {pointed_at(server, b)}"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert rpc_server.stdout is not None
        assert rpc_server.stdout.readline().strip() == "rpc server ready"
        assert run(client, b).stdout.strip() == "fib(10) = 55"
    finally:
        rpc_server.terminate()
        rpc_server.wait(10)


@pytest.mark.parametrize("example", ["reliable_publisher.py", "consumer.py", "rpc.py"])
def test_examples_help_keeps_usage_lines_apart_and_names_amqp_url(example: str) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    shown = [line.strip() for line in r.stdout.splitlines()]
    for line in usage(example):  # each usage line stands on its own line, not run together
        assert any(line.startswith(s.rstrip(" \\")) for s in shown if s.startswith("python3 "))
    assert sum(s.startswith("python3 examples/") for s in shown) == len(usage(example))
    assert "AMQP_URL" in r.stdout
