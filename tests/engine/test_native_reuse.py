"""Decoded chunks kept by the compiled engine for the batches after the one that decoded them (csrc/pool.c,
"Reused"; ``Engine.reuse``), and the CPU pipeline that turns it on for a grid's epoch read ahead.

Direct calls with hand-made tables count decodes (one thread, jobs one after another: deterministic), check
that a new generation reads files again, that the bytes held stay within the bound, and that a kept chunk
decoded whole never fails a job whose own span decodes. Pipeline runs compare with zarr-python bit for bit.
``.ci/asan`` runs this file under AddressSanitizer.
"""

from __future__ import annotations

import os
import threading
import time

import numcodecs
import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine.cpu import native

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(native.Engine is None, reason="stoker._native is not available")]

U16 = native.SOURCE_KINDS[np.dtype("uint16")]
ROWS, COLS = 8, 256  # a chunk: 8 x 256 uint16, 4 KiB decoded
WIDE = 1 << 15  # 8 x 32768 uint16: 512 KiB, several zstd blocks (so a decode can stop early)


def _values(i: int, version: int = 0, cols: int = COLS) -> np.ndarray:
    return ((np.arange(ROWS * cols, dtype=np.uint32) * 7 + 1000 * i + 31 * version) % 65521).astype(
        np.uint16).reshape(ROWS, cols)


