"""The GPU decode's chunks of arrays in stores, served from the disk cache by the compiled reads (issue 48):
against moto's S3 server and the loopback HTTP server, the GPU-decode executor (on the host stand-in) reads the
chunks whose generation its pipeline knows from their entry files in one ``stage_read`` call per store and
group (csrc/staging.c: each payload checked as the CPU engine checks entries, placed into the staging), with
no Python ``get_many`` and no entry read in Python; an entry flipped, truncated or evicted is fetched again
through the store; every batch equals zarr-python's values, and the CPU path's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.gpu import native_reads
from stoker.engine.gpu import staging as gpu_staging
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.pipeline import facade as pipelines
from stoker.storage.diskcache import DiskCache, disk_cache

from cached_arrays import ARRAYS, BOXES, damage_entries, remote_fixture
from cached_arrays import check_batch as _batch, entries as _entries, write as _write
from store_fixtures import BUCKET, empty_s3_fixture, range_server_fixture, read_tree, written_tree_fixture, zarr_values

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not native_reads.available() or not native.zstd, reason="no compiled engine")]

s3 = empty_s3_fixture()
data = written_tree_fixture(_write)
http = range_server_fixture()
remote = remote_fixture("gpu-entries")


@pytest.fixture
def gpu_decode(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on the host."""
    monkeypatch.setattr(pipelines, "make_executor",
                        lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))


class _Calls:
    """Counts, on every thread: the staging's store reads through Python (``fetch_stored``: one ``get_many``, a
    remote request or a disk-cache hit read in Python), the chunk entries read in Python (DiskCache.get_many;
    an array's zarr.json apart), and the compiled reads' calls with their entry rows."""

    def __init__(self, monkeypatch) -> None:
        self.get_many = self.python_entries = self.stage_calls = self.entry_rows = 0
        fetch_stored, cache_get_many, read = gpu_staging.fetch_stored, DiskCache.get_many, native.stage_read

        def counted_fetch(*args, **kwargs):
            self.get_many += 1
            return fetch_stored(*args, **kwargs)

        def counted_cache(cache, idents, read_files=None):
            self.python_entries += sum(1 for i in idents if not i.endswith("\nkept") and not
                                       i.split("\n")[1].rsplit("/", 1)[-1].startswith("zarr.json"))
            return cache_get_many(cache, idents, read_files)

        def counted_read(buf, paths, files, table, *rest, **kw):
            self.stage_calls += 1
            self.entry_rows += int((table[:, 1] == native_reads.ENTRY).sum())
            return read(buf, paths, files, table, *rest, **kw)

        monkeypatch.setattr(gpu_staging, "fetch_stored", counted_fetch)
        monkeypatch.setattr(DiskCache, "get_many", counted_cache)
        monkeypatch.setattr(native, "stage_read", counted_read)


def _config(options: dict, folder) -> stoker.Config:
    return stoker.Config(batch_size=len(BOXES), dtype="native", n_compute_threads=2, pop_timeout_s=60,
                         storage_options=options, cache_dir=str(folder), cache_bytes=64 << 20, prefetch_bytes=0,
                         device="cpu", host_buffer_bytes=16 << 20, device_buffer_bytes=16 << 20)


@pytest.mark.parametrize("path", list(ARRAYS))
def test_hits_of_known_generations_are_read_by_the_compiled_reads(remote, data, tmp_path, monkeypatch, gpu_decode,
                                                                   path):
    uri, options, server = remote
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)
    with stoker.Pipeline(_config(options, folder)) as p:  # epoch 1: fetched, kept
        _batch(p, uri, data, path)
    assert cache.flush(30)
    with stoker.Pipeline(_config(options, folder)) as p:  # epoch 2, a new pipeline
        _batch(p, uri, data, path)  # (its first batch learns the generations: S3 by a LIST, HTTP by HEADs)
        calls = _Calls(monkeypatch)
        hits, hit_bytes = cache.hits, cache.hit_bytes
        asked = server.requests if server else None
        _batch(p, uri, data, path)
        # every chunk from its entry file, in one compiled call per group: no get_many, no entry read in Python
        assert calls.get_many == 0 and calls.python_entries == 0, vars(calls)
        assert calls.entry_rows > 0 and calls.stage_calls == 1, vars(calls)
        assert cache.hits - hits == calls.entry_rows and cache.hit_bytes > hit_bytes  # counted as hits
        if server is not None:
            assert server.requests == asked  # no request at all
        monkeypatch.undo()


@pytest.mark.parametrize("path", list(ARRAYS))
def test_entries_another_process_evicts_are_reported_by_the_compiled_reads(remote, data, tmp_path, monkeypatch,
                                                                           gpu_decode, path):
    # entries unlinked by another process, handed to the compiled reads, which find them gone (ST_ENTRY): the
    # store's cache is told (entries_missed), as the CPU engine tells it, so its next look-ups look on disk.
    # Before: nothing told it, and they kept being handed out until a CPU read missed them
    uri, options, server = remote
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)
    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert cache.flush(30)
        damage_entries(folder, "unlink")  # another process's eviction (the empty markers kept)
        calls = _Calls(monkeypatch)
        losses = cache.losses
        _batch(p, uri, data, path)  # zarr's values: fetched again through the store
        assert calls.entry_rows > 0 and calls.get_many > 0, vars(calls)  # handed out, found gone
        assert cache.losses > losses  # reported
        monkeypatch.undo()


