"""The compiled reader (``stoker._native``): whole zstd chunk files read and decoded without the GIL.

Every pipeline case runs twice, through the compiled reader and through the pure-Python
path, with zarr-python as the oracle; on the compiled run a spy proves the reader ran.
"""

import os
import shutil

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BytesCodec, TransposeCodec, ZstdCodec

import numcodecs
import stoker
from stoker import native

pytestmark = pytest.mark.timeout(60)


def _native_disabled() -> bool:
    return os.environ.get("STOKER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def test_extension_is_built():
    if _native_disabled():
        pytest.skip("STOKER_NATIVE=0 turns the compiled reader off")
    assert native.zstd_files is not None, (
        "stoker._native was not built or could not find zstd in numcodecs: install a C compiler and "
        "reinstall stoker (pip install -e .)"
    )


@pytest.fixture(params=["compiled", "python"])
def reader(request, monkeypatch):
    """Which path reads zstd chunk files; yields the sizes of the compiled calls made."""
    calls: list[int] = []
    if request.param == "python":
        monkeypatch.setattr(native, "zstd_files", None)
    else:
        real = native.zstd_files
        if real is None:
            pytest.skip("stoker._native is not available")

        def spy(paths, scratch, outs, nbytes):
            calls.append(len(paths))
            return real(paths, scratch, outs, nbytes)

        monkeypatch.setattr(native, "zstd_files", spy)
    calls_holder = {"kind": request.param, "calls": calls}
    yield calls_holder
    if request.param == "compiled":
        assert calls, "the compiled reader was never called"


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
        assert max(reader["calls"]) > 4  # chunks of several arrays in one call


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


def test_file_beyond_the_frame_bound_takes_the_python_path(tmp_path, reader):
    """A frame followed by a large skippable frame is valid zstd but larger than any frame of this
    chunk: the compiled reader declines it and the Python path decodes it correctly."""
    uri, data = _one_chunk_array(tmp_path / "a.zarr")
    chunk = os.path.join(uri, "c", "0", "0")
    padding = 64 << 10
    skippable = (0x184D2A50).to_bytes(4, "little") + padding.to_bytes(4, "little") + bytes(padding)
    with open(chunk, "ab") as f:
        f.write(skippable)
    torch.testing.assert_close(_read_first_chunk(uri), torch.from_numpy(data[None, :8, :8].astype(np.float32)))


def test_direct_call_reports_each_file(tmp_path):
    """The extension's own contract: one status per file, the good ones decoded, none skipped."""
    if native.zstd_files is None:
        pytest.skip("stoker._native is not available")
    good = numcodecs.Zstd(level=1).encode(np.arange(64, dtype="uint8").tobytes())
    paths = [tmp_path / n for n in ("good", "missing", "garbage", "big", "short-output")]
    paths[0].write_bytes(good)
    paths[2].write_bytes(b"not a zstd frame at all")
    paths[3].write_bytes(bytes(10_000))
    paths[4].write_bytes(numcodecs.Zstd(level=1).encode(bytes(32)))
    outs = [np.full(64, 0xAB, dtype="uint8") for _ in paths]
    results = native.zstd_files([str(p) for p in paths], np.empty(4096, "uint8"), outs, 64)
    assert [r[0] for r in results] == [native.OK, native.MISSING, native.CODEC_ERROR, native.TOO_BIG, native.SIZE]
    assert results[0][1] == len(good) and results[0][2] == 64
    np.testing.assert_array_equal(outs[0], np.arange(64, dtype="uint8"))
    assert results[3][2] == 10_000 and results[4][2] == 32
    assert native.zstd_error(results[2][2])  # zstd's own words for the failure
    with pytest.raises(ValueError):
        native.zstd_files([str(paths[0])], np.empty(4096, "uint8"), [np.empty(8, "uint8")], 64)
