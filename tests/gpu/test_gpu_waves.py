"""Waves of the GPU-decode executor: the chunks of several lookahead batches staged and decoded in one call,
run end to end on CPU tensors (GpuDecodeExecutor.on_host, its stream decoder gpu.reference.HostDecoder).
Waves span batches queued already, stay within the staging and scratch that device_buffer_bytes and
host_buffer_bytes hold, and deliver the CPU path's batches bit for bit, in order; a damaged chunk fails only
the batch holding it; a device failure on healthy chunks fails the wave's batches with DeviceError."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.gpu import frames
from stoker.engine.gpu import staging as gpu_staging
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.gpu.reference import HostDecoder
from stoker.engine.pipeline import facade as pipelines
from stoker.errors import DecodeError, DeviceError
from batch_oracle import random_crops

pytestmark = pytest.mark.timeout(120)

SHAPE, CHUNKS = (32, 64, 64), (8, 16, 16)  # 64 chunks of 2,048 uint16 (4 KiB decoded)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("waves")
    z = zarr.create_array(str(root / "a.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="uint16", fill_value=0,
                          compressors=ZstdCodec(level=3))
    rng = np.random.default_rng(0)
    data = ((np.add.outer(np.arange(SHAPE[0]), np.arange(SHAPE[1]))[..., None] + np.arange(SHAPE[2])) % 3000
            + rng.integers(0, 50, size=SHAPE)).astype("uint16")
    z[:] = data
    return str(root / "a.zarr"), data


@pytest.fixture
def held_reads(monkeypatch, request):
    """Pipelines built in the test decode with the GPU-decode executor on CPU tensors (``made``), its decoder
    made by ``decoder[0]``; the reader's first read waits (10 s at most) until ``wait_for`` batches are
    submitted, so it finds them queued and waves form across them; the tests of failures get the jobs
    submitted (``jobs``)."""
    made, decoder, wait_for = [], [HostDecoder], [4]
    jobs = [] if "fails" in request.node.name else None
    submitted = threading.Condition()
    counts = {"submitted": 0, "reads": 0}

    class Counting(GpuDecodeExecutor):
        def submit(self, plan, target):
            job = super().submit(plan, target)
            if jobs is not None:  # (a job holds its slot: only where every batch has one of its own)
                jobs.append(job)
            with submitted:
                counts["submitted"] += 1
                submitted.notify_all()
            return job

    def factory(cfg, device, stats, store):
        made.append(Counting(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: decoder[0]()))
        return made[-1]

    read = gpu_staging.Stager.read

    def held(self, *args, **kw):
        counts["reads"] += 1
        if counts["reads"] == 1:
            with submitted:
                submitted.wait_for(lambda: counts["submitted"] >= wait_for[0], timeout=10.0)
        return read(self, *args, **kw)

    monkeypatch.setattr(pipelines, "make_executor", factory)
    monkeypatch.setattr(gpu_staging.Stager, "read", held)
    return made, decoder, wait_for, jobs


def _cfg(**kw):
    base = dict(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, n_io_threads=1, lookahead_batches=4,
                host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20, pop_timeout_s=30.0)
    return stoker.Config(**{**base, **kw})


def _chunk_box(i):
    """The box of the i-th chunk in C order."""
    grid = [s // c for s, c in zip(SHAPE, CHUNKS)]
    at = np.unravel_index(i, grid)
    return [(int(a) * c, (int(a) + 1) * c) for a, c in zip(at, CHUNKS)]


def _crops(uri, n, crop=(12, 24, 24), seed=5):
    return random_crops(uri, SHAPE, crop, n, seed)


def _batches(cfg, samples):
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        return [torch.from_dlpack(b).clone() for b in p]


def _cpu_batches(cfg, samples, monkeypatch):
    with monkeypatch.context() as mp:  # the CPU executor (Config(device="cpu") picks it)
        from stoker.engine import choose

        mp.setattr(pipelines, "make_executor", choose.make_executor)
        return _batches(cfg, samples)


def test_waves_hold_several_batches_and_deliver_the_cpu_path_s_batches(volume, held_reads, monkeypatch):
    uri, data = volume
    made, _, _, jobs = held_reads
    samples = _crops(uri, 16)
    got = _batches(_cfg(), samples)
    ex = made[0]
    assert max(n for n, _, _ in ex.waves) >= 4, list(ex.waves)  # the batches queued share the reader's waves
    assert sum(n for n, _, _ in ex.waves) >= len(got) == 8  # (a batch spans waves too: counted in each)
    want = _cpu_batches(_cfg(), samples, monkeypatch)
    assert len(got) == len(want) == 8 and all(torch.equal(g, w) for g, w in zip(got, want))
    for b, batch in enumerate(got):
        for row, s in enumerate(samples[2 * b:2 * b + 2]):
            assert torch.equal(batch[row], torch.from_numpy(data[tuple(slice(*a) for a in s.aabb)].astype(np.float32)))


def test_waves_stay_within_the_budgets(volume, held_reads, monkeypatch):
    """device_buffer_bytes of 1 MiB holds the slots and waves of a few dozen chunks: waves are cut there,
    still across batches, and every one fits the staging and scratch prepare sized."""
    uri, _ = volume
    made, _, wait_for, _ = held_reads
    wait_for[0] = 5
    cfg = _cfg(batch_size=4, device_buffer_bytes=1 << 20)
    samples = _crops(uri, 40, crop=(8, 16, 16))  # 1 to 8 chunks a crop
    got = _batches(cfg, samples)
    ex = made[0]
    enc_cap, dec_cap = ex.wave_bytes
    assert 0 < dec_cap < 64 * 8192  # cut by the budget: fewer chunks than the batches held back read
    assert all(staged <= enc_cap and decoded <= dec_cap for _, staged, decoded in ex.waves), list(ex.waves)
    assert max(n for n, _, _ in ex.waves) >= 2 and len(ex.waves) > 3
    assert ex.device_nbytes() <= cfg.device_buffer_bytes
    want = _cpu_batches(cfg, samples, monkeypatch)
    assert len(got) == len(want) == 10 and all(torch.equal(g, w) for g, w in zip(got, want))


def _truncate(path, key):
    """Chunk ``key`` cut in half: its zstd header parses (the device takes it), its stream fails to decode."""
    f = os.path.join(path, *key.split("/"))
    raw = open(f, "rb").read()
    open(f, "wb").write(raw[:len(raw) // 2])


def _outcomes(cfg, samples, jobs):
    """Each batch's error, or its values: the batches are one slot each, all in flight at once (no pop: a
    pipeline's error is sticky, so later pops would raise the first batch's)."""
    n = len(samples) // cfg.batch_size
    assert n == cfg.lookahead_batches + 1
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        deadline = time.monotonic() + 30
        while len(jobs) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(jobs) == n and all(job.wait(30.0) for job in jobs)
        return [job.error if job.error is not None else job.out.clone() for job in jobs]


def test_a_damaged_chunk_fails_only_the_batch_holding_it(tmp_path, volume, held_reads):
    """One chunk per batch, five batches in one wave: the damaged stream (found by the wave's deferred check)
    fails its batch with the CPU path's DecodeError naming the chunk; the wave's other batches are delivered."""
    src, data = volume
    made, _, _, jobs = held_reads
    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="uint16", fill_value=0,
                      compressors=ZstdCodec(level=3))[:] = data
    _truncate(uri, "c/0/0/1")  # the second chunk in C order: batch 1's
    samples = [stoker.Sample(uri, _chunk_box(i)) for i in range(5)]
    got = _outcomes(_cfg(batch_size=1), samples, jobs)
    assert max(n for n, _, _ in made[0].waves) >= 4
    assert isinstance(got[1], DecodeError) and got[1].key == "c/0/0/1" and uri in str(got[1])
    for i, x in enumerate(got):
        if i != 1:
            assert isinstance(x, torch.Tensor), x
            want = data[tuple(slice(*a) for a in samples[i].aabb)].astype(np.float32)
            assert torch.equal(x[0], torch.from_numpy(want))


def test_a_device_failure_on_healthy_chunks_fails_the_wave_s_batches_with_device_error(volume, held_reads):
    """The device reports a wave damaged but the CPU decodes every chunk of it: each of its batches fails
    with DeviceError naming its own chunk (not DecodeError); the batches of later waves are delivered."""
    uri, data = volume
    made, decoder, _, jobs = held_reads
    failed = []

    class FailsFirstWave(HostDecoder):
        def decode_staged(self, staged, layout, *args, deferred=None, **kw):
            out = super().decode_staged(staged, layout, *args, deferred=deferred, **kw)
            if not failed:
                failed.append(len(layout.chunk_in))
                deferred.append(lambda: (_ for _ in ()).throw(frames.FrameError("nvCOMP status 7")))
            return out

    decoder[0] = FailsFirstWave
    samples = [stoker.Sample(uri, _chunk_box(i)) for i in range(5)]
    got = _outcomes(_cfg(batch_size=1), samples, jobs)
    first = made[0].waves[0][0]
    assert first >= 4 and failed == [first]  # one chunk per batch
    for i, x in enumerate(got):
        if i < first:
            assert isinstance(x, DeviceError) and not isinstance(x, DecodeError)
            assert x.keys == [f"c/{'/'.join(str(int(a[0]) // c) for a, c in zip(samples[i].aabb, CHUNKS))}"]
        else:
            want = data[tuple(slice(*a) for a in samples[i].aabb)].astype(np.float32)
            assert isinstance(x, torch.Tensor) and torch.equal(x[0], torch.from_numpy(want))


def test_close_with_an_open_wave_returns_promptly_and_gives_the_staging_back(volume, held_reads):
    uri, _ = volume
    made, _, _, jobs = held_reads
    p = stoker.Pipeline(_cfg())
    try:
        p.push(_crops(uri, 40))
        with p.pop():
            pass
        t0 = time.monotonic()
        p.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        p.close()
    ex = made[0]
    for thread in (ex._reader, ex._thread):
        thread.join(10.0)
        assert not thread.is_alive()
    assert all(not s.busy for s in ex.host_slots.slots)


def test_a_batch_is_finished_once_the_next_wave_is_queued_not_before(volume, held_reads, monkeypatch):
    """No wait for the device in steady state: a batch whose last chunks are in wave k is finished (its
    deferred check read) only once wave k + 1 is decoded (queued, on a GPU), so the device always has the
    next wave while the host waits for one; only with nothing to queue is a wave waited for at once. Each
    "device" decode here takes 50 ms, so the reader is always a wave ahead; waves hold two chunks (one where
    no second batch is queued: the consumer holds the slots)."""
    from stoker.engine.gpu import executor as gpu_decodes

    uri, data = volume
    made, decoder, wait_for, _ = held_reads
    monkeypatch.setattr(gpu_decodes, "GROUP_BYTES", 2 * 4096)
    calls, checked = [], []

    class Slow(HostDecoder):
        def decode_staged(self, staged, layout, *args, deferred=None, **kw):
            n = len(calls)
            calls.append(n)
            out = super().decode_staged(staged, layout, *args, deferred=deferred, **kw)
            time.sleep(0.05)
            deferred.append(lambda: checked.append((n, len(calls))))
            return out

    decoder[0] = Slow
    samples = [stoker.Sample(uri, _chunk_box(i)) for i in range(12)]
    got = _batches(_cfg(batch_size=1), samples)
    waves = [n for n, _, _ in made[0].waves]
    assert max(waves) == 2 and sum(waves) == 12, waves  # two batches a wave where two are queued
    assert [n for n, _ in checked] == list(range(len(waves)))
    assert all(at >= n + 2 for n, at in checked[:-1]), checked  # the next wave was queued first
    for x, s in zip(got, samples):
        assert torch.equal(x[0], torch.from_numpy(data[tuple(slice(*a) for a in s.aabb)].astype(np.float32)))
