"""Sharded arrays in stores rewritten after a reader cached their shard indexes: every value read afterwards
is the new array's (zarr-python's read of it), or a typed error; never a chunk of one version located by the
index of another.

Each shard index read through a store is cached with the generation of the shard value it came from (S3:
its ETag; HTTP: ETag, else Last-Modified; a zip archive: its identity); an inner chunk's range that comes
back from another generation makes the reader read the index and the chunk anew, once. The new data leaves
each shard's first inner chunk empty (zarr-python does not store it), so the new shards are shorter and
their chunks sit at other offsets: an old index locates garbage in them."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.errors import DecodeError
from stoker.storage import ObjectStore, ZipStore

from range_server import RangeServer
from store_fixtures import BUCKET, FAST_REMOTE, empty_s3_fixture, read_tree, write_zip

pytestmark = pytest.mark.timeout(120)

SHAPE, SHARD, INNER = (32, 32), (16, 16), (4, 4)  # 2 x 2 shards of 4 x 4 inner chunks
FAST = FAST_REMOTE
BOXES = [[(0, 13), (0, 13)], [(3, 16), (10, 23)], [(19, 32), (2, 15)], [(10, 23), (17, 30)], [(16, 29), (16, 29)],
         [(0, 13), (19, 32)]]  # every shard, whole inner chunks and parts of them


def _versions(seed: int = 0) -> list[np.ndarray]:
    """Three versions of the data, equal nowhere; the later ones leave each shard's first inner chunk empty."""
    rng = np.random.default_rng(seed)
    out = [rng.integers(1, 10, size=SHAPE, dtype="uint16")]
    for lo, hi in [(1000, 30000), (30000, 60000)]:
        new = rng.integers(lo, hi, size=SHAPE, dtype="uint16")
        new.reshape(2, SHARD[0], 2, SHARD[1])[:, :INNER[0], :, :INNER[1]] = 0
        out.append(new)
    return out


def _write(root: str, data: np.ndarray) -> dict[str, bytes]:
    """The array holding ``data`` written by zarr-python under ``root`` (created or rewritten); its files."""
    arr = zarr.create_array(root, shape=SHAPE, chunks=INNER, shards=SHARD, dtype="uint16", fill_value=0,
                            compressors=ZstdCodec(level=1), overwrite=True)
    arr[...] = data
    return read_tree(root)


def _oracle(root: str) -> np.ndarray:
    return zarr.open_array(root, mode="r")[...]


def _crops(data: np.ndarray) -> list[np.ndarray]:
    return [data[a:b, c:d] for (a, b), (c, d) in BOXES]


s3 = empty_s3_fixture()


@pytest.fixture
def on_s3(s3, tmp_path):
    """``(uri, options, upload(data) -> oracle)``: an array on S3 under a prefix of its own; ``upload`` writes
    ``data`` with zarr-python locally and puts every object, and gives zarr-python's read of it."""
    prefix = f"rewritten-{uuid.uuid4().hex[:8]}"
    root = str(tmp_path / "a.zarr")

    def upload(data: np.ndarray) -> np.ndarray:
        s3.upload(_write(root, data), f"{prefix}/a.zarr")
        return _oracle(root)

    return f"s3://{BUCKET}/{prefix}/a.zarr", {**s3.options, **FAST}, upload


def _pipeline(options: dict, uri: str) -> stoker.Pipeline:
    prefix = uri.split("/a.zarr")[0] + "/"
    return stoker.Pipeline(stoker.Config(batch_size=len(BOXES), dtype="native", n_compute_threads=2,
                                         pop_timeout_s=30, host_buffer_bytes=16 << 20,
                                         storage_options={prefix: options}))


def _batch(p: stoker.Pipeline, uri: str) -> list[np.ndarray]:
    p.push([stoker.Sample(uri, box) for box in BOXES])
    with p.pop() as b:
        got = torch.from_dlpack(b).clone().numpy()
    return list(got)


def test_a_pipeline_reads_an_array_rewritten_on_s3_as_the_new_array(on_s3, decode_path):
    uri, options, upload = on_s3
    first, second, _ = _versions()
    old = upload(first)
    with _pipeline(options, uri) as p:
        assert all(np.array_equal(a, b) for a, b in zip(_batch(p, uri), _crops(old)))  # indexes cached
        new = upload(second)
        got = _batch(p, uri)
        for k, (a, b) in enumerate(zip(got, _crops(new))):
            assert np.array_equal(a, b), f"crop {k}: {(a != b).sum()} of {a.size} values are not the new array's"


