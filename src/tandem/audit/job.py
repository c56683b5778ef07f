"""`tandem audit`: read the members' checkpoints, compare, report, and fail loudly.

    tandem audit --cluster http://127.0.0.1:15672          # the local cluster
    tandem audit --members http://10.0.0.5:15672,...        # any members
    tandem audit --kubernetes demo.default                  # a BrokerCluster, from inside

Exit codes: 0 all members agree (OK, LAGGING, MISSING/EXTRA on a backup are reported, not
failures); 1 a member DIVERGED, has another history (EPOCH_MISMATCH), lags past the limits
(LAG_EXCEEDED) or did not answer (UNREACHABLE); 2 the audit could not run (no members, no
primary, bad options).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tandem.audit import members, report, source, transforms

FAILED, CANNOT_RUN = 1, 2


@dataclass(frozen=True, slots=True)
class Options:
    urls: list[str]
    out: Path
    history: Path | None = None
    history_format: str = "parquet"
    max_lag_records: int = 100_000
    max_lag_seconds: float = 30.0
    token: str | None = None
    textfile: Path | None = None
    pushgateway: str | None = None
    cluster_name: str = "tandem"


def session(master: str | None = "local[2]") -> SparkSession:
    """A light session: no UI, few shuffle partitions, a quick JVM. `master` None: the one
    spark-submit gave (a SparkApplication's driver)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder
    if master:
        builder = builder.master(master)
    builder = (
        builder.appName("tandem-audit")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC -XX:TieredStopAtLevel=1")
        .config("spark.sql.session.timeZone", "UTC")
    )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def progress(text: str) -> None:
    print(f"tandem audit: {text}", file=sys.stderr, flush=True)


def run(options: Options, spark: SparkSession) -> int:
    started = time.monotonic()
    progress(f"reading the checkpoints of {len(options.urls)} members")
    rows = source.snapshot(spark, options.urls, options.token)
    for m in transforms.members(rows).where(~F.col("reachable")).collect():
        print(f"tandem audit: member {m['url']} {m['error']}", file=sys.stderr)
    if not transforms.primary(rows).take(1):
        print(
            "tandem audit: no member answered as primary; cannot compare (is the cluster "
            "failing over? run again)",
            file=sys.stderr,
        )
        return CANNOT_RUN
    progress("comparing every member with the primary at the same log position")
    results = transforms.audit(rows, options.max_lag_records, options.max_lag_seconds)
    results = results.withColumn("audited_at", F.lit(time.time())).localCheckpoint(eager=True)
    if options.history is not None:
        progress(f"appending to the history in {options.history}")
        _append(rows, options.history / "checkpoints", options.history_format)
        _append(results, options.history / "results", options.history_format)
        trend = _read(spark, options.history / "results", options.history_format)
    else:
        trend = results
    progress("writing the report")
    options.out.mkdir(parents=True, exist_ok=True)
    print(report.table(transforms.summary(results), results))
    report.json_lines(results, options.out / "audit.jsonl")
    report.plot(trend, options.out / "audit.png")
    figures = report.figures(results, options.cluster_name)
    if options.textfile is not None:
        report.write_textfile(figures, options.textfile)
    if options.pushgateway:
        report.push(figures, options.pushgateway, options.cluster_name)
    bad = transforms.failing(results).count()
    took = time.monotonic() - started
    print(
        f"tandem audit: {results.count()} rows, {bad} failing, in {took:.1f} s; report in "
        f"{options.out}/audit.jsonl and audit.png",
        file=sys.stderr,
    )
    return FAILED if bad else 0


def _append(frame: DataFrame, path: Path, fmt: str) -> None:
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out = frame.withColumn("day", F.lit(day)).write.mode("append").partitionBy("day")
    out.parquet(str(path)) if fmt == "parquet" else out.json(str(path))


def _read(spark: SparkSession, path: Path, fmt: str) -> DataFrame:
    return spark.read.parquet(str(path)) if fmt == "parquet" else spark.read.json(str(path))


def main(args: argparse.Namespace, spark: SparkSession | None = None) -> int:
    try:
        if args.cluster:
            urls = members.from_cluster(args.cluster, args.token)
            name = "local"
        elif args.members:
            urls = [u.strip() for u in args.members.split(",") if u.strip()]
            name = "tandem"
        else:
            name, _, namespace = args.kubernetes.partition(".")
            urls = members.from_kubernetes(name, namespace or "default")
    except members.DiscoveryError as exc:
        print(f"tandem audit: {exc}", file=sys.stderr)
        return CANNOT_RUN
    if not urls:
        print("tandem audit: no members to audit", file=sys.stderr)
        return CANNOT_RUN
    if args.checkpoint:
        made = members.request_checkpoint(urls, args.token)
        progress(
            f"checkpoint {made} made on the primary" if made else "no primary took a checkpoint"
        )
    options = Options(
        urls=urls,
        out=Path(args.out),
        history=Path(args.history) if args.history else None,
        history_format=args.history_format,
        max_lag_records=args.max_lag_records,
        max_lag_seconds=args.max_lag_seconds,
        token=args.token,
        textfile=Path(args.textfile) if args.textfile else None,
        pushgateway=args.pushgateway,
        cluster_name=name,
    )
    if spark is not None:
        return run(options, spark)
    # Under spark-submit (a SparkApplication's driver) the master is spark-submit's.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = args.master or (None if submitted else "local[2]")
    progress(f"starting Spark ({master or 'as submitted'})")
    own = session(master)
    try:
        return run(options, own)
    finally:
        own.stop()
