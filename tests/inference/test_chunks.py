"""ChunkWriter: chunks encoded on the calling thread and stored through the store API hold the same bytes, under
the same keys, as zarr-python's own write of the same values; layouts it does not encode go to zarr-python."""

from __future__ import annotations

import os

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, GzipCodec, ZstdCodec

from stoker.inference import zstdframes
from stoker.inference.buffers import BufferPool
from stoker.inference.chunks import ChunkWriter

pytestmark = pytest.mark.timeout(120)

SHAPE, CHUNKS = (2, 13, 29, 17), (1, 4, 8, 8)  # edge chunks on every spatial axis, one channel per chunk


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def _boxes(shape, unit):
    for z in range(0, shape[1], unit[1]):
        for y in range(0, shape[2], unit[2]):
            for x in range(0, shape[3], unit[3]):
                yield (slice(None), slice(z, min(z + unit[1], shape[1])), slice(y, min(y + unit[2], shape[2])),
                       slice(x, min(x + unit[3], shape[3])))


def _data(dtype, fill):
    data = np.random.default_rng(1).integers(0, 50, SHAPE).astype(dtype)
    data[:, :4, :8, :8] = fill  # a chunk of the fill value only: zarr-python stores nothing for it
    data[0, 4:8, 8:16, :8] = fill
    data[0, 4, 8, 0] = 1  # ... and one that starts with the fill value but is not empty
    return data


LAYOUTS = {
    "v3-zstd": dict(zarr_format=3),
    "v3-zstd-checksum": dict(zarr_format=3, compressors=ZstdCodec(level=5, checksum=True)),
    "v3-raw": dict(zarr_format=3, compressors=None),
    "v2-zstd": dict(zarr_format=2),
    "v2-blosc": dict(zarr_format=2, compressors=numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1)),
    "v2-raw": dict(zarr_format=2, compressors=None),
}


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
@pytest.mark.parametrize("dtype,fill", [("f4", 0.0), ("f4", 7.0), ("u1", 0), ("i2", 3)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_direct_chunks_are_zarrs_bytes(tmp_path, layout, dtype, fill, pooled):
    data = _data(dtype, fill)
    kw = dict(shape=SHAPE, chunks=CHUNKS, dtype=dtype, fill_value=fill, **LAYOUTS[layout])
    ours = zarr.create_array(str(tmp_path / "ours.zarr"), **kw)
    theirs = zarr.create_array(str(tmp_path / "theirs.zarr"), **kw)
    pool = BufferPool(1 << 20) if pooled else None
    cw = ChunkWriter(ours, pool)
    assert cw.direct
    for box in _boxes(SHAPE, (2, 4, 8, 8)):
        cw.write(box, np.ascontiguousarray(data[box]))
        theirs[box] = data[box]
    assert cw.direct_chunks > 0
    if pooled and "zstd" in layout:
        assert pool.held_bytes > 0  # the frames' buffer came back, for the next region
    assert _files(str(tmp_path / "ours.zarr")) == _files(str(tmp_path / "theirs.zarr"))
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "ours.zarr"), mode="r")[:], data)


def test_nan_fill_and_negative_zero(tmp_path):
    """A NaN fill value: a chunk of NaNs is left to zarr-python (not stored); -0.0 under a 0.0 fill is
    stored (zarr-python compares a zero fill by its bits)."""
    for fill in (np.nan, 0.0):
        data = np.random.default_rng(2).random(SHAPE).astype("f4")
        data[:, :4, :8, :8] = fill
        data[:, 4:8, :8, :8] = -0.0
        kw = dict(shape=SHAPE, chunks=CHUNKS, dtype="f4", fill_value=fill)
        ours = zarr.create_array(str(tmp_path / f"ours{fill}.zarr"), **kw)
        theirs = zarr.create_array(str(tmp_path / f"theirs{fill}.zarr"), **kw)
        cw = ChunkWriter(ours)
        for box in _boxes(SHAPE, (2, 4, 8, 8)):
            cw.write(box, np.ascontiguousarray(data[box]))
            theirs[box] = data[box]
        assert _files(str(tmp_path / f"ours{fill}.zarr")) == _files(str(tmp_path / f"theirs{fill}.zarr"))


