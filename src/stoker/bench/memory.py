"""Stoker's memory, measured alone in a fresh process (``python -m stoker.bench.memory``).

Peers running in the same process leave allocator state behind, so the benchmark
measures stoker's peak RSS in a child process that imports only what stoker
needs and replays the same seeded crops. The arrays of the first batch are evicted
from the page cache first, so its latency is that of a cold start (fresh process,
data on disk). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys


def measure(paths: list[str], shape: list[int], crop: list[int], grid: bool, seed: int, n_batches: int,
            batch_size: int, host_buffer_bytes: int) -> dict:
    from .datasets import evict_page_cache
    from .runner import RssSampler, make_samples, rss_bytes, run_stoker

    samples = make_samples(paths, tuple(shape), tuple(crop), (n_batches + 1) * batch_size, grid, seed=seed)
    evicted = evict_page_cache(sorted({s.uri for s in samples[:batch_size]}))
    baseline = rss_bytes()
    with RssSampler() as rss:
        result = run_stoker(samples, batch_size, 2, host_buffer_bytes)
    return {"baseline": baseline, "peak": rss.peak, "samples_per_s": result.samples_per_s,
            "peak_host_bytes": result.extra["stats"].peak_host_bytes,
            "first_batch_s": result.extra["first_batch_s"] if evicted else None}


def main() -> None:
    print(json.dumps(measure(**json.loads(sys.argv[1]))))


if __name__ == "__main__":
    main()
