"""The local cluster's election record in a file (local/election.py), on a real directory."""

from __future__ import annotations

import asyncio
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.ha.ports import Unavailable
from tandem.local.election import FileElectionStore


def test_a_missing_record_is_a_new_cluster_and_a_write_is_compared_and_set(
    tmp_path: Path,
) -> None:
    store = FileElectionStore(tmp_path, ["a", "b"])
    first = asyncio.run(store.read())
    assert first.epoch == 0 and first.holder is None and first.version == 0
    stored = asyncio.run(store.compare_and_set(first, replace(first, holder="a", epoch=1)))
    assert stored is not None and stored.version == 1
    assert asyncio.run(store.read()) == stored
    # a second writer that read the first version loses
    assert asyncio.run(store.compare_and_set(first, replace(first, holder="b"))) is None
    assert asyncio.run(store.read()).holder == "a"


def test_a_data_dir_deleted_under_the_cluster_is_named_not_taken_for_a_new_cluster(
    tmp_path: Path,
) -> None:
    """A missing record in a missing directory is not a new cluster (epoch 0, no primary,
    which a controller would act on): it is a port that cannot answer, with its path."""
    data = tmp_path / "data"
    data.mkdir()
    store = FileElectionStore(data, ["a", "b"])
    record = asyncio.run(store.read())
    record = asyncio.run(store.compare_and_set(record, replace(record, holder="a", epoch=1)))
    assert record is not None
    shutil.rmtree(data)
    with pytest.raises(Unavailable, match=re.escape(f"data directory {data} is gone")):
        asyncio.run(store.read())
    with pytest.raises(Unavailable, match=re.escape(f"data directory {data} is gone")):
        asyncio.run(store.compare_and_set(record, replace(record, epoch=2)))


def test_an_unreadable_record_is_unavailable_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "election.json").mkdir()  # a directory where the record should be
    store = FileElectionStore(tmp_path, ["a"])
    with pytest.raises(Unavailable, match=r"cannot read the election record .*election\.json"):
        asyncio.run(store.read())
