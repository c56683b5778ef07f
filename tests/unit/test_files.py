"""Small files replaced whole (store/files.py): what a reader in another process may see."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from tandem.broker.store.files import replace_file

OLD, NEW = '{"amqp": 5672, "old": true}', '{"amqp": 5673, "new": true}'


def _read_until_told(path: Path, stop: Any, seen: Any) -> None:
    torn = set()
    while not stop.is_set():
        text = path.read_text()
        if text not in (OLD, NEW):
            torn.add(text)
    seen.put(sorted(torn))


def test_a_reader_sees_the_old_file_or_the_new_one_never_a_torn_one(tmp_path: Path) -> None:
    # `tandem cluster status` and the tests read cluster.json while `cluster up` rewrites it:
    # a plain write_text truncates first, and a reader then reads an empty file
    path = tmp_path / "cluster.json"
    replace_file(path, OLD)
    ctx = multiprocessing.get_context("fork")
    stop, seen = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_read_until_told, args=(path, stop, seen))
    reader.start()
    try:
        for i in range(3000):
            replace_file(path, NEW if i % 2 else OLD.encode(), durable=i % 100 == 0)
    finally:
        stop.set()
    torn = seen.get(timeout=30)
    reader.join(30)
    assert torn == []
    assert path.read_text() == NEW
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]  # no temporary left over
