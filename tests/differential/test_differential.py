"""The differential test in CI (issue 14): sequences of what RabbitMQ users do (80, 40 with
paging and checkpoints, 40 through a cluster), each followed by kill -9 and a restart, and
the state compared exact to the byte. Longer runs:

    DIFFERENTIAL_COUNT=10000 python3 -m pytest tests/differential -s
    python -m tests.differential --seed N --count M
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.differential import harness

COUNT = int(os.environ.get("DIFFERENTIAL_COUNT", "60"))


@pytest.mark.timeout(60 + 3 * COUNT)
def test_a_restart_brings_back_exactly_what_a_client_left(tmp_path: Path) -> None:
    figures = harness.run(tmp_path, COUNT)
    print(f"differential: {figures}")
    assert figures["sequences"] >= COUNT and figures["operations"] > figures["refused"]


PAGED_COUNT = int(os.environ.get("DIFFERENTIAL_PAGED_COUNT", "30"))


@pytest.mark.timeout(60 + 3 * PAGED_COUNT)
def test_a_restart_brings_back_exactly_what_a_client_left_when_every_queue_pages_and_checkpoints(
    tmp_path: Path,
) -> None:
    """The same with a memory budget of one byte: every persistent message after a queue's
    first stays in the log, a page of its own, read back when the queue gets to it; and a
    checkpoint after every durable record, so that each restart loads one and replays the
    records after it."""
    config = {"queue_memory_bytes": 1, "checkpoint_records": 1}
    figures = harness.run(tmp_path, PAGED_COUNT, config=config)
    print(f"differential, paged: {figures}")
    assert figures["sequences"] >= PAGED_COUNT


@pytest.mark.timeout(300)
def test_a_codec_that_drops_a_field_type_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation check: records that write byte strings as text (one field type dropped
    from the encoding) are caught. The broker is a subprocess; the fault reaches it through
    an environment variable only this test sets (TANDEM_TEST_FAULT_BYTES_AS_TEXT)."""
    monkeypatch.setenv("TANDEM_TEST_FAULT_BYTES_AS_TEXT", "1")
    with pytest.raises(harness.Differential, match="became"):
        harness.run(tmp_path, 20, seed=0, shrink=False)


@pytest.mark.timeout(300)
def test_an_apply_that_checks_again_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second mutation check: apply re-runs a client's check (the reserved-prefix one),
    so a restart refuses the durable server-named queue the primary made; caught."""
    monkeypatch.setenv("TANDEM_TEST_FAULT_APPLY_CHECKS", "1")
    with pytest.raises(harness.Differential, match="gone"):
        harness.run(tmp_path, 20, seed=0, shrink=False)


CLUSTER_COUNT = int(os.environ.get("DIFFERENTIAL_CLUSTER_COUNT", "40"))


@pytest.mark.timeout(120 + 10 * CLUSTER_COUNT)
def test_every_backup_equals_the_primary_and_a_new_primary_equals_the_old(
    tmp_path: Path,
) -> None:
    """The same sequences through a 3-member cluster's front port: after each, every backup's
    state equals the primary's at one position; after every 8th, kill -9 of the primary, and
    the new primary's state equals the old one's. The members checkpoint every few records,
    so that the killed one comes back from a checkpoint and the difference it takes."""
    config = {"checkpoint_records": 5}
    figures = harness.run(tmp_path, CLUSTER_COUNT, cluster=True, kill_every=8, config=config)
    print(f"differential (cluster): {figures}")
    assert figures["sequences"] >= CLUSTER_COUNT and figures["failovers"] >= CLUSTER_COUNT // 8
