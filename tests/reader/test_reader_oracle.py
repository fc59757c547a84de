"""Property tests: ``stoker.open_array(...).read(box)`` equals zarr-python's read, bit for bit.

Arrays are written by zarr-python 3 with random geometry (1-4 axes, size-1 axes,
edge chunks and shards that are partial), random codecs, dtypes, byte orders,
memory orders, chunk key encodings and fill values, and with chunks, shards and
inner chunks missing (never written, or skipped by zarr because they hold only
the fill value). Every random box, empty ones and the whole array included, is
read by stoker and by a freshly opened zarr array and compared byte for byte
(so NaN payloads, -0.0 and byte order all count).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile

import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    TransposeCodec,
    ZstdCodec,
)

import stoker

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

# Largest extent per axis and most chunks per axis, by rank: keeps every array small and quick to write.
MAX_EXTENT = {1: 40, 2: 30, 3: 12, 4: 7}
MAX_CHUNKS_PER_AXIS = {1: 12, 2: 6, 3: 4, 4: 3}


# ---------------------------------------------------------------------------------------------
# Comparing


def native(dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("=")


def assert_bit_equal(got: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Same shape, native dtype and the very same bytes (NaN payloads and -0.0 included)."""
    expected = np.asarray(expected)
    assert got.dtype == native(expected.dtype), f"{what}: dtype {got.dtype} != {native(expected.dtype)}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    want = np.ascontiguousarray(expected.astype(native(expected.dtype)))
    np.testing.assert_array_equal(got, want, err_msg=what)  # readable report, NaN == NaN
    assert np.ascontiguousarray(got).tobytes() == want.tobytes(), f"{what}: values equal but bits differ"


def expected_fill(zarr_fill, dtype) -> np.ndarray:
    """zarr's fill value as a 0-d native array; a v2 ``null`` fill reads as zeros."""
    if zarr_fill is None:
        return np.zeros((), native(dtype))
    return np.asarray(zarr_fill).astype(native(dtype)).reshape(())


def check_reader(path: str, boxes, *, chunks, shards, zarr_format: int) -> None:
    """Open ``path`` with stoker and with zarr, check the metadata and every box."""
    ref = zarr.open_array(store=path, mode="r")
    arr = stoker.open_array(path)
    assert arr.shape == ref.shape
    assert arr.ndim == len(ref.shape)
    assert arr.dtype == native(ref.dtype)
    assert arr.zarr_format == zarr_format
    assert arr.chunks == tuple(chunks)
    assert arr.shards == (tuple(shards) if shards is not None else None)
    want_fill = expected_fill(ref.fill_value, ref.dtype)
    got_fill = np.asarray(arr.fill_value, dtype=arr.dtype)
    assert got_fill.tobytes() == want_fill.tobytes(), f"fill {arr.fill_value!r} != zarr {ref.fill_value!r}"
    full = tuple((0, n) for n in ref.shape)
    for i, box in enumerate([*boxes, full]):
        slices = tuple(slice(a, b) for a, b in box)
        expected = ref[slices] if ref.ndim else ref[()]
        # alternate between (start, stop) pairs and slices
        got = arr.read(slices if i % 2 else box)
        assert_bit_equal(got, np.asarray(expected), f"box {box} of {path}")


# ---------------------------------------------------------------------------------------------
# Data


