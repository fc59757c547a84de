"""Fuzzing the compiled reader (``stoker._native``): its zstd and blosc frame parsers and its copy-plan parser.

Frames come from numcodecs (valid, with every option that changes their layout), are built by hand
(zstd frames of raw and RLE blocks with every header variant), are damaged (bit flips, overwritten
bytes and header fields, truncation, extension, splices, block headers with sizes past the file), or
are random bytes; each is read as a whole chunk file and as an inner chunk of a shard at an offset.
Every case must end in a status or a ``ValueError``, never in a fault or a write outside the buffers
handed in (each sits between guard bytes; ``.ci/asan`` runs this file against a build with
AddressSanitizer, where a read out of bounds is a fault too). Where a frame decodes in numcodecs,
the bytes the compiled reader returns equal numcodecs' decode; a frame built valid must be read.

Budget: a few hundred examples per test from a fixed seed, so ``make test`` is quick and repeatable;
``STOKER_FUZZ_EXAMPLES=N`` runs N examples per test from a random seed (``make asan`` does; a failure
prints the blob that replays it with ``@reproduce_failure``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import platform
import sys
import textwrap
import time
from array import array

import crc32c
import numcodecs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from stoker.engine.cpu import native
import native_testing
import preload_shim
from stoker.storage.diskcache import HEADER, MAGIC
from stoker.zarr.codecs.blosc import PARTIAL_MAX_SHARE
from batch_oracle import blend_reference as _blend_reference

_LONG = os.environ.get("STOKER_FUZZ_EXAMPLES", "").strip()

pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.timeout(600 if _LONG else 120),
    pytest.mark.skipif(not (native_testing.decode_files and native.zstd and native.blosc),
                       reason="stoker._native is not available (tests/engine/test_native.py says why)"),
]


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` from a fixed seed, or STOKER_FUZZ_EXAMPLES from a random one."""
    return settings(max_examples=int(_LONG) if _LONG else examples, derandomize=not _LONG, database=None,
                    deadline=None, print_blob=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# ---------------------------------------------------------------------------------------------
# zstd's and c-blosc's own functions, through ctypes: the numcodecs copies the compiled reader calls

_zstd_lib = ctypes.CDLL(numcodecs.zstd.__file__)
_zstd_lib.ZSTD_frameHeaderSize.restype = ctypes.c_size_t
_zstd_lib.ZSTD_frameHeaderSize.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_zstd_lib.ZSTD_isError.restype = ctypes.c_uint
_zstd_lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
_CODECS = native._symbols(numcodecs.zstd.__file__, "ZSTD_decompress", "ZSTD_isError")[1] + \
    native._symbols(numcodecs.blosc.__file__, "blosc_decompress_ctx", "blosc_getitem")[1]
_STREAMING = native._symbols(numcodecs.zstd.__file__, *native.ZSTD_STREAMING)[1]


def _configure(streaming: bool = True, share: float = PARTIAL_MAX_SHARE) -> None:
    """zstd's early stop on or off, and the largest share of a blosc chunk decoded block by block: in the tests'
    module (decode_files, the chunk from its file) and in stoker._native (the engine, the same chunk from memory)
    alike, since each extension module keeps settings of its own and the two reads are compared."""
    import stoker._native as shipped

    for module in (native_testing.module, shipped):
        module.set_codecs(*_CODECS, share)
        module.set_zstd_streaming(*(_STREAMING if streaming and native.zstd_streaming else [0] * 7))


@contextlib.contextmanager
def configured(streaming: bool = True, share: float = PARTIAL_MAX_SHARE):
    """:func:`_configure` for the block's duration, then the settings stoker loads with."""
    _configure(streaming, share)
    try:
        yield
    finally:
        _configure()


def zstd_blocks(frame: bytes) -> list[int]:
    """Offsets of a zstd frame's block headers, as far as they stay inside ``frame``."""
    pos = _zstd_lib.ZSTD_frameHeaderSize(frame, len(frame))
    if _zstd_lib.ZSTD_isError(pos):
        return []
    found = []
    while pos + 3 <= len(frame):
        found.append(pos)
        header = int.from_bytes(frame[pos:pos + 3], "little")
        if header & 1:
            break
        pos += 3 + (1 if (header >> 1) & 3 == 1 else header >> 3)
    return found


def oracle(codec: int, stored: bytes, nbytes: int) -> bytes | None:
    """numcodecs' decode of ``stored`` when it is a chunk of ``nbytes``, else None. Called only on frames
    whose header the compiled reader found to state ``nbytes`` (so numcodecs allocates no more)."""
    try:
        if codec == native.CODEC_ZSTD:
            out = np.empty(nbytes, np.uint8)
            numcodecs.Zstd().decode(stored, out=out)  # with out: at most nbytes, or an error
            return out.tobytes()
        got = numcodecs.Blosc().decode(stored)
        return bytes(got) if len(got) == nbytes else None
    except Exception:  # noqa: BLE001 - any refusal: not a chunk numcodecs reads
        return None


# ---------------------------------------------------------------------------------------------
# Calling the reader

_GUARD = 64  # bytes of 0x5A on each side of every buffer the reader writes


class Guarded:
    """``view``: ``n`` bytes of ``fill`` between guards, ``shift`` bytes past an aligned address; ``intact()``
    says the guards were not written."""

    def __init__(self, n: int, fill: int = 0xAB, shift: int = 0):
        self.start = _GUARD + shift
        self.whole = np.full(n + 2 * _GUARD + shift, 0x5A, np.uint8)
        self.view = self.whole[self.start:self.start + n]
        self.view[:] = fill

    def intact(self) -> bool:
        before, after = self.whole[:self.start], self.whole[self.start + self.view.size:]
        return bool((before == 0x5A).all() and (after == 0x5A).all())


_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def fenced(n: int, fill: int = 0) -> np.ndarray:
    """``n`` bytes ending where an inaccessible page begins: a read past the end faults at once, also inside
    zstd and c-blosc (numcodecs' builds, which AddressSanitizer does not see into)."""
    pages = -(-n // _PAGE) + 1
    region = mmap.mmap(-1, pages * _PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if _libc.mprotect(base + (pages - 1) * _PAGE, _PAGE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    buf = np.frombuffer(region, np.uint8, count=n, offset=(pages - 1) * _PAGE - n)
    buf[:] = fill
    return buf


def call(work, codec, files: list[bytes], nbytes: int, spans, wheres, scratch_len: int, places=None, dst=None,
         scratch_fill: int = 0, out_shift: int = 0):
    """One decode_files call over ``files`` (written to disk); returns (results, outs). The scratch buffer
    ends where an inaccessible page begins (:func:`fenced`)."""
    paths = []
    for i, data in enumerate(files):
        path = work / f"chunk{i}"
        path.write_bytes(data)
        paths.append(str(path))
    scratch = fenced(scratch_len, scratch_fill)
    outs = [Guarded(nbytes, shift=out_shift) for _ in files]
    regions = [(*(w if w is not None else (-1, 0)), *sp) for w, sp in zip(wheres, spans)]
    results = native_testing.decode_files(codec, paths, regions, scratch, [o.view for o in outs], nbytes, places, dst)
    assert all(o.intact() for o in outs), "a write outside the output buffer"
    assert len(results) == len(files)
    return results, outs


_MEMORY_ENGINE = None


def from_memory(codec: int, data: bytes, where, nbytes: int, span: tuple[int, int], scratch_len: int, result,
                out: np.ndarray) -> None:
    """Read the same stored bytes from a buffer (a chunk fetched from a store) on the engine, which decodes them
    where they are: the status and detail the file got, and the same bytes placed; a range past the buffer is
    refused before any read. The buffer ends where the chunk does (a range: its head and the range), so a read
    past the chunk is one past the buffer, which ASan catches (.ci/asan)."""
    global _MEMORY_ENGINE
    a, b = span
    if nbytes < 1 or b <= a or nbytes + scratch_len > 1 << 26:  # the engine never asks for no bytes
        return
    if _MEMORY_ENGINE is None:
        _MEMORY_ENGINE = native.Engine(1, 1 << 27)
    inside = where is None or where[0] + where[1] <= len(data)
    # exactly sized (ASan guards its ends), and ending with the chunk
    buffer = np.frombuffer(data if where is None or not inside else data[:where[0] + where[1]], np.uint8).copy()
    chunks = np.zeros((1, native.N_CHUNK_COLS), np.int64)
    chunks[0, native.C_FILE] = -1
    chunks[0, native.C_OFFSET], chunks[0, native.C_LENGTH] = where if where is not None else (-1, 0)
    chunks[0, native.C_SPAN_START], chunks[0, native.C_SPAN_STOP] = a, b
    chunks[0, native.C_CODEC], chunks[0, native.C_NBYTES], chunks[0, native.C_MAX_STORED] = codec, nbytes, scratch_len
    chunks[0, native.C_NCOPIES] = 1
    sources = np.array([[native.SOURCE_KINDS[np.dtype("uint8")], 0, 0, 1, ord("."), 0, 1]], np.int64)
    batch = Guarded(b - a, fill=0x11)
    args = (chunks, np.array([[a, 0, b - a]], np.int64), sources, np.zeros((0, native.F_COORDS + 1), np.int64),
            b"x", batch.view, native.KIND_SAME, False, np.array([1], np.int64), [buffer])
    if not inside:
        with pytest.raises(ValueError, match="outside its buffer"):
            _MEMORY_ENGINE.submit(*args)
        return
    job = _MEMORY_ENGINE.submit(*args)
    assert job.wait(20)
    status, detail, _ = job.results()
    status, detail = int(np.frombuffer(status, np.int32)[0]), int(np.frombuffer(detail, np.int64)[0])
    event("read from memory too")
    assert batch.intact(), "a write outside the batch"
    if codec == native.CODEC_BLOSC and result[0] == native.ST_CODEC_ERROR and status == native.ST_OK:
        # blosc's partial decode of a file reads only the blocks the span needs, and states their end as the
        # frame's size: a block whose streams run past the next block's start fails there (the Python path
        # then decodes the frame whole). In memory the whole frame is there, and the block decodes from the
        # chunk's own bytes, as a whole decode reads them.
        event("blosc from memory: a block read past the next one's start")
        reference = oracle(codec, bytes(buffer[0 if where is None else where[0]:]), nbytes)
        if reference is not None:
            assert batch.view.tobytes() == reference[a:b], "from memory, other bytes than numcodecs'"
        return
    assert status == result[0], f"from memory: status {status}, from its file: {result[0]}"
    if status == native.ST_OK:
        assert batch.view.tobytes() == out[a:b].tobytes(), "from memory, other bytes than from its file"
    elif not (codec == native.CODEC_BLOSC and status == native.ST_CODEC_ERROR):
        # blosc's error code depends on the frame it was handed: read in part from a file, the frame states the
        # end of the blocks read as its size (above); in memory it is whole. Only zstd's code is ever shown:
        # the engine hands every failed blosc chunk to the Python path, which decides and words the error.
        assert detail == result[2]


# How a chunk is stored: a whole file, or an inner chunk of a shard between other bytes, at an offset and
# with a length that may disagree with the frame (an index that lies or a shard cut short)
placements = st.one_of(
    st.just(None), st.just(None),
    st.tuples(st.binary(max_size=100), st.binary(max_size=100),
              st.sampled_from([0, 0, 0, -1, 1, -7, 7, -100, 100, 1 << 20, 1 << 40]))
)


def check_one(work, codec: int, stored: bytes, nbytes: int, span: tuple[int, int], placement,
              scratch_slack: int, valid: bool, reference: bytes | None = None) -> tuple:
    """Read ``stored`` as placed by ``placement``; check the status against what the bytes are, the output
    against numcodecs; read it again over a scratch buffer full of other bytes: the same outcome, so no
    byte the reader did not read from the file reaches the output. ``valid``: the frame was built as a
    chunk of ``nbytes`` (so it must be read, unless stored with a lying length)."""
    if placement is None:
        data, where, size, lied = stored, None, len(stored), False
    else:
        head, tail, delta = placement
        length = max(0, len(stored) + delta)
        data = head + stored + tail
        where, size, lied = (len(head), length), length, delta != 0
        stored = data[len(head):len(head) + length]  # what the index says the chunk is
    # a scratch buffer of about the stored size (an index that claims a terabyte gets a small one)
    scratch_len = max(1, size + scratch_slack if size < 1 << 24 else len(data))
    spans, wheres = [span], [where]
    results, outs = call(work, codec, [data], nbytes, spans, wheres, scratch_len)
    from_memory(codec, data, where, nbytes, span, scratch_len, results[0], outs[0].view)
    again, outs_again = call(work, codec, [data], nbytes, spans, wheres, scratch_len, scratch_fill=0xC3)
    result, out = results[0], outs[0].view
    status, nread, detail, *_, placed = result
    note(f"status {status}, read {nread}, detail {detail}; size {size}, nbytes {nbytes}, span {span}")
    event(f"status {status}" + (" (stopped early)" if status == native.ST_OK and detail < nbytes else ""))
    assert (again[0][0], again[0][2]) == (status, detail), "the outcome depends on bytes never read"
    assert status in (native.ST_OK, native.ST_TOO_BIG, native.ST_SHORT, native.ST_CODEC_ERROR, native.ST_SIZE, native.ST_FRAME)
    assert placed == 0
    a, b = span
    if size > scratch_len:
        assert status == native.ST_TOO_BIG and detail == size
        return result
    assert status != native.ST_TOO_BIG
    if status == native.ST_SHORT:
        assert where is not None and where[0] + where[1] > len(data)
    if status == native.ST_FRAME:
        assert codec == native.CODEC_BLOSC
    if status == native.ST_OK:
        assert 0 < detail <= nbytes or detail == nbytes == 0
        assert nread <= 2 * size  # at worst zstd's block-header hops, then the whole frame
        np.testing.assert_array_equal(out[a:b], outs_again[0].view[a:b])
        if reference is None:
            reference = oracle(codec, stored, nbytes)
        if reference is not None:
            assert out[a:b].tobytes() == reference[a:b], "decoded bytes differ from numcodecs'"
        else:  # numcodecs refuses the frame: only damage past an early stop goes unseen (and an empty
            # chunk, which zstd reads from zero frames; the engine never asks for one)
            assert detail < nbytes or nbytes == 0, "a whole frame numcodecs refuses was read as good"
    elif valid and not lied:
        pytest.fail(f"a valid frame was refused with status {status}")
    return result


# ---------------------------------------------------------------------------------------------
# Contents and spans

def spread(lo: int, hi: int):
    """Integers spread evenly over [lo, hi] (hypothesis' own lean towards small ones)."""
    return st.integers(0, 1000).map(lambda k: lo + (hi - lo) * k // 1000)


def sizes(max_size: int):
    """Chunk sizes: tiny, small, large (many zstd blocks of 128 KiB, many blosc blocks), and edges."""
    edges = [n for n in (1, 255, 256, 4096, 65536, (128 << 10) - 1, (128 << 10) + 1, 300_000) if n <= max_size]
    large = spread(128 << 10, max_size) if max_size > 128 << 10 else spread(0, max_size)
    return st.one_of(st.integers(0, min(300, max_size)), spread(0, min(8192, max_size)), large, large,
                     st.sampled_from(edges))


@st.composite
def contents(draw, max_size: int = 4096, itemsize: int = 1) -> bytes:
    """Bytes of a chunk: compressible, incompressible or both, of a whole number of items."""
    n = draw(sizes(max_size))
    n -= n % itemsize
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["zeros", "noise", "smooth", "pattern", "mixed"]))
    if kind == "zeros":
        return bytes(n)
    if kind == "noise":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if kind == "smooth":
        return np.cumsum(rng.integers(-2, 3, n), dtype=np.int64).astype(np.uint8).tobytes()
    if kind == "pattern":
        return (rng.integers(0, 256, 1 + n % 17, dtype=np.uint8).tobytes() * (n + 1))[:n]
    cut = rng.integers(0, n + 1) if n else 0
    return bytes(cut) + rng.integers(0, 16, n - cut, dtype=np.uint8).tobytes()


@st.composite
def spans(draw, nbytes: int) -> tuple[int, int]:
    """A byte range of the chunk a crop reads: often short (the partial and early-stop paths)."""
    if nbytes == 0 or draw(st.booleans()):
        return 0, nbytes
    if draw(st.integers(0, 9)) == 0:  # empty: the engine never asks for one, the call allows it
        return (draw(st.integers(0, nbytes)),) * 2
    a = draw(st.one_of(st.integers(0, nbytes - 1), spread(0, nbytes - 1)))
    b = draw(st.one_of(st.integers(a + 1, min(nbytes, a + 64)), spread(a + 1, nbytes)))
    return a, b


# ---------------------------------------------------------------------------------------------
# Mutations of frames

INTERESTING_U32 = [0, 1, 2, 3, 15, 16, 17, 255, 256, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]


@st.composite
def mutated(draw, frame: bytes, donors: list[bytes], fields: list[int] = ()) -> bytes:
    """``frame`` after one to four damages; ``fields``: offsets of little-endian uint32 fields worth lying in."""
    data = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "field", "truncate", "extend", "splice", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.one_of(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]), st.integers(0, 255)))
        elif op == "field" and fields:
            at = draw(st.sampled_from(list(fields)))
            if at + 4 <= len(data):
                value = draw(st.one_of(st.sampled_from(INTERESTING_U32), st.integers(0, 2**32 - 1),
                                       st.sampled_from([len(frame), len(frame) - 1, len(frame) + 1])))
                data[at:at + 4] = (value % 2**32).to_bytes(4, "little")
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif op == "extend":
            data += draw(st.one_of(st.binary(max_size=64), st.integers(0, 70_000).map(bytes)))
        elif op == "splice" and donors:
            donor = draw(st.sampled_from(donors))
            a = draw(st.integers(0, len(donor)))
            b = draw(st.integers(a, len(donor)))
            data[pos:pos + (b - a)] = donor[a:b]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# zstd

