"""Sample sources: deterministic global orders, rank sharding, resumable and elastic state."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.sampling import partition as sh

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    a = zarr.create_array(str(root / "a.zarr"), shape=(24, 40), chunks=(8, 8), dtype="uint16")
    a[:] = np.arange(24 * 40, dtype="uint16").reshape(24, 40)
    b = zarr.create_array(str(root / "b.zarr"), shape=(16, 16), chunks=(8, 8), dtype="uint16")
    b[:] = 7
    return [str(root / "a.zarr"), str(root / "b.zarr")]


def _epoch(src, epoch):
    return [src.sample(epoch, i) for i in range(len(src))]


def test_global_order_depends_only_on_seed_and_epoch(arrays):
    a = stoker.RandomCrops(arrays, (4, 4), seed=3, samples_per_epoch=200)
    b = stoker.RandomCrops(arrays, (4, 4), seed=3, samples_per_epoch=200)
    assert _epoch(a, 0) == _epoch(b, 0) and _epoch(a, 1) == _epoch(b, 1)
    assert _epoch(a, 0) != _epoch(a, 1)
    assert _epoch(a, 0) != _epoch(stoker.RandomCrops(arrays, (4, 4), seed=4, samples_per_epoch=200), 0)
    assert a.sample(1, 1500 % 200) == b.sample(1, 1500 % 200)  # any index is reachable directly
    g = stoker.TileGrid(arrays, (4, 4), shuffle=True, seed=1)
    assert sorted(map(repr, _epoch(g, 0))) == sorted(map(repr, _epoch(g, 1))) and _epoch(g, 0) != _epoch(g, 1)
    # a shuffled grid's order is its seed's too: the same seed in another grid gives it, another seed does not
    assert _epoch(stoker.TileGrid(arrays, (4, 4), shuffle=True, seed=1), 0) == _epoch(g, 0)
    other = stoker.TileGrid(arrays, (4, 4), shuffle=True, seed=2)
    assert sorted(map(repr, _epoch(other, 0))) == sorted(map(repr, _epoch(g, 0))) and _epoch(other, 0) != _epoch(g, 0)


def test_random_crops_in_bounds_and_weighted(arrays):
    src = stoker.RandomCrops(arrays, (4, 6), seed=0, samples_per_epoch=3000)
    shapes = {arrays[0]: (24, 40), arrays[1]: (16, 16)}
    counts = {u: 0 for u in arrays}
    for s in _epoch(src, 0):
        assert s.shape == (4, 6)
        assert all(0 <= a and b <= n for (a, b), n in zip(s.aabb, shapes[s.uri]))
        counts[s.uri] += 1
    expected = 24 * 40 / (24 * 40 + 16 * 16)  # weighted by volume
    assert abs(counts[arrays[0]] / 3000 - expected) < 0.04
    only_b = stoker.RandomCrops(arrays, (4, 4), weights=[0, 1], samples_per_epoch=50)
    assert {s.uri for s in _epoch(only_b, 0)} == {arrays[1]}
    with pytest.raises(stoker.InvalidArgument):
        stoker.RandomCrops(arrays, (32, 32))  # b cannot hold it


def test_tile_grid_covers_every_tile_once(arrays):
    g = stoker.TileGrid(arrays, (8, 8))
    tiles = _epoch(g, 0)
    assert len(tiles) == 3 * 5 + 2 * 2 == len(set(tiles))
    strided = stoker.TileGrid(arrays[:1], (8, 8), stride=(4, 16))
    assert len(strided) == 5 * 3


@pytest.mark.parametrize("policy", sh.POLICIES)
@pytest.mark.parametrize("even", sh.EVEN)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_disjoint_complete_equal(arrays, policy, even, world):
    src = stoker.SampleList(_epoch(stoker.RandomCrops(arrays, (4, 4), samples_per_epoch=23), 0), shuffle=True)
    order = _epoch(src, 0)
    parts = [list(src.for_rank(r, world, policy, even)) for r in range(world)]
    assert len({len(p) for p in parts}) == 1  # equal counts: no rank waits in a collective
    flat = [s for p in parts for s in p]
    if even == "drop":
        assert len(flat) == len(set(map(id, flat))) and len(flat) == 23 // world * world
        positions = sorted(order.index(s) for s in flat)
        assert len(set(positions)) == len(positions)  # disjoint
    else:
        assert set(map(repr, flat)) == set(map(repr, order))  # complete; wrapped ones repeat the start
        assert len(flat) == -(-23 // world) * world


def test_state_dict_and_fingerprint(arrays):
    src = stoker.RandomCrops(arrays, (4, 4), seed=5, samples_per_epoch=40).for_rank(1, 2)
    state = src.state_dict()
    assert {"epoch", "position", "seed", "world_size", "rank", "fingerprint"} <= state.keys()
    assert (state["rank"], state["world_size"], state["seed"], state["position"]) == (1, 2, 5, 0)
    other = stoker.RandomCrops(arrays, (4, 4), seed=6, samples_per_epoch=40).for_rank(1, 2)
    with pytest.raises(stoker.InvalidArgument, match="another sample list"):
        other.load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), w1=st.integers(1, 4), w2=st.integers(1, 4), w3=st.integers(1, 4),
       k1=st.integers(0, 20), k2=st.integers(0, 20), policy=st.sampled_from(sh.POLICIES),
       policy2=st.sampled_from(sh.POLICIES))
def test_elastic_resume_covers_the_rest_exactly_once(n, w1, w2, w3, k1, k2, policy, policy2):
    """Run on w1 ranks for k1 steps, resume on w2 for k2 steps, then on w3 to the end of the epoch."""
    src = stoker.SampleList([stoker.Sample(f"x{i}.zarr", [(0, 1)]) for i in range(n)])
    seen = []
    state = None
    for world, steps, pol in ((w1, k1, policy), (w2, k2, policy2), (w3, None, policy)):
        views = [src.for_rank(r, world, pol, "drop") for r in range(world)]
        for v in views:
            if state is not None:
                v.load_state_dict(state)
        available = len(views[0])  # what each rank has left (iterating advances it)
        its = [iter(v) for v in views]
        m = available if steps is None else min(steps, available)
        for it in its:
            seen += [next(it) for _ in range(m)]
        state = its[0].state_after(m)
        finished = m == available  # this run reached the end of the epoch (its dropped tail is not carried)
        assert state["position"] == (n if finished else len(seen))  # counts every rank's samples
    assert len(seen) == len(set(seen))  # nothing repeated
    # with "drop" each run may drop fewer than `world` samples of what is left; nothing else is missing
    assert n - len(seen) < max(w1, w2, w3)


def _arrays_data(arrays):
    return {u: zarr.open_array(u, mode="r")[:] for u in arrays}


def test_pipeline_resume_after_k_batches_equals_uninterrupted(arrays):
    data = _arrays_data(arrays)
    cfg = stoker.Config(batch_size=4, dtype="native", host_buffer_bytes=8 << 20, lookahead_batches=3, device="cpu",
                        n_compute_threads=2, n_io_threads=1)
    make = lambda: stoker.RandomCrops(arrays, (4, 4), seed=9, samples_per_epoch=48).for_rank(0, 1)  # noqa: E731
    with stoker.Pipeline(cfg) as p:
        p.push(make())
        full = [(b.samples, torch.from_dlpack(b).clone()) for b in p]
    assert len(full) == 12
    with stoker.Pipeline(cfg) as p:
        p.push(make())
        for _ in range(5):
            with p.pop():
                pass
        state = p.state_dict()  # the lookahead has pulled further; the state must not count it
    assert state["batches"] == 5 and state["sources"][0]["position"] == 20
    src = make()
    src.load_state_dict(state["sources"][0])
    with stoker.Pipeline(cfg) as p:
        p.push(src)
        rest = [(b.samples, torch.from_dlpack(b).clone()) for b in p]
    assert len(rest) == 7
    for (s1, x1), (s2, x2) in zip(full[5:], rest):
        assert s1 == s2 and torch.equal(x1, x2)
        for row, s in enumerate(s2):
            assert np.array_equal(x2[row].numpy(), data[s.uri][tuple(slice(a, b) for a, b in s.aabb)])


def test_forever_crosses_epochs_and_state_follows(arrays):
    src = stoker.RandomCrops(arrays, (4, 4), seed=2, samples_per_epoch=10).for_rank(0, 1)
    it = src.forever()
    first = [next(it) for _ in range(25)]
    assert first[:10] == _epoch(src.source, 0) and first[10:20] == _epoch(src.source, 1)
    state = it.state_after(25)
    assert (state["epoch"], state["position"]) == (2, 5)
    again = src.source.for_rank(0, 1)
    again.load_state_dict(state)
    assert next(iter(again)) == src.source.sample(2, 5)


# -- real process groups ------------------------------------------------------------------------


def _tiles(arrays):
    """A grid's tiles as a shuffled SampleList: a grid itself refuses even="drop", which these tests split by."""
    return stoker.SampleList(list(stoker.TileGrid(arrays, (4, 4))), shuffle=True, seed=4)


