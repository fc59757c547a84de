"""``stoker bench records``: the record Loader against a DataLoader over zarr-python, in one process run.

Datasets: seeded point-cloud records (``points`` (N, 3) and ``features`` (N, 4) float32, N varying
from 500 to 3,000), written once with zarr-python; the large copy for the scaling check repeats the
small one's records under new names. Construction time and RSS are measured in fresh processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .datasets import write_dataset


def _records_complete(base: Path, n: int) -> bool:
    """Whether ``base`` holds the ``n`` records: its marker (written last) says so."""
    try:
        text = (base / ".complete").read_text()
        if not text:  # older versions touched an empty marker after the last record
            return len(list(base.glob("r*.zarr"))) == n
        return json.loads(text) == {"format": "stoker-bench-records", "n": n}
    except (OSError, ValueError):
        return False


def ensure_records(root: Path, n: int, progress: bool = True) -> Path:
    """A directory of ``n`` record groups (reused when complete; one writer among processes racing for it)."""
    base = root / f"records-{n}"
    write_dataset(base, lambda tmp: _write_records(tmp, n, progress), is_complete=lambda p: _records_complete(p, n))
    return base


def _write_records(base: Path, n: int, progress: bool) -> None:
    import zarr
    from tqdm import tqdm

    seed_n = min(n, 2000)
    rng = np.random.default_rng(0)
    for i in tqdm(range(seed_n), desc=f"writing {seed_n} records", unit="rec", disable=not progress):
        npts = int(rng.integers(500, 3001))
        g = zarr.open_group(str(base / f"r{i:06d}.zarr"), mode="w")
        g.create_array("points", data=rng.normal(size=(npts, 3)).astype(np.float32), chunks=(npts, 3))
        g.create_array("features", data=rng.normal(size=(npts, 4)).astype(np.float32), chunks=(npts, 4))
    for i in tqdm(range(seed_n, n), desc="copying records", unit="rec", disable=not progress or n <= seed_n):
        shutil.copytree(base / f"r{i % seed_n:06d}.zarr", base / f"r{i:06d}.zarr")
    (base / ".complete").write_text(json.dumps({"format": "stoker-bench-records", "n": n}))  # last


def zarr_python_peer(root: Path, pattern: str, keys: tuple[str, ...], batch_size: int, workers: int,
                     collate) -> torch.utils.data.DataLoader:
    """The peer of the record Loader (here and in ``records --mesh``): a shuffled, seeded DataLoader of
    ``workers`` processes over :class:`ZarrPythonRecords`, batched by ``collate``.

    >>> dl = zarr_python_peer(root, "r*.zarr", ("points", "features"), 32, 4, collate)  # doctest: +SKIP
    """
    return torch.utils.data.DataLoader(ZarrPythonRecords(root, pattern, keys), batch_size=batch_size, shuffle=True,
                                       num_workers=workers, collate_fn=collate,
                                       generator=torch.Generator().manual_seed(0))


class ZarrPythonRecords(torch.utils.data.Dataset):
    """One record group per item (those under ``root`` matching ``pattern``), its arrays ``keys`` read whole
    through zarr-python, opened lazily in each worker."""

    def __init__(self, root: Path, pattern: str, keys: tuple[str, ...]) -> None:
        self.paths = sorted(str(p) for p in root.glob(pattern))
        self.keys = keys

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        import zarr

        g = zarr.open_group(self.paths[i], mode="r")
        return {k: torch.from_numpy(g[k][:]) for k in self.keys}


def _concat(samples: list[dict]) -> dict:
    out = {}
    for k in samples[0]:
        out[k] = torch.cat([s[k] for s in samples])
        out[f"{k}_batch"] = torch.cat([torch.full((len(s[k]),), i) for i, s in enumerate(samples)])
    return out


def steady_rate(batches, n_batches: int, batch_size: int, in_flight: int) -> float:
    """Samples/s in steady state: ``in_flight`` batches are being prepared when the clock starts and when it
    stops (the epoch has more batches after the window), so no head start or drain is timed."""
    it = iter(batches)
    for _ in range(1 + in_flight):  # warm-up: threads or workers start, the prefetch fills
        next(it)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    seconds = time.perf_counter() - t0
    del it
    return n_batches * batch_size / seconds


_METADATA_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs")


def _warm_metadata(base: Path) -> None:
    """Read every metadata file once: construction is then timed against the page cache, not the disk
    (otherwise the larger dataset, less likely to be cached, looks slower per record for the disk's sake)."""
    for dirpath, _, files in os.walk(base):
        for name in files:
            if name in _METADATA_FILES:
                with open(os.path.join(dirpath, name), "rb") as f:
                    f.read()


def _construction(base: Path, repeats: int = 3) -> dict:
    """The fastest of ``repeats`` fresh-process constructions (metadata warm), to damp machine noise."""
    _warm_metadata(base)
    return min((_construct_in_fresh_process(base) for _ in range(repeats)), key=lambda r: r["seconds"])


def _construct_in_fresh_process(base: Path) -> dict:
    code = (
        "import json,time,sys; from stoker.bench.runner import rss_bytes; r0=rss_bytes(); "
        "from stoker.records import ZarrRecords; import stoker; r1=rss_bytes(); t=time.perf_counter(); "
        f"ds=ZarrRecords({str(base)!r}, fields=['points','features']); dt=time.perf_counter()-t; "
        "print(json.dumps({'n':len(ds),'seconds':dt,'rss_delta':rss_bytes()-r1}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _in_flight() -> int:
    """Batches in flight in steady state: the DataLoader's prefetch (prefetch_factor 2 per worker, a worker per core)."""
    return 2 * (os.cpu_count() or 1)


def records_for_steady_state(batch_size: int, n_batches: int) -> int:
    """The fewest records that time ``n_batches`` after the prefetch has filled (and before it drains)."""
    return batch_size * (n_batches + 1 + 2 * _in_flight())


def run(root: Path, n_small: int, n_large: int, batch_size: int, n_batches: int) -> str:
    from ..records import Loader, ZarrRecords

    small = ensure_records(root, n_small)
    large = ensure_records(root, n_large)
    cores = os.cpu_count() or 1
    in_flight = _in_flight()  # the Loader's is 2; both are timed the same way
    n_batches = min(n_batches, n_small // batch_size - 1 - 2 * in_flight)
    if n_batches < 1:
        raise ValueError(f"{n_small} records are too few to time {cores} workers in steady state")
    ds = ZarrRecords(small, fields=["points", "features"])
    with Loader(ds, batch_size, collate="concat", shuffle=True, seed=0, n_threads=cores) as loader:
        stoker_rate = steady_rate(loader, n_batches, batch_size, in_flight)
    dl = zarr_python_peer(small, "r*.zarr", ("points", "features"), batch_size, cores, _concat)
    dl_rate = steady_rate(dl, n_batches, batch_size, in_flight)
    a, b = _construction(small), _construction(large)
    lines = [
        f"records: {n_small} point clouds (500-3,000 points), batch {batch_size}, {n_batches} timed batches in "
        f"steady state, {cores} threads / workers",
        f"{'peer':<34}{'samples/s':>11}{'stoker x':>10}",
        f"{'stoker.records.Loader (threads)':<34}{stoker_rate:>11.1f}",
        f"{'DataLoader(num_workers) + zarr':<34}{dl_rate:>11.1f}{stoker_rate / dl_rate:>9.2f}x",
        "construction (fresh process, metadata only, metadata files in the page cache, best of 3):",
        f"  {a['n']:>7,} records: {a['seconds']:.2f} s, RSS +{a['rss_delta'] / 1e6:.1f} MB "
        f"({a['seconds'] / a['n'] * 1e6:.0f} us and {a['rss_delta'] / a['n']:.0f} B per record)",
        f"  {b['n']:>7,} records: {b['seconds']:.2f} s, RSS +{b['rss_delta'] / 1e6:.1f} MB "
        f"({b['seconds'] / b['n'] * 1e6:.0f} us and {b['rss_delta'] / b['n']:.0f} B per record)",
    ]
    return "\n".join(lines)