@st.composite
def numcodecs_zstd(draw, max_size: int = 300_000) -> tuple[bytes, bytes]:
    """``(frame, content)``: a frame numcodecs wrote, with or without a checksum."""
    content = draw(contents(max_size))
    codec = numcodecs.Zstd(level=draw(st.sampled_from([-5, 1, 3, 9])),
                           checksum=draw(st.sampled_from([False, False, False, True])))
    return codec.encode(content), content


@st.composite
def hand_zstd(draw) -> tuple[bytes, bytes, bool]:
    """``(frame, content, valid)``: a zstd frame of raw and RLE blocks with a drawn header: a content size
    of 0 to 8 bytes or none, single segment or a window, a dictionary id, a checksum right or wrong, a
    content size that may lie. ``valid``: the format allows it (numcodecs is still the judge)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    blocks, content = [], b""
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.one_of(st.integers(0, 300), st.sampled_from([1 << 10, 100_000, 128 << 10])))
        if draw(st.booleans()):
            blocks.append((0, n, rng.integers(0, 256, n, dtype=np.uint8).tobytes()))
            content += blocks[-1][2]
        else:
            byte = int(rng.integers(0, 256))
            blocks.append((1, n, bytes([byte])))
            content += bytes([byte]) * n
    size = len(content)
    lie = draw(st.sampled_from([0, 0, 0, 1, -1, 1 << 33]))
    stated = None if draw(st.integers(0, 3)) == 0 else max(0, size + lie)
    single = stated is not None and draw(st.booleans())
    window_log = draw(st.integers(10, 17))
    checksum = draw(st.booleans())
    dict_field = draw(st.sampled_from([0, 0, 0, 1, 2, 4]))
    valid = lie == 0 and dict_field == 0
    if stated is None:
        fcs_flag, fcs = 0, b""
    else:
        widths = [w for w, lo, hi in ((1, 0, 255), (2, 256, 65791), (4, 0, 2**32 - 1), (8, 0, 2**64 - 1))
                  if lo <= stated <= hi and (w != 1 or single)]
        width = draw(st.sampled_from(widths))
        fcs_flag = {1: 0, 2: 1, 4: 2, 8: 3}[width]
        fcs = (stated - 256 if width == 2 else stated).to_bytes(width, "little")
    window = 1 << window_log
    if not single:
        valid &= all(n <= min(window, 128 << 10) for _, n, _ in blocks)
    fhd = fcs_flag << 6 | single << 5 | checksum << 2 | {0: 0, 1: 1, 2: 2, 4: 3}[dict_field]
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([fhd])
    if not single:
        header += bytes([(window_log - 10) << 3])
    header += (draw(st.integers(1, 2**32 - 1)) % 2 ** (8 * dict_field)).to_bytes(dict_field, "little") + fcs
    body = b""
    for i, (kind, n, payload) in enumerate(blocks):
        last = i == len(blocks) - 1
        body += (last | kind << 1 | n << 3).to_bytes(3, "little") + payload
    frame = header + body
    if checksum:
        good = numcodecs.Zstd(level=1, checksum=True).encode(content)[-4:]
        if draw(st.integers(0, 3)) == 0:
            good, valid = bytes(x ^ 0xFF for x in good), False
        frame += good
    return frame, content, valid


@st.composite
def block_header_damage(draw, frame: bytes) -> bytes:
    """A block header of ``frame`` rewritten: any type, a size up to the largest (past the file), the last
    flag set or cleared."""
    found = zstd_blocks(frame)
    if not found:
        return frame
    at = draw(st.sampled_from(found))
    header = int.from_bytes(frame[at:at + 3], "little")
    size = draw(st.one_of(st.just(header >> 3), st.integers(0, 2**21 - 1),
                          st.sampled_from([0, 1, len(frame) - at - 3, len(frame) - at - 2, 128 << 10, 2**21 - 1])))
    kind = draw(st.one_of(st.just((header >> 1) & 3), st.integers(0, 3)))
    last = draw(st.one_of(st.just(header & 1), st.integers(0, 1)))
    new = (last | kind << 1 | (size % 2**21) << 3).to_bytes(3, "little")
    return frame[:at] + new + frame[at + 3:]


scratch_slack = st.sampled_from([0, 0, 0, 0, 0, 1, 100, -1])  # -1: one byte short of the stored chunk
streamings = st.sampled_from([True, True, True, False])  # zstd's early stop on (or off: one-shot decodes)


@fuzz(150)
@given(st.data())
def test_zstd_frames_from_numcodecs_read_as_numcodecs_does(work, data):
    """Valid frames, whole or stopped early, as files or inner chunks, with zstd's streaming on or off."""
    frame, content = data.draw(numcodecs_zstd())
    nbytes = len(content)
    span = data.draw(spans(nbytes))
    with configured(streaming=data.draw(streamings)):
        check_one(work, native.CODEC_ZSTD, frame, nbytes, span, data.draw(placements), data.draw(scratch_slack),
                  valid=True, reference=content)


@fuzz(150)
@given(st.data())
def test_hand_built_zstd_frames(work, data):
    """Every frame header layout, raw and RLE blocks, checksums right and wrong, content sizes that lie."""
    frame, content, valid = data.draw(hand_zstd())
    nbytes = len(content) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    if nbytes < 0:
        return
    valid &= nbytes == len(content)
    with configured(streaming=data.draw(streamings)):
        check_one(work, native.CODEC_ZSTD, frame, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=valid, reference=content if valid else None)


@fuzz(300)
@given(st.data())
def test_damaged_zstd_frames(work, data):
    """Frames damaged anywhere: header, block headers (sizes past the file, reserved types, the last-block
    flag), bodies, checksums; cut short, extended, spliced with another frame."""
    if data.draw(st.booleans()):
        frame, content = data.draw(numcodecs_zstd(max_size=data.draw(st.sampled_from([512, 300_000]))))
    else:
        frame, content, _ = data.draw(hand_zstd())
    donor = numcodecs.Zstd(level=1).encode(content[::-1] + b"donor")
    if data.draw(st.booleans()):
        frame = data.draw(block_header_damage(frame))
    if data.draw(st.booleans()):
        frame = data.draw(mutated(frame, [donor, frame], fields=[0, 4, 5, 6, 9, 10, 13]))
    nbytes = len(content) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    if nbytes < 0:
        return
    with configured(streaming=data.draw(streamings)):
        check_one(work, native.CODEC_ZSTD, frame, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=False)


@fuzz(150)
@given(st.data())
def test_zstd_early_stop_with_damage_after_it(work, data):
    """Frames of several blocks read for a span in their first blocks (the early stop and its block-header
    hops), with the rest of the frame intact, cut short, extended, or with a later block damaged."""
    size = data.draw(spread((128 << 10) + 1, 600_000))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    content = rng.integers(0, data.draw(st.sampled_from([2, 16, 256])), size, dtype=np.uint8).tobytes()
    frame = numcodecs.Zstd(level=data.draw(st.sampled_from([-5, 1]))).encode(content)
    stop = data.draw(st.integers(1, size - 1))
    span = (data.draw(st.integers(0, stop - 1)), stop)
    blocks = zstd_blocks(frame)
    later = [b for b in blocks if b > 64] or blocks
    damage = data.draw(st.sampled_from(["none", "header", "byte", "truncate", "extend"]))
    if damage == "header":
        frame = data.draw(block_header_damage(frame))
    elif damage == "byte":
        at = data.draw(st.integers(min(later), len(frame) - 1))
        frame = frame[:at] + bytes([frame[at] ^ 0xFF]) + frame[at + 1:]
    elif damage == "truncate":
        frame = frame[:data.draw(st.integers(min(later), len(frame) - 1))]
    elif damage == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=8))
    check_one(work, native.CODEC_ZSTD, frame, size, span, data.draw(placements), data.draw(scratch_slack),
              valid=damage == "none", reference=content if damage == "none" else None)


# ---------------------------------------------------------------------------------------------
# blosc

_TYPESIZES = {1: "u1", 2: "u2", 3: "V3", 4: "u4", 8: "u8", 16: "V16", 33: "V33"}


@st.composite
def numcodecs_blosc(draw, max_size: int = 200_000) -> tuple[bytes, bytes]:
    """``(frame, content)``: a blosc1 frame numcodecs wrote, with its compressor, shuffle, typesize and
    block size drawn (incompressible contents are stored as a plain copy, "memcpyed")."""
    typesize = draw(st.sampled_from(sorted(_TYPESIZES)))
    content = draw(contents(max_size, itemsize=typesize))
    codec = numcodecs.Blosc(cname=draw(st.sampled_from(["lz4", "lz4hc", "blosclz", "zstd", "zlib"])),
                            clevel=draw(st.sampled_from([0, 1, 5, 9])),
                            shuffle=draw(st.sampled_from([numcodecs.Blosc.NOSHUFFLE, numcodecs.Blosc.SHUFFLE,
                                                          numcodecs.Blosc.BITSHUFFLE])),
                            blocksize=draw(st.sampled_from([0, 0, 16, 64, 256, 1000, 4096, 1 << 15])))
    return bytes(codec.encode(np.frombuffer(content, dtype=_TYPESIZES[typesize]))), content


def blosc_fields(frame: bytes) -> list[int]:
    """Offsets of a blosc1 frame's uint32 fields: nbytes, blocksize, cbytes and the block table's entries."""
    nblocks = 0
    if len(frame) >= 16:
        nbytes, blocksize = int.from_bytes(frame[4:8], "little"), int.from_bytes(frame[8:12], "little")
        nblocks = min(-(-nbytes // blocksize) if blocksize else 0, (len(frame) - 16) // 4)
    return [4, 8, 12] + [16 + 4 * i for i in range(nblocks)]


@st.composite
def blosc_header_damage(draw, frame: bytes) -> bytes:
    """Header bytes of a blosc1 frame set to values that disagree: version, flags (memcpyed and the
    shuffles toggled), typesize, and the table's entries pointing anywhere in or out of the frame."""
    data = bytearray(frame)
    if len(data) < 16:
        return frame
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["version", "flags", "typesize", "table"]))
        if what == "version":
            data[0] = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 255]))
        elif what == "flags":
            data[2] ^= draw(st.sampled_from([0x1, 0x2, 0x4, 0x10, 0x20, 0xE0]))
        elif what == "typesize":
            data[3] = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 17, 255]))
        else:
            entries = blosc_fields(frame)[3:]
            if entries:
                at = draw(st.sampled_from(entries))
                other = draw(st.sampled_from(entries))
                value = draw(st.one_of(
                    st.sampled_from([0, 15, 16, at, len(frame) - 1, len(frame), 2**31 - 1, 2**32 - 1,
                                     int.from_bytes(frame[other:other + 4], "little")]),  # another block's
                    st.integers(0, len(frame))))
                data[at:at + 4] = value.to_bytes(4, "little")
    return bytes(data)


shares = st.sampled_from([PARTIAL_MAX_SHARE, PARTIAL_MAX_SHARE, 1.0, 0.0])


