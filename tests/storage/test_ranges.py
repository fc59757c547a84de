"""Coalescing byte ranges of one file: every request served once, no hole wider than the gap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.storage.ranges import Read, coalesce

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# coalesce

range_lists = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=40)


def check_coalesced(ranges, reads, max_gap, max_length):
    served = sorted(i for r in reads for i, _, _ in r.parts)
    assert served == list(range(len(ranges)))  # each request served exactly once
    assert [r.offset for r in reads] == sorted(r.offset for r in reads)
    for r in reads:
        assert r.parts
        for i, off, n in r.parts:
            assert (off, n) == tuple(ranges[i])
            assert r.offset <= off and off + n <= r.offset + r.length
        starts = [off for _, off, _ in r.parts]
        assert starts == sorted(starts) and r.offset == starts[0]
        assert r.offset + r.length == max(off + n for _, off, n in r.parts)  # no wasted tail
        if len(r.parts) > 1:
            assert r.length <= max_length
        # No hole wider than max_gap inside a read.
        end = r.offset
        for _, off, n in r.parts:
            assert off - end <= max_gap
            end = max(end, off + n)
    # Greedy: the next read starts where merging was not allowed.
    for a, b in zip(reads, reads[1:]):
        _, off, n = b.parts[0]
        a_end = a.offset + a.length
        assert off - a_end > max_gap or max(a_end, off + n) - a.offset > max_length


@given(range_lists, st.integers(0, 300), st.integers(1, 3000), st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_coalesce_properties(ranges, max_gap, max_length, seed):
    reads = coalesce(ranges, max_gap=max_gap, max_length=max_length)
    check_coalesced(ranges, reads, max_gap, max_length)
    # Slices map back to the right bytes of the file.
    blob = np.random.default_rng(seed).integers(0, 256, size=6000, dtype=np.uint8).tobytes()
    got = [None] * len(ranges)
    for r in reads:
        buf = blob[r.offset:r.offset + r.length]
        for i, sl in r.slices():
            got[i] = buf[sl]
    assert got == [blob[off:off + n] for off, n in ranges]


def test_coalesce_examples():
    assert coalesce([]) == []
    assert coalesce([(0, 100), (120, 80)], max_gap=64) == [Read(0, 200, ((0, 0, 100), (1, 120, 80)))]
    assert coalesce([(0, 100), (120, 80)], max_gap=19) == [Read(0, 100, ((0, 0, 100),)),
                                                           Read(120, 80, ((1, 120, 80),))]
    assert len(coalesce([(0, 100), (120, 80)], max_gap=20)) == 1  # a gap of exactly max_gap merges
    # adjacent ranges merge even with max_gap=0; request order is kept in the parts
    assert coalesce([(10, 5), (0, 10)], max_gap=0) == [Read(0, 15, ((1, 0, 10), (0, 10, 5)))]
    # duplicates and overlaps are served from one read
    reads = coalesce([(5, 10), (5, 10), (8, 2), (0, 20)], max_gap=0)
    assert len(reads) == 1 and (reads[0].offset, reads[0].length) == (0, 20)
    assert sorted(i for i, _ in reads[0].slices()) == [0, 1, 2, 3]
    # max_length splits merges, but a single long range is never cut
    reads = coalesce([(0, 50), (50, 50), (100, 50)], max_gap=10, max_length=100)
    assert [(r.offset, r.length) for r in reads] == [(0, 100), (100, 50)]
    assert coalesce([(0, 500)], max_length=100) == [Read(0, 500, ((0, 0, 500),))]
