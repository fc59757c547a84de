"""The compiled engine (``stoker._native.Engine``): whole batches from flat plan tables on threads the
extension owns.

Direct calls with hand-made tables check its contract (statuses, fills, the scratch budget, cancellation,
close with threads busy, a job dropped mid-batch); pipeline runs check that its statuses become the same
typed errors as on the Python path, that a batch reports its lowest failing chunk, and that the Python work
per batch does not grow with the number of chunks. ``.ci/asan`` runs this file under AddressSanitizer.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import native

from descriptors import open_under
from native_testing import one_chunk_tables

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(native.Engine is None, reason="stoker._native is not available")]

U16 = native.SOURCE_KINDS[np.dtype("uint16")]


@pytest.fixture(autouse=True)
def _engines_closed(monkeypatch):
    """Every engine a test makes (its own, or a pipeline's) is closed by its end, its threads gone: an engine
    dropped unclosed stops its threads without waiting for them, and they ran on into the next test on the
    worker, whose counts of the process's threads (/proc/self/task) they spoil. Closed here anyway."""
    made, real = [], native.Engine

    def make(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(native, "Engine", make)
    yield
    running = [e.info()["alive"] for e in made if e.info()["alive"]]
    for e in made:
        e.close(5)
    assert not running, f"engines left running by the test, with {running} threads: close them"


def _chunk(i: int) -> np.ndarray:
    return (np.arange(64, dtype=np.uint16) + 64 * i).reshape(8, 8)


class Tables:
    """Hand-made tables: chunk i is the file ``root/c/0.<i>`` (key separator '.'), an 8x8 uint16 chunk copied
    whole into row i of an (n, 8, 8) batch; fill chunks take -1."""

    def __init__(self, root, n: int, codec: int = native.CODEC_ZSTD, kind: int = native.KIND_F32):
        self.root = str(root) + "/"
        os.makedirs(self.root + "c", exist_ok=True)
        self.n = n
        self.blob = os.fsencode(self.root + "c/")
        self.sources = np.zeros((1, native.S_STRIDES + 2), np.int64)
        s = self.sources[0]
        s[native.S_KIND], s[native.S_PATH_LEN], s[native.S_SEP] = U16, len(self.blob), ord(".")
        s[native.S_STRIDES:] = (8, 1)
        fill = np.float32(-1).tobytes() if kind == native.KIND_F32 else np.uint16(65535).tobytes()
        self.sources[0, native.S_FILL] = np.frombuffer(fill.ljust(8, b"\0"), np.int64)[0]
        self.files = np.zeros((n, native.F_COORDS + 2), np.int64)
        self.files[:, native.F_COORDS + 1] = np.arange(n)
        self.chunks = np.zeros((n, native.N_CHUNK_COLS), np.int64)
        c = self.chunks
        c[:, native.C_FILE] = np.arange(n)
        c[:, native.C_OFFSET] = c[:, native.C_BUFFER] = -1
        c[:, native.C_SPAN_STOP] = c[:, native.C_NBYTES] = 128
        c[:, native.C_CODEC] = codec
        c[:, native.C_MAX_STORED] = 4096
        c[:, native.C_FIRST_COPY] = np.arange(n)
        c[:, native.C_NCOPIES] = 1
        self.copies = np.zeros((n, native.COPY_COLS(2)), np.int64)
        self.copies[:, native.CP_DST_OFFSET] = np.arange(n) * 64
        self.copies[:, native.CP_EXTENT:] = 8
        self.kind = kind
        self.batch = np.zeros((n, 8, 8), np.float32 if kind == native.KIND_F32 else np.uint16)

    def write(self, i: int, data: bytes | None = None, codec=None) -> str:
        path = self.root + f"c/0.{i}"
        if data is None:
            raw = _chunk(i).tobytes()
            data = (codec or numcodecs.Zstd(level=1)).encode(raw)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def args(self, batch=None):
        batch = self.batch if batch is None else batch
        return (self.chunks, self.copies, self.sources, self.files, self.blob, batch.reshape(-1).view(np.uint8),
                self.kind, False, np.array([8, 1], np.int64))

    def expected(self, i: int) -> np.ndarray:
        return _chunk(i).astype(self.batch.dtype)


def _results(job):
    """A job's statuses and details as arrays, and its counters; checks the count of chunks not placed (the
    finisher reads no status when it is 0)."""
    status, detail, counters = job.results()
    status = np.frombuffer(status, np.int32)
    assert counters["not_placed"] == int((status != native.ST_OK).sum())
    return status, np.frombuffer(detail, np.int64), counters


@pytest.mark.parametrize("kind", [native.KIND_F32, native.KIND_SAME], ids=["placed", "decoded-into-batch"])
def test_a_batch_in_one_call(tmp_path, kind):
    """40 zstd chunks, each copied whole into its row: cast (uint16 into float32), each is decoded into the
    thread's scratch and placed from there (place_copies); as stored (a plain copy), each is decoded straight
    into its place (direct_place: no place time). The same values and counters either way."""
    t = Tables(tmp_path, 40, kind=kind)
    for i in range(40):
        t.write(i)
    engine = native.Engine(2, 1 << 20)
    job = engine.submit(*t.args())
    assert job.wait(10) and job.done and len(job) == 40
    status, _, counters = _results(job)
    assert (status == native.ST_OK).all()
    for i in range(40):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    assert counters["chunks_decoded"] == 40 and counters["bytes_decoded"] == 40 * 128
    assert counters["bytes_read"] == sum(os.path.getsize(t.root + f"c/0.{i}") for i in range(40))
    assert counters["files_opened"] == 40  # whole chunk files: one open each
    assert (counters["place_ns"] == 0) == (kind == native.KIND_SAME)
    assert engine.close(5)


def _in_memory(t: Tables, rows, buffers: int) -> None:
    """Chunks ``rows`` of ``t`` read from buffers (row k's chunk: buffer k, whole) instead of files."""
    for k, i in enumerate(rows):
        t.chunks[i, native.C_FILE] = -1
        t.chunks[i, native.C_BUFFER] = k


def test_chunks_in_memory_are_read_as_files_are(tmp_path):
    """Chunks whose stored bytes are in buffers (fetched from a store): whole buffers of any kind (bytes, a
    memoryview slice, numpy), a range of a shared staging buffer, a missing value (None: the fill), zstd
    stopped early and blosc decoded in part, beside chunks read from files, in one job; each decodes to
    what its file would."""
    t = Tables(tmp_path, 7)
    frames = [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(7)]
    blosc = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=32).encode(_chunk(4).tobytes())
    staging = np.frombuffer(b"head" + frames[3] + b"tail", np.uint8)
    t.write(6)  # a file beside them
    buffers = [frames[0], memoryview(b"xx" + frames[1])[2:], None, staging, blosc, np.frombuffer(frames[5], np.uint8)]
    _in_memory(t, range(6), len(buffers))
    t.chunks[3, native.C_OFFSET], t.chunks[3, native.C_LENGTH] = 4, len(frames[3])
    t.chunks[4, native.C_CODEC] = native.CODEC_BLOSC
    t.copies[4, native.CP_SRC_OFFSET] = 16  # the chunk's rows 2..: its first blosc block is not decoded
    t.copies[4, native.CP_EXTENT] = 6
    t.chunks[4, native.C_SPAN_START] = 32
    t.copies[5, native.CP_EXTENT] = 2  # rows 0..1: zstd stops after the block holding them
    t.chunks[5, native.C_SPAN_STOP] = 32
    engine = native.Engine(2, 1 << 20)
    job = engine.submit(*t.args(), buffers)
    assert job.wait(10)
    status, _, counters = _results(job)
    assert status.tolist() == [native.ST_OK] * 7
    for i in (0, 1, 3, 6):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    assert (t.batch[2] == -1).all()
    np.testing.assert_array_equal(t.batch[4, :6], t.expected(4)[2:])
    np.testing.assert_array_equal(t.batch[5, :2], t.expected(5)[:2])
    assert counters["chunks_decoded"] == 6 and counters["chunks_filled"] == 1
    assert engine.close(5)


def test_chunks_in_memory_keep_the_checks_of_files(tmp_path):
    """Stored larger than the codec's bound (TOO_BIG, unread), damaged (a codec error), decoded to another
    size (SIZE), a blosc frame whose header disagrees (FRAME): the statuses a file of the same bytes gets."""
    t = Tables(tmp_path, 4)
    good = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    buffers = [good, good[:-3] + b"\xff\xff\xff", numcodecs.Zstd(level=1).encode(b"\0" * 64),
               numcodecs.Blosc("lz4").encode(b"\0" * 64)]
    _in_memory(t, range(4), len(buffers))
    t.chunks[0, native.C_MAX_STORED] = len(good) - 1
    t.chunks[3, native.C_CODEC] = native.CODEC_BLOSC
    engine = native.Engine(1, 1 << 20)
    job = engine.submit(*t.args(), buffers)
    assert job.wait(10)
    status, detail, _ = _results(job)
    assert status.tolist() == [native.ST_TOO_BIG, native.ST_CODEC_ERROR, native.ST_SIZE, native.ST_FRAME]
    assert detail[0] == len(good) and detail[2] == 64
    assert (t.batch == 0).all()
    assert engine.close(5)


def test_chunks_in_memory_take_scratch_for_their_decoded_bytes_only(tmp_path):
    """A chunk in a buffer is decoded straight from it: a thread's scratch holds its decoded bytes only, not
    its stored bound (whole zstd, zstd stopped early, blosc in part, lz4, a range of a staging buffer), so a
    budget of one decoded chunk runs them, while a file chunk still needs its stored bytes too."""
    t = Tables(tmp_path, 5)
    zstd = [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(5)]
    blosc = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=32).encode(_chunk(2).tobytes())
    lz4 = numcodecs.LZ4().encode(_chunk(3).tobytes())
    staging = np.frombuffer(b"head" + zstd[4] + b"tail", np.uint8)
    buffers = [zstd[0], zstd[1], blosc, lz4, staging]
    _in_memory(t, range(5), len(buffers))
    t.copies[1, native.CP_EXTENT] = 2  # rows 0..1: zstd stops after the block holding them
    t.chunks[1, native.C_SPAN_STOP] = 32
    t.chunks[2, native.C_CODEC] = native.CODEC_BLOSC
    t.copies[2, native.CP_SRC_OFFSET], t.copies[2, native.CP_EXTENT] = 16, 6  # the chunk's rows 2..: its first blosc block is not decoded
    t.chunks[2, native.C_SPAN_START] = 32
    t.chunks[3, native.C_CODEC] = native.CODEC_LZ4
    t.chunks[4, native.C_OFFSET], t.chunks[4, native.C_LENGTH] = 4, len(zstd[4])
    engine = native.Engine(2, 128)  # one decoded chunk: 128 bytes (a multiple of 64)
    job = engine.submit(*t.args(), buffers)
    assert job.wait(10)
    status, _, counters = _results(job)
    assert status.tolist() == [native.ST_OK] * 5
    for i in (0, 3, 4):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    np.testing.assert_array_equal(t.batch[1, :2], t.expected(1)[:2])
    np.testing.assert_array_equal(t.batch[2, :6], t.expected(2)[2:])
    assert counters["max_threads"] == 1 and engine.info()["peak"] == 128
    t.chunks[0, native.C_BUFFER], t.chunks[0, native.C_FILE] = -1, 0  # a file chunk: stored bytes too
    with pytest.raises(ValueError, match="budget"):
        engine.submit(*t.args(), buffers)
    assert engine.close(5)


