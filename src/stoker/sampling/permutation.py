"""A seeded permutation of ``0..n-1`` evaluated one index at a time, in constant memory.

>>> p = Permutation(10, seed=0, epoch=3)
>>> sorted(p[i] for i in range(10)) == list(range(10))
True

A shuffled epoch of ``n`` samples needs ``order[i]`` for the ``i`` each rank
visits, not the whole order: a table of ``n`` indices (``rng.permutation(n)``)
costs 8 bytes a sample, gigabytes for the crops of a large volume. Instead,
``order[i]`` is a four-round Feistel network over the smallest power of 4 that
holds ``n`` (so both halves have the same width), keyed by ``(seed, epoch)``,
with cycle walking: an output ``>= n`` is encrypted again until it falls below
``n``, which stays a bijection of ``0..n-1`` and takes fewer than 4 rounds of
the network on average. The round function is keyed BLAKE2b (a PRF), which makes
four rounds a pseudo-random permutation (Luby-Rackoff).
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

# Changing how an order is computed changes the samples of a saved position: sources put this in their
# fingerprint, so a state saved under another order is refused rather than resumed into other samples.
ORDER_VERSION = "feistel4-blake2b-1"
_ROUNDS = 4


class Permutation:
    """``p[i]`` for ``i`` in ``0..n-1``: a bijection of ``0..n-1`` fixed by ``(seed, epoch)``."""

    __slots__ = ("n", "key", "_half", "_mask", "_keys")

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = int(n)
        self.key = (self.n, int(seed), int(epoch))
        self._half = max(1, ((self.n - 1).bit_length() + 1) // 2)  # bits of each half: 4**half >= n
        self._mask = (1 << self._half) - 1
        key = np.random.SeedSequence([int(seed), int(epoch)]).generate_state(8, np.uint32).tobytes()
        self._keys = [hashlib.blake2b(key=key, digest_size=8, person=b"stoker-order%d" % r) for r in range(_ROUNDS)]

    def __len__(self) -> int:
        return self.n

    def _round(self, r: int, x: int) -> int:
        h = self._keys[r].copy()
        h.update(x.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little") & self._mask

    def _encrypt(self, x: int) -> int:
        half, mask = self._half, self._mask
        left, right = x >> half, x & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ self._round(r, right)
        return (left << half) | right

    def __getitem__(self, i: int) -> int:
        i = operator.index(i)
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a permutation of {self.n}")
        x = self._encrypt(i)
        while x >= self.n:  # cycle walking: the cycle through i returns below n, at i itself at the latest
            x = self._encrypt(x)
        return x
