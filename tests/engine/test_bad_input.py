"""Bad input of every kind: each gets its typed error, a message that says what and where, and
none of it hangs or writes a byte to the store.

Every failing case goes through :func:`expect_error`, which snapshots the store (every file's
bytes, size and mtime, every directory's mtime) before the call and compares it afterwards.
"""

from __future__ import annotations

import json
import os
import shutil

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.zarr.sharding import EMPTY

pytestmark = pytest.mark.timeout(30)

SHAPE = (32, 32)
CHUNKS = (16, 16)


# ---------------------------------------------------------------------------------------------
# helpers


def snapshot(root) -> dict:
    """Everything under ``root`` that a write could change: file bytes/size/mtime, dir mtimes."""
    out = {}
    root = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        st = os.stat(dirpath)
        out[os.path.relpath(dirpath, root) + "/"] = ("dir", st.st_mtime_ns)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (f.read(), st.st_size, st.st_mtime_ns)
    return out


def expect_error(root, exc_type, fn, *needles):
    """Call ``fn``; it must raise ``exc_type`` mentioning every needle and leave ``root`` untouched."""
    before = snapshot(root)
    with pytest.raises(exc_type) as info:
        fn()
    assert snapshot(root) == before, "a failed open/read modified the store"
    err = info.value
    assert isinstance(err, stoker.StokerError)
    msg = str(err)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not named in error message {msg!r}"
    return err


def read_all(uri):
    arr = stoker.open_array(uri)
    return arr.read([(0, s) for s in arr.shape])


