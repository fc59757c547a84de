"""A batch's Job as a state machine: every legal path, the transitions it refuses, one finisher however many
threads finish chunks at once, and a settle interrupted at each stage (see ``Job``'s docstring)."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu.executor import engine_available
from stoker.engine.executor import Job, JobState, JobStateError

pytestmark = pytest.mark.timeout(60)


def _job(n: int, then=None) -> Job:
    return Job(SimpleNamespace(n_chunks=n), None, n, then)


class _EngineJob:
    """The compiled engine's job as a Job waits for it: done once ``open`` is set."""

    def __init__(self, done: bool = True) -> None:
        self.open = threading.Event()
        if done:
            self.open.set()

    def wait(self, timeout=None) -> bool:
        return self.open.wait(timeout)


class _Hook:
    """A ``then`` that records the thread it ran on and whether ``done`` was already set then."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[threading.Thread, bool]] = []
        self.fail = fail

    def __call__(self, job: Job) -> None:
        self.calls.append((threading.current_thread(), job.done.is_set()))
        if self.fail is not None:
            raise self.fail


# -- the paths of a batch whose chunks are placed by threads of ours ------------------------------------------

def test_the_thread_that_places_the_last_chunk_runs_the_hook_then_sets_done():
    hook = _Hook()
    job = _job(3, hook)
    job.finish(2, bytes_read=5)
    assert job.state is JobState.RUNNING and not job.done.is_set() and not hook.calls
    job.finish(1, bytes_read=7, chunks_decoded=1)
    assert job.state is JobState.DONE and job.done.wait(0) and job.error is None
    assert hook.calls == [(threading.current_thread(), False)]  # before done, once
    assert job.counts["bytes_read"] == 12 and job.counts["chunks_decoded"] == 1
    assert not job.has_hook  # dropped once run


def test_a_batch_of_no_chunks_is_done_when_made():
    hook = _Hook()
    job = _job(0, hook)
    assert job.state is JobState.DONE and job.done.is_set() and len(hook.calls) == 1


def test_a_hook_that_raises_fails_the_batch_with_its_error():
    boom = ValueError("the copy to the device failed")
    job = _job(1, _Hook(fail=boom))
    job.finish()
    assert job.state is JobState.FAILED and job.error is boom and job.done.is_set()


def test_the_first_failure_fails_the_batch_cancels_it_once_and_later_chunks_are_only_counted():
    hook, stops = _Hook(), []
    job = _job(4, hook)
    job.on_cancel(lambda: stops.append(1))
    first = stoker.DecodeError("chunk c/0/1 is damaged", key="c/0/1")
    job.finish(1)
    job.finish(1, first)
    assert job.state is JobState.FAILED and job.error is first and job.done.is_set() and stops == [1]
    job.finish(1, stoker.DecodeError("chunk c/0/2 too", key="c/0/2"), bytes_read=3)
    job.finish(1)  # the last chunk of a failed batch: no hook, no second cancel
    assert job.error is first and stops == [1] and not hook.calls and job.counts["bytes_read"] == 3
    job.on_cancel(lambda: stops.append(2))  # a stop given to a failed job runs at once
    assert stops == [1, 2]


# -- refused -------------------------------------------------------------------------------------------------

def test_more_chunks_than_the_batch_has_are_refused_and_the_state_kept():
    job = _job(1)
    job.finish()
    with pytest.raises(JobStateError, match="done job of 1 chunks"):
        job.finish()
    with pytest.raises(JobStateError):
        job.finish(0, ValueError("late"))
    assert job.state is JobState.DONE and job.error is None


def test_a_hook_that_reports_a_chunk_is_refused_and_fails_the_batch():
    job = _job(1, lambda j: j.finish())
    job.finish()
    assert job.state is JobState.FAILED and isinstance(job.error, JobStateError)


@pytest.mark.parametrize("case", ["hook", "twice", "done", "failed"])
def test_only_a_running_job_without_a_hook_is_left_to_its_waiter(case):
    job = _job(0 if case == "done" else 1, _Hook() if case == "hook" else None)
    if case == "twice":
        job.settled_by(_EngineJob(), lambda j, e: j.finish())
    if case == "failed":
        job.finish(1, ValueError("read failed"))
    state = job.state
    with pytest.raises(JobStateError):
        job.settled_by(_EngineJob(), lambda j, e: j.finish())
    assert job.state is state


@pytest.mark.parametrize("how", ["running", "done", "applying", "twice"])
def test_only_a_settling_job_is_taken_over_and_only_once(how):
    job = _job(2)
    if how == "done":
        job.finish(2)
    if how in ("applying", "twice"):
        def settle(j, e):
            if how == "applying":  # the settle changed the job before handing it on: too late
                j.finish(1)
            assert j.take_over(j.claim)
            j.take_over(j.claim)
        job.settled_by(_EngineJob(), settle)
        with pytest.raises(JobStateError):
            job.wait(1)
        return
    with pytest.raises(JobStateError):
        job.take_over(job.claim)


# -- many threads at once ------------------------------------------------------------------------------------

def test_chunks_finished_from_many_threads_at_once_finish_the_batch_exactly_once():
    n_threads, per_thread = 16, 300
    for _ in range(5):
        hook = _Hook()
        job = _job(n_threads * per_thread, hook)
        start = threading.Barrier(n_threads)

        def place():
            start.wait(10)
            for _ in range(per_thread):
                job.finish(1, bytes_decoded=2)

        threads = [threading.Thread(target=place) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert job.done.wait(5) and job.state is JobState.DONE and job.error is None
        assert len(hook.calls) == 1 and hook.calls[0][0] in threads and hook.calls[0][1] is False
        assert job.counts["bytes_decoded"] == 2 * n_threads * per_thread


def test_failures_from_many_threads_at_once_keep_one_error_and_cancel_once():
    n_threads = 16
    for _ in range(5):
        hook, stops = _Hook(), []
        job = _job(n_threads * 2, hook)
        job.on_cancel(lambda: stops.append(threading.current_thread()))
        errors = [ValueError(f"chunk {i}") for i in range(n_threads)]
        start = threading.Barrier(n_threads)

        def place(i):
            start.wait(10)
            job.finish(1)
            job.finish(1, errors[i])

        threads = [threading.Thread(target=place, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert job.state is JobState.FAILED and job.done.is_set() and job.error in errors
        assert len(stops) == 1 and not hook.calls


# -- settled by the thread that waits ------------------------------------------------------------------------

def test_a_settled_job_is_settled_once_by_one_of_many_waiters():
    engine, settled = _EngineJob(done=False), []

    def settle(job, engine_job):
        settled.append(threading.current_thread())
        assert job.state is JobState.SETTLING and engine_job is engine
        job.finish(3, chunks_decoded=3)

    job = _job(3)
    job.settled_by(engine, settle)
    results: list[bool] = []
    waiters = [threading.Thread(target=lambda: results.append(job.wait(20))) for _ in range(8)]
    for t in waiters:
        t.start()
    engine.open.set()
    for t in waiters:
        t.join(30)
    assert results == [True] * 8 and job.state is JobState.DONE
    assert len(settled) == 1 and settled[0] in waiters and job.counts["chunks_decoded"] == 3


def test_a_wait_that_times_out_on_the_engine_claims_nothing():
    engine, settled = _EngineJob(done=False), []
    job = _job(1)
    job.settled_by(engine, lambda j, e: (settled.append(1), j.finish()))
    assert job.wait(0.01) is False and job.state is JobState.RUNNING and not settled
    engine.open.set()
    assert job.wait(5) and settled == [1] and job.state is JobState.DONE


def test_a_settle_hands_the_job_on_and_the_other_thread_takes_it_and_finishes_it():
    finisher: list[threading.Thread] = []

    def settle(job, engine_job):
        claim = job.claim

        def take():
            assert job.take_over(claim) and job.state is JobState.RUNNING
            job.finish(2)

        t = threading.Thread(target=take)
        finisher.append(t)
        t.start()

    job = _job(2)
    job.settled_by(_EngineJob(), settle)
    assert job.wait(10) and job.state is JobState.DONE
    finisher[0].join(10)


# -- a settle interrupted (Ctrl-C on the consumer's thread) ---------------------------------------------------

def test_a_settle_interrupted_before_it_changed_the_job_is_done_again_by_the_next_wait():
    calls = []

    def settle(job, engine_job):
        calls.append(job.state)
        if len(calls) == 1:
            raise KeyboardInterrupt
        job.finish(2)

    job = _job(2)
    job.settled_by(_EngineJob(), settle)
    with pytest.raises(KeyboardInterrupt):
        job.wait(5)
    assert job.state is JobState.RUNNING and not job.done.is_set()
    assert job.wait(5) and job.state is JobState.DONE and job.error is None
    assert calls == [JobState.SETTLING, JobState.SETTLING]


class _Interrupting(int):
    """A count whose addition raises KeyboardInterrupt: an interrupt inside ``finish``, under its lock."""

    def __radd__(self, other):
        raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["inside finish", "between two finishes"])
def test_a_settle_interrupted_while_it_changed_the_job_fails_the_batch_rather_than_hang(where):
    calls = []

    def settle(job, engine_job):
        calls.append(1)
        if where == "inside finish":
            job.finish(2, bytes_read=_Interrupting(1))
        job.finish(1)
        raise KeyboardInterrupt

    job = _job(2)
    job.settled_by(_EngineJob(), settle)
    with pytest.raises(KeyboardInterrupt):
        job.wait(5)
    assert job.state is JobState.FAILED and job.done.is_set() and calls == [1]
    assert isinstance(job.error, stoker.StokerError) and "interrupted" in str(job.error)
    assert job.wait(1)  # not settled again


@pytest.mark.parametrize("taken", ["before the interrupt", "after it"])
def test_a_settle_interrupted_after_it_handed_the_job_on_finishes_the_batch_once(taken):
    """The thread the job was handed to takes it over first (and owns it), or the interrupt puts it back
    first (that hand-off is stale and dropped, and the next wait settles and hands it on again)."""
    calls, takers = [], []

    def settle(job, engine_job):
        calls.append(job.claim)
        claim, took = job.claim, threading.Event()

        def take():
            if job.take_over(claim):
                job.finish(2)
            took.set()

        takers.append(threading.Thread(target=take))
        if taken == "before the interrupt" or len(calls) > 1:
            takers[-1].start()
            took.wait(10)
        if len(calls) == 1:
            raise KeyboardInterrupt

    job = _job(2)
    job.settled_by(_EngineJob(), settle)
    with pytest.raises(KeyboardInterrupt):
        job.wait(5)
    if taken == "after it":
        assert job.state is JobState.RUNNING and not job.done.is_set()
        takers[0].start()
        takers[0].join(10)
        assert job.state is JobState.RUNNING  # a stale hand-off: dropped
    assert job.wait(10) and job.state is JobState.DONE and job.error is None
    assert calls == ([1] if taken == "before the interrupt" else [1, 2])
    for t in takers:
        t.join(10)


def test_a_settle_interrupted_as_it_completed_the_job_completes_it():
    """The interrupt lands at the call of the completion, after the last chunk made the job COMPLETING."""
    def settle(job, engine_job):
        job.finish(1)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is Job._complete.__code__:
            sys.setprofile(None)
            raise KeyboardInterrupt

    job = _job(1)
    job.settled_by(_EngineJob(), settle)
    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            job.wait(5)
    finally:
        sys.setprofile(None)
    assert job.state is JobState.DONE and job.done.is_set() and job.error is None


def test_a_settle_interrupted_between_the_state_and_the_event_still_wakes_the_waiters():
    class SetRaisesOnce(type(_job(0).done)):
        raised = False

        def set(self):
            if not SetRaisesOnce.raised:
                SetRaisesOnce.raised = True
                raise KeyboardInterrupt
            super().set()

    job = _job(1)
    job.done = SetRaisesOnce()
    job.settled_by(_EngineJob(), lambda j, e: j.finish(1))
    with pytest.raises(KeyboardInterrupt):
        job.wait(5)
    assert job.state is JobState.DONE and job.done.is_set()


# -- through a pipeline and the compiled engine --------------------------------------------------------------

@pytest.mark.skipif(not engine_available(), reason="stoker._native is not available")
def test_a_pop_interrupted_while_its_settle_applied_the_results_fails_that_batch_and_says_why(tmp_path, monkeypatch):
    """Ctrl-C on the consumer's thread while its settle was changing the batch (some chunks counted): the
    batch cannot be settled again (its counts would be added twice), so the next pop raises it as lost
    instead of waiting for it forever."""
    from stoker.engine.cpu.decode_native import NativeDecoder

    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 32, 32), chunks=(4, 8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(8 * 32 * 32, dtype=np.uint16).reshape(8, 32, 32)
    real, calls = NativeDecoder._finish_placed, []

    def interrupted_once(job, n, counts, fetched):
        calls.append((threading.current_thread(), job.state))
        if len(calls) == 2:  # the second batch: one chunk counted, then the interrupt
            job.finish(1)
            raise KeyboardInterrupt
        real(job, n, counts, fetched)

    monkeypatch.setattr(NativeDecoder, "_finish_placed", staticmethod(interrupted_once))
    boxes = [[(0, 4), (0, 16), (0, 16)], [(4, 8), (8, 24), (16, 32)], [(2, 6), (16, 32), (0, 16)]]
    cfg = stoker.Config(batch_size=1, sample_shape=(4, 16, 16), dtype="f32", n_compute_threads=2, pop_timeout_s=20.0,
                        device="cpu")
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, b) for b in boxes])
        with p.pop() as batch:
            assert np.array_equal(torch.from_dlpack(batch)[0].numpy(), z[0:4, 0:16, 0:16].astype(np.float32))
        with pytest.raises(KeyboardInterrupt):
            p.pop()
        with pytest.raises(stoker.StokerError, match="interrupted while it was being handed over"):
            p.pop()
    assert [state for _, state in calls] == [JobState.SETTLING, JobState.SETTLING]  # claimed by the pop
    assert {thread for thread, _ in calls} == {threading.current_thread()}


@pytest.mark.skipif(not engine_available(), reason="stoker._native is not available")
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_pop_interrupted_as_its_settle_handed_the_batch_on_delivers_it_at_the_next_pop(tmp_path, monkeypatch,
                                                                                          where):
    """A chunk the engine did not place sends the batch to the finisher thread; Ctrl-C on the consumer's
    thread just before or just after that hand-off: the next pop delivers the batch (here its chunk's
    DecodeError), neither lost (a pop timing out) nor finished twice."""
    import os

    from stoker.engine.cpu.decode_native import NativeDecoder

    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 64), chunks=(8, 8), dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    path = os.path.join(uri, "c", "0", "3")
    raw = bytearray(open(path, "rb").read())
    raw[-6:] = b"\xff" * 6  # a damaged last block: the engine does not place it
    open(path, "wb").write(bytes(raw))
    real, calls = NativeDecoder._to_finisher, []

    def interrupted_once(self, job, *args):
        calls.append(threading.current_thread())
        if where == "after":
            real(self, job, *args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        if where == "before":
            real(self, job, *args)

    monkeypatch.setattr(NativeDecoder, "_to_finisher", interrupted_once)
    cfg = stoker.Config(batch_size=1, sample_shape=(8, 64), dtype="f32", n_compute_threads=2, pop_timeout_s=10.0,
                        device="cpu")
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(0, 8), (0, 64)])])
        with pytest.raises(KeyboardInterrupt):
            p.pop()
        with pytest.raises(stoker.DecodeError) as err:
            p.pop()
        assert err.value.key == "c/0/3"
    assert calls[0] is threading.current_thread() and len(calls) in (1, 2)


def test_abandon_stops_a_running_job_and_leaves_a_completing_one_be():
    """A batch of fields whose one field failed stops the others with abandon(): a running job fails (its
    hook never runs), one whose hook is running (COMPLETING) finishes as it was, with no JobStateError."""
    hook = _Hook()
    running = _job(2, hook)
    running.finish(1)
    assert running.abandon(RuntimeError("stop")) and running.state is JobState.FAILED and running.done.is_set()
    running.finish(1)  # a chunk placed after: only counted
    assert not hook.calls and str(running.error) == "stop"

    entered, release = threading.Event(), threading.Event()

    def slow(job):  # (an assert here would fail this thread, not the test: the main thread checks the join)
        entered.set()
        release.wait(10)

    completing = _job(1, slow)
    t = threading.Thread(target=completing.finish)
    t.start()
    assert entered.wait(10) and completing.state is JobState.COMPLETING
    assert not completing.abandon(RuntimeError("stop"))  # finish(0, error) raised JobStateError here
    release.set()
    t.join(10)
    assert not t.is_alive() and completing.state is JobState.DONE and completing.error is None
    assert not completing.abandon(RuntimeError("late"))  # final states stay as they are


def test_a_job_abandoned_while_handed_off_is_not_taken_over_and_stays_failed():
    """Another field of the batch failed while this field's settle had handed the job on (SETTLING, queued for
    the finisher): abandon fails it, and the finisher's take_over then finds it finished (False), rather than
    raising JobStateError out of the finisher's loop."""
    handed: list[int] = []
    job = _job(2)
    job.settled_by(_EngineJob(), lambda j, e: handed.append(j.claim))
    assert job.wait(0.01) is False and job.state is JobState.SETTLING  # handed on: not done yet
    assert job.abandon(RuntimeError("field b failed")) and job.done.is_set()
    assert job.take_over(handed[0]) is False
    assert job.state is JobState.FAILED and str(job.error) == "field b failed"


