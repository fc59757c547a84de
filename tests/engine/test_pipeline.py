"""The crop pipeline against zarr-python: values, order, casting, errors, lifetime."""

from __future__ import annotations

import functools
import gc
import itertools
import os
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import stoker

from batch_oracle import random_crops as _random_samples

pytestmark = pytest.mark.timeout(60)


def _write(path, shape, chunks, dtype="uint16", shards=None, compressors="lz4", fill_value=0, seed=0, order_hint=None):
    comp = {
        "lz4": BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
        "zstd": ZstdCodec(level=1),
        None: None,
    }[compressors]
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                          compressors=comp, fill_value=fill_value)
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        data = rng.normal(0, 1000, size=shape).astype(dtype)
    elif np.dtype(dtype).kind == "b":
        data = rng.integers(0, 2, size=shape).astype(bool)
    else:
        info = np.iinfo(dtype)
        data = rng.integers(max(info.min, -30000), min(info.max, 60000), size=shape, endpoint=True).astype(dtype)
    z[:] = data
    return z, data


def _expected(data, sample, dtype):
    crop = data[tuple(slice(a, b) for a, b in sample.aabb)]
    if dtype == "f32":
        return torch.from_numpy(crop.astype(np.float32))
    if dtype == "f16":
        return torch.from_numpy(crop.astype(np.float16))
    if dtype == "bf16":
        return torch.from_numpy(crop.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(crop))


def _cfg(**kw):
    base = dict(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                pop_timeout_s=20.0, device="cpu")  # the CPU path, also on a GPU machine
    base.update(kw)
    return stoker.Config(**base)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    path = tmp_path_factory.mktemp("vol") / "v.zarr"
    z, data = _write(path, (40, 70, 90), (8, 16, 32))
    return str(path), data


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sh") / "s.zarr"
    z, data = _write(path, (40, 70, 90), (8, 16, 32), shards=(16, 32, 64), compressors="zstd")
    return str(path), data


def _check_all(p, data, dtype, n_batches=None):
    seen = []
    for batch in (p if n_batches is None else p.batches(n_batches)):
        x = torch.from_dlpack(batch)
        assert x.shape[0] == len(batch.samples)
        for row, s in enumerate(batch.samples):
            assert torch.equal(x[row], _expected(data, s, dtype)), (batch, row, s)
        seen.extend(batch.samples)
    return seen


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "native"])
def test_batches_equal_zarr_and_keep_push_order(volume, dtype):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 20, 24), 24)
    with stoker.Pipeline(_cfg(dtype=dtype)) as p:
        p.push(samples)
        seen = _check_all(p, data, dtype)
    assert seen == samples


def test_sharded_crops_across_shard_boundaries(sharded):
    uri, data = sharded
    # crops straddling shard edges on every axis
    samples = [stoker.Sample(uri, [(10, 20), (20, 50), (50, 90)]) for _ in range(2)]
    samples += _random_samples(uri, data.shape, (10, 30, 40), 14)
    with stoker.Pipeline(_cfg(dtype="native")) as p:
        p.push(samples)
        assert _check_all(p, data, "native") == samples


def test_overlapping_and_duplicate_crops_are_deduplicated(volume):
    uri, data = volume
    s = stoker.Sample(uri, [(0, 8), (0, 16), (0, 32)])  # exactly one chunk
    samples = [s, s, s, stoker.Sample(uri, [(0, 8), (8, 24), (16, 48)])]
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        _check_all(p, data, "f32")
        stats = p.stats()
    assert stats.chunks_needed == 3 + 4
    assert stats.chunks_decoded == 4  # chunk (0,0,0) once, plus the 3 others the last crop touches
    assert stats.chunk_dedup_hits == 3


def test_mixed_source_dtypes_in_one_batch(tmp_path):
    a, da = _write(tmp_path / "a.zarr", (16, 16), (8, 8), dtype="uint16")
    b, db = _write(tmp_path / "b.zarr", (16, 16), (8, 8), dtype="float32", compressors="zstd")
    c, dc = _write(tmp_path / "c.zarr", (16, 16), (8, 8), dtype=">i4", compressors=None)
    samples = [stoker.Sample(str(tmp_path / n), [(1, 9), (3, 11)]) for n in ("a.zarr", "b.zarr", "c.zarr", "a.zarr")]
    with stoker.Pipeline(_cfg(dtype="bf16", lossy_casts=True)) as p:  # int32 into bf16 rounds: asked for
        p.push(samples)
        x = torch.from_dlpack(p.pop())
    for row, data in enumerate((da, db, dc, da)):
        assert torch.equal(x[row], _expected(data, samples[row], "bf16"))
    with stoker.Pipeline(_cfg(dtype="native")) as p:
        p.push(samples)
        with pytest.raises(stoker.DtypeMismatch):
            p.pop()


