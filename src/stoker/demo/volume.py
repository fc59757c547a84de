"""The volume task behind ``stoker demo``: a synthetic sharded Zarr volume and a small 3D conv denoiser.

>>> path = ensure_volume(default_volume_path())     # written once, with a progress bar
>>> model = Denoiser3D()
>>> loss = denoise_loss(model, crops)                 # crops: (B, Z, Y, X) float32 from the pipeline

The volume imitates microscopy: smooth structure plus sensor noise, uint16,
blosc-lz4 compressed inner chunks of 16x32x32 in 32x128x128 shards, so the demo
exercises the sharded read path with modest read amplification for its crops.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidArgument, StokerError, StorageError
from ..storage.artifacts import cache_root
from ..storage.fsutil import write_once

__all__ = [
    "CROP", "Denoiser3D", "VOLUME_SHAPE", "cache_dir", "default_volume_path", "denoise_loss", "ensure_volume",
]

VOLUME_SHAPE = (128, 512, 512)
SHARD = (32, 128, 128)
INNER_CHUNK = (16, 32, 32)
CROP = (16, 64, 64)
# Normalisation of the synthetic intensities (about 2000 +- 800): keeps the loss near 1 at the start.
MEAN, SCALE = 2000.0, 800.0
NOISE_SIGMA = 0.3
_MARKER = ".stoker-complete"


def cache_dir() -> Path:
    """Where generated demo data lives (``$STOKER_CACHE`` or ``~/.cache/stoker``)."""
    return cache_root()


def default_volume_path() -> Path:
    return cache_dir() / "demo-volume-v2.zarr"


def ensure_volume(path: str | os.PathLike, shape: tuple[int, int, int] = VOLUME_SHAPE, seed: int = 0,
                  progress: bool = True, wait_s: float | None = None) -> Path:
    """Create the demo volume at ``path`` unless a complete one with this shape and seed is there; returns the path.

    Safe to call from any number of processes at once, on any node sharing the folder
    (:func:`~stoker.storage.fsutil.write_once`): one writes, the others wait for it (at most
    ``wait_s``, see :func:`~stoker.storage.fsutil.claim`) and reuse its volume. The volume is
    written under a temporary name with its marker (the shape and seed) last, then renamed
    into place, so whatever sits at ``path`` with a matching marker is complete; anything
    else there (an older or interrupted volume) is replaced.

    A volume that cannot be written (a full disk, a folder without write permission) is a
    :class:`~stoker.errors.StorageError` naming the path, the room it needs and where else to put it.
    """
    path = Path(path)
    if len(shape) != 3 or any(s % c for s, c in zip(shape, SHARD)):
        raise InvalidArgument(f"shape must be 3 extents, multiples of the shard shape {SHARD}, got {shape}")
    marker = {"format": "stoker-demo-volume", "shape": [int(s) for s in shape], "seed": int(seed)}

    def is_complete(root: Path) -> bool:
        try:
            return json.loads((root / _MARKER).read_text()) == marker
        except (OSError, ValueError):
            return False

    try:
        write_once(path, lambda tmp: _write_volume(tmp, shape, seed, progress, marker), is_complete=is_complete,
                   wait_s=wait_s)
    except OSError as exc:
        if isinstance(exc, StokerError):  # already says what and where (a claim that timed out, ...)
            raise
        raise _not_written(path, shape, exc) from exc
    return path


def _not_written(path: Path, shape: tuple[int, int, int], exc: OSError) -> StorageError:
    """The error for a volume the file system did not take: what failed, the room needed, what to do."""
    need = math.prod(shape) * 2  # uint16, before compression: an upper bound of what is written
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    why = ("the disk (or a quota, or a file size limit) is full" if full
           else "the folder cannot be written" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
           else "the file system refused it")
    return StorageError(
        f"cannot write the demo volume at {path}: {why} ({type(exc).__name__}: {exc}). It needs up to "
        f"{need / 2**20:,.0f} MiB; free that much there, or set STOKER_CACHE to a folder with room (the "
        "volume goes to $STOKER_CACHE/demo-volume-v2.zarr)", uri=str(path), errno=exc.errno)


def _write_volume(root: Path, shape: tuple[int, int, int], seed: int, progress: bool, marker: dict) -> None:
    import zarr
    from tqdm import tqdm
    from zarr.codecs import BloscCodec

    z = zarr.create_array(
        str(root), shape=shape, shards=SHARD, chunks=INNER_CHUNK, dtype="uint16",
        compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    )
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0: shape[1], 0: shape[2]].astype(np.float32)
    for z0 in tqdm(range(0, shape[0], SHARD[0]), desc="writing demo volume", unit="slab", disable=not progress):
        zz = np.arange(z0, z0 + SHARD[0], dtype=np.float32)[:, None, None]
        base = MEAN + SCALE * np.sin(xx / 37.0 + zz / 11.0) * np.cos(yy / 23.0 - zz / 29.0)
        noise = rng.normal(0, 40, size=base.shape).astype(np.float32)
        z[z0: z0 + SHARD[0]] = np.clip(base + noise, 0, 65535).astype(np.uint16)
    (root / _MARKER).write_text(json.dumps(marker))  # last: it says the volume is complete


class Denoiser3D(torch.nn.Module):
    """Three 3x3x3 convolutions predicting the noise of a one-channel volume (a residual denoiser).

    >>> Denoiser3D()(torch.zeros(2, 1, 16, 64, 64)).shape
    torch.Size([2, 1, 16, 64, 64])
    """

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv3d(1, width, 3, padding=1), torch.nn.GELU(),
            torch.nn.Conv3d(width, width, 3, padding=1), torch.nn.GELU(),
            torch.nn.Conv3d(width, 1, 3, padding=1),
        )

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return noisy - self.net(noisy)


def denoise_loss(model: torch.nn.Module, crops: torch.Tensor) -> torch.Tensor:
    """MSE between the clean crops and the model's output for crops plus gaussian noise.

    ``crops`` are raw intensities ``(B, Z, Y, X)``; the noise comes from torch's global
    RNG, whose state the trainer checkpoints, so a resumed run draws the same noise.
    """
    clean = ((crops.float() - MEAN) / SCALE).unsqueeze(1)
    noisy = clean + NOISE_SIGMA * torch.randn_like(clean)
    return torch.nn.functional.mse_loss(model(noisy).float(), clean)