class Chunks:
    """``n`` zstd chunk files ``root/c/0.<i>`` of 8 x ``cols``, chunk i's first ``rows`` rows copied into row i
    of an (n, 8, cols) batch (cast to float32, or as stored with ``same``): the arguments of ``Engine.submit``."""

    def __init__(self, root, n: int, rows: int = ROWS, same: bool = False, cols: int = COLS) -> None:
        self.cols = cols
        self.root = str(root) + "/"
        os.makedirs(self.root + "c", exist_ok=True)
        self.n, self.rows = n, rows
        self.blob = os.fsencode(self.root + "c/")
        self.sources = np.zeros((1, native.S_STRIDES + 2), np.int64)
        s = self.sources[0]
        s[native.S_KIND], s[native.S_PATH_LEN], s[native.S_SEP] = U16, len(self.blob), ord(".")
        s[native.S_STRIDES:] = (cols, 1)
        self.files = np.zeros((n, native.F_COORDS + 2), np.int64)
        self.files[:, native.F_COORDS + 1] = np.arange(n)
        c = self.chunks = np.zeros((n, native.N_CHUNK_COLS), np.int64)
        c[:, native.C_FILE] = np.arange(n)
        c[:, native.C_OFFSET] = c[:, native.C_BUFFER] = -1
        c[:, native.C_NBYTES] = ROWS * cols * 2
        c[:, native.C_SPAN_STOP] = rows * cols * 2  # a crop of the first rows: alone, its decode stops there
        c[:, native.C_CODEC] = native.CODEC_ZSTD
        c[:, native.C_MAX_STORED] = 1 << 20
        c[:, native.C_FIRST_COPY] = np.arange(n)
        c[:, native.C_NCOPIES] = 1
        self.copies = np.zeros((n, native.COPY_COLS(2)), np.int64)
        self.copies[:, native.CP_DST_OFFSET] = np.arange(n) * ROWS * cols
        self.copies[:, native.CP_EXTENT:] = (rows, cols)
        self.kind = native.KIND_SAME if same else native.KIND_F32
        self.batch = np.zeros((n, ROWS, cols), np.uint16 if same else np.float32)

    def write(self, version: int = 0, damaged: int | None = None, values=_values) -> None:
        """Each chunk file, its ``values`` of ``version``; chunk ``damaged`` cut short in its last bytes."""
        for i in range(self.n):
            frame = numcodecs.Zstd(level=1).encode(values(i, version, self.cols).tobytes())
            if i == damaged:
                frame = frame[:-3] + b"\xff\xff\xff"
            with open(self.root + f"c/0.{i}", "wb") as f:
                f.write(frame)

    def submit(self, engine, order: np.ndarray | None = None):
        """One job of every chunk (taken in ``order``: the chunk rows permuted), into a zeroed batch, submitted."""
        self.batch[...] = 0
        chunks = self.chunks if order is None else self.chunks[order]
        return engine.submit(chunks, self.copies, self.sources, self.files, self.blob,
                             self.batch.reshape(-1).view(np.uint8), self.kind, False,
                             np.array([self.cols, 1], np.int64))

    def run(self, engine, order: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """:meth:`submit`, then the job's statuses (in that order) and counters once done."""
        return _done(self.submit(engine, order))

    def check(self, version: int = 0, upto: int | None = None, values=_values) -> None:
        """The batch holds chunks [0, upto) of ``version``, as zarr-python would decode them (the rows read)."""
        for i in range(self.n if upto is None else upto):
            np.testing.assert_array_equal(self.batch[i, :self.rows], values(i, version, self.cols)[:self.rows])
            assert not self.batch[i, self.rows:].any()


def _done(job) -> tuple[np.ndarray, dict]:
    """A job's statuses and counters once it is done."""
    assert job.wait(20)
    status, _, counters = job.results()
    return np.frombuffer(status, np.int32), counters


def test_a_chunk_kept_is_placed_into_the_later_jobs_without_a_read(tmp_path):
    """Jobs one after another (never in flight together): with reuse, each chunk is read and decoded by the
    first job only, and the next ones, with other copies and another cast, are placed from what it kept; with
    none (the default), every job reads every chunk."""
    n = 12
    first, second = Chunks(tmp_path, n), Chunks(tmp_path, n, same=True)
    first.write()
    engine = native.Engine(1, 16 << 20)
    for _ in range(2):  # no reuse asked: each job decodes its chunks
        status, c = second.run(engine)
        assert (status == native.ST_OK).all() and (c["chunks_decoded"], c["chunks_reused"]) == (n, 0)
    engine.reuse(1 << 20, 1)
    status, c = first.run(engine)
    assert (status == native.ST_OK).all() and (c["chunks_decoded"], c["chunks_reused"]) == (n, 0)
    first.check()
    for _ in range(3):
        status, c = second.run(engine)
        assert (status == native.ST_OK).all()
        assert (c["chunks_decoded"], c["chunks_reused"], c["bytes_read"], c["files_opened"]) == (0, n, 0, 0)
        second.check()
    info = engine.reuse_info()
    assert (info["inserted"], info["hits"], info["entries"], info["evicted"]) == (n, 3 * n, n, 0)
    assert info["held"] == info["peak"] == n * ROWS * COLS * 2
    assert engine.close(5)


def test_a_crop_s_chunk_is_kept_whole_for_the_jobs_that_read_further(tmp_path):
    """The first job reads 3 rows of each chunk (alone, its decode would stop there): kept, a chunk is decoded
    whole, so a job reading all 8 rows is placed from it. A chunk damaged past those 3 rows fails only the job
    that reads that far, as with no reuse: the first job's own span is decoded again alone (and not kept), and
    the second job reads and fails it itself."""
    n = 6
    crop, whole = Chunks(tmp_path, n, rows=3, cols=WIDE), Chunks(tmp_path, n, same=True, cols=WIDE)
    crop.write(damaged=n - 1)
    engine = native.Engine(1, 16 << 20)
    engine.reuse(16 << 20, 7)
    status, c = crop.run(engine)
    assert status.tolist() == [native.ST_OK] * n
    crop.check()
    assert c["chunks_decoded"] == n
    status, c = whole.run(engine)
    assert status.tolist() == [native.ST_OK] * (n - 1) + [native.ST_CODEC_ERROR]
    whole.check(upto=n - 1)
    assert (c["chunks_reused"], engine.reuse_info()["inserted"]) == (n - 1, n - 1)
    assert engine.close(5)


def test_a_new_generation_reads_every_file_again(tmp_path):
    """A chunk kept for one generation is never served to a job submitted in another: files rewritten between
    two generations (two pushes) are read again, with their new values, and the old entries are dropped."""
    n = 5
    t = Chunks(tmp_path, n)
    t.write(version=0)
    engine = native.Engine(1, 16 << 20)
    engine.reuse(1 << 20, 1)
    t.run(engine)
    t.check(version=0)
    t.write(version=1)  # same paths, same sizes: the key (path and grid coordinates) is the same
    status, c = t.run(engine)
    assert (c["chunks_reused"], c["chunks_decoded"]) == (n, 0)  # the same generation: kept values, as designed
    t.check(version=0)
    engine.reuse(1 << 20, 2)
    assert engine.reuse_info()["held"] == 0
    status, c = t.run(engine)
    assert (status == native.ST_OK).all() and (c["chunks_reused"], c["chunks_decoded"]) == (0, n)
    t.check(version=1)
    assert engine.close(5)


def test_the_chunks_kept_stay_within_their_bound(tmp_path):
    """At most ``max_bytes`` are held, least recently used out first: room for 3 chunks of 8 keeps the last
    3 decoded; a job over all 8 then reuses what is still there when it reaches it and decodes the rest. Lowering
    the bound evicts down to it; 0 keeps nothing."""
    n, size = 8, ROWS * COLS * 2
    t = Chunks(tmp_path, n)
    t.write()
    engine = native.Engine(1, 16 << 20)
    engine.reuse(3 * size, 1)
    t.run(engine)
    info = engine.reuse_info()
    assert (info["entries"], info["held"], info["peak"], info["evicted"]) == (3, 3 * size, 3 * size, n - 3)
    for _ in range(3):
        status, c = t.run(engine)
        assert (status == native.ST_OK).all() and c["chunks_decoded"] + c["chunks_reused"] == n
        t.check()
        assert engine.reuse_info()["peak"] <= 3 * size
    engine.reuse(size, 1)
    assert engine.reuse_info()["held"] == size
    engine.reuse(0, 1)
    assert engine.reuse_info()["held"] == 0
    status, c = t.run(engine)
    assert c["chunks_reused"] == 0 and c["chunks_decoded"] == n
    assert engine.close(5)


def test_the_memory_a_chunk_is_decoded_into_to_be_kept_is_within_the_bound(tmp_path):
    """A chunk to be kept is decoded into memory its entry will own: that memory is taken within the bound
    (older entries evicted first) and counted in ``held`` and ``peak`` while the decode runs, not only once the
    entry is listed (else each thread held a chunk more than the bound, unseen). One thread, chunk 1 damaged:
    with room for one chunk, decoding 1 evicts the kept 0 first and its failure leaves nothing kept; with room
    for two, the peak counts 1's memory beside 0's, and the failed decode gives it back."""
    n, size = 2, ROWS * COLS * 2
    t = Chunks(tmp_path, n)
    t.write(damaged=1)
    for room, after in [(1, (0, 0, 1, size)), (2, (1, size, 0, 2 * size))]:
        engine = native.Engine(1, 16 << 20)
        engine.reuse(room * size, 1)
        status, _ = t.run(engine)
        assert status.tolist() == [native.ST_OK, native.ST_CODEC_ERROR]
        info = engine.reuse_info()
        assert (info["entries"], info["held"], info["evicted"], info["peak"]) == after
        assert engine.close(5)


def test_jobs_of_many_threads_with_a_small_bound_place_every_value(tmp_path):
    """Two threads, jobs submitted from three Python threads, each taking the chunks in an order of its own, while
    the bound (8 chunks of 16) evicts entries that other threads are placing from (pinned: freed by the last one
    out): every batch is right, the bound holds, and every chunk is decoded, shared or reused. Under
    ``.ci/asan`` this is the race check of the entries' lifetime."""
    n, size = 16, ROWS * COLS * 2
    Chunks(tmp_path, n).write()
    engine = native.Engine(2, 16 << 20)
    engine.reuse(8 * size, 1)
    errors = []

    def run(same: bool, seed: int) -> None:
        try:
            t = Chunks(tmp_path, n, same=same)
            rng = np.random.default_rng(seed)
            for _ in range(20):
                status, c = t.run(engine, rng.permutation(n))
                assert (status == native.ST_OK).all() and c["chunks_decoded"] + c["chunks_reused"] + \
                    c["chunks_shared"] == n
                t.check()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k == 1, k)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(100)
    assert not errors, errors[0]
    info = engine.reuse_info()
    assert info["peak"] <= 8 * size and info["hits"] > 0
    assert engine.close(5)