def test_a_writable_buffer_changed_during_its_job_is_not_read(tmp_path):
    """The threads read a job's buffers without the GIL until it is done: a writable one (a bytearray, a
    writable array) that its caller changes meanwhile was decoded as it was then (a blosc frame's sizes read
    twice, once checked and once by c-blosc, read past its end where they changed between), so submit reads
    it from a copy of its own; a read-only one (bytes, a read-only view) is read in place. Here the one thread
    is busy with an earlier job while the buffers are overwritten: the batch is what they held at submit."""
    engine = native.Engine(1, 1 << 20)
    busy = Tables(tmp_path / "busy", 3000)
    frame = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    _in_memory(busy, range(3000), 3000)
    first = engine.submit(*busy.args(), [frame] * 3000)  # the thread's work for a while, in order first
    t = Tables(tmp_path / "changed", 3)
    frames = [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(3)]
    buffers = [bytearray(frames[0]), np.frombuffer(bytearray(frames[1]), np.uint8), memoryview(frames[2])]
    _in_memory(t, range(3), 3)
    job = engine.submit(*t.args(), buffers)
    buffers[0][:] = bytes(len(frames[0]))
    buffers[1][:] = 0
    assert first.wait(30) and job.wait(30)
    status, _, _ = _results(job)
    assert status.tolist() == [native.ST_OK] * 3
    for i in range(3):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    # in_place (stoker's own fetched values): read where they are, the caller's promise
    buffers = [bytearray(f) for f in frames]
    job = engine.submit(*t.args(), buffers, None, None, True)
    assert job.wait(30) and (_results(job)[0] == native.ST_OK).all()
    assert engine.close(5)


@pytest.mark.parametrize("where", [(-2, 0), (0, -1), (-1, 5), (1, 10**6), (2**62, 2**62), (4, 1)])
def test_a_range_outside_its_buffer_is_refused_before_any_read(tmp_path, where):
    """offset and length of a chunk in a buffer: (-1, 0) for the whole buffer, or a range inside it; any other
    is a plan refused in C before a thread sees it; so are buffer numbers out of range and a fill or file
    chunk naming a buffer."""
    t = Tables(tmp_path, 1)
    _in_memory(t, [0], 1)
    t.chunks[0, native.C_OFFSET], t.chunks[0, native.C_LENGTH] = where
    buffers = [b"abcd"] if where != (4, 1) else [None]
    engine = native.Engine(1, 1 << 20)
    with pytest.raises(ValueError, match="plan"):
        engine.submit(*t.args(), buffers)
    t.chunks[0, native.C_OFFSET], t.chunks[0, native.C_LENGTH] = -1, 0
    for buffer, file, codec in [(1, -1, native.CODEC_ZSTD), (-2, -1, native.CODEC_ZSTD), (0, 0, native.CODEC_ZSTD),
                                (0, -1, native.CODEC_FILL), (-1, -1, native.CODEC_ZSTD)]:
        t.chunks[0, native.C_BUFFER], t.chunks[0, native.C_FILE], t.chunks[0, native.C_CODEC] = buffer, file, codec
        with pytest.raises(ValueError, match="plan"):
            engine.submit(*t.args(), [b"abcd"])
    with pytest.raises(TypeError):
        engine.submit(*t.args(), [object()])
    assert engine.close(5)


@pytest.mark.parametrize("wrong", [np.float64, np.int32, np.int8], ids=["float64", "int32", "int8"])
@pytest.mark.parametrize("table", [0, 1, 2, 3, 8], ids=["chunks", "copies", "sources", "files", "dst_strides"])
def test_tables_of_another_type_are_refused_by_name(tmp_path, table, wrong):
    """The tables are read as int64: a numpy array of another type (its bytes the same, so every value checks)
    is refused with a ValueError naming the table and int64, not read as int64 nor blamed on its values; the
    same bytes as bytes (what chunk_rows and copy_rows return) are taken as they are."""
    t = Tables(tmp_path, 2)
    for i in range(2):
        t.write(i)
    engine = native.Engine(1, 1 << 20)
    args = list(t.args())
    name = ["chunks", "copies", "sources", "files", "", "", "", "", "dst_strides"][table]
    good = np.ascontiguousarray(args[table])
    args[table] = good.view(wrong)
    with pytest.raises(ValueError, match=f"{name} must be int64"):
        engine.submit(*args)
    args[table] = good.tobytes()
    job = engine.submit(*args)
    assert job.wait(10)
    status, _, _ = _results(job)
    assert (status == native.ST_OK).all()
    for i in range(2):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    assert engine.close(5)


def test_a_buffer_overlapping_the_batch_is_refused(tmp_path):
    """A buffer chunks are decoded from that is (part of) the batch they are placed into is refused before any
    thread reads it: other chunks' copies would write it while its frame is decoded (c-blosc reads a frame's
    sizes from the buffer again, so a header changed under it is read past the buffer's end). A buffer beside
    the batch in one allocation is taken; a writable buffer inside it is read from its copy (as it was then)."""
    t = Tables(tmp_path, 2, codec=native.CODEC_BLOSC)
    _in_memory(t, [0, 1], 2)
    frames = [numcodecs.Blosc(cname="lz4").encode(_chunk(i).tobytes()) for i in range(2)]
    engine = native.Engine(1, 1 << 20)
    whole = np.zeros(t.batch.nbytes + 4096, np.uint8)
    batch = whole[:t.batch.nbytes].view(np.float32).reshape(t.batch.shape)
    for at in (0, 100, t.batch.nbytes - 1):  # the batch's first bytes, inside it, its last byte
        inside = whole[at:at + len(frames[1])]
        inside[:] = np.frombuffer(frames[1], np.uint8)[:len(inside)]
        with pytest.raises(ValueError, match="overlaps the batch"):
            engine.submit(*t.args(batch), [frames[0], memoryview(inside).toreadonly()])
    job = engine.submit(*t.args(batch), [frames[0], inside])  # writable: copied at submit
    assert job.wait(10) and (_results(job)[0] == native.ST_OK).all()
    np.testing.assert_array_equal(batch[1], t.expected(1))
    beside = whole[t.batch.nbytes:t.batch.nbytes + len(frames[1])]
    beside[:] = np.frombuffer(frames[1], np.uint8)
    job = engine.submit(*t.args(batch), [frames[0], beside])
    assert job.wait(10)
    status, _, _ = _results(job)
    assert (status == native.ST_OK).all()
    for i in range(2):
        np.testing.assert_array_equal(batch[i], t.expected(i))
    assert engine.close(5)


def test_buffers_live_as_long_as_the_job(tmp_path):
    """The job holds the buffers it reads (the caller may drop its own references at once) and lets them go
    with it."""
    import weakref

    t = Tables(tmp_path, 2)
    frame = np.frombuffer(numcodecs.Zstd(level=1).encode(_chunk(0).tobytes()), np.uint8).copy()
    frame.flags.writeable = False  # read in place (a writable one: from a copy of its own)
    gone = weakref.ref(frame)
    _in_memory(t, range(2), 2)
    engine = native.Engine(1, 1 << 20)
    job = engine.submit(*t.args(), [frame, frame[:]])
    del frame
    assert gone() is not None
    assert job.wait(10)
    assert _results(job)[0].tolist() == [native.ST_OK] * 2
    np.testing.assert_array_equal(t.batch[1], t.expected(0))
    del job
    assert gone() is None
    assert engine.close(5)


def test_cancel_stops_reading_buffers(tmp_path):
    """Once cancel() returns no worker reads the job's buffers: they are freed right after it, mid-batch
    (under AddressSanitizer, .ci/asan, a read of them after that is a fault)."""
    n = 3000
    t = Tables(tmp_path, n)
    frame = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    _in_memory(t, range(n), n)
    engine = native.Engine(2, 1 << 20)
    for _ in range(3):
        buffers = [np.frombuffer(frame, np.uint8).copy() for _ in range(n)]
        job = engine.submit(*t.args(), buffers)
        job.cancel()  # as a rule mid-batch (how far the workers got is up to the machine)
        del buffers  # the job's views hold them now
        assert job.wait(10)
        assert set(_results(job)[0].tolist()) <= {native.ST_OK, native.ST_CANCELLED}
        del job  # the last views of the buffers: freed here
    assert engine.close(5)


def test_missing_files_and_fill_chunks_take_the_fill_value(tmp_path):
    t = Tables(tmp_path, 4)
    t.write(0)
    t.chunks[2, native.C_FILE] = -1  # nothing stored (an empty shard entry): no file at all
    t.chunks[2, native.C_CODEC] = native.CODEC_FILL
    t.write(3)
    engine = native.Engine(1, 1 << 20)
    job = engine.submit(*t.args())
    assert job.wait(10)
    status, _, counters = _results(job)
    assert status.tolist() == [native.ST_OK] * 4
    assert (t.batch[1] == -1).all() and (t.batch[2] == -1).all()
    np.testing.assert_array_equal(t.batch[3], t.expected(3))
    assert counters["chunks_filled"] == 2 and counters["chunks_decoded"] == 2
    assert engine.close(5)


