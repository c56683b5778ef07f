"""The audit against a real local cluster: the Data Source reads each member, a healthy cluster
passes, a backup made to diverge on purpose (a test-only fault that drops its enqueues to one
queue) fails the audit, and a member that is down or is not a member is reported."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pika
import pytest
from pyspark.sql import SparkSession

from tandem.audit import job, members, source
from tandem.cli import parser
from tests.support import BUG_PHRASE, LocalCluster

QUEUES = ("orders", "diverging")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Every member drops the enqueues to `diverging` it takes as a backup.
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_TEST_FAULT_DROP_ENQUEUES", "*:diverging")
    c = LocalCluster(tmp_path_factory.mktemp("audit") / "cluster", 3).start()
    mp.undo()
    yield c
    c.stop()
    assert BUG_PHRASE not in c.logs(), c.logs()


def publish(c: LocalCluster, queue: str, count: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(c.url()))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    for i in range(count):
        ch.basic_publish("", queue, f"{queue} {i}".encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()


def checkpoint(c: LocalCluster) -> str:
    """A fresh checkpoint, once every member has recorded it."""
    urls = members.from_cluster(f"http://127.0.0.1:{c.admin_port}")
    made = members.request_checkpoint(urls)
    assert made is not None
    epoch, position = (int(x) for x in made.split(":"))

    def recorded(_: object) -> bool:
        for url in urls:
            with urllib.request.urlopen(url + "/replication/checkpoints", timeout=5) as r:
                cps = json.loads(r.read())["checkpoints"]
            if not any(cp["epoch"] == epoch and cp["position"] == position for cp in cps):
                return False
        return True

    c.wait_for(recorded, f"checkpoint {made} on every member")
    return made


def audit(spark: SparkSession, out: Path, *args: str) -> tuple[int, list[dict[str, object]]]:
    parsed = parser().parse_args(["audit", "--out", str(out), *args])
    code = job.main(parsed, spark=spark)
    lines = (out / "audit.jsonl").read_text().splitlines() if (out / "audit.jsonl").exists() else []
    return code, [json.loads(line) for line in lines]


def test_the_source_reads_one_partition_per_member(
    spark: SparkSession, cluster: LocalCluster
) -> None:
    urls = members.from_cluster(f"http://127.0.0.1:{cluster.admin_port}")
    assert len(urls) == 3
    checkpoint(cluster)
    frame = source.snapshot(spark, urls)
    assert frame.rdd.getNumPartitions() == 3
    assert not frame.where("not reachable").collect()
    nodes = {r["node"] for r in frame.select("node").distinct().collect()}
    assert nodes == {"tandem-1", "tandem-2", "tandem-3"}
    roles = sorted(r["role"] for r in frame.select("node", "role").distinct().collect())
    assert roles == ["backup", "backup", "primary"]


def test_a_healthy_cluster_passes_and_a_diverged_backup_fails(
    spark: SparkSession, cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = f"http://127.0.0.1:{cluster.admin_port}"
    history = tmp_path / "history"
    publish(cluster, "orders", 200)
    checkpoint(cluster)
    code, rows = audit(spark, tmp_path / "first", "--cluster", admin, "--history", str(history))
    assert code == 0, rows
    assert {r["status"] for r in rows} == {"OK"}
    assert {r["queue"] for r in rows} == {"orders"}
    assert all(r["depth"] == 200 for r in rows)

    publish(cluster, "diverging", 50)
    textfile = tmp_path / "audit.prom"
    code, rows = audit(
        spark,
        tmp_path / "second",
        "--cluster",
        admin,
        "--checkpoint",  # the audit asks for the checkpoint itself
        "--history",
        str(history),
        "--textfile",
        str(textfile),
    )
    assert code == job.FAILED
    by = {(r["node"], r["queue"]): r for r in rows}
    primary = cluster.cluster()["primary"]
    backups = {n for n, _ in by} - {primary}
    for node in backups:
        assert by[node, "diverging"]["status"] in ("DIVERGED", "LAGGING"), by[node, "diverging"]
        assert by[node, "orders"]["status"] in ("OK", "LAGGING")
    assert any(by[n, "diverging"]["status"] == "DIVERGED" for n in backups)
    assert by[primary, "diverging"]["depth"] == 50
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "STATUS" in out
    assert (tmp_path / "second" / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'tandem_audit_rows{cluster="local",status="DIVERGED"}' in textfile.read_text()
    assert len(list((history / "results").rglob("*.parquet"))) >= 2  # both runs kept


class NotAMember(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_members_that_do_not_answer_or_answer_wrongly_are_reported(
    spark: SparkSession, cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotAMember)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = members.from_cluster(f"http://127.0.0.1:{cluster.admin_port}")
        stranger = f"http://127.0.0.1:{server.server_address[1]}"
        dead = "http://127.0.0.1:9"  # discard: nobody listens
        code, rows = audit(spark, tmp_path, "--members", ",".join([*urls, stranger, dead]))
    finally:
        server.shutdown()
    assert code == job.FAILED
    unreachable = {r["node"]: r["detail"] for r in rows if r["status"] == "UNREACHABLE"}
    assert "not JSON" in unreachable[stranger.removeprefix("http://")]
    assert "does not answer" in unreachable["127.0.0.1:9"]
    err = capsys.readouterr().err
    assert "127.0.0.1:9 does not answer" in err


def test_no_members_found_is_a_clear_error(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = audit(spark, tmp_path, "--cluster", "http://127.0.0.1:9")
    assert code == job.CANNOT_RUN
    assert "cannot read the cluster's members from http://127.0.0.1:9/cluster" in (
        capsys.readouterr().err
    )


def test_without_pyspark_the_command_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['pyspark'] = None; from tandem.cli import main; "
        "sys.exit(main(['audit', '--members', 'http://127.0.0.1:9']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    assert "python3 -m pip install -c constraints.txt -e '.[audit]'" in out.stderr


def test_the_parser_takes_every_documented_option() -> None:
    args = parser().parse_args(
        ["audit", "--kubernetes", "demo.queues", "--max-lag-records", "5", "--master", "local[1]"]
    )
    assert isinstance(args, argparse.Namespace) and args.kubernetes == "demo.queues"
