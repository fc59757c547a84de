"""A seeded matrix of every Zarr layout zarr-python writes, read by stoker and by zarr-python, bit for bit.

Each case is one seed: it draws a layout, writes a small random array with zarr-python (some chunks never
written, some written and then deleted or overwritten with the fill value), reads random boxes (inside, at
the far borders, the whole array) through ``stoker.open_array(...).read`` and through a ``stoker.Pipeline``
(``dtype="native"`` and ``dtype="f32"``, in batches of two), and compares each with zarr-python's numpy slice (same bytes: NaN payloads, -0.0 and byte
order count; the float32 batch against numpy's cast of that slice).

What it draws:

- Zarr v2: bool, int8..int64, uint8..uint64, float16/32/64, complex64/128, little- and big-endian;
  order C and F; dimension_separator "." and "/"; compressors none, zstd, blosc (lz4, lz4hc, zstd, zlib,
  blosclz; shuffle none, byte, bit, auto; block sizes), gzip, zlib, lz4, bz2, lzma; filters delta,
  shuffle, fixedscaleoffset, quantize, astype, bitround, packbits, and bytes codecs (zlib, base64, bz2,
  crc32, adler32, fletcher32, jenkins_lookup3) as filters.
- Zarr v3: the same types (the byte order the ``bytes`` codec's ``endian``); transpose (any permutation,
  chained); compressors blosc (typesize of the type or another), zstd, gzip, crc32c and the
  ``numcodecs.*`` bytes codecs (zlib, lz4, bz2, lzma, shuffle, blosc, the checksums), chained; numcodecs
  array-to-array codecs (delta, fixedscaleoffset, astype, quantize, bitround); key encodings default and
  v2 with either separator.
- v3 sharding: inner chunks from one to several per shard, shards that do and do not divide the array,
  the index at the start or the end, with or without crc32c, in either byte order; a compressor after
  the sharding codec (a shard compressed whole).
- 1-d to 5-d, some larger 2-d and 3-d arrays (chunks of many blosc blocks), chunks that divide the shape and do not (edge chunks), chunks larger than the array.
- Fill values 0, nonzero, the type's extremes, NaN, +-inf, -0.0 (v2: also null).
- Layouts stoker does not read (nested sharding, transpose or numcodecs array codecs before
  ``sharding_indexed``, numcodecs.packbits, datetime, string, raw bytes and structured types): a
  :class:`stoker.UnsupportedFormat` from ``open_array`` and from a pipeline's batch, never data.
- Where: the array's folder, or a member of a group (consolidated or not) in a zip archive or over HTTP
  (tests/range_server.py; half the time through a disk cache, the native batches read twice).
- Executors: the compiled engine, the Python decode path, and the GPU decode and hybrid executors on CPU
  tensors (``on_host``; complex128, which the device does not move, is their ``NotYetSupported``).

``STOKER_LAYOUT_SEEDS=N`` runs seeds 0..N-1 instead of the fixed 64 (``A:B``: seeds A..B-1); a seed's id
reproduces its case.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
import zipfile

import numcodecs
import numpy as np
import pytest
import torch
import zarr
import zarr.codecs.numcodecs as zn
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, TransposeCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.pipeline import facade as pipelines

from range_server import RangeServer
from batch_oracle import host_executor, values_of as _values

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

_SPAN = os.environ.get("STOKER_LAYOUT_SEEDS", "").strip()  # "N" (seeds 0..N-1) or "A:B"
SEEDS = list(range(*map(int, _SPAN.split(":")))) if ":" in _SPAN else list(range(int(_SPAN or 64)))

V2_DTYPES = ["|b1", "|i1", "|u1", "<i2", ">i2", "<u2", ">u2", "<i4", ">i4", "<u4", ">u4", "<i8", ">i8", "<u8",
             ">u8", "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<c8", ">c16"]
V3_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"]
BLOSC_CNAMES = ["lz4", "lz4hc", "zstd", "zlib", "blosclz"]
#: most extent per axis, by rank: small arrays, few chunks, a quick write
MAX_EXTENT = {1: 40, 2: 16, 3: 9, 4: 6, 5: 5}


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _native(dt) -> np.dtype:
    return np.dtype(dt).newbyteorder("=")


# ---------------------------------------------------------------------------------------------
# Drawing a layout


def _geometry(rng):
    """``(shape, chunks)``: extents often not multiples of the chunks, chunks sometimes past the array."""
    if rng.random() < 0.15:  # larger: chunks of many blosc blocks, of which a crop decodes a few
        ndim = int(rng.integers(2, 4))
        shape = tuple(int(rng.integers(24, 65) if ndim == 2 else rng.integers(12, 21)) for _ in range(ndim))
        return shape, tuple(int(rng.integers(8, n + 1)) for n in shape)
    ndim = int(rng.integers(1, 6))
    shape = tuple(int(_pick(rng, [1, rng.integers(2, MAX_EXTENT[ndim] + 1), rng.integers(2, MAX_EXTENT[ndim] + 1)]))
                  for _ in range(ndim))
    chunks = []
    for n in shape:
        tier = _pick(rng, ["divides", "edge", "edge", "over"])
        if tier == "divides":
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            chunks.append(int(_pick(rng, divisors[-3:])))
        elif tier == "edge":
            chunks.append(int(rng.integers(max(1, n // 4), n + 1)))
        else:
            chunks.append(n + int(rng.integers(1, 3)))
    return shape, tuple(chunks)


def _fill(rng, dt: np.dtype, *, allow_none: bool):
    nt = _native(dt)
    options: list = [0] if not allow_none else [0, None]
    if nt.kind == "b":
        options += [True, False]
    elif nt.kind in "iu":
        info = np.iinfo(nt)
        options += [7, int(info.min), int(info.max)]
    elif nt.kind == "f":
        options += [-2.5, float("nan"), float("inf"), float("-inf"), -0.0]
    else:
        options += [complex(1.5, -2), complex(float("nan"), 0.0)]
    value = _pick(rng, options)
    return None if value is None else nt.type(value)


def _blosc_v2(rng):
    return numcodecs.Blosc(cname=_pick(rng, BLOSC_CNAMES), clevel=int(rng.integers(0, 10)),
                           shuffle=_pick(rng, [0, 1, 2, -1]), blocksize=_pick(rng, [0, 0, 64, 256, 1024]))


def _v2_compressor(rng):
    kind = _pick(rng, ["none", "blosc", "blosc", "zstd", "gzip", "zlib", "lz4", "bz2", "lzma"])
    return {"none": lambda: None, "blosc": lambda: _blosc_v2(rng),
            "zstd": lambda: numcodecs.Zstd(level=int(rng.integers(-1, 6)), checksum=bool(rng.integers(2))),
            "gzip": lambda: numcodecs.GZip(level=int(rng.integers(0, 10))),
            "zlib": lambda: numcodecs.Zlib(level=int(rng.integers(0, 10))), "lz4": numcodecs.LZ4,
            "bz2": numcodecs.BZ2, "lzma": numcodecs.LZMA}[kind]()


def _v2_filters(rng, dt: np.dtype):
    nt = _native(dt)
    kinds = ["none", "none", "shuffle", "checksum", "bytes"]
    if nt.kind in "iu":
        kinds += ["delta", "fixedscaleoffset", "astype"]
    elif nt.kind == "f" and nt.itemsize >= 4:
        kinds += ["quantize", "astype"] + (["bitround"] if dt == nt else [])  # numcodecs' takes native floats
    elif nt.kind == "b":
        kinds += ["packbits"]
    kind = _pick(rng, kinds)
    if kind == "none":
        return None
    if kind == "bytes":  # a bytes codec as a filter, before the compressor
        return [_pick(rng, [numcodecs.Zlib, numcodecs.Base64, numcodecs.BZ2])()]
    if kind == "packbits":
        return [numcodecs.PackBits()]
    if kind == "bitround":
        return [numcodecs.BitRound(keepbits=int(rng.integers(1, 12)))]
    if kind == "shuffle":
        return [numcodecs.Shuffle(elementsize=int(_pick(rng, [dt.itemsize, 1])))]
    if kind == "checksum":
        return [_pick(rng, [numcodecs.CRC32, numcodecs.Adler32, numcodecs.Fletcher32, numcodecs.JenkinsLookup3])()]
    if kind == "delta":
        return [numcodecs.Delta(dtype=dt.str)]
    if kind == "fixedscaleoffset":
        return [numcodecs.FixedScaleOffset(offset=3, scale=1, dtype=dt.str)]
    if kind == "quantize":
        return [numcodecs.Quantize(digits=3, dtype=dt.str)]
    return [numcodecs.AsType(encode_dtype="<f8" if nt.kind == "f" else ">i8", decode_dtype=dt.str)]


def _v3_compressors(rng, itemsize: int) -> list:
    """0-3 bytes-to-bytes codecs, e.g. ``[numcodecs.shuffle, zstd, crc32c]``."""
    out = []
    for _ in range(int(_pick(rng, [0, 1, 1, 2, 3]))):
        kind = _pick(rng, ["blosc", "blosc", "zstd", "gzip", "crc32c", "zlib", "lz4", "bz2", "lzma", "shuffle",
                           "nc-blosc", "checksum"])
        if kind == "blosc":
            out.append(BloscCodec(cname=_pick(rng, BLOSC_CNAMES), clevel=int(rng.integers(0, 10)),
                                  shuffle=_pick(rng, ["noshuffle", "shuffle", "bitshuffle"]),
                                  typesize=int(_pick(rng, [itemsize, itemsize, 1, 2, 4, 8])),
                                  blocksize=int(_pick(rng, [0, 0, 64, 256, 1024]))))
        elif kind == "nc-blosc":
            out.append(zn.Blosc(cname=_pick(rng, BLOSC_CNAMES), shuffle=int(_pick(rng, [0, 1, 2])),
                                typesize=int(_pick(rng, [itemsize, 4]))))
        elif kind == "checksum":
            out.append(_pick(rng, [zn.CRC32, zn.Adler32, zn.Fletcher32, zn.JenkinsLookup3])())
        elif kind == "shuffle":  # the element size must divide the bytes it gets: the chunk's, or any
            out.append(zn.Shuffle(elementsize=int(_pick(rng, [itemsize, 1])) if not out else 1))
        else:
            out.append({"zstd": lambda: ZstdCodec(level=int(rng.integers(-1, 6)), checksum=bool(rng.integers(2))),
                        "gzip": lambda: GzipCodec(level=int(rng.integers(0, 10))), "crc32c": Crc32cCodec,
                        "zlib": lambda: zn.Zlib(level=int(rng.integers(1, 10))), "lz4": zn.LZ4, "bz2": zn.BZ2,
                        "lzma": zn.LZMA}[kind]())
    return out


def _v3_filters(rng, ndim: int, dt: np.dtype) -> list:
    """A transpose (or two), or a numcodecs array-to-array codec, or nothing."""
    nt = _native(dt)
    kind = _pick(rng, ["none", "none", "transpose", "transpose", "transposes", "numcodecs"])
    if kind == "transpose":
        return [TransposeCodec(order=tuple(int(i) for i in rng.permutation(ndim)))]
    if kind == "transposes":
        return [TransposeCodec(order=tuple(int(i) for i in rng.permutation(ndim))) for _ in range(2)]
    if kind == "numcodecs" and nt.kind in "iu":
        # no astype of a one-byte type: zarr-python 3.1 cannot read it back ("Invalid endianness: None")
        return [_pick(rng, [lambda: zn.Delta(dtype=nt.str), lambda: zn.FixedScaleOffset(offset=2, scale=1, dtype=nt.str),
                            lambda: zn.AsType(encode_dtype="int64", decode_dtype=nt.str) if nt.itemsize > 1 else
                            zn.Delta(dtype=nt.str)])()]
    if kind == "numcodecs" and nt.kind == "f" and nt.itemsize >= 4:
        return [_pick(rng, [lambda: zn.Quantize(digits=3, dtype=nt.str), lambda: zn.BitRound(keepbits=5),
                            lambda: zn.AsType(encode_dtype="float64", decode_dtype=nt.str)])()]
    return []


def draw_layout(rng: np.random.Generator) -> dict:
    """``create_array`` keyword arguments of a random layout, plus what stoker should make of it:
    ``chunks`` (the read chunk), ``shards`` (or None) and ``refused`` (the error type, or None)."""
    shape, chunks = _geometry(rng)
    ndim = len(shape)
    kind = _pick(rng, ["v2", "v2", "v3", "v3", "sharded", "sharded", "sharded-compressed", "refused"])
    config = {"write_empty_chunks": bool(rng.random() < 0.2)}
    if kind == "v2":
        dt = np.dtype(_pick(rng, V2_DTYPES))
        kw = dict(zarr_format=2, dtype=dt, chunks=chunks, filters=_v2_filters(rng, dt),
                  compressors=_v2_compressor(rng), order=_pick(rng, ["C", "F"]),
                  chunk_key_encoding={"name": "v2", "separator": _pick(rng, [".", "/"])},
                  fill_value=_fill(rng, dt, allow_none=True))
        return dict(kw=kw, shape=shape, dtype=dt, chunks=chunks, shards=None, refused=None, config=config)
    dt = np.dtype(_pick(rng, V3_DTYPES))
    kw = dict(zarr_format=3, dtype=dt, fill_value=_fill(rng, dt, allow_none=False),
              chunk_key_encoding={"name": _pick(rng, ["default", "v2"]), "separator": _pick(rng, ["/", "."])})
    filters = _v3_filters(rng, ndim, dt)
    # after numcodecs array codecs, little-endian only: zarr-python 3.1 reads their big-endian chunks wrongly
    # (tests/zarr/test_foreign_layouts.py holds stoker's big-endian reads to zarr's little-endian ones)
    numcodecs_filters = any(not isinstance(f, TransposeCodec) for f in filters)
    endian = "little" if numcodecs_filters else _pick(rng, ["little", "big"])
    inner_chain = [*filters, BytesCodec(endian=endian), *_v3_compressors(rng, dt.itemsize)]
    if kind == "v3":
        n_filters = next(i for i, c in enumerate(inner_chain) if isinstance(c, BytesCodec))
        filters = inner_chain[:n_filters]
        kw.update(chunks=chunks, filters=filters, serializer=inner_chain[n_filters],
                  compressors=inner_chain[n_filters + 1:] or None)
        return dict(kw=kw, shape=shape, dtype=dt, chunks=chunks, shards=None, refused=None, config=config)
    shards = tuple(c * int(_pick(rng, [1, 1, 2, 3])) for c in chunks)
    index_codecs = [BytesCodec(endian=_pick(rng, ["little", "big"]))] + ([Crc32cCodec()] if rng.integers(2) else [])
    sharding = ShardingCodec(chunk_shape=chunks, codecs=inner_chain, index_codecs=index_codecs,
                             index_location=_pick(rng, ["start", "end"]))
    if kind == "sharded":
        kw.update(chunks=shards, serializer=sharding, compressors=None, filters=None)
        return dict(kw=kw, shape=shape, dtype=dt, chunks=chunks, shards=shards, refused=None, config=config)
    if kind == "sharded-compressed":  # a compressor after sharding_indexed: the whole shard is the read chunk
        kw.update(chunks=shards, serializer=sharding, filters=None,
                  compressors=_pick(rng, [[ZstdCodec(level=1)], [GzipCodec()], [BloscCodec(cname="lz4")],
                                          [zn.Zlib(), Crc32cCodec()]]))
        return dict(kw=kw, shape=shape, dtype=dt, chunks=shards, shards=None, refused=None, config=config)
    # layouts zarr-python writes and stoker refuses
    how = _pick(rng, ["nested", "transpose-outside", "numcodecs-outside", "packbits", "dtype"])
    if how == "dtype":  # a type that is not a number, in either format
        dt = _pick(rng, [np.dtype("<M8[ns]"), np.dtype("<m8[s]"), np.dtype("|S4"), np.dtype("<U3"), np.dtype("|V4"),
                         np.dtype([("a", "<i4"), ("b", "<f8")]), str])
        fmt = int(_pick(rng, [2, 3]))
        kw = dict(zarr_format=fmt, dtype=dt, chunks=chunks)
        if fmt == 3:
            kw["chunk_key_encoding"] = {"name": "default"}
    elif how == "nested":
        outer = tuple(s * int(_pick(rng, [1, 2])) for s in shards)
        kw.update(chunks=outer, compressors=None, filters=None,
                  serializer=ShardingCodec(chunk_shape=shards, codecs=[sharding]))
    elif how == "transpose-outside":  # the identity is read (it changes nothing), any other order refused
        order = tuple(int(i) for i in rng.permutation(ndim))
        kw.update(chunks=shards, compressors=None, serializer=sharding, filters=[TransposeCodec(order=order)])
        if order == tuple(range(ndim)):
            return dict(kw=kw, shape=shape, dtype=dt, chunks=chunks, shards=shards, refused=None, config=config)
    elif how == "numcodecs-outside":
        kw.update(chunks=shards, compressors=None, serializer=sharding, dtype=np.dtype("int32"), fill_value=np.int32(0),
                  filters=[zn.Delta(dtype="int32")])
        dt = np.dtype("int32")
    else:
        kw.update(chunks=chunks, dtype=np.dtype("bool"), fill_value=np.bool_(False), filters=[zn.PackBits()],
                  serializer=BytesCodec(), compressors=None)
        dt = np.dtype("bool")
    return dict(kw=kw, shape=shape, dtype=dt, chunks=chunks, shards=None, refused=stoker.UnsupportedFormat,
                config=config, how=how)


# ---------------------------------------------------------------------------------------------
# Writing it


def _regions(shape, unit):
    """Every box of the grid of ``unit`` over ``shape``, as slices."""
    grids = [range(0, n, c) for n, c in zip(shape, unit)]
    for starts in itertools.product(*grids):
        yield tuple(slice(s, min(s + c, n)) for s, c, n in zip(starts, unit, shape))


def _stored_keys(path: str) -> list[str]:
    out = []
    for parent, _, names in os.walk(path):
        for name in names:
            if name not in ("zarr.json", ".zarray", ".zattrs", ".zgroup"):
                out.append(os.path.join(parent, name))
    return sorted(out)


def write(rng, path: str, layout: dict, group: str | None = None, consolidated: bool = False) -> str:
    """Write ``layout`` at ``path`` (or as member ``path`` of the group ``group``, maybe consolidated): some of it,
    then maybe a part overwritten with the fill value (whole chunks, shards or inner chunks dropped by zarr)
    and a stored chunk file deleted; returns what was done."""
    if group is not None:
        zarr.open_group(group, mode="w", zarr_format=layout["kw"]["zarr_format"])
    z = zarr.create_array(path, shape=layout["shape"], config=layout["config"], **layout["kw"])
    if consolidated:
        zarr.consolidate_metadata(group)  # the metadata a store's reads take (chunks written later change none)
    if layout["refused"] is not None:  # refused at open: the metadata is what counts (zarr-python cannot
        return "none"                  # write some of these: a delta before sharding_indexed)
    shape, dt = layout["shape"], layout["dtype"]
    data = _values(rng, shape, dt)
    how = _pick(rng, ["all", "all", "part", "none"])
    if how == "all":
        z[...] = data
    elif how == "part":
        part = tuple(slice(int(a), int(b) + 1) for a, b in (sorted(rng.integers(0, n, size=2)) for n in shape))
        z[part] = data[part]
    done = [how]
    if how != "none" and rng.random() < 0.5:  # chunks (or inner chunks) written, then set back to the fill
        fill = z.fill_value if z.fill_value is not None else np.zeros((), _native(dt))
        for region in _regions(shape, layout["chunks"]):
            if rng.random() < 0.3:
                z[region] = fill
        done.append("refilled")
    keys = _stored_keys(path)
    if keys and rng.random() < 0.4:  # a stored chunk or shard file deleted
        os.remove(_pick(rng, keys))
        done.append("deleted")
    return "+".join(done)


# ---------------------------------------------------------------------------------------------
# Reading it


def _boxes(rng, shape) -> list[tuple[tuple[int, int], ...]]:
    """Boxes of one random size: one at the origin, one touching every far border, random ones inside."""
    size = [int(rng.integers(1, n + 1)) for n in shape]
    out = [tuple((0, b) for b in size), tuple((n - b, n) for n, b in zip(shape, size))]
    for _ in range(2):
        out.append(tuple((a, a + b) for a, b in ((int(rng.integers(0, n - b + 1)), b) for n, b in zip(shape, size))))
    return out


def _bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    want = np.ascontiguousarray(want.astype(_native(want.dtype)))
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.ascontiguousarray(got).tobytes() == want.tobytes(), f"{what}: bits differ\ngot\n{got}\nwant\n{want}"


def _f32_expected(want: np.ndarray) -> np.ndarray | None:
    """What an ``"f32"`` batch (with lossy_casts) holds for ``want``, or None where stoker must refuse it
    (a finite value past float32's range would be an inf the data did not hold)."""
    nt = _native(want.dtype)
    if nt.kind == "f" and nt.itemsize == 8:
        finite = want[np.isfinite(want)]
        if (np.abs(finite) > np.finfo(np.float32).max).any():
            return None
    return want.astype(np.float32)  # numpy keeps a NaN's payload (torch's float16 cast makes 0x7fffffff)


def _pipeline(uri: str, boxes, dtype: str, **knobs) -> np.ndarray:
    """The boxes' rows, in batches of two: the second batch reads with what the first learnt (shard indexes,
    blosc block tables of remote chunks)."""
    per = 2 if len(boxes) % 2 == 0 else 1
    cfg = stoker.Config(batch_size=per, dtype=dtype, lossy_casts=dtype != "native", device="cpu",
                        host_buffer_bytes=16 << 20, device_buffer_bytes=16 << 20, n_io_threads=1,
                        n_compute_threads=1, pop_timeout_s=20.0, **knobs)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box) for box in boxes])
        rows = []
        for _ in range(len(boxes) // per):
            with p.pop() as batch:
                rows.append(torch.from_dlpack(batch).numpy().copy())
        return np.concatenate(rows)


def check(uri: str, ref, layout: dict, rng, executor: str, what: str, **knobs) -> None:
    """``uri`` read by stoker equals ``ref`` (zarr-python's array) read by zarr-python, box by box; ``knobs``:
    the pipelines' Config (a disk cache: the native batches are read twice, the second time from it)."""
    arr = stoker.open_array(uri)
    assert arr.shape == ref.shape and arr.dtype == _native(ref.dtype), what
    assert arr.chunks == tuple(layout["chunks"]), what
    assert arr.shards == layout["shards"], what
    shape = ref.shape
    boxes = _boxes(rng, shape)
    whole = tuple((0, n) for n in shape)
    expected = {}
    for box in [*boxes, whole]:
        expected[box] = np.asarray(ref[tuple(slice(a, b) for a, b in box)])
        _bits_equal(arr.read(box), expected[box], f"open_array box {box} of {what}")
    if executor in ("gpu", "hybrid") and _native(ref.dtype).itemsize == 16:
        with pytest.raises(stoker.NotYetSupported, match="complex128"):  # the device moves 1-8 byte elements
            _pipeline(uri, boxes, "native")
        return
    for batch_boxes in (boxes, [whole]) + ((boxes,) if knobs else ()):
        got = _pipeline(uri, batch_boxes, "native", **knobs)
        for row, box in enumerate(batch_boxes):
            _bits_equal(got[row], expected[box], f"native batch box {box} of {what}")
    wants = [_f32_expected(expected[box]) for box in boxes]
    if _native(ref.dtype).kind == "c" or any(w is None for w in wants):
        with pytest.raises(stoker.DtypeMismatch):
            _pipeline(uri, boxes, "f32", **knobs)
        return
    got = _pipeline(uri, boxes, "f32", **knobs)
    for row, (box, want) in enumerate(zip(boxes, wants)):
        _bits_equal(got[row], want, f"f32 batch box {box} of {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder, and an HTTP server of it."""
    root = tmp_path_factory.mktemp("layouts")
    server = RangeServer(str(root))
    yield root, server
    server.stop()


def _zip(folder: str) -> str:
    """The Zarr zip store of ``folder`` (its hierarchy at the archive's root)."""
    archive = folder + ".zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for parent, _, names in os.walk(folder):
            for name in names:
                zf.write(os.path.join(parent, name), os.path.relpath(os.path.join(parent, name), folder))
    return archive


EXECUTORS = {
    "engine": None,  # the CPU executor, the compiled engine where it takes the chunks
    "python": None,  # the CPU executor's Python decode path
    "gpu": host_executor("gpu"),
    "hybrid": host_executor("hybrid"),
}


@pytest.mark.parametrize("seed", SEEDS)
def test_layout_reads_as_zarr_python_reads_it(served, tmp_path, monkeypatch, seed):
    rng = np.random.default_rng([seed, 20261207])
    layout = draw_layout(rng)
    # where the array is read: its folder, or a member of a group (consolidated or not) in a zip archive or
    # over HTTP (there with a disk cache or without)
    where = _pick(rng, ["local", "local", "local", "zip", "http"])
    consolidated = where != "local" and rng.random() < 0.7
    knobs = {"cache_dir": str(tmp_path / "cache")} if where == "http" and rng.random() < 0.5 else {}
    executor = ("engine", "python", "gpu", "hybrid")[seed % 4]
    if executor == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif EXECUTORS[executor] is not None:  # the GPU decode's executors on CPU tensors (HostDecoder)
        monkeypatch.setattr(pipelines, "make_executor", EXECUTORS[executor])
    base = served[0] / f"{seed}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    group = None if where == "local" else str(base / "g.zarr")
    path = str(base / "a.zarr") if group is None else os.path.join(group, "a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = write(rng, path, layout, group, consolidated)
    uri = path
    if where == "zip":
        uri = os.path.join(_zip(group), "a")
    elif where == "http":
        uri = f"{served[1].url}/{seed}/g.zarr/a"
    what = f"seed {seed} ({where}, {consolidated=}, {knobs=}, {executor}): shape={layout['shape']} {layout['kw']} config={layout['config']} " \
           f"written={written}"
    if layout["refused"] is not None:
        whole = tuple((0, n) for n in layout["shape"])
        with pytest.raises(stoker.UnsupportedFormat):  # README.md, "What is read": never data
            stoker.open_array(uri).read(whole)
        with pytest.raises(stoker.UnsupportedFormat):
            _pipeline(uri, [whole], "native")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = zarr.open_array(path, mode="r")
        check(uri, ref, layout, rng, executor, what, **knobs)
