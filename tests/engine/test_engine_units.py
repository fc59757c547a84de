"""Engine pieces on their own: partial blosc decoding, the batch planner, the transient budget."""

from __future__ import annotations

import threading
import time

import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec

import torch

import stoker
from stoker.engine.buffers import Cancelled, Reservation, TransientBudget, size_class
from stoker.engine.cpu.executor import engine_available
from stoker.engine.planning.tables import plan_tables
from stoker.zarr.codecs import blosc as blosc_partial

pytestmark = pytest.mark.timeout(60)

_CHUNK = (np.arange(32 * 64 * 64, dtype=np.uint32) * 2654435761 % 5003).astype(np.uint16).reshape(32, 64, 64)


@pytest.mark.skipif(not blosc_partial.available(), reason="numcodecs' blosc does not export blosc_getitem")
@pytest.mark.parametrize("cname", ["lz4", "zstd", "blosclz", "zlib"])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_partial_decode_matches_full_decode(cname, shuffle, data):
    frame = numcodecs.Blosc(cname, 5, shuffle, blocksize=16384).encode(_CHUNK)
    n = _CHUNK.nbytes
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    dest = np.full(_CHUNK.shape, 0xBEEF, dtype=np.uint16)
    assert blosc_partial.decode_blocks(frame, start, stop, dest)
    got = dest.view(np.uint8).reshape(-1)[start:stop]
    assert np.array_equal(got, _CHUNK.view(np.uint8).reshape(-1)[start:stop])


