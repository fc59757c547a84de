"""``CropDataset(persistent=True)``: one pipeline for every epoch read to its end (as DataLoader's
``persistent_workers``), each epoch's batches its own and equal to the zarr-python oracle, an epoch stopped
early closing it, exact resume; ``Pipeline.drop_used_up``; and over an object store with a disk cache, the
second epoch asking the server nothing where a new pipeline revalidates every object."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader
from zarr.codecs import ZstdCodec

import stoker
from stoker.storage.diskcache import disk_cache

from store_fixtures import FAST_REMOTE, random_int_arrays, range_server_fixture, written_tree_fixture

pytestmark = pytest.mark.timeout(120)

N = 26  # samples an epoch: 6 batches of 4 and 2 left over, which drop_last drops


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("persistent") / "v.zarr")
    z = zarr.create_array(uri, shape=(12, 40, 40), chunks=(4, 16, 16), dtype="int16")
    z[:] = np.random.default_rng(8).integers(-3000, 3000, z.shape, dtype=np.int16)
    return uri, z[:]


def _source(uri):
    return stoker.RandomCrops([uri], (4, 8, 8), seed=3, samples_per_epoch=N)


def _cfg(**kw):
    return stoker.Config(**{**dict(batch_size=4, dtype="f32", device="cpu", n_compute_threads=2,
                                   host_buffer_bytes=16 << 20, pop_timeout_s=20.0), **kw})


def _want(data, uri, epoch, start=0, stop=24):
    src = _source(uri)
    return np.stack([data[tuple(slice(*ax) for ax in src.sample(epoch, i).aabb)] for i in range(start, stop)]
                    ).astype("f4")


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_epoch_runs_in_one_pipeline_and_gives_its_own_batches(volume, decode_path, drop_last):
    """Three epochs through a DataLoader: one pipeline, each epoch's batches exactly its samples (the 2 left
    over by drop_last never open the next epoch), as the zarr-python read of each crop."""
    uri, data = volume
    ds = stoker.CropDataset(_source(uri).for_rank(0, 1), _cfg(drop_last=drop_last), copy=True, persistent=True)
    pipelines = []
    for epoch in range(3):
        got = list(DataLoader(ds, batch_size=None))
        assert len(got) == (6 if drop_last else 7)
        assert np.array_equal(torch.cat(got).numpy(), _want(data, uri, epoch, stop=24 if drop_last else N))
        pipelines.append(ds._kept[0])
        assert ds.state_dict()["epoch"] == epoch + 1
    assert pipelines[0] is pipelines[1] is pipelines[2]
    assert pipelines[0].pending == 0 and pipelines[0].state_dict()["sources"] == []
    ds.close()
    assert ds._kept is None and pipelines[0]._closed
    again = list(DataLoader(ds, batch_size=None))  # a closed dataset iterates again, in a new pipeline
    assert np.array_equal(torch.cat(again).numpy(), _want(data, uri, 3, stop=24 if drop_last else N))


def test_an_epoch_stopped_early_closes_its_pipeline_and_the_next_iteration_continues(volume):
    uri, data = volume
    with stoker.CropDataset(_source(uri).for_rank(0, 1), _cfg(), copy=True, persistent=True) as ds:
        first = list(DataLoader(ds, batch_size=None))
        kept = ds._kept[0]
        head = []
        for x in DataLoader(ds, batch_size=None):  # epoch 1, in the kept pipeline, stopped after 2 batches
            head.append(x)
            if len(head) == 2:
                break
        rest = list(DataLoader(ds, batch_size=None))  # its batches in flight are not this iteration's
        assert kept._closed and ds._kept is not None and ds._kept[0] is not kept
        assert np.array_equal(torch.cat(first).numpy(), _want(data, uri, 0))
        assert np.array_equal(torch.cat(head + rest).numpy(), _want(data, uri, 1))
        last = ds._kept[0]
    assert last._closed and ds._kept is None  # the with block closed it


def test_a_persistent_dataset_resumes_with_the_next_batch(volume):
    """StatefulDataLoader's state of a persistent dataset (its last push's position) resumes exactly, in a
    loader made afresh from it, also after whole epochs."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    uri, data = volume
    make = lambda: sdl.StatefulDataLoader(stoker.CropDataset(_source(uri).for_rank(0, 1), _cfg(), copy=True,  # noqa: E731
                                                             persistent=True), batch_size=None)
    loader = make()
    list(loader)  # epoch 0
    it = iter(loader)
    for _ in range(4):  # 4 batches of epoch 1
        next(it)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert np.array_equal(torch.cat(rest).numpy(), _want(data, uri, 1, 16, 24))
    assert np.array_equal(torch.cat(list(resumed)).numpy(), _want(data, uri, 2))
    assert pickle.loads(pickle.dumps(resumed.dataset)).state_dict() == resumed.dataset.state_dict()