@pytest.mark.parametrize("kw", [
    dict(shards=(2, 8, 16, 16)),
    dict(compressors=GzipCodec()),
    dict(serializer=BytesCodec(endian="big")),
    dict(zarr_format=2, filters=[numcodecs.Delta(dtype="f4")]),
    dict(zarr_format=2, order="F"),
], ids=["sharded", "gzip", "big-endian", "v2-filters", "v2-order-F"])
def test_other_layouts_go_through_zarr(tmp_path, kw):
    data = _data("f4", 0.0)
    ours = zarr.create_array(str(tmp_path / "ours.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="f4", **kw)
    cw = ChunkWriter(ours)
    assert not cw.direct
    unit = (2, 8, 16, 16) if "shards" in kw else (2, 4, 8, 8)
    for box in _boxes(SHAPE, unit):
        cw.write(box, np.ascontiguousarray(data[box]))
    assert cw.direct_chunks == 0
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "ours.zarr"), mode="r")[:], data)


def test_a_box_off_the_chunks_goes_through_zarr(tmp_path):
    data = _data("f4", 0.0)
    ours = zarr.create_array(str(tmp_path / "ours.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="f4")
    cw = ChunkWriter(ours)
    box = (slice(None), slice(2, 6), slice(0, 8), slice(0, 8))
    cw.write(box, np.ascontiguousarray(data[box]))
    assert cw.direct_chunks == 0
    np.testing.assert_array_equal(ours[box], data[box])


@pytest.mark.parametrize("level,checksum", [(0, False), (1, True), (3, False), (-1, False), (9, True)])
def test_zstd_frames_are_numcodecs_bytes(level, checksum):
    """The same library, calls and parameters as numcodecs' Zstd.encode: the same frames, from one context
    reused for every chunk of a thread."""
    assert zstdframes.available()
    frames = zstdframes.ZstdFrames(level, checksum)
    rng = np.random.default_rng(3)
    out = np.zeros(frames.bound(64 * 64 * 4), dtype=np.uint8)
    for chunk in (rng.random((64, 64), dtype=np.float32), np.zeros((64, 64), np.float32),
                  rng.integers(0, 4096, (64, 64)).astype(np.float32), rng.integers(0, 9, (7, 5)).astype("u1")):
        n = frames.encode(chunk, out)
        assert out[:n].tobytes() == numcodecs.Zstd(level=level, checksum=checksum).encode(chunk)
    ctx = frames._local.ctx
    frames.encode(chunk, out)
    assert frames._local.ctx is ctx
    with pytest.raises(ValueError):
        frames.encode(chunk, out[:4])


def _obstore_memory():
    import obstore.store

    return zarr.storage.ObjectStore(obstore.store.MemoryStore(), read_only=False)


@pytest.mark.parametrize("make", [zarr.storage.MemoryStore, _obstore_memory], ids=["zarr-memory", "obstore-memory"])
def test_a_store_that_keeps_buffers_gets_copies(tmp_path, make):
    """A MemoryStore keeps what it is given (zarr's, or obstore's behind zarr's ObjectStore): the recycled
    frames' buffer is not handed to it, so the next region's frames do not overwrite the chunks stored
    before."""
    data = _data("f4", 0.0)
    ours = zarr.create_array(make(), shape=SHAPE, chunks=CHUNKS, dtype="f4")
    cw = ChunkWriter(ours, BufferPool(1 << 20))
    assert cw.direct
    for box in _boxes(SHAPE, (2, 4, 8, 8)):
        cw.write(box, np.ascontiguousarray(data[box]))
    assert cw.direct_chunks > 0
    np.testing.assert_array_equal(ours[:], data)


@pytest.mark.parametrize("make", [zarr.storage.MemoryStore, _obstore_memory, "local"],
                         ids=["zarr-memory", "obstore-memory", "local"])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_chunks_without_a_compressor_are_their_bytes_and_never_the_caller_s_memory(tmp_path, make, zarr_format):
    """Without a compressor a chunk's bytes are the values' own: a file or an upload takes them as they are,
    while a store that keeps what it is given gets a copy, so the caller's buffer (a TileWriter's, recycled
    for the next region) may be overwritten once the write returned."""
    data = _data("f4", 0.0)
    store = str(tmp_path / "raw.zarr") if make == "local" else make()
    ours = zarr.create_array(store, shape=SHAPE, chunks=CHUNKS, dtype="f4", compressors=None,
                             zarr_format=zarr_format)
    cw = ChunkWriter(ours, BufferPool(1 << 20))
    assert cw.direct
    for box in _boxes(SHAPE, (2, 4, 8, 8)):
        values = np.ascontiguousarray(data[box])
        cw.write(box, values)
        values.fill(-7)  # the next region's values, in the same memory
    assert cw.direct_chunks == 94  # all 96 but the 2 of the fill value only (zarr-python's)
    np.testing.assert_array_equal(ours[:], data)


def test_local_chunk_files_are_written_without_zarrs_event_loop(tmp_path, monkeypatch):
    """A LocalStore's chunks are files written on the calling thread (as LocalStore writes them), not
    handed to ``store.set`` (zarr's event loop, then its worker thread, per chunk)."""
    data = _data("f4", 0.0)
    ours = zarr.create_array(str(tmp_path / "ours.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="f4")
    theirs = zarr.create_array(str(tmp_path / "theirs.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="f4")
    theirs[:] = data
    cw = ChunkWriter(ours, BufferPool(1 << 20))

    async def refused(self, key, value):
        raise AssertionError(f"store.set({key!r}) for a chunk ChunkWriter writes itself")

    stored = []
    monkeypatch.setattr(zarr.storage.LocalStore, "set", refused)
    for box in _boxes(SHAPE, (2, 4, 8, 8)):
        if cw._not_empty(np.ascontiguousarray(data[box])):  # a region of fill values goes to zarr-python
            cw.write(box, np.ascontiguousarray(data[box]))
            stored.append(box)
    assert cw.direct_chunks > 0
    monkeypatch.undo()
    mine, want = _files(str(tmp_path / "ours.zarr")), _files(str(tmp_path / "theirs.zarr"))
    assert mine and all(mine[k] == want[k] for k in mine) and not [k for k in mine if "partial" in k]
    for box in stored:
        np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "ours.zarr"), mode="r")[box], data[box])


def test_a_chunk_folder_removed_after_its_first_file_is_made_again(tmp_path):
    """Chunk files' folders are made once per writer; one removed behind its back (a user clearing the
    array's chunks) is made again, not a failed write, and nothing temporary stays."""
    import shutil

    data = _data("f4", 0.0)
    ours = zarr.create_array(str(tmp_path / "ours.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="f4")
    cw = ChunkWriter(ours, BufferPool(1 << 20))
    boxes = [b for b in _boxes(SHAPE, (2, 4, 8, 8)) if cw._not_empty(np.ascontiguousarray(data[b]))]
    cw.write(boxes[0], np.ascontiguousarray(data[boxes[0]]))
    first = cw.direct_chunks
    assert first > 0
    shutil.rmtree(tmp_path / "ours.zarr" / "c")
    for box in boxes:
        cw.write(box, np.ascontiguousarray(data[box]))
    assert cw.direct_chunks == first * (1 + len(boxes))  # every chunk written by the writer, none by zarr
    back = zarr.open_array(str(tmp_path / "ours.zarr"), mode="r")
    for box in boxes:
        np.testing.assert_array_equal(back[box], data[box])
    assert not [k for k in _files(str(tmp_path / "ours.zarr")) if "partial" in k]


def test_a_failed_put_returns_the_buffer_only_once_every_put_of_the_region_ended(tmp_path, monkeypatch):
    """On an object store each chunk's put reads a view of the region's recycled buffer: when one put fails,
    the others are still uploading, so the buffer goes back to the pool (where the next region encodes into
    it) only once they all ended; the write then raises the failure."""
    import asyncio
    import time

    import obstore.store

    (tmp_path / "o").mkdir()
    store = zarr.storage.ObjectStore(obstore.store.LocalStore(str(tmp_path / "o")), read_only=False)
    arr = zarr.create_array(store, shape=(64, 64), chunks=(32, 32), dtype="f4")
    pool = BufferPool(1 << 24)
    cw = ChunkWriter(arr, pool)
    ended: list[float] = []

    async def put(self, key, value):
        if key.endswith("c/0/0"):
            raise OSError("503 from the object store")
        await asyncio.sleep(0.3)  # still reading its view of the buffer
        ended.append(time.monotonic())

    monkeypatch.setattr(zarr.storage.ObjectStore, "set", put)
    with pytest.raises(OSError, match="503"):
        cw.write((slice(0, 64), slice(0, 64)), np.random.default_rng(0).random((64, 64)).astype("f4"))
    raised = time.monotonic()
    assert len(ended) == 3 and max(ended) <= raised  # every other put ended before the buffer was given back
