"""SizedLRU against a model: bounded by bytes, thread-safe, oversized values returned but not kept."""

from __future__ import annotations

import random
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.storage.cache import SizedLRU

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# SizedLRU


class ModelLRU:
    """Reference model of SizedLRU's contract."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.items = OrderedDict()
        self.hits = self.misses = 0

    def get_or_load(self, key, load, size):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return self.items[key][0]
        self.misses += 1
        value = load()
        if size <= self.max_bytes:
            self.items[key] = (value, size)
            while sum(s for _, s in self.items.values()) > self.max_bytes:
                self.items.popitem(last=False)
        return value


@given(st.integers(0, 100), st.lists(st.tuples(st.integers(0, 12), st.integers(0, 60)), max_size=80))
@settings(max_examples=200, deadline=None)
def test_sized_lru_matches_model(max_bytes, ops):
    sizes = {}
    cache = SizedLRU(max_bytes, sizeof=lambda v: sizes[v])
    model = ModelLRU(max_bytes)
    for key, size in ops:
        sizes.setdefault(f"v{key}", size)
        size = sizes[f"v{key}"]
        loads = []
        missed_before = model.misses
        value = cache.get_or_load(key, lambda: loads.append(key) or f"v{key}")
        expected = model.get_or_load(key, lambda: f"v{key}", size)
        assert value == expected == f"v{key}"
        assert cache.nbytes <= max_bytes
        assert (cache.hits, cache.misses) == (model.hits, model.misses)
        assert len(loads) == model.misses - missed_before  # loaded exactly on a miss
        assert list(cache._items) == list(model.items)  # same contents in the same LRU order
        assert cache.nbytes == sum(s for _, s in model.items.values())
        assert len(cache) == len(model.items)


def test_sized_lru_order_and_counters():
    loads = []

    def loader(k):
        return lambda: loads.append(k) or k * 10

    cache = SizedLRU(max_bytes=30, sizeof=lambda v: 10)
    assert [cache.get_or_load(k, loader(k)) for k in (1, 2, 3)] == [10, 20, 30]
    assert (cache.hits, cache.misses, len(cache), cache.nbytes) == (0, 3, 3, 30)
    assert cache.get_or_load(1, loader(1)) == 10  # hit: 1 becomes most recent
    assert cache.hits == 1 and loads == [1, 2, 3]
    cache.get_or_load(4, loader(4))  # evicts 2, the least recently used
    assert cache.nbytes == 30 and len(cache) == 3
    cache.get_or_load(1, loader(1))
    cache.get_or_load(3, loader(3))
    assert loads == [1, 2, 3, 4]
    cache.get_or_load(2, loader(2))  # 2 was evicted: reloaded
    assert loads == [1, 2, 3, 4, 2]
    assert (cache.hits, cache.misses) == (3, 5)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_get_many_is_get_for_each_key_in_one_lock():
    """Hits become the most recent in the order asked; misses are counted and given as ``missing``; a cached
    None is a hit."""
    cache = SizedLRU(max_bytes=40, sizeof=lambda v: 10)
    for k in (1, 2, 3):
        cache.put(k, None if k == 2 else k * 10)
    missing = object()
    assert cache.get_many([3, 9, 2, 1], missing) == [30, missing, None, 10]
    assert list(cache._items) == [3, 2, 1] and (cache.hits, cache.misses) == (3, 1)
    cache.put(4, 40)
    cache.put(5, 50)  # evicts 3: the least recently asked for
    assert cache.get_many([3, 2], missing) == [missing, None]
    assert cache.get_many([]) == []


def test_holds_is_in_for_each_key_and_touches_nothing():
    """``holds`` says what ``in`` says of each key (a cached None held too), and neither reorders nor counts."""
    cache = SizedLRU(max_bytes=30, sizeof=lambda v: 10)
    for k in (1, 2, 3):
        cache.put(k, None if k == 2 else k * 10)
    assert cache.holds([3, 9, 2, 1, 3]) == [True, False, True, True, True]
    assert list(cache._items) == [1, 2, 3] and (cache.hits, cache.misses) == (0, 0)
    cache.put(4, 40)  # evicts 1: still the least recently used
    assert cache.holds([1, 4]) == [False, True] and cache.holds([]) == []


def test_sized_lru_oversized_values_are_returned_not_kept():
    cache = SizedLRU(max_bytes=100, sizeof=len)
    small = cache.get_or_load("s", lambda: b"x" * 60)
    big = cache.get_or_load("b", lambda: b"y" * 101)
    assert big == b"y" * 101 and len(cache) == 1 and cache.nbytes == 60
    assert cache.get_or_load("s", lambda: b"other") == small
    # None values are cacheable (a missing shard is remembered as None)
    calls = []
    none_cache = SizedLRU(max_bytes=100, sizeof=lambda v: 64)
    for _ in range(3):
        assert none_cache.get_or_load("k", lambda: calls.append(1)) is None
    assert len(calls) == 1
    assert (none_cache.hits, none_cache.misses) == (2, 1)


def test_sized_lru_threads():
    cache = SizedLRU(max_bytes=1000, sizeof=lambda v: v[1])
    rng = random.Random(7)
    keys = [rng.randrange(60) for _ in range(4000)]

    def work(part):
        for k in part:
            value = cache.get_or_load(k, lambda k=k: (k, 10 + k % 50))
            assert value == (k, 10 + k % 50)
            assert cache.nbytes <= 1000

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, [keys[i::8] for i in range(8)]))
    assert cache.hits + cache.misses == len(keys)
    assert cache.nbytes == sum(size for _, size in cache._items.values()) <= 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.booleans(), st.integers(1, 40)), max_size=80))
def test_forget_nones_drops_exactly_the_none_values_still_cached(ops):
    """What a pipeline does at each push to its shard indexes: the keys cached as None (shards not stored)
    are dropped, every other entry is kept, and the bytes add up, also after evictions and replacements."""
    cache = SizedLRU(200, sizeof=lambda v: 7 if v is None else len(v))
    for key, none, size in ops:
        cache.put(key, None if none else "x" * size)
    kept = {k: v for k, (v, _) in cache._items.items()}
    assert cache.forget_nones() == sum(v is None for v in kept.values())
    assert {k: v for k, (v, _) in cache._items.items()} == {k: v for k, v in kept.items() if v is not None}
    assert cache.nbytes == sum(len(v) for v in kept.values() if v is not None)
    assert cache.forget_nones() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40)), max_size=80))
def test_every_value_evicted_or_replaced_is_told_once(ops):
    """``evicted`` is told each value a put evicted or replaced by another (what the pipeline tells its
    executors to forget): with the values still cached, every value put, each object once."""
    told: list = []
    cache = SizedLRU(120, sizeof=len, evicted=told.extend)
    put = []
    for key, size in ops:
        value = ["x"] * size  # a new object each put
        put.append(value)
        cache.put(key, value)
    kept = [v for v, _ in cache._items.values()]
    assert sorted(map(id, told + kept)) == sorted(map(id, put))
