"""A fault on one of the GPU-decode executor's threads (a bug of stoker's) reaches the consumer as an InternalError
naming the thread, at the next pop, never as a hang ended by a PoolStarved that blames the consumer's slots;
the close still closes, and a ShutdownError escaping at the close stays the close's.

The executor runs on CPU tensors (its host stand-ins, as in test_gpu_executor.py); the faults are injected.
``pop_timeout_s`` is short, so a pipeline that hangs instead fails the test with PoolStarved within seconds.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import stoker
from stoker.engine.gpu import native_reads
from stoker.engine.gpu import staging as gpu_staging, streams
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.pipeline import facade as pipelines
from stoker.errors import InternalError, ShutdownError, pipeline_closed

from batch_oracle import first_planes_crops, zstd_array

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    data = np.random.default_rng(0).integers(0, 4000, size=(16, 64, 64)).astype("uint16")
    return zstd_array(tmp_path_factory.mktemp("gpu-faults") / "v.zarr", data, (8, 16, 16))


@pytest.fixture
def made(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on CPU tensors; the executors made."""
    executors: list[GpuDecodeExecutor] = []

    def factory(cfg, device, stats, store):
        executors.append(GpuDecodeExecutor.on_host(cfg, stats, store))
        return executors[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    return executors


def _cfg(**kw) -> stoker.Config:
    base = dict(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, n_io_threads=1,
                host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20, pop_timeout_s=5.0)
    base.update(kw)
    return stoker.Config(**base)


def _want(data: np.ndarray, samples: list[stoker.Sample]) -> np.ndarray:
    return np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in samples]).astype("float32")


def _next_pop_fails(p: stoker.Pipeline, thread: str, more: list[stoker.Sample]) -> InternalError:
    """The next pop's InternalError, which names ``thread`` (a prefix: a pool's threads are numbered) and is
    sticky (pop raises it again, and so does a push of ``more``)."""
    with pytest.raises(InternalError) as raised:
        p.pop()
    err = raised.value
    assert err.thread.startswith(thread), err.thread
    assert "internal error of stoker" in str(err) and "report" in str(err)
    with pytest.raises(InternalError):
        p.pop()
    with pytest.raises(InternalError):
        p.push(more)
    return err


def _closed(p: stoker.Pipeline, ex: GpuDecodeExecutor) -> None:
    """close() returns and leaves no thread of the executor's running."""
    p.close()
    for thread in ex.threads():
        thread.join(10.0)
    assert not [t.name for t in ex.threads() if t.is_alive()]


def test_a_fault_of_the_reader_s_loop_is_the_next_pop_s_internal_error(volume, made, monkeypatch):
    """The reader's hand-over of a wave raises (a handler of its loop, past the loop's own handling): its thread
    ended and the batch it staged, and every later one, waited for nobody until PoolStarved. Now they fail
    with an InternalError naming the reader."""
    uri, _ = volume
    hand_wave = GpuDecodeExecutor._hand_wave
    injected: list[str] = []

    def fails_once(self):
        if not injected and self._wave is not None:
            injected.append(threading.current_thread().name)
            raise RuntimeError("an injected bug handing a wave on")
        hand_wave(self)

    monkeypatch.setattr(GpuDecodeExecutor, "_hand_wave", fails_once)
    p = stoker.Pipeline(_cfg())
    try:
        p.push(first_planes_crops(uri, 8))
        err = _next_pop_fails(p, "stoker-gpu-read", first_planes_crops(uri, 2))
        assert err.thread == "stoker-gpu-read" and isinstance(err.__cause__, RuntimeError)
        assert injected == ["stoker-gpu-read"]
    finally:
        _closed(p, made[0])


def test_a_fault_of_the_submitter_s_loop_is_the_next_pop_s_internal_error(volume, made, monkeypatch):
    """The submitter finished a batch, then raised (its accounting, say): its thread ended, the reader waited
    for a staging buffer nobody gave back, and the consumer for batches nobody finished. Now the batch
    finished before is delivered, its values right, and the next pop raises the fault."""
    uri, data = volume
    finish = GpuDecodeExecutor._finish
    injected: list[str] = []

    def finish_then_fail(self, b):
        finish(self, b)
        if not injected:
            injected.append(threading.current_thread().name)
            raise RuntimeError("an injected bug after a batch was finished")

    monkeypatch.setattr(GpuDecodeExecutor, "_finish", finish_then_fail)
    samples = first_planes_crops(uri, 8)
    p = stoker.Pipeline(_cfg())
    try:
        p.push(samples)
        with p.pop() as batch:
            got = torch.from_dlpack(batch).numpy().copy()
        np.testing.assert_array_equal(got, _want(data, samples[:2]))
        err = _next_pop_fails(p, "stoker-gpu-decode", samples[:2])
        assert err.thread == "stoker-gpu-decode" and isinstance(err.__cause__, RuntimeError)
        assert injected == ["stoker-gpu-decode"]
    finally:
        _closed(p, made[0])


