"""GIL-held time of a pipeline's threads (``Stats.gil_seconds``): what it counts and what it leaves out.

Every check compares CPU-clock amounts with wide margins (Python burnt on purpose against work done
with the GIL released), so a slow or busy machine cannot flip them.
"""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import stoker
import stoker.engine.cpu.executor as cpu_module
from stoker.runtime import gil
from stoker.engine.cpu import native
from stoker.engine.cpu.decode_native import NativeDecoder
from stoker.engine import stats as stats_module
from stoker.engine.stats import StatsRecorder
from stoker.runtime.workers import DaemonPool

pytestmark = pytest.mark.timeout(60)

BURN_S = 0.03


@pytest.fixture(autouse=True)
def no_full_collections():
    """A garbage collection runs on whichever thread allocates and holds the GIL (a full one took
    70 ms in a process with torch loaded): real GIL time, but not what these checks are about."""
    gc.disable()
    yield
    gc.enable()


def _burn_python(seconds: float) -> None:
    """Hold the GIL for ``seconds`` of this thread's CPU time (small Python operations, as a step's Python)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        sum(range(200))


def _hash_without_gil(data: memoryview) -> float:
    """CPU seconds of a call that releases the GIL (hashlib does for large buffers), made through
    :func:`gil.released`; returns what the thread's clock says it took."""
    t0 = time.thread_time()
    gil.released(hashlib.sha256, data)
    return time.thread_time() - t0


def _on_enrolled_thread(fn):
    out = {}

    def run():
        gil.enroll()
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out["value"]


def test_held_time_counts_python_and_leaves_out_released_calls():
    data = memoryview(np.ones(48 << 20, dtype=np.uint8))  # its pages touched here, not on the measured thread

    def work():
        _burn_python(BURN_S)
        released = _hash_without_gil(data)
        released += gil.released(lambda: gil.released(_hash_without_gil, data))  # nested: counted once
        return gil.held_since_last() * 1e-9, released, gil.held_since_last() * 1e-9

    held, released, again = _on_enrolled_thread(work)
    assert held >= BURN_S  # every bit of the Python burnt
    assert held < BURN_S + released / 2  # and not the hashing, which ran without the GIL
    assert again < held  # the next call counts from the previous one


def test_a_wait_counts_as_released_and_returns_what_the_condition_says():
    class WakeUpCosts:
        """A condition whose wake-up burns CPU, as a futex wake and the GIL hand-over do on a busy host."""

        def wait(self, timeout=None):
            _burn_python(BURN_S)
            return True

    cond = threading.Condition()

    def work():
        gil.held_since_last()
        woken = gil.wait(WakeUpCosts(), 1.0)
        held = gil.held_since_last() * 1e-9
        with cond:
            timed_out = gil.wait(cond, 0.01)
        return woken, held, timed_out

    woken, held, timed_out = _on_enrolled_thread(work)
    assert woken is True and timed_out is False
    assert held < BURN_S / 2  # the wait's CPU is not GIL time

    out = {}

    def waiter():
        gil.enroll()
        with cond:
            out["ready"] = True
            cond.notify_all()
            out["notified"] = gil.wait(cond, 30)

    t = threading.Thread(target=waiter)
    with cond:
        t.start()
        while not out.get("ready"):
            cond.wait(1)
        cond.notify_all()  # the waiter is in gil.wait: it holds the lock only once woken
    t.join(30)
    assert out["notified"] is True


def test_held_time_given_back_is_counted_by_the_next_report():
    def work():
        _burn_python(BURN_S)
        taken = gil.held_since_last()
        gil.carry(taken)  # not charged by its taker: the thread's next report counts it
        return taken, gil.held_since_last()

    taken, again = _on_enrolled_thread(work)
    assert taken >= BURN_S * 1e9 and again >= taken


def test_threads_that_are_not_enrolled_are_not_measured():
    out = {}

    def work():
        _burn_python(0.005)
        out["held"] = gil.held_since_last()
        out["enrolled"] = gil.enrolled()
        out["released"] = gil.released(sum, [1, 2, 3])

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert out == {"held": 0, "enrolled": False, "released": 6}


def test_recorder_charges_pipeline_threads_but_not_the_consumer():
    rec = StatsRecorder()

    def pipeline_thread():
        _burn_python(BURN_S)
        rec.stage("plan", 0.0)  # a pipeline thread's report charges its Python since the last one
        _burn_python(BURN_S)
        rec.stage("pop_wait", 0.0)  # the consumer reports pop_wait: its Python is dropped, enrolled or not
        _burn_python(BURN_S)
        rec.charge_thread()  # a pipeline thread that reports no stage
        return None

    _on_enrolled_thread(pipeline_thread)
    rec.gil(0.25)  # time measured elsewhere (the hook for native code that takes the GIL)
    s = rec.snapshot()
    assert 2 * BURN_S + 0.25 <= s.gil_seconds < 3 * BURN_S + 0.25
    assert "gil_seconds" in str(s) and "gil_ms_per_batch" in str(s)
    rec.reset()
    assert rec.snapshot().gil_seconds == 0.0