@fuzz(200)
@given(st.data())
def test_blosc_frames_from_numcodecs_read_as_numcodecs_does(work, data):
    """Valid frames of every compressor, shuffle, typesize and block size, decoded whole or block by block."""
    frame, content = data.draw(numcodecs_blosc())
    nbytes = len(content)
    with configured(share=data.draw(shares)):
        check_one(work, native.CODEC_BLOSC, frame, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=True, reference=content)


@fuzz(400)
@given(st.data())
def test_damaged_blosc_frames(work, data):
    """Header fields that lie (nbytes, blocksize, cbytes, typesize, flags), block tables pointing anywhere,
    and damage anywhere else; decoded whole and block by block."""
    frame, content = data.draw(numcodecs_blosc(max_size=data.draw(st.sampled_from([2048, 200_000]))))
    donor = bytes(numcodecs.Blosc("lz4", 5, 1, blocksize=256).encode(content[::-1] + b"donor"))
    if data.draw(st.booleans()):
        frame = data.draw(blosc_header_damage(frame))
    if data.draw(st.booleans()):
        frame = data.draw(mutated(frame, [donor, frame], fields=blosc_fields(frame)))
    nbytes = len(content) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    if nbytes < 0:
        return
    with configured(share=data.draw(shares)):
        check_one(work, native.CODEC_BLOSC, frame, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=False)


# ---------------------------------------------------------------------------------------------
# blosc frames built by hand: blocks stored raw, in any order, overlapping

def blosc_frame(nbytes: int, blocksize: int, starts: list[int], body: bytes, flags: int = 0x10) -> bytes:
    """A blosc1 frame of typesize 1 (one stream per block; no shuffle) from its block table and payload."""
    cbytes = 16 + 4 * len(starts) + len(body)
    return (bytes([2, 1, flags, 1]) + b"".join(v.to_bytes(4, "little") for v in (nbytes, blocksize, cbytes))
            + b"".join(v.to_bytes(4, "little") for v in starts) + body)


def raw_blocks(content: bytes, blocksize: int) -> list[bytes]:
    """Each block stored raw: a stream as long as what it decodes to is copied as it is (c-blosc's rule),
    after its 4-byte size."""
    blocks = [content[i:i + blocksize] for i in range(0, len(content), blocksize)]
    return [len(b).to_bytes(4, "little") + b for b in blocks]


@st.composite
def hand_blosc(draw) -> tuple[bytes, bytes, bool]:
    """``(frame, content, valid)``: a frame of raw blocks stored in any order with gaps between them, its
    table sometimes pointing into other blocks' storage (blocks that overlap: c-blosc reads them, never
    writes them). ``valid``: the table was left as built."""
    blocksize = draw(st.sampled_from([16, 64, 100, 256, 1000]))
    content = draw(contents(min(4096, 16 * blocksize)))
    if not content:
        content = b"\1"
    blocks = raw_blocks(content, blocksize)
    order = draw(st.permutations(range(len(blocks))))
    table_end = 16 + 4 * len(blocks)
    starts, body = [0] * len(blocks), b""
    for i in order:
        body += bytes(draw(st.sampled_from([0, 0, 0, 1, 4, 7])))  # a gap
        starts[i] = table_end + len(body)
        body += blocks[i]
    valid = blocksize <= len(content)  # c-blosc's rule
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        i = draw(st.integers(0, len(blocks) - 1))
        starts[i] = draw(st.one_of(st.integers(table_end, table_end + len(body) - 1),
                                   st.sampled_from([s + d for s in starts for d in (1, 4)])))
        valid = False
    return blosc_frame(len(content), blocksize, starts, body), content, valid


@fuzz(200)
@given(st.data())
def test_hand_built_blosc_frames(work, data):
    """Blocks stored out of order, with gaps, or overlapping other blocks, decoded whole and block by block."""
    frame, content, valid = data.draw(hand_blosc())
    nbytes = len(content)
    with configured(share=data.draw(shares)):
        check_one(work, native.CODEC_BLOSC, frame, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=valid, reference=content if valid else None)


_BLOSC_MAX_BUFFERSIZE = 2**31 - 1 - 16  # c-blosc 1's largest chunk (INT_MAX less its overhead)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("typesize", [1, 4])
def test_a_blosc_header_stating_more_than_blosc1_holds_is_refused_before_blosc(work, typesize):
    """A blosc1 header stating a chunk of 3 GiB (the chunk's metadata saying as much): the partial decode handed
    blosc_getitem its first item and count cast to int, so a span past 2 GiB became a negative start, and the
    whole decode a size blosc reads as a negative int32; only blosc's own checks stopped them (ST_CODEC_ERROR,
    -1). Such a header is refused now before any blosc call (ST_FRAME: the Python path decides), every span
    alike; one stating c-blosc's largest chunk is still handed to blosc. Nothing is decoded: the 3 GiB output
    is mapped, never touched."""
    blocksize, nblocks = 1 << 30, 3
    table_end = 16 + 4 * nblocks
    body = b"".join((1).to_bytes(4, "little") + b"\0" for _ in range(nblocks))  # junk streams: blosc refuses
    starts = [table_end + 5 * i for i in range(nblocks)]
    path = work / "huge_blosc"
    # mapped, never written (released with the test)
    out = mmap.mmap(-1, 3 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    view = np.frombuffer(out, np.uint8)
    scratch = np.zeros(1 << 12, np.uint8)
    for nbytes in (3 << 30, 2**31, _BLOSC_MAX_BUFFERSIZE + 1, _BLOSC_MAX_BUFFERSIZE):
        frame = bytearray(blosc_frame(nbytes, blocksize, starts, body, flags=0x1))
        frame[3] = typesize
        path.write_bytes(bytes(frame))
        spans_tried = [(0, nbytes), (16, 80), (nbytes - 64, nbytes)]
        if nbytes > 2**31 + 64:
            spans_tried.append((2**31 + 16, 2**31 + 80))  # an item past INT_MAX bytes
        with configured(share=1.0):
            for span in spans_tried:
                (status, nread, detail, *_), = native_testing.decode_files(
                    native.CODEC_BLOSC, [str(path)], [(-1, 0, *span)], scratch, [view[:nbytes]], nbytes, None,
                    None)
                if nbytes > _BLOSC_MAX_BUFFERSIZE:
                    assert status == native.ST_FRAME, (nbytes, span, status, detail)
                else:  # within blosc1's range: handed to blosc, which refuses the junk streams
                    assert status == native.ST_CODEC_ERROR, (nbytes, span, status, detail)


# ---------------------------------------------------------------------------------------------
# Random bytes

@fuzz(300)
@given(st.data())
def test_random_bytes(work, data):
    """Bytes that are no frame at all, some starting as one (zstd's magic number, a blosc1 header)."""
    codec = data.draw(st.sampled_from([native.CODEC_ZSTD, native.CODEC_BLOSC]))
    nbytes = data.draw(st.sampled_from([0, 1, 16, 100, 4096, 65536]))
    start = data.draw(st.sampled_from([b"", b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd\x20", b"\x28\xb5\x2f\xfd\x00\x00",
                                       b"\x02\x01\x21\x01" + nbytes.to_bytes(4, "little")]))
    stored = start + data.draw(st.binary(max_size=600))
    if codec == native.CODEC_BLOSC and len(stored) >= 16 and data.draw(st.booleans()):  # cbytes: the stored size
        stored = stored[:12] + len(stored).to_bytes(4, "little") + stored[16:]
    with configured(streaming=data.draw(streamings), share=data.draw(shares)):
        check_one(work, codec, stored, nbytes, data.draw(spans(nbytes)), data.draw(placements),
                  data.draw(scratch_slack), valid=False)


# ---------------------------------------------------------------------------------------------
# Copy plans

_KINDS = {k: t for t, k in native.SOURCE_KINDS.items()}  # source kind -> numpy dtype
_INTEGER_BATCHES = {native.KIND_I32: np.dtype("int32"), native.KIND_I64: np.dtype("int64")}
DST_KINDS = [native.KIND_SAME, native.KIND_F32, native.KIND_BF16, native.KIND_I32, native.KIND_I64]


def batch_item(dst_kind: int, src_item: int) -> int:
    """Bytes of one batch element of ``dst_kind`` (KIND_SAME: the source's)."""
    if dst_kind in _INTEGER_BATCHES:
        return _INTEGER_BATCHES[dst_kind].itemsize
    return src_item if dst_kind == native.KIND_SAME else 4 if dst_kind == native.KIND_F32 else 2


def model_place(plan: list[int], chunk: bytes, span: tuple[int, int], batch: np.ndarray, dst_bytes: int,
                dst_kind: int, unfit: list[bool] | None = None) -> bool:
    """What a copy plan must do (see check_copies and place_copies in csrc/place.c), done in Python on ``batch``
    (uint8): False, writing nothing, when the plan is malformed, casts a float into an integer batch, or any
    element it reads or writes lies outside the chunk's decoded span or the batch's first ``dst_bytes``; else
    True, with the copies made. Into an integer batch a value that does not fit is written as 0, and
    ``unfit`` gets whether one did not (the chunk's ST_RANGE)."""
    if len(plan) < 3 or not 0 <= plan[0] < len(_KINDS) or not 1 <= plan[1] <= 32 or plan[2] < 0:
        return False
    if dst_kind in _INTEGER_BATCHES and _KINDS[plan[0]].kind == "f":
        return False
    kind, ndim, ncopies = plan[:3]
    if len(plan) != 3 + 2 * ndim + ncopies * (2 + ndim):
        return False
    ss, ds = plan[3:3 + ndim], plan[3 + ndim:3 + 2 * ndim]
    if ss[-1] != 1 or ds[-1] != 1:
        return False
    src_t = _KINDS[kind]
    item = src_t.itemsize
    d_item = batch_item(dst_kind, item)
    chunk_elems, dst_elems = len(chunk) // item, dst_bytes // d_item
    copies = [plan[3 + 2 * ndim + i * (2 + ndim):3 + 2 * ndim + (i + 1) * (2 + ndim)] for i in range(ncopies)]
    for s0, d0, *ext in copies:
        if s0 < 0 or d0 < 0 or min(ext) < 1 or min(ss) < 0 or min(ds) < 0:
            return False
        s_last = s0 + sum((e - 1) * s for e, s in zip(ext, ss))
        d_last = d0 + sum((e - 1) * d for e, d in zip(ext, ds))
        if s_last >= chunk_elems or d_last >= dst_elems or s0 * item < span[0] or (s_last + 1) * item > span[1]:
            return False
        if np.prod(ext, dtype=object) > dst_elems:  # a copy writes no more elements than the batch holds
            return False
    src = np.frombuffer(chunk[:chunk_elems * item], dtype=src_t)
    bad = False
    if dst_kind == native.KIND_SAME:
        dst, conv = batch[:dst_elems * d_item].view(src_t), lambda v: v
    elif dst_kind in _INTEGER_BATCHES:
        out_t = _INTEGER_BATCHES[dst_kind]
        dst = batch[:dst_elems * d_item].view(out_t)

        def conv(v):
            nonlocal bad
            x = int(v[0])
            fits = np.iinfo(out_t).min <= x <= np.iinfo(out_t).max
            bad |= not fits
            return np.array([x if fits else 0], out_t)
    elif dst_kind == native.KIND_F32:
        dst, conv = batch[:dst_elems * d_item].view(np.float32), lambda v: v.astype(np.float32)
    else:
        dst = batch[:dst_elems * d_item].view(np.uint16)

        def conv(v):
            return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for s0, d0, *ext in copies:
        for idx in itertools.product(*(range(e) for e in ext)):
            s = s0 + sum(i * k for i, k in zip(idx, ss))
            d = d0 + sum(i * k for i, k in zip(idx, ds))
            dst[d] = conv(src[s:s + 1])[0]
    if unfit is not None:
        unfit.append(bad)
    return True


INTERESTING_I64 = [-2**63, -2**62, -1, 0, 1, 2, 31, 32, 33, 2**31, 2**32, 2**62, 2**63 - 1]


@st.composite
def copy_plans(draw, chunk_shape, batch_shape, kind) -> list[int]:
    """A plan as copy_plan writes it (copies of boxes of the chunk into boxes of batch rows), then often
    damaged: any value set to an edge (negative, zero, huge, wrapping), the plan cut or extended, ndim
    or the copy count changed."""
    ndim = len(chunk_shape)
    cs = [int(np.prod(chunk_shape[k + 1:])) for k in range(ndim)]
    bs = [int(np.prod(batch_shape[k + 1:])) for k in range(len(batch_shape))]
    plan = [kind, ndim, 0, *cs, *bs[1:]]
    for _ in range(draw(st.integers(0, 3))):
        ext = [draw(st.integers(1, min(c, b))) for c, b in zip(chunk_shape, batch_shape[1:])]
        s0 = [draw(st.integers(0, c - e)) for c, e in zip(chunk_shape, ext)]
        d0 = [draw(st.integers(0, b - e)) for b, e in zip(batch_shape[1:], ext)]
        row = draw(st.integers(0, batch_shape[0] - 1))
        plan += [sum(a * s for a, s in zip(s0, cs)), row * bs[0] + sum(a * s for a, s in zip(d0, bs[1:])), *ext]
        plan[2] += 1
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["value", "value", "value", "cut", "extend", "ndim", "ncopies"]))
        if op == "value" and plan:
            i = draw(st.integers(0, len(plan) - 1))
            plan[i] = draw(st.one_of(st.sampled_from(INTERESTING_I64), st.integers(-2**63, 2**63 - 1),
                                     st.integers(-3, 3).map(lambda d, v=plan[i]: max(-2**63, min(2**63 - 1, v + d)))))
        elif op == "cut":
            del plan[draw(st.integers(0, len(plan))):]
        elif op == "extend":
            plan += draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=5))
        elif op == "ndim" and len(plan) > 1:
            plan[1] = draw(st.sampled_from([0, 1, 2, 3, 4, 32, 33, -1]))
        elif len(plan) > 2:
            plan[2] = draw(st.sampled_from([0, 1, 2, 3, 2**62 + 1, -1]))
    return plan


