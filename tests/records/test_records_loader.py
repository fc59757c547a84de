"""stoker.records.Loader: thread-pool batches of record datasets, sharded, resumable, prompt to close.

Real records written by zarr-python; ranks are emulated in-process with explicit
``rank``/``world_size`` (the split is pure arithmetic), plus one real gloo group
for the defaults. Slow or failing reads come from thin wrappers around the real
dataset.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr

from stoker.errors import DtypeMismatch, InvalidArgument, RankMismatch, ShutdownError
from stoker.records import Concat, Loader, LoaderTimeout, Pad, ZarrRecords

from gloo_ranks import gloo_group, spawn_ranks, write_result

N_RECORDS = 13


def _first(loader):
    """``loader``'s first batch, the loader closed after it (its reader threads end with the test)."""
    with loader:
        return next(iter(loader))


def write_dataset(root: str, n: int = N_RECORDS) -> None:
    """Record i: ``points`` (2 + i % 5, 3) float32, ``cells`` (1 + i % 3, 2) int32 indexing points, ``rid`` (1,)."""
    for i in range(n):
        rng = np.random.default_rng(i)
        npts = 2 + i % 5
        g = zarr.open_group(os.path.join(root, f"rec_{i:03d}.zarr"), mode="w", zarr_format=3 if i % 2 else 2)
        g.create_array("points", data=rng.normal(size=(npts, 3)).astype("f4"))
        g.create_array("cells", data=rng.integers(0, npts, size=(1 + i % 3, 2)).astype("i4"))
        g.create_array("rid", data=np.array([i], dtype="i8"))


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loader"))
    write_dataset(root)
    return ZarrRecords(root, fields=["points", "cells", "rid"])


class Slow(torch.utils.data.Dataset):
    """The real dataset, each read delayed (``delay`` seconds, or a random jitter up to ``jitter``)."""

    def __init__(self, base, delay: float = 0.0, jitter: float = 0.0, fail_at: int | None = None) -> None:
        self.base, self.delay, self.jitter, self.fail_at = base, delay, jitter, fail_at
        self.reads: list[int] = []
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        with self.lock:
            self.reads.append(i)
        time.sleep(self.delay + random.random() * self.jitter)
        if i == self.fail_at:
            raise ValueError(f"cannot read record {i}")
        return self.base[i]


def ids(batches) -> list[list[int]]:
    return [b["rid"].tolist() for b in batches]


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def readers() -> set[threading.Thread]:
    """The loaders' reader threads alive in this process, by their name."""
    return {t for t in threading.enumerate() if t.name.startswith("stoker-records-")}


def settle(before: set[threading.Thread], timeout: float = 10.0) -> set[threading.Thread]:
    """The reader threads started since ``before`` (a test's own) still alive once they have all ended (or after
    ``timeout``). Threads, not a count: a loader an earlier test of this process dropped (``next(iter(loader))``)
    ends its readers without waiting for them, and those leaving during a later test made its count fall short
    of the baseline it took (reproduced by running test_cpu_device_is_a_pass_through just before)."""
    deadline = time.monotonic() + timeout
    while readers() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return readers() - before


# -- collation ---------------------------------------------------------------------------------


def test_concat_matches_a_manual_reference(ds):
    batches = list(Loader(ds, 4, collate="concat", shuffle=False, n_threads=3))
    assert len(batches) == 4
    for j, batch in enumerate(batches):
        samples = [ds[i] for i in range(4 * j, min(4 * j + 4, N_RECORDS))]
        assert set(batch) == {"points", "points_batch", "cells", "cells_batch", "rid", "rid_batch"}
        for f in ("points", "cells", "rid"):
            assert torch.equal(batch[f], torch.cat([s[f] for s in samples]))
            want = torch.cat([torch.full((len(s[f]),), k, dtype=torch.long) for k, s in enumerate(samples)])
            assert torch.equal(batch[f + "_batch"], want)