def test_missing_chunks_and_shards_are_fill_value(tmp_path):
    z = zarr.create_array(str(tmp_path / "f.zarr"), shape=(32, 32), chunks=(4, 4), shards=(8, 8), dtype="float32",
                          fill_value=-7.5)
    z[0:8, 0:4] = 1.0  # one shard, half its inner chunks
    samples = [stoker.Sample(str(tmp_path / "f.zarr"), [(2, 14), (2, 14)])] * 2
    with stoker.Pipeline(_cfg(batch_size=2)) as p:
        p.push(samples)
        x = torch.from_dlpack(p.pop())
    assert torch.equal(x[0], torch.from_numpy(z[2:14, 2:14]))


def test_generator_is_pulled_lazily_and_push_while_pop(volume):
    uri, data = volume
    pulled = itertools.count()

    def gen():
        for s in itertools.cycle(_random_samples(uri, data.shape, (8, 16, 16), 16)):
            next(pulled)
            yield s

    with stoker.Pipeline(_cfg(lookahead_batches=2)) as p:
        p.push(gen())
        _check_all(p, data, "f32", n_batches=5)
        time.sleep(0.2)
        # consumed and released 5 batches; beyond them at most the 3 slots' batches (lookahead 2 and the slot
        # the consumer gave back) and the one planned to wait for a slot were pulled, nothing more
        assert next(pulled) <= (5 + 3 + 1) * 4 + 1


def test_a_pop_waiting_on_used_up_samples_takes_another_threads_push(volume):
    """pop() over used-up pushed samples waits up to pop_timeout_s, by design (the leftover "pop should raise
    at once" was looked at and kept): push is open to any thread while a pop waits, so nothing tells the
    pop that no more samples come; iteration (``for b in p``) is what ends once what was pushed is used up,
    and close() from another thread ends a waiting pop with ShutdownError. Here the pop is served by a push
    made half a second into its wait, long before its 20 s."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 8)
    with stoker.Pipeline(_cfg(batch_size=4, pop_timeout_s=20.0)) as p:
        p.push(samples[:4])
        assert [len(b) for b in p.batches(1)] == [4]
        assert list(p) == []  # the pushed samples are used up: iteration ends, it does not wait
        pusher = threading.Timer(0.5, p.push, (samples[4:],))
        pusher.start()
        t0 = time.monotonic()
        try:
            with p.pop() as b:
                assert list(b.samples) == samples[4:]
                x = torch.from_dlpack(b)
                for row, s in enumerate(b.samples):
                    assert torch.equal(x[row], _expected(data, s, "f32"))
        finally:
            pusher.join(5)
        assert time.monotonic() - t0 < 15


def test_a_released_slot_is_refilled_before_the_next_pop(volume):
    """The coordinator plans the next batch while every slot is full and launches it into the slot the
    consumer gives back, without waiting for the consumer's next pop; the batches still come in push order
    and hold the right crops."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 16, 16), 4 * 6)
    with stoker.Pipeline(_cfg(lookahead_batches=1)) as p:  # two slots
        p.push(samples)
        inflight = p._coordinator.inflight
        first = p.pop()  # holds one slot; batch 1 is in the other
        deadline = time.monotonic() + 10
        while len(inflight) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time enough for a launch that should not happen
        assert len(inflight) == 1  # nothing more: no slot is free
        first.release()
        while len(inflight) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(inflight) == 2  # batch 2 launched into the released slot, no pop in between
        for b in range(1, 6):
            with p.pop() as batch:
                got = torch.from_dlpack(batch)
                for i, s in enumerate(samples[4 * b: 4 * b + 4]):
                    want = data[tuple(slice(a, z) for a, z in s.aabb)].astype(np.float32)
                    assert np.array_equal(got[i].numpy(), want)


def test_a_source_of_bad_samples_is_not_drained_ahead(volume):
    """Batches that fail to plan ride in flight as errors, one per slot and one more: the coordinator stops
    pulling there, as it does for good batches, instead of drawing an endless source dry."""
    uri, data = volume
    pulled = itertools.count()
    past_the_end = stoker.Sample(uri, [(a, a + 8) for a in (data.shape[0], 0, 0)])

    def gen():
        while True:
            next(pulled)
            yield past_the_end

    with stoker.Pipeline(_cfg(lookahead_batches=1)) as p:  # two slots
        p.push(gen())
        time.sleep(0.3)
        assert next(pulled) <= (2 + 1) * 4 + 1
        with pytest.raises(stoker.OutOfBounds):
            p.pop()