def test_a_read_pool_task_s_fault_fails_its_batch_with_an_internal_error(volume, made, monkeypatch):
    """A slice of the staging's read pool raising past its own handling was only printed: the map waited for
    the slice nobody ended, and the consumer until PoolStarved. Now the batch fails with an InternalError
    naming the pool's thread."""
    uri, _ = volume
    run_slice = gpu_staging._run_slice
    injected: list[str] = []

    def fails_on_the_pool(slices, j):
        name = threading.current_thread().name
        if name.startswith("stoker-gpu-read_"):  # a pool thread ("_i"), not the reader (the map's caller)
            injected.append(name)
            raise RuntimeError("an injected bug in a slice of reads")
        run_slice(slices, j)

    monkeypatch.setattr(gpu_staging, "_run_slice", fails_on_the_pool)
    monkeypatch.setattr(native_reads, "available", lambda: False)  # the Python reads, on the read pool's threads
    p = stoker.Pipeline(_cfg(n_compute_threads=4))
    try:
        p.push(first_planes_crops(uri, 8))
        err = _next_pop_fails(p, "stoker-gpu-read_", first_planes_crops(uri, 2))
        assert isinstance(err.__cause__, RuntimeError) and err.thread in injected
    finally:
        _closed(p, made[0])


def test_a_shutdown_error_escaping_the_reader_at_the_close_stays_a_shutdown_error(volume, made, monkeypatch):
    """At the close, the reader's hand-over raises the close's ShutdownError past the loop (its batches queued
    are then failed by the fault's route, not the close's): they fail with that ShutdownError, never an
    InternalError, and nothing is reported as a thread's error."""
    uri, _ = volume
    hand_wave, stage = GpuDecodeExecutor._hand_wave, GpuDecodeExecutor._stage
    jobs, escaped, hooked = [], [], []
    submit = GpuDecodeExecutor.submit

    def kept(self, plan, target):
        jobs.append(submit(self, plan, target))
        return jobs[-1]

    def stage_until_closed(self, b, counts):
        if len(jobs) > 1 and b.job is not jobs[0]:  # the first batch is made; the second waits for the close
            self._hand_wave()  # (the first batch's chunks: its wave would wait for this one)
            for _ in range(100):  # bounded: 10 s
                if self._closing:
                    break
                threading.Event().wait(0.1)
            raise pipeline_closed()
        return stage(self, b, counts)

    def raises_when_closing(self):
        if self._closing:
            escaped.append(threading.current_thread().name)
            raise pipeline_closed()
        hand_wave(self)

    monkeypatch.setattr(GpuDecodeExecutor, "submit", kept)
    monkeypatch.setattr(GpuDecodeExecutor, "_stage", stage_until_closed)
    monkeypatch.setattr(GpuDecodeExecutor, "_hand_wave", raises_when_closing)
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    p = stoker.Pipeline(_cfg(batch_size=1, lookahead_batches=4))
    try:
        p.push(first_planes_crops(uri, 4))
        with p.pop():
            pass
        for _ in range(100):  # bounded: 10 s; the lookahead's batches are submitted (queued behind the second)
            if len(jobs) == 4:
                break
            threading.Event().wait(0.1)
        assert len(jobs) == 4
    finally:
        _closed(p, made[0])
    assert escaped == ["stoker-gpu-read"] and not hooked
    assert all(j.done.is_set() for j in jobs)
    failed = [j.error for j in jobs[1:]]
    assert all(isinstance(e, ShutdownError) for e in failed), failed
    assert not any(isinstance(e, InternalError) for e in failed)
    with pytest.raises(ShutdownError):
        p.pop()


def test_a_fault_of_the_event_waiter_s_loop_fails_its_watches_and_a_new_thread_serves_later_ones():
    """The thread that waits for nvCOMP's events raising past its own handling (here reporting a watch done)
    left every watch queued behind it undone: a check waiting for a decode to start, which takes no limit,
    waited until the close. Now those watches report an InternalError naming the thread (the check raises
    it as the batch's error), and a later watch is served by a new thread."""
    gate = threading.Event()

    class Event:
        def __init__(self, wait_for: threading.Event | None = None) -> None:
            self.wait_for = wait_for

        def synchronize(self) -> None:
            if self.wait_for is not None:
                assert self.wait_for.wait(10.0)

    class SetFailsOnce(threading.Event):
        failed = False

        def set(self) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("an injected bug reporting a watch done")
            super().set()

    waiter = streams.EventWaiter("stoker-nvcomp-check test")
    first = waiter.watch(Event(gate))  # the thread waits for it until the gate opens
    first._done = SetFailsOnce()
    queued = waiter.watch(Event())
    gate.set()
    for watch in (first, queued):
        assert watch.wait(10.0)
        assert isinstance(watch.error, InternalError) and watch.error.thread == "stoker-nvcomp-check test"
        assert isinstance(watch.error.__cause__, RuntimeError) and not watch.query()
    later = waiter.watch(Event())
    assert later.wait(10.0) and later.query()
