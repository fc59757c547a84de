"""``stoker.CropDataset`` in ``torch.utils.data.DataLoader`` and torchdata's ``StatefulDataLoader``: batches
equal to the zarr-python oracle, safe zero-copy hand-over, exact resume, epochs, and the refusal of worker
processes."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader

import stoker

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    rng = np.random.default_rng(5)
    uris = []
    for name, dtype in (("t2m", "float32"), ("u10", "int16")):
        z = zarr.create_array(str(root / f"{name}.zarr"), shape=(12, 40, 40), chunks=(4, 16, 16), dtype=dtype)
        z[:] = rng.normal(0, 50, z.shape).astype(dtype)
        uris.append(str(root / f"{name}.zarr"))
    return uris, [zarr.open_array(u, mode="r")[:] for u in uris]


def _source(uris):
    return stoker.RandomCrops([uris], (4, 8, 8), seed=1, samples_per_epoch=24)


CFG = dict(batch_size=4, dtype="f32", device="cpu", n_compute_threads=2, host_buffer_bytes=16 << 20,
           pop_timeout_s=20.0)


def _oracle(data, samples):
    return np.stack([np.stack([d[tuple(slice(*ax) for ax in s.aabb)] for d in data]).astype("f4") for s in samples])


def _epoch_samples(uris, epoch):
    src = _source(uris)
    return [src.sample(epoch, i) for i in range(24)]


def test_dataloader_yields_the_batches_and_epochs_advance(group, decode_path):
    uris, data = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**CFG))
    loader = DataLoader(ds, batch_size=None)
    assert len(loader) == 6
    for epoch in range(2):
        got = [x.clone() for x in loader]  # zero-copy views, each dropped after its copy
        want = _oracle(data, _epoch_samples(uris, epoch))
        assert len(got) == 6 and all(x.shape == (4, 2, 4, 8, 8) for x in got)
        assert np.array_equal(torch.cat(got).numpy(), want)
    assert ds.state_dict()["epoch"] == 2 and len(ds) == 6


def test_a_loop_that_stops_early_continues_where_it_stopped(group):
    uris, data = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**CFG), copy=True)
    first = []
    for x in DataLoader(ds, batch_size=None):
        first.append(x)
        if len(first) == 2:
            break
    assert ds.state_dict()["position"] == 8 and len(ds) == 4
    rest = list(DataLoader(ds, batch_size=None))
    assert np.array_equal(torch.cat(first + rest).numpy(), _oracle(data, _epoch_samples(uris, 0)))


def test_set_epoch_starts_that_epoch_from_its_first_batch(group):
    """set_epoch(e), as a training loop calls it before each epoch (docs/dataloader.md): the next iter() yields
    epoch e's batches from its first, also when called mid-epoch and when going back to an earlier epoch."""
    uris, data = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**CFG), copy=True)
    it = iter(DataLoader(ds, batch_size=None))
    next(it)  # mid-epoch 0: set_epoch ends this iteration
    for epoch in (3, 1):
        ds.set_epoch(epoch)
        assert (ds.state_dict()["epoch"], ds.state_dict()["position"], len(ds)) == (epoch, 0, 6)
        got = list(DataLoader(ds, batch_size=None))
        assert np.array_equal(torch.cat(got).numpy(), _oracle(data, _epoch_samples(uris, epoch)))
    del it


def test_the_usual_epoch_loop_after_a_resume_repeats_and_skips_nothing(group):
    """load_state_dict, then ``for epoch in range(saved, n): ds.set_epoch(epoch)`` (the loop every training
    script has): the resumed epoch continues after the checkpoint's batch, as an uninterrupted run; a
    checkpoint at an epoch's end leaves that epoch nothing; set_epoch once an iteration has started starts the
    epoch again."""
    uris, data = group
    cfg = stoker.Config(**CFG)
    for consumed in (2, 6):
        ds = stoker.CropDataset(_source(uris).for_rank(0, 1), cfg, copy=True)
        ds.set_epoch(1)
        before = []
        for x in DataLoader(ds, batch_size=None):
            before.append(x)
            if len(before) == consumed:
                saved = ds.state_dict()  # as a checkpoint inside the loop takes it
                break
        resumed = stoker.CropDataset(_source(uris).for_rank(0, 1), cfg, copy=True)
        resumed.load_state_dict(saved)
        after = {}
        for epoch in (1, 2):
            resumed.set_epoch(epoch)
            after[epoch] = list(DataLoader(resumed, batch_size=None))
        got = torch.cat(before + after[1]).numpy() if after[1] else torch.cat(before).numpy()
        assert np.array_equal(got, _oracle(data, _epoch_samples(uris, 1)))
        assert np.array_equal(torch.cat(after[2]).numpy(), _oracle(data, _epoch_samples(uris, 2)))
        resumed.set_epoch(2)  # iterated since the load: epoch 2 again, from its first batch
        assert len(resumed) == 6