@pytest.mark.parametrize("damage", ["flip", "truncate", "unlink"])
@pytest.mark.parametrize("path", list(ARRAYS))
def test_an_unsound_entry_is_fetched_again(remote, data, tmp_path, monkeypatch, gpu_decode, damage, path):
    uri, options, server = remote
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)
    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert cache.flush(30)
        damage_entries(folder, damage)  # the entries with a payload (not the empty markers)
        calls = _Calls(monkeypatch)
        misses = cache.misses
        _batch(p, uri, data, path)  # zarr's values: no unsound payload decoded
        assert calls.get_many > 0 and cache.misses > misses, vars(calls)  # fetched from the store
        if damage != "unlink":
            assert calls.entry_rows > 0  # handed to the compiled reads, which found them unsound
        monkeypatch.undo()
        assert cache.flush(30)
        hits = cache.hits
        _batch(p, uri, data, path)  # the entries written anew are sound: served from disk again
        assert cache.hits > hits


def test_an_unsound_entry_before_a_sound_one_in_a_full_group_is_fetched_again(remote, s3, data, tmp_path,
                                                                                 monkeypatch, gpu_decode):
    """Every other inner chunk's entry of a sharded array damaged, each group's staging reserved to the byte
    (its ranges' lengths, as ReadPlan.take reserves them where the staging is what cuts the group: here each
    group's buffer is cut to that, a view of the real staging): an unsound entry placed before a sound one
    leaves no hole (the sound payloads are moved end to end), so the store's refetch of it fits the group's
    room, and the batch is zarr-python's (before: BudgetExceeded)."""
    import struct

    import zarr

    uri, options, server = remote
    shape = (256, 256)
    arr = zarr.create_array(os.path.join(data, "tight"), shape=shape, chunks=(32, 32), shards=(128, 128),
                            dtype="uint8", compressors=ZstdCodec(level=1))
    arr[...] = np.random.default_rng(7).integers(0, 256, shape, dtype=np.uint8)
    if server is None:  # (the HTTP server serves the folder as it is; S3 holds what was uploaded)
        s3.upload(read_tree(os.path.join(data, "tight")), uri.removeprefix(f"s3://{BUCKET}/") + "/tight")
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)
    cfg = stoker.Config(batch_size=1, dtype="native", n_compute_threads=2, pop_timeout_s=60, storage_options=options,
                        cache_dir=str(folder), cache_bytes=64 << 20, prefetch_bytes=0, device="cpu",
                        host_buffer_bytes=1 << 20, device_buffer_bytes=16 << 20)
    want = zarr_values(data, "tight")
    read, groups = gpu_staging.Stager.read, []

    def exact(stager, plan, sources, reads, i, e, buf, group, *rest):
        room = int(reads.enc[e] - reads.enc[i] - reads.gap[i])  # what take() reserved for chunks i..e
        groups.append(room)
        return read(stager, plan, sources, reads, i, e, buf[:group.pos + room], group, *rest)

    def batch(p):
        p.push([stoker.Sample(f"{uri}/tight", [(0, 256), (0, 256)])])
        with p.pop() as b:
            np.testing.assert_array_equal(torch.from_dlpack(b)[0].numpy(), want)

    with stoker.Pipeline(cfg) as p:
        batch(p)
        assert cache.flush(30)
        batch(p)  # (generations known from here on)
        damaged, lengths = 0, set()
        for entry in _entries(folder):
            with open(entry, "rb") as f:
                raw = f.read()
            if len(raw) < 200:  # (not the empty markers)
                continue
            ident = raw[24:24 + struct.unpack_from("<I", raw, 12)[0]].decode().split("\n")  # uri, key, range, ...
            if "/tight/c/" not in "/" + ident[1] or ":" not in ident[2]:  # (S3: its key under the prefix)
                continue
            offset, length = map(int, ident[2].split(":"))
            if length == 16 * 16 + 4:  # a shard's index (an offset and a length per inner chunk, its crc32c)
                continue
            lengths.add(length)
            if (offset // length) % 2:  # every other inner chunk of each shard (their lengths are equal)
                continue
            with open(entry, "r+b") as f:  # one bit of the payload's last byte
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0x10]))
            damaged += 1
        assert damaged == 32 and len(lengths) == 1  # (incompressible: every inner chunk as long)
        calls = _Calls(monkeypatch)
        monkeypatch.setattr(gpu_staging.Stager, "read", exact)
        hits = cache.hits
        batch(p)  # zarr's values: the unsound ones fetched again into the room their sound neighbours left
        assert calls.entry_rows == 64 and calls.get_many > 0 and cache.hits - hits == 32, vars(calls)
        assert len(groups) > 1 and sum(groups) == 64 * lengths.pop(), groups