def test_pad_matches_a_manual_reference(ds):
    batches = list(Loader(ds, 5, collate="pad", shuffle=False))
    for j, batch in enumerate(batches):
        samples = [ds[i] for i in range(5 * j, min(5 * j + 5, N_RECORDS))]
        for f in ("points", "cells"):
            lengths = [len(s[f]) for s in samples]
            assert batch[f + "_lengths"].tolist() == lengths and batch[f + "_lengths"].dtype == torch.long
            assert batch[f].shape == (len(samples), max(lengths), samples[0][f].shape[1])
            for k, s in enumerate(samples):
                assert torch.equal(batch[f][k, : lengths[k]], s[f])
                assert not batch[f][k, lengths[k]:].any()  # padded with zeros


def test_concat_increment_shifts_indices_and_a_callable_collates(ds):
    batch = _first(Loader(ds, 3, collate=Concat(increment={"cells": "points"}), shuffle=False))
    samples = [ds[i] for i in range(3)]
    offset = np.cumsum([0] + [len(s["points"]) for s in samples[:-1]])
    assert torch.equal(batch["cells"], torch.cat([s["cells"] + int(o) for s, o in zip(samples, offset)]))
    assert torch.equal(batch["points"][batch["cells"][-1].long()], samples[2]["points"][samples[2]["cells"][-1].long()])
    got = _first(Loader(ds, 3, collate=lambda xs: [int(x["rid"][0]) for x in xs], shuffle=False))
    assert got == [0, 1, 2]