def test_a_rank_share_resumed_in_the_usual_loop_continues_its_epoch(group):
    uris, _ = group
    whole = [s.aabb for s in _source(uris).for_rank(0, 1)]  # epoch 0 uninterrupted
    share = _source(uris).for_rank(0, 1)
    it = iter(share)
    head = [next(it).aabb for _ in range(5)]
    saved = it.state_after(5)  # (what a pipeline reports after 5 samples popped)
    resumed = _source(uris).for_rank(0, 1)
    resumed.load_state_dict(saved)
    resumed.set_epoch(0)  # kept: the loaded position
    assert head + [s.aabb for s in resumed] == whole
    resumed.set_epoch(0)  # iterated since: the epoch from its first sample
    assert [s.aabb for s in resumed] == whole


def test_zero_copy_batches_are_not_overwritten_while_held(group):
    """Holding every batch of a zero-copy dataset: the slots are not reused under them, so the pipeline runs
    out of slots and says so (PoolStarved naming the fix) rather than overwrite one."""
    uris, _ = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**{**CFG, "pop_timeout_s": 1.0}))
    held = []
    with pytest.raises(stoker.PoolStarved, match="clone"):
        for x in DataLoader(ds, batch_size=None):
            held.append((x, x.clone()))
    assert len(held) == 3  # lookahead_batches + 1 slots
    assert all(torch.equal(x, copy) for x, copy in held)


def test_a_dataloader_batch_size_that_holds_every_slot_is_named(group):
    """DataLoader(ds, batch_size=4) keeps 4 zero-copy batches to collate them, more than the 3 slots: the
    PoolStarved says to pass batch_size=None, not only to release batches the loop never held."""
    uris, _ = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**{**CFG, "pop_timeout_s": 1.0}))
    with pytest.raises(stoker.PoolStarved, match="batch_size=None") as info:
        next(iter(DataLoader(ds, batch_size=4)))
    assert info.value.consumer_holds_all
    ok = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**{**CFG, "pop_timeout_s": 1.0}))
    assert sum(1 for _ in DataLoader(ok, batch_size=None)) == 6  # each batch dropped before the next


