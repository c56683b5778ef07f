"""The audit at scale: generated checkpoint rows (as the tandem_checkpoints source yields
them) through the real transforms, in Spark local mode on this machine.

    python bench/audit.py [--rows 10000000] [--members 3] [--checkpoints 100] [--master local[2]]

The rows are members x checkpoints x queues (queues make up the rest): a long history of a
cluster with many queues, or many clusters. One backup diverges on one queue at the latest
checkpoint and one lags one checkpoint behind, so the comparison does real work. Prints the
time to audit and the checkpoint rows per second, twice (the first run warms the JVM).
There is no RabbitMQ counterpart: RabbitMQ has no such audit.
"""

from __future__ import annotations

import argparse
import time

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tandem.audit import transforms
from tandem.audit.job import session


def generate(spark: SparkSession, rows: int, members: int, checkpoints: int) -> DataFrame:
    queues = max(1, rows // (members * checkpoints))
    ids = spark.range(members * checkpoints * queues)
    member = (F.col("id") % members).cast("int")
    cp = ((F.col("id") / members).cast("long") % checkpoints).cast("long")
    queue = (F.col("id") / (members * checkpoints)).cast("long")
    lagging = member == members - 1  # the last member has not recorded the newest checkpoint
    frame = ids.select(
        F.concat(F.lit("tandem-"), member).alias("node"),
        member.alias("m"),
        cp.alias("cp"),
        queue.alias("q"),
    ).where(~(lagging & (F.col("cp") == checkpoints - 1)))
    depth = F.col("q") % 1000 + F.col("cp")
    diverged = (F.col("m") == 1) & (F.col("q") == 7) & (F.col("cp") == checkpoints - 1)
    queue_rows = frame.select(
        "node",
        F.lit("http://bench").alias("url"),
        F.when(F.col("m") == 0, "primary").otherwise("backup").alias("role"),
        F.lit(True).alias("reachable"),
        F.lit(None).cast("string").alias("error"),
        F.lit(1).cast("long").alias("epoch"),
        ((F.col("cp") + 1) * 10_000).alias("position"),
        (F.col("cp") * 60.0 + 1.8e9).alias("time"),
        (F.col("cp") * 60.0 + 1.8e9 + 0.01).alias("recorded_at"),
        F.lit("/").alias("vhost"),
        F.concat(F.lit("q-"), F.col("q")).alias("queue"),
        F.when(diverged, depth + 1).otherwise(depth).cast("long").alias("depth"),
        F.lit("all").alias("replicate"),
    )
    marks = (
        queue_rows.select(*[c for c in queue_rows.columns if c not in ("vhost", "queue")])
        .drop("depth", "replicate")
        .distinct()
        .select(
            "*",
            F.lit(None).cast("string").alias("vhost"),
            F.lit(None).cast("string").alias("queue"),
            F.lit(None).cast("long").alias("depth"),
            F.lit(None).cast("string").alias("replicate"),
        )
    )
    return queue_rows.unionByName(marks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--checkpoints", type=int, default=100)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    spark = session(args.master)
    spark.conf.set("spark.sql.shuffle.partitions", "8")
    rows = generate(spark, args.rows, args.members, args.checkpoints).cache()
    count = rows.count()  # generate and cache before the clock starts
    print(f"{count:,} checkpoint rows ({args.members} members, {args.checkpoints} checkpoints)")
    for run in ("first (cold JVM)", "second"):
        started = time.perf_counter()
        results = transforms.audit(rows, 100_000, 600.0).cache()
        summary = {r["status"]: r["count"] for r in transforms.summary(results).collect()}
        took = time.perf_counter() - started
        results.unpersist()
        print(
            f"{run}: audited in {took:.1f} s, {count / took:,.0f} rows/s; statuses {summary}",
            flush=True,
        )
    spark.stop()


if __name__ == "__main__":
    main()