SLOW = 1 << 19  # 8 x 2^19 uint16: 8 MiB decoded from noise, a decode of several milliseconds


def _noise(i: int, version: int = 0, cols: int = COLS) -> np.ndarray:
    """Values zstd decodes slowly (entropy-coded literals, few matches), so a decode is long enough to overlap."""
    return np.random.default_rng(1000 * i + version).integers(0, 64, (ROWS, cols)).astype(np.uint16)


def _slow(root, same: bool = False, cols: int = SLOW) -> Chunks:
    t = Chunks(root, 1, same=same, cols=cols)
    t.chunks[:, native.C_MAX_STORED] = 2 * ROWS * cols * 2  # noise: stored near its decoded size
    return t


def _busy(root, engine, n: int = 50000):
    """A job that keeps the engine's threads busy a while (``n`` small chunks of one file, read as a byte range of
    a file of no known identity: never shared nor kept, so each is read and decoded): jobs submitted right after
    it are in flight together before a thread reaches them. Cancel it to let them run."""
    t = Chunks(root, 1, cols=8)
    t.write()
    t.chunks[:, native.C_OFFSET] = 0
    t.chunks[:, native.C_LENGTH] = os.path.getsize(t.root + "c/0.0")
    t.chunks = np.repeat(t.chunks, n, axis=0)
    t.chunks[:, native.C_FIRST_COPY] = np.arange(n)
    t.copies = np.repeat(t.copies, n, axis=0)
    t.copies[:, native.CP_DST_OFFSET] = np.arange(n) * ROWS * 8
    t.batch = np.zeros((n, ROWS, 8), np.float32)
    return t.submit(engine)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_chunk_two_jobs_need_at_once_is_decoded_once(tmp_path, reuse):
    """Two threads, two jobs in flight that need one chunk file (with reuse or not): one thread takes it in the
    first job while the other, finding the first job's only chunk handed out, takes it in the second. Claiming it,
    looking for the other jobs' copies of it and starting the decode are one section of the engine's lock, so the
    second of the two finds the chunk taken by the first (which places it into both) and never decodes it as well:
    once a round, every round. (Before, each claimed its own job's copy first, unlocked, then could find the other's
    copy claimed and both decode it, or with reuse find it kept only once the other was through: with reuse,
    some of the 40 rounds did so in most runs on 2 cores; without, rarely, as the window was narrower.)"""
    first, second = _slow(tmp_path, cols=1 << 16), _slow(tmp_path, same=True, cols=1 << 16)
    first.write(values=_noise)
    engine = native.Engine(2, 64 << 20)
    busy_root = tmp_path / "busy"
    together = 0
    for r in range(40):
        if reuse:
            engine.reuse(32 << 20, r + 1)  # a new generation: nothing kept from the last round
        busy = _busy(busy_root, engine)
        a, b = first.submit(engine), second.submit(engine)
        early = busy.done  # the threads were through it before b was in flight (a stall): not this case
        busy.cancel()
        (sa, ca), (sb, cb) = _done(a), _done(b)
        assert sa.tolist() == sb.tolist() == [native.ST_OK]
        first.check(values=_noise)
        second.check(values=_noise)
        if not early:
            together += 1
            decoded, shared = ca["chunks_decoded"] + cb["chunks_decoded"], ca["chunks_shared"] + cb["chunks_shared"]
            assert (decoded, shared) == (1, 1), r
    assert together >= 20
    assert engine.close(5)


