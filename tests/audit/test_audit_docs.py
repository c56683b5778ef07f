"""The `tandem audit` lines of the README's tour and of docs/audit.md, run as written against
a real cluster (only the address rewritten), in this test run's one Spark session."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tandem.audit import job
from tandem.cli import parser
from tests.integration.test_docs_commands import blocks, pointed_at, shell_lines
from tests.support import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def audit_lines(path: Path, after: str = "") -> list[str]:
    lines = [line for b in blocks(path, "sh", after) for line in shell_lines(b)]
    return [line for line in lines if line.startswith("tandem audit")]


@pytest.mark.parametrize(
    ("doc", "after"), [("README.md", "## A five-minute tour"), ("docs/audit.md", "")]
)
def test_the_documented_audit_runs_as_written(
    doc: str,
    after: str,
    spark: SparkSession,
    cluster: LocalCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (line,) = audit_lines(ROOT / doc, after)
    installs = [
        line
        for b in blocks(ROOT / doc, "sh", after)
        for line in shell_lines(b)
        if "pip install" in line
    ]
    assert installs and all("'.[audit]'" in i for i in installs)  # the extra the test has
    monkeypatch.chdir(tmp_path)  # the report goes to ./tandem-audit
    argv = shlex.split(pointed_at(line, cluster))[1:]
    code = job.main(parser().parse_args(argv), spark=spark)
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"OK\s+\d+", out)
    assert (tmp_path / "tandem-audit" / "audit.png").exists()
    assert (tmp_path / "tandem-audit" / "audit.jsonl").read_text().count("\n") >= 3
