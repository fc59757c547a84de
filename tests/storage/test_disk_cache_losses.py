"""Entries gone from the disk cache after an epoch (evicted by this process or another sharing the folder, a
write not made) are fetched again, and prefetched: a kept marker or a remembered entry is not taken for the
entry itself. Against moto's S3 server and the loopback HTTP server, batches checked against zarr-python."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import stoker
from stoker.storage import prefetch as sprefetch
from stoker.storage.diskcache import disk_cache

from cached_arrays import ARRAYS, BOXES, cache_folder, check_batch, entries, payloads
from test_disk_cache_engine import (  # noqa: F401 - fixtures
    FAST, ONE_EACH, _Asked, _config, _planned_while_held, data, http, remote, s3, zarr_values)

CACHE_BYTES = 64 << 20
COLD = len(ONE_EACH) - 2  # a cold epoch's batches planned ahead: all but the two that take the slots


class _Started:
    """Values and ranges the prefetch buffer started fetching (the real ``PrefetchBuffer.ask``)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = sprefetch.PrefetchBuffer.ask

        def ask(buf, *args, **kwargs):
            out = real(buf, *args, **kwargs)
            self.n += out.started
            return out

        monkeypatch.setattr(sprefetch.PrefetchBuffer, "ask", ask)


def _cfg(options, folder) -> stoker.Config:
    return stoker.Config(batch_size=1, dtype="i64", n_compute_threads=2, pop_timeout_s=60, lookahead_batches=1,
                         storage_options=options, cache_dir=str(folder), cache_bytes=CACHE_BYTES)


def _epoch(p, asked: _Asked, uri: str, path: str, want) -> int:
    """An epoch of ONE_EACH's crops of ``path`` (checked against ``want``), its first two batches held while
    COLD are planned: how many were planned ahead (``_planned_while_held``)."""
    return _planned_while_held(p, asked, f"{uri}/{path}", ONE_EACH, want, COLD)


def _unlink_payloads(folder) -> int:
    """Remove every entry with a payload, markers kept: what another process's eviction does."""
    gone = payloads(folder)
    for e in gone:
        os.unlink(e)
    return len(gone)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", list(ARRAYS))
def test_entries_this_process_evicts_are_prefetched_again(remote, data, tmp_path, monkeypatch, path):  # noqa: F811
    # one pipeline, two epochs; between them this process's cache evicts every entry (other values written
    # push them out). The second epoch needs every fetch again: planned ahead and prefetched as the first.
    # Before: entry_files gave the entries remembered from the first epoch, found nothing to fetch, and
    # batches waited for the network (prefetched 0).
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path, CACHE_BYTES)
    want = zarr_values(data, path)
    asked, started = _Asked(monkeypatch), _Started(monkeypatch)
    with stoker.Pipeline(_cfg(options, folder)) as p:
        assert _epoch(p, asked, uri, path, want) == COLD
        first = started.n
        assert first >= COLD and cache.flush(30) and payloads(folder)
        evicted = cache.evicted
        for i in range(2 * CACHE_BYTES // (8 << 20)):  # the LRU's oldest (the epoch's entries) go first
            cache.put(f"filler\n{i}", os.urandom(8 << 20))
        assert cache.flush(30) and cache.evicted > evicted
        gc.collect()  # the first epoch's batches still viewed in a reference cycle hold their slots until then
        before = len(asked.planned)
        assert _epoch(p, asked, uri, path, want) == COLD  # values checked
        assert asked.planned[before:before + COLD] == [0] * COLD  # nothing handed as on disk
        assert started.n - first >= first, (first, started.n - first)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_new_pipeline_prefetches_what_was_evicted_though_marked(remote, data, tmp_path, monkeypatch, path):  # noqa: F811
    # a restart over a folder whose entries another process evicted, their keys' markers left: every chunk is
    # fetched, and prefetched. Before: a marked whole value was only revalidated, never fetched ahead.
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path, CACHE_BYTES)
    want = zarr_values(data, path)
    asked, started = _Asked(monkeypatch), _Started(monkeypatch)
    with stoker.Pipeline(_cfg(options, folder)) as p:
        _epoch(p, asked, uri, path, want)
        first = started.n
    assert cache.flush(30) and _unlink_payloads(folder)
    with stoker.Pipeline(_cfg(options, folder)) as p:
        _epoch(p, asked, uri, path, want)
        assert started.n - first >= first, (first, started.n - first)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", list(ARRAYS))
