"""Shards rewritten while they are read: every crop is the old data or the new data, never a mix of
one version's index with the other's bytes.

A shard index is cached with the identity of the file it was read from (device, inode, size, times);
bytes it locates are read only from a file of that identity, else the index is read anew. The arrays
here have more shards (144) than a store keeps descriptors open (128), so some shards are reopened
after a rewrite while their old index is still cached: the case that returned index bytes as data.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
import native_testing
from stoker.storage import LocalStore

pytestmark = pytest.mark.timeout(60)

SHAPE, SHARD, INNER = (48, 48), (4, 4), (2, 2)  # 12 x 12 = 144 shards of 2 x 2 inner chunks
GRID = tuple(s // c for s, c in zip(SHAPE, SHARD))


@pytest.fixture(params=["raw-python", "zstd-python", "zstd-compiled"])
def codec(request, monkeypatch):
    """The inner chunks' codec, and the read path: the Python path, or the compiled reader (which takes
    zstd and blosc chunks only)."""
    codec, engine = request.param.split("-")
    if engine == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif native.Engine is None:
        pytest.skip("stoker._native is not available")
    return codec


def _create(path, codec: str, crc: bool):
    inner = [BytesCodec()] + ([ZstdCodec(level=1)] if codec == "zstd" else [])
    index = [BytesCodec()] + ([Crc32cCodec()] if crc else [])
    return zarr.create_array(str(path), shape=SHAPE, chunks=SHARD, dtype="uint16", fill_value=0, compressors=None,
                             serializer=ShardingCodec(chunk_shape=INNER, codecs=inner, index_codecs=index))


def _versions(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Old and new data, equal nowhere. The new data leaves each shard's first inner chunk empty (zarr
    does not store it), so the new shards are shorter and their inner chunks sit at other offsets."""
    rng = np.random.default_rng(seed)
    old = rng.integers(1, 10, size=SHAPE, dtype="uint16")
    new = rng.integers(1000, 60000, size=SHAPE, dtype="uint16")
    new.reshape(GRID[0], SHARD[0], GRID[1], SHARD[1])[:, : INNER[0], :, : INNER[1]] = 0
    return old, new


def _shard_files(root) -> list[str]:
    return [os.path.join(root, "c", str(i), str(j)) for i in range(GRID[0]) for j in range(GRID[1])]


@pytest.fixture(params=["rename", "in_place"])
def rewrite(request):
    """How the shards are rewritten: by zarr-python (a new file renamed over each shard), or in place
    (each shard file truncated and written anew, keeping its inode) with the bytes zarr-python wrote."""
    return request.param


def _array(tmp_path, codec, crc, mode):
    """``(uri, old, new, rewrite())``: the array holds ``old``; ``rewrite()`` makes it hold ``new``."""
    old, new = _versions()
    uri = str(tmp_path / "a.zarr")
    _create(uri, codec, crc)[...] = old
    if mode == "rename":
        def rewrite():
            zarr.open_array(uri, mode="r+")[...] = new
    else:
        staged = tmp_path / "new.zarr"
        _create(staged, codec, crc)[...] = new

        def rewrite():
            for src, dst in zip(_shard_files(staged), _shard_files(uri)):
                with open(src, "rb") as f:
                    data = f.read()
                with open(dst, "r+b") as f:
                    f.write(data)
                    f.truncate()
    return uri, old, new, rewrite


def _shard_crops(uri) -> list[stoker.Sample]:
    """One crop per shard (so the store must reopen the shards it evicted), plus crops across four shards."""
    crops = [stoker.Sample(uri, [(i * 4, i * 4 + 4), (j * 4, j * 4 + 4)])
             for i in range(GRID[0]) for j in range(GRID[1])]
    crops += [stoker.Sample(uri, [(i * 4 + 2, i * 4 + 6), (i * 4 + 2, i * 4 + 6)]) for i in range(GRID[0] - 1)]
    return crops


