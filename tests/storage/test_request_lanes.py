"""What a call's requests cost the event loop thread every ObjectStore shares: a call of many requests runs
them in at most ``max_in_flight`` lanes (tasks), not a task per request queued on a semaphore, and keeps
its bounds (``max_in_flight`` at once, ``queue_timeout_s`` naming the key that never started). Against the
loopback HTTP server of the store tests (tests/range_server.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time

import pytest

import stoker
from stoker.errors import NotFound, ShutdownError, StorageError
from stoker.storage import ByteRange, ObjectStore
from stoker.storage.objectstore import _Loop

from range_server import RangeServer

N_KEYS = 48
LANES = 6


@pytest.fixture
def server(tmp_path):
    os.makedirs(tmp_path / "c")
    for i in range(N_KEYS):
        with open(tmp_path / "c" / str(i), "wb") as f:
            f.write(bytes([i]) * (100 + i))
    srv = RangeServer(str(tmp_path))
    yield srv
    srv.stop()


def _on_the_loop(loop, call) -> None:
    """``call()`` run on ``loop``'s thread (the shared event loop's), waited for (10 s at most)."""
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (call(), done.set()))
    assert done.wait(10)


class _TaskCount:
    """Tasks created on the shared event loop while the block runs (its task factory, swapped in and back)."""

    def __enter__(self) -> "_TaskCount":
        self.loop = _Loop.get().loop
        self.n = 0

        def factory(loop, coro, **kw):
            self.n += 1
            return asyncio.Task(coro, loop=loop, **kw)

        self._set(factory)
        return self

    def _set(self, factory) -> None:
        _on_the_loop(self.loop, lambda: self.loop.set_task_factory(factory))

    def __exit__(self, *exc) -> None:
        self._set(None)


@pytest.mark.timeout(60)
def test_a_batch_of_heads_takes_a_task_per_lane_not_per_key(server):
    s = ObjectStore(server.url, max_in_flight=LANES)
    keys = [f"c/{i}" for i in range(N_KEYS)]
    s.versions(keys[:2])  # the loop and connections up
    server.latency_s = 0.02
    with _TaskCount() as tasks:
        got = s.versions(keys)
    assert [v[0] for v in got] == [100 + i for i in range(N_KEYS)]  # each key's own size, in its place
    assert server.peak_in_flight <= LANES
    # the call's own task (run_coroutine_threadsafe) and one per lane; before: one per key and, for each key
    # that waited for a slot, one more (asyncio.wait_for)
    assert tasks.n <= LANES + 1, tasks.n
    s.close()


@pytest.mark.timeout(60)
def test_a_get_many_of_values_and_ranges_takes_a_task_per_lane(server):
    s = ObjectStore(server.url, max_in_flight=LANES, max_gap=0)
    keys = [f"c/{i}" for i in range(N_KEYS // 2)]
    ranges = [ByteRange(f"c/{i}", 10, 20) for i in range(N_KEYS // 2, N_KEYS)]
    s.get_many(keys[:1], [])
    server.latency_s = 0.02
    with _TaskCount() as tasks:
        values, parts = s.get_many(keys, ranges)
    assert [bytes(v) for v in values] == [bytes([i]) * (100 + i) for i in range(N_KEYS // 2)]
    assert [bytes(p) for p in parts] == [bytes([i]) * 20 for i in range(N_KEYS // 2, N_KEYS)]
    assert server.peak_in_flight <= LANES and tasks.n <= LANES + 1, tasks.n
    with _TaskCount() as tasks:
        got = s.get_each(ranges)
    assert [bytes(p) for p in got] == [bytes([i]) * 20 for i in range(N_KEYS // 2, N_KEYS)]
    assert tasks.n <= LANES + 1, tasks.n
    s.close()


@pytest.mark.timeout(60)
def test_heads_that_never_got_a_slot_name_their_key_in_place(server):
    s = ObjectStore(server.url, max_in_flight=1, timeout_s=20.0, queue_timeout_s=0.2, retries=0)
    server.latency_s = 1.0  # the first HEAD holds the call's only slot past queue_timeout_s
    got = s.versions(["c/0", "c/1", "c/2"])
    assert got[0] == s.versions(["c/0"])[0] and got[0][0] == 100
    for key, outcome in zip(["c/1", "c/2"], got[1:]):
        assert isinstance(outcome, StorageError) and outcome.key == key, outcome
        assert "free request slot" in str(outcome) and "max_in_flight=1" in str(outcome)
        assert outcome.attempts == 0 and outcome.waited_s >= 0.2
    assert server.requests == 2  # c/1 and c/2 never went out (and c/0 was asked again)
    s.close()


class _LoopCalls:
    """Python function calls made on the shared event loop thread while the block runs (``sys.setprofile``
    there; a coroutine's resumption counts as a call too): ``n`` all of them, ``own`` those in stoker's code.
    asyncio's own share depends on how many loop iterations the answers take (one wake-up each, or several
    answers to one on a loaded machine), so only stoker's share is steady."""

    def __enter__(self) -> "_LoopCalls":
        self.loop = _Loop.get().loop
        self.n = 0
        self.own = 0
        ours = os.path.dirname(stoker.__file__) + os.sep

        def profile(frame, event, arg):
            if event == "call":
                self.n += 1
                self.own += frame.f_code.co_filename.startswith(ours)

        self._set(profile)
        return self

    def _set(self, profile) -> None:
        import sys

        _on_the_loop(self.loop, lambda: sys.setprofile(profile))

    def __exit__(self, *exc) -> None:
        self._set(None)