@fuzz(300)
@given(st.data())
def test_copy_plans(work, data):
    """A copy plan is refused (ValueError, nothing written) exactly when it is malformed or reaches outside
    the chunk's decoded span or the batch; otherwise the batch holds exactly the copies it describes."""
    kind = data.draw(st.sampled_from(sorted(_KINDS)))
    src_t = _KINDS[kind]
    ndim = data.draw(st.integers(1, 3))
    chunk_shape = data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    batch_shape = [data.draw(st.integers(1, 3))] + data.draw(st.lists(st.integers(1, 7), min_size=ndim,
                                                                      max_size=ndim))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if src_t.kind == "f":  # finite values only: NaN payloads in bfloat16 are torch's business
        values = (rng.standard_normal(int(np.prod(chunk_shape))) * 1000).astype(src_t)
    else:
        values = rng.integers(np.iinfo(src_t).min, np.iinfo(src_t).max, int(np.prod(chunk_shape)), dtype=src_t,
                              endpoint=True)
    chunk = values.tobytes()
    nbytes = len(chunk)
    dst_kind = data.draw(st.sampled_from(DST_KINDS))
    if dst_kind in _INTEGER_BATCHES and src_t.kind in "iu" and data.draw(st.booleans()):
        # values the integer batch holds, so wide sources are placed whole too (else most overflow: ST_RANGE)
        have, room = np.iinfo(src_t), np.iinfo(_INTEGER_BATCHES[dst_kind])
        chunk = rng.integers(max(have.min, room.min), min(have.max, room.max), len(values), dtype=src_t,
                             endpoint=True).tobytes()
    d_item = batch_item(dst_kind, src_t.itemsize)
    batch_bytes = int(np.prod(batch_shape)) * d_item
    declared = data.draw(st.one_of(st.just(batch_bytes), st.integers(0, batch_bytes)))  # a batch too small
    plans = [data.draw(copy_plans(chunk_shape, batch_shape, kind)) for _ in range(data.draw(st.integers(1, 2)))]
    # how each plan is handed over: as copy_plan does, or as a buffer of a length that is no whole number
    # of int64 values, or not aligned to them; and chunk and batch buffers not aligned to their elements
    forms = [data.draw(st.sampled_from(["array"] * 10 + ["ragged", "unaligned"])) for _ in plans]
    out_shift, dst_shift = (data.draw(st.sampled_from([0] * 10 + [1, 2, 4])) for _ in range(2))
    span = data.draw(st.one_of(st.just((0, nbytes)), spans(nbytes)))
    stream = data.draw(st.booleans())
    note(f"plans {plans} as {forms}; span {span}; batch {batch_bytes} bytes, {declared} declared, kind {dst_kind}; "
         f"shifts {out_shift}, {dst_shift}")

    batch = Guarded(batch_bytes, fill=0x11, shift=dst_shift)
    want = batch.view.copy()

    def aligned(plan: list[int]) -> bool:
        """A cast reads and writes whole elements of the plan's own kind (damage may have changed it; a plan
        of no kind is refused by the model)."""
        item = _KINDS[plan[0]].itemsize if plan and 0 <= plan[0] < len(_KINDS) else src_t.itemsize
        return dst_kind == native.KIND_SAME or (out_shift % item == 0 and dst_shift % d_item == 0)

    unfit: list[bool] = []
    valid = (forms == ["array"] * len(plans)
             and all(aligned(p) and model_place(p, chunk, span, want, declared, dst_kind, unfit) for p in plans))
    event("taken" if valid else "refused")
    if valid and any(unfit):
        event("a value past the integer batch: ST_RANGE")
    if not valid:
        want = batch.view.copy()
    frame = numcodecs.Zstd(level=1).encode(chunk)
    dst = (batch.view.ctypes.data, declared, dst_kind, stream)
    places = []
    for plan, form in zip(plans, forms):
        raw = array("q", plan).tobytes()
        if form == "ragged":
            raw += bytes(data.draw(st.integers(1, 7)))
        elif form == "unaligned":
            raw = memoryview(bytearray(1) + raw)[1:]
        places.append(array("q", plan) if form == "array" else raw)
    try:
        results, outs = call(work, native.CODEC_ZSTD, [frame] * len(plans), nbytes, [span] * len(plans),
                             [None] * len(plans), len(frame), places=places, dst=dst, out_shift=out_shift)
    except ValueError as exc:
        assert "copy plan" in str(exc)
        assert not valid, "a valid plan was refused"
    else:
        assert valid, "a plan that reaches outside the chunk's span or the batch was taken"
        assert [r[0] for r in results] == [native.ST_RANGE if u else native.ST_OK for u in unfit]
        assert all(r[6] for r in results)
    assert batch.intact(), "a write outside the batch"
    np.testing.assert_array_equal(batch.view, want)


@pytest.mark.parametrize("dst_kind", [native.KIND_SAME, native.KIND_F32])
@pytest.mark.parametrize("stride", [2**63 - 2, 2**62 + 1, 12345])
def test_a_huge_stride_on_an_axis_of_extent_one_is_never_scaled(work, dst_kind, stride):
    """A copy whose outer axis has extent 1 never steps along it, so the checks take any stride there; placing
    it must not scale that stride to bytes (2 * (2**63 - 2) overflows: UBSan under ``make asan`` stopped on
    it, found by the copy-plan fuzzer). The copy is taken and placed as the model says."""
    values = np.arange(4, dtype=np.uint16)
    chunk = values.tobytes()
    kind = native.SOURCE_KINDS[np.dtype("uint16")]
    plan = [kind, 2, 1, stride, 1, stride, 1, 0, 0, 1, 4]  # (1, 4) chunk into a (1, 4) batch
    d_item = 2 if dst_kind == native.KIND_SAME else 4
    batch = Guarded(4 * d_item, fill=0x11)
    want = batch.view.copy()
    assert model_place(plan, chunk, (0, len(chunk)), want, 4 * d_item, dst_kind)
    frame = numcodecs.Zstd(level=1).encode(chunk)
    results, _ = call(work, native.CODEC_ZSTD, [frame], len(chunk), [(0, len(chunk))], [None], len(frame),
                      places=[array("q", plan)], dst=(batch.view.ctypes.data, 4 * d_item, dst_kind, False))
    assert results[0][0] == native.ST_OK and results[0][6]
    assert batch.intact()
    np.testing.assert_array_equal(batch.view, want)


# ---------------------------------------------------------------------------------------------
# The call's other arguments

@fuzz(200)
@given(st.data())
def test_regions_and_batch_targets(work, data):
    """Regions, output sizes and batch targets of any value: a ValueError or a status, nothing else."""
    frame = numcodecs.Zstd(level=1).encode(bytes(range(64)))
    edge = st.sampled_from([-2**63, -2, -1, 0, 1, 63, 64, 65, len(frame), 2**62, 2**63 - 1])
    region = tuple(data.draw(st.one_of(edge, st.integers(-2**63, 2**63 - 1))) for _ in range(4))
    nbytes = data.draw(st.sampled_from([0, 1, 64, 65]))
    out_len = data.draw(st.sampled_from([0, 63, 64, 100]))
    dst_fields = (data.draw(st.sampled_from([0, 1])), data.draw(st.one_of(edge, st.integers(-2**63, 2**63 - 1))),
                  data.draw(st.integers(-3, 5)))
    use_dst = data.draw(st.booleans())
    path = work / "plain"
    path.write_bytes(frame)
    batch = Guarded(64)
    dst = (batch.view.ctypes.data if dst_fields[0] else 0, *dst_fields[1:]) if use_dst else None
    out = Guarded(out_len)
    offset, length, start, stop = region
    expect_error = (out_len < nbytes or start < 0 or stop > nbytes or start > stop or offset < -1 or length < 0
                    or offset > 2**63 - 1 - length)
    if use_dst:
        expect_error |= not dst_fields[0] or dst_fields[1] < 0 or not 0 <= dst_fields[2] < native.N_DST_KINDS
    try:
        results = native_testing.decode_files(native.CODEC_ZSTD, [str(path)], [region],
                                              np.empty(len(frame) + 10, np.uint8), [out.view], nbytes, None, dst)
    except ValueError:
        assert expect_error
    else:
        assert not expect_error
        assert native.ST_OK <= results[0][0] <= native.ST_FRAME  # a status of a chunk file, not of the engine
    assert out.intact() and batch.intact() and (batch.view == 0xAB).all()


# ---------------------------------------------------------------------------------------------
# The engine's plan tables

_ENGINE = None


def _engine():
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = native.Engine(2, 1 << 20)
    return _ENGINE


def _edges(n: int):
    """Values that break tables: out of range for a table of ``n`` rows, negative, overflowing products."""
    return st.sampled_from([-2**63, -2**62, -2, -1, 0, 1, 2, 7, 8, 63, 64, 65, 127, 128, 129, 4095, 4096, 2**31,
                            2**32, 2**62, 2**63 - 1, n - 1, n, n + 1])


@fuzz(300)
@given(st.data())
def test_engine_tables(work, data):
    """Sound tables with a few values replaced by hostile ones (indices out of range, negative sizes, products
    that overflow, copies outside the batch or the chunk, buffers and ranges in them out of range, a blob with
    a NUL or too short, a batch too small):
    refused with a ValueError before any thread sees them, or run to a status per chunk, with no write
    outside the batch's buffer (between guard bytes) and no read outside the threads' scratch (ASan)."""
    n = data.draw(st.integers(1, 5))
    root = work / "engine"
    (root / "c").mkdir(parents=True, exist_ok=True)
    chunk = np.arange(64, dtype="uint16").reshape(8, 8)
    frame = numcodecs.Zstd(level=1).encode(chunk.tobytes())
    shard = b"head" + frame + numcodecs.Blosc("lz4", 5, 1).encode(chunk.tobytes()) + b"tail"
    for i in range(n):
        (root / "c" / f"0.{i}").write_bytes(frame if i % 2 == 0 else shard)
    blob = os.fsencode(str(root) + "/c/")
    sources = np.array([[native.SOURCE_KINDS[np.dtype("uint16")], 0, 0, len(blob), ord("."), 0, 8, 1]], np.int64)
    files = np.zeros((n, native.F_COORDS + 2), np.int64)
    files[:, native.F_COORDS + 1] = np.arange(n)
    chunks = np.zeros((n, native.N_CHUNK_COLS), np.int64)
    chunks[:, native.C_FILE] = np.arange(n)
    chunks[:, native.C_OFFSET] = chunks[:, native.C_BUFFER] = -1
    chunks[:, native.C_SPAN_STOP] = chunks[:, native.C_NBYTES] = 128
    chunks[:, native.C_MAX_STORED] = 4096
    chunks[:, native.C_FIRST_COPY] = np.arange(n)
    chunks[:, native.C_NCOPIES] = 1
    for i in range(1, n, 2):  # inner chunks of a "shard": the zstd frame at 4, the blosc frame after it
        which = data.draw(st.integers(0, 1))
        chunks[i, native.C_OFFSET] = 4 if which == 0 else 4 + len(frame)
        chunks[i, native.C_LENGTH] = len(frame) if which == 0 else len(shard) - 8 - len(frame)
        chunks[i, native.C_CODEC] = native.CODEC_ZSTD if which == 0 else native.CODEC_BLOSC
        if data.draw(st.booleans()):  # a shard of known identity: its inner chunks may be shared between jobs
            st_ = os.stat(root / "c" / f"0.{i}")
            files[i, native.F_HAS_IDENT:native.F_COORDS] = [1, st_.st_dev, st_.st_ino, st_.st_size,
                                                            st_.st_mtime_ns, st_.st_ctime_ns]
    # chunks in memory (fetched from a store): buffer i holds what file i holds, exactly sized (ASan guards
    # its ends), or nothing (None: a missing value)
    buffers = [None if data.draw(st.integers(0, 5)) == 0 else np.frombuffer(frame if i % 2 == 0 else shard,
                                                                           np.uint8).copy() for i in range(n)]
    for i in range(n):
        if data.draw(st.booleans()):
            chunks[i, native.C_FILE], chunks[i, native.C_BUFFER] = -1, i
    if data.draw(st.booleans()):
        chunks[0, native.C_FILE], chunks[0, native.C_BUFFER], chunks[0, native.C_CODEC] = -1, -1, native.CODEC_FILL
    copies = np.zeros((n, 4), np.int64)
    copies[:, 1] = np.arange(n) * 64
    copies[:, 2:] = 8
    strides = np.array([8, 1], np.int64)
    kind = data.draw(st.sampled_from([native.KIND_SAME, native.KIND_F32, native.KIND_BF16]))
    d_item = {native.KIND_SAME: 2, native.KIND_F32: 4, native.KIND_BF16: 2}[kind]
    tables = {"chunks": chunks, "copies": copies, "sources": sources, "files": files, "strides": strides}
    for _ in range(data.draw(st.integers(0, 3))):
        name = data.draw(st.sampled_from(sorted(tables)))
        table = tables[name].reshape(-1) if name == "strides" else tables[name]
        if table.ndim == 1:
            table[data.draw(st.integers(0, len(table) - 1))] = data.draw(_edges(n))
        else:
            row, col = data.draw(st.integers(0, table.shape[0] - 1)), data.draw(st.integers(0, table.shape[1] - 1))
            table[row, col] = data.draw(_edges(table.shape[0]))
    if data.draw(st.integers(0, 9)) == 0:
        blob = data.draw(st.sampled_from([blob[:-1], blob[:3] + b"\0" + blob[4:], b""]))
    nbytes = n * 64 * d_item - data.draw(st.sampled_from([0] * 8 + [1, d_item, 64]))
    batch = Guarded(max(0, nbytes), fill=0x11)
    twin = Guarded(max(0, nbytes), fill=0x11)  # a second job of the same tables in flight: chunks it may share
    note(f"tables {tables}, blob {blob!r}, kind {kind}, batch {nbytes} bytes, buffers {[b is None for b in buffers]}")
    try:
        jobs = [_engine().submit(chunks, copies, sources, files, blob, b.view, kind, False, strides, buffers)
                for b in (batch, twin)]
    except ValueError as exc:
        event("refused")
        assert "plan" in str(exc)
    else:
        event("run")
        for job in jobs:
            assert job.wait(20)
            status = np.frombuffer(job.results()[0], np.int32)
            assert set(status.tolist()) <= set(range(native.ST_PENDING))
    assert batch.intact() and twin.intact(), "a write outside the batch"


# ---------------------------------------------------------------------------------------------
# lz4, zlib and gzip: decoded whole by the engine, with lz4's and zlib's own functions

_WHOLE = {native.CODEC_LZ4: lambda: numcodecs.LZ4(), native.CODEC_ZLIB: lambda: numcodecs.Zlib(level=1),
          native.CODEC_GZIP: lambda: numcodecs.GZip(level=1)}


