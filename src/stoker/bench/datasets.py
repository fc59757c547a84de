"""Seeded benchmark datasets, written once with zarr-python (reused when complete).

A dataset's content is smooth structure with a little noise (``"smooth"``, scenarios 1-8), or
compressible data like real measurements (:mod:`.synthetic`: ``"microscopy"``, ``"weather"``);
:func:`compression_ratio` says how much smaller it is stored than decoded.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import StokerError, StorageError
from ..storage.fsutil import write_once

MARKER = ".complete"


@dataclass(frozen=True)
class VolumeSpec:
    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    codec: str  # "blosc-lz4" | "blosc-zstd" | "blosc-zstd-bitshuffle" | "zstd"
    shards: tuple[int, ...] | None = None
    count: int = 1  # number of arrays (copies of one generated array under different names)
    content: str = "smooth"  # or one of synthetic.CONTENTS


def _codec(name: str):
    from zarr.codecs import BloscCodec, ZstdCodec

    if name == "blosc-lz4":
        return BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    if name == "blosc-zstd":
        return BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
    if name == "blosc-zstd-bitshuffle":  # what weather data written through xarray often carries
        return BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")
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


def _names(spec: VolumeSpec) -> list[str]:
    return ["array.zarr"] if spec.count == 1 else [f"a{i:05d}.zarr" for i in range(spec.count)]


def array_paths(root: Path, spec: VolumeSpec) -> list[str]:
    return [str(Path(root) / spec.name / name) for name in _names(spec)]


def _marker(spec: VolumeSpec) -> dict:
    fields = json.loads(json.dumps(asdict(spec)))
    if spec.content == "smooth":  # as before contents had names: datasets written then stay complete
        del fields["content"]
    else:  # a retuned generator makes other data: a dataset it wrote before is written anew
        from .synthetic import VERSION

        fields["generator"] = VERSION
    return {"format": "stoker-bench-volume", **fields}


def _is_complete(base: Path, spec: VolumeSpec) -> bool:
    """Whether ``base`` holds the complete dataset of ``spec``: its marker (written last) describes ``spec``."""
    try:
        text = (base / MARKER).read_text()
        if not text:  # older versions touched an empty marker after the last array: check the first one
            meta = json.loads((base / _names(spec)[0] / "zarr.json").read_text())
            return meta.get("shape") == list(spec.shape) and meta.get("data_type") == spec.dtype
        return json.loads(text) == _marker(spec)
    except (OSError, ValueError, AttributeError):
        return False


def write_dataset(base: Path, build, is_complete, wait_s: float | None = None) -> None:
    """:func:`~stoker.storage.fsutil.write_once` for a benchmark dataset: a file system that does not take it
    (a full disk, a quota, a folder that cannot be written) is a :class:`~stoker.errors.StorageError` naming
    the folder, the cause and ``--data``, which the CLI prints on one line, not an ``OSError`` traceback from
    deep in zarr's writer. (``write_once`` leaves nothing half-written behind either way.)"""
    try:
        write_once(base, build, is_complete=is_complete, wait_s=wait_s)
    except OSError as exc:
        if isinstance(exc, StokerError):  # already says what and where (a claim that timed out, ...)
            raise
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        why = ("the disk (or a quota, or a file size limit) is full" if full
               else "the folder cannot be written" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
               else "the file system refused it")
        fix = ("free room there, or give stoker bench --data a folder with room" if full else
               "give stoker bench --data a folder it can write")
        raise StorageError(f"cannot write the benchmark dataset {base}: {why} ({type(exc).__name__}: {exc}); {fix}",
                           uri=str(base), errno=exc.errno) from exc


def ensure(root: Path, spec: VolumeSpec, progress: bool = True, wait_s: float | None = None) -> list[str]:
    """Write the dataset unless a complete copy exists; returns the array paths.

    Safe from many processes at once (:func:`~stoker.storage.fsutil.write_once`): one writes, the others wait for it
    (at most ``wait_s``) and reuse it.
    """
    base = Path(root) / spec.name
    write_dataset(base, lambda tmp: _write(tmp, spec, progress), is_complete=lambda p: _is_complete(p, spec),
                  wait_s=wait_s)
    return array_paths(Path(root), spec)


