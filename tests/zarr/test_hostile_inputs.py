"""Hostile inputs: small files that would cost gigabytes end in their typed error within a memory bound.

Each case writes a real array with zarr-python, replaces one chunk with hostile bytes (a decompression
bomb of every codec the Python path decodes, a blosc header that lies, a sparse 3 GiB chunk file, a shard
index claiming a 3 GiB inner chunk), then reads it in a child process: through ``open_array(...).read``,
a Pipeline (compiled reader on and off) or ``stoker inspect``. The child reports the error it got and
its peak RSS growth over the hostile read alone (``/proc/self/clear_refs`` resets the peak first), with
its address space capped so that a regression fails the test rather than the machine.

Bombs decode to 128 MiB (:data:`BOMB`); a bounded read of these 512 KiB chunks grows by far less than
:data:`GROWTH_LIMIT`. They are built without holding their decoded size in memory: stdlib streaming
compressors, and zstd, lz4 and blosc frames assembled from their documented formats (each checked
against numcodecs at a small size).
"""

from __future__ import annotations

import bz2
import functools
import json
import lzma
import os
import struct
import subprocess
import sys
import zlib

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.zarr.codecs import bounds as bounded

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc (Linux)"),
]

BOMB = 128 << 20  # what each bomb decodes to
GROWTH_LIMIT = 32 << 20  # peak RSS growth allowed for one hostile read (the chunks hold 512 KiB)
SPARSE = 3 << 30  # a sparse chunk file, or the inner chunk a shard index claims
# Four 512 KiB chunks: every bomb is stored in fewer bytes than such a chunk may take (max_stored_nbytes,
# 584 KiB), so it is the decoder's bound that stops it, not the stored-size check (an lz4 block expands
# at most 255-fold, deflate about 1000-fold).
SHAPE, CHUNKS, DTYPE = (1024, 1024), (512, 512), "uint16"
GOOD, BAD = [(512, 520), (512, 520)], [(0, 8), (0, 8)]  # a box in an intact chunk, one in the hostile chunk


# ---------------------------------------------------------------------------------------------
# bombs


