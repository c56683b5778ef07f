"""One process per data dir: an advisory lock held for the node's lifetime.

The kernel drops a `flock` when its process dies, kill -9 included, so a crashed node never
leaves a stale lock behind. The file also names its holder, so the refusal can say who it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from tandem.errors import StoreError

LOCK_NAME = "LOCK"


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, owner: str) -> None:
        """Take the lock or raise StoreError naming the process that holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open the lock file {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreError(
                f"data dir {self.path.parent} is in use by {holder}; stop it first or give "
                f"this node another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (tandem node {owner})\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None
