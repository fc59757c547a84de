"""The shard indexes of batches pulled ahead are read ahead, together, not one batch's planning after another's.

Over a store, a batch of a sharded array waits a round trip for the indexes of shards it is the first to touch,
on the coordinator, before it can be planned; batches planned ahead (prefetch) then found their shards one
round trip after another (``stoker bench --store http --latency-ms 100``, scenario 2: a "plan" of 28 ms a
batch). The coordinator now starts the index reads of the batches it pulls (eight at once) as soon as their
arrays are open, and a batch's planning waits for those reads rather than asking again. Against the loopback
HTTP server, which holds every index read until all those expected have arrived: every index of the batches
pulled is asked at once, and each once; every batch equals zarr-python's; a read ahead that fails leaves the
batch to read its index itself; a corrupt index is the error of the batch that reads that shard, as without
reading ahead.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.errors import DecodeError, StorageError
from stoker.engine.pipeline import coordinator
from stoker.reader import array as array_module
from stoker.reader.array import NOT_CACHED, shard_entries, start_shard_entries

from range_server import RangeServer, _Handler
from store_fixtures import FAST_REMOTE

pytestmark = pytest.mark.timeout(180)

SHAPE = (64, 128)
SHARDS = (16, 32)  # a 4 x 4 grid of shards
GRID = (SHAPE[0] // SHARDS[0], SHAPE[1] // SHARDS[1])
#: how long the server holds an index read waiting for the others (the old planning, one batch's reads at a
#: time, never gathered them all: each then waited this long)
HOLD_S = 3.0


class _IndexHandler(_Handler):
    def _answer(self, body: bool) -> None:
        suffix = (self.headers.get("Range") or "").startswith("bytes=-")  # zarr's index at the shard's end
        if not suffix:
            super()._answer(body)
            return
        self.server.index_read(self.path, +1)
        with self.server.cond:
            held = self.server.hold > 0
            self.server.hold -= held
        if held:  # the first ``hold`` index reads wait for the test's ``gate``
            self.server.gate.wait(120)
        try:
            super()._answer(body)
        finally:
            self.server.index_read(self.path, -1)


class _IndexServer(RangeServer):
    """Counts the index reads (``indexes``: path -> reads) and the most in flight at once (``peak``); once
    ``expected`` is set, holds each until that many are in flight (or HOLD_S passed); the first ``hold`` index
    reads wait until ``gate`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.RequestHandlerClass = _IndexHandler
        self.indexes: collections.Counter = collections.Counter()
        self.index_in_flight = self.peak = 0
        self.expected = 0
        self.hold = 0
        self.gate = threading.Event()
        self.cond = threading.Condition()

    def index_read(self, path: str, delta: int) -> None:
        with self.cond:
            self.index_in_flight += delta
            if delta > 0:
                self.indexes[path] += 1
                self.peak = max(self.peak, self.index_in_flight)
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.index_in_flight >= self.expected, timeout=HOLD_S)


@pytest.fixture
def served(tmp_path):
    root = str(tmp_path / "data")
    arr = zarr.create_array(os.path.join(root, "s"), shape=SHAPE, chunks=(8, 16), shards=SHARDS, dtype="uint16",
                            compressors=ZstdCodec(level=1), fill_value=0)
    arr[...] = want = np.random.default_rng(4).integers(1, 60000, size=SHAPE).astype("uint16")
    server = _IndexServer(root)
    try:
        yield server, f"{server.url}/s", want, root
    finally:
        server.latency_s = 0
        server.gate.set()
        server.stop()


def _config(server: RangeServer, **kw) -> stoker.Config:
    return stoker.Config(**{"batch_size": 2, "dtype": "f32", "lossy_casts": True, "lookahead_batches": 1,
                            "pop_timeout_s": 90, "host_buffer_bytes": 16 << 20,
                            "storage_options": {server.url + "/": {**FAST_REMOTE, "timeout_s": 30.0}}, **kw})


def _box(shard: int) -> list[tuple[int, int]]:
    """A box inside shard number ``shard`` (C order over the grid), across two of its inner chunks."""
    y, x = divmod(shard, GRID[1])
    return [(y * SHARDS[0] + 4, y * SHARDS[0] + 12), (x * SHARDS[1] + 8, x * SHARDS[1] + 24)]


def _pop_all(p: stoker.Pipeline, boxes: list, want: np.ndarray, batch_size: int = 2) -> None:
    for k in range(0, len(boxes), batch_size):
        with p.pop() as b:
            got = torch.from_dlpack(b).numpy()
            for row, box in zip(got, boxes[k:k + batch_size]):
                assert np.array_equal(row, want[tuple(slice(a, z) for a, z in box)].astype(np.float32))


def test_the_indexes_of_batches_pulled_together_are_read_at_once_and_once(served):
    server, uri, want, _ = served
    server.latency_s = 0.02
    with stoker.Pipeline(_config(server)) as p:
        p.push([stoker.Sample(uri, _box(0))] * 2)  # opens the array and reads shard 0's index
        _pop_all(p, [_box(0)] * 2, want)
        # eight batches pulled at once, two shards each: shards 1..15 (and 1 again)
        boxes = [_box(1 + n % 15) for n in range(16)]
        server.expected = 15
        p.push([stoker.Sample(uri, box) for box in boxes])
        _pop_all(p, boxes, want)
    assert server.peak == 15, (server.peak, server.indexes)  # all together, not a batch's two at a time
    assert sorted(server.indexes.values()) == [1] * 16, server.indexes  # every shard's index read once


def test_a_read_ahead_that_fails_leaves_the_batch_to_read_its_index(served):
    server, uri, want, _ = served
    reader = stoker.open_array(uri, storage_options=FAST_REMOTE)
    keys = reader.shard_keys([1, 2])
    ran = []
    assert start_shard_entries([(reader, k) for k in keys], ran.append) == 2
    assert start_shard_entries([(reader, k) for k in keys], ran.append) == 0  # in flight already: not again
    server.fail(6)  # every try of the read ahead's two (retries=2): it fails
    ran[0]()
    assert reader.cached_shard_entries(keys) == [NOT_CACHED, NOT_CACHED]
    got = shard_entries([(reader, k) for k in keys])  # read here, the read ahead over
    assert all(not isinstance(e, Exception) and e is not None for e in got), got
    assert sorted(server.indexes.values()) == [4, 4], server.indexes  # three failed tries, then its own read
    box = _box(1)
    assert np.array_equal(reader.read(box), want[tuple(slice(a, z) for a, z in box)])


def test_a_planning_waits_for_the_read_ahead_rather_than_asking_again(served):
    server, uri, want, _ = served
    reader = stoker.open_array(uri, storage_options=FAST_REMOTE)
    keys = reader.shard_keys([3, 4, 5])
    server.expected = 3
    threads = []

    def run(fn) -> None:
        threads.append(threading.Thread(target=fn, daemon=True))
        threads[-1].start()

    assert start_shard_entries([(reader, k) for k in keys], run) == 3
    got = shard_entries([(reader, k) for k in keys])  # the read ahead's three, held till all three arrived
    for t in threads:
        t.join(30)
    assert all(not isinstance(e, Exception) and e is not None for e in got), got
    assert sorted(server.indexes.values()) == [1, 1, 1], server.indexes


def test_a_corrupt_index_is_the_error_of_the_batch_that_reads_its_shard(served):
    server, uri, want, root = served
    path = os.path.join(root, "s", "c", "1", "2")  # shard (1, 2): number 6
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")  # the index's checksum
    with stoker.Pipeline(_config(server)) as p:
        p.push([stoker.Sample(uri, _box(0))] * 2)
        _pop_all(p, [_box(0)] * 2, want)
        boxes = [_box(n) for n in (1, 2, 6, 6, 3, 4)]
        p.push([stoker.Sample(uri, box) for box in boxes])
        _pop_all(p, boxes[:2], want)
        with pytest.raises(DecodeError, match="c/1/2"):
            p.pop()


class _GatedHandler(_Handler):
    def _answer(self, body: bool) -> None:
        self.server.gate.wait(120)
        super()._answer(body)


def test_a_queued_read_ahead_is_read_by_its_planner_not_waited_for(served, monkeypatch):
    # a read ahead still queued (behind other work on its threads) is taken over by the planning that needs it
    # (before: it waited for the queued read, up to FLIGHT_WAIT_S); the queued job then skips it: each read once
    server, uri, want, _ = served
    monkeypatch.setattr(array_module, "FLIGHT_WAIT_S", 600.0)  # a wait for the queued job: the test's timeout
    reader = stoker.open_array(uri, storage_options=FAST_REMOTE)
    keys = reader.shard_keys([7, 8])
    queued = []
    assert start_shard_entries([(reader, k) for k in keys], queued.append) == 2
    got = shard_entries([(reader, k) for k in keys])  # the job never ran: read here
    assert all(not isinstance(e, Exception) and e is not None for e in got), got
    queued[0]()  # the job runs late: nothing left to read
    assert sorted(server.indexes.values()) == [1, 1], server.indexes
    assert reader._index_flights == {}
    box = _box(7)
    assert np.array_equal(reader.read(box), want[tuple(slice(a, z) for a, z in box)])


def test_a_batch_is_planned_while_the_openers_wait_on_a_slow_store(served, tmp_path, monkeypatch):
    # batch 0 reads shards of an open array of store A; the seven batches after it open seventy new arrays of
    # store B, whose requests are held: they take all 64 opener threads, and batch 0's read ahead queues behind
    # them. Batch 0 arrives while B's requests are still held (its planning reads its indexes), each index once.
    server, uri, want, _ = served
    monkeypatch.setattr(array_module, "FLIGHT_WAIT_S", 600.0)  # a wait for the queued job: pop's timeout
    root_b = str(tmp_path / "b")
    n_new = 70
    for i in range(n_new):
        zarr.create_array(os.path.join(root_b, f"x{i}"), shape=(8, 16), chunks=(8, 16), dtype="uint16",
                          fill_value=0)[...] = 3
    slow = RangeServer(root_b)
    slow.RequestHandlerClass = _GatedHandler
    slow.gate = threading.Event()
    slow.gate.set()
    try:
        cfg = _config(server, batch_size=10, pop_timeout_s=60,
                      storage_options={server.url + "/": {**FAST_REMOTE, "timeout_s": 30.0},
                                       slow.url + "/": {**FAST_REMOTE, "timeout_s": 120.0}})
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, _box(0))] * 10)
            _pop_all(p, [_box(0)] * 10, want, 10)
            server.indexes.clear()
            slow.gate.clear()  # from now on
            boxes = [_box(1 + k) for k in range(10)]
            p.push([stoker.Sample(uri, box) for box in boxes] +
                   [stoker.Sample(f"{slow.url}/x{i}", [(0, 8), (0, 16)]) for i in range(n_new)])
            with p.pop() as b:  # while store B's requests are held
                got = torch.from_dlpack(b).numpy()
                assert not slow.gate.is_set()
                for row, box in zip(got, boxes):
                    assert np.array_equal(row, want[tuple(slice(a, z) for a, z in box)].astype(np.float32))
            slow.gate.set()
            for _ in range(n_new // 10):
                with p.pop() as b:
                    assert (torch.from_dlpack(b).numpy() == 3).all()
        assert sorted(server.indexes.values()) == [1] * 10, server.indexes
    finally:
        slow.gate.set()
        slow.stop()


def test_a_forked_child_reads_an_index_its_parent_was_reading(served, monkeypatch):
    # the parent's read (another thread's, held by the server) is no read of the child's: the child reads the
    # index itself (and meets obstore's typed error of a forked child: its runtime does not survive a fork)
    # rather than waiting FLIGHT_WAIT_S for a thread it has not
    server, uri, want, _ = served
    monkeypatch.setattr(array_module, "FLIGHT_WAIT_S", 600.0)
    reader = stoker.open_array(uri, storage_options=FAST_REMOTE)
    key = reader.shard_keys([9])[0]
    server.hold = 1
    reading = threading.Thread(target=shard_entries, args=([(reader, key)],), daemon=True)
    reading.start()
    with server.cond:
        assert server.cond.wait_for(lambda: server.indexes, timeout=60)  # the parent's read is at the server
    assert key in reader._index_flights
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when it read the index
        code = 1
        try:
            got = shard_entries([(reader, key)])
            read = got[0] is not None and not isinstance(got[0], Exception)
            code = 0 if read or (isinstance(got[0], StorageError) and "forked" in str(got[0])) else 2
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 120  # (a child waiting for the parent's flight would wait 600 s)
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited for its parent's read of the index")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert not server.gate.is_set()  # the parent's read still held: the child read the index itself
    finally:
        server.gate.set()
        reading.join(30)
    assert list(server.indexes.values()) == [1], server.indexes  # the parent's read, after the child's end


def test_reads_ahead_keep_to_half_the_index_cache(served, monkeypatch):
    # an index cache of eight indexes, eight batches of four shards pulled at once: reading all thirty-two
    # ahead evicted the first batches' before their planning, which read them again (60 reads); reads ahead now
    # reserve at most half the cache, the rest read by their batches: every index read once
    server, _, _, root = served
    monkeypatch.setattr(coordinator, "DEFAULT_INDEX_CACHE_BYTES", 8 * (16 * 4 + 64))
    shape = (128, 256)
    arr = zarr.create_array(os.path.join(root, "t"), shape=shape, chunks=(8, 16), shards=SHARDS, dtype="uint16",
                            compressors=ZstdCodec(level=1), fill_value=0)
    arr[...] = want = np.random.default_rng(5).integers(1, 60000, size=shape).astype("uint16")
    server.latency_s = 0.02

    def box(shard: int) -> list[tuple[int, int]]:
        y, x = divmod(shard, 8)
        return [(y * 16 + 4, y * 16 + 12), (x * 32 + 8, x * 32 + 24)]

    with stoker.Pipeline(_config(server, batch_size=4)) as p:
        p.push([stoker.Sample(f"{server.url}/t", box(0))] * 4)
        _pop_all(p, [box(0)] * 4, want, 4)
        server.indexes.clear()
        boxes = [box(s) for s in range(1, 33)]
        p.push([stoker.Sample(f"{server.url}/t", b) for b in boxes])
        _pop_all(p, boxes, want, 4)
    assert sorted(server.indexes.values()) == [1] * 32, server.indexes



def test_planning_splits_its_cpu_from_its_waits_and_openers_follow_n_io_threads(served):
    # ``plan`` is the coordinator's CPU planning, ``plan_wait`` what it waited (here its arrays' opens and shard
    # indexes, each a round trip); the opener threads are sixteen per I/O thread (the knob their error names)
    server, _, _, root = served
    for i in range(24):
        zarr.create_array(os.path.join(root, f"n{i}"), shape=(8, 16), chunks=(8, 16), dtype="uint16",
                          fill_value=0)[...] = i
    server.latency_s = 0.05
    start = time.perf_counter()
    with stoker.Pipeline(_config(server, batch_size=4, n_io_threads=1)) as p:
        p.push([stoker.Sample(f"{server.url}/n{i}", [(0, 8), (0, 16)]) for i in range(24)])
        for k in range(6):
            with p.pop() as b:
                got = torch.from_dlpack(b).numpy()
                assert [int(row[0, 0]) for row in got] == list(range(4 * k, 4 * k + 4))
        openers = p._coordinator._openers  # (this pipeline's: other tests' may linger a moment)
        stages = p.stats().stages
    wall = time.perf_counter() - start
    assert openers.max_threads == 16 and 0 < len(openers._threads) <= 16, openers._threads
    assert 0 < stages["plan"].seconds <= wall
    assert stages["plan_wait"].seconds > 0
