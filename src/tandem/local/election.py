"""The election record in a file: compare-and-set under a lock, with a version counter.

`<data_dir>/election.json` holds the record; `<data_dir>/election.lock` is flocked for each
read-compare-write, so two controllers (or a controller and its restarted self) cannot both
win. A missing file is a new cluster: no primary, epoch 0, every member in sync.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import replace
from pathlib import Path

from tandem.ha.model import ElectionRecord


class FileElectionStore:
    """Implements ha.ports.ElectionStore on a file."""

    def __init__(self, data_dir: Path, nodes: list[str]) -> None:
        self.path = data_dir / "election.json"
        self.lock_path = data_dir / "election.lock"
        self.nodes = nodes

    def _read(self) -> ElectionRecord:
        if not self.path.exists():
            return ElectionRecord.initial(self.nodes)
        try:
            return ElectionRecord.from_dict(json.loads(self.path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the election record {self.path}: {exc}") from None

    async def read(self) -> ElectionRecord:
        return self._read()

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self._read().version != expected.version:
                    return None
                stored = replace(new, version=expected.version + 1)
                tmp = self.path.with_name("election.json.tmp")
                with open(tmp, "w") as f:
                    json.dump(stored.to_dict(), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                return stored
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
