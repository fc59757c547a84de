"""DaemonPool at shutdown: queued tasks dropped, or drained (run) when the owner asks, and never new ones."""

from __future__ import annotations

import threading

import pytest

from stoker.errors import ShutdownError
from stoker.runtime.workers import DaemonPool

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("drain", [False, True])
def test_queued_tasks_are_dropped_or_drained_at_shutdown(drain):
    # A decoder's queued task may be the only one to account for a batch's chunks (a fetch handed over just
    # before close): drained, it runs and ends them; dropped, the batch was never finished.
    pool = DaemonPool(1, "t")
    started, release = threading.Event(), threading.Event()
    ran, done = [], threading.Event()
    pool.submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(5)
    for i in range(3):
        pool.submit(lambda i=i: (ran.append(i), i == 2 and done.set()))
    pool.shutdown(drain=drain)
    with pytest.raises(ShutdownError):
        pool.submit(print)
    release.set()
    if drain:
        assert done.wait(5) and ran == [0, 1, 2]
    else:
        pool.threads[0].join(5)
        assert ran == []
    pool.threads[0].join(5)
    assert not pool.threads[0].is_alive()  # the thread leaves once nothing is left


def test_idle_threads_leave_and_the_pool_starts_them_again(monkeypatch):
    # a pipeline that opened hundreds of remote arrays had dozens of opener threads idle for the rest of the run
    from stoker.runtime import workers

    monkeypatch.setattr(workers, "IDLE_RETIRE_S", 0.2)
    pool = DaemonPool(3, "t")
    release, started = threading.Event(), threading.Semaphore(0)
    for _ in range(3):
        pool.submit(lambda: (started.release(), release.wait(10)))
    for _ in range(3):
        assert started.acquire(timeout=5)
    first = pool.threads
    assert sorted(t.name for t in first) == ["t_0", "t_1", "t_2"]
    release.set()
    for t in first:
        t.join(5)
        assert not t.is_alive(), t.name  # idle past IDLE_RETIRE_S: left
    ran = threading.Event()
    pool.submit(ran.set)  # work again: a thread started for it, under a name no live thread has
    assert ran.wait(5)
    assert [t.name for t in pool.threads] == ["t_0"] and pool.threads[0] not in first
    monkeypatch.setattr(workers, "IDLE_RETIRE_S", 30.0)
    busy = threading.Event()
    for _ in range(5):  # never more than max_threads at once, however many left before
        pool.submit(busy.wait, 10)
    assert len([t for t in pool.threads if t.is_alive()]) <= 3
    busy.set()
    pool.shutdown()
    for t in pool.threads:
        t.join(5)
        assert not t.is_alive()


@pytest.mark.parametrize("first_starts", [True, False])
def test_a_thread_another_submit_is_starting_is_kept(monkeypatch, first_starts):
    # submit makes its thread under the pool's lock and starts it after: a second submit meanwhile, pruning the
    # threads that left idle, took the one not yet started for one of them: its name was given again, and
    # its failed start (the system gives no more threads) raised ValueError and left it counted as live
    from stoker.runtime import workers

    real_start = workers.start_thread
    in_start, go_on = threading.Event(), threading.Event()

    def start(thread, knob, owner="Config"):
        if thread.name == "t_0":
            in_start.set()
            assert go_on.wait(10)
            if not first_starts:
                raise workers.no_thread(thread.name, knob, RuntimeError("can't start new thread"), owner)
        real_start(thread, knob, owner)

    monkeypatch.setattr(workers, "start_thread", start)
    pool = DaemonPool(2, "t")
    release, ran, raised = threading.Event(), [], []

    def first() -> None:
        try:
            pool.submit(lambda: (ran.append("first"), release.wait(10)))
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            raised.append(exc)

    submitter = threading.Thread(target=first)
    submitter.start()
    assert in_start.wait(10)
    pool.submit(lambda: (ran.append("second"), release.wait(10)))
    go_on.set()
    submitter.join(10)
    assert raised == []  # a failed start with a thread left running is no error: that thread takes the task
    names = sorted(t.name for t in pool.threads)
    assert names == (["t_0", "t_1"] if first_starts else ["t_1"])
    assert pool._state.live == len(names)
    release.set()
    pool.shutdown(drain=True)
    for t in pool.threads:
        t.join(5)
        assert not t.is_alive()
    assert sorted(ran) == ["first", "second"]