def test_collate_errors_name_the_field():
    with pytest.raises(RankMismatch, match="'x'"):
        Concat()([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 4)}])
    with pytest.raises(DtypeMismatch, match="'x'"):
        Pad()([{"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int64)}])
    with pytest.raises(InvalidArgument, match="collide"):
        Concat()([{"x": torch.zeros(2), "x_batch": torch.zeros(2)}])
    with pytest.raises(InvalidArgument, match="fields"):
        Concat()([{"x": torch.zeros(2)}, {"y": torch.zeros(2)}])


# -- order and sharding ------------------------------------------------------------------------


def test_order_is_deterministic_per_seed_and_epoch(ds):
    def epoch(loader, e):
        loader.set_epoch(e)
        return ids(loader)

    jittery = Slow(ds, jitter=0.004)  # threads finish out of order; batches must not
    a, b = Loader(jittery, 3, seed=7, n_threads=4), Loader(ds, 3, seed=7, n_threads=1)
    e0, e1 = epoch(a, 0), epoch(a, 1)
    assert e0 == epoch(b, 0) and e1 == epoch(b, 1)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(N_RECORDS))
    assert epoch(a, 0) == e0  # going back to an epoch replays it
    assert ids(Loader(ds, 3, seed=8)) != e0
    assert sum(ids(Loader(ds, 3, shuffle=False)), []) == list(range(N_RECORDS))


class Indexed:
    """A dataset of ``n`` tiny records, for split arithmetic over many sizes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"rid": torch.tensor([i])}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_number_of_batches(world, drop_last):
    for n in (7, 10, 11, 13):
        for bs in (1, 2, 3, 4):
            loaders = [Loader(Indexed(n), bs, rank=r, world_size=world, seed=n, drop_last=drop_last, n_threads=2)
                       for r in range(world)]
            runs = [ids(loader) for loader in loaders]
            counts = {len(run) for run in runs}
            assert counts == {len(loaders[0])} or (counts == {0} and len(loaders[0]) == 0), (n, bs)
            assert len({tuple(len(b) for b in run) for run in runs}) == 1  # batch sizes line up too
            got = [i for run in runs for b in run for i in b]
            if drop_last:
                per_rank = n // world // bs * bs
                assert len(got) == len(set(got)) == world * per_rank, (n, bs)
            else:
                assert set(got) == set(range(n)) and len(got) == world * -(-n // world), (n, bs)


# -- resuming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_resume_mid_epoch_equals_the_uninterrupted_run(ds, k):
    for rank in range(2):
        full = Loader(ds, 2, seed=3, rank=rank, world_size=2, prefetch=3)
        want = ids(full) + ids(full)  # epochs 0 and 1 (the epoch advances on its own)

        first = Loader(Slow(ds), 2, seed=3, rank=rank, world_size=2, prefetch=3)
        it = iter(first)
        got = [next(it)["rid"].tolist() for _ in range(k)]
        time.sleep(0.05)  # let the readers prefetch beyond what was received
        state = json.loads(json.dumps(first.state_dict()))  # it must survive a checkpoint file
        first.close()
        assert (state["epoch"], state["steps"]) == (0, min(2 * k, 7))  # 7 records per rank, in 4 batches

        resumed = Loader(ds, 2, seed=3, rank=rank, world_size=2)
        resumed.load_state_dict(state)
        for epoch in (0, 1):
            resumed.set_epoch(epoch)  # a no-op in the resumed epoch, a fresh start in the next
            got += ids(resumed)
        assert got == want


def test_breaking_out_continues_where_it_stopped(ds):
    loader = Loader(ds, 3, seed=1)
    want = ids(Loader(ds, 3, seed=1))
    got = []
    for batch in loader:
        got.append(batch["rid"].tolist())
        if len(got) == 2:
            break
    assert len(loader) == len(want) - 2
    got += ids(loader)
    assert got == want and loader.epoch == 0
    # Without set_epoch, iterating a complete epoch moves on to the next one.
    assert len(loader) == len(want)
    assert ids(loader) != want and loader.epoch == 1
    # After load_state_dict, set_epoch of the loaded epoch keeps its position: a complete epoch stays complete
    # (a resumed loop finds nothing left); set_epoch of an epoch iterated since starts it again (an evaluation
    # loop that calls set_epoch(0) before each pass sees every batch each time).
    done = loader.state_dict()
    fresh = Loader(ds, 3, seed=1)
    fresh.set_epoch(1)
    epoch1 = ids(fresh)
    loader.load_state_dict(done)
    loader.set_epoch(1)
    assert len(loader) == 0 and ids(loader) == [] and loader.epoch == 1
    loader.set_epoch(1)
    assert len(loader) == len(want) and loader.epoch == 1
    assert ids(loader) == epoch1 != want


def test_resume_on_another_world_size_skips_and_repeats_nothing(ds):
    before = []
    states = []
    for rank in range(2):
        loader = Loader(ds, 2, seed=5, rank=rank, world_size=2)
        it = iter(loader)
        before += [i for _ in range(2) for i in next(it)["rid"].tolist()]
        states.append(loader.state_dict())
        loader.close()
    after = []
    for rank in range(3):
        loader = Loader(ds, 3, seed=5, rank=rank, world_size=3)
        loader.load_state_dict(states[rank % 2])
        runs = ids(loader)
        assert len(runs) == 1  # 13 - 8 = 5 left: 2 per rank (one wrapped), one batch each
        after += sum(runs, [])
    assert len(set(before)) == 8 and not set(before) & set(after)
    assert set(before) | set(after) == set(range(N_RECORDS))


def test_state_from_another_order_is_refused(ds, tmp_path):
    state = Loader(ds, 2, seed=1).state_dict()
    others = (Loader(ds, 2, seed=2), Loader(ds, 2, seed=1, shuffle=False), Loader(Indexed(N_RECORDS + 1), 2, seed=1))
    for other in others:
        with pytest.raises(InvalidArgument, match="order would differ"):
            other.load_state_dict(state)
    with pytest.raises(InvalidArgument, match="format"):
        Loader(ds, 2).load_state_dict({"epoch": 0})
    with pytest.raises(InvalidArgument, match="malformed"):
        Loader(ds, 2, seed=1).load_state_dict({**state, "steps": "many"})


# -- threads, prefetch, close, errors ---------------------------------------------------------------


def test_prefetch_is_bounded(ds):
    slow = Slow(ds, delay=0.002)
    loader = Loader(slow, 2, shuffle=False, prefetch=2, n_threads=4)
    it = iter(loader)
    next(it)
    wait_for(lambda: len(slow.reads) >= 6)
    time.sleep(0.2)  # time enough to read everything, were it allowed
    assert len(slow.reads) == 2 * (1 + 2)  # the received batch and two ahead, no more
    next(it)
    wait_for(lambda: len(slow.reads) >= 8)
    time.sleep(0.1)
    assert len(slow.reads) == 2 * (2 + 2)
    loader.close()


def test_close_is_prompt_and_leaves_no_thread_or_process(ds):
    baseline = readers()
    loader = Loader(Slow(ds, delay=0.05), 2, prefetch=4, n_threads=4)
    it = iter(loader)
    next(it)
    assert len(readers() - baseline) == 4
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 1.0
    assert settle(baseline) == set()
    assert multiprocessing.active_children() == []
    with pytest.raises(ShutdownError):
        next(it)
    with pytest.raises(ShutdownError):
        iter(loader)


def test_threads_end_with_the_epoch_and_with_a_break(ds):
    baseline = readers()
    loader = Loader(ds, 2, n_threads=3)
    for _ in loader:
        assert multiprocessing.active_children() == []  # no worker process, ever
    assert settle(baseline) == set()
    for _ in loader:
        break  # the dropped iterator stops its threads
    assert settle(baseline) == set()


def test_a_read_error_reaches_the_consumer_after_the_batches_before_it(ds):
    baseline = readers()
    loader = Loader(Slow(ds, fail_at=7), 2, shuffle=False, n_threads=3, prefetch=3)
    got = []
    with pytest.raises(ValueError, match="cannot read record 7"):
        for batch in loader:
            got.append(batch["rid"].tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert loader.state_dict()["steps"] == 6  # as of the last batch received
    assert settle(baseline) == set()
    # The next iteration retries the failed batch.
    loader2 = Loader(ds, 2, shuffle=False)
    loader2.load_state_dict(loader.state_dict())
    assert ids(loader2)[0] == [6, 7]


def test_close_after_a_read_error_waits_for_the_other_readers(ds):
    """A record fails at once while another reader is in a long read: the error reaches the consumer at once,
    and the loader's close() then returns once that reader has ended (it returned at once, leaving the thread
    running into the next test)."""

    class FailsFirst(Slow):
        def __getitem__(self, i: int) -> dict:
            if i == 0:
                raise ValueError("cannot read record 0")
            time.sleep(0.5)
            return self.base[i]

    baseline = readers()
    loader = Loader(FailsFirst(ds), 2, shuffle=False, n_threads=2, prefetch=1)
    with pytest.raises(ValueError, match="cannot read record 0"):
        next(iter(loader))
    assert readers() - baseline  # (the other reader is in its read)
    loader.close()
    assert readers() - baseline == set()


def test_a_stuck_read_times_out(ds):
    baseline = readers()
    loader = Loader(Slow(ds, delay=1.5), 2, timeout_s=0.1, n_threads=1)
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeout):
        next(iter(loader))
    assert time.monotonic() - t0 < 1.0  # raised on time, not after the stuck read
    loader.close()
    assert settle(baseline) == set()  # the reader ends once its read returns


def test_cpu_device_is_a_pass_through(ds):
    a = _first(Loader(ds, 4, shuffle=False, device="cpu"))
    b = _first(Loader(ds, 4, shuffle=False))
    assert all(torch.equal(a[k], b[k]) and a[k].device.type == "cpu" for k in b)
    with pytest.raises(InvalidArgument, match="device"):
        Loader(ds, 4, device="nonsense")


@pytest.mark.cuda
def test_cuda_device_batches_arrive_on_the_gpu(ds):
    cpu = list(Loader(ds, 4, shuffle=False))
    gpu = list(Loader(ds, 4, shuffle=False, device="cuda"))
    assert len(gpu) == len(cpu) > 0
    for a, b in zip(cpu, gpu):
        assert all(b[k].is_cuda and torch.equal(a[k], b[k].cpu()) for k in a)


def test_bad_arguments(ds):
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"batch_size": 2, "prefetch": 0}, "prefetch"),
                          ({"batch_size": 2, "collate": "stack"}, "collate"),
                          ({"batch_size": 2, "rank": 2, "world_size": 2}, "rank"),
                          ({"batch_size": 2, "n_threads": 0}, "n_threads"),
                          ({"batch_size": 2, "timeout_s": 0}, "timeout_s")):
        with pytest.raises(InvalidArgument, match=match):
            Loader(ds, **kwargs)
    with pytest.raises(InvalidArgument, match="full dataset"):
        Loader(ds.for_rank(0, 2), 2)
    with pytest.raises(InvalidArgument, match="map-style"):
        Loader(42, 2)


# -- a real process group --------------------------------------------------------------------------


def _group_worker(rank: int, world: int, tmp: str, root: str) -> None:
    with gloo_group(rank, world, tmp):
        loader = Loader(ZarrRecords(root, fields=["points", "rid"]), 2, seed=4)  # rank and world from the group
        steps = 0
        for _ in loader:
            # Lockstep as in training: a rank with a missing batch would hang this collective.
            t = torch.ones(1)
            dist.all_reduce(t)
            steps += 1
        write_result(tmp, rank, {"rank": loader.rank, "world": loader.world_size, "steps": steps})


@pytest.mark.timeout(120)
def test_ranks_from_a_process_group_step_in_lockstep(tmp_path):
    root = str(tmp_path / "data")
    write_dataset(root)
    results = spawn_ranks(_group_worker, 3, tmp_path, root)
    assert [(r["rank"], r["world"], r["steps"]) for r in results] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


@pytest.mark.parametrize("samples, error", [
    ([{"x": "label"}], InvalidArgument),
    ([{"x": torch.zeros(2, dtype=torch.int32)}, {"x": torch.zeros(2)}], DtypeMismatch),
    ([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 4)}], RankMismatch),
])
def test_the_default_collate_names_the_option_that_fixes_it(samples, error):
    from stoker.records.collate import resolve

    for name in ("concat", "pad"):
        with pytest.raises(error, match=r"collate=<your function"):
            resolve(name)(samples)


@pytest.mark.timeout(60)
def test_a_fault_of_a_reader_thread_s_loop_is_the_next_take_s_internal_error(ds, monkeypatch):
    """A reader thread's loop raising past its own handling (here handing a finished batch over) ended the
    thread: the batch waited timeout_s (30 s here) and then blamed the dataset. Now the next batch taken
    raises an InternalError naming the thread, and so does every later one; close() still closes."""
    from stoker.errors import InternalError
    from stoker.records import loader as loaders

    deliver = loaders._Work.deliver
    injected: list[str] = []

    def fails_once(self, j, part):
        # batch 0's hand-over: the first batch taken is the lost one (with two threads, batch 1 may be made
        # first; had its hand-over failed, batch 0 could be taken, whole and right, before the fault was kept)
        if j == 0 and not injected:
            injected.append(threading.current_thread().name)
            raise RuntimeError("an injected bug handing a batch over")
        deliver(self, j, part)

    monkeypatch.setattr(loaders._Work, "deliver", fails_once)
    loader = Loader(ds, 4, shuffle=False, n_threads=2, timeout_s=30.0)
    it = iter(loader)
    work = loader._work
    with pytest.raises(InternalError) as raised:
        next(it)
    err = raised.value
    assert err.thread == injected[0] and err.thread.startswith("stoker-records-")
    assert isinstance(err.__cause__, RuntimeError) and "report" in str(err)
    with pytest.raises(InternalError):  # every later batch's take (the iterator ends at its error)
        work.take(1, 10.0)
    loader.close()
    for t in work.threads:
        t.join(10.0)
    assert not any(t.is_alive() for t in work.threads)


@pytest.mark.parametrize("collate", ["concat", "pad"])
def test_a_0d_field_is_a_b_vector_in_both_collates_never_padded(tmp_path, collate):
    """A per-record scalar (a 0-d array beside the points) is ``(B,)`` with either collate: "pad" gave ``(B, 1)``
    plus ``{field}_lengths`` of ones, "concat" ``(B,)``. The varying field beside it is padded as before."""
    for i in range(5):
        g = zarr.open_group(os.path.join(tmp_path, f"r{i}.zarr"), mode="w", zarr_format=2 + i % 2)
        g.create_array("points", data=np.arange(3 * (i + 1), dtype="f4").reshape(-1, 3))
        g.create_array("label", data=np.asarray(10 * i + 1, dtype="i8"))
    ds = ZarrRecords(str(tmp_path), fields=["points", "label"])
    batch = list(Loader(ds, 4, collate=collate, shuffle=False))[0]
    want = torch.tensor([int(ds[i]["label"]) for i in range(4)])
    assert ds[0]["label"].shape == () and batch["label"].shape == (4,)
    assert torch.equal(batch["label"], want) and "label_lengths" not in batch
    if collate == "pad":
        assert batch["points_lengths"].tolist() == [1, 2, 3, 4] and batch["points"].shape == (4, 4, 3)