def _bounded(codec: int, stored: bytes, nbytes: int) -> bytes | None:
    """What the Python path decodes ``stored`` to (its bounded decoders), when that is exactly ``nbytes``."""
    from stoker.zarr.codecs import bounds as bounded

    try:
        out = bounded.decoder(_WHOLE[codec](), nbytes)(stored)
    except Exception:  # noqa: BLE001 - refused: not a chunk of this size
        return None
    out = bytes(out)
    return out if len(out) == nbytes else None


@fuzz(400)
@given(st.data())
def test_lz4_zlib_gzip_chunks_decode_as_the_python_path_does(work, data):
    """Frames numcodecs wrote (concatenated gzip members and zero padding too), damaged or not, read by the
    engine as whole chunk files and as inner chunks of a shard: a chunk the engine places holds exactly
    what the Python path's bounded decoder makes of the stored bytes; one it does not place is one that
    decoder does not read as the chunk either (left to the Python path, status FRAME), or a read that
    failed; nothing is written outside the batch. The same bytes in memory (a fetched value, whole or a range
    of it; read-only in place, or writable and copied at submit) are read as the file is."""
    codec = data.draw(st.sampled_from(sorted(_WHOLE)))
    content = data.draw(contents(max_size=data.draw(st.sampled_from([4096, 300_000]))))
    if not content:
        content = b"\1"
    stored = _WHOLE[codec]().encode(content)
    stored = bytes(stored)
    if codec == native.CODEC_GZIP and data.draw(st.booleans()):  # more members, with zero padding between and after
        cut = data.draw(st.integers(0, len(content)))
        stored = (bytes(numcodecs.GZip(1).encode(content[:cut])) + bytes(data.draw(st.integers(0, 9)))
                  + bytes(numcodecs.GZip(1).encode(content[cut:])) + bytes(data.draw(st.integers(0, 9))))
    if data.draw(st.booleans()):
        stored = data.draw(mutated(stored, [stored[::-1]], fields=[0] if codec == native.CODEC_LZ4 else []))
    nbytes = len(content) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    if nbytes < 1:
        return
    want = _bounded(codec, stored, nbytes)
    root = work / "whole"
    (root / "c").mkdir(parents=True, exist_ok=True)
    inner = data.draw(st.booleans())
    held = b"head" + stored + b"tail" if inner else stored
    (root / "c" / "0").write_bytes(held)  # key "0": rank 1
    in_memory = data.draw(st.sampled_from([None, bytes, bytearray]))  # a file, or a fetched value
    blob = os.fsencode(str(root) + "/c/")
    sources = np.array([[native.SOURCE_KINDS[np.dtype("uint8")], 0, 0, len(blob), ord("."), 0, 1]], np.int64)
    files = np.zeros((1, native.F_COORDS + 1), np.int64)
    chunks = np.zeros((1, native.N_CHUNK_COLS), np.int64)
    chunks[0, native.C_BUFFER] = -1 if in_memory is None else 0
    chunks[0, native.C_FILE] = 0 if in_memory is None else -1
    chunks[0, native.C_OFFSET], chunks[0, native.C_LENGTH] = (4, len(stored)) if inner else (-1, 0)
    chunks[0, native.C_SPAN_STOP] = chunks[0, native.C_NBYTES] = nbytes
    chunks[0, native.C_CODEC] = codec
    chunks[0, native.C_MAX_STORED] = max(0, len(stored) + data.draw(st.sampled_from([0, 0, 100, -1])))
    chunks[0, native.C_NCOPIES] = 1
    copies = np.array([[0, 0, nbytes]], np.int64)
    batch = Guarded(nbytes, fill=0x11)
    job = _engine().submit(chunks, copies, sources, files, blob, batch.view, native.KIND_SAME, False,
                           np.array([1], np.int64), *([] if in_memory is None else [[in_memory(held)]]))
    assert job.wait(20)
    status = int(np.frombuffer(job.results()[0], np.int32)[0])
    event(f"status {status}, {'a file' if in_memory is None else in_memory.__name__}")
    assert batch.intact(), "a write outside the batch"
    if status == native.ST_OK:
        assert want is not None and batch.view.tobytes() == want
    else:
        assert status in (native.ST_FRAME, native.ST_TOO_BIG), status
        assert (batch.view == 0x11).all()
        assert status == native.ST_TOO_BIG or want is None, "a chunk the Python path reads was left to it"


@fuzz(300)
@given(st.data())
def test_plan_grid_arguments(work, data):
    """The compiled grid planner takes any int64 buffers: a ValueError, or copies and chunks that are sound
    (every copy inside its crop and its chunk; chunks distinct; copies grouped by chunk)."""
    ndim = data.draw(st.integers(1, 3))
    n_src = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 4))
    edge = st.one_of(st.integers(-3, 40), st.sampled_from([-2**63, 2**62, 2**63 - 1]))
    small = data.draw(st.booleans())
    value = st.integers(0, 40) if small else edge
    shape = np.array([data.draw(st.integers(1, 12) if small else edge) for _ in range(ndim)], np.int64)
    starts = np.array([[data.draw(value) for _ in range(ndim)] for _ in range(n)], np.int64).reshape(n, ndim)
    sids = np.array([data.draw(st.integers(0, n_src - 1) if small else edge) for _ in range(n)], np.int64)
    chunk_shapes = np.array([[data.draw(st.integers(1, 9) if small else edge) for _ in range(ndim)]
                             for _ in range(n_src)], np.int64)
    strides = np.array([[data.draw(st.integers(0, 99) if small else edge) for _ in range(ndim)]
                        for _ in range(n_src)], np.int64)
    itemsizes = np.array([data.draw(st.sampled_from([1, 2, 4, 8]) if small else edge) for _ in range(n_src)], np.int64)
    try:
        copies, chunks = native.plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes)
    except (ValueError, MemoryError):
        event("refused")
        return
    event("planned")
    copies = np.frombuffer(copies, np.int64).reshape(-1, native.GRID_COPY_COLS(ndim))
    chunks = np.frombuffer(chunks, np.int64).reshape(-1, native.GRID_CHUNK_COLS + ndim)
    coords = range(native.GRID_CHUNK_COLS, native.GRID_CHUNK_COLS + ndim)
    keys = {tuple(c[[native.G_SOURCE, *coords]]) for c in chunks}
    assert len(keys) == len(chunks)
    n_copies, first = chunks[:, native.G_NCOPIES], chunks[:, native.G_FIRST_COPY]
    assert n_copies.sum() == len(copies) and (np.cumsum(n_copies) - n_copies == first).all()
    box_at, ext_at = native.GC_BOX_START(ndim), native.GC_EXTENT(ndim)
    for c in chunks:
        mine = copies[c[native.G_FIRST_COPY]:c[native.G_FIRST_COPY] + c[native.G_NCOPIES]]
        cs = chunk_shapes[c[native.G_SOURCE]]
        start, box, ext = mine[:, native.GC_CHUNK_START:box_at], mine[:, box_at:ext_at], mine[:, ext_at:]
        assert (start >= 0).all() and (ext >= 1).all() and (start + ext <= cs).all()
        assert (box >= 0).all() and (box + ext <= shape).all()


@pytest.mark.skipif(native.plan_grid is None, reason="the compiled grid planner is not built")
@pytest.mark.parametrize("which, wrong", [(0, np.array([[2.0]])), (2, np.array([4.0])), (1, np.zeros(8, np.uint8)),
                                          (3, np.array([3, 0], np.int32))])
def test_plan_grid_refuses_buffers_that_are_not_int64(which, wrong):
    """A buffer of another type whose length is a multiple of 8 bytes was read as int64 all the same: starts of
    float64 2.0 planned a crop at 2**62; eight uint8 or two int32 read as one int64. Refused, as the other
    planners refuse them."""
    args = [np.array([[2]], np.int64), np.array([0], np.int64), np.array([4], np.int64), np.array([[3]], np.int64),
            np.array([[1]], np.int64), np.array([2], np.int64)]
    native.plan_grid(*args)  # int64: planned
    args[which] = wrong
    with pytest.raises(ValueError, match="int64"):
        native.plan_grid(*args)


@pytest.mark.skipif(native.plan_grid is None, reason="the compiled grid planner is not built")
@pytest.mark.parametrize("start, chunk, stride, itemsize", [
    (2**59 + 5, 2**62, 1, 16),      # a span in bytes past 2**63 (elements times the item size)
    (2**62, 2**62, 1, 1),           # a chunk whose end is past the largest index
    (2**63 - 2, 2**62, 0, 8),       # the last chunk of the largest index
])
def test_plan_grid_extremes_refused_or_sound(start, chunk, stride, itemsize):
    """Sizes at the edge of int64: the planner refuses them (ValueError) or plans spans that are sound,
    never a wrapped (negative) byte count."""
    try:
        copies, chunks = native.plan_grid(np.array([[start]], np.int64), np.array([0], np.int64),
                                          np.array([1], np.int64), np.array([[chunk]], np.int64),
                                          np.array([[stride]], np.int64), np.array([itemsize], np.int64))
    except ValueError:
        return
    chunks = np.frombuffer(chunks, np.int64).reshape(-1, 6)
    copies = np.frombuffer(copies, np.int64).reshape(-1, 5)
    assert len(chunks) == 1 and 0 <= chunks[0, 3] < chunks[0, 4]
    assert copies[0, 2] == start - (start // chunk) * chunk and copies[0, 4] == 1


def _shard_positions_reference(index, cps, shard_strides):
    """What csrc/grid.c's shard_positions must give, in Python."""
    inner, shard_of, first, numbers = [], [], [], []
    for i, row in enumerate(index.tolist()):
        flat = 0
        for v, c in zip(row, cps.tolist()):
            flat = flat * c + v % c
        number = sum(v // c * s for v, c, s in zip(row, cps.tolist(), shard_strides.tolist()))
        if number not in numbers:
            numbers.append(number)
            first.append(i)
        inner.append(flat)
        shard_of.append(numbers.index(number))
    return inner, shard_of, first, numbers


@pytest.mark.skipif(native.shard_positions is None, reason="the compiled grid planner is not built")
@fuzz(300)
@given(st.data())
def test_shard_positions_arguments(data):
    """shard_positions takes any int64 buffers: a ValueError, or each chunk's inner index and shard, and each
    shard's first chunk and number, as the reference computes them (the reference's Python ints never wrap:
    a sum past int64 must be refused)."""
    ndim = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 12))
    small = data.draw(st.integers(0, 2)) > 0
    edge = st.one_of(st.integers(-3, 40), st.sampled_from([-2**63, -1, 2**31, 2**62, 2**63 - 1]))
    value = st.integers(0, 30) if small else edge
    index = np.array([[data.draw(value) for _ in range(ndim)] for _ in range(n)], np.int64).reshape(n, ndim)
    cps = np.array([data.draw(st.integers(1, 5) if small else edge) for _ in range(ndim)], np.int64)
    strides = np.array([data.draw(st.integers(0, 50) if small else edge) for _ in range(ndim)], np.int64)
    if data.draw(st.integers(0, 5)) == 0:  # a buffer of another rank or count
        cps = np.append(cps, 2)
    try:
        got = native.shard_positions(index, cps, strides)
    except (ValueError, MemoryError):
        event("refused")
        assert not small or len(cps) != ndim
        return
    event("placed")
    inner, shard_of, first, numbers = (np.frombuffer(b, np.int64).tolist() for b in got)
    want = _shard_positions_reference(index, cps, strides)
    assert [inner, shard_of, first, numbers] == list(want)  # the reference's ints never wrap: a sum past int64
    # would differ from any value the C code could give


