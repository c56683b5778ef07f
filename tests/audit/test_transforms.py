"""The audit's comparison on hand-made checkpoint rows: every status, and the ties."""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession

from tandem.audit import members, transforms

Queue = tuple[str, str, int, str]  # vhost, queue, depth, replicate


def cp(
    node: str, role: str, epoch: int, position: int, time: float, *queues: Queue
) -> list[tuple[Any, ...]]:
    """One checkpoint a member recorded, as the source's rows."""
    head = (node, f"http://{node}", role, True, None, epoch, position, time, time + 0.01)
    return [(*head, None, None, None, None)] + [(*head, *q) for q in queues]


def down(node: str, error: str = "does not answer: connection refused") -> list[tuple[Any, ...]]:
    return [(node, f"http://{node}", None, False, error, *([None] * 8))]


def fresh(node: str, role: str = "backup") -> list[tuple[Any, ...]]:
    """A member that answers but has recorded no checkpoint yet."""
    return [(node, f"http://{node}", role, True, *([None] * 9))]


def audit(
    spark: SparkSession, *groups: list[tuple[Any, ...]], records: int = 1000, seconds: float = 60
) -> dict[tuple[str, str | None], dict[str, Any]]:
    rows = spark.createDataFrame([r for g in groups for r in g], members.SCHEMA)
    out = transforms.audit(rows, records, seconds).collect()
    found = {(r["node"], r["queue"]): r.asDict() for r in out}
    assert len(found) == len(out), "one row per member and queue"
    return found


A = ("/", "a", 5, "all")
B = ("/", "b", 2, "all")
T = 1_000_000.0


def test_a_backup_in_step_is_ok_and_the_primary_is_reported_too(spark: SparkSession) -> None:
    r = audit(spark, cp("p", "primary", 1, 100, T, A, B), cp("b1", "backup", 1, 100, T, A, B))
    assert {k: v["status"] for k, v in r.items()} == {
        ("p", "a"): "OK",
        ("p", "b"): "OK",
        ("b1", "a"): "OK",
        ("b1", "b"): "OK",
    }
    assert r["b1", "a"]["lag_records"] == 0 and r["b1", "a"]["position"] == 100
    assert r["b1", "a"]["depth"] == r["b1", "a"]["primary_depth"] == 5


def test_the_same_position_with_another_depth_is_diverged(spark: SparkSession) -> None:
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, A, B),
        cp("b1", "backup", 1, 100, T, ("/", "a", 4, "all"), B),
    )
    assert r["b1", "a"]["status"] == "DIVERGED" and r["b1", "b"]["status"] == "OK"
    assert "depth 5 on the primary, 4 here" in r["b1", "a"]["detail"]


def test_queues_missing_and_extra_on_a_backup(spark: SparkSession) -> None:
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, A, B),
        cp("b1", "backup", 1, 100, T, A, ("/", "c", 0, "all")),
    )
    assert r["b1", "b"]["status"] == "MISSING_ON_BACKUP"
    assert r["b1", "c"]["status"] == "EXTRA_ON_BACKUP"
    assert r["b1", "a"]["status"] == "OK"


def test_configuration_queues_compare_presence_and_none_queues_are_not_compared(
    spark: SparkSession,
) -> None:
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, ("/", "cfg", 9, "configuration"), ("/", "mine", 3, "none")),
        cp("b1", "backup", 1, 100, T, ("/", "cfg", 0, "configuration")),
    )
    assert r["b1", "cfg"]["status"] == "OK"
    assert ("b1", "mine") not in r and ("p", "mine") not in r


def test_the_latest_common_checkpoint_is_the_one_compared(spark: SparkSession) -> None:
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, ("/", "a", 1, "all")),
        cp("p", "primary", 1, 200, T + 10, ("/", "a", 7, "all")),
        cp("p", "primary", 1, 300, T + 20, ("/", "a", 9, "all")),
        cp("b1", "backup", 1, 100, T, ("/", "a", 1, "all")),
        cp("b1", "backup", 1, 200, T + 10, ("/", "a", 7, "all")),
    )
    row = r["b1", "a"]
    assert row["status"] == "OK" and row["position"] == 200 and row["checkpoint_time"] == T + 10
    assert row["lag_records"] == 100 and row["lag_seconds"] == 10.0


def test_a_member_that_does_not_answer(spark: SparkSession) -> None:
    r = audit(spark, cp("p", "primary", 1, 100, T, A), down("b1"))
    assert r["b1", "a"]["status"] == "UNREACHABLE"
    assert "connection refused" in r["b1", "a"]["detail"]


