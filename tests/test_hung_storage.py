"""Storage that blocks: a file that never answers must never hang stoker, nor keep the process alive.

A FIFO where a chunk, metadata, shard, statistics or checkpoint file should be stands in for a hung
mount: a blocking open of it waits for a writer forever. stoker opens every file non-blocking and
refuses anything but a regular file with a StorageError naming it.
"""

from __future__ import annotations

import os
import stat

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker import native
from stoker.records import ZarrRecords, compute_stats, sidecar
from stoker.storage import LocalStore
from stoker.train import Checkpoints

pytestmark = pytest.mark.timeout(60)

FIFO = "is a FIFO, not a regular file"


@pytest.fixture
def fifo():
    """``fifo(path)`` puts a FIFO at ``path``. At teardown any reader still blocked opening one is released
    (so a regression fails its test instead of leaving a thread stuck)."""
    made = []

    def make(path) -> str:
        path = str(path)
        if os.path.lexists(path):
            os.unlink(path)
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody is waiting
        except OSError:
            pass


@pytest.fixture(params=["python", "compiled"])
def engine(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(native, "decode_files", None)
    elif native.decode_files is None:
        pytest.skip("stoker._native is not available")
    return request.param


def _cfg(**kw):
    base = dict(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, n_io_threads=1, n_compute_threads=2,
                pop_timeout_s=10.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


def _array(path, fmt=3, shards=None):
    zstd = ZstdCodec(level=1) if fmt == 3 else numcodecs.Zstd(level=1)
    z = zarr.create_array(str(path), shape=(8, 8), chunks=(4, 4) if shards is None else (2, 2), shards=shards,
                          dtype="uint16", compressors=zstd, zarr_format=fmt)
    z[...] = np.arange(64, dtype="uint16").reshape(8, 8) + 1
    return str(path)


def _pipeline_raises(uri, match=FIFO):
    samples = [stoker.Sample(uri, [(0, 4), (0, 4)]), stoker.Sample(uri, [(4, 8), (4, 8)])]
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        with pytest.raises(stoker.StorageError, match=match):
            p.pop()


def test_fifo_as_chunk_file(tmp_path, fifo, engine):
    uri = _array(tmp_path / "a.zarr")
    path = fifo(tmp_path / "a.zarr" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO) as info:
        stoker.open_array(uri, store=LocalStore()).read(np.s_[0:4, 0:4])
    assert info.value.path == path
    _pipeline_raises(uri)  # the compiled reader's own open refuses it too


@pytest.mark.parametrize("fmt,name", [(3, "zarr.json"), (2, ".zarray")])
def test_fifo_as_metadata(tmp_path, fifo, fmt, name):
    uri = _array(tmp_path / "a.zarr", fmt=fmt)
    fifo(tmp_path / "a.zarr" / name)
    with pytest.raises(stoker.StorageError, match=FIFO):
        stoker.open_array(uri, store=LocalStore())
    _pipeline_raises(uri)


def test_fifo_as_shard_file(tmp_path, fifo, engine):
    uri = _array(tmp_path / "a.zarr", shards=(4, 4))
    fifo(tmp_path / "a.zarr" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO):
        stoker.open_array(uri, store=LocalStore()).read(np.s_[0:4, 0:4])
    _pipeline_raises(uri)


def test_compiled_reader_refuses_a_fifo_as_chunk_file_and_as_shard(tmp_path, fifo):
    if native.decode_files is None:
        pytest.skip("stoker._native is not available")
    path = fifo(tmp_path / "chunk")
    regions = [(-1, 0, 0, 64), (0, 16, 0, 64)]  # a whole chunk file, an inner chunk of a shard
    results = native.decode_files(native.ZSTD, [path, path], regions, np.empty(4096, "uint8"),
                                  [np.empty(64, "uint8") for _ in regions], 64, None, None)
    assert [r[0] for r in results] == [native.NOT_REGULAR] * 2
    assert [r[2] for r in results] == [stat.S_IFIFO] * 2


def _records(root):
    for i in range(2):
        g = zarr.open_group(str(root / f"rec_{i}.zarr"), mode="w", zarr_format=3)
        g.create_array("x", data=np.arange(24, dtype="float32").reshape(8, 3) + i, chunks=(4, 3))
    return str(root)


def test_fifo_in_records(tmp_path, fifo):
    root = _records(tmp_path / "d")
    ds = ZarrRecords(root, store=LocalStore())
    fifo(tmp_path / "d" / "rec_1.zarr" / "x" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO):
        ds[1]
    fifo(tmp_path / "d" / "rec_1.zarr" / "x" / "zarr.json")
    with pytest.raises(stoker.StorageError, match=FIFO):
        ZarrRecords(root)


def test_fifo_as_statistics_sidecar_is_ignored_with_a_warning(tmp_path, fifo):
    """An unreadable statistics file is ignored with a warning and replaced (the sidecar's rule): a FIFO
    is unreadable, said so at once rather than waited on."""
    root = _records(tmp_path / "d")
    path = fifo(sidecar.path_for(root))
    with pytest.warns(RuntimeWarning, match=FIFO):
        stats = compute_stats(ZarrRecords(root), ["x"])
    assert stats["x"].count.sum() > 0
    assert stat.S_ISREG(os.lstat(path).st_mode)  # written anew as a regular file


def test_fifo_as_checkpoint(tmp_path, fifo):
    ckpts = Checkpoints(tmp_path)
    path = fifo(ckpts.path_for(5))
    with pytest.raises(stoker.CheckpointError, match=FIFO):
        ckpts.load(path)