@pytest.mark.skipif(native.gather_entries is None, reason="the compiled grid planner is not built")
@fuzz(300)
@given(st.data())
def test_gather_entries_arguments(data):
    """gather_entries takes any tables and int64 buffers: a ValueError, or every chunk's entry from its shard's
    table (the empty entry where its shard has none), never a read outside a table."""
    n_inner = data.draw(st.integers(0, 6))
    n_tables = data.draw(st.integers(0, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tables = [rng.integers(0, 2**63, (n_inner, 2), dtype=np.uint64) for _ in range(n_tables)]
    hostile = data.draw(st.integers(0, 3)) == 0  # out-of-range values, a malformed table or count
    if n_tables and hostile and data.draw(st.booleans()):  # one of another length, or not a table at all
        tables[-1] = data.draw(st.sampled_from([np.zeros((n_inner + 1, 2), np.uint64), np.zeros(3, np.uint8),
                                                 b"x" * 16 * n_inner, "text"]))
    n_shards = data.draw(st.integers(0, 4))
    n = data.draw(st.integers(0, 8))
    edge = st.sampled_from([-2**63, -2, 2**62, 2**63 - 1]) if hostile else st.nothing()
    slot = np.array([data.draw(st.one_of(st.integers(-1, n_tables - 1), edge)) for _ in range(n_shards)], np.int64)
    shard_of = np.array([data.draw(st.one_of(st.integers(0, max(0, n_shards - 1)), edge)) for _ in range(n)],
                        np.int64)
    inner = np.array([data.draw(st.one_of(st.integers(0, max(0, n_inner - 1)), edge)) for _ in range(n)], np.int64)
    if hostile and data.draw(st.booleans()):
        inner = inner[:-1]  # one too few
    try:
        got = native.gather_entries(tables, slot, shard_of, inner)
    except (ValueError, TypeError):
        event("refused")
        return
    event("gathered")
    got = np.frombuffer(got, np.uint64).reshape(-1, 2)
    assert len(got) == len(shard_of)
    for i, (k, j) in enumerate(zip(shard_of.tolist(), inner.tolist())):
        s = int(slot[k])
        want = [2**64 - 1] * 2 if s < 0 else \
            np.frombuffer(memoryview(tables[s]).cast("B"), np.uint64).reshape(-1, 2)[j].tolist()
        assert got[i].tolist() == want


def _fits(v: int) -> bool:
    return -2**63 <= v < 2**63


@pytest.mark.skipif(native.plan_crops is None, reason="the compiled grid planner is not built")
@fuzz(300)
@given(st.data())
def test_plan_crops_arguments(data):
    """plan_crops takes any int64 buffers: a ValueError, the first crop that ends past its array, or
    plan_grid's plan of the same crops with the bytes they need and whether an array is sharded, as Python's
    ints compute them. A box whose extent is not the batch's shape (inside its array) is refused."""
    ndim = data.draw(st.integers(1, 3))
    n_src = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 4))
    small = data.draw(st.integers(0, 2)) > 0
    edge = st.one_of(st.integers(-3, 40), st.sampled_from([-2**63, 2**62, 2**63 - 1]))
    v = (lambda lo, hi: st.integers(lo, hi)) if small else (lambda lo, hi: edge)
    shape = [data.draw(v(1, 12)) for _ in range(ndim)]
    rows = [[data.draw(st.sampled_from([1, 2, 4, 8]) if small else edge)]
            + [data.draw(v(1, 9)) for _ in range(ndim)] + [data.draw(v(0, 99)) for _ in range(ndim)]
            + [data.draw(st.integers(0, 1))] + [data.draw(v(1, 60)) for _ in range(ndim)] for _ in range(n_src)]
    sids = [data.draw(v(0, n_src - 1)) for _ in range(n)]
    boxes = []
    for _ in range(n):
        starts = [data.draw(v(0, 40)) for _ in range(ndim)]
        boxes.append([[s, s + e] if _fits(s + e) else [s, 2**63 - 1] for s, e in zip(starts, shape)])
        if data.draw(st.integers(0, 5)) == 0:  # a box of another extent than the shape on one axis
            a, d = data.draw(st.integers(0, ndim - 1)), data.draw(st.sampled_from([-2, -1, 1, 3]))
            if _fits(boxes[-1][a][1] + d):
                boxes[-1][a][1] += d
    args = [np.array(boxes, np.int64).reshape(n, ndim, 2), np.array(sids, np.int64), np.array(shape, np.int64),
            array("q", [x for r in rows for x in r])]
    if data.draw(st.integers(0, 7)) == 0:  # a buffer of another type or count
        k = data.draw(st.integers(0, 3))
        # (7 int64 fit no count here: boxes hold an even number, rows a multiple of 5, 8 or 11)
        args[k] = data.draw(st.sampled_from([np.zeros(3, np.int32), b"\0" * 24, np.zeros(7, np.int64)]))
        with pytest.raises((ValueError, TypeError)):
            native.plan_crops(*args)
        return
    # the reference: crops in order, an array number out of range refused, the first crop past its array named
    want_outside, refused = -1, False
    for s in range(n):
        if not 0 <= sids[s] < n_src:
            refused = True
            break
        if any(boxes[s][a][1] > rows[sids[s]][native.A_SHAPE(ndim) + a] for a in range(ndim)):
            want_outside = s
            break
    # past the crops' bounds (none outside), every box's extent is the shape's
    mismatched = not refused and want_outside < 0 and any(
        b[1] - b[0] != e for box in boxes for b, e in zip(box, shape))
    per = np.array(rows, np.int64)
    starts = np.array([[b[0] for b in box] for box in boxes], np.int64).reshape(n, ndim)

    def grid():  # plan_grid's plan of the same crops (it raises what it refuses)
        strides_at = native.A_STRIDES(ndim)
        return native.plan_grid(starts, args[1], args[2],
                                np.ascontiguousarray(per[:, native.A_CHUNK_SHAPE:native.A_CHUNK_SHAPE + ndim]),
                                np.ascontiguousarray(per[:, strides_at:strides_at + ndim]),
                                np.ascontiguousarray(per[:, native.A_ITEMSIZE]))

    # the bytes the crops need, each step as the C code takes it: past int64 anywhere is refused
    crop, items, steps = 1, 0, []
    for e in shape:
        crop *= e
        steps.append(crop)
    for s in sids if not refused and want_outside < 0 else ():  # (past a crop outside, a number may be any)
        items += rows[s][native.A_ITEMSIZE]
        steps.append(items)
    bytes_fit = all(_fits(v) for v in steps) and _fits(crop * items)
    try:
        copies, chunks, outside, bytes_needed, any_sharded = native.plan_crops(*args)
    except (ValueError, MemoryError):
        event("refused")
        if not refused:  # every crop inside its array: a refusal needs a reason
            assert want_outside < 0
            if mismatched:
                event("refused: a box not of the shape")
            elif bytes_fit:
                with pytest.raises((ValueError, MemoryError)):
                    grid()
        return
    assert not refused and outside == want_outside
    assert outside >= 0 or not mismatched
    if outside >= 0:
        event("outside")
        assert copies is None and chunks is None
        return
    event("planned")
    assert bytes_fit and bytes_needed == crop * items and any_sharded == any(r[native.A_SHARDED(ndim)] for r in rows)
    assert (copies, chunks) == grid()


