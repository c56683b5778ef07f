"""The report's outputs for alerting: a Prometheus textfile and a Pushgateway push (to a
local HTTP server standing in for the Pushgateway, which accepts any PUT)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pyspark.sql import SparkSession

from tandem.audit import members, report, transforms
from tests.audit.test_transforms import A, T, cp, down


class Gateway(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        Gateway.received.append((self.command, self.path, self.rfile.read(length)))
        self.send_response(200)
        self.end_headers()

    do_POST = do_PUT

    def log_message(self, *args: object) -> None:
        pass


def test_the_figures_reach_a_textfile_and_a_pushgateway(
    spark: SparkSession, tmp_path: Path
) -> None:
    rows = spark.createDataFrame(
        cp("p", "primary", 1, 100, T, A)
        + cp("b1", "backup", 1, 100, T, ("/", "a", 4, "all"))
        + down("b2"),
        members.SCHEMA,
    )
    results = transforms.audit(rows, 1000, 60)
    figures = report.figures(results, "orders")
    path = tmp_path / "tandem_audit.prom"
    report.write_textfile(figures, path)
    text = path.read_text()
    assert 'tandem_audit_rows{cluster="orders",status="DIVERGED"} 1.0' in text
    assert 'tandem_audit_failing{cluster="orders"} 2.0' in text  # DIVERGED + UNREACHABLE
    assert 'tandem_audit_lag_records{cluster="orders",node="b1"} 0.0' in text

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        report.push(figures, f"http://127.0.0.1:{server.server_address[1]}", "orders")
    finally:
        server.shutdown()
    ((method, where, body),) = Gateway.received
    assert method == "PUT" and where == "/metrics/job/tandem-audit/cluster/orders"
    assert b"tandem_audit_failing" in body
