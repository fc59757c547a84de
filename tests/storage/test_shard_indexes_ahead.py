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
import threading

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.errors import DecodeError
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
        try:
            super()._answer(body)
        finally:
            self.server.index_read(self.path, -1)


class _IndexServer(RangeServer):
    """Counts the index reads (``indexes``: path -> reads) and the most in flight at once (``peak``); once
    ``expected`` is set, holds each until that many are in flight (or HOLD_S passed)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.RequestHandlerClass = _IndexHandler
        self.indexes: collections.Counter = collections.Counter()
        self.index_in_flight = self.peak = 0
        self.expected = 0
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
        server.stop()


def _config(server: RangeServer, **kw) -> stoker.Config:
    return stoker.Config(**{"batch_size": 2, "dtype": "f32", "lossy_casts": True, "lookahead_batches": 1,
                            "pop_timeout_s": 90, "host_buffer_bytes": 16 << 20,
                            "storage_options": {server.url + "/": {**FAST_REMOTE, "timeout_s": 30.0}}, **kw})


def _box(shard: int) -> list[tuple[int, int]]:
    """A box inside shard number ``shard`` (C order over the grid), across two of its inner chunks."""
    y, x = divmod(shard, GRID[1])
    return [(y * SHARDS[0] + 4, y * SHARDS[0] + 12), (x * SHARDS[1] + 8, x * SHARDS[1] + 24)]


def _pop_all(p: stoker.Pipeline, boxes: list, want: np.ndarray) -> None:
    for k in range(0, len(boxes), 2):
        with p.pop() as b:
            got = torch.from_dlpack(b).numpy()
            for row, box in zip(got, boxes[k:k + 2]):
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
