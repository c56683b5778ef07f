"""A mapping split into many dicts, for the node's indexes that grow with the queues.

Two things a plain dict does to a loop that must answer within a fraction of a second, once it
holds millions of entries (every live message, on a deep queue):

- it grows by doubling, and a doubling moves every entry at once: with two or three million
  entries that took 0.2 to 1 s on this project's machine, in the middle of a record's apply,
  on the primary and both backups at the same moment (their indexes grow in step), and the
  controller, its status polls unanswered, dropped a backup from the in-sync set;
- CPython stops tracking an exact dict whose keys and values refer to nothing (the store's key
  tuples are untracked once a collection has seen them), and its next new key tracks it again
  in the youngest generation, so every young collection walked every entry: 50 to 200 ms a
  collection, several a second, with 900,000 messages queued.

`Shards` keeps SHARDS dicts, a key's by its hash: each grows on its own. Their shares of the
keys differ, from 1 to nearly 2 in steps of 2**(1/SHARDS): with even shares, message ids
(consecutive offsets) filled every shard in step, and all of them doubled within the same few
inserts, as long a pause as one dict's doubling (a backup, silent for a second, left the
in-sync set).
Skewed, the shards reach their doubling sizes one after another, about 1% of the whole apart.
They are a dict subclass, which the collector never untracks: once old (and frozen,
broker/collector.py) a shard stays so.

A Shards is one dict, in every slot, until it holds SPLIT_AT keys: the store keeps one for
each queue (`ByQueue`), and most queues are shallow.

`ByQueue` is the store's index of live messages, a Shards per queue: a checkpoint copies,
and a deleted queue drops, one queue's entries without a pass over the others' (a deep queue
left alone cost every checkpoint a copy of its million entries on the loop, 30-70 ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final, Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

SHARDS: Final = 64
SPLIT_AT: Final = 1 << 15  # keys: one dict until then (a split moves them in 2-3 ms)
_SLOTS: Final = 1 << 14  # a key's hash picks a slot, and the slot its shard


def _slots() -> list[int]:
    """Shard i gets a share of the slots proportional to 2**(i/SHARDS), in runs."""
    weights = [2 ** (i / SHARDS) for i in range(SHARDS)]
    total, below = sum(weights), 0.0
    out: list[int] = []
    for i, weight in enumerate(weights):
        below += weight
        out += [i] * round(_SLOTS * below / total - len(out))
    return out


_SHARD_OF: Final = _slots()
_MASK: Final = _SLOTS - 1
_MISSING: Final = object()


class _Shard(dict[K, V]):
    __slots__ = ()


class Shards(Generic[K, V]):
    """The mapping operations the indexes use, over SHARDS dicts (one, until SPLIT_AT keys,
    in every slot). Compiled, a module
    constant not `Final` is looked up in the module's dict at each use, and a dict typed as
    its subclass is called through Python's method lookup: with both, an operation took
    218-239 ns, not 287-306 (300,000 pops from Python, best of five)."""

    __slots__ = ("shards", "whole")

    def __init__(self, items: Iterable[tuple[K, V]] = ()) -> None:
        whole: dict[K, V] = _Shard()
        self.shards: list[dict[K, V]] = [whole] * SHARDS
        self.whole: dict[K, V] | None = whole  # the one dict, until the split
        for key, value in items:
            self[key] = value

    def __getitem__(self, key: K) -> V:
        return self.shards[_SHARD_OF[hash(key) & _MASK]][key]

    def __setitem__(self, key: K, value: V) -> None:
        shard = self.shards[_SHARD_OF[hash(key) & _MASK]]
        shard[key] = value
        if self.whole is not None and len(shard) >= SPLIT_AT:
            self._split()

    def _split(self) -> None:
        whole = self.whole
        assert whole is not None
        self.whole = None
        self.shards = [_Shard() for _ in range(SHARDS)]
        for key, value in whole.items():
            self.shards[_SHARD_OF[hash(key) & _MASK]][key] = value

    def dicts(self) -> list[dict[K, V]]:
        """The dicts that hold the keys, each once."""
        whole = self.whole
        return self.shards if whole is None else [whole]

    def __delitem__(self, key: K) -> None:
        del self.shards[_SHARD_OF[hash(key) & _MASK]][key]

    def __contains__(self, key: object) -> bool:
        return key in self.shards[_SHARD_OF[hash(key) & _MASK]]

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: T) -> V | T: ...

    def get(self, key: K, default: object = None) -> object:
        return self.shards[_SHARD_OF[hash(key) & _MASK]].get(key, default)

    @overload
    def pop(self, key: K) -> V: ...

    @overload
    def pop(self, key: K, default: T) -> V | T: ...

    def pop(self, key: K, default: object = _MISSING) -> object:
        shard = self.shards[_SHARD_OF[hash(key) & _MASK]]
        return shard.pop(key) if default is _MISSING else shard.pop(key, default)

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.dicts())

    def __bool__(self) -> bool:
        return any(self.dicts())

    def __iter__(self) -> Iterator[K]:
        for shard in self.dicts():
            yield from shard

    def items(self) -> Iterator[tuple[K, V]]:
        for shard in self.dicts():
            yield from shard.items()

    def clear(self) -> None:
        for shard in self.dicts():
            shard.clear()


Key = tuple[str, str, int]  # (vhost, queue, message id)


class ByQueue:
    """Live messages by queue: (vhost, queue, message id) -> where its ENQUEUE record is,
    a Shards of ids for each queue. A queue's Shards stays when it empties (a firehose
    empties its queue at every message); it goes with the queue (`drop`)."""

    __slots__ = ("queues",)

    def __init__(self) -> None:
        self.queues: dict[tuple[str, str], Shards[int, int]] = {}

    def of(self, vhost: str, queue: str) -> Shards[int, int]:
        """The queue's index, made if it has none."""
        index = self.queues.get((vhost, queue))
        if index is None:
            index = self.queues[(vhost, queue)] = Shards()
        return index

    def get(self, key: Key) -> int | None:
        index = self.queues.get((key[0], key[1]))
        return None if index is None else index.get(key[2])

    def __setitem__(self, key: Key, at: int) -> None:
        self.of(key[0], key[1])[key[2]] = at

    def pop(self, key: Key) -> int | None:
        index = self.queues.get((key[0], key[1]))
        return None if index is None else index.pop(key[2], None)

    def __contains__(self, key: Key) -> bool:
        index = self.queues.get((key[0], key[1]))
        return index is not None and key[2] in index

    def drop(self, vhost: str, queue: str) -> Shards[int, int] | None:
        """Forget a queue's entries; they are returned."""
        return self.queues.pop((vhost, queue), None)

    def __len__(self) -> int:
        return sum(len(index) for index in self.queues.values())

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def clear(self) -> None:
        self.queues.clear()
