"""EpochCursor and its state: one cursor for the crop samplers (RankShare) and the records Loader.

The literal states below were saved by stoker before the cursor (a RankShare state had no format or
version; a Loader state was ``stoker-records-loader`` version 1), with what the code of then read after
loading them; they must resume the same way.
"""

from __future__ import annotations

import json

import pytest
import torch

import stoker
from stoker.sampling.cursor import FORMAT, VERSION, CursorState, EpochCursor, Run
from stoker.errors import InvalidArgument
from stoker.records import Loader

pytestmark = pytest.mark.timeout(60)

# RankShare.state_dict() before the cursor: an earlier contiguous run on 3 ranks, then 4 samples on 2.
OLD_SHARE_STATE = {"epoch": 0, "position": 14, "seed": 3, "world_size": 2, "rank": 0,
                   "fingerprint": "cd633c1b8c5971a2", "policy": "strided", "even": "drop", "steps": 4,
                   "segments": [[3, "contiguous", "wrap", 2]]}
# Loader.state_dict() before the cursor: rank 1 of 3 after two batches of 2 in epoch 2.
OLD_LOADER_STATE = {"format": "stoker-records-loader", "version": 1, "epoch": 2, "segments": [], "world_size": 3,
                    "even": "wrap", "steps": 4, "rank": 1, "seed": 5, "shuffle": True, "size": 17, "names": None}


def _samples():
    return stoker.SampleList([stoker.Sample("/a.zarr", [(i, i + 1)]) for i in range(23)], shuffle=True, seed=3)


class Seq:
    def __len__(self):
        return 17

    def __getitem__(self, i):
        return {"i": torch.tensor([i])}


def _loader(rank, world, **kw):
    return Loader(Seq(), batch_size=2, seed=5, rank=rank, world_size=world, n_threads=1, **kw)


# -- states saved before the cursor -----------------------------------------------------------------


@pytest.mark.parametrize("rank, world, policy, even, want", [
    (2, 4, "strided", "wrap", [10, 17, 21]),
    (0, 2, "strided", "drop", [12, 10, 3, 17]),
    (1, 3, "contiguous", "drop", [13, 3, 11]),
])
def test_an_old_rank_share_state_resumes_as_before(rank, world, policy, even, want):
    view = _samples().for_rank(rank, world, policy, even)
    view.load_state_dict(OLD_SHARE_STATE)
    assert [s.aabb[0][0] for s in view] == want and view.state_dict()["position"] == 23


@pytest.mark.parametrize("rank, world, kw, want, steps", [
    (1, 3, {}, [[1, 14]], 6),                        # the same split: continued exactly
    (0, 2, {}, [[11, 10], [14]], 3),                 # another world size: what is left, split anew
    (1, 3, {"drop_last": True}, [], 1),              # another split of the same world size
])
def test_an_old_loader_state_resumes_as_before(rank, world, kw, want, steps):
    with _loader(rank, world, **kw) as loader:
        loader.load_state_dict(OLD_LOADER_STATE)
        assert [b["i"].tolist() for b in loader] == want
        assert loader.state_dict()["steps"] == steps and loader.epoch == 2


def test_old_states_read_into_the_typed_state():
    share = CursorState.from_dict(OLD_SHARE_STATE)
    assert (share.epoch, share.world_size, share.policy, share.even, share.steps, share.position) == \
        (0, 2, "strided", "drop", 4, 14)
    assert share.segments == (Run(3, "contiguous", "wrap", 2),)
    assert share.order == {"seed": 3, "fingerprint": "cd633c1b8c5971a2"}
    loader = CursorState.from_dict(OLD_LOADER_STATE)
    assert (loader.policy, loader.position, loader.order["size"]) == ("strided", None, 17)


# -- the current state ------------------------------------------------------------------------------


def test_states_are_versioned_and_round_trip_through_json():
    view = _samples().for_rank(1, 3, "contiguous", "wrap")
    it = iter(view)
    next(it)
    state = it.state_after(1)
    assert (state["format"], state["version"]) == (FORMAT, VERSION)
    assert CursorState.from_dict(json.loads(json.dumps(state))).to_dict() == state
    with _loader(1, 3) as loader:
        next(iter(loader))
        saved = loader.state_dict()
        assert (saved["format"], saved["version"], saved["steps"]) == (FORMAT, VERSION, 2)
        assert CursorState.from_dict(json.loads(json.dumps(saved))).to_dict() == saved


def test_what_was_consumed_not_what_was_produced():
    """The state counts the samples consumed; a resumed run on another world size takes the rest once."""
    cursor = EpochCursor(10, rank=1, world_size=3)
    assert list(cursor.share()) == [1, 4, 7, 0]
    state = cursor.after(2).state({})
    assert (state.epoch, state.steps, state.position) == (0, 2, 6)
    assert cursor.after(4, forever=True).state({}).epoch == 1  # a whole share: the next epoch
    rest = []
    for rank in range(2):
        other = EpochCursor(10, rank, 2)
        other.load(state, keep_split=True)  # another world size: split anew
        rest += list(other.share())[other.steps:]
    assert sorted(rest) == [6, 7, 8, 9]


@pytest.mark.parametrize("bad, match", [
    ({"epoch": 0}, "format"),
    ({**OLD_LOADER_STATE, "version": 7}, "version 7"),
    ({"format": FORMAT, "version": 3, "epoch": 0}, "version 3"),
    ({**OLD_SHARE_STATE, "steps": "many"}, "malformed"),
    ({**OLD_SHARE_STATE, "even": "sometimes"}, "even='sometimes'"),
    ({**OLD_SHARE_STATE, "segments": [[0, "strided", "wrap", 1]]}, "world_size >= 1"),
    ({**OLD_SHARE_STATE, "epoch": -1}, "epoch=-1"),
    ({**OLD_SHARE_STATE, "rank": 2, "world_size": 2}, "rank=2"),
    ([1, 2], "dict"),
])
def test_bad_states_name_what_is_wrong(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        CursorState.from_dict(bad)


@pytest.mark.parametrize("runs, steps", [([], 5), ([], 10**6), ([(2, "strided", "wrap", 100)], 0),
                                         ([(3, "contiguous", "wrap", 3)], 2), ([(2, "strided", "drop", 5)], 1)])
def test_a_state_that_does_not_fit_the_dataset_is_refused_on_load(runs, steps):
    # (10 samples on 2 ranks: 5 each; after 3 on each of 3 ranks, 1 left (1 a rank); a finished "drop" run: none)
    state = CursorState(0, 2, 0, "strided", "wrap", steps, tuple(Run(*r) for r in runs))
    fits = not runs and steps == 5
    for keep_split in (True, False):
        cursor = EpochCursor(10, 0, 2)
        if fits:
            cursor.load(state, keep_split)  # a whole share is an epoch's end, not too much
            continue
        with pytest.raises(InvalidArgument, match="does not fit a dataset of 10 samples"):
            cursor.load(state, keep_split)


def test_a_loader_refuses_a_state_past_its_dataset_as_invalid():
    with _loader(0, 1) as loader:
        state = loader.state_dict()
        with pytest.raises(InvalidArgument, match="does not fit"):
            loader.load_state_dict({**state, "steps": 10**6})


def test_a_state_of_the_other_kind_is_refused():
    with _loader(0, 1) as loader, pytest.raises(InvalidArgument, match="not a stoker.records.Loader"):
        loader.load_state_dict(_samples().for_rank(0, 1).state_dict())
    with pytest.raises(InvalidArgument, match="another sample list"):
        _samples().for_rank(0, 1).load_state_dict(_loader(0, 1).state_dict())
