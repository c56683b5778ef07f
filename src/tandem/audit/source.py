"""`spark.read.format("tandem_checkpoints")`: the members' checkpoints as a DataFrame, one
partition per member, read by Spark's Python workers (PySpark's Python Data Source API).

Options: `members`, the members' admin URLs, comma-separated; `token`, an admin token when
the members require one. Each read asks the members again, so the job freezes one snapshot
per run (`snapshot`).
"""

from __future__ import annotations

from collections.abc import Iterator

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from tandem.audit import members

NAME = "tandem_checkpoints"


class MemberPartition(InputPartition):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


class CheckpointReader(DataSourceReader):
    def __init__(self, urls: list[str], token: str | None) -> None:
        self.urls, self.token = urls, token

    def partitions(self) -> list[InputPartition]:
        return [MemberPartition(url) for url in self.urls]

    def read(self, partition: InputPartition) -> Iterator[members.Row]:
        assert isinstance(partition, MemberPartition)
        yield from members.read_member(partition.url, self.token)


class CheckpointSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return members.SCHEMA

    def reader(self, schema: object) -> DataSourceReader:
        urls = [u.strip() for u in self.options.get("members", "").split(",") if u.strip()]
        if not urls:
            raise ValueError(f"the {NAME} source needs the option members=URL[,URL...]")
        return CheckpointReader(urls, self.options.get("token") or None)


def snapshot(spark: SparkSession, urls: list[str], token: str | None = None) -> DataFrame:
    """Every member read once: the rows are materialized now, later actions reuse them."""
    spark.dataSource.register(CheckpointSource)
    reader = spark.read.format(NAME).option("members", ",".join(urls))
    if token:
        reader = reader.option("token", token)
    return reader.load().localCheckpoint(eager=True)