def test_worker_processes_are_refused(group):
    uris, _ = group
    ds = stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**CFG))
    with pytest.raises(stoker.InvalidArgument, match="num_workers=0"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")))


def test_arguments_are_checked(group):
    uris, _ = group
    with pytest.raises(stoker.InvalidArgument, match="SampleSource"):
        stoker.CropDataset([stoker.Sample(uris[0], [(0, 1)] * 3)], stoker.Config(**CFG))
    with pytest.raises(stoker.InvalidArgument, match="Config"):
        stoker.CropDataset(_source(uris), dict(CFG))
    ds = stoker.CropDataset(_source(uris), stoker.Config(**CFG))  # shards by RANK/WORLD_SIZE: one process here
    assert ds.source.world_size == 1 and pickle.loads(pickle.dumps(ds)).state_dict() == ds.state_dict()
    other = stoker.RandomCrops([uris], (4, 8, 8), seed=2, samples_per_epoch=24).for_rank(0, 1)
    with pytest.raises(stoker.InvalidArgument, match="another sample list"):
        ds.load_state_dict(other.state_dict())


@pytest.mark.parametrize("k", [0, 3, 6])
def test_stateful_dataloader_resumes_with_the_next_batch(group, decode_path, k):
    """torchdata's StatefulDataLoader (num_workers=0) saves the dataset's state with its own; a loader made
    afresh from that state (pickled, as in a checkpoint) yields batch k + 1 onward; after a whole epoch (k=6)
    the next epoch."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    uris, data = group
    make = lambda: sdl.StatefulDataLoader(stoker.CropDataset(_source(uris).for_rank(0, 1), stoker.Config(**CFG),  # noqa: E731
                                                             copy=True), batch_size=None)
    loader = make()
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    if k < 6:
        assert len(rest) == 6 - k
        want = _oracle(data, _epoch_samples(uris, 0)[4 * k:])
    else:
        assert len(rest) == 6
        want = _oracle(data, _epoch_samples(uris, 1))
    assert np.array_equal(torch.cat(rest).numpy(), want)


def test_resume_on_another_world_size(group):
    """Two ranks' datasets save after 2 batches each; three ranks resume from that state and take exactly
    the rest of the epoch, once each."""
    uris, _ = group
    states = []
    for rank in range(2):
        ds = stoker.CropDataset(_source(uris).for_rank(rank, 2), stoker.Config(**CFG))
        it = iter(DataLoader(ds, batch_size=None))
        next(it), next(it)
        states.append(ds.state_dict())
    assert states[0]["position"] == 16
    rest = []
    for rank in range(3):
        ds = stoker.CropDataset(_source(uris).for_rank(rank, 3), stoker.Config(**{**CFG, "batch_size": 1}))
        ds.load_state_dict(states[rank % 2])
        assert len(ds) == 3  # 8 samples left, ceil(8 / 3) a rank (wrapped)
        src = ds._positioned()
        rest += list(src)
    samples = _epoch_samples(uris, 0)
    taken = [samples[i] for r in range(2) for i in range(r, 16, 2)]
    assert sorted(map(repr, taken + rest)) == sorted(map(repr, samples + samples[16:17]))  # one wrapped


@pytest.mark.timeout(240)
def test_docs_examples_run(tmp_path, monkeypatch):
    """docs/dataloader.md's examples run as written, in order; the Lightning one where lightning is installed."""
    import re
    from importlib.util import find_spec
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "dataloader.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 9
    lightning = find_spec("lightning") is not None
    monkeypatch.chdir(tmp_path)
    # the examples' datasets, closed at the end: a loop broken out of (StatefulDataLoader keeps its iterator to
    # resume) and a Trainer stopped at max_steps leave their pipelines running for as long as the examples'
    # objects live, and their coordinators then worked through every later test of the process (seen under a
    # test run: 200 ms of "stoker-coordinator" CPU in a later test's window)
    made = []
    real_init = stoker.CropDataset.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(stoker.CropDataset, "__init__", init)
    namespace = {"__name__": "docs"}
    try:
        for block in blocks:
            if "import lightning" in block and not lightning:
                continue
            exec(compile(block, str(page), "exec"), namespace)
    finally:
        for ds in made:
            ds.close()
    assert namespace["state"]["_num_yielded"] == 3
    xs = namespace["xs"]  # the samples of named fields
    assert {k: (tuple(v.shape), v.dtype) for k, v in xs.items()} == {
        "inputs": ((4, 2, 2, 64, 64), torch.float32), "target": ((4, 1, 32, 32), torch.bfloat16)}
    assert namespace["exact"].output_dtype == torch.int64 and namespace["rounded"].lossy_casts
    if lightning:
        assert namespace["trainer"].global_step == 6


def _shares(ctx, ds):
    """A rank's epoch of a dataset built in the parent process, before the process group existed."""
    import torch.distributed as dist

    mine = (len(ds), [x for x in ds])
    out = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return out


@pytest.mark.timeout(120)
def test_a_dataset_built_before_the_process_group_takes_each_ranks_share(group):
    """Built before init_process_group (in the launcher, a LightningDataModule.__init__) it sharded as rank 0
    of 1; in the ranks it takes each rank's share, so two ranks see the epoch once between them."""
    import stoker.train as st

    uris, data = group
    ds = stoker.CropDataset(_source(uris), stoker.Config(**{**CFG, "batch_size": 2}), copy=True)
    assert (ds.source.rank, ds.source.world_size) == (0, 1) and len(ds) == 12
    (n0, b0), (n1, b1) = st.launch(_shares, ds, nprocs=2, use_cuda=False)
    assert n0 == n1 == 6 and len(b0) == len(b1) == 6
    samples = _epoch_samples(uris, 0)
    for rank, batches in ((0, b0), (1, b1)):  # strided: rank r takes samples r, r + 2, ...
        got = torch.cat(batches).numpy()
        np.testing.assert_array_equal(got, _oracle(data, samples[rank::2]))


def test_per_batch_bookkeeping_does_not_refingerprint_the_sample_list(group, monkeypatch):
    """The position CropDataset keeps after every batch carries the source's fingerprint: computed once
    for the source (a JSON dump of every sample of a long list), not once a batch."""
    uris, data = group
    calls = []
    original = stoker.SampleList.identity
    monkeypatch.setattr(stoker.SampleList, "identity", lambda self: calls.append(1) or original(self))
    samples = _epoch_samples(uris, 0)
    ds = stoker.CropDataset(stoker.SampleList(samples).for_rank(0, 1), stoker.Config(**CFG), copy=True)
    got = list(DataLoader(ds, batch_size=None))
    assert len(got) == 6 and ds.state_dict()["epoch"] == 1  # used up: the next epoch
    assert np.array_equal(torch.cat(got).numpy(), _oracle(data, samples))
    assert len(calls) == 1


def test_a_source_of_ones_own_feeds_a_dataset(group):
    """A SampleSource subclass with public methods only works through CropDataset and its states."""
    uris, data = group

    class Rows(stoker.SampleSource):
        def __init__(self, uris, n):
            self.uris, self.n = uris, n

        def __len__(self):
            return self.n

        def sample(self, epoch, index):
            return stoker.Sample(self.uris, [(index % 8, index % 8 + 4), (0, 8), (8, 16)])

    ds = stoker.CropDataset(Rows(uris, 8), stoker.Config(**CFG), copy=True)
    first = next(iter(DataLoader(ds, batch_size=None)))
    again = stoker.CropDataset(Rows(uris, 8), stoker.Config(**CFG), copy=True)
    again.load_state_dict(pickle.loads(pickle.dumps(ds.state_dict())))
    rest = list(DataLoader(again, batch_size=None))
    want = _oracle(data, [Rows(uris, 8).sample(0, i) for i in range(8)])
    assert np.array_equal(torch.cat([first] + rest).numpy(), want)


def test_a_dataset_iterated_again_reuses_the_batch_slots(tmp_path, decode_path, monkeypatch):
    """Each iteration of a CropDataset runs a new pipeline; its host batch slots are the last one's memory
    (buffers.SPARE_SLOTS), not new pages the kernel faults in and zeroes, and every batch still equals the
    zarr-python read of its tiles. A batch the consumer keeps past its iteration is never handed on: the next
    iteration does not write into it."""
    from stoker.engine import buffers
    from stoker.train.dataset import read_ahead

    spare = buffers.SpareSlots(64 << 20)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    z = zarr.create_array(str(tmp_path / "v.zarr"), shape=(36, 40, 40), chunks=(8, 16, 16), dtype="uint16")
    z[:] = np.random.default_rng(2).integers(0, 4096, z.shape, dtype=np.uint16)
    data = z[:]
    grid = stoker.TileGrid([str(tmp_path / "v.zarr")], (12, 24, 24), stride=(8, 16, 16))
    ds = stoker.CropDataset(grid, stoker.Config(**CFG, sample_shape=(12, 24, 24)), with_samples=True)
    want = [data[tuple(slice(*ax) for ax in grid.sample(0, i).aabb)].astype("f4") for i in range(len(grid))]
    kept, memory = None, []
    for run in range(3):
        got, ptrs = [], set()
        for samples, x in ds:
            got += [(s, t.clone()) for s, t in zip(samples, x)]
            ptrs.add(x.untyped_storage().data_ptr())
            if run == 0:
                kept = (x, x.clone())  # the last batch of the first run, held on
        assert len(got) == len(grid) and all(np.array_equal(t.numpy(), w) for (_, t), w in zip(got, want))
        memory.append(ptrs)
    assert torch.equal(kept[0], kept[1])  # never overwritten by the runs after it
    # n slots a run (4 batches read ahead: all in flight); all but the one of the run's last batch, still viewed
    # (x) when its pipeline closes, go to the next run
    n = read_ahead(ds.cfg, grid.for_rank(0, 1)) + 1
    assert n == 4 and spare.taken == 2 * (n - 1)
    assert kept[0].untyped_storage().data_ptr() not in memory[1] | memory[2]


@pytest.fixture(scope="module")
def tiles_volume(tmp_path_factory):
    """A uint16 volume of 16 chunks of 64^3 (zstd, zarr-python's default) and its 16 tiles of 96^3 at stride
    56: every tile touches 8-12 chunks, every chunk 4-16 tiles (of 2-4 batches of 4)."""
    uri = str(tmp_path_factory.mktemp("tiles") / "v.zarr")
    z = zarr.create_array(uri, shape=(128, 128, 256), chunks=(64, 64, 64), dtype="uint16")
    z[:] = np.random.default_rng(4).integers(0, 4096, z.shape, dtype=np.uint16)
    return uri, z[:]


def test_a_grid_is_read_ahead_so_its_chunks_are_decoded_about_once(tiles_volume, monkeypatch):
    """A grid's epoch is read up to whole ahead (within a quarter of host_buffer_bytes), so the engine's
    batches in flight share the chunks their tiles have in common: about one decode per chunk, where 2
    batches ahead (the default) decoded them 2-2.5 times over behind a consumer slower than the reads. The
    batches are the zarr-python reads of their tiles, in the grid's order."""
    from stoker.engine.cpu.executor import engine_available
    from stoker.train import dataset as module

    if not engine_available():
        pytest.skip("the compiled engine is not built (the Python path shares no chunk between batches)")
    uri, data = tiles_volume
    decoded = []

    class Counted(module.Pipeline):
        def close(self):
            if not self._closed:
                decoded.append(self.stats().chunks_decoded)
            super().close()

    monkeypatch.setattr(module, "Pipeline", Counted)
    grid = stoker.TileGrid([uri], (96, 96, 96), stride=(56, 56, 56))
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=2, sample_shape=(96, 96, 96),
                        pop_timeout_s=20.0)
    assert module.read_ahead(cfg, grid.for_rank(0, 1)) == 3  # 4 batches: every one in flight
    ds = stoker.CropDataset(grid, cfg, with_samples=True)
    for _ in range(3):
        got = 0
        for samples, x in ds:
            for s, t in zip(samples, x):
                assert s == grid.sample(0, got)
                assert np.array_equal(t.numpy(), data[tuple(slice(*ax) for ax in s.aabb)].astype("f4"))
                got += 1
            time.sleep(0.01)  # a model's step: slower than the reads
        assert got == 16
    # 16 chunks: 16-22 decodes a run where the coordinator submits the batches before the engine's threads
    # are through the first one's chunks (a race: 30 seen in a run on a machine loaded 5 times over, so the
    # best of three runs is asked); at 2 batches ahead 32-41 in every run
    assert min(decoded) <= 16 + 8, decoded