def test_each_failure_has_its_status(tmp_path):
    """Every way a chunk can fail, one chunk each, in one job: the others are placed all the same."""
    t = Tables(tmp_path, 9)
    for i in range(9):
        t.write(i)
    os.unlink(t.root + "c/0.1")
    os.mkfifo(t.root + "c/0.1")  # a FIFO where a chunk should be
    os.unlink(t.root + "c/0.2")
    os.symlink(t.root + "c/0.2", t.root + "c/0.2")  # a loop: ELOOP
    t.write(3, b"\x28\xb5\x2f\xfd garbage")  # a zstd magic number, then garbage
    t.write(4, numcodecs.Zstd(level=1).encode(bytes(64)))  # a frame of another size
    t.write(5, bytes(5000))  # larger than the stored bound
    blosc = numcodecs.Blosc("lz4", 5, 1).encode(np.arange(10, dtype="uint16"))
    t.write(6, blosc)
    t.chunks[6, native.C_CODEC] = native.CODEC_BLOSC  # a blosc frame of another size: left to the Python path
    # chunk 7: an inner chunk of a shard (here the whole file at offset 0), read only from a file of the
    # identity its index was read from: this identity is not the file's
    size = os.path.getsize(t.root + "c/0.7")
    t.chunks[7, native.C_OFFSET], t.chunks[7, native.C_LENGTH] = 0, size
    t.files[7, native.F_HAS_IDENT] = 1
    t.files[7, native.F_INO] = 12345
    # chunk 8: an inner chunk running past the end of its file
    t.chunks[8, native.C_OFFSET], t.chunks[8, native.C_LENGTH] = 10, os.path.getsize(t.root + "c/0.8")
    engine = native.Engine(2, 1 << 20)
    job = engine.submit(*t.args())
    assert job.wait(10)
    status, detail, _ = _results(job)
    assert status.tolist() == [native.ST_OK, native.ST_NOT_REGULAR, native.ST_OS_ERROR, native.ST_CODEC_ERROR, native.ST_SIZE,
                               native.ST_TOO_BIG, native.ST_FRAME, native.ST_CHANGED, native.ST_SHORT]
    assert detail[1] == stat.S_IFIFO and detail[2] == 40 and detail[4] == 64 and detail[5] == 5000  # ELOOP: 40
    np.testing.assert_array_equal(t.batch[0], t.expected(0))
    assert not t.batch[1:].any()  # nothing was written for a chunk that failed
    assert engine.close(5)


def _shards(t: Tables, frames: list[bytes], shard_of: list[int]) -> list[str]:
    """Chunk i of ``t`` becomes an inner chunk of shard ``shard_of[i]`` (the file ``c/0.<shard>``, file row
    ``shard``), its frame stored after the earlier chunks of that shard, with the shard's identity."""
    stored: dict[int, bytes] = {}
    for i, (frame, s) in enumerate(zip(frames, shard_of)):
        here = stored.get(s, b"")
        t.chunks[i, native.C_FILE] = s
        t.chunks[i, native.C_OFFSET], t.chunks[i, native.C_LENGTH] = len(here), len(frame)
        stored[s] = here + frame
    paths = []
    for s, data in stored.items():
        paths.append(t.write(s, data + b"index"))
        st = os.stat(paths[-1])
        t.files[s, native.F_HAS_IDENT:native.F_COORDS] = [1, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                          st.st_ctime_ns]
    return paths


