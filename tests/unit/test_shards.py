"""The sharded mapping behind the indexes that grow with the queues (`model/shards.py`)."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.broker.model.shards import SHARDS, Shards

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


def test_each_shard_grows_alone() -> None:
    """Message ids spread evenly over the shards: a doubling moves a SHARDS-th of them."""
    index: Shards[int, int] = Shards((3 << 64 | offset, offset) for offset in range(1, 100_001))
    sizes = [len(shard) for shard in index.shards]
    assert max(sizes) - min(sizes) <= 100_000 // SHARDS // 10


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