def test_drop_used_up_drops_the_leftovers_and_forgets_the_positions(volume):
    uri, data = volume
    src = _source(uri).for_rank(0, 1)
    with stoker.Pipeline(_cfg()) as p:
        p.push(src)
        with pytest.raises(stoker.InvalidArgument, match="iteration has ended"):
            p.drop_used_up()  # batches in flight, samples to give
        got = [torch.from_dlpack(b).numpy().copy() for b in p]
        assert len(got) == 6 and p.pending == 2 and len(p.state_dict()["sources"]) == 1
        assert p.drop_used_up() == 2
        assert p.pending == 0 and p.state_dict()["sources"] == [] and p.drop_used_up() == 0
        src.set_epoch(1)
        p.push(src)
        with p.pop() as b:  # epoch 1's first batch: its first 4 samples, none of epoch 0's
            assert np.array_equal(torch.from_dlpack(b).numpy(), _want(data, uri, 1, 0, 4))
            assert b.keys[:, 0].tolist() == [1] * 4
        assert p.state_dict()["sources"][-1]["position"] == 4


# -- over HTTP with a disk cache --------------------------------------------------------------------

SHAPE = (32, 64, 64)
ARRAYS = {f"a{i}": dict(chunks=(16, 16, 16), dtype="int32", compressors=ZstdCodec(level=1)) for i in range(3)}
_write = random_int_arrays(ARRAYS, SHAPE)
data = written_tree_fixture(_write)
http = range_server_fixture()


@pytest.mark.parametrize("persistent", [True, False])
def test_a_second_epoch_from_the_cache_asks_the_server_nothing_in_a_kept_pipeline(http, data, tmp_path,
                                                                                 persistent):
    """The first epoch fetches and caches; the same epoch again, in the pipeline kept, reads every chunk from the disk
    cache without a request (its generations learnt in this pipeline, within cache_staleness_s), where a new
    pipeline (persistent=False) revalidates each object it opens (HEADs, no body). Every batch equals the
    zarr-python read of the files."""
    cache = str(tmp_path / "cache")
    uris = [f"{http.url}/{name}" for name in ARRAYS]
    arrays = {u: zarr.open_array(os.path.join(data, name), mode="r")[:] for u, name in zip(uris, ARRAYS)}
    source = stoker.RandomCrops(uris, (8, 16, 16), seed=4, samples_per_epoch=24)
    cfg = _cfg(storage_options={http.url + "/": FAST_REMOTE}, cache_dir=cache, cache_bytes=64 << 20, dtype="i32")
    ds = stoker.CropDataset(source.for_rank(0, 1), cfg, copy=True, persistent=persistent, with_samples=True)
    asked = []
    for _ in range(2):
        ds.set_epoch(0)  # the same crops again: every chunk they need was fetched and cached by the first
        start = len(http.log)
        for samples, x in DataLoader(ds, batch_size=None):
            want = np.stack([arrays[s.uri][tuple(slice(*ax) for ax in s.aabb)] for s in samples])
            assert np.array_equal(x.numpy(), want)
        asked.append([(m, p) for _, m, p in http.log[start:]])
        assert disk_cache(cache, 64 << 20).flush(30)  # the first epoch's entries on disk
    ds.close()
    assert any(m == "GET" for m, _ in asked[0])
    if persistent:
        assert asked[1] == []
    else:
        assert asked[1] and all(m == "HEAD" for m, p in asked[1] if "/c/" in p)


