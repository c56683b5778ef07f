"""The container image: deploy/build-image.sh builds it here (podman, a base made from Debian
packages, no registry), and the broker inside answers AMQP on the host's network."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from tests.support import wait_for_amqp

ROOT = Path(__file__).resolve().parents[2]
RUN = ["podman", "--runtime", "runc"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None and os.geteuid() != 0:
        pytest.skip("podman is not installed and installing it needs root")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("podman is not installed and this machine has no apt-get to install it")
    out = subprocess.run(
        [str(ROOT / "deploy" / "build-image.sh")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _logs(name: str) -> str:
    """The container's output: the broker logs to stderr."""
    out = subprocess.run([*RUN, "logs", name], capture_output=True, text=True)
    return out.stdout + out.stderr


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, int, int]]:
    amqp, admin = _free_port(), _free_port()
    name = f"tandem-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [
            *(*RUN, "run", "-d", "--rm", "--network", "host", "--name", name, image),
            *("broker", "--config", "/etc/tandem/tandem.yaml", "--host", "127.0.0.1"),
            *("--amqp-port", str(amqp), "--admin-port", str(admin)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield name, amqp, admin
    finally:
        logs = _logs(name)
        subprocess.run([*RUN, "rm", "-f", "-t", "5", name], capture_output=True, timeout=60)
        assert "please report it as a bug" not in logs, logs


@pytest.mark.timeout(900)
def test_the_image_runs_the_broker_as_a_non_root_user_and_answers_amqp(
    image: str, container: tuple[str, int, int]
) -> None:
    name, amqp, admin = container
    wait_for_amqp(amqp, timeout=60)
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("image-check", durable=True)
    ch.basic_publish("", "image-check", b"from the host", pika.BasicProperties(delivery_mode=2))
    _, _, body = ch.basic_get("image-check", auto_ack=True)
    assert body == b"from the host"
    conn.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/health", timeout=5) as r:
        assert json.loads(r.read())["status"] == "ok"
    uid = subprocess.run(
        [*RUN, "exec", name, "id", "-u"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert uid == "10001"
    assert "running compiled" in _logs(name)  # the build stage compiled it (setup.py)
    inspect = subprocess.run(
        [*RUN, "image", "inspect", "--format", "{{json .Config}}", image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    config = json.loads(inspect)
    assert config["Entrypoint"] == ["tandem"] and config["User"] == "10001"
    assert "/var/lib/tandem" in config["Volumes"]


@pytest.mark.timeout(900)
def test_the_image_installs_the_versions_the_tests_run_on(image: str) -> None:
    freeze = subprocess.run(
        [
            *(*RUN, "run", "--rm", "--entrypoint", "/opt/tandem/bin/python", image),
            *("-m", "pip", "freeze", "--exclude-editable"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    pinned = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    inside = dict(line.split("==", 1) for line in freeze.splitlines() if "==" in line)
    assert {"kopf", "kubernetes", "pamqp", "pydantic"} <= inside.keys()
    differ = {n: (pinned.get(n), v) for n, v in inside.items() if pinned.get(n) != v}
    assert not differ, f"the image's versions differ from constraints.txt: {differ}"
