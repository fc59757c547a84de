"""The bench's peak RSS (``bench.rss.RssSampler``) comes from the kernel's high-water mark, set back at the
block's start: an allocation that lives a moment is caught, a peak from before the block is not, samplers
nest, and no thread wakes (nor takes the GIL from the peer measured) while the block runs. Before, a thread
read /proc/self/statm every 2 ms: most of ``--thread-cpu``'s "other" CPU."""

from __future__ import annotations

import contextlib
import gc
import mmap
import sys
import threading
import time

import numpy as np
import pytest

from stoker.bench import rss
from stoker.bench.runner import RssSampler

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's mark: Linux /proc")]

MB = 1 << 20


@contextlib.contextmanager
def _no_collections():
    """No garbage collection while the block runs (one started by its allocations frees what earlier tests of
    this process left, and the resident size falls while the block measures it), after one now."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _touch(nbytes: int) -> None:
    """Make ``nbytes`` resident a moment (every page written), then unmap them. A mapping of its own, not
    malloc's: after some other test of the process (or a library it loaded) changed malloc's settings, a large
    block came from heap pages already resident, the resident size never rose, and both tests below failed in
    a full suite's worker (its peak 4 KiB over its base)."""
    with mmap.mmap(-1, nbytes) as block:
        view = np.frombuffer(block, np.uint8)
        view.fill(1)
        del view


def test_a_moments_allocation_is_the_peak_and_an_earlier_one_is_not():
    with _no_collections():
        _touch(300 * MB)  # before the block: not its peak
        with RssSampler() as sampler:
            base = rss.rss_bytes()
            _touch(120 * MB)
    assert base + 110 * MB <= sampler.peak < base + 250 * MB


def test_samplers_nest():
    # each bound is from the resident size just before its own allocation: a long test run's process may give
    # pages back meanwhile (CI once saw it 70 MB smaller at the inner block's start than at the outer's)
    with _no_collections(), RssSampler() as outer:
        base = rss.rss_bytes()
        _touch(150 * MB)  # before the inner one set the mark back: still the outer's peak
        with RssSampler() as inner:
            inner_base = rss.rss_bytes()
            _touch(60 * MB)
        _touch(20 * MB)
    assert base + 140 * MB <= outer.peak
    assert inner_base + 50 * MB <= inner.peak < inner_base + 140 * MB


def test_no_thread_wakes_while_the_block_runs():
    # no thread of the process's starts for the block (the old sampler's thread woke 250 times a second, each
    # time taking the GIL from the peer measured), and what the block costs is its start and end, on the calling
    # thread: before, the process's CPU over the block was compared with an idle window's, which another thread
    # of a long test process (pytest-xdist's worker, a test's lingering pool) could wake in (CI saw 3.2 ms)
    before = set(threading.enumerate())
    cpu = time.thread_time()
    with RssSampler():
        started = set(threading.enumerate()) - before
        time.sleep(0.2)
    cpu = time.thread_time() - cpu
    assert not started, f"the block started {sorted(t.name for t in started)}"
    assert cpu < 0.003, f"{cpu * 1e3:.1f} ms of the calling thread's CPU for a block that slept"


def test_where_the_mark_cannot_be_set_back_a_thread_samples(monkeypatch):
    # the fallback (no clear_refs): a thread samples the resident size, so the check above can fail
    monkeypatch.setattr(rss, "_set_back_high_water", lambda: False)
    before = set(threading.enumerate())
    with RssSampler() as sampler:
        started = set(threading.enumerate()) - before
        _touch(60 * MB)
        time.sleep(0.05)
    assert [t.name for t in started] == ["stoker-bench-rss"]
    assert sampler.peak > 0
