"""The audit's comparison, as pure DataFrame transforms (no I/O, no collect).

Input: the checkpoint rows of every member (`members.SCHEMA`). Every member compares itself
with the primary at the same log position: the latest audit checkpoint both recorded,
joined on (epoch, position, vhost, queue). Each member and queue gets one status, the first
that holds:

| status | when |
|---|---|
| UNREACHABLE | the member did not answer, or answered something unexpected |
| EPOCH_MISMATCH | the member recorded a checkpoint the primary never made: another history |
| LAG_EXCEEDED | its latest checkpoint is behind the primary's by more than the limits |
| LAGGING | behind, within the limits, and no checkpoint in common yet to compare at |
| MISSING_ON_BACKUP | at the common checkpoint the primary had the queue, the member not |
| EXTRA_ON_BACKUP | ... the member had a queue the primary did not |
| DIVERGED | ... both had it, replicated `all`, with different depths: the real alarm |
| OK | ... the same depth (or, replicated `configuration`, both have the queue) |

Lag is measured between the member's latest checkpoint and the primary's: in records
(positions) and seconds (the checkpoints' times, both stamped by the primary's clock).
Queues replicated `none` are the primary's alone and are not compared.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

STATUSES = (
    "UNREACHABLE",
    "EPOCH_MISMATCH",
    "LAG_EXCEEDED",
    "LAGGING",
    "MISSING_ON_BACKUP",
    "EXTRA_ON_BACKUP",
    "DIVERGED",
    "OK",
)
FAILING = ("UNREACHABLE", "EPOCH_MISMATCH", "LAG_EXCEEDED", "DIVERGED")
COLUMNS = (
    "node",
    "role",
    "vhost",
    "queue",
    "status",
    "epoch",
    "position",
    "checkpoint_time",
    "lag_records",
    "lag_seconds",
    "primary_depth",
    "depth",
    "detail",
)


def members(rows: DataFrame) -> DataFrame:
    """One row per member: node, url, role, reachable, error."""
    return rows.select("node", "url", "role", "reachable", "error").distinct()


def checkpoints(rows: DataFrame) -> DataFrame:
    """One row per member and checkpoint it recorded: node, epoch, position, time."""
    marks = rows.where(F.col("epoch").isNotNull() & F.col("queue").isNull())
    return marks.select("node", "epoch", "position", "time").distinct()


def queues(rows: DataFrame) -> DataFrame:
    """The replicated queues at each checkpoint: node, epoch, position, vhost, queue, depth,
    replicate."""
    return rows.where(F.col("queue").isNotNull() & (F.col("replicate") != F.lit("none"))).select(
        "node", "epoch", "position", "vhost", "queue", "depth", "replicate"
    )


def primary(rows: DataFrame) -> DataFrame:
    """The primary's name (one row): the member answering as primary whose latest checkpoint
    is at the highest epoch (two answer so only in the instant of a failover)."""
    marks = checkpoints(rows)
    latest = marks.groupBy("node").agg(F.max("epoch").alias("top_epoch"))
    candidates = (
        members(rows)
        .where(F.col("reachable") & (F.col("role") == F.lit("primary")))
        .join(latest, "node", "left")
    )
    rank = Window.orderBy(F.col("top_epoch").desc_nulls_last(), F.col("node"))
    return (
        candidates.withColumn("n", F.row_number().over(rank))
        .where(F.col("n") == 1)
        .select(F.col("node").alias("primary"))
    )


def audit(rows: DataFrame, max_lag_records: int, max_lag_seconds: float) -> DataFrame:
    """One status per member and queue (COLUMNS), the primary's own rows included as OK."""
    who = primary(rows)
    is_primary = F.col("node") == F.col("primary")
    point = F.struct("epoch", "position", "time")
    # Every checkpoint, marked with whether the primary recorded it too.
    marks = (
        checkpoints(rows)
        .crossJoin(who)
        .withColumn(
            "on_primary",
            F.max(is_primary.cast("int")).over(Window.partitionBy("epoch", "position")) == 1,
        )
    )
    ref = marks.where(is_primary).agg(
        F.max_by(point, "position").alias("pl"), F.min("position").alias("p_oldest")
    )
    foreign = ~F.col("on_primary") & (
        (F.col("position") > F.col("pl.position"))
        | (F.col("epoch") > F.col("pl.epoch"))
        | (F.col("position") >= F.col("p_oldest"))
    )
    per_member = (
        marks.where(~is_primary)
        .crossJoin(ref)
        .groupBy("node")
        .agg(
            F.max_by(point, "position").alias("ml"),
            F.max_by(point, F.when(F.col("on_primary"), F.col("position"))).alias("c"),
            F.max(F.when(foreign, F.struct("epoch", "position"))).alias("foreign"),
        )
    )
    exceeded = (F.col("lag_records") > F.lit(max_lag_records)) | (
        F.col("lag_seconds") > F.lit(max_lag_seconds)
    )
    state = (
        members(rows)
        .join(who, F.col("node") == F.col("primary"), "left_anti")
        .join(per_member, "node", "left")
        .crossJoin(ref)
        .withColumn("lag_records", F.col("pl.position") - F.col("ml.position"))
        .withColumn("lag_seconds", F.round(F.col("pl.time") - F.col("ml.time"), 3))
        .withColumn(
            "member_status",
            F.when(~F.col("reachable"), "UNREACHABLE")
            .when(F.col("foreign").isNotNull(), "EPOCH_MISMATCH")
            .when(exceeded, "LAG_EXCEEDED")
            .when(F.col("c").isNull(), "LAGGING"),
        )
        .withColumn("detail", _member_detail())
    )
    qs = queues(rows)
    p_qs = qs.join(who, is_primary).select(
        "epoch", "position", "vhost", "queue", F.col("depth").alias("primary_depth"), "replicate"
    )
    at_pl = (F.col("epoch") == F.col("pl.epoch")) & (F.col("position") == F.col("pl.position"))
    p_now = p_qs.join(ref, at_pl).select("vhost", "queue", "primary_depth")

    # The primary itself, and members that stop at a member-level status: one row for each
    # queue the primary has now (or one without a queue).
    primary_rows = _result(
        members(rows).join(who, is_primary).crossJoin(ref).join(p_now, how="left"),
        status=F.lit("OK"),
        epoch=F.col("pl.epoch"),
        position=F.col("pl.position"),
        checkpoint_time=F.col("pl.time"),
        lag_records=F.lit(0).cast("long"),
        lag_seconds=F.lit(0.0),
        depth=F.col("primary_depth"),
        detail=F.lit("the primary"),
    )
    stopped = _result(
        state.where(F.col("member_status").isNotNull()).join(p_now, how="left"),
        status=F.col("member_status"),
        epoch=F.col("c.epoch"),
        position=F.col("c.position"),
        checkpoint_time=F.col("c.time"),
        depth=F.lit(None).cast("long"),
    )

    # The others, queue by queue at the checkpoint they have in common with the primary.
    compared = state.where(F.col("member_status").isNull()).select(
        "node",
        "role",
        F.col("c.epoch").alias("c_epoch"),
        F.col("c.position").alias("c_position"),
        F.col("c.time").alias("checkpoint_time"),
        "lag_records",
        "lag_seconds",
    )
    at_c = (F.col("epoch") == F.col("c_epoch")) & (F.col("position") == F.col("c_position"))
    key = ["node", "vhost", "queue"]
    theirs = qs.join(compared.select("node", "c_epoch", "c_position"), "node").where(at_c)
    ours = p_qs.crossJoin(compared.select("node", "c_epoch", "c_position")).where(at_c)
    side_by_side = ours.select(*key, "primary_depth", "replicate").join(
        theirs.select(*key, "depth"), key, "full_outer"
    )
    queue_status = (
        F.when(F.col("queue").isNull(), "OK")  # no replicated queue on either side
        .when(F.col("depth").isNull(), "MISSING_ON_BACKUP")
        .when(F.col("primary_depth").isNull(), "EXTRA_ON_BACKUP")
        .when(
            (F.col("replicate") == F.lit("all")) & (F.col("depth") != F.col("primary_depth")),
            "DIVERGED",
        )
        .otherwise("OK")
    )
    compared_rows = _result(
        compared.join(side_by_side, "node", "left")
        .withColumn("status", queue_status)
        .withColumn("detail", _queue_detail()),
        epoch=F.col("c_epoch"),
        position=F.col("c_position"),
    )
    return primary_rows.unionByName(stopped).unionByName(compared_rows)


