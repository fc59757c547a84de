"""The seeded bijection behind shuffled sources: a permutation, fixed by (seed, epoch), shuffled."""

from __future__ import annotations

import pytest

from stoker.sampling.permutation import Permutation

pytestmark = pytest.mark.timeout(120)


def _order(n, seed=0, epoch=0):
    p = Permutation(n, seed, epoch)
    return [p[i] for i in range(n)]


def test_is_a_permutation():
    for n in range(0, 260):  # every small size, whose domains (powers of 4) the cycle walk leaves often
        assert sorted(_order(n, seed=n, epoch=1)) == list(range(n)), n
    for n in (4**5, 4**5 + 1, 3000, 2**14 - 1):
        assert sorted(_order(n, seed=7, epoch=2)) == list(range(n)), n


def test_fixed_by_seed_and_epoch():
    assert _order(500, 3, 4) == _order(500, 3, 4)
    orders = [_order(500, seed, epoch) for seed in (0, 1) for epoch in (0, 1, 2)]
    assert len({tuple(o) for o in orders}) == len(orders)


def test_looks_shuffled():
    n = 10_000
    order = _order(n, seed=0, epoch=5)
    runs, longest = 1, 1  # stretches where the next index follows the previous one (i, i+1, ...)
    for a, b in zip(order, order[1:]):
        runs = runs + 1 if b == a + 1 else 1
        longest = max(longest, runs)
    assert longest < 5
    assert sum(i == p for i, p in enumerate(order)) < 10  # few fixed points (a random one has 1 on average)
    displacement = sum(abs(i - p) for i, p in enumerate(order)) / n
    assert 0.25 * n < displacement < 0.42 * n  # n/3 for a uniform permutation; an identity-like order is near 0


def test_huge_and_out_of_range():
    n = 2**62
    p = Permutation(n, 1, 2)
    first = [p[i] for i in range(1000)]
    assert all(0 <= x < n for x in first) and len(set(first)) == 1000 and p[n - 1] < n
    for bad in (-1, n):
        with pytest.raises(IndexError):
            p[bad]
    assert len(Permutation(0, 0, 0)) == 0 and _order(1) == [0]