# -- a real pipeline ---------------------------------------------------------------------------------


def _volume(tmp_path, shape=(16, 512, 512), chunks=(2, 512, 512)):
    z = zarr.create_array(str(tmp_path / "v.zarr"), shape=shape, chunks=chunks, dtype="uint16",
                          compressors=ZstdCodec(level=1), fill_value=0)
    z[:] = np.random.default_rng(0).integers(0, 1000, size=shape, dtype=np.uint16)  # entropy-coded, not stored raw
    return str(tmp_path / "v.zarr")


def _samples(uri, n, depth=4, shape=(16, 512, 512), seed=1):
    rng = np.random.default_rng(seed)
    return [stoker.Sample(uri, [(z0, z0 + depth), (0, shape[1]), (0, shape[2])])
            for z0 in rng.integers(0, shape[0] - depth + 1, size=n).tolist()]


def _cfg(batch_size=4):
    return stoker.Config(batch_size=batch_size, dtype="f32", host_buffer_bytes=256 << 20, lookahead_batches=1,
                         n_io_threads=1, n_compute_threads=2)


def test_pipeline_planning_python_shows_as_gil_time(tmp_path, monkeypatch):
    uri = _volume(tmp_path)
    real = cpu_module.plan_tables  # the planner of both decode paths

    def slow_plan(*args, **kwargs):
        _burn_python(BURN_S)  # Python planning of a known CPU cost per batch
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_module, "plan_tables", slow_plan)
    n = 5
    with stoker.Pipeline(_cfg(batch_size=2)) as p:
        p.push(_samples(uri, 2 * n))
        for _ in range(n):
            with p.pop():
                pass
        s = p.stats()
    assert s.batches_emitted == n
    assert s.gil_seconds >= n * BURN_S and s.gil_per_batch >= BURN_S


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_decoding_without_the_gil_is_not_gil_time(tmp_path, monkeypatch, path):
    # 2 MiB zstd chunks, whole planes: per batch about 20 MiB decoded and cast with the GIL released,
    # against a little Python to plan and hand out the work
    if path == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif native.Engine is None:
        pytest.skip("the compiled reader is not built")
    shape = (32, 512, 512)
    uri = _volume(tmp_path, shape=shape, chunks=(4, 512, 512))
    with stoker.Pipeline(_cfg()) as p:
        p.push(_samples(uri, 4 * 6, depth=8, shape=shape))
        for _ in range(6):
            with p.pop():
                pass
        s = p.stats()
    decode = s.stages["decode"].seconds
    assert s.chunks_decoded >= 12 and decode > 0
    assert 0 < s.gil_seconds < 0.3 * decode, (s.gil_seconds, decode)


@pytest.mark.timeout(60)
def test_a_consumer_on_a_pool_thread_is_not_charged(tmp_path):
    # a training loop may itself run on a stoker pool thread (enrolled): its step is still not the pipeline's
    uri = _volume(tmp_path, shape=(8, 64, 64), chunks=(4, 32, 32))
    done = threading.Event()
    out = {}

    def consume():
        try:
            with stoker.Pipeline(_cfg(batch_size=2)) as p:
                p.push(_samples(uri, 8, depth=2, shape=(8, 64, 64)))
                for _ in range(4):
                    with p.pop():
                        _burn_python(BURN_S)
                out["stats"] = p.stats()
        finally:
            done.set()

    pool = DaemonPool(1, "consumer")
    pool.submit(consume)
    assert done.wait(30)
    pool.shutdown()
    assert out["stats"].gil_seconds < 2 * BURN_S  # 4 steps of BURN_S ran on the consumer's thread