def _result(frame: DataFrame, **given: Column) -> DataFrame:
    """The result's COLUMNS, in order: those `given` as expressions, the rest by name."""
    return frame.select(*[given[c].alias(c) if c in given else F.col(c) for c in COLUMNS])


def _member_detail() -> Column:
    return (
        F.when(~F.col("reachable"), F.col("error"))
        .when(
            F.col("foreign").isNotNull(),
            F.format_string(
                "checkpoint %d:%d is not in the primary's history (its latest: %d:%d)",
                F.col("foreign.epoch"),
                F.col("foreign.position"),
                F.col("pl.epoch"),
                F.col("pl.position"),
            ),
        )
        .when(F.col("ml").isNull(), F.lit("no checkpoint recorded yet"))
        .otherwise(
            F.format_string(
                "%d records, %.3f s behind the primary", F.col("lag_records"), F.col("lag_seconds")
            )
        )
    )


def _queue_detail() -> Column:
    return (
        F.when(
            F.col("status") == "DIVERGED",
            F.format_string(
                "depth %d on the primary, %d here at the same position",
                F.col("primary_depth"),
                F.col("depth"),
            ),
        )
        .when(F.col("status") == "MISSING_ON_BACKUP", F.lit("the primary has it, this member not"))
        .when(F.col("status") == "EXTRA_ON_BACKUP", F.lit("this member has it, the primary not"))
        .when(F.col("queue").isNull(), F.lit("no replicated queue at the checkpoint"))
        .otherwise(F.lit(""))
    )


def summary(results: DataFrame) -> DataFrame:
    """Rows per status, in the statuses' order."""
    order = F.array_position(F.array(*[F.lit(s) for s in STATUSES]), F.col("status"))
    return results.groupBy("status").count().orderBy(order)


def failing(results: DataFrame) -> DataFrame:
    return results.where(F.col("status").isin(*FAILING))