@pytest.mark.parametrize("threads", [1, 2])
def test_a_thread_opens_a_shard_once_for_its_inner_chunks(tmp_path, threads):
    """A thread keeps a shard's file open between the inner chunks of it that it reads (one open, not one
    per chunk), for a few shards at a time, as a crop straddling shards needs; each chunk is still read at
    its own offset and decoded to its own values. (On a local file system: see the next test.)"""
    if not native.local_file_system(tmp_path):
        pytest.skip(f"{tmp_path} is on a file system the engine does not keep files open on")
    frames = [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(120)]
    for shard_of, opened in (([0] * 120, 1), ([i % 2 for i in range(120)], 2), ([i // 40 for i in range(120)], 3),
                             ([i % 5 for i in range(120)], 120)):  # five in turn: four kept, each evicted in time
        t = Tables(tmp_path / f"{len(set(shard_of))}", 120)
        _shards(t, frames, shard_of)
        engine = native.Engine(threads, 1 << 20)
        job = engine.submit(*t.args())
        assert job.wait(10)
        status, _, counters = _results(job)
        assert (status == native.ST_OK).all()
        for i in range(120):
            np.testing.assert_array_equal(t.batch[i], t.expected(i))
        if opened == 120:
            assert counters["files_opened"] == 120 or threads > 1, counters
        else:
            # each thread that read opens each shard once; on a loaded machine one thread may read them all
            assert counters["files_opened"] == opened * counters["max_threads"] or (
                threads > 1 and opened <= counters["files_opened"] <= opened * threads), counters
        assert engine.close(5)


def test_shard_files_are_kept_open_on_local_file_systems_only(tmp_path):
    """Over NFS or SMB, fstat answers from a cache and only an open checks a file against its server, so a
    shard file is kept open only on a file system known to be local; unknown ones count as remote."""
    assert native.local_file_system("/proc/self/status") is False  # procfs: not a local disk's
    if os.path.isdir("/dev/shm"):
        assert native.local_file_system("/dev/shm") is True  # tmpfs
    with pytest.raises(OSError):
        native.local_file_system(tmp_path / "missing")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_no_file_stays_open_once_a_job_is_done(tmp_path):
    """The shard files a thread kept open are closed before the job is done, whatever its chunks did: read
    well, failed (too big, damaged, past the file's end) or were cancelled."""
    n = 400
    frames = [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(n)]
    frames[3] = frames[3][:-3] + b"\xff\xff\xff"
    t = Tables(tmp_path, n)
    _shards(t, frames, [i % 6 for i in range(n)])  # more shards than a thread keeps: some are closed early
    t.chunks[5, native.C_MAX_STORED] = 10
    t.chunks[n - 1, native.C_LENGTH] += 1000  # the last chunk of its shard: past the file's end
    engine = native.Engine(2, 1 << 20)
    before = open_under(tmp_path)
    job = engine.submit(*t.args())
    assert job.wait(10)
    assert open_under(tmp_path) == before
    status, _, _ = _results(job)
    assert status[[3, 5, n - 1]].tolist() == [native.ST_CODEC_ERROR, native.ST_TOO_BIG, native.ST_SHORT]
    assert (np.delete(status, [3, 5, n - 1]) == native.ST_OK).all()
    for _ in range(3):
        job = engine.submit(*t.args())
        job.cancel()
        assert job.wait(10)
        assert open_under(tmp_path) == before
    assert engine.close(5)
    assert open_under(tmp_path) == before


def test_many_inner_chunks_of_one_stored_range_are_entered_in_linear_time(tmp_path):
    """A shard whose index names one byte range for many inner chunks (a writer that stores equal chunks once):
    the job's table of shareable chunks keeps that range once, so building it is linear in the rows (entered
    each time, the probe through them grew with each: 60,000 rows took seconds), and every row is still read
    and placed as its own chunk."""
    n = 60_000
    t = Tables(tmp_path, n)
    [shard] = _shards(t, [numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())], [0])
    t.chunks[:, native.C_FILE] = 0
    t.chunks[:, native.C_OFFSET], t.chunks[:, native.C_LENGTH] = t.chunks[0, native.C_OFFSET], t.chunks[0, native.C_LENGTH]
    engine = native.Engine(2, 1 << 20)
    try:
        t0 = time.thread_time()
        job = engine.submit(*t.args())
        spent = time.thread_time() - t0  # the caller's CPU time: the tables checked, copied and entered
        assert job.wait(50)
        status, _, counters = _results(job)
        assert (status == native.ST_OK).all() and counters["chunks_decoded"] == n
        assert (t.batch == t.expected(0)).all()
        assert spent < 1.0, f"submitting {n:,} rows of one stored range took {spent:.2f} s of CPU"
    finally:
        assert engine.close(5)



def test_an_index_naming_one_offset_with_many_lengths_is_entered_in_linear_time(tmp_path):
    """A crafted shard index may put every inner chunk at one offset with a different length each (rows that are
    never the same stored bytes): they must not all land on one probe chain of the table of shareable chunks
    (40,000 such rows took 1.6 s to submit, quadratic). Each row still fails or reads as its own chunk."""
    n = 40_000
    t = Tables(tmp_path, n)
    frame = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    [shard] = _shards(t, [frame + bytes(n + 16)], [0])
    t.chunks[:, native.C_FILE] = 0
    t.chunks[:, native.C_OFFSET] = t.chunks[0, native.C_OFFSET]
    t.chunks[:, native.C_LENGTH] = np.arange(1, n + 1)
    t.chunks[len(frame) - 1, native.C_LENGTH] = len(frame)  # one row names the true frame
    engine = native.Engine(1, 1 << 20)
    try:
        t0 = time.thread_time()
        job = engine.submit(*t.args())
        spent = time.thread_time() - t0
        job.cancel()
        assert job.wait(50)
        assert spent < 0.5, f"submitting {n:,} rows of one offset took {spent:.2f} s of CPU"
    finally:
        assert engine.close(5)


def test_a_shard_rewritten_in_place_while_kept_open_is_not_read_again(tmp_path):
    """A thread that keeps a shard open still checks its identity after each inner chunk's reads: a shard
    rewritten in place (same inode) while the thread decodes its first chunk gives CHANGED for the chunks
    after (Python then reads the index anew), never bytes read at the old index's offsets."""
    t = Tables(tmp_path, 20)
    big = numcodecs.Zstd(level=1).encode(np.zeros(64 << 20, np.uint8))  # long to decode, quick to read
    frames = [big] + [numcodecs.Zstd(level=1).encode(_chunk(i).tobytes()) for i in range(1, 20)]
    [shard] = _shards(t, frames, [0] * 20)
    t.chunks[0, native.C_NBYTES] = t.chunks[0, native.C_SPAN_STOP] = 64 << 20
    t.chunks[0, native.C_MAX_STORED] = 1 << 20
    t.copies[0, 2:] = (1, 8)
    time.sleep(0.05)  # the rewrite lands on another tick of the file system's clock
    engine = native.Engine(1, 80 << 20)
    job = engine.submit(*t.args())
    with open(shard, "r+b") as f:  # the same bytes: only the identity says it was written
        f.write(open(shard, "rb").read())
    assert job.wait(20)
    status, _, counters = _results(job)
    assert status[0] in (native.ST_OK, native.ST_CHANGED)  # read before or after the rewrite
    assert (status[1:] == native.ST_CHANGED).all(), status
    assert engine.close(5)


def test_budget_for_one_thread_runs_one_thread_at_a_time(tmp_path):
    """A budget that holds one thread's scratch: four threads, one at a time; less than that: refused."""
    t = Tables(tmp_path, 64)
    for i in range(64):
        t.write(i)
    need = 128 + 4096  # the decoded chunk (rounded up to 64 bytes), then its stored bound
    engine = native.Engine(4, need)
    for _ in range(3):
        t.batch[...] = 0
        job = engine.submit(*t.args())
        assert job.wait(10)
        status, _, counters = _results(job)
        assert (status == native.ST_OK).all() and counters["max_threads"] == 1
        assert all((t.batch[i] == t.expected(i)).all() for i in range(64))
    info = engine.info()
    assert info["used"] <= need and info["peak"] == need
    small = native.Engine(4, need - 1)
    with pytest.raises(ValueError, match="budget"):
        small.submit(*t.args())
    assert engine.close(5) and small.close(5)


def _allocations_of_fail():
    """A size no allocation of this machine can get (Linux, heuristic or strict overcommit), or None."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            mode = f.read().strip()
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return None
    size = 1 << 39  # under AddressSanitizer's largest allocation (1 TiB, past it every failure is reported)
    return size if mode != "1" and info.get("MemTotal", 0) + info.get("SwapTotal", 0) < size // 2 else None


def test_scratch_that_cannot_be_allocated_leaves_its_chunks_to_python(tmp_path):
    """A budget larger than the machine: a thread's scratch cannot be allocated, and each chunk it would have
    read is NO_MEMORY (the Python path reads it). Many threads fail together while the job finishes under
    them (a worker used the job after another had finished and freed it: AddressSanitizer saw the write); the
    reservations go back, and nothing allocated is counted."""
    size = _allocations_of_fail()
    if size is None:
        pytest.skip("this machine may grant any allocation (overcommit), or has that much memory")
    t = Tables(tmp_path, 2)
    for i in range(2):
        t.write(i)
    t.chunks[:, native.C_NBYTES] = t.chunks[:, native.C_MAX_STORED] = size // 2
    engine = native.Engine(8, 1 << 62)
    for _ in range(50):
        batch = np.zeros((2, 8, 8), np.float32)
        job = engine.submit(*t.args(batch))
        assert job.wait(10)
        status, _, _ = _results(job)
        assert status.tolist() == [native.ST_NO_MEMORY] * 2 and not batch.any()
        del job
    assert engine.close(5)
    info = engine.info()
    assert info["alive"] == 0 and info["used"] == 0 and info["peak"] == 0, info


def test_a_chunk_not_copied_whole_as_stored_is_placed_from_the_scratch(tmp_path):
    """Only a zstd chunk whose one copy is all of it, as stored and contiguous in the batch, is decoded straight
    into its place (test_a_batch_in_one_call); a part of a chunk, a byte swap or a batch whose rows are not
    contiguous are placed from the scratch (place time). Every batch holds the chunks' values either way."""
    def run(t: Tables, batch=None):
        engine = native.Engine(2, 1 << 20)
        job = engine.submit(*t.args(batch))
        assert job.wait(10)
        status, _, counters = _results(job)
        assert (status == native.ST_OK).all() and counters["chunks_decoded"] == t.n
        assert engine.close(5)
        return counters["place_ns"]

    part = Tables(tmp_path / "same", 6, kind=native.KIND_SAME)  # rows 2..7 of each chunk
    for i in range(6):
        part.write(i)
    part.copies[:, native.CP_SRC_OFFSET] = 16
    part.copies[:, native.CP_EXTENT] = 6
    part.chunks[:, native.C_SPAN_START] = 32
    assert run(part) > 0
    np.testing.assert_array_equal(part.batch[:, :6], np.stack([part.expected(i)[2:] for i in range(6)]))
    swapped = Tables(tmp_path / "swapped", 6, kind=native.KIND_SAME)
    for i in range(6):
        swapped.write(i, numcodecs.Zstd(level=1).encode(_chunk(i).astype(">u2").tobytes()))
    swapped.sources[0, native.S_SWAP] = 1
    assert run(swapped) > 0
    np.testing.assert_array_equal(swapped.batch, np.stack([swapped.expected(i) for i in range(6)]))
    wide = Tables(tmp_path / "same", 6, kind=native.KIND_SAME)  # each chunk into the left half of 16-wide rows
    wide.copies[:, native.CP_DST_OFFSET] = np.arange(6) * 128
    batch = np.zeros((6, 8, 16), np.uint16)
    args = list(wide.args(batch))
    args[-1] = np.array([16, 1], np.int64)  # the batch's strides: its rows are not contiguous
    wide.args = lambda batch=None: tuple(args)
    assert run(wide) > 0
    np.testing.assert_array_equal(batch[:, :, :8], np.stack([wide.expected(i) for i in range(6)]))
    assert not batch[:, :, 8:].any()


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint16"])
@pytest.mark.parametrize("out", ["native", "f32", "i64"])
def test_whole_chunks_decoded_into_the_batch_are_zarrs_values(tmp_path, dtype, out):
    """Forecasting's layout (a step a chunk, read whole, of several variables as channels, in two fields):
    each field's batch is zarr-python's values bit for bit, on every output dtype its chunks are decoded
    straight into (native, f32 from float32, i64 from int64) and on the casts beside them; NaN payloads kept."""
    if out == "f32" and dtype == "int64" or out == "i64" and dtype == "float32":
        pytest.skip("refused casts (test_integer_casts.py)")
    rng = np.random.default_rng(3)
    uris = []
    for v in range(2):
        data = rng.standard_normal((9, 5, 7)).astype(dtype) if dtype == "float32" else \
            rng.integers(0, 1 << 15, (9, 5, 7)).astype(dtype)
        if dtype == "float32":  # a signalling NaN's bits and a quiet one with a payload: copied, never changed
            data.view(np.uint32)[2, 1, 3], data.view(np.uint32)[4, 0, 0] = 0x7F800001, 0x7FC00123
        uri = str(tmp_path / f"v{v}.zarr")
        zarr.create_array(uri, shape=data.shape, chunks=(1, 5, 7), dtype=dtype, fill_value=0,
                          compressors=ZstdCodec(level=1))[...] = data
        uris.append(uri)
    starts = [0, 3, 2, 6]
    samples = [stoker.Sample({"input": (uris, [(t, t + 2), (0, 5), (0, 7)]), "target": (uris, [(t + 2, t + 3), (0, 5), (0, 7)])})
               for t in starts]
    cfg = stoker.Config(batch_size=4, dtype=out, device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as batch:
            got = {k: torch.from_dlpack(v).clone() for k, v in batch.items()}
    arrays = [zarr.open_array(u, mode="r")[...] for u in uris]
    for name, (lo, hi) in {"input": (0, 2), "target": (2, 3)}.items():
        want = np.stack([np.stack([a[t + lo:t + hi] for a in arrays]) for t in starts])
        want = want if out == "native" else want.astype({"f32": np.float32, "i64": np.int64}[out])
        assert got[name].numpy().tobytes() == want.tobytes(), name


def test_a_chunk_decoded_into_the_batch_fails_as_any_other(tmp_path):
    """Chunks decoded straight into the batch keep their statuses: garbage, a frame of another size and a
    missing file fail or fill as before, and the chunks around them are placed."""
    t = Tables(tmp_path, 5, kind=native.KIND_SAME)
    for i in range(5):
        t.write(i)
    t.write(1, b"\x28\xb5\x2f\xfd garbage")
    t.write(2, numcodecs.Zstd(level=1).encode(bytes(64)))
    os.unlink(t.root + "c/0.3")
    engine = native.Engine(2, 1 << 20)
    job = engine.submit(*t.args())
    assert job.wait(10)
    status, detail, _ = _results(job)
    assert status.tolist() == [native.ST_OK, native.ST_CODEC_ERROR, native.ST_SIZE, native.ST_OK, native.ST_OK]
    assert detail[2] == 64
    for i in (0, 4):
        np.testing.assert_array_equal(t.batch[i], t.expected(i))
    assert (t.batch[3] == 65535).all()  # the fill value
    assert engine.close(5)


@pytest.mark.parametrize("kind", [native.KIND_F32, native.KIND_SAME], ids=["placed", "decoded-into-batch"])
def test_cancel_stops_every_write_into_the_batch(tmp_path, kind):
    """Once cancel() returns no thread writes into the batch (nor decodes into it): chunks not placed by then
    are CANCELLED, and a batch overwritten right after cancel keeps what it was given."""
    n = 3000
    t = Tables(tmp_path, n, kind=kind)
    frame = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    for i in range(n):
        t.write(i, frame)
    engine = native.Engine(2, 1 << 20)
    job = engine.submit(*t.args())
    job.cancel()
    t.batch[...] = 7
    assert job.wait(10)
    status, _, _ = _results(job)
    assert (status == native.ST_CANCELLED).sum() > 0 and set(status.tolist()) <= {native.ST_OK, native.ST_CANCELLED}
    time.sleep(0.05)
    assert (t.batch == 7).all()
    assert engine.close(5)


@pytest.mark.parametrize("kind", [native.KIND_F32, native.KIND_SAME], ids=["placed", "decoded-into-batch"])
def test_a_job_dropped_mid_batch_never_writes_again(tmp_path, kind):
    """The job holds its batch's buffer; dropped, it cancels first, so the buffer can be freed under
    threads still working (AddressSanitizer would see a write into freed memory)."""
    n = 2000
    t = Tables(tmp_path, n, kind=kind)
    frame = numcodecs.Zstd(level=1).encode(_chunk(0).tobytes())
    for i in range(n):
        t.write(i, frame)
    engine = native.Engine(2, 1 << 20)
    for _ in range(5):
        batch = np.zeros((n, 8, 8), t.batch.dtype)
        job = engine.submit(*t.args(batch))
        del job, batch
    assert engine.close(5)


def test_close_mid_batch_leaves_a_busy_thread_behind_safely(tmp_path):
    """close() returns within its timeout even while a thread is inside a long chunk; that thread finishes,
    writes nothing, and leaves; the engine then refuses work."""
    t = Tables(tmp_path, 2)
    big = np.zeros(64 << 20, np.uint8)
    t.write(0, numcodecs.Zstd(level=1).encode(big))
    t.write(1)
    t.chunks[0, native.C_NBYTES] = t.chunks[0, native.C_SPAN_STOP] = big.nbytes
    t.chunks[0, native.C_MAX_STORED] = 1 << 20
    t.copies[0, 2:] = (1, 8)  # 8 bytes of it (4 elements would do; any copy in the batch)
    engine = native.Engine(1, 80 << 20)
    job = engine.submit(*t.args())
    time.sleep(0.005)
    t0 = time.monotonic()
    engine.close(0.0)
    assert time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + 20
    while engine.info()["alive"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.info()["alive"] == 0 and engine.info()["used"] == 0
    status, _, _ = _results(job)
    assert set(status.tolist()) <= {native.ST_OK, native.ST_CANCELLED, native.ST_PENDING}
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(*t.args())


def _pipeline_batch(uri, boxes, **cfg):
    base = dict(batch_size=len(boxes), dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0)
    base.update(cfg)
    with stoker.Pipeline(stoker.Config(**base)) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        with p.pop() as batch:
            return torch.from_dlpack(batch).clone()


def test_a_batch_reports_its_lowest_failing_chunk(tmp_path):
    """Chunks fail in the engine in any order; the batch's error is always the one of its first chunk that
    fails (here a corrupt frame in chunk c/0/1, then files that are no chunk at c/0/2 and later)."""
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 64), chunks=(8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    for i in range(1, 8):
        path = os.path.join(uri, "c", "0", str(i))
        raw = bytearray(open(path, "rb").read())
        raw[-6:] = b"\xff" * 6  # a damaged last block
        open(path, "wb").write(bytes(raw))
    for _ in range(5):
        with pytest.raises(stoker.DecodeError) as err:
            _pipeline_batch(uri, [[(0, 8), (0, 64)]])
        assert err.value.key == "c/0/1" and uri in str(err.value)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_fetched_batch_reports_its_lowest_failing_chunk(tmp_path, codec):
    """The same for an array in a zip archive, decoded by the engine from the fetched bytes: zstd's errors
    mapped from its statuses, lz4's decided by the Python path from the same bytes (the engine leaves frames
    it cannot read to it); the same typed error, naming the array and the chunk key."""
    from store_fixtures import read_tree, write_zip

    root = str(tmp_path / "src")
    compressor = ZstdCodec(level=1) if codec == "zstd" else numcodecs.LZ4()
    z = zarr.create_array(root + "/a.zarr", shape=(8, 64), chunks=(8, 8), dtype="uint16", compressors=compressor,
                          zarr_format=3 if codec == "zstd" else 2)
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    values = read_tree(root)
    for i in range(1, 8):
        key = f"a.zarr/c/0/{i}" if codec == "zstd" else f"a.zarr/0.{i}"
        values[key] = values[key][:-6] + (b"\xff" * 6 if codec == "zstd" else b"")  # a damaged or cut end
    write_zip(str(tmp_path / "a.zip"), values)
    uri = str(tmp_path / "a.zip/a.zarr")
    for _ in range(5):
        with pytest.raises(stoker.DecodeError) as err:
            _pipeline_batch(uri, [[(0, 8), (0, 64)]])
        assert err.value.key == ("c/0/1" if codec == "zstd" else "0.1") and uri in str(err.value)
    assert np.array_equal(_pipeline_batch(uri, [[(0, 8), (0, 8)]])[0].numpy(), z[:, :8].astype(np.float32))


@pytest.mark.parametrize("layout", ["v2", "v3 with v2 keys", "v3"])
def test_an_array_at_the_root_of_a_zip_archive_is_read(tmp_path, layout):
    # zarr's ZipStore puts the array at the archive's root: its chunk keys have no prefix ("0.1")
    from store_fixtures import read_tree, write_zip

    kw = {"v2": dict(zarr_format=2, compressors=numcodecs.Zstd(level=1)),
          "v3 with v2 keys": dict(chunk_key_encoding={"name": "v2"}), "v3": {}}[layout]
    z = zarr.create_array(str(tmp_path / "src"), shape=(8, 64), chunks=(4, 8), dtype="uint16", **kw)
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    write_zip(str(tmp_path / "a.zip"), read_tree(str(tmp_path / "src")))
    got = _pipeline_batch(str(tmp_path / "a.zip"), [[(0, 4), (3, 40)], [(2, 6), (27, 64)]], dtype="native")
    assert np.array_equal(got[0].numpy(), z[0:4, 3:40]) and np.array_equal(got[1].numpy(), z[2:6, 27:64])


def test_os_errors_name_the_file(tmp_path):
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 16), chunks=(8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = 1
    path = os.path.join(uri, "c", "0", "1")
    os.unlink(path)
    os.symlink(path, path)
    with pytest.raises(stoker.StorageError, match="symbolic links") as err:
        _pipeline_batch(uri, [[(0, 8), (0, 16)]])
    assert err.value.path == path


class _Counting:
    """``native.Engine`` whose every call from Python is counted (the engine's and its jobs')."""

    def __init__(self, real, counts):
        self._real, self._counts = real, counts

    def __call__(self, *args):
        return _Proxy(self._real(*args), self._counts)


class _Proxy:
    def __init__(self, obj, counts):
        self._obj, self._counts = obj, counts

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        self._counts[name] = self._counts.get(name, 0) + 1
        if callable(value):
            def call(*args, **kwargs):
                out = value(*args, **kwargs)
                return _Proxy(out, self._counts) if name == "submit" else out
            return call
        return value

    def __len__(self):
        return len(self._obj)


@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "sharded"])
def test_python_work_per_batch_does_not_grow_with_chunks(tmp_path, monkeypatch, sharded):
    """A batch of 10 chunks and one of 1,000: the same calls from Python into the engine, and about the same
    number of Python calls altogether (planning and the engine's tables on the submitting thread, the
    accounting on the thread that waits for the batch; a few calls vary with timing, never with the chunks)."""
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(40, 40, 40), chunks=(4, 4, 4), dtype="uint8",
                          shards=(40, 40, 40) if sharded else None, compressors=ZstdCodec(level=1))
    z[...] = np.arange(64000, dtype=np.uint32).reshape(40, 40, 40) % 251
    boxes = {10: [(0, 4), (0, 8), (0, 20)], 1000: [(0, 40), (0, 40), (0, 40)]}
    real = native.Engine
    results = {}
    for n, box in boxes.items():
        shape = tuple(b - a for a, b in box)
        counts: dict[str, int] = {}
        monkeypatch.setattr(native, "Engine", _Counting(real, counts))
        calls = {"submit": 0, "settle": 0}

        def counter(where):
            def profile(frame, event, arg):
                if event in ("call", "c_call"):
                    calls[where] += 1
            return profile

        cfg = stoker.Config(batch_size=1, sample_shape=shape, dtype="f32", device="cpu", n_compute_threads=2,
                            pop_timeout_s=20.0)
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, box)])  # a first batch: arrays opened, shard index cached, threads up
            with p.pop():
                pass
            executor = p._executor.decoders
            decoder = executor.native
            settle = decoder._settle

            def counted(*args, **kwargs):  # on the thread that settles the batch (the one waiting for it)
                sys.setprofile(counter("settle"))
                try:
                    settle(*args, **kwargs)
                finally:
                    sys.setprofile(None)

            decoder._settle = counted  # before the submit, which hands the batch its settle
            counts.clear()
            out = torch.empty((1, *shape))
            sys.setprofile(counter("submit"))
            try:
                plan = executor.plan(1, [stoker.Sample(uri, box)], p._open)
                job = executor.submit(plan, out)
            finally:
                sys.setprofile(None)
            assert job.wait(20) and job.error is None and plan.n_chunks == n
            want = z[tuple(slice(a, b) for a, b in box)].astype(np.float32)
            assert np.array_equal(out[0].numpy(), want)
        results[n] = (dict(counts), calls)
    assert results[10][0] == results[1000][0] and results[10][0]["submit"] == 1
    # timing moves a few calls: waking a consumer that waits for the batch (a job's Done makes its Event only
    # then) is a dozen; Python per chunk would be a thousand
    for where in ("submit", "settle"):
        assert results[10][1][where] > 0 and abs(results[10][1][where] - results[1000][1][where]) <= 20, results