class _AbandonedAsItIsRead(Job):
    """A job that, the first time its settling thread reads its state as SETTLING, is abandoned by another
    thread: at once where the job's lock is free (the read was outside it), else once the lock is let go."""

    abandoner: threading.Thread | None = None

    @property
    def _state(self):
        state = self.__dict__["_st"]
        if state is JobState.SETTLING and self.abandoner is None and threading.current_thread() is self.settler:
            self.abandoner = threading.Thread(target=self.abandon, args=(RuntimeError("field b failed"),))
            self.abandoner.start()
            if not self._lock.locked():  # read outside the lock: the abandon lands between the read and a store
                self.abandoner.join(10)
        return state

    @_state.setter
    def _state(self, value):
        self.__dict__["_st"] = value


def test_an_abandon_during_a_settle_is_never_overwritten():
    """A settle's SETTLING -> APPLYING was made outside the job's lock: an abandon between its check and its
    store was overwritten, and the job ended DONE with the abandon's error set. Now either the abandon comes
    first (the settle's chunks are only counted: FAILED) or the settle does (the abandon is refused: DONE)."""
    job = _AbandonedAsItIsRead(SimpleNamespace(n_chunks=2), None, 2)
    job.settler = threading.current_thread()
    job._state = JobState.SETTLING  # claimed by a waiter, which now applies every chunk
    job.finish(2)
    assert job.abandoner is not None
    job.abandoner.join(10)
    assert not job.abandoner.is_alive() and job.done.is_set()
    assert job.state in (JobState.DONE, JobState.FAILED)
    assert (job.state is JobState.FAILED) == (job.error is not None), (job.state, job.error)