def payload(seed=0, shape=SHAPE, dtype="u2"):
    """Data that compresses but not to nothing (so truncation/clobbering hits real payload)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1000, size=shape).astype(dtype)


def compressor(fmt: int, name: str | None, **config):
    if name is None:
        return None
    if fmt == 2:
        return {"blosc": numcodecs.Blosc, "zstd": numcodecs.Zstd, "gzip": numcodecs.GZip}[name](**config)
    return {"blosc": BloscCodec, "zstd": ZstdCodec, "gzip": GzipCodec, "crc32c": Crc32cCodec}[name](**config)


def make_array(path, fmt=3, comp="zstd", *, data=None, shape=SHAPE, chunks=CHUNKS, fill_value=0, **kw):
    data = payload(shape=shape) if data is None else data
    if "compressors" not in kw:
        c = compressor(fmt, comp)
        kw["compressors"] = None if c is None else c
    arr = zarr.create_array(
        os.fspath(path), shape=shape, chunks=chunks, dtype=data.dtype, zarr_format=fmt,
        fill_value=fill_value, **kw,
    )
    arr[...] = data
    return data


def first_key(fmt: int) -> str:
    return "0.0" if fmt == 2 else "c/0/0"


def rewrite(path, new: bytes) -> None:
    with open(path, "wb") as f:
        f.write(new)


def edit_json(path, change) -> None:
    with open(path) as f:
        doc = json.load(f)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


# ---------------------------------------------------------------------------------------------
# corrupt chunk files


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("comp", ["blosc", "zstd", "gzip", None])
@pytest.mark.parametrize("cut", ["half", "last_byte", "header_only", "empty"])
def test_truncated_chunk(tmp_path, fmt, comp, cut):
    uri = str(tmp_path / "a.zarr")
    data = make_array(uri, fmt, comp)
    key = first_key(fmt)
    chunk = os.path.join(uri, key)
    raw = open(chunk, "rb").read()
    keep = {"half": len(raw) // 2, "last_byte": len(raw) - 1, "header_only": 16, "empty": 0}[cut]
    rewrite(chunk, raw[:keep])
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 4), (0, 4)]), uri, repr(key))
    assert err.uri == uri and err.key == key
    # The other chunks are intact and still read correctly.
    np.testing.assert_array_equal(arr.read([(16, 32), (0, 32)]), data[16:, :])


def test_truncated_blosc_frame_is_never_read_past_its_end(tmp_path):
    """blosc1 trusts its header; a frame a few bytes short used to decode silently (regression)."""
    uri = str(tmp_path / "a.zarr")
    for shuffle in (0, 1, 2):
        shutil.rmtree(uri, ignore_errors=True)
        make_array(uri, 2, None, compressors=numcodecs.Blosc(shuffle=shuffle))
        raw = open(os.path.join(uri, "0.0"), "rb").read()
        for cut in range(1, 8):
            rewrite(os.path.join(uri, "0.0"), raw[:-cut])
            arr = stoker.open_array(uri)
            expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 16), (0, 16)]), uri, "'0.0'")


def _flip(raw: bytes, pos: int, mask: int = 0xFF) -> bytes:
    b = bytearray(raw)
    b[pos] ^= mask
    return bytes(b)


def _clobber(raw: bytes, start: int, stop: int | None = None, value: int = 0xFF) -> bytes:
    b = bytearray(raw)
    stop = len(b) if stop is None else stop
    b[start:stop] = bytes([value]) * (stop - start)
    return bytes(b)


CORRUPTIONS = {
    # name: (format, codec name, codec config, corruption of the stored frame)
    "v2-blosc-payload-ff": (2, "blosc", {}, lambda r: _clobber(r, 16)),
    "v2-blosc-payload-00": (2, "blosc", {}, lambda r: _clobber(r, 16, value=0)),
    "v2-blosc-header-version": (2, "blosc", {}, lambda r: _flip(r, 0)),
    "v2-blosc-header-nbytes": (2, "blosc", {}, lambda r: _flip(r, 5)),
    "v2-blosc-header-cbytes": (2, "blosc", {}, lambda r: _flip(r, 13, 0x01)),
    "v3-blosc-payload-ff": (3, "blosc", {}, lambda r: _clobber(r, 16)),
    "v3-blosc-header-cbytes": (3, "blosc", {}, lambda r: _flip(r, 12, 0x01)),
    "v2-gzip-middle": (2, "gzip", {}, lambda r: _flip(r, len(r) // 2)),
    "v3-gzip-middle": (3, "gzip", {}, lambda r: _flip(r, len(r) // 2)),
    "v3-gzip-crc-trailer": (3, "gzip", {}, lambda r: _flip(r, len(r) - 6, 0x01)),
    "v3-crc32c-first-bit": (3, "crc32c", {}, lambda r: _flip(r, 0, 0x01)),
    "v3-crc32c-middle-bit": (3, "crc32c", {}, lambda r: _flip(r, len(r) // 2, 0x10)),
    "v3-crc32c-checksum-bit": (3, "crc32c", {}, lambda r: _flip(r, len(r) - 1, 0x80)),
    "v3-zstd-checksum-middle": (3, "zstd", {"checksum": True}, lambda r: _flip(r, len(r) // 2)),
    "v3-zstd-checksum-last": (3, "zstd", {"checksum": True}, lambda r: _flip(r, len(r) - 1, 0x01)),
    "v2-zstd-checksum-middle": (2, "zstd", {"checksum": True}, lambda r: _flip(r, len(r) // 2)),
    "v3-zstd-magic": (3, "zstd", {}, lambda r: _clobber(r, 0, 4, 0)),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_chunk(tmp_path, case):
    # A zstd frame without a checksum can decode a corrupted payload silently (a format limit),
    # so payload corruption is only asserted where the format can detect it.
    # Likewise a blosc frame of incompressible data is stored verbatim (its "memcpyed" flag), so the
    # data here compresses, and the test checks that blosc really compressed it.
    fmt, comp, config, corrupt = CORRUPTIONS[case]
    uri = str(tmp_path / "a.zarr")
    data = np.random.default_rng(1).integers(0, 40, size=SHAPE).astype("u2")
    make_array(uri, fmt, None, data=data, compressors=compressor(fmt, comp, **config))
    key = first_key(fmt)
    chunk = os.path.join(uri, key)
    raw = open(chunk, "rb").read()
    if comp == "blosc":
        assert not raw[2] & 0x02, "blosc stored the chunk uncompressed"
    bad = corrupt(raw)
    assert bad != raw and len(bad) == len(raw)
    rewrite(chunk, bad)
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 16), (0, 16)]), uri, repr(key))
    assert err.key == key


def test_crc32c_detects_every_single_bit_flip(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3, None, compressors=Crc32cCodec(), shape=(4, 4), chunks=(4, 4))
    chunk = os.path.join(uri, "c/0/0")
    raw = open(chunk, "rb").read()
    assert len(raw) == 4 * 4 * 2 + 4
    for pos in range(len(raw)):
        for bit in range(8):
            rewrite(chunk, _flip(raw, pos, 1 << bit))
            arr = stoker.open_array(uri)
            with pytest.raises(stoker.DecodeError):
                arr.read([(0, 4), (0, 4)])
    rewrite(chunk, raw)
    np.testing.assert_array_equal(read_all(uri), zarr.open_array(uri)[...])


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("comp", ["zstd", "blosc", None])
def test_chunk_of_wrong_size(tmp_path, fmt, comp):
    """A valid compressed chunk from an array with another chunk shape is not silently reshaped."""
    uri = str(tmp_path / "a.zarr")
    other = str(tmp_path / "b.zarr")
    make_array(uri, fmt, comp)
    make_array(other, fmt, comp, chunks=(8, 8))
    key = first_key(fmt)
    shutil.copyfile(os.path.join(other, key), os.path.join(uri, key))
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 1), (0, 1)]), uri, repr(key))
    assert err.key == key


def test_chunk_from_wider_dtype(tmp_path):
    """Same chunk shape, but written as uint32: twice the bytes a uint16 chunk holds."""
    uri = str(tmp_path / "a.zarr")
    other = str(tmp_path / "b.zarr")
    make_array(uri, 3, "gzip")
    make_array(other, 3, "gzip", data=payload(dtype="u4"))
    shutil.copyfile(os.path.join(other, "c/1/1"), os.path.join(uri, "c/1/1"))
    arr = stoker.open_array(uri)
    expect_error(uri, stoker.DecodeError, lambda: arr.read([(20, 21), (20, 21)]), uri, "'c/1/1'",
                 "decodes to more than the 512 bytes")


# ---------------------------------------------------------------------------------------------
# shards


def make_sharded(path, *, index_location="end", data=None, fill_value=0):
    """(32, 32) uint16 in (16, 16) shards of (8, 8) inner chunks (4 inner per shard)."""
    data = payload() if data is None else data
    arr = zarr.create_array(
        os.fspath(path), shape=data.shape, dtype=data.dtype, chunks=(16, 16), fill_value=fill_value,
        serializer=ShardingCodec(
            chunk_shape=(8, 8), codecs=[BytesCodec(), ZstdCodec()], index_location=index_location
        ),
        compressors=None, filters=None,
    )
    arr[...] = data
    return data


INDEX_NBYTES = 4 * 16 + 4  # 4 inner chunks of (offset, nbytes) uint64, then crc32c


@pytest.mark.parametrize("where", ["end", "start"])
@pytest.mark.parametrize("pos", [0, 17, INDEX_NBYTES - 5, INDEX_NBYTES - 1])
def test_shard_index_bad_crc(tmp_path, where, pos):
    uri = str(tmp_path / "s.zarr")
    data = make_sharded(uri, index_location=where)
    shard = os.path.join(uri, "c/0/1")
    raw = open(shard, "rb").read()
    start = 0 if where == "start" else len(raw) - INDEX_NBYTES
    rewrite(shard, _flip(raw, start + pos, 0x04))
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 4), (20, 24)]), uri, "'c/0/1'", "index")
    assert err.key == "c/0/1"
    # Other shards are not affected.
    np.testing.assert_array_equal(arr.read([(16, 32), (0, 32)]), data[16:])


@pytest.mark.parametrize("where", ["end", "start"])
def test_shard_shorter_than_its_index_claims(tmp_path, where):
    """Bytes cut from the data region; the index survives intact (and its CRC is valid)."""
    uri = str(tmp_path / "s.zarr")
    make_sharded(uri, index_location=where)
    shard = os.path.join(uri, "c/0/0")
    raw = open(shard, "rb").read()
    if where == "end":
        body, index = raw[:-INDEX_NBYTES], raw[-INDEX_NBYTES:]
        cut = body[: len(body) // 4] + body[len(body) // 2:] + index  # a hole in the middle
    else:
        cut = raw[: INDEX_NBYTES + (len(raw) - INDEX_NBYTES) // 2]  # data region loses its tail
    assert len(cut) > INDEX_NBYTES
    rewrite(shard, cut)
    arr = stoker.open_array(uri)
    expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 1), (0, 1)]), uri, "'c/0/0'",
                 "shorter than its index claims")


def test_shard_index_with_valid_crc_pointing_past_eof(tmp_path):
    """A crafted index whose checksum is right but whose entries lie: bounds are still checked."""
    uri = str(tmp_path / "s.zarr")
    make_sharded(uri)
    shard = os.path.join(uri, "c/1/1")
    raw = open(shard, "rb").read()
    index = np.frombuffer(raw[-INDEX_NBYTES:-4], dtype="<u8").reshape(4, 2).copy()
    crc = numcodecs.CRC32C(location="end")
    for bad_entry in ([len(raw) - 10, 64], [2**64 - 1, 5], [2**63, 2**63]):
        lying = index.copy()
        lying[3] = bad_entry
        rewrite(shard, raw[:-INDEX_NBYTES] + bytes(crc.encode(lying.astype("<u8").tobytes())))
        arr = stoker.open_array(uri)
        expect_error(uri, stoker.DecodeError, lambda: arr.read([(16, 17), (16, 17)]), uri, "'c/1/1'")


@pytest.mark.parametrize("where", ["end", "start"])
@pytest.mark.parametrize("size", [0, 1, INDEX_NBYTES - 1])
def test_shard_shorter_than_index_itself(tmp_path, where, size):
    uri = str(tmp_path / "s.zarr")
    make_sharded(uri, index_location=where)
    shard = os.path.join(uri, "c/1/0")
    rewrite(shard, open(shard, "rb").read()[:size])
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(16, 32), (0, 16)]), uri, "'c/1/0'",
                       "truncated")
    assert err.key == "c/1/0"


def test_corrupt_inner_chunk_names_shard_and_inner_chunk(tmp_path):
    uri = str(tmp_path / "s.zarr")
    make_sharded(uri)
    shard = os.path.join(uri, "c/0/0")
    arr = stoker.open_array(uri)
    offset, nbytes = (int(v) for v in arr.shard_index("c/0/0")[1])
    raw = open(shard, "rb").read()
    rewrite(shard, _clobber(raw, offset, offset + 4, 0))  # zstd magic of inner chunk 1
    arr = stoker.open_array(uri)
    err = expect_error(uri, stoker.DecodeError, lambda: arr.read([(0, 8), (8, 16)]), uri, "c/0/0[1]")
    assert err.key == "c/0/0[1]"
    # Inner chunk 0 of the same shard is intact.
    np.testing.assert_array_equal(arr.read([(0, 8), (0, 8)]), zarr.open_array(uri)[0:8, 0:8])


# ---------------------------------------------------------------------------------------------
# metadata


def test_invalid_json_zarr_json(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    meta = os.path.join(uri, "zarr.json")
    rewrite(meta, open(meta, "rb").read()[:-10])
    err = expect_error(uri, stoker.MetadataError, lambda: stoker.open_array(uri), uri, "zarr.json", "JSON")
    assert isinstance(err, stoker.DecodeError) and err.uri == uri


def test_invalid_json_zarray(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 2)
    rewrite(os.path.join(uri, ".zarray"), b'{"shape": [32, 32], "chunks": ')
    err = expect_error(uri, stoker.MetadataError, lambda: stoker.open_array(uri), uri, ".zarray")
    assert isinstance(err, stoker.DecodeError)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"[1, 2, 3]", b"null", b""])
def test_metadata_not_an_object(tmp_path, content):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    rewrite(os.path.join(uri, "zarr.json"), content)
    expect_error(uri, stoker.MetadataError, lambda: stoker.open_array(uri), uri, "zarr.json")


@pytest.mark.parametrize("field,value", [("shape", None), ("shape", [32, -1]), ("shape", "32"),
                                         ("chunks", [0, 16]), ("chunks", [16])])
def test_v2_metadata_contradictions(tmp_path, field, value):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 2)
    edit_json(os.path.join(uri, ".zarray"), lambda d: d.__setitem__(field, value))
    expect_error(uri, stoker.MetadataError, lambda: stoker.open_array(uri), uri)


@pytest.mark.parametrize("place", ["after_bytes", "array_to_array", "inside_shard"])
def test_unknown_v3_codec(tmp_path, place):
    uri = str(tmp_path / "a.zarr")
    if place == "inside_shard":
        make_sharded(uri)
    else:
        make_array(uri, 3)

    def change(doc):
        codecs = doc["codecs"]
        if place == "after_bytes":
            codecs.append({"name": "lzma9000", "configuration": {"level": 9}})
        elif place == "array_to_array":
            codecs.insert(0, {"name": "lzma9000"})
        else:
            codecs[0]["configuration"]["codecs"].append({"name": "lzma9000"})

    edit_json(os.path.join(uri, "zarr.json"), change)
    err = expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "lzma9000")
    assert err.codec == "lzma9000"


@pytest.mark.parametrize("field", ["compressor", "filters"])
def test_unknown_v2_compressor_or_filter(tmp_path, field):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 2)
    bogus = {"id": "lzma9000", "level": 3}
    edit_json(os.path.join(uri, ".zarray"),
              lambda d: d.__setitem__(field, bogus if field == "compressor" else [bogus]))
    err = expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "lzma9000")
    assert err.codec == "lzma9000"


@pytest.mark.parametrize("dtype", ["<U4", "|S8", "|O", "<M8[ns]", "|V8",
                                   [["a", "<i4"], ["b", "<f8"]], "not-a-dtype"])
def test_unsupported_v2_dtype(tmp_path, dtype):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 2)
    edit_json(os.path.join(uri, ".zarray"), lambda d: d.__setitem__("dtype", dtype))
    expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "dtype")


@pytest.mark.parametrize("dtype", ["string", "float8", {"name": "numpy.datetime64", "configuration": {}}])
def test_unsupported_v3_data_type(tmp_path, dtype):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    edit_json(os.path.join(uri, "zarr.json"), lambda d: d.__setitem__("data_type", dtype))
    expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "data_type")


def test_rectilinear_chunk_grid(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    edit_json(os.path.join(uri, "zarr.json"), lambda d: d.__setitem__(
        "chunk_grid", {"name": "rectilinear", "configuration": {"chunk_shapes": [[16, 16], [8, 24]]}}))
    err = expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "rectilinear")
    assert err.grid == "rectilinear"


def test_storage_transformers(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    edit_json(os.path.join(uri, "zarr.json"),
              lambda d: d.__setitem__("storage_transformers", [{"name": "sharding_v0"}]))
    expect_error(uri, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri, "storage transformers")


@pytest.mark.parametrize("kind", ["empty_dir", "nonexistent", "nested_nonexistent", "regular_file"])
def test_missing_metadata(tmp_path, kind):
    uri = str(tmp_path / "a.zarr")
    if kind == "empty_dir":
        os.mkdir(uri)
    elif kind == "nested_nonexistent":
        uri = str(tmp_path / "no" / "such" / "a.zarr")
    elif kind == "regular_file":
        rewrite(uri, b"not a directory")
    err = expect_error(tmp_path, stoker.NotFound, lambda: stoker.open_array(uri), uri)
    assert isinstance(err, FileNotFoundError)
    assert err.uri == uri


def test_missing_metadata_via_pathlike_and_file_uri(tmp_path):
    target = tmp_path / "nothing.zarr"
    err = expect_error(tmp_path, stoker.NotFound, lambda: stoker.open_array(target), str(target))
    assert isinstance(err, FileNotFoundError)
    uri = "file://" + str(target)
    expect_error(tmp_path, stoker.NotFound, lambda: stoker.open_array(uri), uri)


@pytest.mark.parametrize("fmt", [2, 3])
def test_group_is_not_an_array(tmp_path, fmt):
    uri = str(tmp_path / "g.zarr")
    group = zarr.open_group(uri, mode="w", zarr_format=fmt)
    group.create_array("child", shape=(4,), dtype="u1", fill_value=3)
    err = expect_error(uri, stoker.InvalidArgument, lambda: stoker.open_array(uri), uri, "group")
    assert isinstance(err, ValueError)
    # ... while its array opens fine.
    np.testing.assert_array_equal(stoker.open_array(os.path.join(uri, "child")).read([(0, 4)]), [3, 3, 3, 3])


def test_v3_metadata_with_wrong_zarr_format(tmp_path):
    uri = str(tmp_path / "a.zarr")
    make_array(uri, 3)
    edit_json(os.path.join(uri, "zarr.json"), lambda d: d.__setitem__("zarr_format", 2))
    expect_error(uri, stoker.MetadataError, lambda: stoker.open_array(uri), uri, "zarr_format")


# ---------------------------------------------------------------------------------------------
# boxes


@pytest.fixture
def small_array(tmp_path):
    uri = str(tmp_path / "box.zarr")
    data = make_array(uri, 3, "zstd", shape=(10, 20), chunks=(4, 8))
    return uri, stoker.open_array(uri), data


@pytest.mark.parametrize("box,axis", [
    ([(0, 11), (0, 20)], 0),
    ([(0, 10), (0, 21)], 1),
    ([(10, 12), (0, 1)], 0),
    ([(0, 1), (30, 40)], 1),
    ((slice(0, 11), slice(None)), 0),
    (np.s_[0:4, 5:100], 1),
])
def test_out_of_bounds_names_axis(small_array, box, axis):
    uri, arr, _ = small_array
    err = expect_error(uri, stoker.OutOfBounds, lambda: arr.read(box), uri, f"axis {axis}")
    assert isinstance(err, stoker.InvalidArgument) and isinstance(err, ValueError) and isinstance(err, IndexError)
    assert err.axis == axis and err.uri == uri


@pytest.mark.parametrize("box", [[(2**64, 2**64 + 1), (2, 6)], [(2**63, 2**63 + 1), (2, 6)], [(0, 2**63), (2, 6)],
                                 [(0, 2**40), (2, 6)], [(3, 4), (2**70, 2**70 + 4)]])
def test_a_pipeline_sample_of_huge_bounds_is_out_of_bounds(small_array, box):
    # past int64 the bounds cannot be planned, and a huge box is over any budget: it is past its array first
    uri, _, _ = small_array
    cfg = stoker.Config(batch_size=1, dtype="native", device="cpu", host_buffer_bytes=64 << 20, pop_timeout_s=20)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box)])
        with pytest.raises(stoker.OutOfBounds) as err:
            p.pop()
    assert err.value.uri == uri and err.value.axis == (1 if box[1][0] > 20 else 0)


@pytest.mark.parametrize("box", [[(0, 1)], [(0, 1), (0, 1), (0, 1)], [], np.s_[0:1], (slice(0, 1),) * 4])
def test_wrong_rank(small_array, box):
    uri, arr, _ = small_array
    err = expect_error(uri, stoker.RankMismatch, lambda: arr.read(box), uri, "axes")
    assert isinstance(err, stoker.InvalidArgument)


@pytest.mark.parametrize("box,axis,needle", [
    ([(-1, 3), (0, 4)], 0, "negative"),
    ([(0, 3), (-5, -1)], 1, "negative"),
    ([(5, 3), (0, 4)], 0, "start <= stop"),
    ([(0, 3), (4, 2)], 1, "start <= stop"),
    ([(0, 4), 3], 1, "bare integer"),
    ([2, (0, 4)], 0, "bare integer"),
    ((slice(0, 4, 2), slice(0, 4)), 0, "step"),
    (np.s_[0:4, ::2], 1, "step"),
    (np.s_[0:4, ::-1], 1, "step"),
    ([(0, 4), (0, 2, 4)], 1, "pair"),
    ([(0, 4), (0.5, 2)], 1, "integer"),
    ([(0, 4), "ab"], 1, "pair"),
    ([(0, 4), None], 1, "pair"),
])
def test_invalid_box(small_array, box, axis, needle):
    uri, arr, _ = small_array
    err = expect_error(uri, stoker.InvalidArgument, lambda: arr.read(box), uri, f"axis {axis}", needle)
    assert isinstance(err, ValueError)
    assert not isinstance(err, (stoker.OutOfBounds, stoker.RankMismatch))


def test_valid_boxes_still_work(small_array):
    uri, arr, data = small_array
    np.testing.assert_array_equal(arr.read([(0, 10), (0, 20)]), data)
    np.testing.assert_array_equal(arr.read(np.s_[3:7, 5:17]), data[3:7, 5:17])
    np.testing.assert_array_equal(arr.read((slice(None), slice(19, None))), data[:, 19:])
    assert arr.read([(4, 4), (0, 20)]).shape == (0, 20)
    assert arr.read([(10, 10), (20, 20)]).shape == (0, 0)
    np.testing.assert_array_equal(arr.read([(np.int64(1), np.int32(2)), (0, 20)]), data[1:2])


# ---------------------------------------------------------------------------------------------
# URIs


# (remote URIs, s3:// gs:// az:// http(s)://, are read through stores: tests/storage/test_remote_arrays.py)
@pytest.mark.parametrize("uri", ["ftp://host/a.zarr", "file://otherhost/data/a.zarr"])
def test_unknown_uri(tmp_path, uri):
    err = expect_error(tmp_path, stoker.UnsupportedFormat, lambda: stoker.open_array(uri), uri)
    assert err.uri == uri


def test_file_uri_opens(tmp_path):
    uri = str(tmp_path / "a.zarr")
    data = make_array(uri, 2, "gzip")
    np.testing.assert_array_equal(read_all("file://" + uri), data)


# ---------------------------------------------------------------------------------------------
# absent data reads as the fill value (positive cases, checked against zarr)


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("fill", [7, 0])
def test_missing_chunks_read_as_fill(tmp_path, fmt, fill):
    uri = str(tmp_path / "a.zarr")
    data = np.full(SHAPE, fill, dtype="u2")
    data[0:16, 0:16] = payload(shape=(16, 16))
    data[16:20, 16:20] = 3
    make_array(uri, fmt, "zstd", data=data, fill_value=fill)
    # zarr did not write the chunks that hold only the fill value...
    assert not os.path.exists(os.path.join(uri, "0.1" if fmt == 2 else "c/0/1"))
    # ... and we remove one more by hand.
    os.remove(os.path.join(uri, "1.1" if fmt == 2 else "c/1/1"))
    expected = zarr.open_array(uri)[...]
    assert (expected[16:, 16:] == fill).all()
    before = snapshot(uri)
    arr = stoker.open_array(uri)
    np.testing.assert_array_equal(arr.read([(0, 32), (0, 32)]), expected)
    np.testing.assert_array_equal(arr.read([(10, 30), (5, 31)]), expected[10:30, 5:31])
    assert snapshot(uri) == before


def test_float_nan_fill_for_missing_chunk(tmp_path):
    uri = str(tmp_path / "a.zarr")
    data = np.full(SHAPE, np.nan, dtype="f4")
    data[:16, :16] = 1.5
    make_array(uri, 3, "gzip", data=data, fill_value=np.nan)
    assert not os.path.exists(os.path.join(uri, "c/1/1"))
    got = read_all(uri)
    np.testing.assert_array_equal(got, zarr.open_array(uri)[...])  # NaN == NaN here
    assert np.isnan(got[16:, 16:]).all() and (got[:16, :16] == 1.5).all()


def test_missing_shard_and_empty_index_entries_read_as_fill(tmp_path):
    uri = str(tmp_path / "s.zarr")
    data = np.full(SHAPE, 9, dtype="u2")
    data[0:8, 0:8] = payload(shape=(8, 8))  # inner chunk 0 of shard (0, 0) only
    data[28:30, 10:14] = 1  # inner chunk 3 of shard (1, 0), partially
    make_sharded(uri, data=data, fill_value=9)
    assert not os.path.exists(os.path.join(uri, "c/0/1"))  # all-fill shards are not written
    assert not os.path.exists(os.path.join(uri, "c/1/1"))
    arr = stoker.open_array(uri)

    def empty_entries(shard_key):
        index = arr.shard_index(shard_key)
        return ((index[:, 0] == EMPTY) & (index[:, 1] == EMPTY)).tolist()

    assert empty_entries("c/0/0") == [False, True, True, True]  # the cases under test really exist
    assert empty_entries("c/1/0") == [True, True, True, False]
    assert arr.shard_index("c/1/1") is None
    before = snapshot(uri)
    expected = zarr.open_array(uri)[...]
    np.testing.assert_array_equal(expected, data)
    np.testing.assert_array_equal(arr.read([(0, 32), (0, 32)]), expected)
    np.testing.assert_array_equal(arr.read([(5, 27), (3, 30)]), expected[5:27, 3:30])
    assert snapshot(uri) == before
    # A whole shard deleted by hand reads as fill as well.
    os.remove(os.path.join(uri, "c/1/0"))
    arr = stoker.open_array(uri)
    np.testing.assert_array_equal(arr.read([(16, 32), (0, 16)]), np.full((16, 16), 9, "u2"))
    np.testing.assert_array_equal(arr.read([(16, 32), (0, 16)]), zarr.open_array(uri)[16:, :16])