def test_read_ahead_stays_within_its_share_of_host_memory():
    """How far a grid's epoch is read ahead: its batches less one, at most the slots a quarter of
    host_buffer_bytes (and the spare slots' 256 MiB) holds (each sample's elements at the batch's element size, 8 bytes when the source
    decides it, 4 more for a 16-bit float's work slot), never fewer than the config's, CPU pipelines only."""
    from stoker.train.dataset import read_ahead

    src = stoker.SampleList([stoker.Sample("/v.zarr", [(0, 32), (0, 64), (i, i + 64)]) for i in range(40)],
                            complete=True).for_rank(0, 1)
    base = dict(batch_size=4, device="cpu", sample_shape=(32, 64, 64))
    assert read_ahead(stoker.Config(**base, dtype="f32"), src) == 9  # 10 batches
    mib = 1 << 20  # an f32 slot: 4 x 32 x 64 x 64 x 4 B = 2 MiB; a quarter of 48 MiB holds 6
    assert read_ahead(stoker.Config(**base, dtype="f32", host_buffer_bytes=48 * mib), src) == 5
    assert read_ahead(stoker.Config(**base, dtype="native", host_buffer_bytes=48 * mib),
                      src) == 2  # 8 + 4 bytes an element: 2 slots fit, the config's 2 stay
    assert read_ahead(stoker.Config(**base, dtype="bf16", host_buffer_bytes=48 * mib),
                      src) == 3  # 2 + 4 bytes: 4 slots
    assert read_ahead(stoker.Config(**base, dtype="f32", lookahead_batches=12), src) == 12
    big = stoker.SampleList([stoker.Sample("/v.zarr", [(0, 32), (0, 256), (i, i + 256)]) for i in range(40)],
                            complete=True).for_rank(0, 1)  # 5 batches of 8, 64 MiB slots: 4 fit in 256 MiB
    assert read_ahead(stoker.Config(**{**base, "batch_size": 8, "sample_shape": (32, 256, 256)}, dtype="f32",
                                    host_buffer_bytes=4 << 30), big) == 3
    assert read_ahead(stoker.Config(**{**base, "device": "cuda"}, dtype="f32"), src) == 2


