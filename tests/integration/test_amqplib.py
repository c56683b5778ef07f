"""amqplib under Node.js, against the real broker."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import Broker

ROOT = Path(__file__).resolve().parents[2]


def test_amqplib_scenarios(broker: Broker) -> None:
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    if not (ROOT / "node_modules" / "amqplib").exists():
        pytest.fail("amqplib is missing: the test command runs `npm ci` first")
    r = subprocess.run(
        ["node", str(ROOT / "tests" / "js" / "amqplib_suite.js"), broker.url()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not ok" not in r.stdout