def _one_array_pipeline(tmp_path):
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(16, 16, 16), chunks=(4, 4, 4), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(16 ** 3, dtype=np.uint16).reshape(16, 16, 16)
    cfg = stoker.Config(batch_size=1, sample_shape=(8, 8, 8), dtype="f32", device="cpu", n_compute_threads=2,
                        pop_timeout_s=20.0)
    p = stoker.Pipeline(cfg)
    p.push([stoker.Sample(uri, [(0, 8), (0, 8), (0, 8)])])  # a first batch: the engine and its threads up
    with p.pop():
        pass
    return p, uri, z


class _Gate:
    """An engine job whose wait returns only once ``open`` is set (``inside``: one release per waiter)."""

    def __init__(self, engine_job):
        self.engine_job, self.open, self.inside = engine_job, threading.Event(), threading.Semaphore(0)
        self.results_on: list[threading.Thread] = []  # the thread of each results() call

    def wait(self, timeout=None):
        self.inside.release()
        self.open.wait(timeout)
        return self.engine_job.wait(timeout)

    def results(self):
        self.results_on.append(threading.current_thread())
        return self.engine_job.results()


def test_a_batch_is_settled_once_by_a_thread_that_waits_for_it(tmp_path):
    """A batch the engine makes whole goes to no thread of ours: the first of its waiters to find the engine
    done reads the results, once, however many wait; the others see it finished."""
    p, uri, z = _one_array_pipeline(tmp_path)
    with p:
        executor = p._executor.decoders
        decoder = executor.native
        settle, settled_on = decoder._settle, []

        def recording(*args, **kwargs):
            settled_on.append(threading.current_thread())
            return settle(*args, **kwargs)

        decoder._settle = recording  # before the submit, which hands the batch its settle
        before = decoder._stats.snapshot().stages["decode"].count
        box = [(4, 12), (2, 10), (6, 14)]
        plan = executor.plan(1, [stoker.Sample(uri, box)], p._open)
        out = torch.full((1, 8, 8, 8), -1.0)
        job = executor.submit(plan, out)
        assert not decoder._pending  # nothing for the finisher thread
        gate = _Gate(job._engine)  # all four inside the engine's wait before any of them returns
        job._engine = gate
        woken: list[bool] = []
        waiters = [threading.Thread(target=lambda: woken.append(job.wait(20))) for _ in range(4)]
        for t in waiters:
            t.start()
        for _ in waiters:
            assert gate.inside.acquire(timeout=10)
        gate.open.set()
        for t in waiters:
            t.join(30)
        assert woken == [True] * 4 and job.error is None
        assert len(settled_on) == 1 and settled_on[0] in waiters
        assert gate.results_on == settled_on  # read once, by that waiter: not handed to the finisher
        assert job.counts["chunks_decoded"] == plan.n_chunks == 18
        assert decoder._stats.snapshot().stages["decode"].count - before == plan.n_chunks  # counted once
        assert np.array_equal(out[0].numpy(), z[4:12, 2:10, 6:14].astype(np.float32))