def _write(tmp: Path, spec: VolumeSpec, progress: bool) -> None:
    import zarr
    from tqdm import tqdm

    paths = [tmp / name for name in _names(spec)]
    first = paths[0]
    z = zarr.create_array(str(first), shape=spec.shape, chunks=spec.chunks, shards=spec.shards,
                          dtype=spec.dtype, compressors=_codec(spec.codec), fill_value=0)
    # A seed from the name that every process agrees on (str hashes differ between processes).
    seed = zlib.crc32(spec.name.encode())
    if spec.content == "smooth":
        _write_smooth(z, spec, seed, progress)
    else:
        _write_synthetic(z, spec, seed, progress)
    for p in tqdm(paths[1:], desc=f"copying {spec.name}", unit="array", disable=not progress or len(paths) < 2):
        shutil.copytree(first, p)
    (tmp / MARKER).write_text(json.dumps(_marker(spec)))  # last: it says the dataset is complete


def _write_smooth(z, spec: VolumeSpec, seed: int, progress: bool) -> None:
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    # Generated a plane of shards (or chunks) at a time, written a row of them at a time: every write
    # covers whole shards, so none is read back and written again, and the bar moves every few seconds.
    block = spec.shards or spec.chunks
    total = math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
    with tqdm(total=total, desc=f"writing {spec.name}", unit="B", unit_scale=True, disable=not progress) as bar:
        for z0 in range(0, spec.shape[0], block[0]):
            depth = min(block[0], spec.shape[0] - z0)
            slab = _slab(rng, z0, depth, spec.shape, spec.dtype)
            for y0 in range(0, spec.shape[1], block[1]):
                rows = slab[:, y0:y0 + block[1]]
                z[z0:z0 + depth, y0:y0 + rows.shape[1]] = rows
                bar.update(rows.nbytes)


_BLOCK_BYTES = 8 << 20  # an unsharded array is generated and written this many bytes' worth of chunks at a time


def write_blocks(spec: VolumeSpec) -> list[tuple[tuple[int, int], ...]]:
    """The boxes a synthetic dataset is generated and written in: whole shards, or runs of whole chunks
    along the first axis of about 8 MiB, so no write reads a stored chunk back."""
    block = list(spec.shards or spec.chunks)
    if spec.shards is None:
        chunk_bytes = math.prod(spec.chunks) * np.dtype(spec.dtype).itemsize
        block[0] *= max(1, _BLOCK_BYTES // chunk_bytes)
    corners = np.ndindex(*(-(-s // b) for s, b in zip(spec.shape, block)))
    return [tuple((c * b, min(s, (c + 1) * b)) for c, b, s in zip(corner, block, spec.shape)) for corner in corners]


def _write_synthetic(z, spec: VolumeSpec, seed: int, progress: bool) -> None:
    """Generate :mod:`.synthetic` content box by box on every core (numpy releases the GIL) while this
    thread writes the boxes made, in order: at most one box per core and one more are in memory at once."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from .synthetic import block

    boxes = write_blocks(spec)
    cores = os.cpu_count() or 1
    total = math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
    with tqdm(total=total, desc=f"writing {spec.name}", unit="B", unit_scale=True, disable=not progress) as bar, \
            ThreadPoolExecutor(cores) as pool:
        window: deque = deque()

        def write_oldest() -> None:
            box, made = window.popleft()
            data = made.result()
            z[tuple(slice(a, b) for a, b in box)] = data
            bar.update(data.nbytes)

        for box in boxes:
            window.append((box, pool.submit(block, spec.content, seed, spec.shape, box)))
            if len(window) > cores:
                write_oldest()
        while window:
            write_oldest()


def stored_bytes(path: str | os.PathLike) -> int:
    """Bytes the chunks (or shards) of the array at ``path`` take on disk: every file but its metadata."""
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup"}
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.name not in meta)


def compression_ratio(path: str | os.PathLike, spec: VolumeSpec) -> float:
    """Decoded bytes over stored bytes of one array of ``spec`` at ``path`` (3.0: stored 3x smaller)."""
    stored = stored_bytes(path)
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize / stored if stored else float("inf")


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