def test_a_chunk_being_decoded_to_be_kept_is_placed_into_a_job_submitted_meanwhile(tmp_path):
    """With reuse, a job submitted while another job's thread decodes a chunk it needs (same generation) joins
    that decode in flight: its own thread goes on, and the decoding thread places the chunk into it once
    decoded and kept. One decode a round, whether the second job's thread gets there during the decode (joined:
    counted shared), after it (reused) or before it starts (taken with it: shared). (Before, a job submitted
    during the decode missed the entry, not kept yet, and decoded the chunk again.) A new generation each round:
    nothing kept from the last is served."""
    first, second = _slow(tmp_path), _slow(tmp_path, same=True)
    first.write(values=_noise)
    engine = native.Engine(2, 64 << 20)
    joined = rounds = 0
    for r in range(40):  # at least 6 rounds, more until a join was seen (a loaded machine can stall 2 ms)
        if r >= 6 and joined:
            break
        rounds += 1
        engine.reuse(32 << 20, r + 1)
        a = first.submit(engine)
        time.sleep(0.002)  # the first job's thread is decoding (several ms), most rounds
        b = second.submit(engine)
        (sa, ca), (sb, cb) = _done(a), _done(b)
        assert sa.tolist() == sb.tolist() == [native.ST_OK]
        first.check(values=_noise)
        second.check(values=_noise)
        assert ca["chunks_decoded"] + cb["chunks_decoded"] == 1, r
        assert ca["chunks_shared"] + cb["chunks_shared"] + cb["chunks_reused"] == 1, r
        joined += cb["chunks_shared"]
    info = engine.reuse_info()
    assert info["inserted"] == rounds and info["held"] == ROWS * SLOW * 2  # the last generation's entry only
    assert joined > 0  # the join itself was exercised (the machine would have to stall 2 ms every round else)
    assert engine.close(5)


