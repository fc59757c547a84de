"""The compiled reader (``stoker._native``): zstd and blosc chunks read, decoded and cast into the batch
without the GIL, by the engine's threads (pipelines) and by ``decode_files`` (direct calls).

Every pipeline case runs through the compiled engine and through the pure-Python path, with
zarr-python as the oracle; on the compiled runs a spy proves the engine ran.
"""

import os
import shutil
from array import array

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ShardingCodec, TransposeCodec, ZstdCodec

import numcodecs
import stoker
from stoker.engine.cpu import native
import native_testing
from stoker.engine.cpu import decode_native

pytestmark = pytest.mark.timeout(60)


def _native_disabled() -> bool:
    return os.environ.get("STOKER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def test_extension_is_built():
    if _native_disabled():
        pytest.skip("STOKER_NATIVE=0 turns the compiled reader off")
    assert native.Engine is not None and native.zstd and native.blosc, (
        "stoker._native was not built or could not find zstd and blosc in numcodecs: install a C compiler and "
        "reinstall stoker (pip install -e .)"
    )
    assert native_testing.decode_files is not None, (
        "stoker._testing (the tests' decode_files) was not built: python setup.py build_ext --inplace"
    )


class _SpyJob:
    """A BatchJob that records, when its results are read, (codec, chunks, placed, decoded) per codec."""

    def __init__(self, job, codecs, calls):
        self._job, self._codecs, self._calls = job, codecs, calls

    done = property(lambda self: self._job.done)

    def wait(self, timeout=None):
        return self._job.wait(timeout)

    def cancel(self):
        self._job.cancel()

    def results(self):
        status, detail, counters = self._job.results()
        ok = np.frombuffer(status, np.int32) == native.ST_OK
        for codec in sorted(set(self._codecs.tolist()) - {native.CODEC_FILL}):
            mine = self._codecs == codec
            self._calls.append((codec, int(mine.sum()), int((ok & mine).sum()), counters["bytes_decoded"]))
        return status, detail, counters


def spying_engine(real, calls):
    """``native.Engine`` whose jobs report into ``calls`` (see _SpyJob)."""
    class Spy:
        def __init__(self, *args):
            self._engine = real(*args)

        def submit(self, chunks, *rest):
            codecs = np.frombuffer(chunks, np.int64).reshape(-1, native.N_CHUNK_COLS)[:, native.C_CODEC].copy()
            return _SpyJob(self._engine.submit(chunks, *rest), codecs, calls)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    return Spy


@pytest.fixture(params=["compiled", "compiled-streamed", "python"])
def reader(request, monkeypatch):
    """Which path makes the batches: the compiled engine, or the Python path (what STOKER_NATIVE=0 gives);
    yields the engine's work per job and codec as (codec, chunks, placed, decoded). "compiled-streamed" writes
    every batch with streaming stores, however small (see decode_native.STREAM_MIN_BYTES)."""
    calls: list[tuple[int, int, int, int]] = []
    if request.param == "compiled-streamed":
        monkeypatch.setattr(decode_native, "STREAM_MIN_BYTES", 0)
    if request.param == "python":
        monkeypatch.setattr(native, "Engine", None)
    else:
        if native.Engine is None:
            pytest.skip("stoker._native is not available")
        monkeypatch.setattr(native, "Engine", spying_engine(native.Engine, calls))
    # expect_engine: a test of layouts or batch dtypes the engine leaves to the Python path says False
    calls_holder = {"kind": "python" if request.param == "python" else "compiled", "calls": calls,
                    "expect_engine": True}
    yield calls_holder
    if request.param != "python" and calls_holder["expect_engine"]:
        assert calls, "the compiled engine was never called"


def _crops(samples, dtype="f32"):
    cfg = stoker.Config(batch_size=len(samples), dtype=dtype, device="cpu", n_compute_threads=2,
                        pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as batch:
            return torch.from_dlpack(batch).clone()


def _boxes(shape, crop, n, seed=0):
    rng = np.random.default_rng(seed)
    return [[(int(s), int(s) + c) for s, c in zip((rng.integers(0, d - c + 1) for d, c in zip(shape, crop)), crop)]
            for _ in range(n)]


def _expect(data, boxes):
    return torch.from_numpy(np.stack([data[tuple(slice(a, b) for a, b in box)] for box in boxes]).astype(np.float32))


LAYOUTS = {
    "v3": dict(zarr_format=3, compressors=ZstdCodec(level=3)),
    "v3-big-endian": dict(zarr_format=3, serializer=BytesCodec(endian="big"), compressors=ZstdCodec(level=1)),
    "v3-transpose": dict(zarr_format=3, filters=[TransposeCodec(order=(1, 0))], compressors=ZstdCodec(level=1)),
    "v2-C": dict(zarr_format=2, compressors=numcodecs.Zstd(level=1)),
    "v2-F": dict(zarr_format=2, compressors=numcodecs.Zstd(level=1), order="F"),
    "v2-lz4": dict(zarr_format=2, compressors=numcodecs.LZ4()),
    "v2-zlib": dict(zarr_format=2, compressors=numcodecs.Zlib(level=1)),
    "v2-gzip-F": dict(zarr_format=2, compressors=numcodecs.GZip(level=1), order="F"),
    "v3-gzip": dict(zarr_format=3, compressors=GzipCodec(level=1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_crops_match_zarr(tmp_path, reader, layout):
    uri = str(tmp_path / "a.zarr")
    shape, chunks = (45, 70), (16, 32)  # edge chunks are partial
    z = zarr.create_array(uri, shape=shape, chunks=chunks, dtype="uint16", fill_value=7, **LAYOUTS[layout])
    data = np.random.default_rng(1).integers(0, 60000, size=shape).astype("uint16")
    z[:32, :] = data[:32, :]  # the last row of chunks is never written: read as the fill value
    expected = zarr.open_array(uri, mode="r")[...]
    assert (expected[32:] == 7).all()
    boxes = _boxes(shape, (20, 40), 6) + [[(0, 20), (0, 40)], [(25, 45), (30, 70)]]
    got = _crops([stoker.Sample(uri, b) for b in boxes])
    torch.testing.assert_close(got, _expect(expected, boxes), rtol=0, atol=0)


@pytest.mark.parametrize("written", [True, False])
@pytest.mark.parametrize("dtype", ["native", "f32", "f16", "bf16", "i64"])
def test_a_zero_dimensional_array_makes_batches_of_its_value(tmp_path, reader, dtype, written):
    reader["expect_engine"] = False  # (either path may take it)
    uri = str(tmp_path / "s.zarr")
    z = zarr.create_array(uri, shape=(), chunks=(), dtype="int32", fill_value=-7)
    if written:
        z[()] = 42  # (exact in every batch dtype)
    cfg = stoker.Config(batch_size=3, dtype=dtype, device="cpu", host_buffer_bytes=64 << 20, pop_timeout_s=20,
                        lossy_casts=True)  # int32 into the float dtypes
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [])] * 3)
        with p.pop() as b:
            got = torch.from_dlpack(b).clone()
    want = {"native": torch.int32, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
            "i64": torch.int64}[dtype]
    assert got.dtype == want and got.tolist() == [42 if written else -7] * 3


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-size", "padded"])
@pytest.mark.parametrize("codec", ["lz4", "zlib", "gzip"])
def test_lz4_zlib_gzip_chunks_read_as_numcodecs_reads_them(tmp_path, reader, codec, damage):
    """Chunks the engine decodes whole with lz4's and zlib's own functions: a damaged one is the same
    DecodeError naming the chunk on every path (the engine leaves it to the Python path, which words it);
    zero bytes after gzip members are padding (numcodecs reads them), after a zlib stream ignored."""
    compressor = {"lz4": numcodecs.LZ4(), "zlib": numcodecs.Zlib(level=1), "gzip": numcodecs.GZip(level=1)}[codec]
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(16, 16), chunks=(8, 8), dtype="uint16", zarr_format=2, compressors=compressor)
    z[...] = np.arange(256, dtype="uint16").reshape(16, 16)
    chunk = os.path.join(uri, "0.0")
    raw = open(chunk, "rb").read()
    damaged = {"garbage": raw[:6] + b"\xff" * (len(raw) - 6), "truncated": raw[: len(raw) // 2],
               "other-size": compressor.encode(np.arange(32, dtype="uint16").tobytes()),
               "padded": raw + bytes(7)}[damage]
    open(chunk, "wb").write(damaged)
    try:  # numcodecs is the oracle: lz4 has no checksum, so some garbage is a valid block
        oracle = np.frombuffer(compressor.decode(damaged), "uint16")
        oracle = oracle.reshape(8, 8) if oracle.size == 64 else None
    except Exception:  # noqa: BLE001 - any refusal
        oracle = None
    if oracle is not None:
        got = _read_first_chunk(uri)
        torch.testing.assert_close(got, torch.from_numpy(oracle.astype(np.float32))[None], rtol=0, atol=0)
        assert damage != "padded" or codec != "lz4"
        return
    assert damage != "padded" or codec == "lz4"  # zero bytes after gzip members or a zlib stream are read
    with pytest.raises(stoker.DecodeError) as err:
        _read_first_chunk(uri)
    assert err.value.key == "0.0" and uri in str(err.value)


def test_one_call_spans_many_arrays_and_chunk_sizes(tmp_path, reader):
    """Chunks of different arrays share a call when their decoded size matches; other sizes get their own."""
    arrays = {}
    for i, chunks in enumerate([(8, 8), (8, 8), (8, 8), (4, 16)]):
        uri = str(tmp_path / f"a{i}.zarr")
        z = zarr.create_array(uri, shape=(16, 32), chunks=chunks, dtype="int16", compressors=ZstdCodec())
        z[...] = np.random.default_rng(i).integers(-3000, 3000, size=(16, 32)).astype("int16")
        arrays[uri] = z[...]
    samples = [stoker.Sample(uri, [(2, 10), (5, 21)]) for uri in arrays]
    got = _crops(samples)
    expected = torch.stack([torch.from_numpy(d[2:10, 5:21].astype(np.float32)) for d in arrays.values()])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if reader["kind"] == "compiled":
        assert max(c[1] for c in reader["calls"]) > 4  # chunks of several arrays in one call


def _one_chunk_array(path, chunks=(8, 8)):
    z = zarr.create_array(str(path), shape=(16, 16), chunks=chunks, dtype="uint16", compressors=ZstdCodec())
    z[...] = np.arange(256, dtype="uint16").reshape(16, 16)
    return str(path), z[...]


def _read_first_chunk(uri):
    return _crops([stoker.Sample(uri, [(0, 8), (0, 8)])])


def test_corrupt_frame_is_a_decode_error(tmp_path, reader):
    uri, _ = _one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    raw = open(chunk, "rb").read()
    open(chunk, "wb").write(b"\0\0\0\0" + raw[4:])  # the zstd magic number
    with pytest.raises(stoker.DecodeError) as err:
        _read_first_chunk(uri)
    assert err.value.key == "c/0/0" and uri in str(err.value)


@pytest.mark.parametrize("cut", ["half", "empty"])
def test_truncated_frame_is_a_decode_error(tmp_path, reader, cut):
    uri, _ = _one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    raw = open(chunk, "rb").read()
    open(chunk, "wb").write(raw[: len(raw) // 2] if cut == "half" else b"")
    with pytest.raises(stoker.DecodeError) as err:
        _read_first_chunk(uri)
    assert err.value.key == "c/0/0"


def test_chunk_of_another_size_is_a_decode_error(tmp_path, reader):
    """A valid frame from an array with another chunk shape is never reshaped or read short."""
    uri, _ = _one_chunk_array(tmp_path / "a.zarr")
    other, _ = _one_chunk_array(tmp_path / "b.zarr", chunks=(4, 8))
    shutil.copyfile(os.path.join(other, "c", "0", "0"), os.path.join(uri, "c", "0", "0"))
    with pytest.raises(stoker.DecodeError, match="c/0/0"):
        _read_first_chunk(uri)


def test_unreadable_chunk_path_is_a_storage_error(tmp_path, reader):
    uri, _ = _one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    os.remove(chunk)
    os.mkdir(chunk)  # a directory where the chunk file should be
    with pytest.raises(stoker.StorageError):
        _read_first_chunk(uri)


def test_file_beyond_the_stored_bound_is_refused_on_every_path(tmp_path, reader):
    """A frame followed by a skippable frame is valid zstd: it reads while the file stays within what the
    codec can store for this chunk (``max_stored_nbytes``, the one bound of both paths); one byte more and
    it is a DecodeError naming both sizes."""
    uri, data = _one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    frame = open(chunk, "rb").read()

    def pad_to(size):
        padding = size - len(frame) - 8
        skippable = (0x184D2A50).to_bytes(4, "little") + padding.to_bytes(4, "little") + bytes(padding)
        open(chunk, "wb").write(frame + skippable)

    limit = stoker.open_array(uri).metadata.codec.max_stored_nbytes
    pad_to(len(frame) + 8 + 1024)
    torch.testing.assert_close(_read_first_chunk(uri), torch.from_numpy(data[None, :8, :8].astype(np.float32)))
    pad_to(limit + 1)
    with pytest.raises(stoker.DecodeError, match=f"stored in {limit + 1} bytes, more than the {limit}") as err:
        _read_first_chunk(uri)
    assert err.value.key == "c/0/0"


def _call(codec, paths, nbytes, spans=None, scratch=4096, places=None, dst=None, outs=None, where=None):
    """One direct call; ``where``: per path (offset, length) of the stored chunk, or None for the whole file."""
    outs = outs if outs is not None else [np.full(nbytes, 0xAB, dtype="uint8") for _ in paths]
    spans = spans or [(0, nbytes)] * len(paths)
    where = where or [None] * len(paths)
    regions = [(*(w or (-1, 0)), *sp) for w, sp in zip(where, spans)]
    return native_testing.decode_files(codec, [str(p) for p in paths], regions, np.empty(scratch, "uint8"), outs, nbytes,
                               places, dst), outs


def test_direct_call_reports_each_zstd_file(tmp_path):
    """The extension's own contract: one status per file, the good ones decoded, none skipped."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    good = numcodecs.Zstd(level=1).encode(np.arange(64, dtype="uint8").tobytes())
    paths = [tmp_path / n for n in ("good", "missing", "garbage", "big", "short-output")]
    paths[0].write_bytes(good)
    paths[2].write_bytes(b"not a zstd frame at all")
    paths[3].write_bytes(bytes(10_000))
    paths[4].write_bytes(numcodecs.Zstd(level=1).encode(bytes(32)))
    results, outs = _call(native.CODEC_ZSTD, paths, 64)
    assert [r[0] for r in results] == [native.ST_OK, native.ST_MISSING, native.ST_CODEC_ERROR, native.ST_TOO_BIG, native.ST_SIZE]
    assert results[0][1] == len(good) and results[0][2] == 64
    np.testing.assert_array_equal(outs[0], np.arange(64, dtype="uint8"))
    assert results[3][2] == 10_000 and results[4][2] == 32
    assert native.zstd_error(results[2][2])  # zstd's own words for the failure
    with pytest.raises(ValueError):
        native_testing.decode_files(native.CODEC_ZSTD, [str(paths[0])], [(-1, 0, 0, 64)], np.empty(4096, "uint8"),
                            [np.empty(8, "uint8")], 64, None, None)
    for bad_region in [(-2, 0, 0, 64), (0, -1, 0, 64), (-1, 0, 0, 65), (-1, 0, 9, 8)]:
        with pytest.raises(ValueError, match="regions"):
            native_testing.decode_files(native.CODEC_ZSTD, [str(paths[0])], [bad_region], np.empty(4096, "uint8"),
                                [np.empty(64, "uint8")], 64, None, None)


def test_argument_lists_emptied_by_their_own_items_are_not_read_past(tmp_path):
    """Converting an argument's item runs Python code (a path's __fspath__, a region's __index__), which may
    empty the very lists being walked: the call walks the arguments as they were when it began, holding
    them. Walking the lists themselves read freed memory (AddressSanitizer: heap-use-after-free)."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    payload = np.arange(64, dtype="uint8").tobytes()
    good = tmp_path / "good"
    good.write_bytes(numcodecs.Zstd(level=1).encode(payload))
    paths: list = []
    regions: list = []
    outs: list = []

    def empty_them():
        paths.clear()
        regions.clear()
        outs.clear()

    class EmptyingPath:
        def __fspath__(self):
            empty_them()
            return str(good)

    class EmptyingIndex:
        def __index__(self):
            empty_them()
            return 0

    for first_path, first_region in [(EmptyingPath(), (-1, 0, 0, 64)), (str(good), (-1, 0, EmptyingIndex(), 64))]:
        paths[:] = [first_path] + [str(tmp_path / "good") for _ in range(3)]  # strings only the list holds
        regions[:] = [first_region] + [(-1, 0, 0, 64)] * 3
        outs[:] = [np.zeros(64, "uint8") for _ in range(4)]
        kept = list(outs)
        results = native_testing.decode_files(native.CODEC_ZSTD, paths, regions, np.empty(4096, "uint8"), outs, 64, None, None)
        assert [r[0] for r in results] == [native.ST_OK] * 4
        assert all(o.tobytes() == payload for o in kept)


def test_a_copy_plan_rewritten_after_its_check_is_placed_as_checked(tmp_path):
    """A copy plan is checked, then used once its chunk is decoded: Python code run for a later item (here a
    path's __fspath__) rewrites the caller's array in between, pointing the copy 900 elements past an
    8-element batch. The call places the plan it checked (its own copy), nothing outside the batch."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    chunk = tmp_path / "c"
    chunk.write_bytes(numcodecs.Zstd(level=1).encode(np.arange(1, 9, dtype="uint16").tobytes()))
    u16 = native.SOURCE_KINDS[np.dtype("uint16")]
    backing = torch.zeros(1024, dtype=torch.float32)  # the batch is its first 8 floats
    dst = (backing.data_ptr(), 32, native.KIND_F32)
    plan = array("q", [u16, 1, 1, 1, 1, 0, 0, 8])  # 8 elements from the chunk's start to the batch's

    class Rewriting:
        def __fspath__(self):
            plan[6] = 900  # dst offset
            return str(chunk)

    results = native_testing.decode_files(native.CODEC_ZSTD, [str(chunk), Rewriting()], [(-1, 0, 0, 16)] * 2,
                                  np.empty(4096, "uint8"), [np.zeros(16, "uint8") for _ in range(2)], 16,
                                  [plan, None], dst)
    assert [r[0] for r in results] == [native.ST_OK, native.ST_OK] and results[0][6] == 1  # decoded, placed
    assert backing[:8].tolist() == list(range(1, 9))
    assert not backing[8:].any()


def test_direct_call_reads_inner_chunks_at_their_offsets(tmp_path):
    """Chunks stored back to back in one file (a shard), read by (offset, length), whole and in blocks."""
    if not (native.zstd and native.blosc):
        pytest.skip("stoker._native is not available")
    n = _BLOCKY.nbytes
    frames = {native.CODEC_ZSTD: numcodecs.Zstd(level=1).encode(_BLOCKY), native.CODEC_BLOSC: _blocky_frame()}
    for codec, frame in frames.items():
        other = numcodecs.Zstd(level=1).encode(_BLOCKY[::-1].copy()) if codec == native.CODEC_ZSTD else \
            numcodecs.Blosc("lz4", 5, 1, blocksize=_BLOCK // 2).encode(_BLOCKY[::-1].copy())
        shard = tmp_path / f"shard{codec}"
        shard.write_bytes(b"junk" * 10 + frame + other + b"tail")
        where = [(40, len(frame)), (40 + len(frame), len(other)), (40 + len(frame), len(other) + 100)]
        spans = [(0, n), (_BLOCK + 8, _BLOCK + 16), (0, n)]
        results, outs = _call(codec, [shard] * 3, n, spans=spans, scratch=n + 4096, where=where)
        assert [r[0] for r in results[:2]] == [native.ST_OK, native.ST_OK]
        assert results[2][0] == native.ST_SHORT  # runs past the end of the file
        np.testing.assert_array_equal(outs[0], _BLOCKY.view("uint8"))
        np.testing.assert_array_equal(outs[1][_BLOCK + 8:_BLOCK + 16], _BLOCKY[::-1].copy().view("uint8")[_BLOCK + 8:_BLOCK + 16])
        assert results[0][1] == len(frame) and (codec == native.CODEC_ZSTD or results[1][1] < len(other))


# 256 KiB of smooth uint16, stored as four blosc blocks of 64 KiB
_BLOCKY = np.cumsum(np.random.default_rng(3).integers(-3, 4, size=1 << 17), dtype=np.int64).astype("uint16")
_BLOCK = 1 << 16  # c-blosc scales a requested block by the item size (2) when it splits shuffled streams


def _blocky_frame() -> bytes:
    frame = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=_BLOCK // 2).encode(_BLOCKY)
    assert int.from_bytes(frame[8:12], "little") == _BLOCK
    return frame


def test_direct_call_decodes_only_the_blocks_a_span_needs(tmp_path):
    if not native.blosc:
        pytest.skip("stoker._native is not available")
    frame = _blocky_frame()
    noise = np.random.default_rng(4).integers(0, 256, size=_BLOCKY.nbytes, dtype="uint8")
    stored = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE).encode(noise)
    assert stored[2] & 0x2  # incompressible: stored as a plain copy ("memcpyed")
    (tmp_path / "chunk").write_bytes(frame)
    (tmp_path / "noise").write_bytes(stored)
    n = _BLOCKY.nbytes
    spans = [(_BLOCK + 100, _BLOCK + 200), (_BLOCK - 10, _BLOCK + 10), (0, n), (100, n // 2 + _BLOCK), (5, n - 5),
             (5, 9)]
    paths = [tmp_path / "chunk"] * 5 + [tmp_path / "noise"]
    results, outs = _call(native.CODEC_BLOSC, paths, n, spans=spans, scratch=n + 4096)
    assert [r[0] for r in results] == [native.ST_OK] * 6
    # bytes decompressed: one block; two blocks; all; three of the four (under PARTIAL_MAX_SHARE); a span
    # touching every block, so all; a memcpyed frame, all
    assert [r[2] for r in results] == [_BLOCK, 2 * _BLOCK, n, 3 * _BLOCK, n, n]
    assert results[0][1] < len(frame) // 2  # read: header, block table and one block only
    want = _BLOCKY.view("uint8")
    np.testing.assert_array_equal(outs[0][_BLOCK + 100:_BLOCK + 200], want[_BLOCK + 100:_BLOCK + 200])
    assert (outs[0][:_BLOCK + 100] == 0xAB).all() and (outs[0][_BLOCK + 200:] == 0xAB).all()  # only the span
    np.testing.assert_array_equal(outs[1][_BLOCK - 10:_BLOCK + 10], want[_BLOCK - 10:_BLOCK + 10])
    np.testing.assert_array_equal(outs[2], want)
    np.testing.assert_array_equal(outs[3][100:n // 2 + _BLOCK], want[100:n // 2 + _BLOCK])
    assert (outs[3][n // 2 + _BLOCK:] == 0xAB).all()  # the fourth block was not decoded
    np.testing.assert_array_equal(outs[4], want)
    np.testing.assert_array_equal(outs[5], noise)


def _zstd_streaming(on: bool) -> None:
    """Turn the compiled reader's zstd context reuse and early stop on or off (off: ZSTD_decompress per chunk,
    what a numcodecs build without those exports gets)."""
    _, addrs = native._symbols(numcodecs.zstd.__file__, *native.ZSTD_STREAMING)
    native_testing.module.set_zstd_streaming(*(addrs if on else [0] * len(native.ZSTD_STREAMING)))


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "one-shot"])
def test_direct_call_stops_zstd_after_the_blocks_a_span_needs(tmp_path, streaming):
    """zstd writes blocks of at most 128 KiB: a span inside the first block reads and decodes about that
    block only (the rest of the frame is checked through its block headers alone), unless the frame
    carries a checksum (checked at its end) or is not exactly one whole frame (then it is read and decoded
    in full, and a damaged tail fails as it always did)."""
    if not (native.zstd and native.zstd_streaming):
        pytest.skip("the compiled reader or zstd's streaming functions are not available")
    block = 128 << 10
    n = 4 * block
    # 4 bits of entropy per byte: each block compresses to about half, so the frame outgrows the first read
    content = np.random.default_rng(3).integers(0, 16, n, dtype=np.uint8)
    plain = numcodecs.Zstd(level=1).encode(content)
    assert len(plain) > 2 * block
    noise = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    noise[block: 2 * block] = 0
    raw_rle = numcodecs.Zstd(level=1).encode(noise)  # raw, RLE, raw, raw blocks
    assert len(raw_rle) == 9 + 3 * (3 + block) + 3 + 1
    files = {
        "plain": plain,
        "raw-rle": raw_rle,
        "checksum": numcodecs.Zstd(level=1, checksum=True).encode(content),
        "truncated": plain[:-100],  # the last block is cut short
        "trailing": plain + b"junk after the frame",
        "cut-in-first": plain[:1000],  # the span's own block is cut short
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [tmp_path / name for name in files] + [tmp_path / "plain"] * 2
    spans = [(5, 9)] * len(files) + [(0, n), (n - 4, n)]
    if not streaming:
        _zstd_streaming(False)
    try:
        results, outs = _call(native.CODEC_ZSTD, paths, n, spans=spans, scratch=n + 4096)
    finally:
        _zstd_streaming(True)
    status = {name: r[0] for name, r in zip(files, results)}
    decoded = {name: r[2] for name, r in zip(files, results)}
    nread = {name: r[1] for name, r in zip(files, results)}
    assert status == {"plain": native.ST_OK, "raw-rle": native.ST_OK, "checksum": native.ST_OK,
                      "truncated": native.ST_CODEC_ERROR, "trailing": native.ST_CODEC_ERROR,
                      "cut-in-first": native.ST_CODEC_ERROR}
    stopped = block if streaming else n
    assert decoded["plain"] == decoded["raw-rle"] == stopped and decoded["checksum"] == n
    assert [r[:1] + r[2:3] for r in results[len(files):]] == [(native.ST_OK, n)] * 2
    if streaming:  # the first read (one block and a little), then one header the first read missed
        assert nread["plain"] <= block + 64 + 3 * 3 < len(plain)
        assert nread["raw-rle"] == block + 64 + 3
    else:
        assert nread["plain"] == len(plain) and nread["raw-rle"] == len(raw_rle)
    assert nread["checksum"] == len(files["checksum"]) and nread["cut-in-first"] == 1000
    for name in ("truncated", "trailing"):  # read whole after the hops found the damage (a header read twice)
        assert len(files[name]) <= nread[name] <= len(files[name]) + 4 * 3, name
    expected = {"raw-rle": noise}
    for name, out, (a, b), r in zip([*files, "plain", "plain"], outs, spans, results):
        if r[0] == native.ST_OK:
            np.testing.assert_array_equal(out[a:b], expected.get(name, content)[a:b])
    for i, name in enumerate(("plain", "raw-rle")):  # each whole first block
        np.testing.assert_array_equal(outs[i][:block], expected.get(name, content)[:block])
    if streaming:  # and the later blocks were never written (zstd may write a few bytes past a block's end)
        assert (outs[0][block + 64:] == 0xAB).all() and (outs[1][block + 64:] == 0xAB).all()


def test_direct_call_damage_found_after_a_stop_deep_in_the_frame(tmp_path):
    """The early stop's checks where the bookkeeping is hardest: a span ending in the third block of a
    frame whose last block is cut short (read on past the first read, hops, then read and decoded whole
    over a scratch buffer that still holds another file's bytes); a frame whose garbage body happens to
    hop from its magic number to the file's end, asked for an empty span (decoded whole, and refused);
    and the good frame, read in the same call, stops early."""
    if not (native.zstd and native.zstd_streaming):
        pytest.skip("the compiled reader or zstd's streaming functions are not available")
    block = 128 << 10
    n = 4 * block
    content = np.random.default_rng(4).integers(0, 16, n, dtype=np.uint8)
    plain = numcodecs.Zstd(level=1).encode(content)
    (tmp_path / "plain").write_bytes(plain)
    (tmp_path / "truncated").write_bytes(plain[:-100])
    # the magic number read as a block header is a raw block of 390821 bytes: a last-block header there,
    # sized to end at the file's end, makes the hops add up although nothing after the header is zstd
    fake = bytearray(plain[:9]) + bytearray(400_000)
    at = 3 + (0x2FB528 >> 3)
    fake[at:at + 3] = (1 | (len(fake) - at - 3) << 3).to_bytes(3, "little")
    (tmp_path / "fake").write_bytes(bytes(fake))
    deep = (0, 2 * block + 10)
    results, outs = _call(native.CODEC_ZSTD, [tmp_path / "plain", tmp_path / "truncated", tmp_path / "fake"], n,
                          spans=[deep, deep, (0, 0)], scratch=n + 4096)
    assert [r[0] for r in results] == [native.ST_OK, native.ST_CODEC_ERROR, native.ST_CODEC_ERROR]
    assert results[0][2] == 3 * block and results[0][1] < len(plain)
    np.testing.assert_array_equal(outs[0][:3 * block], content[:3 * block])


def test_shard_cut_short_after_the_stop_is_still_an_error(tmp_path, reader):
    """An inner chunk's size comes from the (cached) shard index, not the file: a shard (index at its start)
    cut inside its last block after its index was read is an error, although the crop's blocks are all
    there and decoding never gets past them."""
    data = np.random.default_rng(6).integers(0, 4096, (16, 128, 128)).astype("uint16")
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=data.shape, dtype="uint16", chunks=(16, 128, 128), compressors=None,
                          filters=None, serializer=ShardingCodec(chunk_shape=(16, 128, 128),
                                                                 codecs=[BytesCodec(), ZstdCodec(level=1)],
                                                                 index_location="start"))
    z[...] = data
    shard = os.path.join(uri, "c", "0", "0", "0")
    raw = open(shard, "rb").read()
    box = [(0, 1), (0, 8), (0, 8)]
    cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box)])
        with p.pop() as batch:  # the index is read, checked against the file and cached
            torch.testing.assert_close(torch.from_dlpack(batch).clone(), _expect(data, [box]), rtol=0, atol=0)
        with open(shard, "r+b") as f:
            f.truncate(len(raw) - 50)
        p.push([stoker.Sample(uri, box)])
        with pytest.raises(stoker.DecodeError, match="shorter than its index claims"):
            p.pop()


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "sharded"])
@pytest.mark.parametrize("checksum", [False, True])
def test_zstd_crops_decode_only_the_blocks_they_read(tmp_path, reader, checksum, sharded):
    """Crops in the first planes of 512 KiB zstd chunks (four blocks) match zarr and, on the compiled path,
    read and decode only the blocks before their last byte (a frame with a checksum: all of it), also
    as inner chunks of a shard (read at their offset in the shard file)."""
    # 12 bits of noise in 16: the frames compress a little and outgrow the reader's first read (128 KiB)
    data = np.random.default_rng(5).integers(0, 4096, (32, 128, 128)).astype("uint16")
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=data.shape, chunks=(16, 128, 128), dtype="uint16",
                          shards=(32, 128, 128) if sharded else None,
                          compressors=ZstdCodec(level=1, checksum=checksum))
    z[...] = data
    boxes = [[(0, 3), (0, 64), (0, 64)], [(16, 19), (64, 128), (10, 74)], [(8, 11), (0, 64), (64, 128)]]
    cfg = stoker.Config(batch_size=3, dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).clone()
        stats = p.stats()
    torch.testing.assert_close(got, _expect(data, boxes), rtol=0, atol=0)
    chunk, plane, row = 16 * 128 * 128 * 2, 128 * 128 * 2, 128 * 2
    assert stats.chunks_decoded == 2
    if sharded:  # one shard file: both inner chunks, then the index (2 x 16 bytes and a crc32c)
        stored = os.path.getsize(os.path.join(uri, "c", "0", "0", "0")) - (2 * 16 + 4)
    else:
        stored = sum(os.path.getsize(os.path.join(uri, "c", str(i), "0", "0")) for i in (0, 1))
    if reader["kind"] == "compiled" and native.zstd_streaming and not checksum:
        # the last byte read: chunk 0 in plane 10 (its third block of four), chunk 1 in plane 2 (its first)
        stops = [10 * plane + 63 * row + 128 * 2, 2 * plane + 127 * row + 74 * 2]
        assert stats.bytes_decoded == sum(-(-stop // (128 << 10)) * (128 << 10) for stop in stops) < 2 * chunk
        assert stats.bytes_read < stored  # the blocks after the stop are not read either
    else:
        assert stats.bytes_decoded == 2 * chunk
        assert stats.bytes_read == stored


def test_compiled_reader_follows_the_partial_share_of_the_blosc_module(tmp_path):
    """C takes its partial-decode rule from zarr.codecs.blosc.PARTIAL_MAX_SHARE (handed over at load): with a
    share of 0 a one-block span is decoded whole, with 1 a span over half the chunk only in its blocks,
    with 0.5 that span whole again."""
    if not native.blosc:
        pytest.skip("stoker._native is not available")
    import numcodecs.blosc
    import numcodecs.zstd

    from stoker.zarr.codecs.blosc import PARTIAL_MAX_SHARE

    _, zstd_addrs = native._symbols(numcodecs.zstd.__file__, "ZSTD_decompress", "ZSTD_isError")
    _, blosc_addrs = native._symbols(numcodecs.blosc.__file__, "blosc_decompress_ctx", "blosc_getitem")
    (tmp_path / "chunk").write_bytes(_blocky_frame())
    n = _BLOCKY.nbytes
    spans = [(_BLOCK + 100, _BLOCK + 200), (_BLOCK + 1, n)]
    decoded = {}
    try:
        for share in (0.0, 0.5, 1.0, PARTIAL_MAX_SHARE):
            native_testing.module.set_codecs(*zstd_addrs, *blosc_addrs, share)
            results, _ = _call(native.CODEC_BLOSC, [tmp_path / "chunk"] * 2, n, spans=spans, scratch=n + 4096)
            assert [r[0] for r in results] == [native.ST_OK] * 2
            decoded[share] = [r[2] for r in results]
    finally:
        native_testing.module.set_codecs(*zstd_addrs, *blosc_addrs, PARTIAL_MAX_SHARE)
    assert decoded[0.0] == [n, n]
    assert decoded[1.0] == [_BLOCK, n - _BLOCK]
    assert decoded[0.5] == [_BLOCK, n]  # the second span needs 3 of the 4 blocks
    assert decoded[PARTIAL_MAX_SHARE] == [_BLOCK, n - _BLOCK if n - _BLOCK <= PARTIAL_MAX_SHARE * n else n]
    with pytest.raises(ValueError, match="between 0 and 1"):
        native_testing.module.set_codecs(*zstd_addrs, *blosc_addrs, 1.5)


def test_direct_call_leaves_doubtful_blosc_frames_to_python(tmp_path):
    if not native.blosc:
        pytest.skip("stoker._native is not available")
    n = _BLOCKY.nbytes
    frame = bytearray(_blocky_frame())
    table_end = 16 + 4 * (n // _BLOCK)
    cases = {
        "good": bytes(frame),
        "other-size": numcodecs.Blosc("lz4", 5, 1, blocksize=1 << 15).encode(_BLOCKY[:1000]),
        "truncated": bytes(frame[:-7]),
        "table": bytes(frame[:16] + (2**31 - 1).to_bytes(4, "little") + frame[20:]),
        "garbage-blocks": bytes(frame[:table_end] + bytes(len(frame) - table_end)),
        "short": b"\x02\x01",
    }
    paths = []
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    for span in [(0, n), (0, 100)]:  # whole and partial decodes
        results, outs = _call(native.CODEC_BLOSC, paths, n, spans=[span] * len(paths), scratch=n + 4096)
        status = dict(zip(cases, (r[0] for r in results)))
        assert status["good"] == native.ST_OK
        assert status["other-size"] == status["truncated"] == status["short"] == native.ST_FRAME
        assert status["garbage-blocks"] == native.ST_CODEC_ERROR
        assert status["table"] == (native.ST_FRAME if span[1] == 100 else native.ST_CODEC_ERROR), span


def _place(tmp_path, dtype_src, batch_dtype, kind, stream=False, values=None, status=None):
    """Cast a 2-D chunk into a batch through the compiled reader; returns (batch, expected by copy_cast).
    ``stream``: with streaming stores, the values repeated so that every row holds whole cache lines;
    ``values``: the chunk's (else the special values of its dtype); ``status``: the chunk's (default ST_OK)."""
    from stoker.engine.cast import copy_cast
    from native_testing import copy_plan
    from stoker.engine.planning.tasks import ChunkTask, Copy
    from stoker.zarr.codecs.chain import ChunkCodec

    values = _SPECIAL[np.dtype(dtype_src)] if values is None else values
    chunk = np.tile(values, 4 if stream else 1).reshape(4, -1)
    codec = ChunkCodec("mem://x", chunk.shape, chunk.dtype, chunk.dtype)
    task = ChunkTask(0, (0, 0), "c/0/0", [Copy.of(0, (slice(0, 4), slice(0, chunk.shape[1])), (slice(1, 5), slice(2, 2 + chunk.shape[1]))),
                                          Copy.of(1, (slice(1, 3), slice(3, 5)), (slice(0, 2), slice(0, 2)))])
    shape = (2, 6, chunk.shape[1] + 3)
    got = torch.full(shape, -7, dtype=batch_dtype)
    want = got.clone()
    plan = copy_plan(task, codec, got, kind)
    assert plan is not None
    path = tmp_path / f"{dtype_src}"
    path.write_bytes(numcodecs.Zstd(level=1).encode(chunk.tobytes()))
    results, _ = _call(native.CODEC_ZSTD, [path], chunk.nbytes, scratch=chunk.nbytes + 4096, places=[plan],
                       dst=(got.data_ptr(), got.numel() * got.element_size(), kind, stream))
    assert results[0][0] == (native.ST_OK if status is None else status) and results[0][6] == 1
    for c in task.copies:
        copy_cast(want[c.dst] if want.dtype == torch.bfloat16 else want.numpy()[c.dst], chunk[c.chunk_sel])
    return got, want


def _special_values():
    out = {}
    for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"):
        info = np.iinfo(t)
        vals = [info.min, info.max, 0, 1, info.max - 1, info.min + 1, 255, 257, 16777217, 2**31 + 1, 2**53 + 1]
        vals = [v for v in vals if info.min <= v <= info.max]
        extra = np.random.default_rng(0).integers(info.min, info.max, size=64 - len(vals), dtype=t, endpoint=True)
        out[np.dtype(t)] = np.concatenate([np.array(vals, dtype=t), extra])
    for t in ("float32", "float64"):
        f = np.finfo(t)
        vals = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, f.tiny, f.tiny / 4, f.max, -f.max, 1.00390625,
                1.0 + 2**-9, 1.0 + 3 * 2**-9, 3.4e38, 1e-45, 65504.0, 1 / 3]
        extra = np.random.default_rng(1).standard_normal(64 - len(vals)) * 1e3
        out[np.dtype(t)] = np.concatenate([np.array(vals, dtype=t), extra.astype(t)])
    return out


_SPECIAL = _special_values()


def _fitting(src: str, batch_dtype: torch.dtype) -> tuple[np.ndarray, bool]:
    """The special values of ``src`` with each finite one that would be inf in ``batch_dtype`` replaced by the
    largest of its sign that is not; True when one was replaced."""
    from stoker.engine.cast import OVERFLOW_AT, unfit_range

    vals = _SPECIAL[np.dtype(src)].copy()
    if batch_dtype not in OVERFLOW_AT or unfit_range(vals, batch_dtype) is None:
        return vals, False
    at = OVERFLOW_AT[batch_dtype]
    edge = (np.nextafter(at, 0.0) if batch_dtype == torch.float32  # rounds to float32's largest
            else float(np.nextafter(np.float32(at), np.float32(0))))  # is bfloat16's largest in float32
    with np.errstate(over="ignore"):
        seen = vals.astype(np.float32) if batch_dtype == torch.bfloat16 else vals
        past = np.isfinite(vals) & (np.abs(seen) >= at)
    vals[past] = np.sign(vals[past]) * edge
    return vals, True


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the Python path's copy of a failed chunk
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("batch", ["f32", "bf16", "native"])
@pytest.mark.parametrize("src", sorted(str(d) for d in _SPECIAL))
def test_compiled_cast_matches_copy_cast_bit_for_bit(tmp_path, src, batch, stream):
    """Every source kind into every batch kind the compiled reader casts to, on edge values (extremes,
    rounding ties, infinities, subnormals, signed zeros): the same bits as the Python path's numpy and
    torch casts, written in place or streamed (whole lines converted apart from a row's ends). NaN stays
    NaN (torch's own bfloat16 NaN bits differ between its vector and scalar loops). A finite value the
    batch would hold as inf (float64's largest into float32) fails the chunk (ST_RANGE), so here the
    largest that fits stands in for it."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    batch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "native": torch.from_numpy(np.empty(0, src)).dtype}[batch]
    kind = {"f32": native.KIND_F32, "bf16": native.KIND_BF16, "native": native.KIND_SAME}[batch]
    values, replaced = _fitting(src, batch_dtype)
    if replaced:  # the special values themselves: every copy is placed, and the chunk fails
        _place(tmp_path, src, batch_dtype, kind, stream, status=native.ST_RANGE)
    got, want = _place(tmp_path, src, batch_dtype, kind, stream, values)
    nan = want.isnan() if want.is_floating_point() else torch.zeros_like(want, dtype=torch.bool)
    assert torch.equal(got.isnan() if got.is_floating_point() else nan, nan)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
    if src.startswith("float"):
        assert nan.sum() == (8 if stream else 2)  # NaN and -NaN, once per repeat (in the first copy only)


@pytest.mark.parametrize("batch", [torch.float32, torch.bfloat16, torch.int16])
def test_streamed_writes_cover_every_alignment_and_nothing_else(tmp_path, batch):
    """Streamed stores write whole cache lines only: rows that start and end at every offset within a
    line, some shorter than a line, land exactly where copy_cast puts them and nothing around them moves."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    from stoker.engine.cast import copy_cast
    from native_testing import copy_plan
    from stoker.engine.planning.tasks import ChunkTask, Copy
    from stoker.zarr.codecs.chain import ChunkCodec

    chunk = np.random.default_rng(3).integers(-30000, 30000, size=(40, 300), dtype="int16")
    codec = ChunkCodec("mem://x", chunk.shape, chunk.dtype, chunk.dtype)
    # row r of the chunk goes to batch row r at column r (0..39: every offset in a 64-byte line for
    # 2- and 4-byte items), with lengths from 1 to 300 elements
    copies = [Copy.of(0, (slice(r, r + 1), slice(0, 1 + (r * 37) % 300)), (slice(r, r + 1), slice(r, r + 1 + (r * 37) % 300)))
              for r in range(40)]
    task = ChunkTask(0, (0, 0), "c/0/0", copies)
    got = torch.full((1, 40, 360), -7, dtype=batch)
    want = got.clone()
    kind = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16, torch.int16: native.KIND_SAME}[batch]
    plan = copy_plan(task, codec, got, kind)
    path = tmp_path / "c"
    path.write_bytes(numcodecs.Zstd(level=1).encode(chunk.tobytes()))
    results, _ = _call(native.CODEC_ZSTD, [path], chunk.nbytes, scratch=chunk.nbytes + 4096, places=[plan],
                       dst=(got.data_ptr(), got.numel() * got.element_size(), kind, True))
    assert results[0][0] == native.ST_OK and results[0][6] == 1
    for c in copies:
        copy_cast(want[c.dst] if batch == torch.bfloat16 else want.numpy()[c.dst], chunk[c.chunk_sel])
    assert torch.equal(got, want)


def test_invalid_copy_plans_are_refused_before_any_write(tmp_path):
    """A plan that would reach outside the chunk or the batch is a ValueError, and the batch is untouched."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    from array import array

    chunk = np.arange(64, dtype="uint16")
    path = tmp_path / "c"
    path.write_bytes(numcodecs.Zstd(level=1).encode(chunk.tobytes()))
    batch = torch.zeros(2, 8, 8, dtype=torch.float32)
    dst = (batch.data_ptr(), batch.numel() * 4, native.KIND_F32)
    u16 = native.SOURCE_KINDS[np.dtype("uint16")]
    good = [u16, 2, 1, 8, 1, 8, 1, 0, 64, 8, 8]  # the whole 8x8 chunk into row 1
    bad = {
        "past the batch": [u16, 2, 1, 8, 1, 8, 1, 0, 65, 8, 8],
        "past the chunk": [u16, 2, 1, 8, 1, 8, 1, 1, 0, 8, 8],
        "empty extent": [u16, 2, 1, 8, 1, 8, 1, 0, 0, 0, 8],
        "negative offset": [u16, 2, 1, 8, 1, 8, 1, -1, 0, 1, 1],
        "strided inner": [u16, 2, 1, 8, 2, 8, 1, 0, 0, 1, 4],
        "unknown kind": [99, 2, 1, 8, 1, 8, 1, 0, 0, 1, 1],
        "short": [u16, 2, 1, 8, 1, 8, 1, 0, 0, 1],
        # values whose products wrap around int64 to small, in-bounds numbers
        "wrapping source stride": [u16, 2, 1, 2**62, 1, 8, 1, 0, 0, 5, 1],
        "wrapping batch stride": [u16, 2, 1, 8, 1, 2**62, 1, 0, 0, 5, 1],
        "wrapping copy count": [u16, 2, 2**62 + 1, 8, 1, 8, 1, 0, 0, 1, 1],
    }
    for name, plan in bad.items():
        with pytest.raises(ValueError, match="copy plan"):
            _call(native.CODEC_ZSTD, [path], 128, places=[array("q", plan)], dst=dst)
        assert not batch.any(), name
    with pytest.raises(ValueError, match="copy plan"):  # reads past the decoded span (another chunk's bytes)
        _call(native.CODEC_ZSTD, [path], 128, spans=[(0, 64)], places=[array("q", good)], dst=dst)
    with pytest.raises(ValueError, match="regions"):
        _call(native.CODEC_ZSTD, [path], 128, where=[(2**63 - 10, 100)])
    assert not batch.any()
    results, _ = _call(native.CODEC_ZSTD, [path], 128, places=[array("q", good)], dst=dst)
    assert results[0][6] == 1
    assert torch.equal(batch[1], torch.arange(64, dtype=torch.float32).reshape(8, 8)) and not batch[0].any()


def test_copy_plans_bounded_by_the_batch_even_with_zero_strides(tmp_path):
    """A plan whose strides are 0 stays inside the chunk and the batch at any extent, so a copy may write
    no more elements than the batch holds: a huge extent is refused, not looped over (it passed the
    bounds checks and the call wrote the same element 2**40 times)."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    from array import array

    path = tmp_path / "c"
    path.write_bytes(numcodecs.Zstd(level=1).encode(np.arange(16, dtype="uint8").tobytes()))
    batch = torch.zeros(16, dtype=torch.uint8)
    u8 = native.SOURCE_KINDS[np.dtype("uint8")]
    dst = (batch.data_ptr(), 16, native.KIND_SAME)
    with pytest.raises(ValueError, match="copy plan"):
        _call(native.CODEC_ZSTD, [path], 16, places=[array("q", [u8, 2, 1, 0, 1, 0, 1, 0, 0, 2**40, 1])], dst=dst)
    results, _ = _call(native.CODEC_ZSTD, [path], 16, places=[array("q", [u8, 2, 1, 0, 1, 0, 1, 15, 0, 16, 1])], dst=dst)
    assert results[0][6] == 1 and batch[0] == 15 and not batch[1:].any()  # 16 writes: as many as the batch holds


def test_plan_buffers_of_a_ragged_length_or_unaligned_are_refused(tmp_path):
    """A plan buffer that is no whole number of int64 values, or not aligned to them, and a cast whose chunk
    or batch buffer is not aligned to its elements, are refused like any bad plan (the ragged plan made the
    call return NULL with no exception set, a SystemError; the others were read and written unaligned)."""
    if not native.zstd:
        pytest.skip("stoker._native is not available")
    from array import array

    path = tmp_path / "c"
    path.write_bytes(numcodecs.Zstd(level=1).encode(np.arange(8, dtype="uint16").tobytes()))
    batch = torch.zeros(9, dtype=torch.float32)
    u16 = native.SOURCE_KINDS[np.dtype("uint16")]
    plan = array("q", [u16, 1, 1, 1, 1, 0, 0, 8]).tobytes()
    dst = (batch.data_ptr(), 32, native.KIND_F32)
    results, _ = _call(native.CODEC_ZSTD, [path], 16, places=[plan], dst=dst)  # as bytes: good
    assert results[0][6] == 1 and torch.equal(batch[:8], torch.arange(8, dtype=torch.float32))
    batch.zero_()
    out = np.zeros(17, np.uint8)[1:]  # a chunk buffer one byte off its uint16 elements
    for name, kwargs in {
        "ragged": dict(places=[plan + b"\0"], dst=dst),
        "unaligned plan": dict(places=[memoryview(bytearray(1) + plan)[1:]], dst=dst),
        "unaligned batch": dict(places=[plan], dst=(batch.data_ptr() + 2, 32, native.KIND_F32)),
        "unaligned chunk": dict(places=[plan], dst=dst, outs=[out]),
    }.items():
        with pytest.raises(ValueError, match="copy plan"):
            _call(native.CODEC_ZSTD, [path], 16, **kwargs)
        assert not batch.any(), name


def test_blosc_partial_decode_reads_no_byte_it_did_not_read(tmp_path):
    """Only the stored bytes of the blocks a span needs are read, each taken to run to the next block's
    start. A frame whose block runs on past that decodes in numcodecs (here block 0 is a lone 4-byte size,
    its 256 raw bytes are the storage of the block after it, and block 3 starts right after that size), but
    a partial read of block 0 handed blosc bytes never read from the file: the scratch buffer's leftovers,
    in a pipeline another chunk's bytes (the output was the scratch buffer's fill). It must be refused (the
    Python path then decides) or read as numcodecs reads it, whatever the scratch buffer held."""
    if not native.blosc:
        pytest.skip("stoker._native is not available")
    content = (np.arange(1024) % 7).astype(np.uint8).tobytes()
    table_end = 16 + 4 * 4
    raw = [(256).to_bytes(4, "little") + content[i:i + 256] for i in range(0, 1024, 256)]  # stored as they are

    def frame(starts, body):  # blosc1, typesize 1, one stream per block (flag 0x10), no shuffle
        header = [1024, 256, table_end + len(body), *starts]
        return bytes([2, 1, 0x10, 1]) + b"".join(v.to_bytes(4, "little") for v in header) + body

    assert bytes(numcodecs.Blosc().decode(frame([table_end + 260 * i for i in range(4)], b"".join(raw)))) == content
    evil = frame([table_end, table_end + 4 + 260, table_end + 4 + 520, table_end + 4], raw[0][:4] + b"".join(raw))
    reference = bytes(numcodecs.Blosc().decode(evil))
    assert reference[768:] == content[:256]  # block 3 is stored where block 0 was
    (tmp_path / "chunk").write_bytes(evil)
    for fill in (0, 0xC3):
        out = np.zeros(1024, np.uint8)
        results = native_testing.decode_files(native.CODEC_BLOSC, [str(tmp_path / "chunk")], [(-1, 0, 0, 8)],
                                      np.full(len(evil), fill, np.uint8), [out], 1024, None, None)
        status, nread = results[0][:2]
        assert nread < len(evil)  # header, table and block 0's 4 bytes
        assert status != native.ST_OK or out[:8].tobytes() == reference[:8], (results[0], fill)


def test_a_crafted_blosc_frame_never_decodes_leftovers_in_a_pipeline(tmp_path, reader):
    """The frame above as chunk 0 of an array whose chunk 1 is read first (its bytes are then the scratch
    buffers' leftovers): on every path, the partial read of chunk 0 is refused or reads as numcodecs does.
    The Python path handed blosc the frame with its stated size, so it decoded leftovers: chunk 1's bytes."""
    content = (np.arange(1024) % 7).astype(np.uint8).tobytes()
    table_end = 16 + 4 * 4
    raw = [(256).to_bytes(4, "little") + content[i:i + 256] for i in range(0, 1024, 256)]
    header = [1024, 256, table_end + 4 + len(b"".join(raw)),
              table_end, table_end + 4 + 260, table_end + 4 + 520, table_end + 4]
    evil = bytes([2, 1, 0x10, 1]) + b"".join(v.to_bytes(4, "little") for v in header) + raw[0][:4] + b"".join(raw)
    reference = np.frombuffer(numcodecs.Blosc().decode(evil), np.uint8)
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(2048,), chunks=(1024,), dtype="uint8", zarr_format=2,
                          compressors=numcodecs.Blosc("lz4", 5, 0, blocksize=256))
    z[:] = np.full(2048, 0xEE, np.uint8)  # chunk 1's bytes: what leftovers would look like
    with open(os.path.join(uri, "0"), "wb") as f:
        f.write(evil)
    cfg = stoker.Config(batch_size=1, dtype="native", device="cpu", n_compute_threads=1, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(1024, 1032)]), stoker.Sample(uri, [(0, 8)])])
        with p.pop() as batch:
            assert (torch.from_dlpack(batch).numpy() == 0xEE).all()
        try:
            with p.pop() as batch:
                got = torch.from_dlpack(batch).numpy()[0]
        except stoker.DecodeError as exc:
            assert "'0'" in str(exc)
        else:
            np.testing.assert_array_equal(got, reference[:8])


@pytest.mark.parametrize("shuffle", [0, 1])
def test_incompressible_blosc_chunks_read_in_part(tmp_path, reader, shuffle):
    """Random bytes make blosc store a frame memcpy'd (no shuffle) or blocks raw: crops of one block and
    of the last bytes, on every path, equal zarr's (the Python path's partial decode stated a shorter frame
    size to c-blosc, which refuses that for memcpy'd frames: every such crop failed)."""
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(1024, 1024), chunks=(512, 512), dtype="uint16", zarr_format=2,
                          compressors=numcodecs.Blosc("lz4", 5, shuffle))
    z[:] = np.random.default_rng(9).integers(0, 2**16, size=z.shape, dtype=np.uint16)
    boxes = [[(512, 520), (512, 520)], [(0, 8), (0, 8)], [(1016, 1024), (1016, 1024)]]
    cfg = stoker.Config(batch_size=3, dtype="native", device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).numpy()
    for row, b in zip(got, boxes):
        np.testing.assert_array_equal(row, z[tuple(slice(*x) for x in b)])


BLOSC_LAYOUTS = {
    "v3-lz4-shuffle": dict(zarr_format=3, compressors=BloscCodec(cname="lz4", shuffle="shuffle", blocksize=1 << 15)),
    "v3-zstd-bitshuffle": dict(zarr_format=3, compressors=BloscCodec(cname="zstd", shuffle="bitshuffle", blocksize=1 << 15)),
    "v3-big-endian": dict(zarr_format=3, serializer=BytesCodec(endian="big"),
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle", blocksize=1 << 15)),
    "v3-transpose": dict(zarr_format=3, filters=[TransposeCodec(order=(2, 1, 0))],
                         compressors=BloscCodec(cname="lz4", shuffle="noshuffle", blocksize=1 << 15)),
    "v2-C": dict(zarr_format=2, compressors=numcodecs.Blosc("lz4", 5, 1, blocksize=1 << 15)),
    "v2-F": dict(zarr_format=2, compressors=numcodecs.Blosc("lz4", 5, 1, blocksize=1 << 15), order="F"),
}


@pytest.mark.parametrize("depth", [6, 20])  # a few planes of a 32-plane chunk: some blocks; most: all
@pytest.mark.parametrize("dtype", ["f32", "bf16", "native", "f16"])
@pytest.mark.parametrize("layout", sorted(BLOSC_LAYOUTS))
def test_blosc_crops_match_zarr(tmp_path, reader, layout, dtype, depth):
    """Random crops over blosc chunks of several blocks (decoded partly or whole, placed in the call or
    by copy_cast), with a never-written chunk read as the fill value."""
    uri = str(tmp_path / "a.zarr")
    shape, chunks = (72, 40, 70), (32, 32, 64)  # 128 KiB chunks of two 64 KiB blocks; edge chunks are partial
    z = zarr.create_array(uri, shape=shape, chunks=chunks, dtype="int16", fill_value=-5, **BLOSC_LAYOUTS[layout])
    data = np.cumsum(np.random.default_rng(2).integers(-40, 41, size=shape), axis=2).astype("int16")
    z[:64] = data[:64]
    expected = zarr.open_array(uri, mode="r")[...]
    assert (expected[64:] == -5).all()
    boxes = _boxes(shape, (depth, 20, 20), 10) + [[(72 - depth, 72), (0, 20), (0, 20)]]
    cfg = stoker.Config(batch_size=len(boxes), dtype=dtype, device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).clone()
        stats = p.stats()
    crops = np.stack([expected[tuple(slice(a, b) for a, b in box)] for box in boxes])
    want = torch.from_numpy(crops) if dtype == "native" else torch.from_numpy(crops).to(
        {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype])
    assert torch.equal(got, want)
    castable = dtype != "f16"  # the engine casts any layout and byte order, into any batch dtype but float16
    reader["expect_engine"] = castable
    if reader["kind"] == "compiled":
        codecs = {c[0] for c in reader["calls"]}
        assert codecs == ({native.CODEC_BLOSC} if castable else set())
        placed = sum(c[2] for c in reader["calls"])
        assert (placed > 0) == castable
        if depth == 6 and (layout.startswith("v3-lz4") or layout == "v2-C"):  # plain: some blocks only
            assert stats.bytes_decoded < stats.chunks_decoded * 32 * 32 * 64 * 2


SHARDED = {
    "zstd": dict(compressors=ZstdCodec(level=1)),
    "blosc": dict(compressors=BloscCodec(cname="lz4", shuffle="shuffle", blocksize=1 << 15)),
}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("codec", sorted(SHARDED))
def test_sharded_crops_match_zarr(tmp_path, reader, codec, dtype):
    """Inner chunks of shards, with a missing shard and an empty inner chunk read as the fill value."""
    uri = str(tmp_path / "s.zarr")
    shape = (96, 64, 64)
    z = zarr.create_array(uri, shape=shape, chunks=(32, 32, 64), shards=(64, 64, 64), dtype="uint16",
                          fill_value=9, **SHARDED[codec])
    data = np.cumsum(np.random.default_rng(5).integers(0, 40, size=shape), axis=2).astype("uint16")
    z[:64] = data[:64]  # the second shard along z is never written
    z[:32, :32, :] = 9  # an inner chunk of nothing but the fill value: not stored
    expected = zarr.open_array(uri, mode="r")[...]
    boxes = _boxes(shape, (8, 40, 40), 12) + [[(88, 96), (0, 40), (0, 40)], [(0, 8), (0, 40), (0, 40)]]
    got = _crops([stoker.Sample(uri, b) for b in boxes], dtype=dtype)
    crops = np.stack([expected[tuple(slice(a, b) for a, b in box)] for box in boxes])
    assert torch.equal(got, torch.from_numpy(crops.astype(np.float32)).to(got.dtype))
    if reader["kind"] == "compiled":
        assert sum(c[2] for c in reader["calls"]) > 0


@pytest.mark.parametrize("codec", sorted(SHARDED))
def test_truncated_shard_is_a_decode_error(tmp_path, codec):
    """The index claims bytes the file no longer has (caught when the batch is planned, on both paths)."""
    _damaged_shard(tmp_path, codec, "truncated-shard")


@pytest.mark.parametrize("codec", sorted(SHARDED))
def test_corrupt_inner_chunk_is_a_decode_error(tmp_path, reader, codec):
    _damaged_shard(tmp_path, codec, "corrupt-inner-chunk")


def _damaged_shard(tmp_path, codec, damage):
    uri = str(tmp_path / "s.zarr")
    z = zarr.create_array(uri, shape=(64, 64), chunks=(32, 32), shards=(64, 64), dtype="uint16",
                          **SHARDED[codec])
    z[...] = np.arange(4096, dtype="uint16").reshape(64, 64)
    shard = os.path.join(uri, "c", "0", "0")
    raw = bytearray(open(shard, "rb").read())
    index = 4 * 16 + 4  # four (offset, length) pairs and a crc32c at the end
    offsets = [int.from_bytes(raw[len(raw) - index + 16 * i:len(raw) - index + 16 * i + 8], "little") for i in range(4)]
    if damage == "truncated-shard":
        open(shard, "wb").write(bytes(raw[:offsets[3] + 10]) + bytes(raw[len(raw) - index:]))
    else:
        raw[offsets[3]:offsets[3] + 8] = bytes(8)
        open(shard, "wb").write(bytes(raw))
    with pytest.raises(stoker.DecodeError) as err:
        _crops([stoker.Sample(uri, [(32, 64), (32, 64)])])
    assert "c/0/0" in err.value.key


def _blosc_one_chunk_array(path):
    z = zarr.create_array(str(path), shape=(256, 512), chunks=(256, 512), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle", blocksize=1 << 15))
    z[...] = _BLOCKY.reshape(256, 512)  # four blocks of 64 rows
    return str(path), z[...]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-size", "block-table", "empty"])
@pytest.mark.parametrize("crop", ["thin", "whole"])
def test_damaged_blosc_chunk_is_a_decode_error(tmp_path, reader, damage, crop):
    """Whatever the compiled reader declines, the Python path words as a DecodeError naming the chunk."""
    uri, _ = _blosc_one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    raw = bytearray(open(chunk, "rb").read())
    if damage == "garbage":
        raw[16 + 4 * 4:] = bytes(len(raw) - 16 - 4 * 4)
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "other-size":
        raw = bytearray(numcodecs.Blosc("lz4", 5, 1, blocksize=1 << 15).encode(np.arange(100, dtype="uint16")))
    elif damage == "block-table":
        raw[16:20] = (2**31 - 1).to_bytes(4, "little")
    else:
        raw = b""
    open(chunk, "wb").write(bytes(raw))
    box = [(0, 2), (0, 512)] if crop == "thin" else [(0, 256), (0, 512)]
    with pytest.raises(stoker.DecodeError) as err:
        _crops([stoker.Sample(uri, box)])
    assert err.value.key == "c/0/0" and uri in str(err.value)


def test_missing_blosc_chunk_is_the_fill_value(tmp_path, reader):
    uri, _ = _blosc_one_chunk_array(tmp_path / "a.zarr")
    os.remove(os.path.join(uri, "c", "0", "0"))
    assert (_crops([stoker.Sample(uri, [(0, 2), (0, 512)])]) == 0).all()