def test_a_grid_that_fits_its_budget_still_fits_when_read_ahead(tmp_path):
    """Read-ahead is a wish the executor grants within host_buffer_bytes: a volume of one 6.5 MiB chunk, tiles
    of 8x32x32, host_buffer_bytes=16 MiB holds the config's 3 batch slots and one chunk's read and decode
    (~13 MiB). read_ahead asks for a quarter of the budget (32 slots, 4 MiB): the pipeline takes what fits
    next to the chunk's room, not a BudgetExceeded telling the user to lower lookahead_batches, and never
    fewer slots than the config's."""
    uri = str(tmp_path / "v.zarr")
    z = zarr.create_array(uri, shape=(104, 256, 256), chunks=(104, 256, 256), dtype="uint8")
    z[:] = np.random.default_rng(0).integers(0, 255, z.shape, dtype=np.uint8)
    data = z[:]
    grid = stoker.TileGrid([uri], (8, 32, 32))
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=2,
                        host_buffer_bytes=16 << 20, sample_shape=(8, 32, 32), pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:  # the grid's samples, at the config's own lookahead: fits
        p.push(grid.for_rank(0, 1))
        with p.pop() as b:
            assert tuple(torch.from_dlpack(b).shape) == (4, 8, 32, 32)
    from stoker.train.dataset import read_ahead

    wished = read_ahead(cfg, grid.for_rank(0, 1))
    assert wished > cfg.lookahead_batches  # asked for more than fits next to the chunk
    ds = stoker.CropDataset(grid, cfg, with_samples=True)
    it = iter(ds)
    samples, x = next(it)  # BudgetExceeded before read-ahead was a wish
    assert tuple(x.shape) == (4, 8, 32, 32)
    for s, t in zip(samples, x):
        assert np.array_equal(t.numpy(), data[tuple(slice(*ax) for ax in s.aabb)].astype("f4"))
    executor = ds._live._executors()[0]
    slot = 4 * 8 * 32 * 32 * 4
    assert cfg.lookahead_batches < executor.lookahead < wished  # some more: what fits, not all it asked
    assert executor.host_nbytes() == (executor.lookahead + 1) * slot <= 16 << 20
    assert executor.host_nbytes() + executor.budget.capacity <= 16 << 20
    del x
    it.close()