def test_a_close_as_an_epoch_ends_leaves_no_pipeline_kept(volume, monkeypatch):
    """close() from another thread (a shutdown hook, a watchdog) that lands as the iteration ends, after its
    last batch and before the pipeline is kept: once close() returned nothing is kept open (its threads and
    batch slots), and the next iteration runs in a new pipeline."""
    import threading

    uri, data = volume
    ds = stoker.CropDataset(_source(uri).for_rank(0, 1), _cfg(), copy=True, persistent=True)
    drop = stoker.Pipeline.drop_used_up
    seen = []

    def close_first(p):
        closing = threading.Thread(target=ds.close)
        closing.start()
        closing.join()  # close() returned, before the epoch's pipeline is kept
        seen.append(p)
        return drop(p)

    monkeypatch.setattr(stoker.Pipeline, "drop_used_up", close_first)
    first = list(DataLoader(ds, batch_size=None))
    monkeypatch.setattr(stoker.Pipeline, "drop_used_up", drop)
    assert seen and ds._kept is None and seen[0]._closed
    assert np.array_equal(torch.cat(first).numpy(), _want(data, uri, 0))
    assert np.array_equal(torch.cat(list(DataLoader(ds, batch_size=None))).numpy(), _want(data, uri, 1))
    assert ds._kept is not None and ds._kept[0] is not seen[0]
    ds.close()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_rewritten_between_epochs_is_read_as_it_is_now(tmp_path, decode_path, zarr_format):
    """An array rewritten between two epochs (zarr-python's overwrite, another chunk shape of the same size):
    the next epoch of the kept pipeline reads it by its new metadata, as a new pipeline and zarr-python do, not
    the new files by the layout it opened the array with (every crop silently wrong)."""
    uri = str(tmp_path / "v.zarr")

    def write(seed, chunks):
        z = zarr.create_array(uri, shape=(16, 48, 48), chunks=chunks, dtype="int16", overwrite=True,
                              zarr_format=zarr_format)
        z[:] = np.random.default_rng(seed).integers(-3000, 3000, z.shape, dtype=np.int16)
        return z[:]

    data = write(0, (4, 16, 16))
    source = stoker.RandomCrops([uri], (4, 8, 8), seed=3, samples_per_epoch=24)
    with stoker.CropDataset(source.for_rank(0, 1), _cfg(), copy=True, persistent=True, with_samples=True) as ds:
        for epoch in range(3):
            for samples, x in DataLoader(ds, batch_size=None):
                want = np.stack([data[tuple(slice(*ax) for ax in s.aabb)] for s in samples]).astype("f4")
                assert np.array_equal(x.numpy(), want)
            kept = ds._kept[0]
            data = write(epoch + 1, [(16, 4, 16), (4, 16, 16), (8, 8, 16)][epoch])
        assert ds._kept[0] is kept  # one pipeline throughout


