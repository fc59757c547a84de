"""Batches of a ``stoker.Pipeline`` equal zarr-python's reads of the same boxes, bit for bit, for layouts
drawn at random: Zarr v2 and v3, sharded or not (index at the start or end), C and F order, transposes of
any order, either byte order, filters (delta, shuffle, fixedscaleoffset, astype, quantize), compressors
(blosc with each shuffle, zstd, gzip, zlib, lz4, bz2, lzma, crc32c), key encodings, fill values (NaN, the
types' extremes), chunks larger than the array, edge chunks and chunks, shards and inner chunks never
written.

tests/reader/test_reader_oracle.py holds ``open_array(...).read`` to the same oracle (Python decode path);
this file holds the pipeline to it, on the Python path and on the compiled engine (``decode_path``), the
boxes half the time chunk-aligned (whole chunks decoded straight into the batch), the array read from its
folder, and (fewer seeds) from an HTTP server (tests/range_server.py: chunks fetched, then decoded from
memory) and from a zip archive of it.

Each case is one seed (its id reproduces it); ``STOKER_FUZZ_EXAMPLES=N`` runs N seeds (a quarter of them
from the HTTP server and the archive).
"""

from __future__ import annotations

import os
import warnings
import zipfile

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, TransposeCodec, ZstdCodec

import stoker

from range_server import RangeServer
from batch_oracle import values_of as _values

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