def test_entries_another_process_evicts_are_reported_by_the_engine(remote, data, tmp_path, monkeypatch, path):  # noqa: F811
    # entries unlinked by another process: no counter here sees it, so batches planned before the engine read
    # one are handed entries and fall back per chunk (values still right); the engine reports the misses
    # (entries_missed), so the batches planned after look on disk and fetch. Before: every later plan was
    # handed the remembered entries too.
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path, CACHE_BYTES)
    want = zarr_values(data, path)
    asked = _Asked(monkeypatch)
    with stoker.Pipeline(_cfg(options, folder)) as p:
        _epoch(p, asked, uri, path, want)
        assert cache.flush(30) and _unlink_payloads(folder)
        gc.collect()  # (as above)
        losses, before = getattr(cache, "losses", 0), len(asked.planned)
        _epoch(p, asked, uri, path, want)
        after = asked.planned[before:]
        assert after and after[-1] == 0, after  # planned once the engine missed: nothing handed as on disk
        assert cache.losses > losses


def test_planning_counts_each_disk_cache_once(tmp_path):
    """A store several arrays of a batch share is one disk cache: its losses count once however many arrays
    a batch reads (summed per array, batches reading two arrays and one differed although nothing was lost
    between them, and each such plan reset ``quiet``, so batches found whole on disk never quieted planning)."""
    from types import SimpleNamespace

    from stoker.engine.pipeline.prefetch import Ahead
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.prefetch import PrefetchStore
    from stoker.storage.uri import open_store

    ahead = Ahead(stoker.Config(prefetch_bytes=1 << 20))
    assert ahead.buffer is not None
    cache = disk_cache(str(tmp_path / "cache"), CACHE_BYTES)
    kv = PrefetchStore(CachingStore(open_store(str(tmp_path / "data")), cache), ahead.buffer)
    two, one = (SimpleNamespace(sources=[SimpleNamespace(kv=kv)] * n) for n in (2, 1))
    cache.lost()  # a loss long ago (an eviction in the first epoch)
    ahead.planned(two, None, False)  # the loss seen
    ahead.quiet = 3  # batches found whole on disk since
    for plan in (one, two, one, two):  # nothing lost between these plans
        ahead.planned(plan, None, False)
        assert ahead.quiet == 3
    cache.lost()  # a loss now: planning ahead resumes
    ahead.planned(one, None, False)
    assert ahead.quiet == 0


def test_a_wrapper_marks_its_keys_again_after_the_engine_found_them_evicted(http, data, tmp_path):  # noqa: F811
    # another process evicts a pipeline's entries and markers; the engine finds the entries gone (reported:
    # entries_missed) and they are fetched and kept again. Their markers are written again too, so another
    # process's wrapper of the folder finds them kept. Before: the markers memo followed only this process's
    # own evictions (DiskCache.evicted), not the one loss count, and they were never written again
    from stoker.storage import ObjectStore
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.diskcache import DiskCache

    folder, cache = cache_folder(tmp_path)
    with stoker.Pipeline(_config({http.url + "/": dict(FAST)}, folder)) as p:
        check_batch(p, http.url, data, "plain")  # cold: fetched, kept, marked
        assert cache.flush(30)
        for entry in entries(folder):  # another process's eviction: entries and markers
            os.unlink(entry)
        losses, asked = cache.losses, len(http.log)
        check_batch(p, http.url, data, "plain")  # the engine misses them: fetched, kept again (values checked)
        assert cache.losses > losses and cache.flush(30)
    keys = sorted({path.lstrip("/") for _, method, path in http.log[asked:] if method == "GET" and "/c/" in path})
    assert len(keys) >= len(BOXES)
    other = CachingStore(ObjectStore(http.url, **FAST), DiskCache(str(folder), 64 << 20))  # another process's view
    try:
        assert other.kept_on_disk(keys) == [True] * len(keys)
        asked = len(http.log)
        values = other.get_many(keys, [])[0]
        assert all(bytes(v) == open(os.path.join(data, k), "rb").read() for k, v in zip(keys, values))
        assert not [path for _, method, path in http.log[asked:] if method == "GET"]  # from disk, a HEAD each
    finally:
        other.close()