@pytest.mark.parametrize("consumer", ["main thread", "stoker pool thread"])
def test_a_batch_settled_on_the_consumers_thread_is_charged_to_the_pipeline(tmp_path, monkeypatch, consumer):
    # a batch the engine makes whole is settled by the thread that pops it (no thread of ours wakes for it):
    # that work is the pipeline's GIL time, while the consumer's own step stays out, on any thread
    if native.Engine is None:
        pytest.skip("the compiled reader is not built")
    uri = _volume(tmp_path, shape=(8, 64, 64), chunks=(4, 32, 32))
    real = NativeDecoder._finish_placed
    settled_on = []

    def slow_finish_placed(*args, **kwargs):
        settled_on.append(threading.current_thread())
        _burn_python(BURN_S)  # settling that holds the GIL for a known time
        return real(*args, **kwargs)

    monkeypatch.setattr(NativeDecoder, "_finish_placed", staticmethod(slow_finish_placed))
    n = 4
    out = {}

    def consume():
        with stoker.Pipeline(_cfg(batch_size=2)) as p:
            p.push(_samples(uri, 2 * n, depth=2, shape=(8, 64, 64)))
            for _ in range(n):
                with p.pop():
                    _burn_python(3 * BURN_S)  # the training step: not the pipeline's
            out["stats"], out["thread"] = p.stats(), threading.current_thread()

    if consumer == "main thread":
        consume()
    else:
        pool = DaemonPool(1, "consumer")
        done = threading.Event()
        pool.submit(lambda: (consume(), done.set()))
        assert done.wait(30)
        pool.shutdown()
    assert settled_on == [out["thread"]] * n
    assert n * BURN_S <= out["stats"].gil_seconds < 2 * n * BURN_S, out["stats"].gil_seconds


# -- where the engine's threads and the coordinator spend their time ---------------------------------------


def test_engine_threads_and_the_coordinator_show_in_stats(tmp_path, monkeypatch):
    """Stats.workers: each engine thread's clocks over the window (since stats_reset), which sum to its wall
    time, that window; Stats.coordinator_seconds: the coordinator thread's CPU (here planning Python of a
    known cost per batch)."""
    if native.Engine is None:
        pytest.skip("the compiled reader is not built")
    uri = _volume(tmp_path, shape=(32, 512, 512), chunks=(4, 512, 512))
    real = cpu_module.plan_tables

    def slow_plan(*args, **kwargs):
        _burn_python(BURN_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_module, "plan_tables", slow_plan)
    n = 6
    with stoker.Pipeline(_cfg()) as p:
        p.push(_samples(uri, 4 * (n + 1), depth=8, shape=(32, 512, 512)))
        with p.pop():
            pass
        t0 = time.monotonic()
        p.stats_reset()
        for _ in range(n):
            with p.pop():
                pass
        s = p.stats()
        window = time.monotonic() - t0
    assert len(s.workers) == 2
    for w in s.workers:
        parts = sum(getattr(w, name) for name in stats_module.WORKER_TIMES)
        assert abs(parts - w.wall) < 1e-6 and 0 < w.wall <= window + 0.05, (w, window)
        assert 0 <= w.busy_share <= 1
    assert sum(w.decode for w in s.workers) > 0 and sum(w.copy for w in s.workers) > 0
    # the chunks made in the window: at most the pushed batches' (two were made ahead, before the reset)
    per_batch = s.chunks_decoded // n
    assert 0 < sum(w.chunks for w in s.workers) <= (n + 1) * per_batch
    assert s.coordinator_seconds >= (n - 2) * BURN_S and s.coordinator_per_batch > 0
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):  # the OS's view: Linux
        assert all(w.on_cpu is not None and 0 <= w.on_cpu <= w.wall + 0.05 for w in s.workers), s.workers
        assert s.coordinator_run_queue is not None and s.coordinator_run_queue >= 0
    assert "busy %" in str(s)


def test_the_engine_threads_reported_do_not_grow_with_batches_or_pipelines(tmp_path):
    """Stats.workers has a row per thread of the engine the pipeline started (one for the batches of one box;
    one shared by every field's lane), however many batches it made, in each of several pipelines one after
    the other: each engine is watched once, by its own pipeline's recorder."""
    if native.Engine is None:
        pytest.skip("the compiled reader is not built")
    uri = _volume(tmp_path, shape=(16, 64, 64), chunks=(2, 32, 32))
    crops = [[(z0, z0 + 2), (0, 32), (0, 32)] for z0 in range(15)] * 4
    for _ in range(3):
        for samples, engines in (([stoker.Sample(uri, c) for c in crops], 1),
                                 ([stoker.Sample({"a": (uri, c), "b": (uri, c)}) for c in crops], 1)):
            with stoker.Pipeline(_cfg(batch_size=2)) as p:
                p.push(samples)
                assert sum(1 for _ in p) == 30
                assert len(p.stats().workers) == 2 * engines  # n_compute_threads=2


def test_the_python_path_reports_no_engine_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "Engine", None)
    uri = _volume(tmp_path, shape=(8, 64, 64), chunks=(4, 32, 32))
    with stoker.Pipeline(_cfg(batch_size=2)) as p:
        p.push(_samples(uri, 4, depth=2, shape=(8, 64, 64)))
        for _ in range(2):
            with p.pop():
                pass
        s = p.stats()
    assert s.workers == () and s.coordinator_seconds > 0
