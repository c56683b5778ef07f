"""The election record in a file: compare-and-set under a lock, with a version counter.

`<data_dir>/election.json` holds the record; `<data_dir>/election.lock` is flocked for each
read-compare-write, so two controllers (or a controller and its restarted self) cannot both
win. A missing file is a new cluster: no primary, epoch 0, every member in sync. A directory that
cannot be read or written (deleted under a running cluster, say) is `Unavailable`, named.
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import replace
from pathlib import Path

from tandem.broker.store.files import replace_file
from tandem.ha.model import ElectionRecord
from tandem.ha.ports import Unavailable


class FileElectionStore:
    """Implements ha.ports.ElectionStore on a file."""

    def __init__(self, data_dir: Path, nodes: list[str]) -> None:
        self.path = data_dir / "election.json"
        self.lock_path = data_dir / "election.lock"
        self.nodes = nodes

    def _read(self) -> ElectionRecord:
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            if not self.path.parent.is_dir():  # not a new cluster: a deleted one
                raise self._gone() from None
            return ElectionRecord.initial(self.nodes)
        except OSError as exc:
            raise self._unavailable("read", exc) from None
        try:
            return ElectionRecord.from_dict(json.loads(text))
        except ValueError as exc:
            raise ValueError(f"cannot read the election record {self.path}: {exc}") from None

    def _unavailable(self, doing: str, exc: OSError) -> Unavailable:
        if not self.path.parent.is_dir():
            return self._gone()
        return Unavailable(f"cannot {doing} the election record {self.path}: {exc}")

    def _gone(self) -> Unavailable:
        return Unavailable(
            f"the cluster's data directory {self.path.parent} is gone: no failover or "
            "change of the in-sync set can be recorded until it is back (was it deleted "
            "while the cluster ran?)"
        )

    async def read(self) -> ElectionRecord:
        return self._read()

    async def compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        try:
            return self._compare_and_set(expected, new)
        except OSError as exc:
            raise self._unavailable("write", exc) from None

    def _compare_and_set(
        self, expected: ElectionRecord, new: ElectionRecord
    ) -> ElectionRecord | None:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self._read().version != expected.version:
                    return None
                stored = replace(new, version=expected.version + 1)
                replace_file(self.path, json.dumps(stored.to_dict()), durable=True)
                return stored
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