def _streamed(compressor, n: int = BOMB, piece: int = 1 << 20) -> bytes:
    """``n`` zero bytes through a stdlib streaming compressor, ``piece`` bytes at a time."""
    zeros = bytes(piece)
    return b"".join(compressor.compress(zeros) for _ in range(n // piece)) + compressor.flush()


def zstd_frame(n: int, content_size: bool) -> bytes:
    """One zstd frame of ``n`` zero bytes in RLE blocks of 128 KiB (RFC 8878, 3.1.1), stating its content
    size in the header or not (as streaming compressors write it)."""
    block = 128 << 10
    header = (0xFD2FB528).to_bytes(4, "little")
    header += bytes([0xC0 if content_size else 0x00, (17 - 10) << 3])  # descriptor; window 2**17
    if content_size:
        header += n.to_bytes(8, "little")
    blocks = []
    for start in range(0, n, block):
        size = min(block, n - start)
        last = start + size == n
        blocks.append((last | 1 << 1 | size << 3).to_bytes(3, "little") + b"\0")  # RLE block of zeros
    return header + b"".join(blocks)


def lz4_bomb(n: int) -> bytes:
    """numcodecs' LZ4 framing (4-byte decoded size) around one LZ4 block of ``n`` zero bytes: a literal,
    one long match at offset 1, and the five closing literals the format requires."""
    match = n - 1 - 5
    extra = match - 4 - 15
    length = b"\xff" * (extra // 255) + bytes([extra % 255])
    block = bytes([1 << 4 | 15]) + b"\0" + (1).to_bytes(2, "little") + length + bytes([5 << 4]) + bytes(5)
    return n.to_bytes(4, "little") + block


def blosc_bomb(n: int) -> bytes:
    """A blosc1 frame of ``n`` bytes whose block table points every block at the same compressed block:
    a frame numcodecs decodes, ``n / 256 KiB`` times smaller than its content."""
    blocksize = 256 << 10
    one = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=0, blocksize=blocksize).encode(bytes(blocksize))
    (first,) = struct.unpack_from("<i", one, 16)
    data = one[first:]
    nblocks = n // blocksize
    table_end = 16 + 4 * nblocks
    header = one[:4] + struct.pack("<III", n, blocksize, table_end + len(data))
    return header + struct.pack(f"<{nblocks}i", *[table_end] * nblocks) + data


@functools.cache
def bomb(name: str) -> bytes:
    """The hostile chunk bytes of each codec (built once per session)."""
    eighth = BOMB // 8  # stream formats that concatenate: one stream repeated, as their readers allow
    if name == "zstd":
        return zstd_frame(BOMB, content_size=True)
    if name == "zstd-unsized":
        return zstd_frame(BOMB, content_size=False)
    if name == "lz4":
        return lz4_bomb(BOMB)
    if name == "blosc":
        return blosc_bomb(BOMB)
    if name == "gzip":
        return _streamed(zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), eighth) * 8
    if name == "zlib":
        return _streamed(zlib.compressobj(9))
    if name == "bz2":
        return _streamed(bz2.BZ2Compressor(9), eighth) * 8
    if name == "lzma":
        return _streamed(lzma.LZMACompressor(preset=0), eighth) * 8
    raise KeyError(name)


def test_bomb_builders_make_what_numcodecs_decodes(tmp_path):
    """The hand-assembled frames are valid: numcodecs decodes small ones to zeros of the stated size."""
    n = 1 << 20
    for frame in (zstd_frame(n, True), zstd_frame(n, False)):
        assert numcodecs.Zstd().decode(frame) == bytes(n)
    assert numcodecs.LZ4().decode(lz4_bomb(n)) == bytes(n)
    assert numcodecs.Blosc().decode(blosc_bomb(n)) == bytes(n)
    limit = stoker.open_array(_v2(tmp_path / "a.zarr", numcodecs.LZ4())).metadata.codec.max_stored_nbytes
    for name in ("zstd", "zstd-unsized", "lz4", "blosc", "gzip", "zlib", "bz2", "lzma"):
        assert len(bomb(name)) < limit, name  # the decoder's bound is what stops it


# ---------------------------------------------------------------------------------------------
# arrays with one hostile chunk


def _v2(path, compressor, filters=None) -> str:
    z = zarr.create_array(str(path), shape=SHAPE, chunks=CHUNKS, dtype=DTYPE, zarr_format=2,
                          compressors=compressor, filters=filters)
    z[...] = np.arange(np.prod(SHAPE), dtype=DTYPE).reshape(SHAPE)
    return str(path)


def _sharded(path) -> str:
    z = zarr.create_array(str(path), shape=SHAPE, chunks=SHAPE, dtype=DTYPE, zarr_format=3, filters=None,
                          compressors=None,
                          serializer=ShardingCodec(chunk_shape=CHUNKS, codecs=[BytesCodec(), ZstdCodec(level=1)]))
    z[...] = np.arange(np.prod(SHAPE), dtype=DTYPE).reshape(SHAPE)
    return str(path)


def _rewrite_shard(shard: str, first: bytes | None, first_length: int | None = None) -> None:
    """Rewrite a one-shard array's shard: inner chunk 0 becomes ``first`` (or ``first_length`` bytes of a
    sparse hole), the other inner chunks keep their bytes; the index (at the end, crc32c) says so."""
    raw = open(shard, "rb").read()
    n_inner = 4
    index = np.frombuffer(raw[-(16 * n_inner + 4):-4], dtype="<u8").reshape(n_inner, 2)
    others = [raw[o:o + n] for o, n in index[1:]]
    entries, body = [], b""
    for chunk in others:
        entries.append((len(body), len(chunk)))
        body += chunk
    if first is not None:
        entries.insert(0, (len(body), len(first)))
        body += first
    else:
        entries.insert(0, (len(body), first_length))
    table = numcodecs.CRC32C(location="end").encode(np.array(entries, dtype="<u8").tobytes())
    with open(shard, "wb") as f:
        f.write(body)
        f.truncate(entries[0][0] + entries[0][1])  # a hole where a claimed inner chunk would be
        f.seek(0, os.SEEK_END)
        f.write(table)


def make_case(name: str, root) -> str:
    """The array of case ``name`` under ``root``, its chunk (0, 0) replaced."""
    path = root / "a.zarr"
    if name == "sharded-zstd":
        uri = _sharded(path)
        _rewrite_shard(os.path.join(uri, "c", "0", "0"), bomb("zstd"))
        return uri
    if name == "shard-index-3GiB":
        uri = _sharded(path)
        _rewrite_shard(os.path.join(uri, "c", "0", "0"), None, SPARSE)
        return uri
    if name == "sparse-3GiB":
        uri = _v2(path, numcodecs.Zstd(level=1))
        os.truncate(os.path.join(uri, "0.0"), SPARSE)
        return uri
    codec, filters = {
        "zstd": (numcodecs.Zstd(level=1), None),
        "zstd-unsized": (numcodecs.Zstd(level=1), None),
        "lz4": (numcodecs.LZ4(), None),
        "blosc": (numcodecs.Blosc(cname="lz4", shuffle=0), None),
        "gzip": (numcodecs.GZip(level=1), None),
        "zlib": (numcodecs.Zlib(level=1), None),
        "zlib-with-filter": (numcodecs.Zlib(level=1), [numcodecs.Delta(dtype="<u2", astype="<u4")]),
        "zstd-as-filter": (None, [numcodecs.Zstd(level=1)]),  # any numcodecs codec may be a v2 filter
        "bz2": (numcodecs.BZ2(level=1), None),
        "lzma": (numcodecs.LZMA(preset=0), None),
    }[name]
    uri = _v2(path, codec, filters)
    with open(os.path.join(uri, "0.0"), "wb") as f:
        f.write(bomb(name.split("-with-")[0].split("-as-")[0]))
    return uri


# ---------------------------------------------------------------------------------------------
# the child: read once to warm up, then the hostile box, and report


CHILD = r"""
import json, os, resource, sys
how, uri, good, bad = json.loads(sys.argv[1])
import stoker

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

if how == "read":
    arr = stoker.open_array(uri)
    run = arr.read
elif how == "inspect":
    from stoker.cli.inspect import describe
    run = lambda box: describe(uri, None if box is good else tuple(b - a for a, b in box))
else:
    p = stoker.Pipeline(stoker.Config(batch_size=1, dtype="f32", device="cpu", n_compute_threads=2,
                                      pop_timeout_s=30.0))
    def run(box):
        p.push([stoker.Sample(uri, box)])
        with p.pop():
            pass
run(good)  # imports, threads, pools, the shard index: what any read costs
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (2 << 30), resource.RLIM_INFINITY))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from here
base = status("VmRSS")
try:
    run(bad)
    error = None
except BaseException as exc:
    error = [type(exc).__name__, str(exc)]
print(json.dumps({"error": error, "growth": status("VmHWM") - base}))
sys.stdout.flush()
os._exit(0)
"""


def run_child(how: str, uri: str, native: bool = True) -> dict:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(stoker.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    if not native:
        env["STOKER_NATIVE"] = "0"
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([how, uri, GOOD, BAD])], env=env,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BOMBS = ["zstd", "zstd-unsized", "lz4", "blosc", "gzip", "zlib", "zlib-with-filter", "zstd-as-filter", "bz2", "lzma",
         "sharded-zstd"]

# (case, how): every read that decoded a bomb whole or read a file whole before the decoders were bounded,
# and two that were bounded already (the compiled reader's zstd, the Python path's partial blosc decode)
CASES = (
    [(name, "read") for name in BOMBS]
    + [(name, "pipeline-python") for name in ("zstd", "zstd-unsized", "blosc", "sharded-zstd")]
    + [(name, "pipeline") for name in ("zstd", "sharded-zstd")]
    + [(name, how) for name in ("sparse-3GiB", "shard-index-3GiB")
       for how in ("read", "pipeline-python", "pipeline", "inspect")]
)


def expected_words(case: str, how: str) -> str:
    """What the error must say: the bound it stopped at, or the two sizes of a chunk refused unread.
    (The compiled reader words its own refusals of a zstd frame; blosc's partial decode, which checks
    the header against the chunk, too.)"""
    if case in ("sparse-3GiB", "shard-index-3GiB"):
        return f"stored in {SPARSE} bytes"
    if how == "read" or how == "pipeline-python" and case != "blosc" or case == "sharded-zstd":
        return "decodes to more than"
    return ""


@pytest.mark.parametrize("case,how", CASES, ids=[f"{c}-{h}" for c, h in CASES])
def test_hostile_chunk_is_a_decode_error_within_bounded_memory(tmp_path, case, how):
    uri = make_case(case, tmp_path)
    got = run_child(how.split("-")[0], uri, native=how != "pipeline-python")
    assert got["error"] is not None, f"{case} read without an error"
    kind, message = got["error"]
    assert kind == "DecodeError", message
    assert "'c/0/0" in message or "'0.0'" in message, message  # the chunk (or inner chunk) is named
    assert expected_words(case, how) in message, message
    assert got["growth"] < GROWTH_LIMIT, f"peak RSS grew by {got['growth'] / 2**20:.0f} MiB: {message}"


# ---------------------------------------------------------------------------------------------
# the bounded decoders read what numcodecs reads


def _valid_inputs():
    """Valid stored bytes of each codec, including the rarer shapes the one-shot readers accept."""
    data = np.arange(3000, dtype="<u2").tobytes()
    gz = numcodecs.GZip(level=1).encode(data)
    half = len(data) // 2
    two_members = numcodecs.GZip().encode(data[:half]) + numcodecs.GZip().encode(data[half:])
    return data, [
        (numcodecs.Zstd(level=1), numcodecs.Zstd(level=1).encode(data)),
        (numcodecs.Zstd(level=1), zstd_frame(len(data), content_size=False)),  # zeros, size not stated
        (numcodecs.LZ4(), numcodecs.LZ4().encode(data)),
        (numcodecs.Blosc(cname="zstd", shuffle=1), numcodecs.Blosc(cname="zstd", shuffle=1).encode(data)),
        (numcodecs.GZip(), gz),
        (numcodecs.GZip(), two_members),  # gzip members one after the other
        (numcodecs.GZip(), gz + bytes(7)),  # zero padding after the last member
        (numcodecs.Zlib(), numcodecs.Zlib().encode(data) + b"junk"),  # bytes after the stream: ignored
        (numcodecs.BZ2(), bz2.compress(data[:half]) + bz2.compress(data[half:]) + b"junk"),
        (numcodecs.LZMA(), lzma.compress(data[:half]) + lzma.compress(data[half:])),
        (numcodecs.LZMA(format=lzma.FORMAT_ALONE), lzma.compress(data, format=lzma.FORMAT_ALONE)),
    ]


def test_bounded_decoders_agree_with_numcodecs_and_stop_one_byte_over():
    for codec, stored in _valid_inputs()[1]:
        expected = bytes(numcodecs.compat.ensure_bytes(codec.decode(stored)))
        n = len(expected)
        assert bytes(bounded.decoder(codec, n)(stored)) == expected, codec
        assert bytes(bounded.decoder(codec, 2 * n + 100)(stored)) == expected, codec  # a loose bound
        with pytest.raises(bounded.TooLarge):
            bounded.decoder(codec, n - 1)(stored)
        assert len(stored) <= bounded.encoded_bound(codec, n)


@pytest.mark.parametrize("stored", [b"", b"\x28\xb5\x2f\xfd", b"not a frame at all", bytes(64)])
@pytest.mark.parametrize("name", ["zstd", "lz4", "blosc", "gzip", "zlib", "bz2", "lzma"])
def test_garbage_is_a_decode_error_of_each_codec(tmp_path, name, stored):
    uri = _v2(tmp_path / "a.zarr", numcodecs.get_codec({"id": name}))
    open(os.path.join(uri, "0.0"), "wb").write(stored)
    with pytest.raises(stoker.DecodeError, match="'0.0'"):
        stoker.open_array(uri).read([(0, 1), (0, 1)])


def _v2_filtered(path, dtype, filters, compressor):
    data = (np.arange(64 * 48).reshape(64, 48) % 200).astype(dtype)
    z = zarr.create_array(str(path), shape=data.shape, chunks=(32, 16), dtype=dtype, zarr_format=2,
                          filters=filters, compressors=compressor)
    z[...] = data
    return str(path), data


@pytest.mark.parametrize("filters,dtype", [
    ([numcodecs.Delta(dtype="<u2", astype="<u8")], "<u2"),  # the filter's output is 4x the chunk
    ([numcodecs.FixedScaleOffset(offset=0, scale=1, dtype="<f8", astype="<u1")], "<f8"),  # 1/8 of it
    ([numcodecs.AsType(encode_dtype="<f8", decode_dtype="<f4")], "<f4"),
])
@pytest.mark.parametrize("compressor", [numcodecs.Zstd(level=1), numcodecs.GZip(level=1), numcodecs.BZ2(level=1)])
def test_filters_that_change_the_size_read_as_zarr_does(tmp_path, filters, dtype, compressor):
    """With v2 filters the decoders are bounded by the element count, not the chunk's bytes: real chunks
    whose compressor output is larger or smaller than the chunk still read bit for bit."""
    uri, data = _v2_filtered(tmp_path / "a.zarr", dtype, filters, compressor)
    np.testing.assert_array_equal(stoker.open_array(uri).read([(0, 64), (0, 48)]), zarr.open_array(uri)[...])


def test_zstd_frame_without_its_size_reads_exactly(tmp_path):
    """A frame that does not state its content size (streaming compressors write these) is decoded into the
    chunk's bound: exact size reads, with and without filters; one byte more is refused."""
    uri = _v2(tmp_path / "a.zarr", numcodecs.Zstd(level=1))
    filtered, _ = _v2_filtered(tmp_path / "f.zarr", "<u2", [numcodecs.Delta(dtype="<u2")], numcodecs.Zstd(level=1))
    nbytes = 512 * 512 * 2
    open(os.path.join(uri, "0.0"), "wb").write(zstd_frame(nbytes, content_size=False))
    assert not stoker.open_array(uri).read([(0, 512), (0, 512)]).any()
    open(os.path.join(filtered, "0.0"), "wb").write(zstd_frame(32 * 16 * 2, content_size=False))
    assert not stoker.open_array(filtered).read([(0, 32), (0, 16)]).any()  # Delta of zeros is zeros
    open(os.path.join(uri, "0.0"), "wb").write(zstd_frame(nbytes + 1, content_size=False))
    with pytest.raises(stoker.DecodeError, match=f"decodes to more than the {nbytes} bytes"):
        stoker.open_array(uri).read([(0, 1), (0, 1)])


def test_checksum_after_a_compressor_reads(tmp_path):
    """v3 zstd then crc32c: the checksum stage is bounded by what zstd can store, and reads."""
    from zarr.codecs import Crc32cCodec

    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=(64, 64), chunks=(32, 32), dtype="uint16",
                          compressors=[ZstdCodec(level=1), Crc32cCodec()])
    z[...] = np.arange(64 * 64, dtype="uint16").reshape(64, 64)
    arr = stoker.open_array(tmp_path / "a.zarr")
    np.testing.assert_array_equal(arr.read([(0, 64), (0, 64)]), z[...])
    codec = arr.metadata.codec
    assert codec.max_stored_nbytes == bounded.encoded_bound(codec.compressors[0], codec.nbytes) + 4