def test_infinite_generator_memory_is_bounded(volume):
    """Current (not peak) RSS stays flat over 300 batches of an endless generator.

    ru_maxrss would be useless here: it is the process's lifetime peak, which earlier
    tests may already have set. A leaked 256 KiB batch per pop would add about 75 MB.
    """
    uri, data = volume
    from stoker.bench.runner import rss_bytes

    crop = (8, 32, 64)

    def gen():
        rng = np.random.default_rng(3)
        while True:
            c = [int(rng.integers(0, s - w + 1)) for s, w in zip(data.shape, crop)]
            yield stoker.Sample(uri, [(a, a + w) for a, w in zip(c, crop)])

    with stoker.Pipeline(_cfg(host_buffer_bytes=8 << 20)) as p:
        p.push(gen())
        for _ in range(30):  # warm up: slots, pools and caches reach their steady size
            with p.pop() as b:
                torch.from_dlpack(b).sum()
        gc.collect()
        before = rss_bytes()
        for _ in range(300):
            with p.pop() as b:
                torch.from_dlpack(b).sum()
        gc.collect()
        after = rss_bytes()
        assert p.stats().peak_host_bytes <= 8 << 20
    assert after - before < 24 << 20


def test_drop_last_and_short_final_batch(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (4, 4, 4), 10)
    with stoker.Pipeline(_cfg(batch_size=4)) as p:
        p.push(samples)
        assert [len(b) for b in p] == [4, 4]
        assert p.pending == 2
    with stoker.Pipeline(_cfg(batch_size=4, drop_last=False)) as p:
        p.push(samples)
        sizes = []
        for b in p:
            x = torch.from_dlpack(b)
            sizes.append(x.shape[0])
            for row, s in enumerate(b.samples):
                assert torch.equal(x[row], _expected(data, s, "f32"))
        assert sizes == [4, 4, 2]
        assert p.pending == 0


def test_held_view_is_never_overwritten_and_pool_starves(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 40)
    with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=1.0)) as p:
        p.push(samples)
        b0 = p.pop()
        x0 = torch.from_dlpack(b0)
        snapshot = x0.clone()
        b0.release()  # released, but x0 still views the slot
        held = [x0]
        for _ in range(1):
            with p.pop() as b:
                held.append(torch.from_dlpack(b))
        with pytest.raises(stoker.PoolStarved, match="holds all 2 batch slots"):
            p.pop()
        assert torch.equal(x0, snapshot)
        # not sticky: it is the consumer's doing, and freeing the views lets the pipeline go on
        del held, x0
        gc.collect()
        with p.pop() as b:
            assert len(b) == 2


def test_slots_of_batches_still_in_flight_are_not_blamed_on_the_consumer(volume, monkeypatch):
    """Every slot busy with a batch still being made (a transform stuck on the engine's thread, as a hung
    mount's read) and none popped: PoolStarved says the batches are in flight, not "the consumer holds all 2
    batch slots. Release batches" (what it said), and no garbage collection runs for a consumer that holds
    nothing; once the work goes on, so does the pipeline."""
    from stoker.engine.pipeline import facade as pipelines

    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 16)
    collections = []
    monkeypatch.setattr(pipelines.gc, "collect", lambda *a: collections.append(1))
    gate = threading.Event()

    def stuck(x):
        gate.wait(30)
        return x

    with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=1.0, transform=stuck)) as p:
        try:
            p.push(samples)
            deadline = time.monotonic() + 20
            while not (p._executor.dtype is not None and p._executor.held() == p._executor.n_slots == 2):
                assert time.monotonic() < deadline, "the coordinator never filled both slots"
                time.sleep(0.01)
            with pytest.raises(stoker.PoolStarved) as info:
                p.pop()
        finally:
            gate.set()
        assert "holds all" not in str(info.value), str(info.value)
        assert "2 batches in flight" in str(info.value), str(info.value)
        assert collections == []
        for k in range(2):
            with p.pop() as b:
                assert torch.equal(torch.from_dlpack(b)[0], _expected(data, samples[2 * k], "f32"))


def test_slots_held_by_garbage_alone_are_collected_for_a_waiting_consumer(volume, monkeypatch):
    # views kept only by reference cycles (an exception kept with its traceback, say) are freed only by
    # Python's collector, which a process that waits does not run: a consumer kept waiting runs it
    from stoker.engine.pipeline import facade as pipelines

    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 24)
    collections = []
    collect = gc.collect
    monkeypatch.setattr(pipelines.gc, "collect", lambda *a: collections.append(collect(*a)))

    class Holder:
        pass

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=10.0)) as p:
            p.push(samples)
            for k in range(12):
                with p.pop() as b:
                    held = Holder()
                    held.me, held.x = held, torch.from_dlpack(b)  # a cycle holding the batch
                    assert torch.equal(held.x[0], _expected(data, samples[2 * k], "f32"))
                    del held
    finally:
        if was_enabled:
            gc.enable()
    assert collections  # (each wait for both slots ran one)


