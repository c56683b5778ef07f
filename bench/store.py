"""Why the store is an append-only log: the candidates measured side by side.

    python bench/store.py [--records 50000] [--batch 64]

Writes RECORDS records of 150 bytes (a 100-byte message with its framing), committing and
fsyncing every BATCH records as group commit does, then reads them all back, with:
  - Tandem's log (its record frames, `tandem.broker.model.records`, os.write + os.fsync per
    batch);
  - SQLite in WAL mode with synchronous=FULL (stdlib sqlite3), one transaction per batch;
  - SQLite with one transaction per record (what a store without group commit pays).
Prints records/s for each and the ratio to Tandem's log.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from tandem.broker.model.records import ENQUEUE, frame, scan


def tandem_log(path: Path, records: int, batch: int) -> tuple[float, float]:
    payload = b"x" * 130
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    start = time.perf_counter()
    pending: list[bytes] = []
    for i in range(records):
        pending.append(frame(ENQUEUE, 1, i + 1, payload))
        if len(pending) == batch or i == records - 1:
            os.write(fd, b"".join(pending))
            os.fsync(fd)
            pending.clear()
    write = time.perf_counter() - start
    os.close(fd)
    start = time.perf_counter()
    got, _end, _corrupt, _torn = scan(path.read_bytes())
    read = time.perf_counter() - start
    assert len(got) == records
    return records / write, records / read


def sqlite_store(path: Path, records: int, batch: int) -> tuple[float, float]:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE log (offset INTEGER PRIMARY KEY, body BLOB)")
    payload = b"x" * 130
    start = time.perf_counter()
    for first in range(0, records, batch):
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO log VALUES (?, ?)",
            [(i, payload) for i in range(first, min(first + batch, records))],
        )
        db.execute("COMMIT")
    write = time.perf_counter() - start
    start = time.perf_counter()
    n = sum(1 for _ in db.execute("SELECT offset, body FROM log ORDER BY offset"))
    read = time.perf_counter() - start
    assert n == records
    db.close()
    return records / write, records / read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        fd = os.open(base / "probe", os.O_WRONLY | os.O_CREAT)
        start = time.perf_counter()
        for _ in range(200):
            os.write(fd, b"x")
            os.fsync(fd)
        fsync_ms = (time.perf_counter() - start) / 200 * 1000
        os.close(fd)
        print(f"one write+fsync on this disk: {fsync_ms:.3f} ms")
        t = tandem_log(base / "log.seg", args.records, args.batch)
        s = sqlite_store(base / "batch.db", args.records, args.batch)
        one = sqlite_store(base / "one.db", min(args.records, 5000), 1)
    print(f"{'store':36}{'write rec/s':>14}{'read rec/s':>14}{'write ratio':>13}")
    rows = [
        ("tandem log, group commit", t),
        (f"sqlite WAL, {args.batch} per commit", s),
        ("sqlite WAL, 1 per commit", one),
    ]
    for name, (w, r) in rows:
        print(f"{name:36}{w:14.0f}{r:14.0f}{w / t[0]:13.2f}")


if __name__ == "__main__":
    main()