def test_a_bound_lowered_while_a_chunk_decodes_to_be_kept_holds_it_to_the_bound(tmp_path):
    """The bound taken back to 0 (``reuse(0, same generation)``, as ``SharedEngine.leave`` does) while a thread
    decodes a 16 MiB chunk to be kept: the keep applies the bound as it is then, so nothing is held past it once
    the job is done. (Before, the keep checked only the generation: the entry was listed and held stayed 16 MiB
    over a bound of 0 until the next ``reuse``, every round on 2 cores.)"""
    chunk = _slow(tmp_path, cols=1 << 20)  # 16 MiB of noise: a decode of 10 ms or more
    chunk.write(values=_noise)
    engine = native.Engine(1, 128 << 20)
    for r in range(5):
        engine.reuse(64 << 20, r + 1)
        job = chunk.submit(engine)
        time.sleep(0.003)  # its thread is decoding into memory reserved within 64 MiB
        engine.reuse(0, r + 1)
        status, _ = _done(job)
        assert status.tolist() == [native.ST_OK]
        chunk.check(values=_noise)
        info = engine.reuse_info()
        assert (info["max_bytes"], info["held"], info["entries"]) == (0, 0, 0), r
    assert engine.close(5)


def test_a_job_of_a_newer_push_never_joins_an_older_push_s_decode_in_flight(tmp_path):
    """A job submitted after a new push (a new generation) while a thread decodes, to be kept, a chunk an older
    push's job needs, its file rewritten between the two pushes: the newer job never joins that decode (a flight
    of the old generation) and reads the new values. (It decodes the chunk itself, or, when the first job's
    thread starts only after it was submitted, that thread reads the new file and takes it along: the values are
    the new ones either way.)"""
    first, second = _slow(tmp_path, cols=1 << 20), _slow(tmp_path, same=True, cols=1 << 20)
    path = first.root + "c/0.0"
    for r in range(8):
        first.write(values=_noise, version=2 * r)
        engine = native.Engine(2, 256 << 20)
        with open(path + ".tmp", "wb") as f:  # the new file, ready to replace the old whole in one step
            f.write(numcodecs.Zstd(level=1).encode(_noise(0, 2 * r + 1, 1 << 20).tobytes()))
        engine.reuse(64 << 20, 1)
        a = first.submit(engine)
        time.sleep(0.003)  # the first job's thread is decoding: a flight of generation 1
        os.replace(path + ".tmp", path)  # (the first job's open file keeps the old bytes)
        engine.reuse(64 << 20, 2)  # the new push
        b = second.submit(engine)
        (sa, _), (sb, cb) = _done(a), _done(b)
        assert sa.tolist() == sb.tolist() == [native.ST_OK]
        second.check(values=_noise, version=2 * r + 1)  # the new values: never placed from the old flight
        assert cb["chunks_decoded"] + cb["chunks_shared"] == 1 and cb["chunks_reused"] == 0, (r, cb)
        assert engine.close(5)


