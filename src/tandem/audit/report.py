"""The audit's report: a table on stdout, JSON lines, a PNG of depth and lag over time, and
figures for alerting (a Prometheus textfile, or a Pushgateway)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway, write_to_textfile
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from tandem.audit import transforms

TABLE = ("node", "role", "vhost", "queue", "status", "position", "lag_records", "lag_seconds")
SHOWN = 40  # rows of the detail table; the JSON lines hold all


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _grid(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def table(summary: DataFrame, results: DataFrame) -> str:
    """The counts per status, then the rows: failing first, then the rest by node."""
    counts = [r.asDict() for r in summary.collect()]
    order = F.array_position(F.array(*[F.lit(s) for s in transforms.STATUSES]), F.col("status"))
    rows = [
        r.asDict() for r in results.orderBy(order, "node", "vhost", "queue").limit(SHOWN).collect()
    ]
    total = sum(c["count"] for c in counts)
    text = _grid(counts, ("status", "count")) + "\n\n" + _grid(rows, TABLE)
    if total > SHOWN:
        text += f"\n... {total - SHOWN} more rows in audit.jsonl"
    return text


def json_lines(results: DataFrame, path: Path) -> None:
    with path.open("w") as f:
        for row in results.toLocalIterator():
            f.write(json.dumps(row.asDict(), sort_keys=True) + "\n")


def plot(trend: DataFrame, path: Path) -> None:
    """Depth of each replicated queue on the primary, and each backup's lag, per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    primary_rows = (
        trend.where((F.col("role") == "primary") & F.col("queue").isNotNull())
        .select("vhost", "queue", "checkpoint_time", "primary_depth")
        .dropDuplicates(["vhost", "queue", "checkpoint_time"])
        .orderBy("checkpoint_time")
        .collect()
    )
    backup_rows = (
        trend.where((F.col("role") != "primary") & F.col("lag_records").isNotNull())
        .groupBy("node", "audited_at")
        .agg(F.max("lag_records").alias("lag_records"))
        .orderBy("audited_at")
        .collect()
    )
    fig, (depth_ax, lag_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    depths: dict[str, list[tuple[float, int]]] = {}
    lags: dict[str, list[tuple[float, int]]] = {}
    for r in primary_rows:
        if r["primary_depth"] is not None:
            point = (r["checkpoint_time"], r["primary_depth"])
            depths.setdefault(f"{r['vhost']} {r['queue']}", []).append(point)
    for r in backup_rows:
        lags.setdefault(str(r["node"]), []).append((r["audited_at"], r["lag_records"]))
    for label, points in sorted(depths.items()):
        depth_ax.plot(*_xy(points), marker=".", label=label)
    for label, points in sorted(lags.items()):
        lag_ax.plot(*_xy(points), marker=".", label=label)
    highest = max((v for points in lags.values() for _, v in points), default=0)
    lag_ax.set_ylim(0, max(1, highest * 1.1))
    depth_ax.set_title("Depth of each replicated queue on the primary (ready + unacked)")
    depth_ax.set_ylabel("messages")
    lag_ax.set_title("Each backup's lag behind the primary")
    lag_ax.set_ylabel("records")
    lag_ax.set_xlabel("time (UTC): of the checkpoint above, of the audit below")
    for ax, series in ((depth_ax, depths), (lag_ax, lags)):
        if series:
            ax.legend(loc="upper left", fontsize="small")
        else:
            ax.text(0.5, 0.5, "nothing to show yet", ha="center", transform=ax.transAxes)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _xy(points: list[tuple[float, int]]) -> tuple[list[Any], list[int]]:
    import datetime

    xs = [datetime.datetime.fromtimestamp(t, datetime.UTC) for t, _ in points]
    return xs, [v for _, v in points]


def figures(results: DataFrame, cluster: str) -> CollectorRegistry:
    """The audit's outcome as gauges: rows per status, each member's lag, the failing rows."""
    registry = CollectorRegistry()
    rows = Gauge(
        "tandem_audit_rows",
        "Audited (member, queue) rows per status",
        ["cluster", "status"],
        registry=registry,
    )
    counts = {r["status"]: r["count"] for r in transforms.summary(results).collect()}
    for status in transforms.STATUSES:
        rows.labels(cluster, status).set(counts.get(status, 0))
    lag_records = Gauge(
        "tandem_audit_lag_records",
        "A member's lag behind the primary, in records",
        ["cluster", "node"],
        registry=registry,
    )
    lag_seconds = Gauge(
        "tandem_audit_lag_seconds",
        "A member's lag behind the primary, in seconds",
        ["cluster", "node"],
        registry=registry,
    )
    per_member = results.groupBy("node").agg(
        F.max("lag_records").alias("records"), F.max("lag_seconds").alias("seconds")
    )
    for r in per_member.collect():
        if r["records"] is not None:
            lag_records.labels(cluster, r["node"]).set(r["records"])
        if r["seconds"] is not None:
            lag_seconds.labels(cluster, r["node"]).set(r["seconds"])
    failing = Gauge(
        "tandem_audit_failing",
        "Rows DIVERGED, EPOCH_MISMATCH, LAG_EXCEEDED or UNREACHABLE",
        ["cluster"],
        registry=registry,
    )
    failing.labels(cluster).set(sum(counts.get(s, 0) for s in transforms.FAILING))
    last = Gauge(
        "tandem_audit_last_run_timestamp_seconds",
        "When the audit last ran",
        ["cluster"],
        registry=registry,
    )
    last.labels(cluster).set(time.time())
    return registry


def write_textfile(registry: CollectorRegistry, path: Path) -> None:
    write_to_textfile(str(path), registry)


def push(registry: CollectorRegistry, url: str, cluster: str) -> None:
    push_to_gateway(url, job="tandem-audit", grouping_key={"cluster": cluster}, registry=registry)
