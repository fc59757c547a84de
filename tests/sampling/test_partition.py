"""Rank partition and resume arithmetic (stoker.sampling.partition) against the array implementation it replaced.

The reference below is stoker's earlier ``shard.py``, which held an epoch's
positions as ``np.arange(n)`` arrays: exact, but O(n) memory. The interval
implementation must give the same positions, order, states and resumes.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.sampling import partition as sh
from stoker.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)


# -- the reference: the array implementation --------------------------------------------------


def old_rank_positions(remaining, rank, world_size, policy, even):
    n = len(remaining)
    m = sh.per_rank(n, world_size, even)
    if n == 0 or m == 0:
        return remaining[:0]
    j = np.arange(m)
    idx = rank + j * world_size if policy == "strided" else rank * m + j
    return remaining[idx % n]


def old_consumed(remaining, world_size, steps, policy, even):
    n = len(remaining)
    m = sh.per_rank(n, world_size, even)
    steps = min(steps, m)
    if n == 0 or steps == 0:
        return remaining[:0]
    ranks = np.arange(world_size)[:, None]
    j = np.arange(steps)[None, :]
    idx = (ranks + j * world_size) if policy == "strided" else (ranks * m + j)
    return remaining[np.unique(idx.reshape(-1) % n)]


def old_remaining_after(n, segments):
    remaining = np.arange(n, dtype=np.int64)
    for world_size, policy, even, steps in segments:
        done = old_consumed(remaining, int(world_size), int(steps), policy, even)
        if even == "drop" and int(steps) >= sh.per_rank(len(remaining), int(world_size), even):
            return remaining[:0]
        remaining = remaining[~np.isin(remaining, done)]
    return remaining


def old_position(n, segments, world_size, policy, even, steps):
    """RankShare's state "position" as the array implementation computed it."""
    remaining = old_remaining_after(n, segments)
    done = len(old_consumed(remaining, world_size, steps, policy, even))
    if even == "drop" and steps >= sh.per_rank(len(remaining), world_size, even):
        done = len(remaining)
    return n - len(remaining) + done


# -- the comparison ---------------------------------------------------------------------------

segment = st.tuples(st.integers(1, 7), st.sampled_from(sh.POLICIES), st.sampled_from(sh.EVEN), st.integers(0, 40))


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 150), segments=st.lists(segment, max_size=5), world=st.integers(1, 7),
       policy=st.sampled_from(sh.POLICIES), even=st.sampled_from(sh.EVEN), steps=st.integers(0, 60))
def test_intervals_match_the_array_implementation(n, segments, world, policy, even, steps):
    segments = [list(s) for s in segments]
    for k in range(len(segments) + 1):  # every prefix of the history
        assert list(sh.remaining_after(n, segments[:k])) == old_remaining_after(n, segments[:k]).tolist()
    new, old = sh.remaining_after(n, segments), old_remaining_after(n, segments)
    assert len(new.intervals) <= 1 + sum(2 * w + 1 for w, *_ in segments)  # bounded by the runs, not by n
    for rank in range(world):
        mine = sh.rank_positions(new, rank, world, policy, even)
        ref = old_rank_positions(old, rank, world, policy, even)
        assert len(mine) == len(ref) and list(mine) == ref.tolist() == mine.to_array().tolist()
        assert [mine[j] for j in range(-len(ref), 0)] == ref.tolist()  # negative indices, as on an array
    done = sh.consumed(new, world, steps, policy, even)
    assert list(done) == old_consumed(old, world, steps, policy, even).tolist()

    # RankShare: the same state, and the same samples after loading it on another world size
    src = stoker.SampleList([stoker.Sample(f"x{i}.zarr", [(0, 1)]) for i in range(n)])
    view = src.for_rank(0, world, policy, even)
    view.cursor.place(0, segments, steps)
    state = view.state_dict()
    assert state["position"] == old_position(n, segments, world, policy, even, steps)
    assert state["segments"] == segments and state["steps"] == steps
    again = src.for_rank(world - 1, world, sh.POLICIES[steps % 2], sh.EVEN[n % 2])
    runs = segments + [[world, policy, even, steps]]
    fits = all(r[3] <= sh.per_rank(len(old_remaining_after(n, runs[:k])), r[0], r[2]) for k, r in enumerate(runs))
    if not fits:  # more consumed than a run's share: not a state of this list (another one's, or edited)
        with pytest.raises(InvalidArgument, match="does not fit"):
            again.load_state_dict(state)
        return
    again.load_state_dict(state)
    if (again.policy, again.even) == (policy, even):  # the same split: continued exactly, its wrapped tail too
        ref = old_rank_positions(old, world - 1, world, policy, even)[steps:]
    else:  # another split: what is left, split anew
        after = segments + ([[world, policy, even, steps]] if steps else [])
        ref = old_rank_positions(old_remaining_after(n, after), world - 1, world, again.policy, again.even)
    assert [s.uri for s in again] == [f"x{i}.zarr" for i in ref.tolist()]


def test_examples_and_edges():
    assert list(sh.rank_positions(sh.Positions.range(10), 1, 3, "strided", "wrap")) == [1, 4, 7, 0]
    assert sh.consumed(sh.Positions.range(10), 3, 2, "strided", "wrap").intervals == [(0, 6)]
    empty = sh.rank_positions(sh.Positions.range(0), 0, 4, "contiguous", "wrap")
    assert len(empty) == 0 and list(empty) == [] and empty.to_array().dtype == np.int64
    with pytest.raises(IndexError):
        sh.Positions.range(3)[3]


def test_huge_epochs_are_a_few_intervals():
    """2**62 positions, resumed twice on other world sizes: the state is a handful of intervals."""
    n = 2**62
    segments = [[3, "contiguous", "wrap", 5], [7, "strided", "drop", 11], [2, "contiguous", "drop", 2**40]]
    rem = sh.remaining_after(n, segments)
    assert len(rem.intervals) <= 8
    # the contiguous run took [r*m, r*m+5) for m = ceil(n/3); the strided one the next 77 of what was left
    m = -(-n // 3)
    took = {p for r in range(3) for p in range(r * m, r * m + 5)}
    left = (p for p in range(2 * m + 200) if p not in took)
    skipped = [next(left) for _ in range(77)]
    assert skipped[-1] == 81 and sh.remaining_after(n, segments[:2])[0] == 82
    mine = sh.rank_positions(rem, 4, 5, "strided", "wrap")
    assert len(mine) == -(-len(rem) // 5) and mine[0] == rem[4]
    assert mine[-1] == rem[(4 + (len(mine) - 1) * 5) % len(rem)]


# -- the names of the layout before "partition" and the folders by layer: gone, never released -----


def test_the_unreleased_old_names_are_gone():
    """0.1.0 was never published: the old module paths (stoker.shard, stoker.sources...), ShardedSource and
    .shard() were removed rather than kept as aliases (CHANGELOG.md)."""
    for old in ("stoker.shard", "stoker.sources", "stoker.pin", "stoker.engine.device"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(AttributeError):
        stoker.ShardedSource  # noqa: B018
    with pytest.raises(AttributeError):
        stoker.sampling.samplers.ShardedSource  # noqa: B018
    from stoker.records import ZarrRecords

    assert not hasattr(stoker.SampleSource, "shard") and not hasattr(ZarrRecords, "shard")