def test_a_job_cancelled_or_dropped_while_it_waits_on_a_decode_in_flight_is_never_written(tmp_path):
    """A job whose chunk joined another job's decode in flight (its own thread gone on) and is then cancelled is
    not written once cancel() returns: its chunk ends CANCELLED (or OK when it was placed before the cancel, in
    a round where the decode was through by then) and it is done once the decoding thread is; a job dropped so is
    freed only once that thread let it go (AddressSanitizer would see a write into freed memory). The job that
    decodes the chunk still gets it, and keeps it."""
    cancelled = 0
    first = _slow(tmp_path, cols=2 * SLOW)  # a decode of about 12 ms here, alone: 9 past the cancel
    first.write(values=_noise)
    engine = native.Engine(2, 128 << 20)
    rounds = 0
    for r, drop in enumerate((False, True) * 20):  # at least 6 rounds, more until a cancel landed in a join
        if r >= 6 and cancelled:
            break
        rounds += 1
        engine.reuse(64 << 20, r + 1)
        second = _slow(tmp_path, same=True, cols=2 * SLOW)
        a = first.submit(engine)
        time.sleep(0.002)  # a's thread is decoding the chunk
        b = second.submit(engine)
        time.sleep(0.001)  # b's thread has joined that decode, most rounds
        if drop:
            del b, second
        else:
            b.cancel()
            second.batch[...] = 7
        sa, ca = _done(a)
        assert sa.tolist() == [native.ST_OK] and ca["chunks_decoded"] == 1
        first.check(values=_noise)
        if not drop:
            sb, cb = _done(b)
            assert cb["chunks_decoded"] == 0
            if sb.tolist() == [native.ST_CANCELLED]:
                assert cb["chunks_shared"] == cb["chunks_reused"] == 0
                cancelled += 1
            else:  # placed (from the decode it joined, or the kept entry) before the cancel
                assert sb.tolist() == [native.ST_OK] and cb["chunks_shared"] + cb["chunks_reused"] == 1
            assert (second.batch == 7).all()  # nothing written after cancel() returned
    assert engine.reuse_info()["inserted"] == rounds
    assert cancelled > 0
    assert engine.close(5)


# -- the pipeline -------------------------------------------------------------------------------------------


@pytest.fixture()
def volume(tmp_path):
    """A zarr-python array (zstd, its default) of 2 x 4 x 4 chunks of 32^3 and the 2 x 3 x 3 tiles of 48^3 at
    stride 32 over it: neighbouring tiles share chunks."""
    uri = str(tmp_path / "v.zarr")
    z = zarr.create_array(uri, shape=(64, 128, 128), chunks=(32, 32, 32), dtype="uint16")
    z[:] = np.random.default_rng(5).integers(0, 4096, z.shape, dtype=np.uint16)
    return uri, z


def _tiles(uri: str) -> list[stoker.Sample]:
    grid = stoker.TileGrid([uri], (48, 48, 48), stride=(32, 32, 32))
    return [grid.sample(0, i) for i in range(len(grid))]


