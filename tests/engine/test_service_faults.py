"""A fault on one of the pipeline's own threads (a bug of stoker's) reaches the consumer as an InternalError
naming the thread, at the next pop, never as a hang ended by a PoolStarved that blames the consumer's slots.

The faults are injected (the bugs they stand for are fixed); ``pop_timeout_s`` is short, so a pipeline that
hangs instead fails the test with PoolStarved within seconds.
"""

from __future__ import annotations

import os
import functools
import threading
import traceback
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.cpu.decode_native import NativeDecoder
from stoker.engine.cpu.decode_python import PythonDecoder
from stoker.engine.executor import Job, JobState, JobStateError
from stoker.runtime.faults import internal_error, serve

from batch_oracle import first_planes_crops, zstd_array

pytestmark = pytest.mark.timeout(60)

@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    data = np.random.default_rng(0).normal(size=(16, 64, 64)).astype("float32")
    return zstd_array(tmp_path_factory.mktemp("faults") / "v.zarr", data, (8, 16, 16))


def _cfg(**kw) -> stoker.Config:
    # a transform: every batch has a completion hook, so the finisher thread finishes it (not its waiter)
    base = dict(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, n_compute_threads=2, pop_timeout_s=5.0,
                device="cpu", transform=lambda x: x)
    base.update(kw)
    return stoker.Config(**base)


def test_the_finisher_threads_fault_is_the_next_pops_internal_error(volume, monkeypatch):
    """The shape of a fixed race (tests/reader/test_stale_shards.py): the finisher finished a batch, then its
    accounting raised, and failing the finished batch raised again (JobStateError): its thread died, and every
    later batch waited for it until PoolStarved. Now the next pop raises the fault, as do every later pop and
    push, and close() still closes."""
    if native.Engine is None:
        pytest.skip("stoker._native is not available")
    uri, data = volume
    finish = NativeDecoder._finish
    faults = []

    def finish_then_fail(self, job, *args, **kw):
        finish(self, job, *args, **kw)  # the batch is complete: failing it now is refused
        faults.append(job.state)
        raise RuntimeError("an injected bug after the batch was finished")

    monkeypatch.setattr(NativeDecoder, "_finish", finish_then_fail)
    samples = first_planes_crops(uri, 8)
    p = stoker.Pipeline(_cfg())
    try:
        p.push(samples)
        with p.pop() as batch:  # finished before the fault: delivered, its values right
            got = np.from_dlpack(batch).copy()
        want = np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in samples[:2]])
        np.testing.assert_array_equal(got, want)
        with pytest.raises(stoker.InternalError) as raised:
            p.pop()
        err = raised.value
        assert err.thread == "stoker-engine-finisher"
        assert "internal error of stoker" in str(err) and "report" in str(err)
        assert isinstance(err.__cause__, JobStateError)  # failing the finished batch, refused
        assert isinstance(err.__cause__.__context__, RuntimeError)  # the bug that began it
        with pytest.raises(stoker.InternalError) as again:  # sticky: pop and push
            p.pop()
        assert again.value is err
        with pytest.raises(stoker.InternalError):
            p.push(samples[:2])
    finally:
        p.close()
    assert faults[0] is JobState.DONE
    assert not any(t.is_alive() for t in p._executor.threads())


def test_a_pool_tasks_fault_fails_every_later_batch_with_an_internal_error(volume, monkeypatch):
    """A task of the Python path's pools raising past its own handling (here a group of reads, after its first
    file) was only printed: its batch waited for chunks nobody would count, until PoolStarved. Now that batch
    fails with an InternalError naming the pool's thread, and so does every later one."""
    monkeypatch.setattr(native, "Engine", None)  # the Python path's pools make every batch
    uri, _ = volume
    injected: list[tuple[str, Job]] = _fail_the_first_task(monkeypatch)
    samples = first_planes_crops(uri, 4)
    p = stoker.Pipeline(_cfg(transform=None))
    try:
        p.push(samples)
        with pytest.raises(stoker.InternalError) as raised:
            for _ in range(2):  # the first batch's task raised, or (done already) the next one's
                p.pop().release()
        err = raised.value
        assert err.thread == injected[0][0] and err.thread.startswith(("stoker-io", "stoker-compute"))
        assert isinstance(err.__cause__, RuntimeError)
        with pytest.raises(stoker.InternalError) as again:
            p.push(samples)
        assert again.value is err
    finally:
        p.close()


