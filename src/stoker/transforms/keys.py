"""Per-sample keys and the random draws keyed by them.

Every sample of a batch has a key ``(epoch, index)`` (``Batch.keys``, an int64 array of shape ``(B, 2)``):
for a sample of a :class:`~stoker.SampleSource` (pushed as its ``RankShare``), its epoch and its index in
that epoch's global order, the same on any world size and after any resume; for a sample pushed as a plain
sequence or iterable, ``(0, n)`` with ``n`` the count of such samples pushed into the pipeline before it.

:func:`uniform` turns keys into numbers in ``[0, 1)`` with a counter-based hash (splitmix64's mixer,
chained over ``seed``, ``salt``, epoch, index and the draw's number): no generator state, so it is the same
whichever thread asks, in whatever order, on whatever device the batch lives, and a resumed run draws
the same for the same sample.

>>> keys = np.array([[0, 0], [0, 1], [3, 7]])
>>> u = uniform(keys, seed=0, n=2)         # (3, 2) float64, a row per sample
>>> bool((uniform(keys[2:], seed=0, n=2) == u[2:]).all())
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import int64
from ..errors import InvalidArgument

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment (the golden ratio in 64 bits)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _u64(value: Any) -> np.ndarray:
    """Integers as uint64 bits (negative ones in two's complement)."""
    return np.asarray(value, dtype=np.int64).view(np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def check_keys(keys: Any, rows: int | None = None, who: str = "a keyed transform") -> np.ndarray:
    """``keys`` as an int64 array ``(B, 2)`` (a tensor is read on the host); InvalidArgument otherwise, or when
    it has other than ``rows`` rows."""
    if keys is None:
        raise InvalidArgument(f"{who} needs the batch's per-sample keys: call it as t(batch, keys) with keys an "
                              "int64 array (B, 2) of (epoch, index), e.g. Batch.keys; the pipeline passes them "
                              "to a transform whose takes_keys is True", knob="transform")
    if hasattr(keys, "detach"):  # a torch tensor, possibly on a GPU
        keys = keys.detach().cpu().numpy()
    arr = np.asarray(keys)
    if arr.ndim != 2 or arr.shape[1] != 2 or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise InvalidArgument(f"{who}: keys must be integers of shape (B, 2), (epoch, index) per sample; got "
                              f"{arr.dtype} of shape {arr.shape}", knob="transform")
    if rows is not None and arr.shape[0] != rows:
        raise InvalidArgument(f"{who}: {arr.shape[0]} keys for a batch of {rows} samples; pass the batch's own "
                              "keys (Batch.keys)", knob="transform")
    return arr.astype(np.int64, copy=False)


def bits(keys: Any, seed: int, n: int = 1, salt: int = 0) -> np.ndarray:
    """``(B, n)`` uint64 hashes of ``(seed, salt, epoch, index, j)`` for each sample's key and ``j < n``."""
    k = check_keys(keys)
    seed, salt = int64("uniform: seed", seed, knob="seed"), int64("uniform: salt", salt, knob="salt")
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design (numpy warns on 0-d values)
        h = _mix(_u64(seed) + _GAMMA)
        h = _mix((h ^ _u64(salt)) + _GAMMA)
        h = _mix((h ^ _u64(k[:, 0:1])) + _GAMMA)  # (B, 1)
        h = _mix((h ^ _u64(k[:, 1:2])) + _GAMMA)
        return _mix((h ^ _u64(np.arange(n, dtype=np.int64)[None, :])) + _GAMMA)  # (B, n)


def uniform(keys: Any, seed: int, n: int = 1, salt: int = 0) -> np.ndarray:
    """``(B, n)`` float64 numbers in ``[0, 1)``, a row per sample, a function of ``(seed, salt, key)`` alone.

    ``salt`` tells apart transforms that share a seed (the built-ins each have their own). Use it in a
    transform of one's own (see :class:`~stoker.transforms.Keyed`) for draws that a resumed run, a slower
    consumer or another device reproduces.
    """
    return (bits(keys, seed, n, salt) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