@pytest.mark.timeout(60)
def test_a_burst_of_heads_costs_the_loop_one_task_and_few_python_calls_each(server):
    # a revalidation burst is tens of HEADs a batch: as lanes each took a task step, five coroutines, a slot
    # object and a per-try timer (and a task per lane); now the call's own task takes the answers as they land
    s = ObjectStore(server.url, max_in_flight=LANES)
    keys = [f"c/{i}" for i in range(N_KEYS)]
    s.versions(keys[:2])
    server.latency_s = 0.02
    with _TaskCount() as tasks, _LoopCalls() as calls:
        got = s.versions(keys)
    assert [v[0] for v in got] == [100 + i for i in range(N_KEYS)]
    assert server.peak_in_flight <= LANES
    assert tasks.n == 1, tasks.n  # the call's own (run_coroutine_threadsafe), none per lane or key
    # stoker's own calls on the loop: 8-9 a HEAD (settle, landing, version, etag and take, and the lane's
    # coroutines resumed once per wake-up); 21.5 in the lanes' design (five coroutines, a slot, a timer).
    # asyncio's calls on top (44-54 a HEAD in all, 75 before) vary with how answers share wake-ups
    assert calls.own / N_KEYS <= 12, calls.own / N_KEYS
    s.close()


@pytest.mark.timeout(60)
def test_heads_retry_what_may_pass_and_name_what_does_not(server):
    s = ObjectStore(server.url, max_in_flight=LANES, backoff_s=0.01, max_backoff_s=0.05)
    keys = [f"c/{i}" for i in range(12)]
    want = s.versions(keys)
    before = server.requests
    server.fail(3, 503)
    assert s.versions(keys) == want  # three answers failed and were asked again
    assert server.requests - before == len(keys) + 3
    once = ObjectStore(server.url, max_in_flight=1, retries=0)
    server.fail(1, 503)
    got = once.versions(["c/0", "c/1", "nothing/here"])
    assert isinstance(got[0], StorageError) and got[0].key == "c/0" and got[0].status == 503
    assert got[0].attempts == 1 and "revalidation of key 'c/0'" in str(got[0])
    assert got[1] == want[1]
    assert isinstance(got[2], NotFound) and got[2].key == "nothing/here"
    s.close()
    once.close()


@pytest.mark.timeout(60)
def test_a_head_past_its_try_limit_is_cancelled_and_tried_again(server):
    import obstore

    from stoker.storage.objectstore import _Heads

    s = ObjectStore(server.url, max_in_flight=2, timeout_s=0.1, connect_timeout_s=0.1, backoff_s=0.01)
    hung: list = []

    def head(store, key):  # each key's first try never answers (a request obstore's own limit missed)
        if not any(k == key for k, _ in hung):
            hung.append((key, asyncio.get_running_loop().create_future()))
            return hung[-1][1]
        return obstore.head_async(store, key)

    keys = ["c/0", "c/1", "c/2"]
    got = s._run(_Heads(s, keys, head).run())
    assert [v[0] for v in got] == [100, 101, 102]
    assert [k for k, _ in hung] == keys and all(f.cancelled() for _, f in hung)
    s.close()


@pytest.mark.timeout(60)
def test_heads_cut_short_by_a_close_give_their_shared_slots_back(server):
    gate = asyncio.Semaphore(3)
    a = ObjectStore(server.url, max_in_flight=4, gate=gate)
    b = ObjectStore(server.url, max_in_flight=4, gate=gate, queue_timeout_s=5.0)
    server.latency_s = 1.0
    flight = a.start_versions([f"c/{i}" for i in range(8)])
    time.sleep(0.3)
    a.close()
    with pytest.raises(ShutdownError):
        a.result_of(concurrent.futures.wait([flight], 10) and flight)
    server.latency_s = 0.0
    got = b.versions([f"c/{i}" for i in range(6)])  # the gate's three slots all came back
    assert [v[0] for v in got] == [100 + i for i in range(6)]
    b.close()


@pytest.mark.timeout(60)
def test_a_hung_head_times_out_while_the_call_waits_for_a_gate_slot(server, monkeypatch):
    # one shared gate slot, c/0's first try never answers (obstore's own limit missed: what the per-try timer
    # is for). The call waits for a slot to start c/1 while c/0 holds it: c/0's try must time out meanwhile,
    # give the slot to c/1, and be tried again; both answer well inside queue_timeout_s.
    import obstore

    gate = asyncio.Semaphore(1)
    s = ObjectStore(server.url, max_in_flight=2, timeout_s=0.1, connect_timeout_s=0.1, backoff_s=0.01,
                    queue_timeout_s=4.0, gate=gate)
    real = obstore.head_async
    hung: list = []

    def head(store, key):
        if key == "c/0" and not hung:
            hung.append(asyncio.get_running_loop().create_future())
            return hung[0]
        return real(store, key)

    monkeypatch.setattr(obstore, "head_async", head)
    t0 = time.monotonic()
    got = s.versions(["c/0", "c/1"])
    took = time.monotonic() - t0
    s.close()
    assert [v[0] for v in got] == [100, 101], got
    assert hung[0].cancelled() and took < 3.5