def test_the_gpu_and_hybrid_executors_close_the_replaced_zip_archives_too(tmp_path, monkeypatch):
    """As above, for the executors that decode on a device (here on the host: their tests' stand-ins): their
    descriptions of each array (gpu/sources.py Described) held the forgotten readers, and each old archive's
    file with them (8 descriptors after 4 epochs where 2 are open)."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.hybrid.executor import HybridExecutor
    from stoker.engine.hybrid.split import Shares
    from stoker.engine.pipeline import facade as pipelines

    archive, write = _zip_writer(tmp_path)
    write(0, (4, 16, 16))  # (the sampler opens the array)
    source = stoker.RandomCrops([archive + "/v.zarr"], (4, 8, 8), seed=3, samples_per_epoch=24)
    for make in (lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store),
                 lambda cfg, device, stats, store: HybridExecutor.on_host(cfg, stats, store, shares=Shares(0.5))):
        monkeypatch.setattr(pipelines, "make_executor", make)
        counts = _descriptors_epoch_after_epoch(tmp_path, source, write, 4)
        assert counts[0] > 0 and counts == [counts[0]] * len(counts), counts


def _descriptors_epoch_after_epoch(tmp_path, source, write, epochs: int) -> list[int]:
    """Epochs of a kept pipeline over ``write``'s archive, written anew first and replaced after each (every
    crop checked against the archive written for it): the descriptors open under ``tmp_path`` after each."""
    import gc

    from descriptors import open_under

    data, counts = write(0, (4, 16, 16)), []
    with stoker.CropDataset(source.for_rank(0, 1), _cfg(), copy=True, persistent=True, with_samples=True) as ds:
        for epoch in range(epochs):
            for samples, x in DataLoader(ds, batch_size=None):
                want = np.stack([data[tuple(slice(*ax) for ax in s.aabb)] for s in samples]).astype("f4")
                assert np.array_equal(x.numpy(), want), f"epoch {epoch}"
            gc.collect()
            counts.append(open_under(tmp_path))
            data = write(epoch + 1, (4, 16, 16))
    return counts


def _zip_writer(tmp_path):
    """``(archive, write)``: ``write(seed, chunks)`` writes an array into a folder, zips the folder into a new
    archive renamed over ``archive`` (as docs/remote.md says to replace one) and returns the array's values."""
    import zipfile

    archive, folder = str(tmp_path / "d.zip"), str(tmp_path / "tree")

    def write(seed, chunks):
        z = zarr.create_array(os.path.join(folder, "v.zarr"), shape=(16, 48, 48), chunks=chunks, dtype="int16",
                              overwrite=True)
        z[:] = np.random.default_rng(seed).integers(-3000, 3000, z.shape, dtype=np.int16)
        with zipfile.ZipFile(archive + ".tmp", "w") as zf:
            for root, _, files in os.walk(folder):
                for f in files:
                    zf.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), folder))
        os.replace(archive + ".tmp", archive)
        return z[:]

    return archive, write


def test_a_zip_archive_replaced_between_epochs_is_read_as_it_is_now(tmp_path):
    """Regression: a zip archive replaced between two epochs (a new archive renamed over it, as docs/remote.md
    says to replace one) was read by the kept pipeline through the old archive's open file: every crop of the
    next epoch silently the old data, where a new pipeline and zarr-python read the new archive."""
    archive, write = _zip_writer(tmp_path)
    data = write(0, (4, 16, 16))
    source = stoker.RandomCrops([archive + "/v.zarr"], (4, 8, 8), seed=3, samples_per_epoch=24)
    with stoker.CropDataset(source.for_rank(0, 1), _cfg(), copy=True, persistent=True, with_samples=True) as ds:
        for epoch in range(3):
            for samples, x in DataLoader(ds, batch_size=None):
                want = np.stack([data[tuple(slice(*ax) for ax in s.aabb)] for s in samples]).astype("f4")
                assert np.array_equal(x.numpy(), want), f"epoch {epoch}"
            kept = ds._kept[0]
            data = write(epoch + 1, [(4, 16, 16), (8, 8, 16), (8, 8, 16)][epoch])  # same layout, then another
        assert ds._kept[0] is kept  # one pipeline throughout


def test_the_replaced_zip_archives_are_closed_epoch_after_epoch(tmp_path, decode_path):
    """Regression: a kept pipeline over a zip archive replaced after each epoch read the new archive, but the
    compiled engine's decoder kept its descriptions of the forgotten arrays, and through them each old
    archive's store and open file: two more descriptors of deleted archives every epoch (16 after 8). The
    arrays the pipeline forgets are forgotten by its executor too, so the old archives are closed."""
    archive, write = _zip_writer(tmp_path)
    write(0, (4, 16, 16))  # (the sampler opens the array)
    source = stoker.RandomCrops([archive + "/v.zarr"], (4, 8, 8), seed=3, samples_per_epoch=24)
    counts = _descriptors_epoch_after_epoch(tmp_path, source, write, 5)
    assert counts[0] > 0 and counts == [counts[0]] * len(counts), counts  # the archive read now only


