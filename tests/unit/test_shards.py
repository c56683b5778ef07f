"""The sharded mapping behind the indexes that grow with the queues (`model/shards.py`)."""

from __future__ import annotations

import gc
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.broker.model.shards import SHARDS, SPLIT_AT, ByQueue, Shards

keys = st.one_of(st.integers(0, 300), st.tuples(st.just("/"), st.sampled_from("ab"), st.integers()))
ops = st.lists(
    st.tuples(st.sampled_from(["set", "pop", "del", "get", "clear"]), keys, st.integers()),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_it_holds_what_a_dict_holds(script: list[tuple[str, object, int]]) -> None:
    ours: Shards[object, int] = Shards()
    theirs: dict[object, int] = {}
    for op, key, value in script:
        if op == "set":
            ours[key] = theirs[key] = value
        elif op == "pop":
            assert ours.pop(key, None) == theirs.pop(key, None)
        elif op == "del" and key in theirs:
            del ours[key]
            del theirs[key]
        elif op == "get":
            assert ours.get(key) == theirs.get(key) and (key in ours) == (key in theirs)
        elif op == "clear":
            ours.clear()
            theirs.clear()
    assert dict(ours.items()) == theirs and set(ours) == set(theirs)
    assert len(ours) == len(theirs) and bool(ours) == bool(theirs)


@pytest.mark.parametrize("kind", ["message ids", "store keys"])
def test_the_shards_double_one_at_a_time(kind: str) -> None:
    """With even shares, consecutive message ids filled every shard in step and all of them
    doubled within the same few inserts: one dict's doubling, as long a pause. Over a
    doubling of the whole, each shard doubles, and never more than two in a thousand inserts."""
    index: Shards[object, int] = Shards()
    sizes = [sys.getsizeof(shard) for shard in index.shards]
    doublings = []
    for batch in range(600):
        for n in range(batch * 1000, batch * 1000 + 1000):
            mid = 3 << 64 | 3 * n  # a queue's ids: every third offset, say
            index[mid if kind == "message ids" else ("/", "q", mid)] = n
        now = [sys.getsizeof(shard) for shard in index.shards]
        if batch >= 300:
            doublings.append(sum(a != b for a, b in zip(sizes, now, strict=True)))
        sizes = now
    assert sum(doublings) >= SHARDS and max(doublings) <= 2, doublings


def test_a_new_key_does_not_make_a_shard_young_again() -> None:
    """An exact dict of untracked keys (the store's key tuples, once collected) is untracked
    by a collection and tracked again, in the youngest generation, by its next new key: every
    young collection would walk it. A shard stays where it grew old."""
    index: Shards[tuple[str, str, int], int] = Shards()
    for mid in range(5000):
        index[("/", "q", mid)] = mid
    gc.collect()  # the key tuples are untracked; an exact dict would be too
    for mid in range(5000, 5000 + SHARDS * 4):  # new, tracked keys, into every shard
        index[("/", "q", mid)] = mid
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert all(gc.is_tracked(s) and id(s) not in young for s in index.shards)


def test_one_dict_until_it_is_large_then_the_shards() -> None:
    """Most queues are shallow, and each has its Shards (`ByQueue`): one dict serves until
    SPLIT_AT keys, then the keys move into SHARDS dicts, every one of them still there."""
    index: Shards[int, int] = Shards()
    for mid in range(SPLIT_AT - 1):
        index[mid] = -mid
    assert len(index.dicts()) == 1 and len({id(s) for s in index.shards}) == 1
    index[SPLIT_AT - 1] = 1 - SPLIT_AT
    assert len(index.dicts()) == SHARDS and len({id(s) for s in index.shards}) == SHARDS
    assert len(index) == SPLIT_AT and all(index[mid] == -mid for mid in range(SPLIT_AT))
    assert sorted(index) == list(range(SPLIT_AT))
    index.clear()
    assert not index and len(index) == 0


queue_keys = st.tuples(st.just("/"), st.sampled_from("abc"), st.integers(0, 50))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "pop", "get", "drop"]), queue_keys), max_size=80))
def test_by_queue_holds_what_a_dict_holds(script: list[tuple[str, tuple[str, str, int]]]) -> None:
    ours = ByQueue()
    theirs: dict[tuple[str, str, int], int] = {}
    for n, (op, key) in enumerate(script):
        if op == "set":
            ours[key] = theirs[key] = n
        elif op == "pop":
            assert ours.pop(key) == theirs.pop(key, None)
        elif op == "get":
            assert ours.get(key) == theirs.get(key) and (key in ours) == (key in theirs)
        else:
            dropped = ours.drop(key[0], key[1])
            gone = {k: v for k, v in theirs.items() if k[:2] == key[:2]}
            named = {} if dropped is None else dict(dropped.items())
            assert named == {k[2]: v for k, v in gone.items()}
            theirs = {k: v for k, v in theirs.items() if k not in gone}
    held = {(v, q, mid): at for (v, q), index in ours.queues.items() for mid, at in index.items()}
    assert held == theirs
    assert len(ours) == len(theirs) and bool(ours) == bool(theirs)