_N = int(os.environ.get("STOKER_FUZZ_EXAMPLES", "").strip() or 40)
CASES = [("file", seed) for seed in range(_N)] + [(where, seed) for where in ("http", "zip")
                                                  for seed in range(_N, _N + max(1, _N // 4))]

V2_DTYPES = ["|u1", "|i1", "<i2", ">i2", ">u2", "<u4", ">i4", ">i8", "<u8", ">u8", "<f2", ">f2", ">f4", "<f8",
             ">f8", "|b1", ">c8"]
V3_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
             "float32", "float64", "complex64"]


def _choice(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _v2_fill(rng, nt: np.dtype):
    if nt.kind == "b":
        return _choice(rng, [None, False, True])
    if nt.kind in "iu":
        info = np.iinfo(nt)
        return _choice(rng, [None, 0, 7, int(info.min), int(info.max)])
    if nt.kind == "c":
        return _choice(rng, [None, 0, complex(1.5, -2)])
    return _choice(rng, [None, 0.0, -0.0, 1.5, float("nan"), float("inf"), float("-inf")])


def _v2_filters(rng, dt: np.dtype):
    nt = dt.newbyteorder("=")
    if nt.kind in "iu":
        kind = _choice(rng, ["none", "delta", "shuffle", "fixedscaleoffset", "astype"])
    elif nt.kind == "f":
        kind = _choice(rng, ["none", "shuffle", "quantize", "astype"])
    else:
        kind = "none"
    if kind == "delta":
        return [numcodecs.Delta(dtype=dt.str)]
    if kind == "shuffle":
        return [numcodecs.Shuffle(elementsize=dt.itemsize)]
    if kind == "fixedscaleoffset":
        return [numcodecs.FixedScaleOffset(offset=3, scale=1, dtype=dt.str)]
    if kind == "quantize":
        return [numcodecs.Quantize(digits=2, dtype=dt.str)]
    if kind == "astype":  # stored wider, read back as the array's type
        return [numcodecs.AsType(encode_dtype="<f8" if nt.kind == "f" else ">i8", decode_dtype=dt.str)]
    return None


def _v2_compressor(rng):
    kind = _choice(rng, ["none", "blosc", "blosc", "zstd", "gzip", "zlib", "lz4", "bz2", "lzma"])
    if kind == "blosc":
        return numcodecs.Blosc(cname=_choice(rng, ["lz4", "zstd", "zlib", "blosclz", "lz4hc"]),
                               shuffle=_choice(rng, [0, 1, 2, -1]), blocksize=_choice(rng, [0, 64]))
    return {"none": None, "zstd": numcodecs.Zstd(level=1, checksum=bool(rng.integers(2))), "gzip": numcodecs.GZip(),
            "zlib": numcodecs.Zlib(), "lz4": numcodecs.LZ4(), "bz2": numcodecs.BZ2(),
            "lzma": numcodecs.LZMA()}[kind]


def _v3_compressors(rng, itemsize: int) -> list:
    out = []
    for _ in range(int(rng.integers(3))):
        kind = _choice(rng, ["blosc", "zstd", "gzip", "crc32c"])
        if kind == "blosc":
            out.append(BloscCodec(cname=_choice(rng, ["lz4", "zstd", "zlib", "blosclz"]), typesize=itemsize,
                                  shuffle=_choice(rng, ["noshuffle", "shuffle", "bitshuffle"]),
                                  blocksize=_choice(rng, [0, 64])))
        else:
            out.append({"zstd": ZstdCodec(level=1, checksum=bool(rng.integers(2))), "gzip": GzipCodec(),
                        "crc32c": Crc32cCodec()}[kind])
    return out


def _v3_fill(rng, nt: np.dtype):
    if nt.kind == "b":
        return np.bool_(rng.integers(2))
    if nt.kind in "iu":
        info = np.iinfo(nt)
        return nt.type(_choice(rng, [0, 7, int(info.min), int(info.max)]))
    if nt.kind == "c":
        return nt.type(_choice(rng, [0, complex(float("nan"), -1.0)]))
    return nt.type(_choice(rng, [0.0, -2.5, float("nan"), float("-inf"), float(np.finfo(nt).max)]))


def write_layout(rng: np.random.Generator, path: str) -> tuple[str, tuple[int, ...]]:
    """Write an array of a random layout at ``path`` with zarr-python, some of it left unwritten; returns a
    description (for failure messages) and its read chunk shape."""
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(rng.integers(1, 13)) for _ in range(ndim))
    chunks = tuple(int(rng.integers(1, n + 3)) for n in shape)  # up to larger than the array
    config = {"write_empty_chunks": bool(rng.integers(2))}
    if rng.random() < 0.5:
        dt = np.dtype(_choice(rng, V2_DTYPES))
        kw = dict(zarr_format=2, dtype=dt, chunks=chunks, filters=_v2_filters(rng, dt),
                  compressors=_v2_compressor(rng), order=_choice(rng, ["C", "F"]),
                  chunk_key_encoding={"name": "v2", "separator": _choice(rng, [".", "/"])},
                  fill_value=_v2_fill(rng, dt.newbyteorder("=")))
    else:
        dt = np.dtype(_choice(rng, V3_DTYPES))
        transpose = [TransposeCodec(order=tuple(int(i) for i in rng.permutation(ndim)))] if rng.random() < 0.5 else []
        chain = dict(serializer=BytesCodec(endian=_choice(rng, ["little", "big"])),
                     compressors=_v3_compressors(rng, dt.itemsize))
        kw = dict(zarr_format=3, dtype=dt, fill_value=_v3_fill(rng, dt),
                  chunk_key_encoding={"name": _choice(rng, ["default", "v2"]), "separator": _choice(rng, ["/", "."])})
        if rng.random() < 0.5:
            inner = ShardingCodec(chunk_shape=chunks, index_location=_choice(rng, ["start", "end"]),
                                  codecs=[*transpose, chain["serializer"], *chain["compressors"]])
            kw.update(chunks=tuple(c * int(rng.integers(1, 4)) for c in chunks), serializer=inner, compressors=None,
                      filters=None)
        else:
            kw.update(chunks=chunks, filters=transpose, **chain)
    z = zarr.create_array(path, shape=shape, config=config, **kw)
    data = _values(rng, shape, dt)
    how = _choice(rng, ["all", "part", "part", "none"])
    if how == "all":
        z[...] = data
    elif how == "part":
        part = tuple(slice(int(a), int(b) + 1) for a, b in (sorted(rng.integers(0, n, size=2)) for n in shape))
        z[part] = data[part]
    return f"{kw} shape={shape} written={how}", chunks


def boxes(rng: np.random.Generator, shape, chunks, n: int = 3) -> list[list[tuple[int, int]]]:
    """``n`` boxes of one shape inside ``shape``; half the time whole chunks, aligned to the grid."""
    if rng.random() < 0.5 and all(c <= s for c, s in zip(chunks, shape)):
        size = [c * int(rng.integers(1, s // c + 1)) for s, c in zip(shape, chunks)]
        starts = lambda: [c * int(rng.integers(0, (s - b) // c + 1)) for s, b, c in zip(shape, size, chunks)]  # noqa: E731
    else:
        size = [int(rng.integers(1, s + 1)) for s in shape]
        starts = lambda: [int(rng.integers(0, s - b + 1)) for s, b in zip(shape, size)]  # noqa: E731
    return [[(a, a + b) for a, b in zip(starts(), size)] for _ in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder, and an HTTP server of it."""
    root = tmp_path_factory.mktemp("served")
    server = RangeServer(str(root))
    yield root, server
    server.stop()


def _uri(where: str, path: str, served) -> str:
    """Where the pipeline reads the array at ``path`` (a folder under the served root)."""
    if where == "http":
        root, server = served
        return f"{server.url}/{os.path.relpath(path, root)}"
    if where == "zip":
        archive = path + ".zip"
        with zipfile.ZipFile(archive, "w") as zf:
            for parent, _, names in os.walk(path):
                for name in names:
                    zf.write(os.path.join(parent, name), os.path.relpath(os.path.join(parent, name), path))
        return archive
    return path


@pytest.mark.parametrize("where,seed", CASES)
def test_pipeline_batches_equal_zarr_python(served, decode_path, where, seed):
    rng = np.random.default_rng([seed, 20261206])
    path = str(served[0] / f"{decode_path}-{where}-{seed}.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layout, chunks = write_layout(rng, path)
        ref = zarr.open_array(path, mode="r")
    crops = boxes(rng, ref.shape, chunks)
    uri = _uri(where, path, served)
    cfg = stoker.Config(batch_size=len(crops), dtype="native", device="cpu", host_buffer_bytes=16 << 20,
                        n_io_threads=1, n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box) for box in crops])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).numpy().copy()
    for row, box in enumerate(crops):
        want = np.asarray(ref[tuple(slice(a, b) for a, b in box)])
        want = np.ascontiguousarray(want.astype(want.dtype.newbyteorder("=")))
        assert got[row].dtype == want.dtype, layout
        assert got[row].tobytes() == want.tobytes(), f"box {box} of {layout}:\n{got[row]}\n!=\n{want}"
