from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The one Spark session of a test run (a JVM takes seconds to start)."""
    from tandem.audit.job import session

    s = session("local[2]")
    # The tests' frames are a few rows: one shuffle partition, no re-planning.
    s.conf.set("spark.sql.shuffle.partitions", "1")
    s.conf.set("spark.sql.adaptive.enabled", "false")
    # Interpreted, not compiled to Java: each query runs once on a few rows, and compiling
    # its stages cost more than running them.
    s.conf.set("spark.sql.codegen.wholeStage", "false")
    s.conf.set("spark.sql.codegen.factoryMode", "NO_CODEGEN")
    yield s
    s.stop()