@pytest.mark.skipif(native.plan_crops is None, reason="the compiled grid planner is not built")
@pytest.mark.parametrize("box", [(0, 2), (2, 4), (0, 3)])
def test_plan_crops_refuses_a_box_other_than_the_batch_shape(box):
    """plan_crops checks a box by its stop but plans it from its start and the batch's shape: a box whose
    extent is not that shape (here [0, 2) of an axis of 4, planned as 10 long) is refused with a ValueError
    naming the problem, never planned as a crop past its array (chunks 0..4 of a 2-chunk axis)."""
    ndim = 1
    rows = np.zeros(native.ARRAY_ROW_COLS(ndim), np.int64)
    rows[native.A_ITEMSIZE] = 1
    rows[native.A_CHUNK_SHAPE] = 2
    rows[native.A_STRIDES(ndim)] = 1
    rows[native.A_SHAPE(ndim)] = 4  # the array: 4 long, chunks of 2
    boxes = np.array([[box]], np.int64)
    with pytest.raises(ValueError, match="box.*shape"):
        native.plan_crops(boxes, np.zeros(1, np.int64), np.array([10], np.int64), rows)
    # the same box with its own extent as the shape is planned: inside the array, a chunk per 2 elements
    copies, chunks, outside, _, _ = native.plan_crops(boxes, np.zeros(1, np.int64),
                                                      np.array([box[1] - box[0]], np.int64), rows)
    assert outside == -1
    index = np.frombuffer(chunks, np.int64).reshape(-1, native.GRID_CHUNK_COLS + ndim)[:, native.GRID_CHUNK_COLS]
    assert index.tolist() == list(range(box[0] // 2, (box[1] - 1) // 2 + 1))


@pytest.mark.skipif(native.chunk_rows is None, reason="the compiled engine is not built")
@fuzz(300)
@given(st.data())
def test_chunk_rows_arguments(data):
    """chunk_rows takes any columns: a ValueError (a chunk number or array out of range, columns of other
    lengths or types), or the engine's chunks table as numpy builds it. Columns may be strided views (a plan's
    columns are views of plan_grid's rows)."""
    n = data.draw(st.integers(0, 6))
    n_src = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hostile = data.draw(st.integers(0, 3)) == 0
    info = rng.integers(-5, 2**40, (n_src, native.N_INFO_COLS), dtype=np.int64)
    # a wider table: its columns are strided views
    plan = rng.integers(-2, 2**40, (n, native.N_PLAN_COLS + 1), dtype=np.int64)
    plan[:, native.P_SOURCE] = rng.integers(0, n_src, n) if not hostile else rng.integers(-2, n_src + 2, n)
    plan[:, native.P_FILE] = rng.integers(-1, 4, n)
    cols = [plan[:, k] for k in range(native.N_PLAN_COLS)]
    eids = data.draw(st.one_of(st.none(), st.lists(st.integers(-2, n + 1) if hostile else
                                                   st.integers(0, max(0, n - 1)), max_size=8 if n else 0)))
    eids = None if eids is None else np.array(eids, np.int64)
    fetched = data.draw(st.booleans())
    if hostile and data.draw(st.booleans()):
        k = data.draw(st.integers(0, 8))
        bad = data.draw(st.sampled_from([np.zeros(n + 1, np.int64), np.zeros(n, np.int32), b"\0" * 8 * n]))
        if k == 8:
            info = bad if data.draw(st.booleans()) else np.zeros((n_src, native.N_INFO_COLS - 1), np.int64)
        else:
            cols[k] = bad
    try:
        got = native.chunk_rows(info, *cols, eids, fetched)
    except (ValueError, TypeError):
        event("refused")
        assert hostile
        return
    event("made")
    take = np.arange(n) if eids is None else eids
    assert ((take >= 0) & (take < n)).all()
    src = plan[take, native.P_SOURCE]
    assert ((src >= 0) & (src < n_src)).all()
    want = np.empty((len(take), native.N_CHUNK_COLS), np.int64)
    want[:, native.C_SOURCE] = src
    for i_col, c_col in ((native.I_CODEC, native.C_CODEC), (native.I_NBYTES, native.C_NBYTES),
                         (native.I_STORED, native.C_MAX_STORED)):
        want[:, c_col] = info[src, i_col]
    if fetched:
        want[:, native.C_FILE] = want[:, native.C_OFFSET] = -1
        want[:, native.C_LENGTH] = 0
        want[:, native.C_BUFFER] = np.arange(len(take))
    else:
        for p_col, c_col in ((native.P_FILE, native.C_FILE), (native.P_OFFSET, native.C_OFFSET),
                             (native.P_LENGTH, native.C_LENGTH)):
            want[:, c_col] = plan[take, p_col]
        want[:, native.C_BUFFER] = -1
        want[want[:, native.C_FILE] < 0, native.C_CODEC] = native.CODEC_FILL
    for p_col, c_col in ((native.P_SPAN_START, native.C_SPAN_START), (native.P_SPAN_STOP, native.C_SPAN_STOP),
                         (native.P_FIRST_COPY, native.C_FIRST_COPY), (native.P_NCOPIES, native.C_NCOPIES)):
        want[:, c_col] = plan[take, p_col]
    assert np.frombuffer(got, np.int64).reshape(-1, native.N_CHUNK_COLS).tolist() == want.tolist()


def _copies_apart(table: list[list[int]], ndim: int, row_stride: int, strides: list[int]) -> bool:
    """Whether copy_rows places these copies (plan_grid's rows) apart: rows and starts not negative, extents
    positive, and, per axis as far as the copies reach (the rows: the largest row + 1), the axes of length > 1
    by increasing stride each past what those before it span (tables.c's copies_overlap)."""
    box_at, ext_at = native.GC_BOX_START(ndim), native.GC_EXTENT(ndim)
    lengths, rows = [1] * ndim, 1
    for r in table:
        box, ext = r[box_at:ext_at], r[ext_at:]
        if r[native.GC_ROW] < 0 or any(b < 0 for b in box) or any(e < 1 for e in ext) or \
                not all(_fits(b + e) for b, e in zip(box, ext)):
            return False
        rows = max(rows, r[native.GC_ROW] + 1)
        lengths = [max(n, b + e) for n, b, e in zip(lengths, box, ext)]
    span = 0
    for n, s in sorted(((n, s) for n, s in zip(lengths + [rows], strides + [row_stride]) if n > 1),
                       key=lambda axis: axis[1]):
        span += (n - 1) * s
        if s <= span - (n - 1) * s or not _fits(span):
            return False
    return True


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled engine is not built")
@fuzz(300)
@given(st.data())
def test_copy_rows_arguments(data):
    """copy_rows takes any columns: a ValueError (a place past int64, columns of other lengths, ranks or
    types), or each copy's (first element in its chunk, first in the batch, extent) as Python's ints give them."""
    ndim = data.draw(st.integers(1, 4))
    m = data.draw(st.integers(0, 6))
    small = data.draw(st.integers(0, 2)) > 0
    edge = st.one_of(st.integers(-3, 50), st.sampled_from([-2**63, 2**31, 2**62, 2**63 - 1]))
    value = st.integers(0, 50) if small else edge
    width, box_at, ext_at = native.GRID_COPY_COLS(ndim), native.GC_BOX_START(ndim), native.GC_EXTENT(ndim)
    table = np.array([[data.draw(value) for _ in range(width)] for _ in range(m)],
                     np.int64).reshape(m, width)  # plan_grid's layout: the columns are views of it
    row_stride = data.draw(value)
    strides = [data.draw(value) for _ in range(ndim)]
    args = [table[:, native.GC_SRC_OFFSET], table[:, native.GC_ROW], table[:, box_at:ext_at], table[:, ext_at:],
            row_stride, array("q", strides)]
    if data.draw(st.integers(0, 7)) == 0:  # a column of another length, rank or type
        k = data.draw(st.sampled_from([0, 1, 2, 3, 5]))
        wrong = {0: [np.zeros(m + 1, np.int64), np.zeros((m, ndim + 1), np.int64), np.zeros(m, np.int32), b"\0" * 8],
                 2: [np.zeros(m + 1, np.int64), np.zeros((m, ndim + 1), np.int64), np.zeros((m, ndim), np.int32)],
                 5: [np.zeros(ndim, np.int32), b"\0" * 8, array("q"), array("q", [1] * 33)]}
        args[k] = data.draw(st.sampled_from(wrong[{1: 0, 3: 2}.get(k, k)]))
        with pytest.raises((ValueError, TypeError)):
            native.copy_rows(*args)
        return
    want = [] if _copies_apart(table.tolist(), ndim, row_stride, strides) else None
    for r in table.tolist() if want is not None else ():
        row, box = r[native.GC_ROW], r[box_at:ext_at]
        dst = row * row_stride + sum(b * s for b, s in zip(box, strides))
        partial = [row * row_stride]
        for b, s in zip(box, strides):
            partial.append(partial[-1] + b * s)
        if not all(_fits(p) for p in partial) or not all(_fits(b * s) for b, s in zip(box, strides)):
            want = None
            break
        copy = [0] * native.COPY_COLS(ndim)
        copy[native.CP_SRC_OFFSET], copy[native.CP_DST_OFFSET] = r[native.GC_SRC_OFFSET], dst
        copy[native.CP_EXTENT:] = r[ext_at:]
        want.append(copy)
    try:
        got = native.copy_rows(*args)
    except ValueError:
        event("refused")
        assert want is None
        return
    event("made")
    assert want is not None
    assert np.frombuffer(got, np.int64).reshape(-1, native.COPY_COLS(ndim)).tolist() == want


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled grid planner is not built")
def test_copy_rows_takes_strided_columns_and_refuses_repeated_memory():
    """copy_rows copied each column (csrc/py_args.c int64_matrix) into rows x cols int64 by the buffer's
    logical size, as if that were memory the caller holds: a np.broadcast_to column (stride 0) of 2**47 rows,
    8 bytes of memory, asked for a 1 PiB allocation (a MemoryError; at a size the machine's overcommit lets
    through, tens of GiB written from 8 bytes), and a small one was silently taken. A column whose values
    repeat in memory (a zero stride, rows overlapping: np.broadcast_to, sliding_window_view) is refused now
    with a ValueError that names it and the fix; strided views (a table's columns, reversed) are read as
    their values, as before."""
    ndim, m = 2, 3
    # per copy: its offset in the chunk, its batch row, its start in the crop, its extent; two spare columns
    table = np.array([[5, 0, 1, 2, 3, 4, -1, -1], [7, 1, 0, 0, 2, 2, -1, -1], [9, 2, 3, 1, 1, 5, -1, -1]], np.int64)
    src, row, box, ext = table[:, 0], table[:, 1], table[:, 2:4], table[:, 4:6]
    strides = array("q", [100, 1])
    want = native.copy_rows(*(np.ascontiguousarray(c) for c in (src, row, box, ext)), 10000, strides)
    assert native.copy_rows(src, row, box, ext, 10000, strides) == want  # the table's strided columns
    reversed_ = native.copy_rows(src[::-1], row[::-1], box[::-1], ext[::-1], 10000, strides)
    assert np.frombuffer(reversed_, np.int64).reshape(m, -1).tolist() == \
        np.frombuffer(want, np.int64).reshape(m, -1)[::-1].tolist()
    huge = np.broadcast_to(np.int64(0), (2**47,))
    repeated = [
        (0, huge), (1, huge),  # 1 PiB of logical int64 in 8 bytes
        (0, np.broadcast_to(src[:1], (m,))),  # a small broadcast: every row the same address
        (2, np.broadcast_to(box[:1], (m, ndim))),
        (3, np.lib.stride_tricks.sliding_window_view(np.arange(m + 1, dtype=np.int64), ndim)),  # rows overlap
    ]
    for k, column in repeated:
        args = [src, row, box, ext]
        args[k] = column
        if len(column) != m:
            args = [np.broadcast_to(np.int64(0), (len(column),) + a.shape[1:]) if i != k else a
                    for i, a in enumerate(args)]
        with pytest.raises(ValueError, match=r"repeats values in memory .*np.ascontiguousarray"):
            native.copy_rows(*args, 10000, strides)
    with pytest.raises(ValueError, match="repeats values in memory"):
        native.copy_rows(src, row, box, ext, 10000, np.broadcast_to(np.int64(1), (ndim,)))


# ---------------------------------------------------------------------------------------------
# Disk-cache entries (csrc/entries.c): entry files in storage/diskcache.py's layout, sound or damaged, which
# the engine reads whole into its scratch and checks before it decodes a byte of them

_ENTRY_ENGINE = None


def entry_bytes(ident: bytes, payload: bytes) -> bytes:
    """An entry as DiskCache.write lays it out."""
    crc = crc32c.crc32c(payload, crc32c.crc32c(ident))
    return HEADER.pack(MAGIC, 0, crc, len(ident), len(payload)) + ident + payload


def sound(raw: bytes, ident: bytes, max_stored: int) -> bool:
    """The oracle: DiskCache's checks of an entry read whole (its header, length, checksum and ident), and the
    chunk's bound on what it stores."""
    if len(raw) < HEADER.size:
        return False
    magic, _, crc, ident_len, length = HEADER.unpack_from(raw)
    body = raw[HEADER.size:]
    return (magic == MAGIC and ident_len == len(ident) and len(body) == ident_len + length and length <= max_stored
            and crc32c.crc32c(body) == crc and body[:ident_len] == ident)


def plant_entry(path, target, damage: str, raw: bytes) -> bool:
    """Put at ``path`` what a fuzz example's ``damage`` asks (a link to ``target`` holding ``raw``, a FIFO, a
    folder, nothing, or ``raw`` itself), after clearing what an earlier example left there; True when ``path``
    is a regular file of ``raw``."""
    for old in (path, target):
        if old.is_dir() and not old.is_symlink():
            old.rmdir()
        elif os.path.lexists(old):
            old.unlink()
    if damage == "link":
        target.write_bytes(raw)
        os.symlink(target, path)
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "folder":
        path.mkdir()
    elif damage != "missing":
        path.write_bytes(raw)
        return True
    return False


def entry_job(path: bytes, ident: bytes, nbytes: int, max_stored: int, span: tuple[int, int],
              rows: np.ndarray | None = None, blob: bytes | None = None, buffers=None, offset: int = -1):
    """One zstd chunk of ``nbytes`` read from the entry file ``path`` (expected ``ident``) into a guarded
    batch of its span; returns (status, detail, batch)."""
    global _ENTRY_ENGINE
    if _ENTRY_ENGINE is None:
        _ENTRY_ENGINE = native.Engine(2, 1 << 26)
    a, b = span
    chunks = np.zeros((1, native.N_CHUNK_COLS), np.int64)
    chunks[0, native.C_FILE] = -1
    chunks[0, native.C_OFFSET], chunks[0, native.C_LENGTH] = (offset, 0 if offset < 0 else 4)
    chunks[0, native.C_SPAN_START], chunks[0, native.C_SPAN_STOP] = a, b
    chunks[0, native.C_CODEC], chunks[0, native.C_NBYTES] = native.CODEC_ZSTD, nbytes
    chunks[0, native.C_MAX_STORED], chunks[0, native.C_NCOPIES] = max_stored, 1
    sources = np.array([[native.SOURCE_KINDS[np.dtype("uint8")], 0, 0, 1, ord("."), 0, 1]], np.int64)
    if rows is None:
        rows = np.array([[0, len(path), len(path), len(ident)]], np.int64)
        blob = path + ident
    batch = Guarded(b - a, fill=0x11)
    job = _ENTRY_ENGINE.submit(chunks, np.array([[a, 0, b - a]], np.int64), sources,
                               np.zeros((0, native.F_COORDS + 1), np.int64), b"x", batch.view, native.KIND_SAME, False,
                               np.array([1], np.int64), [None] if buffers is None else buffers, rows, blob)
    assert job.wait(20)
    status, detail, _ = job.results()
    assert batch.intact(), "a write outside the batch"
    return int(np.frombuffer(status, np.int32)[0]), int(np.frombuffer(detail, np.int64)[0]), batch


@fuzz(300)
@given(data=st.data())
def test_disk_cache_entries(work, data):
    """Sound entries decode to numcodecs' bytes and are touched; every damaged one (a bit flipped anywhere, cut
    short, extended, a header field rewritten, another ident, random bytes, a link, a FIFO, a folder, none) is
    ST_ENTRY, never decoded, never a read past what the file and the bounds allow."""
    content = data.draw(contents(max_size=20_000))
    if not content:
        content = b"\0"
    payload = numcodecs.Zstd(level=1).encode(content)
    ident = data.draw(st.binary(max_size=300))
    raw = entry_bytes(ident, payload)
    max_stored = max(0, len(payload) + data.draw(st.sampled_from([0, 0, 64, 4096, -1, -len(payload)])))
    damage = data.draw(st.sampled_from(["none", "flip", "cut", "extend", "field", "ident", "random", "link", "fifo",
                                        "folder", "missing"]))
    event(damage)
    expected = ident
    if damage == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1:]
    elif damage == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "extend":
        raw = raw + data.draw(st.binary(min_size=1, max_size=100))
    elif damage == "field":  # the crc, the ident's length or the payload's, as any value
        at, size = data.draw(st.sampled_from([(8, 4), (12, 4), (16, 8)]))
        value = data.draw(st.sampled_from([0, 1, len(ident) + 1, len(payload) - 1, (1 << 8 * size) - 1,
                                           1 << (8 * size - 1)]))
        raw = raw[:at] + value.to_bytes(size, "little") + raw[at + size:]
    elif damage == "ident":
        expected = data.draw(st.binary(max_size=300).filter(lambda b: b != ident))
    elif damage == "random":
        raw = data.draw(st.binary(max_size=400))
    name = f"entry-{damage}"
    path = work / name
    if plant_entry(path, work / "target", damage, raw):
        os.utime(path, (1_000_000, 1_000_000))
    a, b = data.draw(spans(len(content)))
    if b <= a:
        a, b = 0, len(content)
    status, detail, batch = entry_job(os.fsencode(path), expected, len(content), max_stored, (a, b))
    good = damage not in ("link", "fifo", "folder", "missing") and sound(raw, expected, max_stored)
    if good:
        assert status == native.ST_OK, (status, detail)
        assert detail == len(payload)  # the payload bytes it served
        assert batch.view.tobytes() == content[a:b]
        assert os.stat(path).st_mtime > 1_000_000 + 1e8  # touched: the cache's LRU clock
    else:
        assert status == native.ST_ENTRY, (status, detail)
        assert detail in (native.ENTRY_GONE, native.ENTRY_UNREADABLE, native.ENTRY_SIZE, native.ENTRY_LAYOUT,
                          native.ENTRY_OTHER_IDENT, native.ENTRY_CHECKSUM)
        assert (batch.view == 0x11).all()  # nothing of it placed


@pytest.mark.parametrize("case", ["path past the blob", "negative path start", "no path", "path with NUL",
                                  "ident past the blob", "ident too long", "huge lengths", "a buffer too",
                                  "a byte range", "rows for other buffers", "rows without a blob"])
def test_disk_cache_entry_tables_are_checked(work, case):
    """Entry rows that name bytes outside the entry blob, a path the engine cannot open as given, an ident past
    the cap, an entry that also has a buffer or a byte range: refused before any thread reads them."""
    path, ident = os.fsencode(work / "never-read"), b"ident"
    rows = np.array([[0, len(path), len(path), len(ident)]], np.int64)
    blob, buffers, offset = path + ident, None, -1
    if case == "path past the blob":
        rows[0, native.E_PATH_LEN] = len(blob) + 1
    elif case == "negative path start":
        rows[0, native.E_PATH_START] = -1
    elif case == "no path":
        rows[0, native.E_PATH_LEN] = 0
    elif case == "path with NUL":
        blob = path[:-1] + b"\0" + ident
    elif case == "ident past the blob":
        rows[0, native.E_IDENT_LEN] = len(ident) + 1
    elif case == "ident too long":
        blob = path + b"i" * (native.ENTRY_IDENT_CAP + 1)
        rows[0, native.E_IDENT_LEN] = native.ENTRY_IDENT_CAP + 1
    elif case == "huge lengths":
        rows[0, native.E_IDENT_START] = rows[0, native.E_IDENT_LEN] = (1 << 63) - 1
    elif case == "a buffer too":
        buffers = [b"stored bytes"]
    elif case == "a byte range":
        offset = 0
    elif case == "rows for other buffers":
        rows = np.concatenate([rows, rows])
    elif case == "rows without a blob":
        blob = None
    with pytest.raises(ValueError):
        entry_job(path, ident, 100, 200, (0, 100), rows, blob, buffers, offset)


def staged_entry(path: bytes, ident: bytes, bound: int) -> tuple[int, int, bytes]:
    """The same entry read by the GPU decode's staging (csrc/staging.c: stage_read, an ENTRY row of that bound
    read on the calling thread): (status, detail, the bytes placed)."""
    from stoker.engine.gpu import native_reads

    buf = bytearray(bound + 64)
    table = np.array([[0, native_reads.ENTRY, bound, 0]], np.int64)
    out = native_reads.read(buf, path + b"\0", np.zeros((1, 6), np.int64), table, 0, 1,
                            (ident, np.array([[0, len(ident)]], np.int64)))
    status, detail, at = (int(v) for v in out[0, [native_reads.STATUS, native_reads.DETAIL, native_reads.AT]])
    return status, detail, bytes(buf[at:at + detail]) if status == native.ST_OK else b""


@fuzz(150)
@given(data=st.data())
def test_engine_and_staging_judge_and_touch_an_entry_alike(work, data):
    """One entry (sound, or damaged as the disk cache may find one), last used long ago, within the minute or in
    the future (another host's clock), read by the CPU engine (read_entry) and by the GPU decode's staging
    (stage_read): the same status and ENTRY_* detail, the same payload, and both touch it (the LRU clock) or
    neither; a sound one is touched unless it was used within the minute (relatime). The staging touched every
    hit and checked entries with code of its own."""
    content = data.draw(st.binary(min_size=1, max_size=5000))
    payload = numcodecs.Zstd(level=1).encode(content)
    ident = data.draw(st.binary(max_size=200))
    raw = entry_bytes(ident, payload)
    bound = max(1, len(payload) + data.draw(st.sampled_from([0, 0, 64, -1])))
    damage = data.draw(st.sampled_from(["none", "none", "flip", "cut", "extend", "field", "ident", "link", "fifo",
                                        "folder", "missing"]))
    age = data.draw(st.sampled_from(["long ago", "within the minute", "future"]))
    event(f"{damage}, {age}")
    expected = ident
    if damage == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1:]
    elif damage == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "extend":
        raw = raw + data.draw(st.binary(min_size=1, max_size=100))
    elif damage == "field":
        at, size = data.draw(st.sampled_from([(8, 4), (12, 4), (16, 8)]))
        raw = raw[:at] + data.draw(st.integers(0, (1 << 8 * size) - 1)).to_bytes(size, "little") + raw[at + size:]
    elif damage == "ident":
        expected = data.draw(st.binary(max_size=200).filter(lambda b: b != ident))
    path = work / f"alike-{damage}"
    plant_entry(path, work / "alike-target", damage, raw)
    when = {"long ago": 10**15, "within the minute": time.time_ns() - 30 * 10**9,
            "future": time.time_ns() + 3600 * 10**9}[age]

    def read(how):
        if damage not in ("link", "fifo", "folder", "missing"):
            os.utime(path, ns=(when, when))
        if how == "engine":
            status, detail, batch = entry_job(os.fsencode(path), expected, len(content), bound, (0, len(content)))
            got = payload if status == native.ST_OK and batch.view.tobytes() == content else b""
        else:
            status, detail, got = staged_entry(os.fsencode(path), expected, bound)
        touched = damage not in ("link", "fifo", "folder", "missing") and os.stat(path).st_mtime_ns != when
        return status, detail, got, touched

    engine_side, staged = read("engine"), read("staging")
    good = damage not in ("link", "fifo", "folder", "missing") and sound(raw, expected, bound)
    assert staged[0] == (native.ST_OK if good else native.ST_ENTRY), staged
    assert staged[3] == (good and age != "within the minute"), (staged, age)
    if good:
        assert staged[2] == payload
    assert engine_side == staged