def random_values(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random data of ``dtype`` (stored byte order kept) with runs that compress and special floats."""
    dt = np.dtype(dtype)
    nt = native(dt)
    style = rng.integers(0, 3)  # 0: full-range noise, 1: few distinct small values, 2: smooth ramp
    if nt.kind == "b":
        out = rng.integers(0, 2, size=shape).astype(bool) if style != 2 else np.ones(shape, bool)
    elif nt.kind in "iu":
        info = np.iinfo(nt)
        if style == 0:
            out = rng.integers(info.min, info.max, size=shape, dtype=nt, endpoint=True)
        elif style == 1:
            out = rng.integers(0, 4, size=shape).astype(nt)
        else:
            out = (np.arange(math.prod(shape)) % 100).reshape(shape).astype(nt)
    else:
        part = np.dtype(f"f{nt.itemsize // 2}") if nt.kind == "c" else nt

        def floats():
            if style == 1:
                v = rng.integers(-2, 3, size=shape).astype(np.float64)
            elif style == 2:
                v = np.linspace(-3, 3, math.prod(shape)).reshape(shape)
            else:
                v = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, size=shape)
            special = rng.random(shape) < 0.05
            v[special] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0]), size=int(special.sum()))
            return v.astype(part)

        if nt.kind == "f":
            out = floats()
        else:
            out = np.empty(shape, nt)
            out.real, out.imag = floats(), floats()
    return np.asarray(out).astype(dt)


def chunk_regions(shape, chunk_shape):
    """Every chunk of the grid as a tuple of slices (clipped to the array)."""
    ranges = [range(0, n, c) for n, c in zip(shape, chunk_shape)]
    for starts in itertools.product(*ranges):
        yield tuple(slice(s, min(s + c, n)) for s, c, n in zip(starts, chunk_shape, shape))


def fill_scalar(fill, dtype):
    return np.zeros((), native(dtype)) if fill is None else np.asarray(fill).astype(native(dtype))


def write_with_holes(z, rng: np.random.Generator, data: np.ndarray, unit_chunks, fill, plan: str, p_fill: float):
    """Write ``data`` into zarr array ``z`` so that some chunks stay missing.

    Each chunk of ``unit_chunks`` is set to the fill value with probability ``p_fill``
    (zarr then skips it, unless ``write_empty_chunks``); ``plan`` says what is written:
    everything, one or two random sub-boxes, or nothing at all.
    """
    data = data.copy()
    if data.ndim:
        for region in chunk_regions(data.shape, unit_chunks):
            if rng.random() < p_fill:
                data[region] = fill_scalar(fill, data.dtype)
    if plan == "none" or 0 in data.shape:
        return
    if plan == "full" or data.ndim == 0:
        z[...] = data
        return
    for _ in range(1 if plan == "box" else 2):
        box = tuple(slice(int(a), int(b) + 1) for a, b in
                    (sorted(rng.integers(0, n, size=2)) for n in data.shape))
        z[box] = data[box]


# ---------------------------------------------------------------------------------------------
# Strategies


@st.composite
def extent(draw, largest: int):
    """One axis length: often 1, sometimes small, often close to the largest allowed."""
    tier = draw(st.sampled_from(["one", "small", "large", "large"]))
    if tier == "one":
        return 1
    if tier == "small":
        return draw(st.integers(2, min(8, largest)))
    return draw(st.integers(max(2, largest // 2), largest))


@st.composite
def chunk_length(draw, n: int, max_chunks: int):
    """A chunk length for an axis of length ``n`` giving at most ``max_chunks`` chunks along it."""
    lo = max(1, -(-n // max_chunks))
    tier = draw(st.sampled_from(["fine", "any", "any", "whole", "over"]))
    if tier == "fine":
        return draw(st.integers(lo, lo + 2))
    if tier == "any":
        return draw(st.integers(lo, max(lo, n)))
    if tier == "whole":
        return max(lo, n)
    return max(lo, n) + draw(st.integers(1, 3))  # one chunk, larger than the array


@st.composite
def geometry(draw, *, sharded: bool = False, max_rank: int = 4):
    """``(shape, chunks, shards)``: chunks are the read (inner) chunks, shards a multiple of them or None.

    Extents are mostly not multiples of the chunks, so edge chunks (and shards) are partial.
    """
    ndim = draw(st.integers(1, max_rank))
    shape = tuple(draw(extent(MAX_EXTENT[ndim])) for _ in range(ndim))
    chunks = tuple(draw(chunk_length(n, MAX_CHUNKS_PER_AXIS[ndim])) for n in shape)
    if not sharded:
        return shape, chunks, None
    shards = []
    for n, c in zip(shape, chunks):
        grid = -(-n // c)
        shards.append(c * draw(st.integers(1, max(1, min(3, grid + 1)))))
    return shape, chunks, tuple(shards)


@st.composite
def boxes(draw, shape, max_boxes: int = 6):
    """Random in-bounds half-open boxes; some with empty extents."""
    out = []
    for _ in range(draw(st.integers(1, max_boxes))):
        box = []
        for n in shape:
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, n))
            box.append((a, b))
        out.append(tuple(box))
    return out


def float_fill(dtype, *, allow_none: bool):
    nt = native(dtype)
    finite = st.floats(width=8 * nt.itemsize if nt.kind == "f" else 64, allow_nan=False, allow_infinity=False)
    opts = [st.just(0.0), st.just(-0.0), st.just(float("nan")), st.just(float("inf")),
            st.just(float("-inf")), st.just(1.5), finite]
    if allow_none:
        opts.append(st.none())
    return st.one_of(*opts)


def fill_values(dtype, *, allow_none: bool):
    nt = native(dtype)
    if nt.kind == "b":
        opts = [st.booleans()]
    elif nt.kind in "iu":
        info = np.iinfo(nt)
        opts = [st.just(0), st.just(int(info.min)), st.just(int(info.max)), st.integers(int(info.min), int(info.max))]
    elif nt.kind == "f":
        return float_fill(dtype, allow_none=allow_none)
    else:  # complex
        part = np.dtype(f"f{nt.itemsize // 2}")
        opts = [st.builds(complex, float_fill(part, allow_none=False), float_fill(part, allow_none=False))]
    if allow_none:
        opts.append(st.none())
    return st.one_of(*opts)


def to_fill(value, dtype):
    """A fill value zarr accepts for ``dtype`` (numpy scalar, so float16/float32 stay exact)."""
    if value is None:
        return None
    return native(dtype).type(value)


BLOSC_CNAMES = ["lz4", "lz4hc", "zstd", "zlib", "blosclz"]

V2_DTYPES = ["<u1", "|i1", "<i2", ">i2", "<u2", ">u4", "<i4", "<i8", ">u8", "<f2", "<f4", ">f4", ">f8", "|b1",
             "<c8", ">c16"]


@st.composite
def v2_compressor(draw):
    kind = draw(st.sampled_from(["none", "blosc", "zstd", "gzip", "zlib", "lz4", "bz2"]))
    if kind == "none":
        return None
    if kind == "blosc":
        return numcodecs.Blosc(
            cname=draw(st.sampled_from(BLOSC_CNAMES)),
            clevel=draw(st.integers(0, 9)),
            shuffle=draw(st.sampled_from([0, 1, 2, -1])),
            blocksize=draw(st.sampled_from([0, 0, 256])),
        )
    if kind == "zstd":
        return numcodecs.Zstd(level=draw(st.integers(-1, 9)), checksum=draw(st.booleans()))
    if kind == "gzip":
        return numcodecs.GZip(level=draw(st.integers(0, 9)))
    if kind == "zlib":
        return numcodecs.Zlib(level=draw(st.integers(0, 9)))
    if kind == "lz4":
        return numcodecs.LZ4()
    return numcodecs.BZ2(level=draw(st.integers(1, 9)))


@st.composite
def v2_filters(draw, dtype):
    nt = native(dtype)
    kind = draw(st.sampled_from(["none", "delta", "shuffle"] if nt.kind in "iu" else ["none", "shuffle"]))
    if kind == "none":
        return None
    if kind == "delta":
        return [numcodecs.Delta(dtype=np.dtype(dtype).str)]
    return [numcodecs.Shuffle(elementsize=np.dtype(dtype).itemsize)]


def v2_key_encoding(separator: str):
    return {"name": "v2", "separator": separator}


V3_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]


@st.composite
def v3_compressors(draw, dtype):
    """0-2 bytes-to-bytes codecs, e.g. ``[zstd, crc32c]``."""
    out = []
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["blosc", "zstd", "gzip", "crc32c"]))
        if kind == "blosc":
            out.append(BloscCodec(
                cname=draw(st.sampled_from(BLOSC_CNAMES)),
                clevel=draw(st.integers(0, 9)),
                shuffle=draw(st.sampled_from(["noshuffle", "shuffle", "bitshuffle"])),
                typesize=native(dtype).itemsize,
                blocksize=draw(st.sampled_from([0, 0, 128])),
            ))
        elif kind == "zstd":
            out.append(ZstdCodec(level=draw(st.integers(-1, 9)), checksum=draw(st.booleans())))
        elif kind == "gzip":
            out.append(GzipCodec(level=draw(st.integers(0, 9))))
        else:
            out.append(Crc32cCodec())
    return out


@st.composite
def v3_key_encoding(draw):
    name = draw(st.sampled_from(["default", "v2"]))
    return {"name": name, "separator": draw(st.sampled_from(["/", "."]))}


@st.composite
def v3_inner_chain(draw, ndim, dtype):
    """``(filters, serializer, compressors)`` of an unsharded chunk (or of an inner chunk)."""
    filters = []
    if ndim > 1 and draw(st.booleans()):
        filters = [TransposeCodec(order=tuple(draw(st.permutations(range(ndim)))))]
    elif draw(st.integers(0, 4)) == 0:
        filters = [TransposeCodec(order=tuple(range(ndim)))]  # identity transpose is legal too
    serializer = BytesCodec(endian=draw(st.sampled_from(["little", "big"])))
    return filters, serializer, draw(v3_compressors(dtype))


def new_dir(tmp_path_factory) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp())


def write_config(draw):
    """zarr's array config: usually skip fill-only chunks, sometimes store them anyway."""
    return {"write_empty_chunks": draw(st.integers(0, 4)) == 0}


# ---------------------------------------------------------------------------------------------
# Zarr v2


@pytest.mark.timeout(300)
@settings(max_examples=600, **SETTINGS)
@given(data=st.data())
def test_v2_matches_zarr(tmp_path_factory, data):
    draw = data.draw
    shape, chunks, _ = draw(geometry())
    dtype = draw(st.sampled_from(V2_DTYPES))
    fill = to_fill(draw(fill_values(dtype, allow_none=True)), dtype)
    order = draw(st.sampled_from(["C", "F"]))
    separator = draw(st.sampled_from([".", "/"]))
    compressor = draw(v2_compressor())
    filters = draw(v2_filters(dtype))
    plan = draw(st.sampled_from(["full", "full", "box", "boxes", "none"]))
    p_fill = draw(st.sampled_from([0.0, 0.3, 0.7]))
    seed = draw(st.integers(0, 2**32 - 1))
    config = write_config(draw)
    note(f"{shape=} {chunks=} {dtype=} {fill=!r} {order=} {separator=} {compressor=} {filters=} {plan=} {p_fill=}")
    event(f"v2 compressor {type(compressor).__name__}")
    rng = np.random.default_rng(seed)
    with new_dir(tmp_path_factory) as tmp:
        path = os.path.join(tmp, "a.zarr")
        z = zarr.create_array(
            store=path, shape=shape, chunks=chunks, dtype=dtype, zarr_format=2, order=order,
            compressors=compressor, filters=filters, fill_value=fill,
            chunk_key_encoding=v2_key_encoding(separator), config=config,
        )
        with open(os.path.join(path, ".zarray")) as f:
            meta = json.load(f)
        assert meta["dtype"] == np.dtype(dtype).str and meta["order"] == order
        assert meta.get("dimension_separator", ".") == separator
        write_with_holes(z, rng, random_values(rng, shape, dtype), chunks, fill, plan, p_fill)
        check_reader(path, draw(boxes(shape)), chunks=chunks, shards=None, zarr_format=2)


# ---------------------------------------------------------------------------------------------
# Zarr v3, plain chunks


@pytest.mark.timeout(300)
@settings(max_examples=600, **SETTINGS)
@given(data=st.data())
def test_v3_unsharded_matches_zarr(tmp_path_factory, data):
    draw = data.draw
    shape, chunks, _ = draw(geometry())
    dtype = draw(st.sampled_from(V3_DTYPES))
    fill = to_fill(draw(fill_values(dtype, allow_none=False)), dtype)
    filters, serializer, compressors = draw(v3_inner_chain(len(shape), dtype))
    key_encoding = draw(v3_key_encoding())
    plan = draw(st.sampled_from(["full", "full", "box", "boxes", "none"]))
    p_fill = draw(st.sampled_from([0.0, 0.3, 0.7]))
    seed = draw(st.integers(0, 2**32 - 1))
    config = write_config(draw)
    note(f"{shape=} {chunks=} {dtype=} {fill=!r} {filters=} {serializer=} {compressors=} {key_encoding=} "
         f"{plan=} {p_fill=}")
    rng = np.random.default_rng(seed)
    with new_dir(tmp_path_factory) as tmp:
        path = os.path.join(tmp, "a.zarr")
        z = zarr.create_array(
            store=path, shape=shape, chunks=chunks, dtype=dtype, zarr_format=3,
            filters=filters, serializer=serializer, compressors=compressors or None, fill_value=fill,
            chunk_key_encoding=key_encoding, config=config,
        )
        with open(os.path.join(path, "zarr.json")) as f:
            names = [c["name"] for c in json.load(f)["codecs"]]
        assert "sharding_indexed" not in names and "bytes" in names
        write_with_holes(z, rng, random_values(rng, shape, dtype), chunks, fill, plan, p_fill)
        check_reader(path, draw(boxes(shape)), chunks=chunks, shards=None, zarr_format=3)


# ---------------------------------------------------------------------------------------------
# Zarr v3, sharded


@st.composite
def sharding_codec(draw, ndim, dtype, inner_chunks):
    filters, serializer, compressors = draw(v3_inner_chain(ndim, dtype))
    index_codecs = [BytesCodec(endian=draw(st.sampled_from(["little", "big"])))]
    if draw(st.booleans()):
        index_codecs.append(Crc32cCodec())
    return ShardingCodec(
        chunk_shape=inner_chunks,
        codecs=[*filters, serializer, *compressors],
        index_codecs=index_codecs,
        index_location=draw(st.sampled_from(["start", "end"])),
    )


@pytest.mark.timeout(300)
@settings(max_examples=600, **SETTINGS)
@given(data=st.data())
def test_v3_sharded_matches_zarr(tmp_path_factory, data):
    draw = data.draw
    shape, chunks, shards = draw(geometry(sharded=True))
    dtype = draw(st.sampled_from(V3_DTYPES))
    fill = to_fill(draw(fill_values(dtype, allow_none=False)), dtype)
    codec = draw(sharding_codec(len(shape), dtype, chunks))
    key_encoding = draw(v3_key_encoding())
    plan = draw(st.sampled_from(["full", "full", "box", "boxes", "none"]))
    # holes per inner chunk (missing index entries) or per shard (missing shard files)
    hole_unit = draw(st.sampled_from(["inner", "shard"]))
    p_fill = draw(st.sampled_from([0.0, 0.3, 0.7]))
    seed = draw(st.integers(0, 2**32 - 1))
    config = write_config(draw)
    note(f"{shape=} {chunks=} {shards=} {dtype=} {fill=!r} {codec=} {key_encoding=} {plan=} {hole_unit=} {p_fill=}")
    event(f"index_location {codec.index_location.value}")
    rng = np.random.default_rng(seed)
    with new_dir(tmp_path_factory) as tmp:
        path = os.path.join(tmp, "a.zarr")
        z = zarr.create_array(
            store=path, shape=shape, chunks=shards, dtype=dtype, zarr_format=3,
            serializer=codec, filters=None, compressors=None, fill_value=fill,
            chunk_key_encoding=key_encoding, config=config,
        )
        with open(os.path.join(path, "zarr.json")) as f:
            names = [c["name"] for c in json.load(f)["codecs"]]
        assert names == ["sharding_indexed"]
        unit = chunks if hole_unit == "inner" else shards
        write_with_holes(z, rng, random_values(rng, shape, dtype), unit, fill, plan, p_fill)
        check_reader(path, draw(boxes(shape)), chunks=chunks, shards=shards, zarr_format=3)


@pytest.mark.timeout(300)
@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_v3_sharded_via_create_array_shards(tmp_path_factory, data):
    """The everyday spelling: ``create_array(chunks=inner, shards=shard, filters/compressors=...)``."""
    draw = data.draw
    shape, chunks, shards = draw(geometry(sharded=True, max_rank=3))
    dtype = draw(st.sampled_from(V3_DTYPES))
    fill = to_fill(draw(fill_values(dtype, allow_none=False)), dtype)
    filters, serializer, compressors = draw(v3_inner_chain(len(shape), dtype))
    seed = draw(st.integers(0, 2**32 - 1))
    note(f"{shape=} {chunks=} {shards=} {dtype=} {fill=!r} {filters=} {serializer=} {compressors=}")
    rng = np.random.default_rng(seed)
    with new_dir(tmp_path_factory) as tmp:
        path = os.path.join(tmp, "a.zarr")
        z = zarr.create_array(
            store=path, shape=shape, chunks=chunks, shards=shards, dtype=dtype, zarr_format=3,
            filters=filters, serializer=serializer, compressors=compressors or None, fill_value=fill,
        )
        write_with_holes(z, rng, random_values(rng, shape, dtype), chunks, fill, "full", 0.4)
        check_reader(path, draw(boxes(shape)), chunks=chunks, shards=shards, zarr_format=3)


# ---------------------------------------------------------------------------------------------
# Fill values and missing chunks, shards and inner chunks


def stored_files(path: str) -> list[str]:
    out = []
    for root, _, files in os.walk(path):
        for f in files:
            if f not in (".zarray", ".zattrs", "zarr.json"):
                out.append(os.path.relpath(os.path.join(root, f), path))
    return out


@pytest.mark.timeout(300)
@settings(max_examples=400, **SETTINGS)
@given(data=st.data())
def test_fill_and_missing_chunks_match_zarr(tmp_path_factory, data):
    """Sparse arrays: most chunks absent, special fill values, both formats, sharded or not."""
    draw = data.draw
    layout = draw(st.sampled_from(["v2", "v3", "v3-sharded"]))
    shape, chunks, shards = draw(geometry(sharded=layout == "v3-sharded"))
    if layout == "v2":
        dtype = draw(st.sampled_from(["<f2", "<f4", ">f8", "<i2", ">u4", "|b1", "<c8"]))
    else:
        dtype = draw(st.sampled_from(["float16", "float32", "float64", "int16", "uint32", "bool", "complex64"]))
    fill = to_fill(draw(fill_values(dtype, allow_none=layout == "v2")), dtype)
    # write a few isolated chunks; everything else is missing (or fill-only and skipped)
    n_written = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    note(f"{layout=} {shape=} {chunks=} {shards=} {dtype=} {fill=!r} {n_written=}")
    rng = np.random.default_rng(seed)
    with new_dir(tmp_path_factory) as tmp:
        path = os.path.join(tmp, "a.zarr")
        kwargs = dict(store=path, shape=shape, dtype=dtype, fill_value=fill)
        if layout == "v2":
            z = zarr.create_array(**kwargs, chunks=chunks, zarr_format=2, order=draw(st.sampled_from("CF")),
                                  compressors=numcodecs.Zstd(level=1))
        elif layout == "v3":
            z = zarr.create_array(**kwargs, chunks=chunks, zarr_format=3, compressors=GzipCodec(level=1))
        else:
            z = zarr.create_array(**kwargs, chunks=shards, zarr_format=3, compressors=None, filters=None,
                                  serializer=ShardingCodec(chunk_shape=chunks, codecs=[BytesCodec()],
                                                           index_location=draw(st.sampled_from(["start", "end"]))))
        regions = list(chunk_regions(shape, chunks))
        picked = rng.choice(len(regions), size=min(n_written, len(regions)), replace=False)
        for i in picked:
            region = regions[int(i)]
            if rng.random() < 0.5:  # a part of the chunk only: the rest of it reads as fill
                region = tuple(slice(r.start, r.start + int(rng.integers(1, r.stop - r.start + 1))) for r in region)
            z[region] = random_values(rng, tuple(r.stop - r.start for r in region), dtype)
        n_grid = math.prod(-(-n // c) for n, c in zip(shape, shards or chunks))
        n_files = len(stored_files(path))
        event(f"{layout}: {'some' if n_files < n_grid else 'no'} stored chunks missing")
        assert n_files <= n_grid
        check_reader(path, draw(boxes(shape, max_boxes=4)), chunks=chunks, shards=shards,
                     zarr_format=2 if layout == "v2" else 3)


# ---------------------------------------------------------------------------------------------
# A few fixed edge cases the generators above do not reach


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zero_dimensional_array(tmp_path, zarr_format):
    path = str(tmp_path / "scalar.zarr")
    z = zarr.create_array(store=path, shape=(), chunks=(), dtype="<i4" if zarr_format == 2 else "int32",
                          fill_value=-7, zarr_format=zarr_format)
    check_reader(path, [()], chunks=(), shards=None, zarr_format=zarr_format)  # never written: fill
    assert stoker.open_array(path).read(()).tolist() == -7
    z[()] = 123456
    check_reader(path, [()], chunks=(), shards=None, zarr_format=zarr_format)
    assert stoker.open_array(path).read(()).tolist() == 123456


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zero_length_axis(tmp_path, zarr_format):
    path = str(tmp_path / "empty.zarr")
    zarr.create_array(store=path, shape=(0, 5), chunks=(2, 2), dtype="uint16", fill_value=3, zarr_format=zarr_format)
    check_reader(path, [((0, 0), (1, 4)), ((0, 0), (0, 0))], chunks=(2, 2), shards=None, zarr_format=zarr_format)


@pytest.mark.parametrize("bits", [0x7FC00001, 0xFFC00000, 0x7FC12345, 0x80000000, 0x00000001])
def test_v3_hex_float_fill_value(tmp_path, bits):
    """A fill value written as its IEEE bit pattern (NaN payloads, -0.0, a subnormal) keeps every bit."""
    path = write_hex_fill_array(tmp_path, bits)
    got = stoker.open_array(path).read([(0, 7), (0, 5)])
    assert got[:3, :2].tolist() == np.arange(6, dtype=np.float32).reshape(3, 2).tolist()
    assert (got.view(np.uint32)[3:] == bits).all() and (got.view(np.uint32)[:, 2:] == bits).all()
    check_reader(path, [((0, 7), (0, 5)), ((4, 6), (1, 5))], chunks=(3, 2), shards=None, zarr_format=3)


def test_v3_hex_signalling_nan_fill_keeps_its_bits(tmp_path):
    """A signalling NaN fill keeps its exact bits, as the v3 spec says.

    zarr-python 3.1 quiets it (reads 0x7fc00001 for ``"0x7f800001"``), so this case
    is checked against the spec, not against zarr.
    """
    path = write_hex_fill_array(tmp_path, 0x7F800001)
    arr = stoker.open_array(path)
    assert np.asarray(arr.fill_value, np.float32).view(np.uint32) == 0x7F800001
    got = arr.read([(0, 7), (0, 5)])
    assert (got.view(np.uint32)[3:] == 0x7F800001).all()


def write_hex_fill_array(tmp_path, bits: int) -> str:
    """A 7x5 float32 v3 array with one chunk written and ``fill_value`` given as hex bits."""
    path = str(tmp_path / "hex.zarr")
    z = zarr.create_array(store=path, shape=(7, 5), chunks=(3, 2), dtype="float32", fill_value=0.0, zarr_format=3)
    z[:3, :2] = np.arange(6, dtype=np.float32).reshape(3, 2)
    meta_path = os.path.join(path, "zarr.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["fill_value"] = f"0x{bits:08x}"
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return path


def test_basic_indexing_reads_as_numpy_indexes(tmp_path):
    """arr[...] follows numpy's basic indexing: slices of step 1 (negative and open ends), integers that drop
    their axis, '...', fewer indices than axes; everything else is a typed error."""
    data = np.arange(6 * 7 * 8, dtype=np.int32).reshape(6, 7, 8)
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=data.shape, chunks=(4, 3, 5), dtype="int32")
    z[:] = data
    arr = stoker.open_array(str(tmp_path / "a.zarr"))
    for key in [np.s_[0:4, 1:6, :], np.s_[-3:, :-2, 2], np.s_[5], np.s_[..., 3], np.s_[1, ..., 2:4], np.s_[:],
                np.s_[2:1, :, :], np.s_[-1, -1, -1], np.s_[..., 0:8:1]]:
        np.testing.assert_array_equal(arr[key], data[key], err_msg=str(key))
    with pytest.raises(stoker.InvalidArgument, match="step must be 1"):
        arr[::2]
    with pytest.raises(stoker.OutOfBounds, match="index 6 is outside"):
        arr[6]
    with pytest.raises(stoker.InvalidArgument, match="4 indices"):
        arr[0, 0, 0, 0]
    with pytest.raises(stoker.InvalidArgument, match="arrays of indices"):
        arr[[0, 1]]
    with pytest.raises(stoker.InvalidArgument, match="one '...'"):
        arr[..., ...]


@pytest.mark.parametrize("orders", [[(1, 2, 0), (1, 0, 2)], [(2, 0, 1), (0, 2, 1), (1, 0, 2)]])
def test_v3_chained_transposes_compose_in_codec_order(tmp_path, orders):
    """Several transpose codecs in a row: each permutes what the one before it returned, as zarr-python applies
    them; composed the other way round they name another axis order (a transposed or scrambled read)."""
    path = str(tmp_path / "tt.zarr")
    data = np.arange(4 * 5 * 6, dtype="int32").reshape(4, 5, 6)
    z = zarr.create_array(store=path, shape=data.shape, chunks=(2, 5, 3), dtype="int32", compressors=None,
                          filters=[TransposeCodec(order=o) for o in orders])
    z[:] = data
    assert np.array_equal(zarr.open_array(path, mode="r")[:], data)
    np.testing.assert_array_equal(stoker.open_array(path).read([(0, 4), (0, 5), (0, 6)]), data)
    check_reader(path, [((1, 3), (0, 5), (2, 6))], chunks=(2, 5, 3), shards=None, zarr_format=3)
