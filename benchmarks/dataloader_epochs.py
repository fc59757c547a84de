"""A DataLoader's second epoch: ``CropDataset`` with a new pipeline per epoch against ``persistent=True``,
from local files and from a loopback object store through the disk cache, side by side in one process run.

    python benchmarks/dataloader_epochs.py --store s3 --latency-ms 20 --rounds 3     # scenario 6, 120 batches
    python benchmarks/dataloader_epochs.py --store http --scenario 1
    python benchmarks/dataloader_epochs.py --tiny --rounds 1                          # seconds: CI's smoke run

Each peer is ``CropDataset(RandomCrops(...).for_rank(0, 1), cfg, persistent=...)`` iterated by
``torch.utils.data.DataLoader(ds, batch_size=None)``, as a training loop over epochs does: a first epoch,
untimed (over the store it fills the cache folder, a new empty one each round; the cache's writes are then
flushed), ``ds.set_epoch(0)``, and the same crops again, timed: samples/s, the process's CPU per batch, and
the requests and megabytes the loopback server (``stoker.bench.serve``, ``--latency-ms`` a request) answered
while timed. The peers:

- ``local, new pipeline`` / ``local, persistent``: the bench scenario's files;
- ``<store> cache, new pipeline``: the files through the server, ``Config(cache_dir=...)``; each epoch a new
  pipeline, which revalidates every object it opens (a LIST of each array over S3, a HEAD per object over HTTP);
- ``<store> cache, persistent``: the same with ``persistent=True``: the second epoch in the pipeline of the
  first, which asks the store nothing within ``cache_staleness_s`` (60 s).

Rounds are interleaved (each round runs every peer once); the report gives each peer's median and the ratios
the issue asks about: each cached peer against the local files read the same way. Every peer's first batch of
the timed epoch is checked equal to the local one's (the same crops, from the same bytes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import stoker
from stoker.bench import datasets, runner
from stoker.bench.remote import Remote
from stoker.bench.serve import Served
from stoker.demo.volume import cache_dir
from stoker.storage.diskcache import disk_cache


def _epoch(ds: stoker.CropDataset, first: list | None = None) -> int:
    n = 0
    for x in DataLoader(ds, batch_size=None):
        if first is not None and not first:
            first.append(x.clone())
        n += x.shape[0]
    return n


def second_epoch(sc, uris: list[str], batch_size: int, batches: int, persistent: bool, served: Served | None,
                 storage_options: dict | None = None) -> dict:
    """One peer's round: a first epoch untimed, then the same crops again, timed."""
    folder = tempfile.mkdtemp(prefix="stoker-dl-cache-") if served is not None else None
    try:
        source = stoker.RandomCrops(uris, sc.crop, seed=0, samples_per_epoch=batch_size * batches,
                                    storage_options=storage_options)
        cfg = runner.stoker_config(batch_size, runner.host_budget(sc, batch_size, None),
                                   storage_options=storage_options, cache_dir=folder)
        with stoker.CropDataset(source.for_rank(0, 1), cfg, persistent=persistent) as ds:
            _epoch(ds)
            if folder is not None:
                disk_cache(folder, runner.CACHE_BYTES).flush(600)  # the first epoch's entries on disk
            ds.set_epoch(0)
            asked = served.counters() if served is not None else (0, 0)
            first: list = []
            t0, c0 = time.perf_counter(), time.process_time()
            n = _epoch(ds, first)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            after = served.counters() if served is not None else (0, 0)
        batches = n / batch_size
        return {"samples_per_s": n / seconds, "cpu_ms": cpu / batches * 1e3,
                "requests": (after[0] - asked[0]) / batches, "mb": (after[1] - asked[1]) / 1e6 / batches,
                "first": first[0]}
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=["s3", "http"], default="s3")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--scenario", type=int, choices=[1, 6], default=6)
    p.add_argument("--batches", type=int, default=120, help="batches an epoch (default 120)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the bench's tiny scenario (CI's smoke run)")
    p.add_argument("--data", type=Path, help="dataset directory (default: the bench's)")
    args = p.parse_args(argv)
    sc = next(s for s in runner.scenarios(tiny=args.tiny) if s.number == args.scenario)
    root = args.data or cache_dir() / "bench"
    paths = datasets.ensure(root, sc.volume)
    batch_size = sc.batch_size
    print(f"scenario {sc.number} ({sc.volume.name}): {len(paths)} arrays, crops {sc.crop}, batch {batch_size}, "
          f"{args.batches} batches an epoch; {args.store} at {args.latency_ms:g} ms a request; "
          f"{args.rounds} interleaved rounds", flush=True)
    rounds: dict[str, list[dict]] = {}
    with Served(root, args.store, args.latency_ms) as served:
        remote = Remote(args.store, served.url, root, args.latency_ms)
        options = remote.storage_options()
        remote_uris = [remote.uri(path) for path in paths]
        peers = {
            "local, new pipeline": (paths, False, None, None),
            "local, persistent": (paths, True, None, None),
            f"{args.store} cache, new pipeline": (remote_uris, False, served, options),
            f"{args.store} cache, persistent": (remote_uris, True, served, options),
        }
        for _ in range(args.rounds):
            for name, (uris, persistent, srv, opts) in peers.items():
                rounds.setdefault(name, []).append(
                    second_epoch(sc, uris, batch_size, args.batches, persistent, srv, opts))
    reference = rounds["local, new pipeline"][0]["first"]
    for name, results in rounds.items():
        if not all(torch.equal(r["first"], reference) for r in results):
            raise SystemExit(f"{name}: its first batch differs from the local files' (not the same crops)")
    medians = {name: {k: statistics.median(r[k] for r in results) for k in ("samples_per_s", "cpu_ms", "requests",
                                                                              "mb")}
               for name, results in rounds.items()}
    print(f"{'second epoch':34} {'samples/s':>10} {'CPU ms/batch':>13} {'requests/batch':>15} {'MB/batch':>9}")
    for name, m in medians.items():
        print(f"{name:34} {m['samples_per_s']:10.1f} {m['cpu_ms']:13.2f} {m['requests']:15.1f} {m['mb']:9.3f}")
    for kind in ("new pipeline", "persistent"):
        local, cached = medians[f"local, {kind}"], medians[f"{args.store} cache, {kind}"]
        per_round = [c["samples_per_s"] / lo["samples_per_s"] for c, lo in
                     zip(rounds[f"{args.store} cache, {kind}"], rounds[f"local, {kind}"])]
        print(f"{args.store} cache / local files, {kind}: {cached['samples_per_s'] / local['samples_per_s']:.2f}x "
              f"samples/s (per round {' '.join(f'{r:.2f}' for r in per_round)}), "
              f"{local['cpu_ms'] / cached['cpu_ms']:.2f}x CPU per batch (local / cached)")
    return medians


if __name__ == "__main__":
    main()