def test_a_settle_interrupted_by_ctrl_c_is_done_again_by_the_next_pop(tmp_path, monkeypatch):
    """Ctrl-C lands on the main thread, often the one that pops and so settles batches: the pop raises it,
    the batch is not lost, and the next pop delivers it."""
    from stoker.engine.cpu.decode_native import NativeDecoder

    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 32, 32), chunks=(4, 8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(8 * 32 * 32, dtype=np.uint16).reshape(8, 32, 32)
    real, calls = NativeDecoder._account, []

    def interrupted_once(self, *args, **kwargs):  # inside the settle, once it has the engine's results
        calls.append(threading.current_thread())
        if len(calls) == 2:  # the second batch's first settle
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativeDecoder, "_account", interrupted_once)
    boxes = [[(0, 4), (0, 16), (0, 16)], [(4, 8), (8, 24), (16, 32)], [(2, 6), (16, 32), (0, 16)]]
    cfg = stoker.Config(batch_size=1, sample_shape=(4, 16, 16), dtype="f32", n_compute_threads=2, pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        got = []
        with p.pop() as batch:
            got.append(torch.from_dlpack(batch).clone())
        with pytest.raises(KeyboardInterrupt):
            p.pop()
        for _ in range(2):
            with p.pop() as batch:
                got.append(torch.from_dlpack(batch).clone())
    assert calls == [threading.current_thread()] * 4
    for box, batch in zip(boxes, got):
        assert np.array_equal(batch[0].numpy(), z[tuple(slice(a, b) for a, b in box)].astype(np.float32))


def test_chunks_the_engine_did_not_place_are_never_handled_inside_pop(tmp_path, monkeypatch):
    """The Python path reads what the engine did not place (and words errors) on the finisher thread, so a
    slow mount cannot hold ``pop`` past its timeout."""
    from stoker.engine.cpu.decode_native import NativeDecoder

    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 64), chunks=(8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    path = os.path.join(uri, "c", "0", "3")
    raw = bytearray(open(path, "rb").read())
    raw[-6:] = b"\xff" * 6  # a damaged last block
    open(path, "wb").write(bytes(raw))
    real, threads = NativeDecoder._failed, []

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativeDecoder, "_failed", recording)
    with pytest.raises(stoker.DecodeError) as err:
        _pipeline_batch(uri, [[(0, 8), (0, 64)]])
    assert err.value.key == "c/0/3"
    assert threads == ["stoker-engine-finisher"]


def test_a_batch_waited_for_after_shutdown_fails_as_closed(tmp_path):
    p, uri, _ = _one_array_pipeline(tmp_path)
    with p:
        executor = p._executor.decoders
        job = executor.submit(executor.plan(1, [stoker.Sample(uri, [(0, 8), (0, 8), (0, 8)])], p._open),
                              torch.empty((1, 8, 8, 8)))
        executor.shutdown()  # the engine's jobs cancelled (or already done): none is settled from it now
        assert job.wait(5) and isinstance(job.error, stoker.ShutdownError)


@pytest.mark.parametrize("sharded", [False, True])
def test_python_work_per_batch_does_not_grow_with_fetched_chunks(tmp_path, sharded):
    """The same for an array in a store (a zip archive): a batch of 10 chunks and one of 1,000 are each one
    fetch handed to the engine in one call, with no chunk decoded in Python, and about the same number of
    Python calls in that hand-off and in the accounting after it (the fetch's requests and the store's own
    reads are per range by nature, and are not counted here)."""

    from store_fixtures import read_tree, write_zip

    root = str(tmp_path / "src")
    z = zarr.create_array(root + "/a.zarr", shape=(40, 40, 40), chunks=(4, 4, 4), dtype="uint8",
                          shards=(40, 40, 40) if sharded else None, compressors=ZstdCodec(level=1))
    z[...] = np.arange(64000, dtype=np.uint32).reshape(40, 40, 40) % 251
    write_zip(str(tmp_path / "a.zip"), read_tree(root))
    uri = str(tmp_path / "a.zip/a.zarr")
    boxes = {10: [(0, 4), (0, 8), (0, 20)], 1000: [(0, 40), (0, 40), (0, 40)]}
    results = {}
    for n, box in boxes.items():
        shape = tuple(b - a for a, b in box)
        calls = {"fetches": 0, "submits": 0, "python_decodes": 0, "handoff": 0, "finish": 0}

        def profiled(where, fn):
            def run(*args, **kwargs):
                def profile(frame, event, arg):
                    if event in ("call", "c_call"):
                        calls[where] += 1
                sys.setprofile(profile)
                try:
                    return fn(*args, **kwargs)
                finally:
                    sys.setprofile(None)
            return run

        cfg = stoker.Config(batch_size=1, sample_shape=shape, dtype="f32", device="cpu", n_compute_threads=2,
                            pop_timeout_s=20.0)
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, box)])  # a first batch: the archive and array opened, threads up
            with p.pop():
                pass
            executor = p._executor.decoders
            decoder, python = executor.native, executor.python
            fetch, decode, handoff, finish = python.fetch, python._decode, decoder._fetched, decoder._finish
            python.fetch = lambda *a, **k: calls.__setitem__("fetches", calls["fetches"] + 1) or fetch(*a, **k)
            python._decode = lambda *a, **k: calls.__setitem__("python_decodes", calls["python_decodes"] + 1) \
                or decode(*a, **k)
            real = decoder.engine
            engine_submit = real.submit
            decoder.engine = type("E", (), {"submit": lambda self, *a: calls.__setitem__(
                "submits", calls["submits"] + 1) or engine_submit(*a)})()
            decoder._fetched = profiled("handoff", handoff)
            decoder._finish = profiled("finish", finish)
            out = torch.empty((1, *shape))
            plan = executor.plan(1, [stoker.Sample(uri, box)], p._open)
            job = executor.submit(plan, out)
            assert job.wait(20) and job.error is None and plan.n_chunks == n
            want = z[tuple(slice(a, b) for a, b in box)].astype(np.float32)
            assert np.array_equal(out[0].numpy(), want)
            decoder.engine = real  # the real engine again for close (the stand-in has only its submit)
        results[n] = calls
    for n in boxes:
        assert results[n]["fetches"] == results[n]["submits"] == 1 and results[n]["python_decodes"] == 0, results
    for where in ("handoff", "finish"):
        assert results[10][where] > 0 and abs(results[10][where] - results[1000][where]) <= 20, results  # as above


@pytest.mark.parametrize("batch", ["f32", "bf16", "same"])
@pytest.mark.parametrize("layout", ["C", "F", "C-swapped", "F-swapped"])
@pytest.mark.parametrize("dtype", sorted(str(d) for d in native.SOURCE_KINDS))
def test_any_layout_and_byte_order_casts_as_copy_cast(tmp_path, dtype, layout, batch):
    """Chunks stored in F order (or any transpose: strides in the tables) and in the other byte order are
    gathered and swapped before the cast: the batch holds what copy_cast makes of the decoded view."""
    from stoker.engine.cast import copy_cast

    dt = np.dtype(dtype)
    rng = np.random.default_rng(5)
    if dt.kind == "f":
        chunk = (rng.standard_normal((6, 20)) * 1000).astype(dt)
    else:
        info = np.iinfo(dt)
        chunk = rng.integers(info.min, info.max, (6, 20), dtype=dt, endpoint=True)
    order = "F" if layout.startswith("F") else "C"
    stored = chunk.astype(dt.newbyteorder("S")) if layout.endswith("swapped") else chunk
    kind = {"f32": native.KIND_F32, "bf16": native.KIND_BF16, "same": native.KIND_SAME}[batch]
    out_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "same": torch.from_numpy(chunk[:1]).dtype}[batch]
    root = str(tmp_path) + "/"
    chunks, sources, files, blob, strides = one_chunk_tables(root, chunk, layout, 2)
    # rows 1..4, columns 3..19 into a (2, 5, 17) batch at (0, 1, 0); the whole chunk's first 5 rows, 17
    # columns into batch row 1
    copies = np.array([[1 * strides[0] + 3 * strides[1], 1 * 17, 4, 17],
                       [0, 85, 5, 17]], np.int64)
    out = torch.full((2, 5, 17), -7, dtype=out_dtype)
    engine = native.Engine(1, 1 << 20)
    job = engine.submit(chunks, copies, sources, files, blob, out.view(-1).view(torch.uint8).numpy(), kind, False,
                        np.array([17, 1], np.int64))
    assert job.wait(10)
    assert np.frombuffer(job.results()[0], np.int32).tolist() == [native.ST_OK]
    want = torch.full((2, 5, 17), -7, dtype=out_dtype)
    view = numcodecs.Zstd().decode(open(root + "c/0.0", "rb").read())
    decoded = np.frombuffer(view, stored.dtype).reshape(chunk.shape, order=order)
    for dst, src in [((0, slice(1, 5), slice(0, 17)), decoded[1:5, 3:20]), ((1, slice(0, 5), slice(0, 17)), decoded[:5, :17])]:
        copy_cast(want[dst] if out_dtype == torch.bfloat16 else want.numpy()[dst], src)
    nan = want.isnan() if want.is_floating_point() else torch.zeros_like(want, dtype=torch.bool)
    assert torch.equal(out.isnan() if out.is_floating_point() else nan, nan)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
    assert torch.equal(out.view(bits)[~nan], want.view(bits)[~nan])
    assert engine.close(5)