def _read(pipeline, samples) -> tuple[np.ndarray, int]:
    """Push ``samples``, pop them all: the batches' rows in order, and the chunks decoded for them."""
    before = pipeline.stats().chunks_decoded
    pipeline.push(samples)
    rows = []
    while len(rows) < len(samples):
        with pipeline.pop(timeout=20) as batch:
            rows.extend(torch.from_dlpack(batch).numpy().copy())
    return np.stack(rows), pipeline.stats().chunks_decoded - before


def test_a_grid_read_ahead_decodes_each_chunk_once(volume):
    """A pipeline reading a grid ahead (``read_ahead``, as CropDataset asks for a grid's epoch) keeps the chunks
    its batches decode: with one engine thread each of the 32 chunks is decoded exactly once, whatever the
    batches in flight (batches of 2 tiles, at most 2 made ahead: each chunk is needed by batches far apart), and
    every tile is zarr-python's values. Without read_ahead, the same grid decodes chunks several times."""
    uri, z = volume
    tiles = _tiles(uri)
    want = np.stack([z[tuple(slice(*ax) for ax in s.aabb)] for s in tiles]).astype(np.float32)
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, sample_shape=(48, 48, 48),
                        lookahead_batches=1, pop_timeout_s=20)
    with stoker.Pipeline(cfg, read_ahead=2) as p:
        got, decoded = _read(p, tiles)
        # the chunks kept count in the pipeline's buffers, within host_buffer_bytes (taken from the Python path's room)
        executor = p._executor
        kept = executor.decoders.native.reuse_info()
        assert 0 < executor.reuse_bytes and kept["peak"] <= executor.reuse_bytes == kept["max_bytes"]
        assert executor.peak_bytes() >= executor.host_nbytes() + kept["peak"]
        assert executor.budget.capacity + executor.reuse_bytes + executor.host_nbytes() <= cfg.host_buffer_bytes
    assert np.array_equal(got, want)
    assert decoded == 32
    with stoker.Pipeline(cfg) as p:
        got, decoded = _read(p, tiles)
    assert np.array_equal(got, want)
    assert decoded > 32


def test_a_new_push_reads_an_array_rewritten_since_the_last(volume):
    """Chunks kept for one push are not served to the next: an array rewritten by zarr-python between two pushes
    of the same tiles into one pipeline gives the new values (the chunk files' paths and sizes unchanged)."""
    uri, z = volume
    tiles = _tiles(uri)
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, sample_shape=(48, 48, 48),
                        lookahead_batches=1, pop_timeout_s=20)
    with stoker.Pipeline(cfg, read_ahead=2) as p:
        _read(p, tiles)
        z[:] = np.asarray(z[:]) ^ np.uint16(0x0F0F)
        got, decoded = _read(p, tiles)
    assert np.array_equal(got, np.stack([z[tuple(slice(*ax) for ax in s.aabb)] for s in tiles]).astype(np.float32))
    assert decoded == 32


def test_a_new_push_of_any_decoder_moves_the_shared_engine_to_a_new_generation():
    """Decoders sharing one engine count their pushes apart: one's push 2 after another kept chunks at its own 2
    must still drop them (a file rewritten before that push is read again); a decoder that leaves takes its
    grant with it."""
    from stoker.engine.cpu.decode_native import SharedEngine

    shared = SharedEngine(2)
    shared.start()
    try:
        lane_a, lane_b = object(), object()
        shared.reuse(lane_a, 1 << 20, 1)
        shared.reuse(lane_b, 1 << 20, 1)
        shared.reuse(lane_b, 1 << 20, 2)
        before = shared.reuse_info()["generation"]
        shared.reuse(lane_a, 1 << 20, 2)
        assert shared.reuse_info()["generation"] != before
        same = shared.reuse_info()["generation"]
        shared.reuse(lane_a, 1 << 20, 2)  # the same push told again: nothing dropped
        assert shared.reuse_info()["generation"] == same
        assert shared.reuse_info()["max_bytes"] == 2 << 20
        shared.leave(lane_a)
        assert shared.reuse_info()["max_bytes"] == 1 << 20
        shared.reuse(lane_b, 0, 2)
        assert shared.reuse_info()["max_bytes"] == 0
    finally:
        shared.close()