@pytest.mark.skipif(not blosc_partial.available(), reason="no blosc_getitem")
def test_partial_decode_really_skips_blocks():
    frame = numcodecs.Blosc("lz4", 5, 1, blocksize=16384).encode(_CHUNK)
    dest = np.full(_CHUNK.shape, 0xBEEF, dtype=np.uint16)
    assert blosc_partial.decode_range(frame, 0, 100, dest)
    flat = dest.reshape(-1)
    assert np.array_equal(flat[:50], _CHUNK.reshape(-1)[:50])  # the range was decoded
    assert (flat[16384 // 2:] == 0xBEEF).all()  # later blocks were never written


@pytest.mark.skipif(not blosc_partial.available(), reason="no blosc_getitem")
def test_partial_decode_only_where_it_is_cheaper():
    """blosc_getitem costs a little more per block than a full decode: a range needing more than
    PARTIAL_MAX_SHARE of the blocks is decoded whole."""
    frame = numcodecs.Blosc("lz4", 5, 1, blocksize=16384).encode(_CHUNK)
    n = _CHUNK.nbytes
    _, block, _ = blosc_partial.blosc_header(frame)
    k = int(blosc_partial.PARTIAL_MAX_SHARE * n) // block  # the most blocks still decoded one by one
    assert 1 <= k < n // block
    dest = np.full(_CHUNK.shape, 0xBEEF, dtype=np.uint16)
    assert blosc_partial.decode_range(frame, 0, k * block, dest) == k * block  # partial
    assert blosc_partial.decode_range(frame, 0, k * block + 1, dest) is None  # one block more: the caller decodes all
    assert not blosc_partial.partial_ok(frame[:16], n, 100, n - 100)
    assert blosc_partial.partial_ok(frame[:16], n, 100, 200)
    codec_dest = np.full(_CHUNK.shape, 0xBEEF, dtype=np.uint16)
    from stoker.zarr.codecs.chain import ChunkCodec

    codec = ChunkCodec(uri="mem", shape=_CHUNK.shape, dtype=_CHUNK.dtype, stored_dtype=_CHUNK.dtype,
                       compressors=(numcodecs.Blosc("lz4", 5, 1, blocksize=16384),))
    assert codec.partial
    assert codec.decode_range_into(frame, codec_dest, 100, n - 100) == n  # decoded whole
    assert np.array_equal(codec_dest, _CHUNK)
    assert codec.decode_range_into(frame, codec_dest, 100, 200) == block


@pytest.mark.parametrize("damage", ["truncated", "block_table", "cbytes"])
def test_partial_decode_rejects_forged_frames(damage):
    frame = bytearray(numcodecs.Blosc("lz4", 5, 1, blocksize=16384).encode(_CHUNK))
    if damage == "truncated":
        frame = frame[:-3]
    elif damage == "block_table":
        frame[16:20] = (2**31 - 1).to_bytes(4, "little")
    else:
        frame[12:16] = (len(frame) + 100).to_bytes(4, "little")
    with pytest.raises(blosc_partial.PartialDecodeError):
        blosc_partial.decode_range(bytes(frame), 0, 100, np.empty_like(_CHUNK))


def test_codec_range_decode_raises_decode_error_naming_key(tmp_path):
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=(32, 64, 64), chunks=(32, 64, 64), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle"))
    z[:] = _CHUNK
    arr = stoker.open_array(tmp_path / "a.zarr")
    key, raw = arr.encoded_chunk((0, 0, 0))
    codec = arr.metadata.codec
    assert codec.partial
    out = np.empty(codec.shape, codec.dtype)
    codec.decode_range_into(raw, out, 4096, 8192, key)
    assert np.array_equal(out.view(np.uint8).reshape(-1)[4096:8192], _CHUNK.view(np.uint8).reshape(-1)[4096:8192])
    with pytest.raises(stoker.DecodeError, match="c/0/0/0"):
        codec.decode_range_into(raw[:-1], out, 0, 10, key)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    plain = zarr.create_array(str(root / "plain.zarr"), shape=(16, 16), chunks=(4, 4), dtype="uint16")
    plain[:] = 1
    sharded = zarr.create_array(str(root / "sharded.zarr"), shape=(16, 16), chunks=(4, 4), shards=(8, 8),
                                dtype="uint16")
    sharded[0:8, 0:8] = 1  # shard (0, 0) only; inner chunks written
    sharded[0:4, 0:4] = 0  # ...and inner chunk (0, 0) back to fill: an empty index entry
    return str(root / "plain.zarr"), str(root / "sharded.zarr")


def _opener():
    cache = {}
    return lambda uri: cache.setdefault(uri, stoker.open_array(uri))


def _tasks(plan) -> list:
    """Every chunk of ``plan`` as the Python path reads it."""
    return [plan.chunks[i] for i in range(plan.n_chunks)]


def test_plan_dedupes_chunks_and_records_every_copy(arrays):
    plain, _ = arrays
    samples = [stoker.Sample(plain, [(2, 6), (2, 6)]), stoker.Sample(plain, [(2, 6), (2, 6)]),
               stoker.Sample(plain, [(4, 8), (0, 4)])]
    plan = plan_tables(0, samples, _opener())
    assert plan.chunks_needed == 4 + 4 + 1
    assert sorted(c.index for c in _tasks(plan)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    c10 = next(c for c in _tasks(plan) if c.index == (1, 0))
    assert [cp.row for cp in c10.copies] == [0, 1, 2]
    fills, reads = plan.python_reads()
    assert not fills and [fr.chunk_ids for fr in reads] == [(0,), (1,), (2,), (3,)]  # a read per file, in order
    assert all(fr.whole_file for fr in reads)
    assert plan.bytes_needed == 3 * 16 * 2


def test_plan_byte_range_covers_exactly_the_selected_rows(arrays):
    plain, _ = arrays
    plan = plan_tables(0, [stoker.Sample(plain, [(1, 3), (1, 2)])], _opener())
    (task,) = _tasks(plan)
    # rows 1..2 of a 4x4 uint16 chunk, columns 1..1: bytes from (1,1) to (2,1) inclusive
    assert (task.byte_start, task.byte_stop) == ((1 * 4 + 1) * 2, (2 * 4 + 1) * 2 + 2)


def test_plan_offsets_and_spans_match_the_slices(tmp_path):
    """The planner keeps each chunk's copies and its byte span as a running min/max: both must agree with
    what the slices say, for crops that cut chunks anywhere, overlap, repeat and sit on edge chunks."""
    from stoker.zarr.grid import c_order_span, chunk_intersections

    path = str(tmp_path / "odd.zarr")
    zarr.create_array(path, shape=(23, 31, 17), chunks=(5, 7, 4), dtype="uint16")
    rng = np.random.default_rng(7)
    shape = (6, 9, 5)
    samples = []
    for _ in range(12):
        corner = [int(rng.integers(0, s - k + 1)) for s, k in zip((23, 31, 17), shape)]
        samples.append(stoker.Sample(path, [(c, c + k) for c, k in zip(corner, shape)]))
    samples.append(samples[3])  # a repeated crop: more copies of the same chunks
    plan = plan_tables(0, samples, _opener())
    seen = 0
    for task in _tasks(plan):
        assert (task.byte_start, task.byte_stop) == c_order_span((5, 7, 4), 2, [c.chunk_sel for c in task.copies])
        seen += len(task.copies)
    # every copy is one the reference geometry names, with the same selections
    want = sorted((row, p.index, p.chunk_sel, p.box_sel) for row, s in enumerate(samples)
                  for p in chunk_intersections(s.aabb, (5, 7, 4)))
    got = sorted((c.row, t.index, c.chunk_sel, c.box_sel) for t in _tasks(plan) for c in t.copies)
    assert seen == plan.chunks_needed and got == want


def test_planned_offsets_are_used_only_for_batches_of_the_plans_shape(arrays):
    """The planner's offsets assume contiguous crops of the plan's sample shape. Into a larger batch tensor
    (the executor's contract does not forbid one) every path must still place the crop where slices say."""
    from stoker.engine.cpu import executor as cpu
    from stoker.engine.stats import StatsRecorder
    from stoker.storage import LocalStore

    plain, _ = arrays
    want = zarr.open_array(plain)[2:6, 5:9].astype(np.float32)
    for engine in (0, 16 << 20):  # the Python path, and the compiled engine where it is built
        ex = cpu.Decoders(1, 1, TransientBudget(64 << 20), StatsRecorder(), LocalStore(), engine_budget=engine)
        try:
            for out in (torch.full((1, 4, 4), -1.0), torch.full((1, 8, 8), -1.0)):
                job = ex.submit(ex.plan(0, [stoker.Sample(plain, [(2, 6), (5, 9)])], _opener()), out)
                assert job.wait(10) and job.error is None
                assert torch.equal(out[0, :4, :4], torch.from_numpy(want))
                assert (out[0, 4:] == -1).all() and (out[0, :, 4:] == -1).all()
        finally:
            ex.shutdown()


def test_plan_refuses_samples_of_another_shape(arrays):
    plain, _ = arrays
    with pytest.raises(stoker.InvalidArgument, match="every sample of a batch"):
        plan_tables(0, [stoker.Sample(plain, [(0, 4), (0, 4)]), stoker.Sample(plain, [(0, 4), (0, 5)])], _opener())


def test_plan_sharded_coalesces_and_fills(arrays):
    _, sharded = arrays
    samples = [stoker.Sample(sharded, [(0, 8), (0, 16)])]  # shard (0,0) present, shard (0,1) missing
    plan = plan_tables(0, samples, _opener())
    fill_ids, reads = plan.python_reads()
    fills = {plan.chunks[i].index for i in fill_ids}
    assert (0, 0) in fills  # empty index entry
    assert {(0, 2), (0, 3), (1, 2), (1, 3)} <= fills  # missing shard file
    (fr,) = reads
    assert fr.path.endswith("c/0/0") and len(fr.chunk_ids) == 3 and len(fr.reads) == 1  # coalesced
    # a chunk the compiled engine left to the Python path: a read of its own, at its index entry's range
    alone = [plan.file_read(c) for c in fr.chunk_ids]
    for one, cid in zip(alone, fr.chunk_ids):
        (read,) = one.reads
        task = plan.chunks[cid]
        assert one.chunk_ids == (cid,) and one.path.endswith("c/0/0")
        assert (read.offset, read.length) == (task.offset, task.length)
        assert read.slices() == [(0, slice(0, task.length))]
    assert all(plan.file_read(c) is None for c in fill_ids)


@pytest.mark.parametrize("one_by_one", [False, True], ids=["coalesced", "read-per-inner-chunk"])
def test_reads_that_find_the_budget_short_move_to_io_threads_and_complete(arrays, monkeypatch, one_by_one):
    """Compute threads read and decode; they never wait for memory (decodes queued behind them may be
    what frees it). With the budget held elsewhere, every read is handed to an I/O thread, which waits:
    shards coalesced, and shards planned with a read per inner chunk (as for the compiled reader)."""
    from stoker.engine.cpu import executor as cpu, decode_python
    from stoker.engine.executor import Job
    from stoker.engine.stats import StatsRecorder
    from stoker.storage import LocalStore

    handoffs = []
    real = decode_python.PythonDecoder._handoff
    monkeypatch.setattr(decode_python.PythonDecoder, "_handoff",
                        lambda self, job, fr, *rest: (handoffs.append(fr), real(self, job, fr, *rest)))
    plain, sharded = arrays
    samples = [stoker.Sample(plain, [(2, 14), (1, 15)]), stoker.Sample(sharded, [(2, 14), (1, 15)])]
    plan = plan_tables(0, samples, _opener())
    fills, reads = plan.python_reads()
    if one_by_one:  # as the compiled engine hands the Python path the chunks it leaves
        reads = [plan.file_read(c) for fr in reads for c in fr.chunk_ids]
    assert any(fr.whole_file for fr in reads) and any(not fr.whole_file for fr in reads)
    assert one_by_one == all(len(fr.chunk_ids) == 1 for fr in reads)
    budget = TransientBudget(8 * size_class(1))
    budget.reserve(budget.capacity, lambda: False)  # someone else holds it all
    ex = cpu.Decoders(1, 1, budget, StatsRecorder(), LocalStore())
    out = torch.full((2, 12, 14), -1.0)
    try:
        job = Job(plan, out, plan.n_chunks)
        ex.python.submit_fills(job, fills)
        ex.python.submit_reads(job, reads)
        assert not job.wait(0.3)  # nothing fits: the reads wait on I/O threads, not compute threads
        # every chunk read is handed off once (the compiled reader hands a shard's inner chunks one by one)
        handed = sorted(c for fr in handoffs for c in fr.chunk_ids)
        assert handed == sorted(c for fr in reads for c in fr.chunk_ids)
        budget.release(budget.capacity)
        assert job.wait(10) and job.error is None
    finally:
        ex.shutdown()
    expect = torch.from_numpy(np.stack([zarr.open_array(u)[2:14, 1:15] for u in (plain, sharded)]).astype(np.float32))
    assert torch.equal(out, expect)
    assert budget.reserved == 0


def test_plan_raises_typed_errors(arrays, tmp_path):
    plain, _ = arrays
    with pytest.raises(stoker.OutOfBounds):
        plan_tables(0, [stoker.Sample(plain, [(0, 4), (14, 18)])], _opener())
    with pytest.raises(stoker.NotFound):
        plan_tables(0, [stoker.Sample(str(tmp_path / "none.zarr"), [(0, 4), (0, 4)])], _opener())


def test_budget_waits_for_release_and_cancels():
    budget = TransientBudget(100)
    budget.reserve(80, lambda: False)
    done = threading.Event()

    def second():
        budget.reserve(50, lambda: False)
        done.set()

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.1)
    assert not done.is_set()  # 80 + 50 > 100: it waits
    budget.release(80)
    assert done.wait(2)
    t.join()
    with pytest.raises(Cancelled):
        budget.reserve(60, lambda: True)
    with pytest.raises(ValueError):
        budget.reserve(101, lambda: False)


def test_try_reserve_never_waits_and_drops_cached_buffers_to_fit():
    cap = size_class(1)
    budget = TransientBudget(2 * cap)
    assert budget.try_reserve(cap)
    budget.give(budget.take(cap))  # cached now
    assert budget.try_reserve(2 * cap)  # fits once the cached buffer is dropped
    assert budget.in_use == 2 * cap
    t0 = time.monotonic()
    assert not budget.try_reserve(1)
    assert time.monotonic() - t0 < 0.05
    with pytest.raises(stoker.BudgetExceeded):
        budget.try_reserve(3 * cap)


def test_budget_buffer_reuse_counts_against_capacity():
    cap = size_class(1)
    budget = TransientBudget(3 * cap)
    budget.reserve(cap, lambda: False)
    buf = budget.take(100)
    assert buf.nbytes == cap
    budget.give(buf)  # the reservation becomes cached memory
    assert (budget.reserved, budget.in_use) == (0, cap)
    budget.reserve(cap, lambda: False)
    assert budget.take(cap) is buf  # reused, not reallocated
    budget.reserve(2 * cap, lambda: False)  # cap in use + 2 cap fits exactly
    assert budget.in_use == 3 * cap and budget.peak <= 3 * cap


def test_reservation_returns_exactly_what_it_held():
    cap = size_class(1)
    budget = TransientBudget(10 * cap)
    res = Reservation(budget, users=2)
    res.reserve(4 * cap, lambda: False)
    shared = res.take(cap, keep=True)
    scratch = res.take(cap)
    res.give(scratch)
    res.done()
    assert budget.reserved == 3 * cap  # still held: one user left
    res.done()
    assert budget.reserved == 0 and budget.in_use == 2 * cap  # shared + scratch cached for reuse
    assert shared.nbytes == cap


def test_plan_splits_a_shard_into_bounded_read_groups(arrays):
    _, sharded = arrays
    samples = [stoker.Sample(sharded, [(0, 8), (0, 8)])]  # 3 present inner chunks of shard (0, 0)
    plan = plan_tables(0, samples, _opener())
    _, reads = plan.python_reads(max_group=1)
    assert len(reads) == 3 and all(len(fr.chunk_ids) == 1 for fr in reads)
    _, reads = plan.python_reads(max_group=10**9)
    assert len(reads) == 1 and len(reads[0].chunk_ids) == 3
    # the gap between requested chunks counts: take the first and last present inner chunks by file
    # offset (the middle one lies between them) as two samples
    table = stoker.open_array(sharded).shard_index("c/0/0")
    present = sorted((int(off), flat) for flat, (off, n) in enumerate(table) if int(n) != 2**64 - 1)
    assert len(present) == 3
    boxes = [[(4 * (flat // 2), 4 * (flat // 2) + 4), (4 * (flat % 2), 4 * (flat % 2) + 4)]
             for _, flat in (present[0], present[-1])]
    gapped = [stoker.Sample(sharded, b) for b in boxes]
    plan = plan_tables(0, gapped, _opener())
    (fr,) = plan.python_reads(max_group=10**9)[1]
    lengths = sum(plan.chunks[c].length for c in fr.chunk_ids)
    assert len(fr.chunk_ids) == 2 and fr.reads[0].length > lengths  # one coalesced read spanning the gap
    decoded = 2 * 4 * 4 * 2
    assert len(plan.python_reads(max_group=lengths + decoded)[1]) == 2  # fits the chunks, not the span


def _block_starts(frame: bytes) -> tuple[int, list[int]]:
    nbytes, blocksize = int.from_bytes(frame[4:8], "little"), int.from_bytes(frame[8:12], "little")
    n = -(-nbytes // blocksize)
    return blocksize, list(np.frombuffer(frame[16:16 + 4 * n], "<i4"))


def _out_of_order_frame(data: np.ndarray) -> bytes:
    """A valid blosc frame whose blocks are stored in reverse order.

    c-blosc compressing on several threads stores blocks in the order the threads
    finish; reversing them builds such a frame deterministically.
    """
    frame = numcodecs.Blosc("lz4", 5, 1, blocksize=65536).encode(data)
    blocksize, starts = _block_starts(frame)
    assert starts == sorted(starts) and len(starts) >= 4
    table_end = 16 + 4 * len(starts)
    ends = starts[1:] + [len(frame)]
    pieces = [frame[s:e] for s, e in zip(starts, ends)]
    body, new_starts, pos = [], [0] * len(starts), table_end
    for j in reversed(range(len(starts))):
        new_starts[j] = pos
        body.append(pieces[j])
        pos += len(pieces[j])
    out = frame[:16] + np.array(new_starts, "<i4").tobytes() + b"".join(body)
    assert len(out) == len(frame)
    assert np.array_equal(np.frombuffer(numcodecs.Blosc().decode(out), data.dtype), data.reshape(-1))  # valid
    return out


@pytest.mark.skipif(not blosc_partial.available(), reason="no blosc_getitem")
def test_partial_read_of_out_of_order_blocks_never_decodes_stale_bytes():
    """Regression: blocks stored out of order once made the partial read miss a needed block."""
    rng = np.random.default_rng(7)
    data = (np.cumsum(rng.integers(-3, 4, size=(32, 128, 128)), axis=2) + 1000).astype(np.uint16)  # 1 MiB
    frame = _out_of_order_frame(data)
    blocksize, starts = _block_starts(frame)
    assert starts != sorted(starts)
    stale = numcodecs.Blosc("lz4", 5, 1).encode(data[::-1].copy())  # another chunk's bytes
    n = len(starts)
    ranges = [(j * blocksize, (j + 1) * blocksize) for j in range(n)]  # every block alone
    ranges += [(j * blocksize + 100, (j + 2) * blocksize - 100) for j in range(n - 1)]  # adjacent pairs
    ranges += [(0, data.nbytes)]
    for start, stop in ranges:
        buf = bytearray(stale.ljust(len(frame), b"\x00")[: len(frame)])  # a pooled buffer's stale contents
        table = blosc_partial.table_size(frame[:16])
        buf[:table] = frame[:table]
        lo, hi = blosc_partial.stored_range(frame[:table], start, stop)
        buf[lo:hi] = frame[lo:hi]
        dest = np.zeros_like(data)
        assert blosc_partial.decode_blocks(bytes(buf), start, stop, dest)
        got = dest.view(np.uint8).reshape(-1)[start:stop]
        assert np.array_equal(got, data.view(np.uint8).reshape(-1)[start:stop]), (start, stop, starts)


def test_corrupt_header_fields_are_partial_decode_errors():
    frame = bytearray(numcodecs.Blosc("lz4", 5, 1, blocksize=16384).encode(_CHUNK))
    for offset, value in [(3, 0), (8, 0), (4, 0)]:  # typesize, blocksize, nbytes
        bad = bytearray(frame)
        bad[offset:offset + (1 if offset == 3 else 4)] = value.to_bytes(1 if offset == 3 else 4, "little")
        with pytest.raises(blosc_partial.PartialDecodeError):
            blosc_partial.stored_range(bytes(bad[:64]), 0, 100)


def _huge_bytes_at(address: int) -> int | None:
    """AnonHugePages (bytes) of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return None


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1: text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_large_batch_slots_are_backed_by_huge_pages():
    """CPU slots of 8 MiB and more ask for huge pages before their first write, and get them; smaller ones
    and pinned ones are left alone."""
    import torch

    from stoker.engine import allocate as hugepages
    from stoker.engine.buffers import SlotRing

    ring = SlotRing(2, (8, 4 << 20), torch.uint8)  # 32 MiB slots
    for slot in ring.slots:
        slot.tensor.fill_(7)
        assert _huge_bytes_at(slot.tensor.data_ptr() + (16 << 20)) > 0
        assert bool((slot.tensor == 7).all())
    assert not hugepages.advise_huge_pages(torch.empty(hugepages.MIN_BYTES - 1, dtype=torch.uint8))
    assert hugepages.advise_huge_pages(torch.empty(hugepages.MIN_BYTES, dtype=torch.uint8))


def test_executors_check_their_memory_as_the_pipeline_did():
    """The budget checks moved into the executors (so the pipeline has no CUDA branch) keep their words: the
    CPU's slots, and a GPU's pinned staging slots (charged at the size torch pins) and device slots. (The
    CUDA executor's arithmetic needs no GPU; tests/engine/test_cuda_pipeline.py runs the rest where there is one.)"""
    from stoker.engine.cpu.executor import CpuExecutor
    from stoker.engine.stats import StatsRecorder
    from stoker.engine.cuda.transfer import CudaExecutor
    from stoker.storage import LocalStore

    cfg = stoker.Config(batch_size=4, sample_shape=(10, 100, 100), dtype="f32", host_buffer_bytes=4 << 20,
                        device_buffer_bytes=3 << 20, device="cpu")
    cpu = CpuExecutor(cfg, StatsRecorder(), LocalStore())
    with pytest.raises(stoker.BudgetExceeded, match=r"3 batch slots \(lookahead_batches \+ 1\) x 4 samples x "
                                                    r"\(10, 100, 100\) x 4 B = 4,800,000 B") as err:
        cpu.check_budget((10, 100, 100), torch.float32, 0)
    assert err.value.needed == 4_800_000
    cuda = CudaExecutor(cfg, torch.device("cuda", 0), StatsRecorder(), LocalStore())
    with pytest.raises(stoker.BudgetExceeded, match=r"2 pinned staging slots \(lookahead_batches\) x 4 samples x "
                                                    r"\(10, 100, 100\) x 4 B, each pinned as 2,097,152 B") as err:
        cuda.check_budget((10, 100, 100), torch.float32, 1)
    assert err.value.needed == 2 * 2_097_152 + 1
    cuda.check_budget((10, 50, 100), torch.float32, 0)  # 800,000 B pinned as 1 MiB, twice; 2,800,000 B on the GPU
    with pytest.raises(stoker.BudgetExceeded, match="device_buffer_bytes=3,145,728 cannot hold this pipeline on "
                                                    "cuda:0: 3 batch slots .* plus 480,000 B of staging") as err:
        cuda.check_budget((10, 60, 100), torch.float32, 0)  # still fits the host; 3,360,000 B on the GPU do not
    assert err.value.knob == "device_buffer_bytes"


@pytest.mark.skipif(not engine_available(), reason="the compiled engine is not built")
def test_arrays_the_engine_cannot_decode_leave_the_budget_to_python(tmp_path):
    """A first batch of bz2 chunks (a codec the engine does not decode): the engine takes no share of
    host_buffer_bytes, and the Python path that reads them keeps all that the slots leave."""
    uri = str(tmp_path / "bz2.zarr")
    z = zarr.open_array(uri, mode="w", shape=(16, 16), chunks=(8, 8), dtype="uint16", zarr_format=2,
                        compressor=numcodecs.BZ2(level=1))
    z[...] = np.arange(256, dtype="uint16").reshape(16, 16)
    cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", host_buffer_bytes=256 << 20, pop_timeout_s=20)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(0, 16), (0, 16)])])
        with p.pop() as batch:
            assert torch.equal(torch.from_dlpack(batch)[0], torch.from_numpy(z[...].astype(np.float32)))
        ex = p._executor
        assert ex.decoders.native is None
        assert ex.budget.capacity == cfg.host_buffer_bytes - ex.host_slots.nbytes


def test_a_failed_job_cancels_its_engine_work_at_once():
    """The first failure of a batch stops what still writes into it (the engine's job): the batch is lost,
    and its slot must not keep being written while the error travels to pop. A stop registered after the
    failure runs at once; every stop runs once."""
    from stoker.engine.executor import Job

    stopped = []
    job = Job(None, torch.zeros(2, 2), 3)
    job.on_cancel(lambda: stopped.append("engine"))
    job.finish(1)
    assert stopped == [] and not job.done.is_set()
    job.finish(1, stoker.DecodeError("chunk c/0 is corrupt"))
    assert stopped == ["engine"] and job.done.is_set() and isinstance(job.error, stoker.DecodeError)
    job.on_cancel(lambda: stopped.append("late"))
    job.finish(1, stoker.DecodeError("a second one"))
    job.cancel()
    assert stopped == ["engine", "late"] and "corrupt" in str(job.error)


def _fill_word_now(fill, dtype) -> int:
    """The fill word cast afresh: ``fill`` in ``dtype``, its bytes zero-padded to 8, as an int64."""
    from stoker.engine.cast import fill_value_as

    raw = fill_value_as(fill, dtype).reshape(1).view(torch.uint8).numpy().tobytes()
    return int(np.frombuffer(raw.ljust(8, b"\0"), np.int64)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint16, torch.int8, torch.float64])
def test_fill_words_are_kept_per_value_and_dtype(dtype):
    """The engine's fill word of an array (its fill value cast into the batch dtype) is the same whether it
    was cast now or kept from an earlier array, and a kept word never answers for another value, source
    dtype or batch dtype (the cache is filled with every value first, then asked again)."""
    from stoker.engine.cpu.decode_native import _FILL_WORDS, _fill_word

    fills = [np.array(v, dt) for dt in ("uint8", "int16", "float32", "float64") for v in (0, 1, 7, 100)]
    fills += [np.array(np.nan, "float64"), np.array(-3, "int16"), np.array(-0.0, "float32")]
    _FILL_WORDS.clear()
    for other in (torch.float32, torch.uint16):  # words of other batch dtypes kept beside these
        [_fill_word(f, other) for f in fills]
    first = [_fill_word(f, dtype) for f in fills]
    again = [_fill_word(f, dtype) for f in fills]
    assert first == again == [_fill_word_now(f, dtype) for f in fills]


def test_done_wakes_every_waiter_once_set_and_times_out_before():
    from stoker.engine.executor import Done

    done = Done()
    assert not done.is_set() and done.wait(0.01) is False  # a wait before the set times out
    woken = []
    waiters = [threading.Thread(target=lambda: woken.append(done.wait(10))) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.05)  # most of them waiting, on the Event the first one made
    assert woken == []
    done.set()
    done.set()  # idempotent
    for t in waiters:
        t.join(10)
    assert woken == [True] * 4 and done.is_set() and done.wait(0) is True
    late = Done()
    late.set()
    assert late.wait() is True and late._event is None  # set before anyone waited: no Event made


def test_a_sized_push_is_checked_against_a_shape_settled_while_it_was_checked(monkeypatch):
    """push checks a list outside the lock and pull stages it without a second look: when a pull of an
    earlier generator settles the pipeline's shape meanwhile, push checks the list again, against it."""
    import stoker.engine.pipeline.intake as intake_module

    intake = intake_module.Intake(stoker.Config(batch_size=2, dtype="f32"), threading.Condition())
    settled = stoker.Sample("a.zarr", [(0, 8), (0, 8)])
    other = [stoker.Sample("b.zarr", [(0, 4), (0, 4)]) for _ in range(2)]
    real = intake_module.validate

    def pulled_meanwhile(s, shape, first=None):
        if s is other[0] and intake.shape is None:  # as a coordinator's pull of the generator would
            intake.shape, intake.first = settled.shape, settled
        return real(s, shape, first)

    monkeypatch.setattr(intake_module, "validate", pulled_meanwhile)
    with pytest.raises(stoker.InvalidArgument, match=r"must be \(8, 8\)"):
        intake.push(other)
    assert intake.pending == 0 and not intake.sources  # nothing of the refused list was queued


def test_host_slot_bytes_counts_the_pipelines_host_slots(tmp_path):
    """pipeline.host_slot_bytes (what stoker bench reports) is the host batch slots' size: 0 before the
    first batch makes them, then every slot of the ring."""
    from stoker.engine.pipeline.facade import host_slot_bytes

    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=(64, 64), chunks=(16, 16), dtype="uint16", fill_value=0)[:] = 7
    cfg = stoker.Config(batch_size=2, sample_shape=(8, 8), dtype="f32", device="cpu", lookahead_batches=3)
    with stoker.Pipeline(cfg) as p:
        assert host_slot_bytes(p) == 0
        p.push([stoker.Sample(uri, [(i, i + 8), (0, 8)]) for i in range(4)])
        with p.pop():
            pass
        ring = p._host_slots
        assert host_slot_bytes(p) == ring.nbytes == len(ring.slots) * 2 * 8 * 8 * 4 > 0


def test_a_batch_cut_off_by_close_has_one_error_written_once():
    """errors.pipeline_closed is the one place the closed-batch error is worded (it was copied 19 times)."""
    from pathlib import Path

    from stoker.errors import ShutdownError, pipeline_closed

    error = pipeline_closed()
    assert isinstance(error, ShutdownError) and isinstance(error, RuntimeError)
    assert str(error) == "the pipeline was closed while this batch was being made"
    src = Path(stoker.__file__).parent
    copies = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if "pipeline was closed while this" in
              p.read_text() or 'ShutdownError("the pipeline was closed")' in p.read_text()]
    assert copies == ["errors.py"]


def test_a_budget_with_no_room_for_the_engine_reads_on_the_python_path(tmp_path):
    """host_buffer_bytes that holds the slots and the Python path's least room, and nothing more: no compiled
    engine is started (it would have no scratch: every job refused), the Python path reads every chunk, and the
    batches are zarr's."""
    from stoker.engine.cpu import executor as cpu
    from zarr.codecs import ZstdCodec

    if not engine_available():
        pytest.skip("stoker._native is not built")
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(16, 64, 72), chunks=(8, 32, 32), dtype="uint16", compressors=ZstdCodec(level=1))
    data = (np.arange(16 * 64 * 72) % 60000).astype(np.uint16).reshape(z.shape)
    z[:] = data
    samples = [stoker.Sample(uri, [(0, 16), (0, 64), (i, i + 64)]) for i in range(8)]
    slots = 3 * 4 * 16 * 64 * 64 * 4  # lookahead_batches + 1 slots of 4 float32 samples
    least = 2 * size_class(8 * 32 * 32 * 2) + size_class(1)  # one chunk's read and decode
    budget = next(b for b in range(slots, 2 * slots) if b - slots == max(min(8 << 20, b // 16), least))
    cfg = stoker.Config(batch_size=4, dtype="f32", host_buffer_bytes=budget, n_io_threads=1, n_compute_threads=2,
                        pop_timeout_s=20.0, device="cpu")
    assert cfg.lookahead_batches == 2
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        got = [torch.from_dlpack(b).clone() for b in p]
        executor = p._executors()[0]
        assert isinstance(executor, cpu.CpuExecutor) and executor.decoders.native is None
    want = [torch.from_numpy(data[:, :, s.aabb[2][0]:s.aabb[2][1]].astype(np.float32)) for s in samples]
    assert all(torch.equal(batch[k], want[4 * j + k]) for j, batch in enumerate(got) for k in range(4))