def _ranks_main(rank, world, init_file, arrays, out_dir, mode):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        src = _tiles(arrays)
        view = src.for_rank(policy="strided", even="drop")  # rank and world size from the process group
        assert (view.rank, view.world_size) == (rank, world)
        if mode == "resume":
            import json

            with open(os.path.join(out_dir, "state.json")) as f:
                view.load_state_dict(json.load(f))
        mine = [repr(s) for s in view]
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            import json

            with open(os.path.join(out_dir, f"{mode}-{world}.json"), "w") as f:
                json.dump(gathered, f)
        if mode == "first":  # stop after 3 samples per rank and save the state, as a checkpoint would
            it = iter(src.for_rank(policy="strided", even="drop"))
            for _ in range(3):
                next(it)
            if rank == 0:
                import json

                with open(os.path.join(out_dir, "state.json"), "w") as f:
                    json.dump(it.state_after(3), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_process_group_shards_are_disjoint_complete_equal(arrays, tmp_path, world):
    import json

    torch.multiprocessing.spawn(_ranks_main, args=(world, str(tmp_path / "init"), arrays, str(tmp_path), "all"),
                                nprocs=world, join=True)
    parts = json.loads((tmp_path / f"all-{world}.json").read_text())
    src = _tiles(arrays)
    order = [repr(s) for s in _epoch(src, 0)]
    flat = [s for p in parts for s in p]
    assert len({len(p) for p in parts}) == 1
    assert len(flat) == len(set(flat)) == len(order) // world * world
    assert set(flat) <= set(order)


def test_elastic_resume_two_to_three_processes(arrays, tmp_path):
    import json

    torch.multiprocessing.spawn(_ranks_main, args=(2, str(tmp_path / "init2"), arrays, str(tmp_path), "first"),
                                nprocs=2, join=True)
    torch.multiprocessing.spawn(_ranks_main, args=(3, str(tmp_path / "init3"), arrays, str(tmp_path), "resume"),
                                nprocs=3, join=True)
    src = _tiles(arrays)
    order = [repr(s) for s in _epoch(src, 0)]
    first = [repr(s) for r in range(2) for s in list(src.for_rank(r, 2, "strided", "drop"))[:3]]
    rest = [s for p in json.loads((tmp_path / "resume-3.json").read_text()) for s in p]
    together = first + rest
    assert len(together) == len(set(together))  # nothing twice
    assert len(order) - len(together) < 3  # only the "drop" tail of the 3-rank run is left out


# -- constant memory ----------------------------------------------------------------------------

_HUGE = r"""
import resource, sys
import stoker

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

big, huge = sys.argv[1:]
stoker.RandomCrops([big], (8, 8, 8), samples_per_epoch=10).for_rank(0, 2).state_dict()  # imports, caches
base = peak()
sources = [
    stoker.RandomCrops([big], (8, 8, 8), seed=1),  # 2**27 crops tile it once: the epoch's default length
    stoker.TileGrid([big], (8, 8, 8), shuffle=True, seed=1),  # 2**27 tiles, shuffled
    stoker.RandomCrops([huge], (8, 8, 8), seed=1, samples_per_epoch=2**62),
    stoker.TileGrid([huge], (8, 8, 8), stride=(2**20,) * 3, shuffle=True, seed=1),  # (2**20 + 1)**3 tiles
]
assert len(sources[0]) == len(sources[1]) == 2**27 and len(sources[3]) == (2**20 + 1)**3, [len(s) for s in sources]
for src in sources:
    n = len(src)
    for policy in ("strided", "contiguous"):
        it = iter(src.for_rank(1, 3, policy, "wrap"))
        first = [next(it) for _ in range(5)]
        assert all(0 <= a and b <= 2**40 for s in first for a, b in s.aabb)
        state = it.state_after(5)
        assert state["position"] == 15, state
        even = "wrap" if isinstance(src, stoker.TileGrid) else "drop"  # a grid refuses to drop tiles
        again = src.for_rank(2, 5, "strided", even)
        again.load_state_dict(state)
        assert len(again) == ((n - 15) // 5 if even == "drop" else -(-(n - 15) // 5))
        it = iter(again)
        rest = [next(it) for _ in range(3)]
        if policy == "strided":  # 3 ranks took positions 0..14; rank 2 of 5 goes on at 17, 22, 27
            assert rest == [src.sample(0, p) for p in (17, 22, 27)], (rest, [src.sample(0, p) for p in (17, 22, 27)])
        assert not set(rest) & set(first)
        assert again.state_dict()["position"] == 15 + 5 * 3
print(peak() - base)
"""


def test_huge_sources_run_in_constant_memory(tmp_path):
    """Sources over 4096**3 and (2**40)**3 voxels with 8**3 crops: construct, shard, iterate, save and resume on
    another world size with a small, fixed amount of memory (the epochs are 2**27 to 2**62 samples long)."""
    import subprocess
    import sys

    zarr.create_array(str(tmp_path / "big.zarr"), shape=(4096,) * 3, chunks=(256,) * 3, dtype="u1")
    zarr.create_array(str(tmp_path / "huge.zarr"), shape=(2**40,) * 3, chunks=(2**20,) * 3, dtype="u1")
    assert os.listdir(tmp_path / "huge.zarr") == ["zarr.json"]  # metadata only: no chunk is written
    out = subprocess.run([sys.executable, "-c", _HUGE, str(tmp_path / "big.zarr"), str(tmp_path / "huge.zarr")],
                         capture_output=True, text=True, timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) < 100 << 20  # peak RSS growth


def test_epochs_too_large_for_positions_are_refused(tmp_path):
    huge = str(tmp_path / "huge.zarr")
    zarr.create_array(huge, shape=(2**40,) * 3, chunks=(2**20,) * 3, dtype="u1")
    with pytest.raises(stoker.InvalidArgument, match="samples_per_epoch") as e:
        stoker.RandomCrops([huge], (8, 8, 8))  # 2**111 crops would tile it once
    assert huge in str(e.value)
    with pytest.raises(stoker.InvalidArgument, match="samples_per_epoch"):
        stoker.RandomCrops([huge], (8, 8, 8), samples_per_epoch=2**62 + 1)
    with pytest.raises(stoker.InvalidArgument, match="stride") as e:
        stoker.TileGrid([huge], (8, 8, 8))
    assert huge in str(e.value)
    assert len(stoker.RandomCrops([huge], (2**20,) * 3)) == 2**60  # the default is a number, not a table


def _old_fingerprint(src, identity):
    """The fingerprint as stoker computed it before shuffled orders carried their version."""
    import hashlib
    import json

    blob = json.dumps([type(src).__name__, identity], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_states_of_the_earlier_shuffled_order_are_refused(arrays):
    """Shuffled orders changed (a seeded bijection, not rng.permutation): a state saved under the old order
    is refused, not resumed into other samples; unshuffled sources keep their fingerprints and states."""
    grid = stoker.TileGrid(arrays, (4, 4), shuffle=True, seed=4)
    old_id = [grid.arrays, grid.shapes, grid.sample_shape, grid.stride, grid.shuffle, grid.seed]
    view = grid.for_rank(0, 2)
    state = {**view.state_dict(), "fingerprint": _old_fingerprint(grid, old_id), "steps": 3}
    with pytest.raises(stoker.InvalidArgument, match="another sample list.*start its epoch again"):
        view.load_state_dict(state)
    samples = [stoker.Sample(f"x{i}.zarr", [(0, 1)]) for i in range(5)]
    listed = stoker.SampleList(samples, shuffle=True, seed=2)
    assert listed.fingerprint != _old_fingerprint(listed, [[s.uri, s.aabb] for s in samples] + [True, 2])

    plain = stoker.TileGrid(arrays, (4, 4), seed=4)
    assert plain.fingerprint == _old_fingerprint(plain, old_id[:4] + [False, 4])
    plain_list = stoker.SampleList(samples, seed=2)
    assert plain_list.fingerprint == _old_fingerprint(plain_list, [[s.uri, s.aabb] for s in samples] + [False, 2])
    crops = stoker.RandomCrops(arrays, (4, 4), seed=5, samples_per_epoch=40)
    assert crops.fingerprint == _old_fingerprint(crops, [crops.arrays, crops.shapes, crops.sample_shape,
                                                         crops.weights.round(12).tolist(), 40, 5])


def _count_identities(monkeypatch, cls):
    """Counts the identity computations of ``cls`` (each one a JSON dump of what the source is made of)."""
    calls = []
    original = cls.identity
    monkeypatch.setattr(cls, "identity", lambda self: calls.append(1) or original(self))
    return calls


def test_state_dict_of_a_long_sample_list_computes_its_fingerprint_once(monkeypatch):
    """A SampleList of 200,000 samples: its fingerprint (a JSON dump and SHA-256 of every sample) is computed
    at the first state, not at every one, and its value is the one states were saved with before."""
    samples = [stoker.Sample("/data/hourly.zarr", [(i, i + 24), (0, 8)]) for i in range(200_000)]
    calls = _count_identities(monkeypatch, stoker.SampleList)
    src = stoker.SampleList(samples)
    share = src.for_rank(0, 2)
    first = share.state_dict()
    it = iter(share)
    for _ in range(100):
        next(it)
        assert it.state_after(1)["fingerprint"] == first["fingerprint"]
        assert share.state_dict()["fingerprint"] == first["fingerprint"]
    share.load_state_dict(first)
    assert len(calls) == 1
    assert first["fingerprint"] == _old_fingerprint(src, [[s.uri, s.aabb] for s in samples] + [False, 0])
    src.samples.append(samples[0])  # another list (a longer one): fingerprinted anew
    assert src.fingerprint != first["fingerprint"] and len(calls) == 2


class _Every(stoker.SampleSource):
    """A source of one's own with public methods only: every ``step``-th row of an array."""

    def __init__(self, uri, n, step, rows=2):
        self.uri, self.n, self.step, self.rows = uri, n, step, rows

    def __len__(self):
        return self.n

    def sample(self, epoch, index):
        start = (index * self.step + epoch) % 20
        return stoker.Sample(self.uri, [(start, start + self.rows), (0, 4)])


def test_a_source_of_ones_own_saves_and_resumes_through_a_pipeline(arrays):
    """A subclass with public methods only: its default identity is its attributes; its states and a
    pipeline's carry its fingerprint and resume; another step is another sample list."""
    src = _Every(arrays[0], 12, 3)
    assert src.identity() == {"len": 12, "seed": 0, "fields": {"uri": arrays[0], "n": 12, "step": 3, "rows": 2}}
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, host_buffer_bytes=4 << 20)
    share = src.for_rank(0, 1)
    with stoker.Pipeline(cfg) as p:
        p.push(share)
        first = [torch.from_dlpack(p.pop()).clone() for _ in range(2)]
        state = p.state_dict()["sources"][0]
    assert state["fingerprint"] == src.fingerprint and state["position"] == 4
    resumed = _Every(arrays[0], 12, 3).for_rank(0, 1)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest == [src.sample(0, i) for i in range(4, 12)]
    assert first[0][0].numpy().tolist() == np.arange(24 * 40).reshape(24, 40)[0:2, 0:4].tolist()
    with pytest.raises(stoker.InvalidArgument, match="another sample list"):
        _Every(arrays[0], 12, 5).for_rank(0, 1).load_state_dict(state)


class _Holding(_Every):
    def __init__(self, uri, n):
        super().__init__(uri, n, 1)
        self.reader = stoker.open_array(uri)  # not plain data: the default identity cannot describe it


class _Described(_Holding):
    def identity(self):
        return [self.uri, self.n]


class _Lengthless(stoker.SampleSource):
    def sample(self, epoch, index):
        return stoker.Sample("/data/a.zarr", [(0, 1)])


def test_a_source_lacking_what_is_needed_gets_a_typed_error_naming_it(arrays):
    with pytest.raises(stoker.IncompleteSource, match=r"does not implement identity\(\).*_Holding.reader is of type ArrayReader") as e:
        _Holding(arrays[0], 4).for_rank(0, 1).state_dict()
    assert e.value.method == "identity" and isinstance(e.value, NotImplementedError)
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, host_buffer_bytes=4 << 20)
    with pytest.raises(stoker.IncompleteSource, match="_Holding.reader"):
        stoker.CropDataset(_Holding(arrays[0], 4), cfg)  # at construction, not at the first checkpoint
    with stoker.Pipeline(cfg) as p:
        p.push(_Holding(arrays[0], 4).for_rank(0, 1))  # reads: only saving a position needs the identity
        p.pop().release()
        with pytest.raises(stoker.IncompleteSource, match="_Holding.reader"):
            p.state_dict()
    assert _Described(arrays[0], 4).for_rank(0, 1).state_dict()["fingerprint"]
    with pytest.raises(stoker.IncompleteSource, match=r"_Lengthless does not implement __len__\(\)") as e:
        _Lengthless().for_rank(0, 1)
    assert e.value.method == "__len__"
    with pytest.raises(stoker.IncompleteSource, match=r"does not implement sample\(\)"):
        stoker.SampleSource.sample(_Lengthless(), 0, 0)