# A C library put before libc (LD_PRELOAD) that answers EAGAIN to every pread of a descriptor opened under an
# armed folder while that descriptor is non-blocking: a file system that honours O_NONBLOCK for regular files
# (some FUSE and network ones do). Entries are opened non-blocking (a FIFO planted at an entry's name must not
# hang the open) and made blocking only when a read says EAGAIN, not with an fcntl per entry read.
_NONBLOCK_SHIM = preload_shim.OPENS + r"""
static char prefix[4096];
static size_t prefix_len;
static char opened_under[65536];
static long refused;

void nonblock_arm(const char *p) { strncpy(prefix, p, sizeof prefix - 1); prefix_len = strlen(prefix); }
long nonblock_refused(void) { return __atomic_load_n(&refused, __ATOMIC_RELAXED); }

static int under(const char *path) { return prefix_len && path && strncmp(path, prefix, prefix_len) == 0; }
static int honoured(int fd) {
    return fd >= 0 && fd < (int)sizeof opened_under && __atomic_load_n(&opened_under[fd], __ATOMIC_RELAXED) &&
           (fcntl(fd, F_GETFL) & O_NONBLOCK);
}
static int opened(open_fn real, const char *path, int flags, mode_t mode) {
    int fd = real(path, flags, mode);
    if (fd >= 0 && fd < (int)sizeof opened_under)
        __atomic_store_n(&opened_under[fd], (char)under(path), __ATOMIC_RELAXED);
    return fd;
}
#define REFUSE(fd) if (honoured(fd)) { __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED); errno = EAGAIN; return -1; }
ssize_t pread(int fd, void *buf, size_t n, off_t at) {
    REAL(pread);
    REFUSE(fd)
    return real(fd, buf, n, at);
}
ssize_t pread64(int fd, void *buf, size_t n, off64_t at) {
    REAL(pread64);
    REFUSE(fd)
    return real(fd, buf, n, at);
}
"""

_NONBLOCK_READS = textwrap.dedent("""
    import ctypes, os, sys
    import numpy as np
    import test_native_fuzz as t
    from stoker.engine.cpu import native
    from stoker.storage import diskcache
    path, ident, content = os.fsencode(sys.argv[1]), sys.argv[2].encode(), bytes.fromhex(sys.argv[3])
    chunk = sys.argv[4]
    payload_len = os.path.getsize(path) - 24 - len(ident)
    shim = ctypes.CDLL(None)
    if not hasattr(shim, "nonblock_arm"):
        sys.exit(77)  # the library was not preloaded (preload_shim.NOT_PRELOADED)
    shim.nonblock_arm(os.fsencode(os.path.dirname(sys.argv[1])))
    engine = t.entry_job(path, ident, len(content), payload_len, (0, len(content)))
    staged = t.staged_entry(path, ident, payload_len)
    whole = open(path, "rb").read()
    files = native.read_files([os.fsdecode(path)], 1 << 20)  # the disk cache's hits read by the engine
    alone = diskcache.read_file(os.fsdecode(path), 1 << 20)  # ... and in Python
    out = np.zeros(len(content), np.uint8)
    decoded = t.native_testing.decode_files(native.CODEC_ZSTD, [chunk], [(-1, 0, 0, len(content))],
                                            np.empty(len(content) + 64, np.uint8), [out], len(content), None, None)
    print(engine[:2], engine[2].view.tobytes() == content, staged[:2], files[0] is not None and
          bytes(files[0]) == whole, alone == whole, decoded[0][0], out.tobytes() == content, shim.nonblock_refused())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="the file system that honours O_NONBLOCK is an LD_PRELOAD library (Linux, glibc)")
def test_an_entry_on_a_file_system_that_honours_o_nonblock_is_read(tmp_path, tmp_path_factory):
    # Each entry read made the descriptor blocking with an fcntl (a system call per entry) before its pread. Now
    # only a read that says EAGAIN does: the entry is read all the same, by the engine, by the staging, by the
    # engine's read_files and the Python read_file (the disk cache's hits), and a chunk file by the engine's
    # reader (io.c), each after one EAGAIN.
    shim = preload_shim.build(tmp_path_factory, _NONBLOCK_SHIM)
    content = bytes(range(256)) * 20
    ident = b"s3://bucket/a.zarr\nc/0/0\n5120"
    (tmp_path / "entries").mkdir()
    path = tmp_path / "entries" / "ab0123"
    path.write_bytes(entry_bytes(ident, numcodecs.Zstd(level=1).encode(content)))
    chunk = tmp_path / "entries" / "c0"
    chunk.write_bytes(numcodecs.Zstd(level=1).encode(content))
    out = preload_shim.run(shim, _NONBLOCK_READS, str(path), ident.decode(), content.hex(), str(chunk))
    assert out.returncode == 0, out.stderr
    payload_len = path.stat().st_size - HEADER.size - len(ident)
    # all read OK (the engine decoding the content), after one EAGAIN each made the descriptor blocking
    assert out.stdout.split() == [f"({native.ST_OK},", f"{payload_len})", "True", f"({native.ST_OK},",
                                  f"{payload_len})", "True", "True", str(native.ST_OK), "True", "5"], \
        (out.stdout, out.stderr)


#: lengths about every path's edges: the byte tail, 8-byte steps, the three 8 KiB streams, the foldings' least
#: (512), their 256- and 128-byte loops, their 64-, 32- and 16-byte steps and tail, a disk-cache entry's size
CRC_LENGTHS = (0, 1, 7, 8, 9, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 13, 100_003, *range(496, 530), 575, 576, 577,
               607, 608, 624, 639, 640, 641, 671, 672, 688, 703, 704, 767, 768, 769, 831, 832, 847, 848, 1023,
               1024, 1025, 4096 + 15, 721_731)


def _crc_mismatches() -> list:
    out = []
    for n in CRC_LENGTHS:
        block = os.urandom(n)
        for seed in (0, 1, 0xFFFFFFFF):
            if native.crc32c(block, seed) != crc32c.crc32c(block, seed):
                out.append((n, seed))
    return out


def test_the_engines_crc32c_is_the_crc32c_packages():
    assert _crc_mismatches() == []


def _crc_path_for_this_cpu(no_fold: bool) -> str:
    """The way the engine's crc32c must go on this CPU, from /proc/cpuinfo's flags (as entries.c decides)."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    if "sse4_2" not in flags:
        return "table"
    if not no_fold and {"avx512f", "avx512vl", "vpclmulqdq", "pclmulqdq"} <= flags:
        return "fold"
    if not no_fold and {"avx2", "vpclmulqdq", "pclmulqdq"} <= flags:
        return "fold256"
    return "sse42"


def _crc_path_in_child(value: str | None) -> str:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "STOKER_NO_CRC_FOLD"}
    if value is not None:
        env["STOKER_NO_CRC_FOLD"] = value
    code = "from stoker import _native; print(_native.crc32c_path())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"),
                    reason="the CPU's flags read from /proc/cpuinfo (x86-64 Linux)")
def test_the_crc32c_goes_the_way_the_cpu_and_stoker_no_crc_fold_say():
    """So the test below compares the folding with the crc32 instruction, not a way with itself: the folding
    where the CPU has it, refused by STOKER_NO_CRC_FOLD=1/true/yes only (0, no, empty: the CPU's way)."""
    from stoker import _native

    assert _native.crc32c_path() == _crc_path_for_this_cpu(os.environ.get("STOKER_NO_CRC_FOLD", "").lower()
                                                           in ("1", "true", "yes"))
    for value in ("1", "true", "YES"):
        assert _crc_path_in_child(value) == _crc_path_for_this_cpu(True), value
    for value in (None, "0", "no", "false", ""):
        assert _crc_path_in_child(value) == _crc_path_for_this_cpu(False), value


def test_the_crc32c_without_folding_is_the_crc32c_packages():
    """The crc32 instruction's three streams alone, as a CPU without VPCLMULQDQ runs them (STOKER_NO_CRC_FOLD,
    read once a process: in a child), give the package's values too, as the folding does (this process)."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json\nfrom stoker import _native\nassert not _native.crc32c_path().startswith('fold'), 'still folding'\n"
            "from test_native_fuzz import _crc_mismatches\nprint(json.dumps(_crc_mismatches()))\n")
    env = dict(os.environ, STOKER_NO_CRC_FOLD="1",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.timeout(120)
@pytest.mark.skipif("ASAN_OPTIONS" in os.environ,  # .ci/asan: its allocator logs each refused allocation, a report
                    reason="AddressSanitizer logs the allocations this test has refused")
def test_read_files_of_sparse_files_past_one_allocation_is_none_not_an_overflow(tmp_path):
    # Before: up to 64 sizes, each at most max_bytes (any long long), were summed into a long long unchecked (sparse
    # files claiming 2**62 bytes each wrapped the group's total: a small allocation, writes past its end), and a
    # group whose files' claims no allocation could hold failed the whole call (a MemoryError on a cache's reads)
    # files claim sizes past the memory to hold them (the allocation fails, no crash), two of them past a long
    # long's range together where the file system allows that (the sum checked); sparse: no block taken
    huge = [tmp_path / f"huge{i}" for i in range(3)]
    size = 1 << 62
    for path in huge:
        path.write_bytes(b"")
        while True:
            try:
                os.truncate(path, size)
                break
            except OSError as exc:  # EFBIG, EINVAL: beyond this file system's largest file
                if size <= 1 << 40:
                    pytest.skip(f"no sparse file of 1 TiB here ({exc})")
                size >>= 1
    small = tmp_path / "small"
    small.write_bytes(b"stoker" * 100)
    paths = [str(small)] + [str(p) for p in huge] + [str(small)]
    got = native.read_files(paths, (1 << 63) - 1)
    # the small ones read whole; no huge one (none fits one allocation beside another's claim, nor alone in memory)
    assert bytes(got[0]) == bytes(got[-1]) == b"stoker" * 100
    assert len(got) == 5 and all(g is None for g in got[1:4])


# ---------------------------------------------------------------------------------------------
# blend_mean (csrc/blend.c): a TileWriter's weighted mean, from any Python arguments


def _blend_array(data, shape, dtype, hostile):
    """An array of ``shape``: C order, a strided view, a ctypes array (its buffer gives no strides) or, hostile,
    unaligned (an offset into its bytes)."""
    how = data.draw(st.sampled_from(["c", "strided", "ctypes"] + (["unaligned"] if hostile else [])))
    dt = np.dtype(dtype)
    if how == "strided":
        return np.zeros(tuple(2 * n for n in shape), dt)[tuple(slice(None, None, 2) for _ in shape)]
    if how == "ctypes" and dt in (np.float32, np.float64):
        t = ctypes.c_float if dt.itemsize == 4 else ctypes.c_double
        for n in reversed(shape):
            t = t * n
        return t()
    if how == "unaligned":
        return np.frombuffer(bytearray(int(np.prod(shape)) * dt.itemsize + 1), dt, offset=1).reshape(shape)
    return np.zeros(shape, dt)


def _aligned(a: np.ndarray) -> bool:
    """Whether every element lies on its type's alignment, as blend.c judges it (numpy calls an empty array
    aligned wherever it starts)."""
    size = a.dtype.itemsize
    return a.ctypes.data % size == 0 and all(s % size == 0 for s in a.strides)


@pytest.mark.skipif(native.blend_mean is None, reason="the compiled engine is not built")
@fuzz(300)
@given(st.data())
def test_blend_mean_arguments(data):
    """blend_mean takes any arguments: a ValueError, TypeError or BufferError (an output or part of another type, rank or
    layout than it reads, a part outside the output, a window of another length or type), or numpy's blend,
    bit for bit, of outputs and parts in any layout: C order, strided, ctypes (no strides given), of any
    extents, 0 included."""
    hostile = data.draw(st.integers(0, 3)) == 0
    floats = st.sampled_from([np.float32, np.float64])
    nd = data.draw(st.integers(0, 9) if hostile else st.integers(2, 4))
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=nd, max_size=nd)))
    out_dtype = data.draw(st.sampled_from([np.float32, np.float64, np.int32, np.float16]) if hostile else floats)
    out = _blend_array(data, shape, out_dtype, hostile)
    view = np.ctypeslib.as_array(out) if not isinstance(out, np.ndarray) else out
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    view[...] = rng.normal(size=shape) * 10
    sound = (out_dtype in (np.float32, np.float64) and 2 <= nd <= 8 and _aligned(view))
    parts = []
    for _ in range(data.draw(st.integers(0, 4))):
        bad = hostile and data.draw(st.integers(0, 3)) == 0
        p_nd = data.draw(st.integers(0, 9)) if bad else nd
        ext = [shape[0] if (a == 0 and not (bad and data.draw(st.booleans())) and a < nd)
               else data.draw(st.integers(0, 5)) for a in range(p_nd)]
        if not bad and nd >= 1:
            ext = [shape[0]] + [data.draw(st.integers(0, n)) for n in shape[1:]]
        p_dtype = data.draw(st.sampled_from([np.float32, np.float64, np.int64]) if bad else floats)
        values = _blend_array(data, tuple(ext), p_dtype, bad)
        v_view = np.ctypeslib.as_array(values) if not isinstance(values, np.ndarray) else values
        v_view[...] = rng.normal(size=tuple(ext)) * 10
        offsets = [data.draw(st.integers(-2, 6) if bad else st.integers(0, max(0, n - e)))
                   for n, e in zip(shape[1:], ext[1:])]
        if bad and data.draw(st.booleans()):
            offsets = offsets[:-1] if offsets and data.draw(st.booleans()) else offsets + [0]
        windows = [rng.random(e) + 0.1 for e in ext[1:]]
        if bad and windows and data.draw(st.booleans()):
            k = data.draw(st.integers(0, len(windows) - 1))
            windows[k] = data.draw(st.sampled_from([windows[k].astype(np.float32), windows[k][:-1] if len(windows[k])
                                                    else np.ones(1), np.ones((1, len(windows[k]))), "w"]))
        part_sound = (p_dtype in (np.float32, np.float64) and p_nd == nd and ext[:1] == list(shape[:1])
                      and _aligned(v_view) and len(offsets) == nd - 1 == len(windows)
                      and all(0 <= o and o + e <= n for o, e, n in zip(offsets, ext[1:], shape[1:]))
                      and all(isinstance(w, np.ndarray) and w.dtype == np.float64 and w.shape == (e,)
                              for w, e in zip(windows, ext[1:])))
        sound = sound and part_sound
        parts.append((values, tuple(offsets), tuple(windows)))
    before = view.copy()
    try:
        native.blend_mean(out, parts)
    except (ValueError, TypeError, BufferError):  # (BufferError: a numpy scalar, the 0-d "view", is read-only)
        event("refused")
        assert not sound
        assert np.array_equal(view, before, equal_nan=True)  # nothing written
        return
    event("blended")
    assert sound
    want = _blend_reference(before, [(np.ctypeslib.as_array(v) if not isinstance(v, np.ndarray) else v, o, w)
                                     for v, o, w in parts])
    np.testing.assert_array_equal(view, want)