def test_the_gpu_decode_staging_reads_an_array_rewritten_on_s3_as_the_new_array(on_s3, monkeypatch):
    """The GPU decode's executor on CPU tensors: its staging fetches the chunks through the store too."""
    from stoker.engine.pipeline import facade as pipelines
    from stoker.engine.gpu.executor import GpuDecodeExecutor

    monkeypatch.setattr(pipelines, "make_executor", lambda c, d, s, st: GpuDecodeExecutor.on_host(c, s, st))
    uri, options, upload = on_s3
    first, second, _ = _versions()
    old = upload(first)
    with _pipeline(options, uri) as p:
        assert all(np.array_equal(a, b) for a, b in zip(_batch(p, uri), _crops(old)))
        new = upload(second)
        for k, (a, b) in enumerate(zip(_batch(p, uri), _crops(new))):
            assert np.array_equal(a, b), f"crop {k}: {(a != b).sum()} of {a.size} values are not the new array's"


def test_a_long_lived_reader_reads_an_array_rewritten_on_s3_as_the_new_array(on_s3):
    uri, options, upload = on_s3
    first, second, third = _versions()
    old = upload(first)
    arr = stoker.open_array(uri, options)
    assert np.array_equal(arr[...], old)
    new = upload(second)
    assert np.array_equal(arr[...], new)
    assert np.array_equal(arr[5:11, 17:30], new[5:11, 17:30])
    # one chunk alone (read_chunk: the reader's single-chunk path)
    newer = upload(third)
    assert np.array_equal(arr.read_chunk((1, 5)), newer[4:8, 20:24])


@pytest.fixture
def rewritten_while_reread(monkeypatch):
    """``arm(upload)``: the next index read through an object store is followed by ``upload()`` (a shard
    rewritten again between its index read anew and its chunks' read)."""
    armed: list = []
    each = ObjectStore.get_each

    def get_each(self, requests, *args, **kwargs):
        got = each(self, requests, *args, **kwargs)
        if armed:
            armed.pop()()
        return got

    monkeypatch.setattr(ObjectStore, "get_each", get_each)
    return armed.append


def test_a_shard_rewritten_again_during_the_reread_is_a_decode_error(on_s3, rewritten_while_reread, decode_path):
    uri, options, upload = on_s3
    first, second, third = _versions()
    upload(first)
    arr = stoker.open_array(uri, options)
    with _pipeline(options, uri) as p:
        arr[...]
        _batch(p, uri)
        upload(second)
        rewritten_while_reread(lambda: upload(third))
        with pytest.raises(DecodeError, match="changed while it was read"):
            arr[...]
        rewritten_while_reread(lambda: upload(first))
        with pytest.raises(DecodeError, match="changed while it was read"):
            _batch(p, uri)


@pytest.mark.parametrize("etags", [True, False], ids=["etag", "last-modified"])
def test_a_reader_over_http_reads_a_rewritten_array_as_the_new_array(tmp_path, etags):
    """The server names each file's version by ETag, or only by Last-Modified (whole seconds: the rewritten
    files are dated a minute later)."""
    first, second, _ = _versions()
    root = str(tmp_path / "a.zarr")
    _write(root, first)
    server = RangeServer(str(tmp_path))
    server.etags = etags
    try:
        arr = stoker.open_array(f"{server.url}/a.zarr", dict(FAST))
        assert np.array_equal(arr[...], _oracle(root))
        _write(root, second)
        later = os.stat(os.path.join(root, "zarr.json")).st_mtime + 60
        for folder, _, names in os.walk(os.path.join(root, "c")):
            for name in names:
                os.utime(os.path.join(folder, name), (later, later))
        assert np.array_equal(arr[...], _oracle(root))
    finally:
        server.stop()


def test_a_reader_handed_the_store_of_a_replaced_zip_archive_reads_the_new_array(tmp_path):
    """Members of a zip archive are read at the archive's identity: an index cached from one archive is not
    used for another one's members."""
    first, second, _ = _versions()
    archive = str(tmp_path / "d.zip")
    write_zip(archive, _write(str(tmp_path / "old.zarr"), first))
    arr = stoker.open_array(f"{archive}/")
    assert np.array_equal(arr[...], _oracle(str(tmp_path / "old.zarr")))
    write_zip(str(tmp_path / "new.zip"), _write(str(tmp_path / "new.zarr"), second))
    os.replace(str(tmp_path / "new.zip"), archive)
    old_store, arr.kv = arr.kv, ZipStore(archive)  # the array's store opened again: the new archive
    try:
        assert np.array_equal(arr[...], _oracle(str(tmp_path / "new.zarr")))
    finally:
        arr.kv.close()
        old_store.close()
