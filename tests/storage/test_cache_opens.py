"""Many arrays cached before, opened at once over S3 with latency: their listings go out together.

A pipeline that opens more arrays at once than it has opener threads asks the disk cache listings of those
that wait first (``Stores.opening``, on an opener thread), so the opens overlap in one round trip instead of
one round trip per sixty-four (the opener threads).
"""

from __future__ import annotations

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
from stoker.storage.locate import Stores

pytestmark = pytest.mark.timeout(180)

N_ARRAYS = 72  # more than the coordinator's 64 opener threads
LATENCY_S = 0.3


class _Timed(BenchServer):
    """The bench's S3 server on loopback, noting when each request came (``arrivals``, monotonic)."""

    def __init__(self, root: str, latency_s: float) -> None:
        super().__init__(root, latency_s, s3=True)
        self.arrivals: list[float] = []

    def count(self, nbytes: int, request: bool = True) -> None:
        if request:
            self.arrivals.append(time.monotonic())
        super().count(nbytes, request)


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "data"
    rng = np.random.default_rng(7)
    for i in range(N_ARRAYS):
        arr = zarr.create_array(str(root / f"a{i:02d}"), shape=(8, 16), chunks=(8, 8), dtype="uint16")
        arr[...] = rng.integers(0, 60000, size=(8, 16)).astype("uint16")
    server = _Timed(str(root), LATENCY_S)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield str(root), f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def _cached_config(url: str, cache_dir) -> stoker.Config:
    """A batch of a crop of every array of the bucket served at ``url``, read through a disk cache at
    ``cache_dir``."""
    options = {f"s3://{BUCKET}/": {"endpoint": url, "region": "us-east-1", "skip_signature": True,
                                   "allow_http": True, "timeout_s": 30.0}}
    return stoker.Config(batch_size=N_ARRAYS, dtype="native", n_compute_threads=1, pop_timeout_s=60,
                         storage_options=options, cache_dir=str(cache_dir), cache_bytes=64 << 20)


def _epoch(cfg: stoker.Config, root: str) -> None:
    """One batch of a crop of each array, each equal to zarr-python's."""
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"s3://{BUCKET}/a{i:02d}", ((0, 8), (4, 12))) for i in range(N_ARRAYS)])
        b = p.pop()
        got = torch.from_dlpack(b).numpy()
        for i in range(N_ARRAYS):
            np.testing.assert_array_equal(got[i], zarr.open_array(os.path.join(root, f"a{i:02d}"), mode="r")[:, 4:12])
        b.release()
    assert disk_cache(str(cfg.cache_dir), 64 << 20).flush(30)


def test_cached_arrays_opened_together_are_listed_in_one_round_trip(served, tmp_path):
    root, url, server = served
    cfg = _cached_config(url, tmp_path / "cache")
    _epoch(cfg, root)
    server.arrivals.clear()
    _epoch(cfg, root)
    # from the disk cache: a listing per array (its zarr.json and chunk revalidated by it) and the group
    # documents above them; every listing asked before any open waits (before: sixty-four opens at a time,
    # each round a round trip after the one before)
    arrivals = sorted(server.arrivals)
    assert N_ARRAYS <= len(arrivals) <= N_ARRAYS + 3, len(arrivals)
    together = sum(t - arrivals[0] < LATENCY_S / 2 for t in arrivals)
    assert together >= N_ARRAYS, [round(t - arrivals[0], 3) for t in arrivals]


def test_the_coordinator_asks_no_listing_of_a_burst_of_opens_itself(served, tmp_path, monkeypatch):
    # the listings of the arrays that wait for an opener thread are asked on an opener thread, not on the
    # coordinator before any open is handed out (before: a Stores.opening call an array, each a store look-up,
    # a disk look-up and a request started, held up the coordinator's planning and the first opens); they
    # still go out together, and every value equals zarr-python's
    root, url, server = served
    cfg = _cached_config(url, tmp_path / "cache")
    _epoch(cfg, root)
    callers: list[str] = []
    real = Stores.opening
    monkeypatch.setattr(Stores, "opening", lambda self, *a, **kw: callers.append(
        threading.current_thread().name) or real(self, *a, **kw))
    server.arrivals.clear()
    _epoch(cfg, root)
    assert callers and not [name for name in callers if name == "stoker-coordinator"], callers
    arrivals = sorted(server.arrivals)
    assert sum(t - arrivals[0] < LATENCY_S / 2 for t in arrivals) >= N_ARRAYS
