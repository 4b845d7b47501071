"""Eviction policies (``kvstore.store.eviction``): victim order per policy, pins, and the setting.

Every policy must answer :meth:`RecencyIndex.victims` completely or with ``None`` having changed
nothing, and skip pinned keys; LRU keeps its O(1) ``OrderedDict`` index and must rank exactly as
the same priority function does through the generic heap index.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.config import ConfigError, load_config
from kvstore.policy import EVICTIONS, Policy
from kvstore.store.eviction import (
    FIFO,
    LFU_AGING,
    LRU,
    POLICIES,
    EvictionPolicy,
    LruIndex,
    PriorityIndex,
    RecencyIndex,
    eviction_policy,
)

FP = 100  # every block's footprint here, unless a test says otherwise


def k(name: str) -> bytes:
    return name.encode()


def index_of(policy: EvictionPolicy | str, *names: str) -> RecencyIndex:
    index = RecencyIndex(policy)
    for name in names:
        index.add(k(name), FP)
    return index


def state(index: RecencyIndex) -> tuple[list[bytes], dict[bytes, int]]:
    return list(index), dict(index.members)


# -- construction and names ----------------------------------------------------------------------


def test_lru_is_the_default_and_keeps_the_ordered_dict_index() -> None:
    assert type(RecencyIndex()) is LruIndex
    assert RecencyIndex().policy is LRU
    assert type(RecencyIndex("lru")) is LruIndex
    for name in ("fifo", "lfu-aging"):
        index = RecencyIndex(name)
        assert type(index) is PriorityIndex and isinstance(index, RecencyIndex)
        assert index.policy is POLICIES[name]
    assert type(RecencyIndex(FIFO)) is PriorityIndex


def test_policy_names_are_one_list() -> None:
    assert tuple(POLICIES) == EVICTIONS
    assert eviction_policy("lfu-aging") is LFU_AGING
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        RecencyIndex("mru")


# -- victim order per policy ---------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_first() -> None:
    index = index_of("lru", "a", "b", "c")
    index.touch(k("a"))
    assert index.victims(1) == [k("b")]
    assert index.victims(2 * FP) == [k("b"), k("c")]
    assert index.victims(3 * FP) == [k("b"), k("c"), k("a")]
    assert list(index) == [k("b"), k("c"), k("a")]


def test_fifo_evicts_the_oldest_stored_whatever_its_use() -> None:
    index = index_of("fifo", "a", "b", "c")
    for _ in range(3):
        index.touch(k("a"))
    assert index.victims(1) == [k("a")]
    assert index.victims(2 * FP) == [k("a"), k("b")]
    index.add(k("a"), FP)  # stored again: keeps its place
    assert list(index) == [k("a"), k("b"), k("c")]
    index.discard(k("a"))
    index.add(k("a"), FP)  # stored anew after leaving: the newest
    assert list(index) == [k("b"), k("c"), k("a")]


def test_lfu_aging_evicts_the_least_used_then_the_least_recent() -> None:
    index = index_of("lfu-aging", "a", "b", "c")
    index.touch(k("a"))
    index.touch(k("a"))
    index.touch(k("b"))
    assert index.victims(1) == [k("c")]
    assert index.victims(3 * FP) == [k("c"), k("b"), k("a")]
    index.touch(k("b"))  # b ties a on hits and is more recent: a goes first
    assert index.victims(2 * FP) == [k("c"), k("a")]


def test_lfu_aging_lets_new_blocks_compete_with_once_popular_ones() -> None:
    index = index_of("lfu-aging", "old", "popular")
    for _ in range(2):
        index.touch(k("old"))
        index.touch(k("popular"))
    # Evicting a block used twice advances the clock to 2 ...
    assert index.victims(1) == [k("old")]
    index.discard(k("old"))
    # ... so a new block ranks with blocks used twice long ago (plain LFU would rank it 0):
    # the tie goes to recency, and one use puts it ahead.
    index.add(k("new"), FP)
    assert index.victims(1) == [k("popular")]
    index.touch(k("new"))
    assert list(index) == [k("popular"), k("new")]


def test_a_chain_touched_suffix_first_keeps_its_prefix_longest() -> None:
    for name in EVICTIONS:
        index = RecencyIndex(name)
        chain = [k(f"c{n}") for n in range(4)]
        for key in Policy.recency_order(chain):
            index.add(key, FP)
        for key in Policy.recency_order(chain):
            index.touch(key)
        assert index.victims(FP) == [chain[-1]], name
        assert index.victims(4 * FP) == chain[::-1], name


# -- pins, short answers, edge cases --------------------------------------------------------------


@pytest.mark.parametrize("name", EVICTIONS)
def test_pinned_keys_are_skipped(name: str) -> None:
    index = index_of(name, "a", "b", "c", "d")
    first = list(index)
    assert index.victims(2 * FP, exclude={first[0], first[2]}) == [first[1], first[3]]
    assert index.victims(FP, exclude=set(first[:3])) == [first[3]]


@pytest.mark.parametrize("name", EVICTIONS)
def test_not_enough_to_free_is_none_having_changed_nothing(name: str) -> None:
    index = index_of(name, "a", "b", "c")
    index.touch(k("b"))
    before = state(index)
    first = index.victims(FP)
    assert index.victims(3 * FP + 1) is None
    assert index.victims(2 * FP, exclude={k("a"), k("c")}) is None
    assert index.victims(3 * FP, exclude={k("b")}) is None
    assert state(index) == before
    assert index.victims(FP) == first
    assert index.victims(0) == [] and index.victims(-5) == []


@pytest.mark.parametrize("name", EVICTIONS)
def test_membership_footprints_and_absent_keys(name: str) -> None:
    index = RecencyIndex(name)
    index.add(k("a"), 10)
    index.add(k("b"), 300)
    index.touch(k("zzz"))  # absent: ignored
    index.discard(k("zzz"))
    assert len(index) == 2 and k("a") in index and k("zzz") not in index
    assert dict(index.members) == {k("a"): 10, k("b"): 300}
    assert index.victims(250, exclude={k("a")}) == [k("b")]  # one big block frees enough
    index.add(k("a"), 500)  # stored again, bigger
    assert index.members[k("a")] == 500
    index.discard(k("a"))
    assert list(index) == [k("b")] and k("a") not in index
    index.discard(k("b"))
    assert len(index) == 0 and index.victims(1) is None


# -- the heap index against the ordered dict ------------------------------------------------------


def test_the_heap_index_ranks_lru_exactly_as_the_ordered_dict_does() -> None:
    rng = random.Random(11)
    fast, generic = LruIndex(), PriorityIndex(LRU)
    names = [k(f"k{n}") for n in range(40)]
    for step in range(5000):
        key = rng.choice(names)
        op, size = rng.random(), rng.randint(1, 200)
        for index in (fast, generic):
            if op < 0.3:
                index.add(key, size)
            elif op < 0.8:
                index.touch(key)
            else:
                index.discard(key)
        if step % 50 == 0:
            pins = set(rng.sample(names, 5))
            needed = rng.randint(0, 3000)
            assert fast.victims(needed, pins) == generic.victims(needed, pins), step
            assert list(fast) == list(generic)
            assert dict(fast.members) == dict(generic.members)


def test_touches_do_not_grow_the_heap_without_bound() -> None:
    index = PriorityIndex(LFU_AGING)
    for n in range(10):
        index.add(k(f"k{n}"), FP)
    for _ in range(10_000):
        index.touch(k("k3"))
    assert len(index._heap) <= 2 * len(index) + 64
    assert index.victims(FP) == [k("k0")]
    assert list(index)[-1] == k("k3")


# -- the setting ---------------------------------------------------------------------------------


def test_policy_eviction_setting(tmp_path: Path) -> None:
    assert Policy().eviction == "lru"
    assert Policy(eviction="lfu-aging").eviction == "lfu-aging"
    with pytest.raises(ValueError, match="eviction"):
        Policy(eviction="mru")
    path = tmp_path / "kvstore.toml"
    path.write_text('[policy]\neviction = "lfu-aging"\n')
    assert load_config(path, env={}).policy.eviction == "lfu-aging"
    assert load_config(env={"KVSTORE_POLICY_EVICTION": "fifo"}).policy.eviction == "fifo"
    assert load_config(env={}).policy.eviction == "lru"
    with pytest.raises(ConfigError, match=r"policy\.eviction"):
        load_config(env={"KVSTORE_POLICY_EVICTION": "mru"})
