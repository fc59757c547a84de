"""Seeded benchmark datasets, written once with zarr-python (reused when complete)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class VolumeSpec:
    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    codec: str  # "blosc-lz4" | "blosc-zstd" | "zstd"
    shards: tuple[int, ...] | None = None
    count: int = 1  # number of arrays (copies of one generated array under different names)


def _codec(name: str):
    from zarr.codecs import BloscCodec, ZstdCodec

    if name == "blosc-lz4":
        return BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    if name == "blosc-zstd":
        return BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
    if name == "zstd":
        return ZstdCodec(level=3)
    raise ValueError(name)


def _slab(rng: np.random.Generator, z0: int, depth: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Smooth structure plus camera-like noise (sigma about 20 counts): blosc lz4 + shuffle compresses it
    about 2-3x, like real microscopy; pure noise would make every reader I/O bound instead."""
    yy = np.arange(shape[1], dtype=np.float32)[:, None]
    xx = np.arange(shape[2], dtype=np.float32)[None, :]
    info = np.iinfo(dtype)
    scale = (info.max - info.min) / 8
    out = np.empty((depth, *shape[1:]), dtype=dtype)
    for i in range(depth):
        z = z0 + i
        base = info.min + 3 * scale + scale * np.sin(xx / 37.0 + z / 11.0) * np.cos(yy / 23.0 + z / 17.0)
        noise = rng.normal(0, max(1.0, scale / 400), size=shape[1:]).astype(np.float32)
        out[i] = np.clip(base + noise, info.min, info.max).astype(dtype)
    return out


def array_paths(root: Path, spec: VolumeSpec) -> list[str]:
    base = root / spec.name
    if spec.count == 1:
        return [str(base / "array.zarr")]
    return [str(base / f"a{i:05d}.zarr") for i in range(spec.count)]


def ensure(root: Path, spec: VolumeSpec, progress: bool = True) -> list[str]:
    """Write the dataset unless a complete copy exists; returns the array paths."""
    import zarr
    from tqdm import tqdm

    base = root / spec.name
    paths = array_paths(root, spec)
    if (base / ".complete").exists():
        return paths
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    first = Path(paths[0])
    z = zarr.create_array(str(first), shape=spec.shape, chunks=spec.chunks, shards=spec.shards,
                          dtype=spec.dtype, compressors=_codec(spec.codec), fill_value=0)
    rng = np.random.default_rng(hash(spec.name) % 2**32)
    step = spec.shards[0] if spec.shards else spec.chunks[0]
    for z0 in tqdm(range(0, spec.shape[0], step), desc=f"writing {spec.name}", unit="slab", disable=not progress):
        depth = min(step, spec.shape[0] - z0)
        z[z0:z0 + depth] = _slab(rng, z0, depth, spec.shape, spec.dtype)
    for p in tqdm(paths[1:], desc=f"copying {spec.name}", unit="array", disable=not progress or len(paths) < 2):
        shutil.copytree(first, p)
    (base / ".complete").touch()
    return paths


def evict_page_cache(paths: list[str]) -> int:
    """Drop the cached pages of every file under ``paths`` (``posix_fadvise(DONTNEED)``: no root needed), so
    their next read comes from the disk; returns the files evicted (0 where the call does not exist)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    n = 0
    for p in paths:
        for f in Path(p).rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                finally:
                    os.close(fd)
    return n


def warm_page_cache(paths: list[str]) -> int:
    """Read every file once so all peers start with a warm page cache; returns bytes read."""
    total = 0
    for p in paths:
        for f in Path(p).rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        total += len(chunk)
    return total