def test_a_path_too_long_for_the_engine_is_read_by_python(tmp_path):
    """An array so deep in folders that the engine cannot build its chunk paths (its cap is 4,096 bytes with
    room for every grid coordinate): its chunks take the Python path, and the batch is right."""
    short = str(tmp_path / "a.zarr")
    z = zarr.create_array(short, shape=(8, 16), chunks=(8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    values = np.arange(128, dtype="uint16").reshape(8, 16)
    z[...] = values
    folder = str(tmp_path / "deep")
    while len(folder) < native.PATH_CAP - 45:
        folder = os.path.join(folder, "d" * min(200, native.PATH_CAP - 45 - len(folder)))
    os.makedirs(folder)
    here = os.getcwd()
    os.chdir(folder)  # zarr's temporary names would not fit there: the array is moved in by a short name
    try:
        os.rename(short, "a.zarr")
    finally:
        os.chdir(here)
    uri = os.path.join(folder, "a.zarr")
    assert len(os.fsencode(uri)) + 3 + 21 * 2 + 1 > native.PATH_CAP > len(os.fsencode(uri)) + 16
    got = _pipeline_batch(uri, [[(0, 8), (2, 14)]])
    assert torch.equal(got[0], torch.from_numpy(values[:, 2:14].astype(np.float32)))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread signal masks from /proc")
def test_engine_threads_block_signals(tmp_path):
    """A signal for the process (Ctrl-C, a launcher's SIGTERM) is never delivered to an engine thread, where
    it would cut a read short (EINTR): they block every signal; the thread that made the engine still takes
    them."""
    from thread_signals import assert_block_process_signals

    engine = native.Engine(3, 1 << 20)
    try:
        # its threads by the ids they say as they start (the threads new in /proc meanwhile may include
        # another's: a long test run's process starts and ends others)
        deadline = time.monotonic() + 10
        while (_clocks(engine)[:, native.W_TID] == 0).any() and time.monotonic() < deadline:
            time.sleep(0.01)
        new = set(_clocks(engine)[:, native.W_TID].tolist())
        assert len(new) == 3 and 0 not in new and new <= {int(x) for x in os.listdir("/proc/self/task")}
        assert_block_process_signals(new)
    finally:
        assert engine.close(5)


# -- each thread's clocks (Engine.worker_clocks) ---------------------------------------------------------------

_TIMES = [native.W_READ, native.W_DECODE, native.W_PLACE, native.W_FILL, native.W_LOCK, native.W_IDLE,
          native.W_BUDGET, native.W_OTHER]


def _clocks(engine) -> np.ndarray:
    return np.frombuffer(engine.worker_clocks(), np.int64).reshape(-1, native.N_WORKER_COLS)


def test_each_thread_clocks_sum_to_its_wall_time(tmp_path):
    """Every stretch of a thread's time goes to one clock: reading, decoding, placing, waiting for work... sum
    to its wall time since it started, read at any moment (the stretch under way included); the chunks add
    up to those of the jobs, and waiting with nothing to do is idle time."""
    t = Tables(tmp_path, 40)
    for i in range(30):
        t.write(i)
    t.chunks[30:35, native.C_CODEC] = native.CODEC_FILL  # fills
    t.chunks[30:35, native.C_FILE] = -1
    engine = native.Engine(2, 1 << 20)
    try:
        for _ in range(5):
            job = engine.submit(*t.args())
            assert job.wait(10)
        rows = _clocks(engine)
        assert rows.shape == (2, native.N_WORKER_COLS)
        for r in rows:
            total = r[_TIMES].sum()
            assert abs(int(total) - int(r[native.W_WALL])) <= max(100_000, r[native.W_WALL] // 1000), r
            assert (r[_TIMES] >= 0).all()
        assert rows[:, native.W_CHUNKS].sum() == 5 * 40  # missing files (35-39) too
        assert rows[:, native.W_READ].sum() > 0 and rows[:, native.W_DECODE].sum() > 0
        assert rows[:, native.W_PLACE].sum() > 0 and rows[:, native.W_FILL].sum() > 0
        if sys.platform.startswith("linux"):  # a thread that found no work yet may not have said its id
            deadline = time.monotonic() + 10
            while (_clocks(engine)[:, native.W_TID] == 0).any() and time.monotonic() < deadline:
                time.sleep(0.01)
            tids = set(_clocks(engine)[:, native.W_TID].tolist())
            assert len(tids) == 2 and tids <= {int(x) for x in os.listdir("/proc/self/task")}
        time.sleep(0.2)  # no work: both threads wait for it
        idle = _clocks(engine)[:, native.W_IDLE] - rows[:, native.W_IDLE]
        assert (idle >= 150_000_000).all(), idle
    finally:
        assert engine.close(5)
    stopped = _clocks(engine)  # threads that left: their clocks stop where they left
    time.sleep(0.05)
    assert (_clocks(engine)[:, native.W_WALL] == stopped[:, native.W_WALL]).all()


def test_a_thread_waiting_for_the_budget_counts_it(tmp_path):
    """A budget that holds one thread's scratch: one thread works, the others wait for the budget, and their
    clocks say so (not idle: there was work). Each job reads files of its own: chunks that jobs in flight
    share are decoded once, by whichever thread takes them first, which would leave the others no work."""
    tables = [Tables(tmp_path / f"t{k}", 64) for k in range(10)]
    for t in tables:
        for i in range(64):
            t.write(i)
    waited = 0
    for _ in range(5):  # a loaded machine may not run the other threads before the one has done it all: again
        engine = native.Engine(3, 128 + 4096)
        try:
            batches = [np.zeros_like(t.batch) for t in tables]
            jobs = [engine.submit(*t.args(b)) for t, b in zip(tables, batches)]  # work enough for the others
            assert all(job.wait(10) for job in jobs)
            rows = _clocks(engine)
            working = rows[:, native.W_CHUNKS] > 0
            assert working.sum() == 1 and rows[working, native.W_CHUNKS].sum() == 10 * 64
            waited = rows[~working, native.W_BUDGET].max()
        finally:
            assert engine.close(5)
        if waited > 0:
            break
    assert waited > 0, rows


def test_a_forked_child_reads_no_thread_clocks(tmp_path):
    """A child process has none of the engine's threads: no rows (and no read of a row its fork cut short)."""
    engine = native.Engine(2, 1 << 20)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if engine.worker_clocks() == b"" else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert len(_clocks(engine)) == 2
    finally:
        assert engine.close(5)


def test_each_array_is_described_to_the_engine_once_per_pipeline(tmp_path, monkeypatch):
    """Batches of ever new combinations of arrays (many small arrays) describe each array to the engine once,
    not once per batch it is in; the batches are what zarr reads."""
    from stoker.engine.cpu import decode_native

    uris, data = [], []
    for k in range(3):
        uri = str(tmp_path / f"a{k}.zarr")
        z = zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="uint16", compressors=ZstdCodec(level=1))
        data.append(np.arange(64, dtype=np.uint16).reshape(8, 8) + 100 * k)
        z[...] = data[-1]
        uris.append(uri)
    described = []
    real = decode_native.shared_source
    def counted(reader, *args):
        described.append(reader.uri)
        return real(reader, *args)

    monkeypatch.setattr(decode_native, "shared_source", counted)
    pairs = [(0, 1), (1, 2), (2, 0), (0, 2), (1, 0), (2, 1)]
    cfg = stoker.Config(batch_size=2, dtype="f32", n_compute_threads=2, lookahead_batches=1)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uris[k], [(2, 6), (1, 7)]) for pair in pairs for k in pair])
        for pair in pairs:
            with p.pop() as b:
                got = torch.from_dlpack(b).numpy()
                for row, k in enumerate(pair):
                    np.testing.assert_array_equal(got[row], data[k][2:6, 1:7])
    assert sorted(described) == sorted(uris), described


# -- chunks shared by the jobs in flight -----------------------------------------------------------------------

WIDE = 1 << 15  # a chunk of 8 rows of 32768 uint16: 512 KiB decoded, several zstd blocks (so a decode can stop early)


def _wide_chunk(i: int) -> np.ndarray:
    return ((np.arange(8 * WIDE, dtype=np.uint32) * 7 + 1000 * i) % 65521).astype(np.uint16).reshape(8, WIDE)


def _wide(root, n: int, kind: int, rows: int, like: Tables | None = None) -> tuple[Tables, list]:
    """Tables of ``n`` wide chunks, inner chunks of two shards (written here, or ``like``'s: the same files and
    identities), the first ``rows`` rows of chunk i copied into row i of an (n, 8, WIDE) batch; its
    ``Engine.submit`` arguments."""
    t = Tables(root, n, kind=kind)
    t.sources[0, native.S_STRIDES:] = (WIDE, 1)
    t.chunks[:, native.C_NBYTES] = 8 * WIDE * 2
    t.chunks[:, native.C_SPAN_STOP] = rows * WIDE * 2
    t.chunks[:, native.C_MAX_STORED] = 4 << 20
    t.copies[:, native.CP_DST_OFFSET] = np.arange(n) * 8 * WIDE
    t.copies[:, native.CP_EXTENT:] = (rows, WIDE)
    t.batch = np.zeros((n, 8, WIDE), t.batch.dtype)
    if like is None:
        frames = [numcodecs.Zstd(level=1).encode(_wide_chunk(i).tobytes()) for i in range(n)]
        frames[n - 1] = frames[n - 1][:-3] + b"\xff\xff\xff"  # damaged: fails wherever it is placed
        _shards(t, frames, [i % 2 for i in range(n)])
    else:
        t.files[...] = like.files
        t.chunks[:, [native.C_FILE, native.C_OFFSET, native.C_LENGTH]] = like.chunks[
            :, [native.C_FILE, native.C_OFFSET, native.C_LENGTH]]
    args = list(t.args())
    args[-1] = np.array([WIDE, 1], np.int64)
    return t, args


def _busy(root, engine):
    """A job that keeps a one-thread engine busy for a while (50,000 small chunks of one file): jobs submitted
    right after it (their tables made before) are all in flight when the thread reaches them. Cancel it to
    let them run."""
    t = Tables(root, 50000)
    t.write(0)
    t.chunks[:, native.C_FILE] = 0
    return engine.submit(*t.args())


def _in_flight_together(tmp_path, engine, *job_args):
    """Submit a job of each of ``job_args`` while the engine's one thread is held busy, so that all are in
    flight before it reaches the first; the finished jobs, in order."""
    busy = _busy(tmp_path / "busy", engine)
    jobs = [engine.submit(*args) for args in job_args]
    assert not busy.done  # all are in flight before the thread reaches the first
    busy.cancel()
    assert all(job.wait(20) for job in jobs)
    return jobs


