"""Celery (kombu over py-amqp, a third client implementation) against the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import Broker

HERE = Path(__file__).resolve().parent


def test_kombu_priorities_and_simple_queue(broker: Broker) -> None:
    kombu = pytest.importorskip("kombu")
    ex = kombu.Exchange("kombu-tasks", "direct", durable=True)
    q = kombu.Queue("kombu-q", ex, routing_key="k", queue_arguments={"x-max-priority": 10})
    with kombu.Connection(broker.url().replace("%2F", "/")) as conn:
        producer = kombu.Producer(conn)
        for i in range(5):
            producer.publish({"n": i}, exchange=ex, routing_key="k", declare=[q], priority=i)
        got: list[int] = []
        with kombu.Consumer(
            conn, [q], callbacks=[lambda body, m: (got.append(body["n"]), m.ack())]
        ):
            while len(got) < 5:
                conn.drain_events(timeout=5)
        assert got == [4, 3, 2, 1, 0]
        simple = conn.SimpleQueue("kombu-simple")
        simple.put({"hello": "world"})
        msg = simple.get(timeout=5)
        assert msg.payload == {"hello": "world"}
        msg.ack()
        simple.close()


def test_celery_worker_runs_tasks_and_returns_results(broker: Broker) -> None:
    pytest.importorskip("celery")
    env = dict(os.environ, TANDEM_TEST_AMQP_URL=broker.url().replace("%2F", "/"))
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_app",
            "worker",
            "--pool=solo",
            "--loglevel=WARNING",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, celery_app; r = [celery_app.add.delay(i, i) for i in range(20)];"
                "print(json.dumps([x.get(timeout=60) for x in r]))",
            ],
            cwd=HERE,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert client.returncode == 0, client.stdout + client.stderr
        assert json.loads(client.stdout) == [2 * i for i in range(20)]
    finally:
        worker.terminate()
        out, _ = worker.communicate(timeout=30)
    assert "Traceback" not in out, out