def test_a_quiet_planner_looks_up_again_once_a_store_fetches(tmp_path, monkeypatch):
    """Batches found whole on disk (QUIET_AFTER in a row) are no longer looked up ahead (prefetch_plan not
    run); once a store of a batch fetched something (a chunk not on disk), the next batch planned is looked
    up and prefetched again (before, every batch waiting for a slot was looked up, quiet or not)."""
    from types import SimpleNamespace

    from stoker.engine.pipeline import prefetch
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.prefetch import PrefetchStore
    from stoker.storage.uri import open_store

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "k").write_bytes(b"0123456789")
    looked: list = []
    real = prefetch.prefetch_plan

    def counted(plan, *args):  # what the real one says of a plan of no chunk: nothing to fetch
        looked.append(plan)
        return real(plan, *args)

    monkeypatch.setattr(prefetch, "prefetch_plan", counted)
    ahead = prefetch.Ahead(stoker.Config(prefetch_bytes=1 << 20))
    cache = disk_cache(str(tmp_path / "cache"), CACHE_BYTES)
    caching = CachingStore(open_store(str(tmp_path / "data")), cache)
    kv = PrefetchStore(caching, ahead.buffer)
    plan = SimpleNamespace(sources=[SimpleNamespace(kv=kv)], chunk_file=np.zeros(0, np.int64), disk_entries=None)
    ahead.planned(plan, None, True)  # seen first: looked up
    assert len(looked) == 1
    ahead.quiet = prefetch.QUIET_AFTER  # batches found whole on disk since
    for _ in range(3):
        ahead.planned(plan, None, True)
    assert len(looked) == 1 and ahead.quiet == prefetch.QUIET_AFTER
    assert [bytes(v) for v in caching.get_many(["k"], [])[0]] == [b"0123456789"]  # fetched: not on disk
    assert caching.fetched == 1
    ahead.planned(plan, None, True)
    assert len(looked) == 2 and ahead.quiet == 0


def test_a_quiet_planner_looks_up_again_once_a_store_asked_for_an_absent_chunk(tmp_path, monkeypatch):
    """A chunk never written (read as its fill value) is asked of the store at every read (a round trip, a
    404) and never kept: a batch reading one is not whole on disk. Once quiet (QUIET_AFTER batches whole on
    disk), a store's request for an absent chunk ends it as a fetch does, so the batches after are looked up
    and their absent chunks prefetched; before, a 404 counted as nothing fetched, and a quiet planner stayed
    quiet for good, each such batch waiting a round trip for its absent chunks."""
    from types import SimpleNamespace

    from stoker.engine.pipeline import prefetch
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.prefetch import PrefetchStore
    from stoker.errors import NotFound
    from stoker.storage.store import ByteRange
    from stoker.storage.uri import open_store

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "k").write_bytes(b"0123456789")
    looked: list = []
    real = prefetch.prefetch_plan

    def counted(plan, *args):
        looked.append(plan)
        return real(plan, *args)

    monkeypatch.setattr(prefetch, "prefetch_plan", counted)
    ahead = prefetch.Ahead(stoker.Config(prefetch_bytes=1 << 20))
    cache = disk_cache(str(tmp_path / "cache"), CACHE_BYTES)
    caching = CachingStore(open_store(str(tmp_path / "data")), cache)
    kv = PrefetchStore(caching, ahead.buffer)
    plan = SimpleNamespace(sources=[SimpleNamespace(kv=kv)], chunk_file=np.zeros(0, np.int64), disk_entries=None)
    ahead.planned(plan, None, True)
    ahead.quiet = prefetch.QUIET_AFTER  # batches found whole on disk since
    ahead.planned(plan, None, True)
    assert len(looked) == 1 and caching.fetched == 0
    assert caching.get_many(["absent"], [])[0] == [None]  # never written: the store has nothing, nothing kept
    assert caching.fetched == 1 and caching.counters.absent == 1 and caching.counters.misses == 0
    ahead.planned(plan, None, True)
    assert len(looked) == 2 and ahead.quiet == 0
    ahead.quiet = prefetch.QUIET_AFTER
    parts = caching.get_each([ByteRange("absent", 0, 4)])  # a range of it, each failure its own: the same
    assert isinstance(parts[0], NotFound) and caching.fetched == 2
    ahead.planned(plan, None, True)
    assert len(looked) == 3 and ahead.quiet == 0