@pytest.mark.parametrize("policy", sh.POLICIES)
@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_a_resume_on_the_same_split_continues_exactly_its_wrapped_tail_too(policy, steps):
    """10 samples on 3 ranks: 4 each, the short ranks wrap to the start. A state saved after ``steps`` samples
    and loaded on the same split gives every rank the rest of its uninterrupted share, the wrapped samples
    included (before, the saved run's rest was split anew, and a short rank wrapped into it instead)."""
    src = stoker.SampleList([stoker.Sample(f"x{i}.zarr", [(0, 1)]) for i in range(10)], shuffle=True, seed=2)
    states = []
    for rank in range(3):
        it = iter(src.for_rank(rank, 3, policy))
        for _ in range(steps):
            next(it)
        states.append(it.state_after(steps))
    for rank in range(3):
        whole = list(src.for_rank(rank, 3, policy))
        for state in (states[rank], states[0]):  # its own state, or rank 0's (the ranks are in lockstep)
            resumed = src.for_rank(rank, 3, policy)
            resumed.load_state_dict(state)
            assert list(resumed) == whole[steps:]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n, world, even", [(2, 3, "drop"), (0, 1, "wrap"), (0, 2, "drop")])
def test_an_endless_share_with_no_sample_an_epoch_is_refused_not_spun(arrays, n, world, even):
    """2 samples on 3 ranks with even="drop" give every rank 0 samples an epoch: forever() looked for the next
    sample epoch after epoch without end, on the pipeline's thread (a PoolStarved that blamed a slow iterable,
    the thread spinning on after close, or a hang without pop_timeout_s)."""
    from stoker.train import CropBatches

    src = stoker.SampleList([stoker.Sample(arrays[0], [(0, 2), (0, 2)])] * n)
    share = src.for_rank(world - 1, world, even=even)
    with pytest.raises(stoker.InvalidArgument, match="no samples"):
        share.forever()
    cfg = stoker.Config(batch_size=1, dtype="native", device="cpu", n_compute_threads=1, host_buffer_bytes=8 << 20,
                        pop_timeout_s=None)
    with CropBatches(share, cfg) as data, pytest.raises(stoker.InvalidArgument, match="no samples"):
        iter(data)
    assert list(share) == []  # one epoch of nothing is no error