def test_no_collection_runs_while_batches_flow(volume, monkeypatch):
    from stoker.engine.pipeline import facade as pipelines

    uri, data = volume
    collections = []
    monkeypatch.setattr(pipelines.gc, "collect", lambda *a: collections.append(1))
    with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=10.0)) as p:
        p.push(_random_samples(uri, data.shape, (8, 8, 8), 24))
        for _ in range(12):
            with p.pop() as b:
                torch.from_dlpack(b).sum()
    assert not collections


def test_release_then_drop_view_frees_slot(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 40)
    with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=5.0)) as p:
        p.push(samples)
        for _ in range(15):  # with 2 slots this only works if released slots are reused
            with p.pop() as b:
                x = torch.from_dlpack(b)
                assert x.shape == (2, 8, 8, 8)
            del x


@pytest.mark.parametrize("bad_config", [
    dict(batch_size=0), dict(batch_size=2.5), dict(dtype="int8"), dict(host_buffer_bytes=10),
    dict(n_io_threads=0), dict(n_compute_threads=0), dict(lookahead_batches=0), dict(pop_timeout_s=0),
    dict(pop_timeout_s=-1), dict(device="tpu"), dict(device=torch.device("meta")), dict(sample_shape=(0, 4)),
    dict(drop_last="yes"),
])
def test_bad_config_values(bad_config):
    with pytest.raises(stoker.InvalidArgument) as info:
        stoker.Config(**bad_config)
    knob = next(iter(bad_config))
    assert f"Config.{knob}" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("given, stored", [(torch.device("cpu"), "cpu"), (torch.device("cuda"), "cuda"),
                                           (torch.device("cuda", 1), "cuda:1")])
def test_config_takes_a_torch_device(given, stored):
    assert stoker.Config(batch_size=2, device=given).device == stored  # a rank's ctx.device passes as is