def test_serve_hands_an_escaping_exception_to_on_fault_as_an_internal_error():
    got = []
    thread = threading.Thread(target=serve, args=(lambda: {}["missing"], got.append), name="stoker-test-loop")
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    (err,) = got
    assert isinstance(err, stoker.InternalError) and err.thread == "stoker-test-loop"
    assert isinstance(err.__cause__, KeyError) and "stoker-test-loop" in str(err)


def test_serve_reports_a_failing_on_fault_as_a_threads_error(monkeypatch):
    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)

    def on_fault(fault):
        raise ValueError("on_fault's own bug")

    thread = threading.Thread(target=serve, args=(lambda: 1 / 0, on_fault), name="stoker-test-loop")
    thread.start()
    thread.join(10)
    (args,) = hooked
    assert args.exc_type is ValueError and isinstance(args.exc_value.__context__, stoker.InternalError)


def test_the_disk_cache_writers_fault_turns_the_cache_off_and_flush_returns(tmp_path, monkeypatch):
    """The disk cache's writer thread dying on a bug left its queue for ever: flush() waited out its timeout
    (the bench's, 600 s) and the cache went on queueing what nobody would write. Now the cache turns itself
    off with a warning naming the InternalError, the queue is dropped and flush() returns True at once."""
    from stoker.storage.diskcache import DiskCache

    def take_fails(self):
        raise RuntimeError("an injected bug in the writer's loop")

    monkeypatch.setattr(DiskCache, "_take", take_fails)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    with pytest.warns(RuntimeWarning, match="stoker-diskcache.*internal error of stoker.*stops caching"):
        cache.put("s3://bkt\nc/0\ng1", b"x" * 100)
        assert cache.flush(timeout_s=30.0)  # at once (the writer is gone: nothing is left queued)
    assert not cache.writable
    assert not cache.has("s3://bkt\nc/0\ng1")  # never written, and no longer served from the queue
    cache.put("s3://bkt\nc/1\ng1", b"y" * 100)  # off: nothing queued
    assert cache.flush(timeout_s=30.0)


def _corrupt_volume(path) -> str:
    z = zarr.create_array(str(path), shape=(8, 32, 32), chunks=(8, 16, 16), dtype="float32",
                          compressors=ZstdCodec(level=1))
    z[:] = np.arange(z.size, dtype="float32").reshape(z.shape)
    with open(path / "c" / "0" / "0" / "0", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 32)  # a corrupt chunk: the engine does not place it, its settle hands the job on
    return str(path)


def _one_sample_config() -> stoker.Config:
    return stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=16 << 20, n_compute_threads=2,
                         pop_timeout_s=10.0, device="cpu")


@pytest.fixture
def lane(tmp_path):
    """``(pipeline, its lane's native decoder, released)``: the decoder made for a first batch (one crop, popped
    and released) of an array with a corrupt chunk; ``released``: the event the test's :class:`_Stuck` engine
    jobs wait for. After the test the pipeline is closed (again), then ``released`` set."""
    if native.Engine is None:
        pytest.skip("stoker._native is not available")
    uri = _corrupt_volume(tmp_path / "a.zarr")
    p = stoker.Pipeline(_one_sample_config())
    released = threading.Event()
    try:
        p.push([stoker.Sample(uri, [(0, 8), (16, 32), (16, 32)])])
        p.pop().release()
        yield p, p._executor.decoders.native, released
    finally:
        p.close()
        released.set()


