"""Arrays written by other tools (and older zarr-pythons), read bit-for-bit as zarr-python reads them.

Each layout is read through ``open_array(...).read`` and through a ``stoker.Pipeline``, once on the
Python decode path (as with ``STOKER_NATIVE=0``) and once as configured (the compiled reader where it
takes the chunks).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zipfile

import numcodecs
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
import zarr.codecs.numcodecs as zn
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.cpu.executor import native_codec

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(params=["python", "default"])
def decode_path(request, monkeypatch):
    """The Python decode path (what STOKER_NATIVE=0 gives), or whatever this process has."""
    if request.param == "python":
        monkeypatch.setattr(native, "Engine", None)
    return request.param


def _boxes(shape, n=12, seed=0):
    rng = np.random.default_rng(seed)
    out = [tuple((0, s) for s in shape)]
    for _ in range(n):
        lo = [int(rng.integers(0, s)) for s in shape]
        out.append(tuple((a, int(rng.integers(a + 1, s + 1))) for a, s in zip(lo, shape)))
    return out


def check_reads(path: str, expected: np.ndarray, crop: tuple[int, ...]) -> None:
    """``open_array`` boxes and Pipeline crops of ``path`` equal ``expected`` bit for bit."""
    arr = stoker.open_array(path)
    for box in _boxes(arr.shape):
        got = arr.read(box)
        want = expected[tuple(slice(a, b) for a, b in box)]
        assert got.dtype == want.dtype, box
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), box
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(8):
        lo = [int(rng.integers(0, s - c + 1)) for s, c in zip(arr.shape, crop)]
        samples.append(stoker.Sample(path, [(a, a + c) for a, c in zip(lo, crop)]))
    cfg = stoker.Config(batch_size=4, dtype="native", device="cpu", n_io_threads=2, n_compute_threads=2,
                        host_buffer_bytes=32 << 20, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        for batch in p.batches(2):
            x = torch.from_dlpack(batch).numpy()
            for row, s in enumerate(batch.samples):
                want = expected[tuple(slice(a, b) for a, b in s.aabb)]
                assert np.array_equal(x[row].view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), s


def _zarr(path) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_array(path, mode="r")[...]


def _edit(path, name, change) -> None:
    meta = os.path.join(path, name)
    with open(meta) as f:
        doc = json.load(f)
    change(doc)
    with open(meta, "w") as f:
        json.dump(doc, f)


# ---------------------------------------------------------------------------------------------
# blosc with a compressor numcodecs' c-blosc lacks


@pytest.mark.parametrize("driver", ["zarr", "zarr3"])
def test_blosc_snappy_written_by_tensorstore_is_refused_at_open(tmp_path, driver):
    """tensorstore's c-blosc has snappy, numcodecs' does not: the array opened, then every read said the
    bytes were corrupt. It is refused at open, naming the compressor."""
    path = str(tmp_path / "snappy.zarr")
    if driver == "zarr":
        meta = {"compressor": {"id": "blosc", "cname": "snappy", "clevel": 5, "shuffle": 1},
                "dtype": "<u2", "shape": [128, 128], "chunks": [64, 64]}
    else:
        meta = {"data_type": "uint16", "shape": [128, 128],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [64, 64]}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "blosc", "configuration": {"cname": "snappy", "clevel": 5, "shuffle": "shuffle",
                                                               "typesize": 2, "blocksize": 0}}]}
    t = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path}, "metadata": meta,
                 "create": True}).result()
    t[...] = (np.arange(128 * 128) % 7).astype("u2").reshape(128, 128)
    assert "snappy" not in numcodecs.blosc.list_compressors()
    with pytest.raises(stoker.UnsupportedFormat, match="blosc compressor 'snappy' is not available") as info:
        stoker.open_array(path)
    assert path in str(info.value) and info.value.cname == "snappy"


@pytest.mark.parametrize("fmt", [2, 3])
def test_blosc_compressor_not_in_numcodecs_list_is_refused(tmp_path, fmt):
    path = str(tmp_path / "a.zarr")
    comp = numcodecs.Blosc(cname="lz4") if fmt == 2 else BloscCodec(cname="lz4")
    zarr.create_array(path, shape=(8,), chunks=(4,), dtype="u2", zarr_format=fmt, compressors=comp)[:] = 1

    def rename(doc):
        (doc["compressor"] if fmt == 2 else doc["codecs"][1]["configuration"])["cname"] = "lz5"

    _edit(path, ".zarray" if fmt == 2 else "zarr.json", rename)
    with pytest.raises(stoker.UnsupportedFormat, match="'lz5' is not available"):
        stoker.open_array(path)


# ---------------------------------------------------------------------------------------------
# a compressor after sharding_indexed


def _compressed_shards(path, *, shape, shards, inner, compressors="auto", index_location="end", inner_codecs=None,
                       dtype="uint16", fill=7):
    """zarr-python's spelling that compresses whole shards: the sharding codec as the serializer, with
    compressors (by default zarr-python's, zstd) after it."""
    codec = ShardingCodec(chunk_shape=inner, index_location=index_location,
                          **({"codecs": inner_codecs} if inner_codecs else {}))
    z = zarr.create_array(path, shape=shape, chunks=shards, shards=None, serializer=codec, compressors=compressors,
                          dtype=dtype, fill_value=fill)
    rng = np.random.default_rng(3)
    z[...] = rng.integers(0, 1000, size=shape).astype(dtype)
    z[tuple(slice(0, i) for i in inner)] = fill  # an empty inner chunk: an empty index entry
    z[tuple(slice(s - s % sh or s - sh, s) for s, sh in zip(shape, shards))] = fill  # the last shard: no file
    return json.load(open(os.path.join(path, "zarr.json")))["codecs"]


@pytest.mark.parametrize("case", ["zstd", "blosc-start-crc", "3d-big-endian"])
def test_compressor_after_sharding_indexed(tmp_path, decode_path, case):
    path = str(tmp_path / "a.zarr")
    if case == "zstd":
        shards = (16, 16)
        codecs = _compressed_shards(path, shape=(40, 30), shards=shards, inner=(8, 8))
        assert [c["name"] for c in codecs] == ["sharding_indexed", "zstd"]
        crop = (12, 10)
    elif case == "blosc-start-crc":
        shards = (16, 20)
        codecs = _compressed_shards(path, shape=(33, 50), shards=shards, inner=(4, 10), index_location="start",
                                    compressors=[BloscCodec(cname="lz4", shuffle="shuffle"), Crc32cCodec()],
                                    inner_codecs=[BytesCodec(), ZstdCodec(level=1)])
        assert [c["name"] for c in codecs] == ["sharding_indexed", "blosc", "crc32c"]
        crop = (9, 21)
    else:
        shards = (4, 8, 8)
        codecs = _compressed_shards(path, shape=(9, 20, 14), shards=shards, inner=(2, 4, 4), dtype="int32",
                                    inner_codecs=[BytesCodec(endian="big")], fill=-3)
        crop = (3, 9, 5)
    expected = _zarr(path)
    arr = stoker.open_array(path)
    assert arr.shards is None and arr.chunks == shards  # read as unsharded: the shard is the read chunk
    assert native_codec(arr.metadata.codec) is None  # the compiled reader cannot take a whole shard
    check_reads(path, expected, crop)


def test_compressed_shard_damage_is_a_decode_error(tmp_path):
    path = str(tmp_path / "a.zarr")
    _compressed_shards(path, shape=(32, 32), shards=(16, 16), inner=(8, 8))
    intact = _zarr(path)[:16, :16]
    shard = os.path.join(path, "c", "0", "1")
    raw = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(raw[: len(raw) // 2])
    arr = stoker.open_array(path)
    with pytest.raises(stoker.DecodeError, match="c/0/1"):
        arr.read([(0, 16), (16, 32)])
    # a frame that decompresses fine but is too short for the index
    with open(shard, "wb") as f:
        f.write(numcodecs.Zstd().encode(b"\0" * 10))
    with pytest.raises(stoker.DecodeError, match="truncated"):
        arr.read([(0, 16), (16, 32)])
    np.testing.assert_array_equal(arr.read([(0, 16), (0, 16)]), intact)  # the other shards still read


def test_a_compressed_shard_is_bounded_like_any_chunk(tmp_path):
    """The whole-shard blob decodes to at most its inner chunks' largest stored sizes plus the index: a
    frame claiming more is refused before it is inflated, and a file larger than such a frame is refused
    before it is read."""
    path = str(tmp_path / "a.zarr")
    _compressed_shards(path, shape=(32, 32), shards=(16, 16), inner=(8, 8))
    arr = stoker.open_array(path)
    codec = arr.metadata.codec
    shard = os.path.join(path, "c", "0", "1")
    with open(shard, "wb") as f:  # a bomb: 64 MiB of zeros, far beyond a 16x16 uint16 shard
        f.write(numcodecs.Zstd().encode(bytes(64 << 20)))
    with pytest.raises(stoker.DecodeError, match="decodes to more than"):
        arr.read([(0, 16), (16, 32)])
    with open(shard, "wb") as f:
        f.truncate(codec.max_stored_nbytes + 1)
    with pytest.raises(stoker.DecodeError, match="more than the"):
        arr.read([(0, 16), (16, 32)])


def test_a_compressed_shard_of_many_small_incompressible_chunks_reads_within_a_tight_bound(tmp_path):
    """512 inner chunks of 512 random bytes, each bz2-compressed (bzip2 grows such input the most): the
    shard reads, and its decode bound stays a small multiple of the shard (64 KiB of room per inner chunk
    made it 130x)."""
    path = str(tmp_path / "a.zarr")
    codec = ShardingCodec(chunk_shape=(8, 8, 8), codecs=[BytesCodec(), zn.BZ2(level=9)])
    z = zarr.create_array(path, shape=(64, 64, 64), chunks=(64, 64, 64), shards=None, serializer=codec,
                          dtype="uint8")
    z[...] = np.random.default_rng(5).integers(0, 256, size=z.shape, dtype=np.uint8)
    arr = stoker.open_array(path)
    np.testing.assert_array_equal(arr.read([(0, 64)] * 3), _zarr(path))
    assert arr.metadata.codec.max_stored_nbytes < 4 * arr.metadata.codec.nbytes + (256 << 10)


def test_nested_sharding_through_a_compressed_shard_is_refused(tmp_path):
    path = str(tmp_path / "a.zarr")
    inner = ShardingCodec(chunk_shape=(4, 4))
    zarr.create_array(path, shape=(16, 16), chunks=(16, 16), shards=None, dtype="u1",
                      serializer=ShardingCodec(chunk_shape=(8, 8), codecs=[inner]), compressors=None)

    def compress_inner(doc):
        doc["codecs"][0]["configuration"]["codecs"].append({"name": "zstd", "configuration": {"level": 0}})

    _edit(path, "zarr.json", compress_inner)
    with pytest.raises(stoker.UnsupportedFormat, match="nested sharding"):
        stoker.open_array(path)


# ---------------------------------------------------------------------------------------------
# numcodecs array-to-array codecs in v3


A2A = {
    "delta": ("int16", lambda: [zn.Delta(dtype="int16")]),
    "delta-astype": ("int32", lambda: [zn.Delta(dtype="int32", astype="int16")]),
    "fixedscaleoffset": ("float64", lambda: [zn.FixedScaleOffset(offset=1000, scale=10, dtype="float64",
                                                                 astype="int32")]),
    "fixedscaleoffset-same-type": ("float32", lambda: [zn.FixedScaleOffset(offset=10, scale=10, dtype="float32")]),
    "quantize": ("float64", lambda: [zn.Quantize(digits=3, dtype="float64")]),
    "bitround": ("float32", lambda: [zn.BitRound(keepbits=6)]),
    "astype": ("float64", lambda: [zn.AsType(encode_dtype="float32", decode_dtype="float64")]),
    "astype-int8": ("int16", lambda: [zn.AsType(encode_dtype="int8", decode_dtype="int16")]),
    "fixedscaleoffset-then-delta": ("float64", lambda: [
        zn.FixedScaleOffset(offset=0, scale=100, dtype="float64", astype="int32"), zn.Delta(dtype="int32")]),
}


def _a2a_array(path, case, endian, *, shards=None):
    dtype, filters = A2A[case]
    rng = np.random.default_rng(5)
    shape = (20, 13)
    data = (rng.normal(size=shape) * 40).astype(dtype) if dtype.startswith("float") else \
        rng.integers(-100, 100, size=shape).astype(dtype)
    if shards:
        codec = ShardingCodec(chunk_shape=(4, 4), codecs=[*filters(), BytesCodec(endian=endian), ZstdCodec()])
        z = zarr.create_array(path, shape=shape, chunks=(8, 8), dtype=dtype, serializer=codec, compressors=None,
                              fill_value=0)
    else:
        z = zarr.create_array(path, shape=shape, chunks=(8, 8), dtype=dtype, filters=filters(),
                              serializer=BytesCodec(endian=endian), compressors=ZstdCodec(level=1), fill_value=0)
    z[:16] = data[:16]  # the last row of chunks: fill
    return data


@pytest.mark.parametrize("case", sorted(A2A))
def test_numcodecs_array_to_array_codecs_little_endian(tmp_path, decode_path, case):
    path = str(tmp_path / "a.zarr")
    _a2a_array(path, case, "little")
    names = [c["name"] for c in json.load(open(os.path.join(path, "zarr.json")))["codecs"]]
    assert names[-2:] == ["bytes", "zstd"] and all(n.startswith("numcodecs.") for n in names[:-2])
    arr = stoker.open_array(path)
    assert not arr.metadata.codec.plain and native_codec(arr.metadata.codec) is None  # never the compiled reader
    check_reads(path, _zarr(path), (5, 6))


@pytest.mark.parametrize("case", sorted(A2A))
def test_numcodecs_array_to_array_codecs_big_endian(tmp_path, decode_path, case):
    """The same data written with a big-endian ``bytes`` codec reads as zarr-python reads the little-endian
    array. (zarr-python 3.1 itself reads the big-endian one wrongly: it hands numcodecs the bytes in the
    stored byte order, and numcodecs views them as its native dtype.)"""
    little, big = str(tmp_path / "little.zarr"), str(tmp_path / "big.zarr")
    _a2a_array(little, case, "little")
    _a2a_array(big, case, "big")
    check_reads(big, _zarr(little), (5, 6))


def test_numcodecs_array_to_array_codecs_inside_shards(tmp_path, decode_path):
    path = str(tmp_path / "a.zarr")
    _a2a_array(path, "fixedscaleoffset-then-delta", "little", shards=True)
    check_reads(path, _zarr(path), (5, 6))


@pytest.mark.parametrize("codecs,needle", [
    ([{"name": "numcodecs.packbits"}], "array-to-array codec 'numcodecs.packbits' is not supported"),
    ([{"name": "numcodecs.delta", "configuration": {"dtype": "float32"}}], "decodes to float32"),
    ([{"name": "transpose", "configuration": {"order": [1, 0]}},
      {"name": "numcodecs.delta", "configuration": {"dtype": "<i2"}}], "transpose together with numcodecs"),
    ([{"name": "numcodecs.delta", "configuration": {"dtype": "<i2"}},
      {"name": "sharding_indexed", "configuration": {"chunk_shape": [4, 4]}}], "before sharding_indexed"),
    ([{"name": "transpose", "configuration": {"order": [1, 0]}},
      {"name": "sharding_indexed", "configuration": {"chunk_shape": [4, 4]}}], "before sharding_indexed"),
    ([{"name": "numcodecs.pcodec", "configuration": {"level": 8}}],
     "array-to-bytes codec 'numcodecs.pcodec' is not supported"),
])
def test_v3_array_codecs_stoker_does_not_read(tmp_path, codecs, needle):
    path = str(tmp_path / "a.zarr")
    zarr.create_array(path, shape=(8, 8), chunks=(8, 8), dtype="int16")

    def replace(doc):
        tail = [] if codecs[-1]["name"] in ("sharding_indexed", "numcodecs.pcodec") else \
            [{"name": "bytes", "configuration": {"endian": "little"}}]
        doc["codecs"] = codecs + tail

    _edit(path, "zarr.json", replace)
    with pytest.raises(stoker.StokerError, match=needle):
        stoker.open_array(path)


@pytest.mark.parametrize("codec", [
    {"name": "numcodecs.astype", "configuration": {"encode_dtype": "<f16", "decode_dtype": "<i2"}},
    {"name": "numcodecs.fixedscaleoffset", "configuration": {"offset": 0, "scale": 1, "dtype": "<i2",
                                                             "astype": "<c32"}},
])
def test_v3_array_codecs_storing_long_doubles_are_refused(tmp_path, codec):
    """A v3 numcodecs codec that stores numpy's long double (``f16``/``c32``: other bytes on other machines,
    see test_v2_extended_precision_dtypes_are_refused), which zarr-python refuses, was read as this
    machine's long double."""
    path = str(tmp_path / "a.zarr")
    zarr.create_array(path, shape=(4,), chunks=(4,), dtype="int16")
    _edit(path, "zarr.json", lambda doc: doc.__setitem__("codecs", [codec, {"name": "bytes"}]))
    os.makedirs(os.path.join(path, "c"), exist_ok=True)
    stored = codec["configuration"].get("encode_dtype") or codec["configuration"]["astype"]
    np.arange(4).astype(stored).tofile(os.path.join(path, "c", "0"))
    with pytest.raises(ValueError, match="No Zarr data type"):
        zarr.open_array(path, mode="r")[...]
    with pytest.raises(stoker.UnsupportedFormat, match="extended precision") as info:
        stoker.open_array(path)
    assert path in str(info.value)


# ---------------------------------------------------------------------------------------------
# zarr-python < 2.8: nested keys and no dimension_separator


def _nested_v2(path, shape=(10, 12, 7), chunks=(4, 5, 3)):
    z = zarr.create_array(path, shape=shape, chunks=chunks, dtype="float32", zarr_format=2, fill_value=-1.0,
                          chunk_key_encoding={"name": "v2", "separator": "/"})
    data = np.random.default_rng(2).normal(size=shape).astype("float32")
    z[...] = data
    z[:4, :5, :3] = -1.0  # left unwritten
    expected = _zarr(path)
    assert os.path.isdir(os.path.join(path, "0")) and "0/1/0" not in os.listdir(path)
    _edit(path, ".zarray", lambda doc: doc.pop("dimension_separator"))
    return expected


def test_v2_nested_keys_without_dimension_separator(tmp_path, decode_path):
    """Read as fill values everywhere, silently, before the layout was detected."""
    path = str(tmp_path / "old.zarr")
    expected = _nested_v2(path)
    assert stoker.open_array(path).metadata.key_encoding.separator == "/"
    check_reads(path, expected, (4, 6, 3))


def test_v2_nested_keys_with_null_dimension_separator(tmp_path):
    path = str(tmp_path / "old.zarr")
    expected = _nested_v2(path)
    _edit(path, ".zarray", lambda doc: doc.__setitem__("dimension_separator", None))
    np.testing.assert_array_equal(stoker.open_array(path).read([(0, 10), (0, 12), (0, 7)]), expected)


def test_v2_flat_keys_without_dimension_separator(tmp_path):
    path = str(tmp_path / "flat.zarr")
    z = zarr.create_array(path, shape=(6, 6), chunks=(3, 3), dtype="u1", zarr_format=2, fill_value=9)
    z[:3] = 1
    _edit(path, ".zarray", lambda doc: doc.pop("dimension_separator", None))
    arr = stoker.open_array(path)
    assert arr.metadata.key_encoding.separator == "."
    np.testing.assert_array_equal(arr.read([(0, 6), (0, 6)]), [[1] * 6] * 3 + [[9] * 6] * 3)


def test_v2_without_dimension_separator_and_nothing_written_reads_fill(tmp_path):
    path = str(tmp_path / "empty.zarr")
    zarr.create_array(path, shape=(6, 6), chunks=(3, 3), dtype="u1", zarr_format=2, fill_value=9)
    _edit(path, ".zarray", lambda doc: doc.pop("dimension_separator", None))
    assert (stoker.open_array(path).read([(0, 6), (0, 6)]) == 9).all()


def _zipped(folder: str, archive: str) -> None:
    """``folder`` (an array) as the archive ``archive``, its members named from the folder's parent."""
    with zipfile.ZipFile(archive, "w") as zf:
        for parent, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(parent, name)
                zf.write(path, os.path.relpath(path, os.path.dirname(folder)))


@pytest.mark.parametrize("nested", [True, False])
def test_v2_keys_without_dimension_separator_in_a_zip_archive(tmp_path, decode_path, nested):
    """The archive's member list is in memory: the layout is detected there as in a directory. Nested keys
    read as fill values everywhere, silently, where the local copy of the array read its data."""
    path = str(tmp_path / "old.zarr")
    if nested:
        expected = _nested_v2(path)
    else:
        z = zarr.create_array(path, shape=(6, 6), chunks=(3, 3), dtype="u1", zarr_format=2, fill_value=9)
        z[:3] = 1
        _edit(path, ".zarray", lambda doc: doc.pop("dimension_separator", None))
        expected = _zarr(path)
    _zipped(path, str(tmp_path / "d.zip"))
    inside = str(tmp_path / "d.zip" / "old.zarr")
    assert stoker.open_array(inside).metadata.key_encoding.separator == ("/" if nested else ".")
    check_reads(inside, expected, (4, 6, 3) if nested else (3, 4))


def test_v2_nested_keys_in_a_consolidated_group_of_a_zip_archive(tmp_path):
    """The array's document from its group's .zmetadata (no dimension_separator there either): detected as well."""
    group = tmp_path / "g.zarr"
    zarr.open_group(str(group), mode="w", zarr_format=2)
    expected = _nested_v2(str(group / "old"))
    zarr.consolidate_metadata(str(group))
    _edit(str(group), ".zmetadata", lambda doc: doc["metadata"]["old/.zarray"].pop("dimension_separator"))
    _zipped(str(group), str(tmp_path / "d.zip"))
    inside = str(tmp_path / "d.zip" / "g.zarr" / "old")
    assert stoker.open_array(inside).metadata.key_encoding.separator == "/"
    np.testing.assert_array_equal(stoker.open_array(inside).read([(0, 10), (0, 12), (0, 7)]), expected)


def test_v2_both_key_layouts_in_a_zip_archive_is_a_metadata_error(tmp_path):
    path = str(tmp_path / "mixed.zarr")
    _nested_v2(path)
    shutil.copyfile(os.path.join(path, "1", "0", "0"), os.path.join(path, "1.0.0"))
    _zipped(path, str(tmp_path / "d.zip"))
    inside = str(tmp_path / "d.zip" / "mixed.zarr")
    with pytest.raises(stoker.MetadataError, match="dimension_separator") as info:
        stoker.open_array(inside)
    assert inside in str(info.value)


def test_v2_both_key_layouts_is_a_metadata_error(tmp_path):
    path = str(tmp_path / "mixed.zarr")
    _nested_v2(path)
    shutil.copyfile(os.path.join(path, "1", "0", "0"), os.path.join(path, "1.0.0"))
    with pytest.raises(stoker.MetadataError, match="dimension_separator") as info:
        stoker.open_array(path)
    assert path in str(info.value)


# ---------------------------------------------------------------------------------------------
# v2 dtypes of numpy's extended precision (zarr-python 2 wrote any numpy dtype)


@pytest.mark.parametrize("dtype", ["<f16", ">f16", "<c32", ">c32"])
def test_v2_extended_precision_dtypes_are_refused(tmp_path, decode_path, dtype):
    """numpy's ``f16``/``c32`` is ``long double``: x87's 80 bits padded to 16 bytes on x86-64, IEEE quad on
    aarch64, absent where long double is a double. Their bytes mean other values on other machines, and
    zarr-python 3 and tensorstore refuse the dtype; stoker read them as this machine's long double."""
    path = str(tmp_path / "ld.zarr")
    os.makedirs(path)
    with open(os.path.join(path, ".zarray"), "w") as f:
        json.dump({"zarr_format": 2, "shape": [4], "chunks": [4], "dtype": dtype, "fill_value": 0, "order": "C",
                   "filters": None, "compressor": None}, f)
    (np.arange(4) + 0.25).astype(dtype).tofile(os.path.join(path, "0"))
    with pytest.raises(ValueError):
        zarr.open_array(path, mode="r")
    with pytest.raises(ValueError, match="Unsupported zarr dtype"):
        ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}).result()
    with pytest.raises(stoker.UnsupportedFormat, match="extended precision") as info:
        stoker.open_array(path)
    assert path in str(info.value)
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=1 << 20, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p, pytest.raises(stoker.UnsupportedFormat, match="extended precision"):
        p.push([stoker.Sample(path, [(0, 4)])])
        p.pop()


@pytest.mark.parametrize("flt", [{"id": "astype", "encode_dtype": "<f16", "decode_dtype": "<f8"},
                                 {"id": "fixedscaleoffset", "offset": 0, "scale": 1, "dtype": "<f8", "astype": "<f16"}])
def test_v2_filters_storing_long_doubles_are_refused(tmp_path, flt):
    """A v2 filter that stores numpy's long double stores machine-dependent bytes as the dtype would: refused
    too (an array of dtype <f8 with AsType(encode_dtype="<f16") was read)."""
    path = str(tmp_path / "ldf.zarr")
    os.makedirs(path)
    with open(os.path.join(path, ".zarray"), "w") as f:
        json.dump({"zarr_format": 2, "shape": [4], "chunks": [4], "dtype": "<f8", "fill_value": 0, "order": "C",
                   "filters": [flt], "compressor": None}, f)
    np.arange(4).astype("<f16").tofile(os.path.join(path, "0"))
    with pytest.raises(stoker.UnsupportedFormat, match="extended precision") as info:
        stoker.open_array(path)
    assert path in str(info.value) and "<f16" in str(info.value)