def test_a_checkpoint_the_primary_never_made_is_another_history(spark: SparkSession) -> None:
    r = audit(
        spark,
        cp("p", "primary", 2, 100, T, A),
        cp("p", "primary", 2, 200, T + 1, A),
        cp("b1", "backup", 1, 200, T + 1, A),  # the same position in an older term
        cp("b2", "backup", 3, 250, T + 2, A),  # a term the primary does not know
        cp("b3", "backup", 2, 100, T, A),
    )
    assert r["b1", "a"]["status"] == "EPOCH_MISMATCH"
    assert "1:200 is not in the primary's history" in r["b1", "a"]["detail"]
    assert r["b2", "a"]["status"] == "EPOCH_MISMATCH"
    assert r["b3", "a"]["status"] == "OK"


def test_lag_past_either_limit_is_exceeded_and_at_the_limit_is_not(spark: SparkSession) -> None:
    groups = [
        cp("p", "primary", 1, 100, T, A),
        cp("p", "primary", 1, 1100, T + 60, A),
        cp("p", "primary", 1, 1101, T + 61, A),
    ]
    at_limit = cp("b1", "backup", 1, 100, T, A)  # 1001 records, 61 s: both past
    r = audit(spark, *groups, at_limit, records=1001, seconds=61)
    assert r["b1", "a"]["status"] == "OK"  # exactly at both limits
    r = audit(spark, *groups, at_limit, records=1000, seconds=61)
    assert r["b1", "a"]["status"] == "LAG_EXCEEDED"  # records past
    r = audit(spark, *groups, at_limit, records=1001, seconds=60.5)
    assert r["b1", "a"]["status"] == "LAG_EXCEEDED"  # seconds past


def test_behind_with_nothing_in_common_yet_is_lagging(spark: SparkSession) -> None:
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, A),
        fresh("b1"),
        cp("p", "primary", 1, 50, T - 1, A),
    )
    assert r["b1", "a"]["status"] == "LAGGING"
    assert r["b1", "a"]["detail"] == "no checkpoint recorded yet"


def test_the_first_status_that_holds_wins(spark: SparkSession) -> None:
    # Diverged depths and lag past the limit: lag is reported (it comes first) ...
    r = audit(
        spark,
        cp("p", "primary", 1, 100, T, A),
        cp("p", "primary", 1, 5000, T + 1, A),
        cp("b1", "backup", 1, 100, T, ("/", "a", 4, "all")),
        records=1000,
    )
    assert r["b1", "a"]["status"] == "LAG_EXCEEDED"
    # ... and another history comes before lag.
    r = audit(
        spark,
        cp("p", "primary", 2, 5000, T + 1, A),
        cp("b1", "backup", 1, 100, T, A),
        cp("p", "primary", 2, 100, T, A),
        records=10,
    )
    assert r["b1", "a"]["status"] == "EPOCH_MISMATCH"


def test_queues_of_the_same_name_in_two_vhosts_are_two_rows(spark: SparkSession) -> None:
    rows = spark.createDataFrame(
        cp("p", "primary", 1, 100, T, ("/", "q", 1, "all"), ("v2", "q", 2, "all"))
        + cp("b1", "backup", 1, 100, T, ("/", "q", 1, "all"), ("v2", "q", 3, "all")),
        members.SCHEMA,
    )
    out = transforms.audit(rows, 1000, 60).where("node = 'b1'").collect()
    assert sorted((r["vhost"], r["status"]) for r in out) == [("/", "OK"), ("v2", "DIVERGED")]


def test_of_two_members_answering_primary_the_higher_epoch_is_the_reference(
    spark: SparkSession,
) -> None:
    r = audit(
        spark,
        cp("old", "primary", 1, 100, T, A),
        cp("new", "primary", 2, 150, T + 1, A),
        cp("new", "primary", 2, 100, T, A),
    )
    assert r["new", "a"]["detail"] == "the primary"
    assert r["old", "a"]["status"] == "EPOCH_MISMATCH"


def test_a_cluster_without_queues_still_reports_each_member(spark: SparkSession) -> None:
    r = audit(spark, cp("p", "primary", 1, 100, T), cp("b1", "backup", 1, 100, T))
    assert set(r) == {("p", None), ("b1", None)}
    assert r["b1", None]["status"] == "OK"


def test_summary_counts_in_the_order_of_the_statuses(spark: SparkSession) -> None:
    rows = spark.createDataFrame(
        cp("p", "primary", 1, 100, T, A, B)
        + cp("b1", "backup", 1, 100, T, ("/", "a", 1, "all"), B)
        + down("b2"),
        members.SCHEMA,
    )
    summary = [tuple(r) for r in transforms.summary(transforms.audit(rows, 10, 10)).collect()]
    assert summary == [("UNREACHABLE", 2), ("DIVERGED", 1), ("OK", 3)]