class _Stuck:
    """An engine job the finisher waits for until the test sets ``released``."""

    def __init__(self, released: threading.Event) -> None:
        self.released = released

    def wait(self, timeout=None):
        return self.released.wait(timeout)


def _native_decoders(p):
    return [ex.decoders.native for ex in p._coordinator.lanes.executors()
            if getattr(ex, "decoders", None) is not None and ex.decoders.native is not None]


def test_a_field_abandoned_while_handed_to_its_finisher_is_no_internal_error(tmp_path, monkeypatch):
    """Field a's settle hands its job to a's finisher (a corrupt chunk, SETTLING with a claim); field b's failure
    abandons it before the finisher takes it over. That finisher then drops it: the lane has no fault and its
    finisher goes on (its take_over raised JobStateError, which became the lane's InternalError)."""
    if native.Engine is None:
        pytest.skip("stoker._native is not available")
    a = _corrupt_volume(tmp_path / "a.zarr")
    b_dir = _corrupt_volume(tmp_path / "b.zarr")
    b = str(tmp_path / "b.zip")  # an archive's array: its chunks are the Python path's, b fails on b's finisher
    with zipfile.ZipFile(b, "w", compression=zipfile.ZIP_STORED) as zf:
        for d, _, files in os.walk(b_dir):
            for f in sorted(files):
                zf.write(os.path.join(d, f), os.path.relpath(os.path.join(d, f), b_dir))
    take_over = Job.take_over
    taken: list[tuple[JobState, bool]] = []
    took = threading.Event()

    def take_over_once_abandoned(self, claim):
        self.done.wait(10)  # the finisher comes to it only once the coordinator abandoned it
        state = self.state
        taken.append((state, take_over(self, claim)))
        took.set()
        return taken[-1][1]

    monkeypatch.setattr(Job, "take_over", take_over_once_abandoned)
    box = [(0, 8), (0, 32), (0, 32)]
    p = stoker.Pipeline(_one_sample_config())
    try:
        p.push([stoker.Sample({"a": (a, box), "b": (b, box)})])
        with pytest.raises(stoker.StokerError) as raised:
            p.pop()
        assert not isinstance(raised.value, stoker.InternalError)
        assert took.wait(10) and taken == [(JobState.FAILED, False)]  # a's finisher dropped it
        decoders = _native_decoders(p)
        assert decoders and [d._fault for d in decoders] == [None] * len(decoders)  # no lane stopped
        assert all(d._thread.is_alive() for d in decoders)
    finally:
        p.close()


def test_close_leaves_a_field_abandoned_while_handed_off_as_it_is(lane):
    """shutdown() fails what the finisher left; a handed-off job another field's failure abandoned is finished
    already: close() skips it (it raised JobStateError, and the Python path was never shut down)."""
    p, d, released = lane
    job = Job(SimpleNamespace(n_chunks=2), None, 2)
    handed: list[int] = []
    job.settled_by(_Stuck(released), lambda j, e: handed.append(j.claim))
    released.set()
    job.wait(0.01)  # claimed, handed on
    released.clear()
    assert job.state is JobState.SETTLING and job.abandon(RuntimeError("field b failed"))
    with d._cond:
        d._pending.append((Job(SimpleNamespace(n_chunks=1), None, 1), _Stuck(released), np.arange(1), None, None))
        d._pending.append((job, _Stuck(released), np.arange(2), None, handed[0]))
        d._cond.notify_all()
    p.close()  # (the finisher still waits for the first engine job: released after the test)
    assert job.state is JobState.FAILED and str(job.error) == "field b failed"
    assert d._python._closing  # the Python path was shut down too


