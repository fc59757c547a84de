"""``stoker demo``: write a small synthetic volume once, then stream random crops from it.

This is the interim main job: it exercises the Zarr reader end to end and prints
throughput. The training demo replaces the reading loop when it lands.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from ..array import open_array


def cache_dir() -> Path:
    """Where generated demo data lives (``$STOKER_CACHE`` or ``~/.cache/stoker``)."""
    root = os.environ.get("STOKER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stoker")
    return Path(root)


def ensure_volume(path: Path, shape=(128, 512, 512), chunks=(32, 128, 128)) -> Path:
    """Create the demo volume (seeded, blosc lz4 + shuffle) unless a complete one exists."""
    import zarr
    from tqdm import tqdm
    from zarr.codecs import BloscCodec

    done = path / ".complete"
    if done.exists():
        return path
    z = zarr.create_array(
        str(path), shape=shape, chunks=chunks, dtype="uint16", overwrite=True,
        compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    )
    rng = np.random.default_rng(0)
    # Smooth structure plus noise: compresses like real microscopy, not like random bytes.
    yy, xx = np.mgrid[0 : shape[1], 0 : shape[2]]
    for z0 in tqdm(range(0, shape[0], chunks[0]), desc="writing demo volume", unit="slab"):
        depth = min(chunks[0], shape[0] - z0)
        zz = np.arange(z0, z0 + depth)[:, None, None]
        base = 2000 + 800 * np.sin(xx / 37.0 + zz / 11.0) * np.cos(yy / 23.0)
        noise = rng.normal(0, 40, size=(depth, *shape[1:]))
        z[z0 : z0 + depth] = np.clip(base + noise, 0, 65535).astype("uint16")
    done.touch()
    return path


def run(args: argparse.Namespace) -> int:
    path = ensure_volume(cache_dir() / "demo-volume.zarr")
    arr = open_array(path)
    print(f"reading random {tuple(args.crop)} crops from {arr}")
    rng = np.random.default_rng(args.seed)
    n = 0
    nbytes = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        corner = [int(rng.integers(0, s - c + 1)) for s, c in zip(arr.shape, args.crop)]
        crop = arr.read([(c, c + w) for c, w in zip(corner, args.crop)])
        n += 1
        nbytes += crop.nbytes
    elapsed = time.perf_counter() - start
    print(f"{n} crops in {elapsed:.1f} s: {n / elapsed:.1f} crops/s, {nbytes / elapsed / 2**20:.1f} MiB/s "
          f"(reference reader, one thread)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="write a small dataset once and stream random crops from it")
    p.add_argument("--seconds", type=float, default=5.0, help="how long to stream (default 5)")
    p.add_argument("--crop", type=int, nargs=3, default=(32, 128, 128), metavar=("Z", "Y", "X"))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)