def test_a_grid_is_read_as_far_ahead_as_it_asks_when_it_fits(tmp_path):
    """With room in host_buffer_bytes the executor grants all of read_ahead's wish: the pipeline's slots are
    the wished batches ahead plus one."""
    uri = str(tmp_path / "v.zarr")
    z = zarr.create_array(uri, shape=(16, 64, 64), chunks=(8, 32, 32), dtype="uint8")
    z[:] = np.random.default_rng(1).integers(0, 255, z.shape, dtype=np.uint8)
    grid = stoker.TileGrid([uri], (8, 16, 16))  # 32 tiles, 8 batches of 4
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=2,
                        sample_shape=(8, 16, 16), pop_timeout_s=30.0)
    from stoker.train.dataset import read_ahead

    wished = read_ahead(cfg, grid.for_rank(0, 1))
    assert wished == 7
    ds = stoker.CropDataset(grid, cfg)
    it = iter(ds)
    n = 1
    next(it)
    executor = ds._live._executors()[0]
    assert executor.lookahead == wished and executor.n_slots == wished + 1
    n += sum(1 for _ in it)
    assert n == 8


def _rows(ctx, ds):
    """The first index of every sample this rank's dataset yields, over the process group."""
    import torch.distributed as dist

    mine = [s.aabb[0][0] for samples, _ in ds for s in samples]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return out


@pytest.mark.timeout(120)
def test_a_state_loaded_before_the_process_group_resumes_the_split_it_was_saved_on(group):
    """7 samples on 2 ranks: 4 each, rank 1 wraps to the epoch's first. A dataset built and given a 2-rank
    state before init_process_group (as rank 0 of 1) kept that state as a 1-rank one, whose 2-rank run was
    an earlier run: in the ranks the rest was split anew, and rank 1 wrapped into the rest (sample 2)
    rather than to the epoch's start (sample 0), unlike the run that was not stopped."""
    import stoker.train as st

    uris, _ = group
    src = stoker.SampleList([stoker.Sample(uris, [(i, i + 1), (0, 8), (0, 8)]) for i in range(7)])
    cfg = stoker.Config(**{**CFG, "batch_size": 1})
    whole = [[s.aabb[0][0] for s in src.for_rank(r, 2)] for r in range(2)]
    assert whole == [[0, 2, 4, 6], [1, 3, 5, 0]]
    it = iter(src.for_rank(0, 2))
    next(it)
    ds = stoker.CropDataset(src, cfg, with_samples=True)  # no process group yet: rank 0 of 1
    ds.load_state_dict(it.state_after(1))
    assert st.launch(_rows, ds, nprocs=2, use_cuda=False) == [w[1:] for w in whole]