def test_the_finishers_fault_leaves_a_stale_hand_off_to_the_waiter_settling_it_again(lane):
    """The finisher's fault fails every job queued for it, but a stale hand-off's job (its settle interrupted,
    a waiter settling it again under a newer claim) is that waiter's: left be, as shutdown leaves it, and
    failed with the fault when that waiter hands it on again."""
    _, d, released = lane
    claims: list[int] = []
    job = Job(SimpleNamespace(n_chunks=2), None, 2)

    class Done:
        def wait(self, timeout=None):
            return True

    job.settled_by(Done(), lambda j, e: claims.append(j.claim))
    job.wait(0.01)  # claimed, handed on (the hand-off queued below)
    job._interrupted(lambda j, e: claims.append(j.claim), Done())  # put back: that hand-off is stale
    job.wait(0.01)  # a waiter claims it again and is settling it
    assert job.state is JobState.SETTLING and claims[1] != claims[0]
    head = Job(SimpleNamespace(n_chunks=1), None, 1)
    with d._cond:  # (the finisher waits for the head's engine job until the end: it takes neither)
        d._pending.append((head, _Stuck(released), np.arange(1), None, None))
        d._pending.append((job, Done(), np.arange(2), None, claims[0]))
        d._cond.notify_all()
    fault = internal_error("stoker-engine-finisher", RuntimeError("an injected bug"))
    d._faulted(fault)
    assert head.error is fault  # a job queued for the finisher fails with its fault
    assert job.state is JobState.SETTLING and job.error is None  # its waiter's still
    d._to_finisher(job, Done(), None, claims[1])  # that waiter hands it on: failed with the fault
    assert job.state is JobState.FAILED and job.error is fault


def test_the_kept_internal_error_holds_none_of_the_faulted_tasks_batch(volume, monkeypatch):
    """The InternalError a pipeline keeps (raised by every later pop) held its cause's traceback, whose frames
    held the faulted task's locals: its job, whose ``out`` views a batch slot, for the pipeline's life. Their
    locals are cleared now (the printed traceback still names the files and lines)."""
    monkeypatch.setattr(native, "Engine", None)  # the Python path's pools make every batch
    uri, _ = volume
    faulted = _fail_the_first_task(monkeypatch)
    p = stoker.Pipeline(_cfg(transform=None))
    try:
        p.push(first_planes_crops(uri, 4))
        with pytest.raises(stoker.InternalError) as raised:
            for _ in range(2):
                p.pop().release()
    finally:
        p.close()
    err = raised.value
    printed = "".join(traceback.format_exception(err.__cause__))
    assert "guard_then_fail" in printed and "an injected bug" in printed  # where it was raised, still said
    assert faulted and err is p._error
    job = faulted[0][1]
    tb, held = err.__cause__.__traceback__, []
    while tb is not None:  # no frame of the cause's traceback holds the job, or a call of it (serve's loop)
        for name, value in tb.tb_frame.f_locals.items():
            args = getattr(value, "args", None) if isinstance(value, functools.partial) else ()
            if value is job or any(a is job for a in args):
                held.append((tb.tb_frame.f_code.co_name, name))
        tb = tb.tb_next
    assert held == []


def _fail_the_first_task(monkeypatch) -> list[tuple[str, Job]]:
    """Make the first task of the Python path's pools raise after its chunks were counted (past the task's own
    handling); returns the list it fills with that task's ``(thread name, job)``."""
    guard = PythonDecoder.guard
    injected: list[tuple[str, Job]] = []
    inside = threading.local()  # a guard run inside another's task is that task's: its error is handled there

    def guard_then_fail(self, job, *args):
        task = not getattr(inside, "guard", False)
        inside.guard = True
        try:
            guard(self, job, *args)
        finally:
            inside.guard = not task
        if task and not injected:
            injected.append((threading.current_thread().name, job))
            raise RuntimeError("an injected bug past the task's own handling")

    monkeypatch.setattr(PythonDecoder, "guard", guard_then_fail)
    return injected