def test_default_compute_threads_share_the_usable_cpus_among_the_node_ranks(monkeypatch):
    from stoker.config import default_compute_threads

    def machine(cores, usable):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)), raising=False)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    machine(64, 64)
    assert default_compute_threads() == 64 and stoker.Config(batch_size=2).compute_threads == 64  # one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun, 8 ranks on this node
    assert stoker.Config(batch_size=2).compute_threads == 8
    machine(64, 32)  # a cpuset of 32 cores shared by the 8 ranks
    assert default_compute_threads() == 4
    machine(64, 8)  # each rank bound to its own 8 cores (srun --cpu-bind): not divided again
    assert default_compute_threads() == 8
    machine(8, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # more ranks than CPUs: still one thread
    assert default_compute_threads() == 1
    for malformed in ("four", "\u00b2", "0"):  # not a count of ranks: read as one rank
        monkeypatch.setenv("LOCAL_WORLD_SIZE", malformed)
        assert default_compute_threads() == 8
    assert stoker.Config(batch_size=2, n_compute_threads=5).compute_threads == 5  # asked for: as given


def test_many_threads_do_not_cut_a_batch_into_single_chunk_tasks(volume, monkeypatch):
    # 16 threads used to cut a batch's ~58 chunk reads into 32 groups: 2 threads running the same groups
    # lost 18% (scenario 1) and 20% (scenario 6) of samples/s to the per-group overhead. (The Python path's
    # grouping: the compiled engine takes a whole batch in one call.)
    from stoker.engine.cpu import native
    from stoker.engine.cpu import decode_python

    monkeypatch.setattr(native, "Engine", None)
    uri, data = volume
    groups, seen_reads = [], []
    original = decode_python.PythonDecoder._read_group

    def counting(self, job, reads):
        groups.append(len(reads))
        return original(self, job, reads)

    monkeypatch.setattr(decode_python.PythonDecoder, "_read_group", counting)
    orig_submit = decode_python.PythonDecoder.submit_reads
    monkeypatch.setattr(decode_python.PythonDecoder, "submit_reads",
                        lambda self, job, reads: seen_reads.append(len(reads)) or orig_submit(self, job, reads))
    samples = _random_samples(uri, data.shape, (16, 48, 64), 8)
    with stoker.Pipeline(_cfg(batch_size=8, n_compute_threads=16, lookahead_batches=1)) as p:
        p.push(samples)
        with p.pop() as b:
            assert torch.equal(torch.from_dlpack(b), torch.stack([_expected(data, s, "f32") for s in samples]))
    (n_reads,) = seen_reads
    assert n_reads >= 64  # enough reads that 16 threads would have made 32 groups
    assert len(groups) == max(8, n_reads // decode_python.MIN_READS_PER_GROUP) < 32
    assert sum(groups) == n_reads and min(groups) >= 2


def test_budget_exceeded_at_construction_names_the_knob():
    cfg = stoker.Config(batch_size=64, sample_shape=(64, 256, 256), dtype="f32", host_buffer_bytes=64 << 20,
                        device="cpu")
    with pytest.raises(stoker.BudgetExceeded, match="host_buffer_bytes") as info:
        stoker.Pipeline(cfg)
    assert info.value.needed > 64 << 20


def test_sample_checks_at_push(volume):
    uri, _ = volume
    with stoker.Pipeline(_cfg(sample_shape=(4, 4, 4))) as p:
        with pytest.raises(stoker.RankMismatch):
            p.push([stoker.Sample(uri, [(0, 4), (0, 4)])])
        with pytest.raises(stoker.InvalidArgument, match="shape"):
            p.push([stoker.Sample(uri, [(0, 4), (0, 4), (0, 5)])])
        with pytest.raises(stoker.InvalidArgument):
            p.push([("not", "a sample")])


def test_sample_normalisation():
    a = stoker.Sample("x.zarr", np.s_[0:4, 2:6])
    b = stoker.Sample("x.zarr", [(0, 4), (2, 6)])
    assert a == b and hash(a) == hash(b) and a.aabb == ((0, 4), (2, 6))
    for bad in ([3, (0, 4)], np.s_[0:4:2, 0:4], np.s_[:, 0:4], [(4, 2)]):
        with pytest.raises(stoker.InvalidArgument):
            stoker.Sample("x.zarr", bad)


@pytest.mark.parametrize("case", ["missing", "oob", "rank", "corrupt"])
def test_store_errors_surface_at_pop_and_are_sticky(volume, tmp_path, case):
    uri, data = volume
    good = _random_samples(uri, data.shape, (4, 4, 4), 4)
    if case == "missing":
        bad = stoker.Sample(str(tmp_path / "nope.zarr"), [(0, 4), (0, 4), (0, 4)])
        err = stoker.NotFound
    elif case == "oob":
        bad = stoker.Sample(uri, [(38, 42), (0, 4), (0, 4)])
        err = stoker.OutOfBounds
    elif case == "rank":
        z, _ = _write(tmp_path / "r.zarr", (8, 8, 8, 8), (4, 4, 4, 4))
        bad = stoker.Sample(str(tmp_path / "r.zarr"), [(0, 4), (0, 4), (0, 4)])
        err = stoker.RankMismatch
    else:
        z, _ = _write(tmp_path / "c.zarr", (8, 8, 8), (4, 4, 4))
        chunk = tmp_path / "c.zarr" / "c" / "0" / "0" / "0"
        chunk.write_bytes(chunk.read_bytes()[:-9])  # truncated: every codec must notice
        bad = stoker.Sample(str(tmp_path / "c.zarr"), [(0, 4), (0, 4), (0, 4)])
        err = stoker.DecodeError
    with stoker.Pipeline(_cfg()) as p:
        p.push(good + [bad] + good[:3])
        with p.pop():
            pass  # the first batch is fine
        with pytest.raises(err) as first:
            p.pop()
        with pytest.raises(err) as again:
            p.pop()
        assert again.value is first.value
        with pytest.raises(err):
            p.push(good)
        # each raise starts from the traceback the error came with: popping on does not grow it, and no frame of
        # it keeps the failed batch's entry
        with pytest.raises(err):
            p.pop()
        depth = _tb_depth(first.value)
        for _ in range(20):
            with pytest.raises(err):
                p.pop()
        assert _tb_depth(first.value) == depth
        tb = first.value.__traceback__
        while tb is not None:
            assert "head" not in tb.tb_frame.f_locals, tb.tb_frame.f_code.co_name
            tb = tb.tb_next


def _tb_depth(exc: BaseException) -> int:
    depth, tb = 0, exc.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


def test_close_is_prompt_with_infinite_generator_and_held_batches(volume):
    uri, data = volume

    def gen():
        while True:
            yield from _random_samples(uri, data.shape, (8, 16, 16), 8)

    p = stoker.Pipeline(_cfg())
    p.push(gen())
    held = [p.pop(), p.pop()]
    x = torch.from_dlpack(held[0])
    coordinator = p._thread
    assert coordinator is not None and coordinator.is_alive()
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 1.0
    assert x.shape[0] == 4  # memory a user holds stays valid
    with pytest.raises(stoker.ShutdownError):
        p.pop()
    with pytest.raises(stoker.ShutdownError):
        p.push(_random_samples(uri, data.shape, (8, 16, 16), 1))
    # this pipeline's own coordinator, not any thread of that name: another test's pipeline left open in this
    # process (under xdist) has one too
    coordinator.join(0.2)
    assert not coordinator.is_alive()


def test_close_stops_a_slow_source_between_two_samples(volume):
    """The coordinator looks for a close between two samples of a batch: behind a slow source its thread
    ends a sample after close(), not a batch after."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 16, 16), 64)

    def slow():
        for s in samples:
            time.sleep(0.25)
            yield s

    p = stoker.Pipeline(_cfg(batch_size=16))
    p.push(slow())
    time.sleep(0.6)  # two of the first batch's 16 samples drawn, the third on its way
    thread = p._coordinator.thread
    p.close()
    thread.join(1.5)  # the sample being drawn (0.25 s) and slack; the rest of the batch would take 3.2 s more
    assert not thread.is_alive()


def test_a_list_pushed_while_a_generator_is_drawn_is_checked_against_its_samples(volume):
    """The shape of a generator's first sample is the pipeline's as soon as it is pulled, not once its batch
    is complete: a list of another shape pushed meanwhile is refused at push, as any other would be."""
    uri, data = volume
    first = _random_samples(uri, data.shape, (8, 16, 16), 8)
    other = _random_samples(uri, data.shape, (8, 16, 32), 4)

    def slow():
        for s in first:
            time.sleep(0.2)
            yield s

    with stoker.Pipeline(_cfg(batch_size=4)) as p:
        p.push(slow())
        deadline = time.monotonic() + 10
        while not p._intake.staged and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(stoker.InvalidArgument, match=r"has shape \(8, 16, 32\)"):
            p.push(other)
        for _ in range(2):
            with p.pop() as batch:
                assert tuple(torch.from_dlpack(batch).shape) == (4, 8, 16, 16)


def test_exception_in_with_block_closes(volume):
    uri, data = volume
    with pytest.raises(RuntimeError, match="boom"):
        with stoker.Pipeline(_cfg()) as p:
            p.push(_random_samples(uri, data.shape, (4, 4, 4), 100))
            p.pop()
            raise RuntimeError("boom")
    with pytest.raises(stoker.ShutdownError):
        p.pop()


def _failing_source(samples):
    """Yields ``samples``, then fails as a broken user generator would."""
    yield from samples
    raise KeyError("source broke")


def test_generator_error_reaches_consumer_in_order(volume):
    uri, data = volume
    good = _random_samples(uri, data.shape, (4, 4, 4), 4)
    gen = functools.partial(_failing_source, good)

    with stoker.Pipeline(_cfg()) as p:
        p.push(gen())
        with p.pop():
            pass
        with pytest.raises(stoker.InvalidArgument, match="source broke"):
            p.pop()


def test_complex_source_cannot_be_cast(tmp_path):
    z = zarr.create_array(str(tmp_path / "c.zarr"), shape=(8, 8), chunks=(4, 4), dtype="complex64")
    z[:] = 1 + 2j
    with stoker.Pipeline(_cfg(batch_size=1)) as p:
        p.push([stoker.Sample(str(tmp_path / "c.zarr"), [(0, 4), (0, 4)])])
        with pytest.raises(stoker.DtypeMismatch, match="complex"):
            p.pop()
    with stoker.Pipeline(_cfg(batch_size=1, dtype="native")) as p:
        p.push([stoker.Sample(str(tmp_path / "c.zarr"), [(0, 4), (0, 4)])])
        x = torch.from_dlpack(p.pop())
        assert x.dtype == torch.complex64 and bool((x == (1 + 2j)).all())


@pytest.mark.parametrize("fixture", ["volume", "sharded"])
@pytest.mark.parametrize("path", ["engine", "python"])
def test_budget_is_fully_returned_after_drain(fixture, path, request, monkeypatch):
    """The Python path gives back every reservation; the engine's threads keep their scratch (within its
    budget) for the next batch. Either way the batch slots and both stay within host_buffer_bytes."""
    from stoker.engine.cpu import native

    if path == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif native.Engine is None:
        pytest.skip("stoker._native is not available")
    uri, data = request.getfixturevalue(fixture)
    with stoker.Pipeline(_cfg(host_buffer_bytes=8 << 20)) as p:
        p.push(_random_samples(uri, data.shape, (8, 16, 32), 24))
        _check_all(p, data, "f32")
        budget = p._budget
        deadline = time.monotonic() + 5
        while budget.reserved and time.monotonic() < deadline:
            time.sleep(0.01)  # the last tasks return their reservations just after the batch is done
        assert budget.reserved == 0
        engine = p._executor.decoders.native
        assert (engine is not None) == (path == "engine")
        info = engine.engine.info() if engine is not None else {"budget": 0, "used": 0, "peak": 0}
        assert 0 < budget.peak + info["peak"] and budget.peak <= budget.capacity and info["used"] <= info["budget"]
        assert p._host_slots.nbytes + budget.capacity + info["budget"] <= 8 << 20
        assert p.stats().peak_host_bytes == p._host_slots.nbytes + budget.peak + info["peak"]


def test_stats_amplification_and_table(volume):
    uri, data = volume
    with stoker.Pipeline(_cfg()) as p:
        p.push(_random_samples(uri, data.shape, (8, 16, 32), 8))
        list(p)
        s = p.stats()
    assert s.batches_emitted == 2 and s.samples == 8
    assert s.bytes_needed == 8 * 8 * 16 * 32 * 2
    assert s.bytes_delivered == 8 * 8 * 16 * 32 * 4
    assert s.decode_amplification >= 1.0 and s.read_amplification > 0
    assert s.chunks_decoded + s.chunk_dedup_hits == s.chunks_needed
    text = str(s)
    for word in ("decode", "io", "assemble", "read_amplification"):
        assert word in text
    p2_stats = s.stages["decode"]
    assert p2_stats.count == s.chunks_decoded


def test_out_of_order_blosc_blocks_read_correctly_end_to_end(tmp_path):
    """Chunk files whose blosc blocks are stored out of order (as multi-threaded c-blosc writes them)."""
    import numcodecs
    from test_engine_units import _out_of_order_frame

    z = zarr.create_array(str(tmp_path / "o.zarr"), shape=(64, 256, 128), chunks=(32, 128, 128), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", blocksize=65536))
    rng = np.random.default_rng(11)
    data = (np.cumsum(rng.integers(-3, 4, size=z.shape), axis=2) + 1000).astype(np.uint16)
    z[:] = data
    for f in (tmp_path / "o.zarr" / "c").rglob("*"):
        if f.is_file():
            chunk = np.frombuffer(numcodecs.Blosc().decode(f.read_bytes()), np.uint16).reshape(32, 128, 128)
            f.write_bytes(_out_of_order_frame(chunk))
    uri = str(tmp_path / "o.zarr")
    samples = _random_samples(uri, data.shape, (16, 40, 50), 48, seed=5)
    with stoker.Pipeline(_cfg(dtype="native")) as p:
        p.push(samples)
        assert _check_all(p, data, "native") == samples


def test_close_from_another_thread_never_hands_out_a_partial_batch(volume):
    uri, data = volume

    def slow():
        for s in itertools.cycle(_random_samples(uri, data.shape, (8, 16, 16), 8)):
            time.sleep(0.05)
            yield s

    p = stoker.Pipeline(_cfg(host_buffer_bytes=2 << 20))
    p.push(slow())
    outcome = []

    def consumer():
        try:
            while True:
                with p.pop() as b:
                    x = torch.from_dlpack(b)
                    for row, s in enumerate(b.samples):  # every batch handed out must be complete
                        assert torch.equal(x[row], _expected(data, s, "f32"))
        except stoker.ShutdownError:
            outcome.append("shutdown")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.5)
    p.close()
    t.join(5)
    assert outcome == ["shutdown"]


def test_source_error_with_drop_last_emits_no_short_batch(volume):
    uri, data = volume
    good = _random_samples(uri, data.shape, (4, 4, 4), 6)
    gen = functools.partial(_failing_source, good)

    with stoker.Pipeline(_cfg(batch_size=4)) as p:
        p.push(gen())
        with p.pop() as b:
            assert len(b) == 4
        with pytest.raises(stoker.InvalidArgument, match="source broke"):
            p.pop()  # the 2 samples before the error do not make a short batch
    with stoker.Pipeline(_cfg(batch_size=4, drop_last=False)) as p:
        p.push(gen())
        assert len(p.pop()) == 4
        assert len(p.pop()) == 2
        with pytest.raises(stoker.InvalidArgument):
            p.pop()


def test_unclosed_pipeline_is_collected_and_its_thread_ends(volume):
    uri, data = volume
    import weakref

    p = stoker.Pipeline(_cfg())
    p.push(itertools.cycle(_random_samples(uri, data.shape, (4, 4, 4), 8)))
    with p.pop():
        pass
    ref = weakref.ref(p)
    thread = p._thread
    del p
    deadline = time.monotonic() + 5
    while (ref() is not None or thread.is_alive()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None and not thread.is_alive()


def test_concurrent_pops_deliver_each_batch_once(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (4, 8, 8), 4 * 30)
    got = []
    lock = threading.Lock()
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)

        def consumer():
            for _ in range(10):
                with p.pop() as b:
                    with lock:
                        got.append(b.info.batch_id)

        threads = [threading.Thread(target=consumer) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert sorted(got) == list(range(30))


def test_a_chunk_larger_than_the_budget_is_a_typed_error(tmp_path):
    small, _ = _write(tmp_path / "small.zarr", (16, 16), (4, 4))
    big, _ = _write(tmp_path / "big.zarr", (2048, 2048), (2048, 2048), compressors=None)  # 8 MiB chunk
    samples = [stoker.Sample(str(tmp_path / "small.zarr"), [(0, 4), (0, 4)]),
               stoker.Sample(str(tmp_path / "big.zarr"), [(0, 4), (0, 4)])]
    with stoker.Pipeline(_cfg(batch_size=1, host_buffer_bytes=4 << 20)) as p:
        p.push(samples)
        with p.pop():
            pass
        with pytest.raises(stoker.BudgetExceeded, match="host_buffer_bytes"):
            p.pop()


def test_stats_after_reset_describe_exactly_the_popped_batches(volume):
    """Work done ahead of a stats_reset() belongs to the batches popped after it, not to nobody."""
    uri, data = volume
    aligned = [stoker.Sample(uri, [(z, z + 8), (y, y + 16), (x, x + 32)])
               for z in (0, 8, 16, 24) for y in (0, 16, 32, 48) for x in (0, 32)]  # whole chunks
    with stoker.Pipeline(_cfg(lookahead_batches=3)) as p:
        p.push(aligned)
        with p.pop():
            pass
        time.sleep(0.3)  # let the lookahead batches finish before the reset
        p.stats_reset()
        for _ in range(5):
            with p.pop():
                pass
        s = p.stats()
    assert s.batches_emitted == 5
    assert s.chunks_decoded == s.chunks_needed == 5 * 4
    assert s.decode_amplification == pytest.approx(1.0)


def test_iteration_is_bounded_by_pop_timeout_when_views_are_kept(volume):
    """``for batch in p`` waits at most pop_timeout_s for each batch, as pop() does: a consumer that keeps
    a small view of every batch holds every slot, and the loop must say so instead of hanging."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 40)
    kept = []
    with stoker.Pipeline(_cfg(batch_size=2, lookahead_batches=1, pop_timeout_s=1.0)) as p:
        p.push(samples)
        with pytest.raises(stoker.PoolStarved, match="holds all 2 batch slots"):
            for batch in p:
                kept.append(torch.from_dlpack(batch)[0, 0])  # a slice for logging keeps the slot's storage
        assert len(kept) == 2
        del kept
        gc.collect()
        with p.pop() as b:  # not sticky: freeing the views lets the pipeline go on
            assert len(b) == 2


def test_oversized_crop_is_refused_before_it_is_planned(tmp_path, monkeypatch):
    """The budget check runs on the arrays' metadata before planning: a crop far beyond host_buffer_bytes
    (here 2 million chunks) is refused at once, without building its plan."""
    uri = str(tmp_path / "huge.zarr")
    zarr.create_array(uri, shape=(1024, 1024, 1024), chunks=(8, 8, 8), dtype="uint8")  # metadata only
    planned = []
    real = stoker.engine.cpu.executor.plan_tables  # the planner of both decode paths
    monkeypatch.setattr(stoker.engine.cpu.executor, "plan_tables", lambda *a, **k: planned.append(1) or real(*a, **k))
    for dtype in ("f32", "native"):
        with stoker.Pipeline(_cfg(batch_size=1, dtype=dtype, host_buffer_bytes=64 << 20)) as p:
            p.push([stoker.Sample(uri, [(0, 1024)] * 3)])
            with pytest.raises(stoker.BudgetExceeded, match="host_buffer_bytes"):
                p.pop()
    assert planned == []


def test_reading_a_box_too_large_to_allocate_is_a_typed_error(tmp_path):
    uri = str(tmp_path / "vast.zarr")
    zarr.create_array(uri, shape=(2**40, 2**40), chunks=(1024, 1024), dtype="uint8")  # metadata only
    with pytest.raises(stoker.InvalidArgument, match="smaller boxes"):
        stoker.open_array(uri).read([(0, 2**40), (0, 2**40)])


def test_a_slow_source_is_named_as_the_cause_of_a_timeout(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 3)

    gate = threading.Event()

    def slow():
        yield from samples[:1]
        gate.wait(3)
        yield from samples[1:]

    p = stoker.Pipeline(_cfg(batch_size=2, pop_timeout_s=0.5))
    try:
        with p:
            p.push(slow())
            with pytest.raises(stoker.PoolStarved, match="1 of 2 pulled so far"):
                p.pop()
    finally:
        # the coordinator, parked in the source, ends now (not seconds into the tests after this one)
        gate.set()
        if p._thread is not None:
            p._thread.join(10)


def test_a_timeout_says_whether_samples_were_missing_or_the_batches_slow(volume):
    """The pipeline asks its intake why no batch came (Intake.starved_reason) and its coordinator how many
    are in flight: each cause has its words."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 8, 8), 3)
    with stoker.Pipeline(_cfg(batch_size=2, pop_timeout_s=0.3)) as p:
        with pytest.raises(stoker.PoolStarved, match=r"no samples are pending; push more\.$"):
            p.pop()
    with stoker.Pipeline(_cfg(batch_size=4, pop_timeout_s=0.3, drop_last=True)) as p:
        p.push(samples)
        with pytest.raises(stoker.PoolStarved, match="3 samples wait for a full batch of 4"):
            p.pop()
        assert list(p) == []  # nothing more can come: iteration ends instead of waiting
    with stoker.Pipeline(_cfg(batch_size=4, pop_timeout_s=5, drop_last=False)) as p:
        p.push(samples)
        assert [len(b) for b in p] == [3]  # the staged samples are asked for as a short batch