def test_a_chunk_two_jobs_in_flight_need_is_read_and_decoded_once(tmp_path):
    """Batches in flight that need the same stored chunk (an inner chunk of a shard file) get it from one read
    and one decode: the thread that takes it first in one job places it into every other job that has not
    taken it yet, each with its own copies and cast, decoded as far as the farthest of them reads (the first
    job reads 3 rows of 8: alone, its decode would stop there). A chunk fails in a job only where its own span
    alone fails, whichever jobs are in flight: the last chunk, damaged past the first job's 3 rows, fails the
    second job only (the union's decode failed, so each decoded its own span alone), as with no sharing."""
    engine = native.Engine(1, 16 << 20)
    n = 6
    first, first_args = _wide(tmp_path / "wide", n, native.KIND_F32, rows=3)
    second, second_args = _wide(tmp_path / "wide", n, native.KIND_SAME, rows=8, like=first)
    a, b = _in_flight_together(tmp_path, engine, first_args, second_args)
    (sa, _, ca), (sb, _, cb) = _results(a), _results(b)
    assert sa.tolist() == [native.ST_OK] * n
    assert sb.tolist() == [native.ST_OK] * (n - 1) + [native.ST_CODEC_ERROR]
    for i in range(n):
        np.testing.assert_array_equal(first.batch[i, :3], _wide_chunk(i)[:3].astype(np.float32))
        if i < n - 1:
            np.testing.assert_array_equal(second.batch[i], _wide_chunk(i))
    assert not first.batch[:, 3:].any()
    assert (ca["chunks_decoded"], ca["chunks_shared"], cb["chunks_decoded"], cb["chunks_shared"]) == (n, 0, 0, n - 1)
    assert cb["bytes_read"] == 0 and cb["files_opened"] == 0
    for args, statuses in ((first_args, sa), (second_args, sb)):  # the same as each alone
        alone = engine.submit(*args)
        assert alone.wait(20) and _results(alone)[0].tolist() == statuses.tolist()
    assert engine.close(5)


def test_a_shared_chunk_fails_only_the_jobs_whose_own_span_fails(tmp_path):
    """As above with the job that reads all 8 rows first: its decode (the union of the spans) fails on the
    damaged last chunk, which the thread then decodes alone as far as the first job's 3 rows for it."""
    engine = native.Engine(1, 16 << 20)
    n = 6
    second, second_args = _wide(tmp_path / "wide", n, native.KIND_SAME, rows=8)
    first, first_args = _wide(tmp_path / "wide", n, native.KIND_F32, rows=3, like=second)
    b, a = _in_flight_together(tmp_path, engine, second_args, first_args)
    (sa, _, ca), (sb, _, cb) = _results(a), _results(b)
    assert sa.tolist() == [native.ST_OK] * n
    assert sb.tolist() == [native.ST_OK] * (n - 1) + [native.ST_CODEC_ERROR]
    np.testing.assert_array_equal(first.batch[:, :3], np.stack([_wide_chunk(i)[:3] for i in range(n)]))
    assert (cb["chunks_decoded"], ca["chunks_shared"]) == (n - 1, n)
    assert engine.close(5)


def test_each_thread_clocks_sum_to_its_wall_time_with_shared_chunks(tmp_path):
    """A chunk placed into the jobs that share it is still one stretch of the thread's time: the locks taken
    to hand it out are the chunk's lock time, not stretches of their own that its read and decode also
    fill (which counted those twice: the clocks summed to more than the wall time)."""
    engine = native.Engine(1, 16 << 20)
    n = 6
    first, first_args = _wide(tmp_path / "wide", n, native.KIND_F32, rows=8)
    second, second_args = _wide(tmp_path / "wide", n, native.KIND_SAME, rows=8, like=first)
    a, b = _in_flight_together(tmp_path, engine, first_args, second_args)
    assert _results(b)[2]["chunks_shared"] == n - 1
    (r,) = _clocks(engine)
    total = int(r[_TIMES].sum())
    assert abs(total - int(r[native.W_WALL])) <= max(100_000, r[native.W_WALL] // 1000), r
    assert (r[_TIMES] >= 0).all()
    assert engine.close(5)


def test_a_job_cancelled_or_dropped_is_never_written_by_a_sharing_thread(tmp_path):
    """A job cancelled while its chunks wait in another job's thread is not written once cancel() returns:
    its chunks end CANCELLED (those another thread took, too), and it is done; a job dropped so is freed only
    once the sharing thread let it go (AddressSanitizer would see a write into freed memory). The job
    that reads them still gets every chunk."""
    engine = native.Engine(1, 16 << 20)
    for drop in (False, True):
        n = 6
        first, first_args = _wide(tmp_path / f"wide{drop}", n, native.KIND_F32, rows=8)
        second, second_args = _wide(tmp_path / f"wide{drop}", n, native.KIND_SAME, rows=8, like=first)
        busy = _busy(tmp_path / f"busy{drop}", engine)
        a = engine.submit(*first_args)
        b = engine.submit(*second_args)
        assert not busy.done
        if drop:
            del b, second, second_args
        else:
            b.cancel()
            second.batch[...] = 7
        busy.cancel()
        assert a.wait(20)
        sa, _, _ = _results(a)
        assert sa.tolist() == [native.ST_OK] * (n - 1) + [native.ST_CODEC_ERROR]
        for i in range(n - 1):
            np.testing.assert_array_equal(first.batch[i], _wide_chunk(i).astype(np.float32))
        if not drop:
            assert b.wait(20)
            sb, _, cb = _results(b)
            assert (sb == native.ST_CANCELLED).all() and cb["chunks_shared"] == 0
            assert (second.batch == 7).all()
    assert engine.close(5)


def test_a_chunk_file_two_jobs_in_flight_need_is_read_once_and_a_missing_one_filled_in_each(tmp_path):
    """Whole chunk files are shared by their path (a step a chunk, as xarray writes forecasting data): one
    read and decode for the jobs in flight, each batch with its own cast; an absent chunk file is each
    job's own fill value."""
    engine = native.Engine(1, 16 << 20)
    n = 5
    first, second = Tables(tmp_path / "files", n), Tables(tmp_path / "files", n, kind=native.KIND_SAME)
    for i in range(n - 1):
        first.write(i)  # chunk n - 1 has no file
    busy = _busy(tmp_path / "busy", engine)
    a = engine.submit(*first.args())
    b = engine.submit(*second.args())
    assert not busy.done
    busy.cancel()
    assert a.wait(20) and b.wait(20)
    (sa, _, ca), (sb, _, cb) = _results(a), _results(b)
    assert (sa == native.ST_OK).all() and (sb == native.ST_OK).all()
    for i in range(n - 1):
        np.testing.assert_array_equal(first.batch[i], first.expected(i))
        np.testing.assert_array_equal(second.batch[i], second.expected(i))
    assert (first.batch[n - 1] == -1).all() and (second.batch[n - 1] == 65535).all()
    assert (ca["chunks_decoded"], cb["chunks_decoded"], cb["chunks_shared"], cb["chunks_filled"]) == (n - 1, 0, n - 1, 1)
    assert cb["bytes_read"] == 0 and cb["files_opened"] == 0
    assert engine.close(5)


def _entry_args(cache, idents: list[str], nbytes: int):
    """``Engine.submit`` arguments of one zstd chunk read from each of ``idents``' disk-cache entries (written
    in ``cache``), chunk i into row i of an (n, nbytes) uint8 batch; the batch."""
    n = len(idents)
    chunks = np.zeros((n, native.N_CHUNK_COLS), np.int64)
    chunks[:, native.C_FILE] = -1
    chunks[:, native.C_OFFSET] = -1
    chunks[:, native.C_BUFFER] = np.arange(n)
    chunks[:, native.C_SPAN_STOP] = nbytes
    chunks[:, native.C_CODEC], chunks[:, native.C_NBYTES] = native.CODEC_ZSTD, nbytes
    chunks[:, native.C_MAX_STORED], chunks[:, native.C_NCOPIES] = nbytes + 64, 1
    chunks[:, native.C_FIRST_COPY] = np.arange(n)
    copies = np.zeros((n, native.CP_EXTENT + 1), np.int64)
    copies[:, native.CP_DST_OFFSET] = np.arange(n) * nbytes
    copies[:, native.CP_EXTENT] = nbytes
    sources = np.array([[native.SOURCE_KINDS[np.dtype("uint8")], 0, 0, 1, ord("."), 0, 1]], np.int64)
    pairs = [b for i in idents for b in (os.fsencode(cache.path(i)), i.encode())]
    lens = np.array([len(b) for b in pairs], np.int64)
    starts = np.cumsum(lens) - lens
    rows = np.stack([starts[0::2], lens[0::2], starts[1::2], lens[1::2]], axis=1)
    batch = np.zeros((n, nbytes), np.uint8)
    return ((chunks, copies, sources, np.zeros((0, native.F_COORDS + 1), np.int64), b"x", batch, native.KIND_SAME,
             False, np.array([1], np.int64), [None] * n, rows, b"".join(pairs)), batch)


def test_a_disk_cache_entry_two_jobs_in_flight_need_is_read_and_decoded_once(tmp_path):
    """Batches in flight that read the same disk-cache entry (a second epoch's, drawn near each other) get it
    from one read, one check and one decode, as a chunk file's: each job's chunk placed and counted as the
    cache's hit (its payload bytes); an entry found corrupt fails in every job that took it (each fetches it
    again), whichever job's thread read it."""
    from stoker.storage.diskcache import DiskCache

    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    n, nbytes = 4, 4096
    values = [np.random.default_rng(i).integers(0, 4, nbytes).astype(np.uint8) for i in range(n)]
    idents = [f"s3://bkt\narray/c/{i}\nall\n'etag{i}'" for i in range(n)]
    payloads = [numcodecs.Zstd(level=1).encode(v.tobytes()) for v in values]
    for ident, payload in zip(idents, payloads):
        assert cache.write(ident, payload)
    engine = native.Engine(1, 16 << 20)
    (first_args, first), (second_args, second) = _entry_args(cache, idents, nbytes), _entry_args(cache, idents, nbytes)
    a, b = _in_flight_together(tmp_path, engine, first_args, second_args)
    (sa, da, ca), (sb, db, cb) = _results(a), _results(b)
    assert sa.tolist() == sb.tolist() == [native.ST_OK] * n
    assert da.tolist() == db.tolist() == list(map(len, payloads))  # each counts the payload it was served
    for batch in (first, second):
        np.testing.assert_array_equal(batch, np.stack(values))
    assert (ca["chunks_decoded"], ca["chunks_shared"], cb["chunks_decoded"], cb["chunks_shared"]) == (n, 0, 0, n)
    assert cb["bytes_read"] == 0
    path = cache.path(idents[1])
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0x10  # one payload bit
    open(path, "wb").write(bytes(raw))
    (first_args, _), (second_args, _) = _entry_args(cache, idents, nbytes), _entry_args(cache, idents, nbytes)
    a, b = _in_flight_together(tmp_path, engine, first_args, second_args)
    for status in (_results(a)[0], _results(b)[0]):
        assert status.tolist() == [native.ST_OK, native.ST_ENTRY] + [native.ST_OK] * (n - 2)
    assert engine.close(5)
