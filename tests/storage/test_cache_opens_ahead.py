"""Batches planned ahead over S3 with latency are not held back by the opens of later batches' arrays.

A second epoch reads from the disk cache, but each array it opens is revalidated first (a listing, one round
trip on the pipeline's opener threads). The coordinator plans batches ahead of their slots; when the next
batch to plan reads an array still being opened, the batches already planned must still take the slots
the consumer gives back, not wait behind that open (scenario 6 of ``stoker bench --store s3 --epochs 2``
lost about a batch's time at each such wait).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.bench.serve import BUCKET, BenchServer
from stoker.storage.diskcache import disk_cache

pytestmark = pytest.mark.timeout(180)

LATENCY_S = 0.05
#: what the listings of arrays 1..4 take more (opens that outlast the batches planned before them)
SLOW_LIST_S = 1.5
#: batches of one sample: five on array 0, then one on each of arrays 1..4 (opened while 0..4 are made)
ORDER = [0, 0, 0, 0, 0, 1, 2, 3, 4]


class _SlowLists(BenchServer):
    """The bench's S3 server on loopback, its listings of arrays 1..4 slower by SLOW_LIST_S."""

    async def _list(self, path, query, body, writer) -> None:
        if query.get("prefix", [""])[0].split("/")[0] in {f"a{i}" for i in ORDER if i}:
            await asyncio.sleep(SLOW_LIST_S)
        await super()._list(path, query, body, writer)


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "data"
    rng = np.random.default_rng(3)
    for i in range(max(ORDER) + 1):
        arr = zarr.create_array(str(root / f"a{i}"), shape=(8, 16), chunks=(8, 8), dtype="uint16")
        arr[...] = rng.integers(0, 60000, size=(8, 16)).astype("uint16")
    server = _SlowLists(str(root), LATENCY_S, s3=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield str(root), f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def _epoch(cfg: stoker.Config, root: str, wait_s: float = 0.0, split_s: float | None = None) -> list[float]:
    """Every batch of ORDER popped (the first ``wait_s`` after the push), each equal to zarr-python's; when
    each pop returned (monotonic). ``split_s``: array 0's batches pushed first, the others that long after
    (within ``wait_s``)."""
    popped = []
    with stoker.Pipeline(cfg) as p:
        samples = [stoker.Sample(f"s3://{BUCKET}/a{i}", ((0, 8), (4, 12))) for i in ORDER]
        if split_s is None:
            p.push(samples)
        else:
            p.push(samples[:ORDER.count(0)])
            time.sleep(split_s)
            p.push(samples[ORDER.count(0):])
            wait_s -= split_s
        time.sleep(wait_s)
        for i in ORDER:
            with p.pop() as b:
                popped.append(time.monotonic())
                want = zarr.open_array(os.path.join(root, f"a{i}"), mode="r")[:, 4:12]
                np.testing.assert_array_equal(torch.from_dlpack(b).numpy()[0], want)
    assert disk_cache(str(cfg.cache_dir), 64 << 20).flush(30)
    return popped


@pytest.mark.parametrize("split_s", [None, 0.3], ids=["one-push", "later-push"])
def test_planned_batches_take_free_slots_while_later_arrays_open(served, tmp_path, split_s):
    # later-push: the batches over arrays 1..4 come in a second push, once the first ran dry, so the
    # coordinator pulls the first of them in the round that would launch it (nothing pulled ahead)
    root, url = served
    options = {f"s3://{BUCKET}/": {"endpoint": url, "region": "us-east-1", "skip_signature": True,
                                   "allow_http": True, "timeout_s": 30.0}}
    cfg = stoker.Config(batch_size=1, dtype="native", n_compute_threads=1, lookahead_batches=1, pop_timeout_s=60,
                        storage_options=options, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
    _epoch(cfg, root)
    # the second epoch: array 0 is open after a few round trips, batches 0 and 1 are made in the two slots,
    # 2..4 planned behind them, and arrays 1..4 are still being listed when the consumer starts
    popped = _epoch(cfg, root, wait_s=SLOW_LIST_S / 3, split_s=split_s)
    # once the consumer gives slots back, batches 2..4 come as fast as they are made (before: they waited
    # for the coordinator's wait for array 1's open to end, the rest of its slow listing)
    late = popped[4] - popped[0]
    assert late < SLOW_LIST_S / 3, [round(t - popped[0], 3) for t in popped]
