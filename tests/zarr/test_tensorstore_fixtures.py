"""stoker reads arrays written by tensorstore (an independent Zarr implementation) exactly as tensorstore does.

Each layout is created by tensorstore's ``zarr`` (v2) or ``zarr3`` driver and
written partially: a few random boxes plus one region set to the fill value, and
never the far corner, so some chunks, shards or inner chunks are missing. Random
boxes (seeded) are then read by stoker and by tensorstore and compared bit for
bit.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import zlib

import numpy as np
import pytest
import tensorstore as ts

import stoker

from batch_oracle import values_of

N_BOXES = 25


def _blosc(cname: str, shuffle, clevel: int = 5) -> dict:
    return {"id": "blosc", "cname": cname, "clevel": clevel, "shuffle": shuffle}


# (id, shape, chunks, dtype, order, compressor, dimension_separator, fill_value)
V2_LAYOUTS = [
    ("u1-raw", (37, 23), (8, 5), "|u1", "C", None, ".", 0),
    ("i1-zlib-3d", (9, 10, 11), (4, 3, 5), "|i1", "C", {"id": "zlib", "level": 3}, ".", -5),
    ("be-i2-F-blosc-lz4-slash", (31, 17, 5), (6, 4, 5), ">i2", "F", _blosc("lz4", 1), "/", -3),
    ("le-u2-blosc-zstd-bitshuffle", (40, 33), (16, 7), "<u2", "C", _blosc("zstd", 2), ".", 65535),
    ("be-u4-blosc-lz4hc-noshuffle-F", (21, 6, 9), (5, 6, 2), ">u4", "F", _blosc("lz4hc", 0), ".", 17),
    ("le-i8-blosc-blosclz-F-slash", (13, 11, 3, 4), (4, 3, 2, 3), "<i8", "F", _blosc("blosclz", 2), "/", 0),
    ("be-u8-blosc-zlib", (29,), (7,), ">u8", "C", _blosc("zlib", 1), ".", 2**64 - 1),
    ("le-f2-zstd-inf", (19, 23), (5, 6), "<f2", "C", {"id": "zstd", "level": 3}, ".", "Infinity"),
    ("be-f4-zstd-F-nan", (24, 18), (7, 8), ">f4", "F", {"id": "zstd", "level": 1}, ".", "NaN"),
    ("le-f8-zlib-neginf-slash", (15, 7, 6), (4, 7, 4), "<f8", "C", {"id": "zlib", "level": 6}, "/", "-Infinity"),
    ("be-f8-gzip-F", (22, 9), (5, 4), ">f8", "F", {"id": "gzip", "level": 5}, ".", 1.5),
    ("le-f4-bz2", (17, 13), (6, 6), "<f4", "C", {"id": "bz2", "level": 9}, ".", -0.0),
    ("b1-blosc-lz4hc-F", (26, 14), (5, 4), "|b1", "F", _blosc("lz4hc", 2), "/", True),
    ("le-c8-zstd", (12, 10), (5, 4), "<c8", "C", {"id": "zstd", "level": 1}, ".", [1.0, "NaN"]),
    ("be-i4-null-fill", (16, 16), (6, 5), ">i4", "C", _blosc("lz4", 1), ".", None),
    ("le-u2-chunk-over-shape", (7, 5), (9, 8), "<u2", "F", None, ".", 9),
]


def _bytes(endian: str = "little") -> dict:
    return {"name": "bytes", "configuration": {"endian": endian}}


def _blosc3(cname: str, shuffle: str, typesize: int) -> dict:
    return {"name": "blosc", "configuration": {"cname": cname, "clevel": 5, "shuffle": shuffle,
                                               "typesize": typesize, "blocksize": 0}}


def _transpose(order) -> dict:
    return {"name": "transpose", "configuration": {"order": list(order)}}


ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
ZSTD_CHECKSUM = {"name": "zstd", "configuration": {"level": 1, "checksum": True}}
GZIP = {"name": "gzip", "configuration": {"level": 5}}
CRC32C = {"name": "crc32c"}


def _shard(inner, codecs, *, location: str = "end", index_crc32c: bool = True, index_endian: str = "little") -> dict:
    return {"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(inner),
        "codecs": codecs,
        "index_codecs": [_bytes(index_endian)] + ([CRC32C] if index_crc32c else []),
        "index_location": location,
    }}


# (id, shape, grid chunk (shard when sharded), inner chunk or None, data_type, codecs, chunk_key_encoding, fill)
V3_LAYOUTS = [
    ("u8-bytes", (37, 23), (8, 5), None, "uint8", [_bytes()], {"name": "default"}, 0),
    ("i16-transpose-be-blosc-zstd-bitshuffle", (19, 12, 10), (4, 5, 3), None, "int16",
     [_transpose((2, 0, 1)), _bytes("big"), _blosc3("zstd", "bitshuffle", 2)], {"name": "default"}, -7),
    ("f32-be-zstd-crc32c-nan", (24, 18), (7, 8), None, "float32",
     [_bytes("big"), ZSTD, CRC32C], {"name": "default"}, "NaN"),
    ("f64-gzip-neginf-dot-keys", (15, 7, 6), (4, 3, 4), None, "float64",
     [_bytes(), GZIP], {"name": "default", "configuration": {"separator": "."}}, "-Infinity"),
    ("u16-blosc-lz4-shuffle-v2-slash-keys", (33, 21), (10, 6), None, "uint16",
     [_bytes(), _blosc3("lz4", "shuffle", 2)], {"name": "v2", "configuration": {"separator": "/"}}, 1234),
    ("i64-transpose-F-blosc-lz4hc-v2-dot-keys", (11, 9, 4, 3), (4, 3, 2, 2), None, "int64",
     [_transpose((3, 2, 1, 0)), _bytes("little"), _blosc3("lz4hc", "noshuffle", 8)],
     {"name": "v2", "configuration": {"separator": "."}}, -(2**63)),
    ("u64-be-blosc-blosclz", (29,), (6,), None, "uint64",
     [_bytes("big"), _blosc3("blosclz", "shuffle", 8)], {"name": "default"}, 2**64 - 1),
    ("f16-blosc-zlib-inf", (21, 14), (5, 5), None, "float16",
     [_bytes(), _blosc3("zlib", "bitshuffle", 2)], {"name": "default"}, "Infinity"),
    ("bool-zstd-checksum", (26, 14), (5, 4), None, "bool", [_bytes(), ZSTD_CHECKSUM], {"name": "default"}, True),
    ("i32-crc32c-only", (14, 15), (4, 4), None, "int32", [_bytes("big"), CRC32C], {"name": "default"}, 42),
    ("c64-gzip", (12, 10), (5, 4), None, "complex64", [_bytes(), GZIP], {"name": "default"}, [2.0, -1.0]),
    ("i8-zstd-v2-default-dot-keys", (23, 17), (6, 5), None, "int8", [_bytes(), ZSTD], {"name": "v2"}, -128),
    ("u32-transpose-be-gzip-3d", (10, 13, 7), (3, 5, 7), None, "uint32",
     [_transpose((1, 2, 0)), _bytes("big"), GZIP], {"name": "default"}, 7),
    # sharded
    ("shard-end-crc-u16-blosc", (40, 33), (16, 14), (4, 7), "uint16",
     [_shard((4, 7), [_bytes(), _blosc3("lz4", "shuffle", 2)])], {"name": "default"}, 0),
    ("shard-start-crc-i16-zstd", (31, 17, 5), (12, 8, 5), (4, 4, 5), "int16",
     [_shard((4, 4, 5), [_bytes(), ZSTD], location="start")], {"name": "default"}, -1),
    ("shard-end-nocrc-f32-transpose-be-gzip", (23, 19), (10, 12), (5, 3), "float32",
     [_shard((5, 3), [_transpose((1, 0)), _bytes("big"), GZIP], index_crc32c=False)], {"name": "default"}, "NaN"),
    ("shard-start-nocrc-bigindex-f64", (17, 13, 9), (6, 8, 9), (3, 4, 3), "float64",
     [_shard((3, 4, 3), [_bytes("big"), _blosc3("zstd", "bitshuffle", 8)], location="start",
             index_crc32c=False, index_endian="big")], {"name": "default", "configuration": {"separator": "."}}, 0.25),
    ("shard-end-inner-crc32c-u8", (35, 26), (14, 13), (7, 13), "uint8",
     [_shard((7, 13), [_bytes(), ZSTD, CRC32C])], {"name": "v2", "configuration": {"separator": "/"}}, 200),
    ("shard-start-crc-i64-4d", (9, 8, 7, 6), (6, 4, 4, 6), (3, 2, 2, 3), "int64",
     [_shard((3, 2, 2, 3), [_transpose((0, 2, 1, 3)), _bytes(), GZIP], location="start")], {"name": "default"}, 3),
    ("shard-end-bigindex-crc-bool", (30, 20), (10, 10), (5, 5), "bool",
     [_shard((5, 5), [_bytes(), _blosc3("lz4hc", "bitshuffle", 1)], index_endian="big")], {"name": "default"}, False),
    ("shard-start-crc-c128-be-zstd", (14, 11), (6, 6), (3, 2), "complex128",
     [_shard((3, 2), [_bytes("big"), ZSTD], location="start")], {"name": "default"}, ["NaN", "-Infinity"]),
    ("shard-end-nocrc-u32-1d-dot-keys", (50,), (12,), (3,), "uint32",
     [_shard((3,), [_bytes(), _blosc3("blosclz", "shuffle", 4)], index_crc32c=False)],
     {"name": "default", "configuration": {"separator": "."}}, 99),
    ("shard-end-crc-f16-one-shard-bigger-than-array", (7, 5), (8, 8), (4, 4), "float16",
     [_shard((4, 4), [_bytes()])], {"name": "default"}, "-Infinity"),
]


def _fill_scalar(store: ts.TensorStore) -> np.ndarray:
    fill = store.fill_value
    if fill is None:
        return np.zeros((), store.dtype.numpy_dtype)
    return np.asarray(fill)


def _write_partially(store: ts.TensorStore, rng: np.random.Generator, grid_chunks, read_chunks) -> None:
    """A few random boxes, never reaching the far corner chunk (or shard) of ``grid_chunks``;
    then the first read chunk (inner chunk when sharded) is set to the fill value."""
    shape = store.shape
    dtype = store.dtype.numpy_dtype
    # stay clear of the last chunk along every axis that has more than one
    limit = [(n - 1) // c * c if n > c else n for n, c in zip(shape, grid_chunks)]
    for _ in range(3):
        box = []
        for n in limit:
            a = int(rng.integers(0, n))
            box.append(slice(a, int(rng.integers(a + 1, n + 1))))
        box = tuple(box)
        data = values_of(rng, tuple(s.stop - s.start for s in box), dtype)
        store[box].write(data).result()
    if all(n <= c for n, c in zip(shape, read_chunks)):
        return  # a single read chunk: leave it written
    region = tuple(slice(0, min(c, n)) for n, c in zip(shape, read_chunks))
    fill = _fill_scalar(store)
    store[region].write(np.full(tuple(s.stop for s in region), fill, dtype=dtype)).result()


def _random_boxes(rng: np.random.Generator, shape, n: int):
    boxes = [tuple((0, s) for s in shape)]
    for i in range(n):
        box = []
        for s in shape:
            a = int(rng.integers(0, s + 1))
            b = a if i % 8 == 7 else int(rng.integers(a, s + 1))  # every eighth box has an empty extent
            box.append((a, b))
        boxes.append(tuple(box))
    return boxes


def _assert_bit_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    want_dtype = expected.dtype.newbyteorder("=")
    assert got.dtype == want_dtype, f"{what}: dtype {got.dtype} != {want_dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    want = np.ascontiguousarray(expected.astype(want_dtype))
    np.testing.assert_array_equal(got, want, err_msg=what)
    assert np.ascontiguousarray(got).tobytes() == want.tobytes(), f"{what}: values equal but bits differ"


def _stored_chunk_files(path: str) -> int:
    return sum(
        1 for _, _, files in os.walk(path) for f in files if f not in (".zarray", ".zattrs", "zarr.json")
    )


def _compare(path: str, store: ts.TensorStore, rng: np.random.Generator, grid_chunks) -> stoker.ArrayReader:
    arr = stoker.open_array(path)
    assert arr.shape == tuple(store.shape)
    assert arr.dtype == np.dtype(store.dtype.numpy_dtype).newbyteorder("=")
    # some stored chunks (or shards) really are missing, so the fill path is exercised
    n_grid = math.prod(-(-n // c) for n, c in zip(store.shape, grid_chunks))
    n_files = _stored_chunk_files(path)
    if n_grid > 1:
        assert 0 < n_files < n_grid, f"expected some chunks missing: {n_files} stored of {n_grid}"
    fill = _fill_scalar(store).astype(arr.dtype)
    assert np.asarray(arr.fill_value, arr.dtype).tobytes() == fill.tobytes()
    for i, box in enumerate(_random_boxes(rng, store.shape, N_BOXES)):
        slices = tuple(slice(a, b) for a, b in box)
        expected = store[slices].read().result()
        got = arr.read(box if i % 2 else slices)
        _assert_bit_equal(got, np.asarray(expected), f"box {box}")
    return arr


def _seed(layout_id: str) -> int:
    return zlib.crc32(layout_id.encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "layout_id,shape,chunks,dtype,order,compressor,separator,fill",
    V2_LAYOUTS, ids=[layout[0] for layout in V2_LAYOUTS],
)
def test_v2_tensorstore_fixture(tmp_path, layout_id, shape, chunks, dtype, order, compressor, separator, fill):
    path = str(tmp_path / "a.zarr")
    metadata = {
        "shape": list(shape), "chunks": list(chunks), "dtype": dtype, "order": order,
        "compressor": compressor, "dimension_separator": separator, "fill_value": fill, "filters": None,
    }
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}, "metadata": metadata},
                    create=True).result()
    rng = np.random.default_rng(_seed(layout_id))
    _write_partially(store, rng, chunks, chunks)
    # tensorstore wrote what we asked for
    with open(os.path.join(path, ".zarray")) as f:
        written = json.load(f)
    assert (written["dtype"], written["order"], written.get("dimension_separator", ".")) == (dtype, order, separator)
    if separator == "/" and len(shape) > 1:
        assert any(os.path.isdir(os.path.join(path, d)) for d in os.listdir(path))
    arr = _compare(path, store, rng, chunks)
    assert arr.zarr_format == 2
    assert arr.chunks == tuple(chunks) and arr.shards is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "layout_id,shape,grid_chunks,inner_chunks,data_type,codecs,key_encoding,fill",
    V3_LAYOUTS, ids=[layout[0] for layout in V3_LAYOUTS],
)
def test_v3_tensorstore_fixture(tmp_path, layout_id, shape, grid_chunks, inner_chunks, data_type, codecs,
                                key_encoding, fill):
    path = str(tmp_path / "a.zarr")
    metadata = {
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid_chunks)}},
        "chunk_key_encoding": key_encoding,
        "codecs": codecs,
        "fill_value": fill,
    }
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "metadata": metadata},
                    create=True).result()
    rng = np.random.default_rng(_seed(layout_id))
    _write_partially(store, rng, grid_chunks, inner_chunks or grid_chunks)
    arr = _compare(path, store, rng, grid_chunks)
    assert arr.zarr_format == 3
    assert arr.chunks == tuple(inner_chunks or grid_chunks)
    assert arr.shards == (tuple(grid_chunks) if inner_chunks else None)
    if inner_chunks:
        # some stored shard has an empty inner-chunk entry, so missing inner chunks are exercised
        shard_grid = [range(-(-n // c)) for n, c in zip(shape, grid_chunks)]
        indexes = [arr.shard_index(arr.metadata.chunk_key(i)) for i in itertools.product(*shard_grid)]
        indexes = [i for i in indexes if i is not None]
        assert indexes, "expected at least one stored shard"
        assert any(((i[:, 0] == 2**64 - 1) & (i[:, 1] == 2**64 - 1)).any() for i in indexes), \
            "expected an empty inner chunk in some stored shard"
