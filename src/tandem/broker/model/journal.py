"""The Journal port: where the model records its changes, in log order.

The store implements it on disk; `MemoryJournal` keeps only the position (a broker with no
data dir, and tests of the model). Every change gets the next log offset, so the position
counts the node's changes as DESIGN.md's log describes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem.broker.model.message import Message
    from tandem.broker.model.queue import Queue


class Journal(Protocol):
    epoch: int
    offset: int

    def define(self, vhost: str, op: str, body: dict[str, Any], durable: bool) -> None:
        """A declaration, deletion, binding or unbinding; `durable` ones go to disk."""

    def enqueue(self, queue: Queue, msg: Message) -> None:
        """A persistent message entered a durable queue; sets msg.mid on first enqueue."""

    def dequeue(self, queue: Queue, msg: Message) -> None:
        """A persistent message left a durable queue for good (ack, drop, purge)."""

    def when_synced(self, callback: Callable[[], None]) -> None:
        """Call back once everything journaled so far is on disk."""

    def dirty(self) -> bool:
        """True when something journaled is not yet on disk."""


class MemoryJournal:
    """Positions only; nothing is kept. Used when the node has no store."""

    def __init__(self) -> None:
        self.epoch = 1
        self.offset = 0

    def define(self, vhost: str, op: str, body: dict[str, Any], durable: bool) -> None:
        self.offset += 1

    def enqueue(self, queue: Queue, msg: Message) -> None:
        self.offset += 1
        if not msg.mid:
            msg.mid = self.offset

    def dequeue(self, queue: Queue, msg: Message) -> None:
        self.offset += 1

    def when_synced(self, callback: Callable[[], None]) -> None:
        callback()

    def dirty(self) -> bool:
        return False