def _cfg(**kw):
    base = dict(batch_size=8, dtype="native", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                pop_timeout_s=20.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


def _version_of(crop: np.ndarray, sample: stoker.Sample, old: np.ndarray, new: np.ndarray) -> str:
    sel = tuple(slice(a, b) for a, b in sample.aabb)
    if np.array_equal(crop, new[sel]):
        return "new"
    if np.array_equal(crop, old[sel]):
        return "old"
    raise AssertionError(f"{sample}: neither the old nor the new data:\n{crop}\nold:\n{old[sel]}\nnew:\n{new[sel]}")


def _drain(p, old, new) -> list[str]:
    versions = []
    for batch in p:
        x = torch.from_dlpack(batch).numpy()
        versions += [_version_of(x[row], s, old, new) for row, s in enumerate(batch.samples)]
    return versions


@pytest.mark.parametrize("crc", [False, True], ids=["plain-index", "crc32c-index"])
def test_pipeline_reads_shards_rewritten_between_batches(tmp_path, codec, crc, rewrite):
    """Every shard is read once (its index stays cached, 16 of its descriptors are evicted), then
    rewritten while the pipeline is idle, then read again: every crop is the new data."""
    uri, old, new, do_rewrite = _array(tmp_path, codec, crc, rewrite)
    crops = _shard_crops(uri)
    with stoker.Pipeline(_cfg()) as p:
        p.push(crops)
        assert set(_drain(p, old, new)) == {"old"}
        do_rewrite()
        p.push(crops)
        assert set(_drain(p, old, new)) == {"new"}  # read after the rewrite finished: never the old file


@pytest.mark.parametrize("crc", [False, True], ids=["plain-index", "crc32c-index"])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_open_array_reads_shards_rewritten_between_reads(tmp_path, codec, crc, rewrite):
    uri, old, new, do_rewrite = _array(tmp_path, codec, crc, rewrite)
    arr = stoker.open_array(uri, store=LocalStore())
    crops = _shard_crops(uri)
    assert {_version_of(arr.read(s.aabb), s, old, new) for s in crops} == {"old"}
    do_rewrite()
    assert {_version_of(arr.read(s.aabb), s, old, new) for s in crops} == {"new"}


def test_pipeline_racing_a_writer_returns_old_or_new_crops(tmp_path, codec):
    """zarr-python rewrites every shard (by rename), back and forth, while a pipeline reads crops of one
    inner chunk each: every crop is one version or the other, or the batch fails with a typed error.
    (A crop over several inner chunks read while its shard is replaced may hold chunks of both versions.)"""
    uri, old, new, _ = _array(tmp_path, codec, True, "rename")
    writes = 4
    done = threading.Event()

    def writer():
        z = zarr.open_array(uri, mode="r+")
        try:
            for k in range(writes):
                z[...] = new if k % 2 == 0 else old
        finally:
            done.set()

    def crops():
        rng = np.random.default_rng(1)
        while True:
            i, j = (int(v) for v in rng.integers(0, [s // c for s, c in zip(SHAPE, INNER)]))
            yield stoker.Sample(uri, [(i * 2, i * 2 + 2), (j * 2, j * 2 + 2)])

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    seen, errors = [], []
    while not done.is_set():
        with stoker.Pipeline(_cfg(lookahead_batches=2)) as p:
            p.push(crops())
            try:
                while not done.is_set():
                    with p.pop() as batch:
                        x = torch.from_dlpack(batch).numpy()
                        seen += [_version_of(x[r], s, old, new) for r, s in enumerate(batch.samples)]
            except stoker.DecodeError as exc:  # a shard that changed again while it was read anew
                errors.append(exc)
    thread.join(30)
    assert not thread.is_alive()
    assert seen and len(errors) < 10


def test_compiled_reader_reads_an_inner_chunk_only_from_the_file_its_index_describes(tmp_path):
    """Given the identity of the shard file the index was read from, the compiled reader reads the inner
    chunk only from a file of that identity, and reports CHANGED (not bytes of another file) otherwise."""
    if native_testing.decode_files is None or not native.zstd:
        pytest.skip("stoker._native (and stoker._testing) is not available")
    import numcodecs

    chunk = np.arange(32, dtype="uint16")
    frame = numcodecs.Zstd(level=1).encode(chunk.tobytes())
    path = tmp_path / "shard"
    path.write_bytes(b"\0" * 7 + frame + b"index")
    st = os.stat(path)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read(identity):
        out = np.zeros(64, "uint8")
        [result] = native_testing.decode_files(native.CODEC_ZSTD, [str(path)], [(7, len(frame), 0, 64, *identity)],
                                               np.empty(4096, "uint8"), [out], 64, None, None)
        return result[0], out

    status, out = read(ident)
    assert status == native.ST_OK and np.array_equal(out.view("uint16"), chunk)
    for changed in ((ident[0], ident[1] + 1, *ident[2:]), (*ident[:2], ident[2] + 1, *ident[3:]),
                    (*ident[:3], ident[3] + 1, ident[4]), (*ident[:4], ident[4] + 1)):
        assert read(changed)[0] == native.ST_CHANGED


def test_a_shard_rewritten_in_place_during_a_read_is_not_read_at_old_offsets(tmp_path):
    """The identity is checked after an inner chunk's read as well as before: a writer that rewrites the
    shard in place between the check and the read (simulated inside the read) made stoker return bytes of
    the new file at the old index's offsets, neither version's data."""
    import numcodecs
    from zarr.codecs import BytesCodec, ShardingCodec

    from stoker.storage import LocalStore

    root = str(tmp_path / "inplace.zarr")
    z = zarr.create_array(root, shape=(8,), chunks=(8,), dtype="uint8",
                          serializer=ShardingCodec(chunk_shape=(4,), codecs=[BytesCodec()]), compressors=None)
    z[:] = np.arange(8, dtype=np.uint8)  # inner chunk 0 = 0..3 at [0, 4), chunk 1 = 4..7 at [4, 8)
    shard = os.path.join(root, "c", "0")
    raw = bytearray(open(shard, "rb").read())

    class Racing(LocalStore):
        armed = False

        def _pread(self, fd, path, offset, length):
            if self.armed and path == shard:  # new values, inner chunks in the other order, same size
                self.armed = False
                new = bytearray(raw)
                new[0:4], new[4:8] = bytes([14, 15, 16, 17]), bytes([10, 11, 12, 13])
                index = np.array([[4, 4], [0, 4]], "<u8").tobytes()  # chunk 0 now at 4, chunk 1 at 0
                new[8:] = bytes(numcodecs.CRC32C(location="end").encode(index))
                with open(shard, "r+b") as f:
                    f.write(new)
            return super()._pread(fd, path, offset, length)

    store = Racing()
    arr = stoker.open_array(root, store=store)
    arr.shard_index("c/0")  # cached, as a running pipeline's plan has it
    time.sleep(0.05)  # the rewrite lands on another tick of the file system's clock
    store.armed = True
    np.testing.assert_array_equal(arr.read([(0, 4)]), [10, 11, 12, 13])  # the new data, read anew


def test_a_batch_the_python_path_reads_whole_completes_once(tmp_path, monkeypatch):
    """A batch none of whose chunks the compiled engine placed (every shard changed since its index was cached)
    goes whole to the Python path. Its reads ran on the compute pool while the finisher thread went on to count
    the engine's placed chunks (none); where they all finished first (a loaded machine), the batch was
    complete, that count of none was taken for a chunk reported twice, and the finisher thread died: every
    later batch timed out (PoolStarved). Here the retries run before the finisher goes on, every time."""
    if native.Engine is None:
        pytest.skip("stoker._native is not available")
    from stoker.engine.cpu.decode_python import PythonDecoder

    ran = []

    def run_now(self, fn, job, *args):  # the compute pool, infinitely fast next to the finisher thread
        ran.append(job.plan.n_chunks)
        fn(job, *args)

    monkeypatch.setattr(PythonDecoder, "run", run_now)
    uri, old, new, do_rewrite = _array(tmp_path, "zstd", False, "in_place")
    crops = _shard_crops(uri)[:16]  # two batches, 16 shards: every inner chunk of the second push ST_CHANGED
    with stoker.Pipeline(_cfg(pop_timeout_s=10.0)) as p:
        p.push(crops)
        assert _drain(p, old, new) == ["old"] * 16
        do_rewrite()
        p.push(crops)
        assert _drain(p, old, new) == ["new"] * 16
    assert ran == [32, 32]  # each batch of the second push handed whole (8 shards of 4 chunks) to the Python path


def test_a_shard_gone_since_its_index_was_read_is_its_fill_value(tmp_path, codec):
    """Shards whose every inner chunk became the fill value are deleted by zarr-python: an index cached
    from the old file (a pipeline kept from one epoch to the next, CropDataset(persistent=True)) locates
    chunks in a file that is no longer there. They are the fill value now, as zarr-python reads them, not a
    DecodeError ("shorter than its index claims") nor the old file's bytes."""
    uri, old, _, _ = _array(tmp_path, codec, False, "rename")
    new = old.copy()
    new[:8, :] = 0  # the shards of the first two rows: every inner chunk the fill value
    crops = _shard_crops(uri)
    with stoker.Pipeline(_cfg(drop_last=False)) as p:
        def read() -> list[np.ndarray]:
            p.push(crops)
            return [x for batch in p for x in torch.from_dlpack(batch).numpy().copy()]

        want = lambda data: [data[tuple(slice(a, b) for a, b in s.aabb)] for s in crops]  # noqa: E731
        assert all(np.array_equal(g, w) for g, w in zip(read(), want(old), strict=True))
        zarr.open_array(uri, mode="r+")[...] = new
        assert not os.path.exists(_shard_files(uri)[0])  # (zarr-python deleted it)
        assert np.array_equal(zarr.open_array(uri)[:], new)
        assert all(np.array_equal(g, w) for g, w in zip(read(), want(new), strict=True))


def test_a_shard_written_since_it_was_found_missing_is_read_at_the_next_push(tmp_path, codec):
    """A shard not stored (all fill value) when a pipeline first looked is written afterwards: a pipeline
    whose pushes were used up (drop_used_up, as CropDataset(persistent=True) keeps it for the next epoch)
    pushed again reads it, as a new pipeline and zarr-python do, not the fill value its cached "missing"
    said (a silently wrong batch)."""
    uri, old, _, _ = _array(tmp_path, codec, False, "rename")
    before = old.copy()
    before[:8, :] = 0  # the shards of the first two rows are not stored
    zarr.open_array(uri, mode="r+")[...] = before
    assert not os.path.exists(_shard_files(uri)[0])
    crops = _shard_crops(uri)
    want = lambda data: [data[tuple(slice(a, b) for a, b in s.aabb)] for s in crops]  # noqa: E731
    with stoker.Pipeline(_cfg(drop_last=False)) as p:
        def read() -> list[np.ndarray]:
            p.push(crops)
            got = [x for batch in p for x in torch.from_dlpack(batch).numpy().copy()]
            p.drop_used_up()
            return got

        assert all(np.array_equal(g, w) for g, w in zip(read(), want(before), strict=True))
        zarr.open_array(uri, mode="r+")[...] = old  # every shard stored now
        assert os.path.exists(_shard_files(uri)[0])
        assert all(np.array_equal(g, w) for g, w in zip(read(), want(old), strict=True))