def test_a_grid_read_epoch_after_epoch_in_one_pipeline_covers_every_tile(tmp_path):
    """A TileGrid's epochs (their last short batch kept, read ahead) in the one pipeline kept: every tile once
    an epoch, in the grid's order, each equal to zarr-python's read; none skipped or carried into the next."""
    uri = str(tmp_path / "g.zarr")
    z = zarr.create_array(uri, shape=(20, 40, 36), chunks=(8, 16, 16), dtype="uint16")
    z[:] = np.random.default_rng(9).integers(0, 4096, z.shape, dtype=np.uint16)
    data = z[:]
    grid = stoker.TileGrid([uri], (8, 16, 16), stride=(6, 12, 12))
    want = [data[tuple(slice(*ax) for ax in grid.sample(0, i).aabb)].astype("f4") for i in range(len(grid))]
    assert len(grid) % 4  # a short last batch each epoch
    with stoker.CropDataset(grid, _cfg(sample_shape=(8, 16, 16)), with_samples=True, persistent=True) as ds:
        kept = []
        for _ in range(3):
            got = [(s.aabb, x.clone()) for samples, xs in ds for s, x in zip(samples, xs)]
            assert [a for a, _ in got] == [grid.sample(0, i).aabb for i in range(len(grid))]
            assert all(np.array_equal(x.numpy(), w) for (_, x), w in zip(got, want, strict=True))
            kept.append(ds._kept[0])
        assert kept[0] is kept[1] is kept[2]


def test_arrays_evicted_from_the_open_arrays_are_forgotten_by_the_executor_too(tmp_path, monkeypatch, decode_path):
    """Regression: an array evicted from the pipeline's open arrays by their bound (``_MAX_OPEN_ARRAYS``, here
    1, so that the two arrays of every batch evict each other) was not told to the executor, whose descriptions
    kept its reader: once the zip archive it was read from was replaced, the kept pipeline forgot the archive
    but the executor held its store, and its open file, for good (a descriptor more of a deleted archive every
    epoch). Told at eviction, the old archives are closed as the pipeline forgets them."""
    from stoker.engine.pipeline import coordinator

    monkeypatch.setattr(coordinator, "_MAX_OPEN_ARRAYS", 1)
    archive, write = _zip_writer(tmp_path)
    write(0, (4, 16, 16))  # (the sampler opens the arrays)
    other = str(tmp_path / "other.zarr")
    z = zarr.create_array(other, shape=(16, 48, 48), chunks=(4, 16, 16), dtype="int16")
    z[:] = np.random.default_rng(1).integers(-3000, 3000, z.shape, dtype=np.int16)
    values = {other: z[:]}
    source = stoker.RandomCrops([archive + "/v.zarr", other], (4, 8, 8), seed=3, samples_per_epoch=24)

    def write_both(seed, chunks):
        values[archive + "/v.zarr"] = write(seed, chunks)
        return values

    import gc

    from descriptors import open_under

    data, counts = write_both(0, (4, 16, 16)), []
    with stoker.CropDataset(source.for_rank(0, 1), _cfg(), copy=True, persistent=True, with_samples=True) as ds:
        for epoch in range(4):
            for samples, x in DataLoader(ds, batch_size=None):
                want = np.stack([data[s.uri][tuple(slice(*ax) for ax in s.aabb)] for s in samples]).astype("f4")
                assert np.array_equal(x.numpy(), want), f"epoch {epoch}"
            gc.collect()
            counts.append(open_under(tmp_path))
            data = write_both(epoch + 1, (4, 16, 16))
    assert counts[0] > 0 and counts == [counts[0]] * len(counts), counts
