"""Many arrays cached before, opened at once over S3 with latency: their listings go out together.

A pipeline that opens more arrays at once than it has opener threads asks the disk cache listings of those
that wait first (``Stores.opening``, on an opener thread), so the opens overlap in one round trip instead of
one round trip per sixty-four (the opener threads).
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

N_ARRAYS = 72  # more than the coordinator's 64 opener threads
#: the longest a listing is held for the others (only a regression, opens one round after another, waits it out)
HOLD_S = 10.0


class _Gathering(BenchServer):
    """The bench's S3 server on loopback, noting each request's target (``targets``); after :meth:`gather`,
    each listing is held until ``n`` listings are open at once (or ``HOLD_S`` passed), and ``peak`` is the most
    that were: a count of what overlapped rather than a timing, which a loaded machine stretches."""

    def __init__(self, root: str) -> None:
        super().__init__(root, 0.0, s3=True)
        self.targets: list[str] = []
        self.open = self.peak = 0
        self._wanted: int | None = None

    def gather(self, n: int) -> None:
        """From now on hold each listing until ``n`` are open at once; ``peak`` counts from zero again."""
        self.targets.clear()
        self.peak, self._wanted = 0, n

    async def _request(self, method: str, target: str, headers: dict, writer) -> None:
        # (on the server's event loop thread: no lock for the counts)
        self.targets.append(target)
        if self._wanted is None or "list-type=2" not in target:
            return await super()._request(method, target, headers, writer)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            deadline = time.monotonic() + HOLD_S
            while self.peak < self._wanted and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await super()._request(method, target, headers, writer)
        finally:
            self.open -= 1


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "data"
    rng = np.random.default_rng(7)
    for i in range(N_ARRAYS):
        arr = zarr.create_array(str(root / f"a{i:02d}"), shape=(8, 16), chunks=(8, 8), dtype="uint16")
        arr[...] = rng.integers(0, 60000, size=(8, 16)).astype("uint16")
    server = _Gathering(str(root))
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


def _epoch(cfg: stoker.Config, root: str, opening=None) -> None:
    """One batch of a crop of each array, each equal to zarr-python's; ``opening(uri)`` told of each
    ``Stores.opening`` of the pipeline's own stores (an instance's attribute: no other pipeline's is touched)."""
    with stoker.Pipeline(cfg) as p:
        if opening is not None:
            stores = p._coordinator.stores
            real = stores.opening
            stores.opening = lambda uri, *a, **kw: opening(uri) or real(uri, *a, **kw)
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
    server.gather(N_ARRAYS)
    _epoch(cfg, root)
    # from the disk cache: a listing per array (its zarr.json and chunk revalidated by it) and the group
    # documents above them; every listing asked before any open waits, so all of them are open at the server
    # at once (before: sixty-four opens at a time, each round a round trip after the one before: at most 64)
    listings = [t for t in server.targets if "list-type=2" in t]
    assert N_ARRAYS <= len(server.targets) <= N_ARRAYS + 3, server.targets
    assert len(listings) == N_ARRAYS, server.targets
    assert server.peak == N_ARRAYS, server.peak


def test_the_coordinator_asks_no_listing_of_a_burst_of_opens_itself(served, tmp_path):
    # the listings of the arrays that wait for an opener thread are asked on an opener thread, not on the
    # coordinator before any open is handed out (before: a Stores.opening call an array, each a store look-up,
    # a disk look-up and a request started, held up the coordinator's planning and the first opens); they
    # still go out together, and every value equals zarr-python's
    root, url, server = served
    cfg = _cached_config(url, tmp_path / "cache")
    _epoch(cfg, root)
    callers: list[str] = []
    server.gather(N_ARRAYS)
    _epoch(cfg, root, opening=lambda uri: callers.append(threading.current_thread().name))
    assert callers and not [name for name in callers if name == "stoker-coordinator"], callers
    assert server.peak == N_ARRAYS, server.peak
