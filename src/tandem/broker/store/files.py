"""Small files replaced whole: readers see the old one or the new one, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path`.

    A rename within a directory is atomic, so a process reading `path` meanwhile (another
    process's `tandem cluster status`, a test waiting for the file to appear) reads a whole
    file. `durable` also syncs the data before the rename, for files a crash must not lose.
    """
    tmp = path.with_name(path.name + ".tmp")
    write_file(tmp, data, durable=durable)
    os.replace(tmp, path)


def write_file(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Write `data` to `path`; `durable` syncs it before returning."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsync a directory: the files created in, renamed into or deleted from it are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
