"""stoker.train: checkpoints, the Trainer loop, and launch with 2 CPU ranks over gloo."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import numpy as np
import pytest
import torch
import zarr

import stoker
import stoker.train as st
import train_jobs as jobs
from stoker.errors import CheckpointError, InvalidArgument, RankFailed, UnusedParameters


# -- Checkpoints ------------------------------------------------------------------------------


def test_checkpoints_rotate_and_list_only_complete_files(tmp_path):
    ck = st.Checkpoints(tmp_path / "ck", every=2, keep=2)
    assert ck.list() == [] and ck.latest() is None
    for step in (2, 4, 6):
        ck.save({"x": torch.tensor([step])}, step)
    assert [s for s, _ in ck.list()] == [4, 6]  # the oldest beyond keep=2 is gone
    (tmp_path / "ck" / ".step-000000008.pt.tmp-999").write_bytes(b"half a checkpoint")
    assert [s for s, _ in ck.list()] == [4, 6]  # a temp file of a dead writer is not a checkpoint
    path, state = ck.load_latest()
    assert path.name == "step-000000006.pt" and state["step"] == 6 and int(state["x"]) == 6
    assert [p.name for p in ck.cleanup()] == [".step-000000008.pt.tmp-999"]
    assert ck.due(4) and not ck.due(5) and not ck.due(0)


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    ck = st.Checkpoints(tmp_path, keep=5)
    ck.save({"v": 1}, 1)
    newest = ck.save({"v": 2}, 2)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(RuntimeWarning, match="damaged"):
        path, state = ck.load_latest()
    assert state["v"] == 1 and path.name == "step-000000001.pt"


def test_no_readable_checkpoint_is_an_error_not_a_silent_fresh_start(tmp_path):
    ck = st.Checkpoints(tmp_path)
    torch.save({"model": 1}, tmp_path / "step-000000003.pt")  # not written by stoker
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="no checkpoint .* can be read"):
        ck.load_latest()
    with pytest.raises(CheckpointError, match="not a stoker checkpoint"):
        ck.load(tmp_path / "step-000000003.pt")


def test_a_write_failure_of_any_kind_is_a_checkpoint_error_and_leaves_no_temp(tmp_path, monkeypatch):
    ck = st.Checkpoints(tmp_path)

    def disk_full(*args, **kwargs):  # what torch.save raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 1024 vs 512")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="unexpected pos"):
        ck.save({"v": 1}, 1)
    assert list(tmp_path.iterdir()) == []


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    ck = st.Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        ck.save({}, step)
    assert [s for s, _ in ck.list()] == [2, 3]
    ck.save({}, 10)
    ck.save({}, 11)
    assert [s for s, _ in ck.list()] == [10, 11]


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"keep": 0}, {"every": 1.5}, {"keep": True}])
def test_checkpoint_settings_are_checked(tmp_path, kwargs):
    with pytest.raises(InvalidArgument):
        st.Checkpoints(tmp_path, **kwargs)


def test_unwritable_checkpoint_directory_is_a_checkpoint_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        st.Checkpoints(blocker / "ck").save({"v": 1}, 1)


def test_a_flipped_byte_in_the_weights_is_damage_and_the_previous_one_loads(tmp_path):
    ck = st.Checkpoints(tmp_path, keep=5)
    ck.save({"w": torch.zeros(256)}, 1)
    weights = torch.arange(256, dtype=torch.float32) + 0.5
    newest = ck.save({"w": weights}, 2)
    raw = bytearray(newest.read_bytes())
    at = bytes(raw).find(weights.numpy().tobytes())
    assert at > 0
    raw[at + 514] ^= 0x01  # one bit of one float: still a valid zip and pickle
    newest.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256") as info:
        ck.load(newest)
    assert info.value.path == str(newest)
    with pytest.warns(RuntimeWarning, match="skipping damaged checkpoint.*step-000000002.pt"):
        path, state = ck.load_latest()
    assert path.name == "step-000000001.pt" and torch.equal(state["w"], torch.zeros(256))
    newest.write_bytes(bytes(raw[:-10]))  # truncated: the header's length says so before any hashing
    with pytest.raises(CheckpointError, match="truncated"):
        ck.load(newest)


def test_checkpoint_fields_are_validated_and_version_1_files_still_load(tmp_path):
    ck = st.Checkpoints(tmp_path)
    good = {"format": st.checkpoint.FORMAT, "version": 1, "step": 3, "v": 7}
    torch.save(good, ck.path_for(3))  # as stoker wrote them before the hashed header
    assert ck.load(ck.path_for(3))["v"] == 7
    torch.save({**good, "version": 2}, ck.path_for(3))  # a version-2 payload stripped of its header
    with pytest.raises(CheckpointError, match="laid out as version 1"):
        ck.load(ck.path_for(3))
    for step, why in ((-5, "not an integer >= 0"), (True, "not an integer >= 0"), ("3", "not an integer"),
                      (4, "holds step 4, its name says 3")):
        _rewrite(ck.path_for(3), step=step)
        with pytest.raises(CheckpointError, match=why):
            ck.load(ck.path_for(3))
    other = tmp_path / "my-copy.pt"  # a name that says no step: any step >= 0 is fine
    _rewrite(ck.path_for(3), step=4)
    os.replace(ck.path_for(3), other)
    assert ck.load(other)["step"] == 4
    with pytest.raises(CheckpointError, match=r"lacks 'model'.*my-copy.pt|my-copy.pt lacks 'model'"):
        ck.load(other, {"model": dict, "v": int})
    with pytest.raises(CheckpointError, match="'v' is int, not dict"):
        ck.load(other, {"v": dict})


def _rewrite(path, drop=(), **changes):
    """Rewrite a checkpoint with changed fields, hash and all: a tampered file, not a damaged one."""
    from stoker.train import checkpoint

    state = torch.load(path, weights_only=False) if path.read_bytes()[:2] == b"PK" else None
    if state is None:
        with open(path, "rb") as f:
            f.seek(checkpoint._HEADER.size)
            state = torch.load(f, weights_only=False)
    state = {k: v for k, v in {**state, **changes}.items() if k not in drop}
    state["version"] = checkpoint.VERSION
    with open(path, "wb") as f:
        checkpoint._dump(state, f)


# -- Trainer in one process --------------------------------------------------------------------


def _trainer(tmp_path=None, **kw):
    model = jobs.Tiny(unused=kw.pop("unused", False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = st.Checkpoints(tmp_path / "ck", every=2) if tmp_path is not None else None
    kw.setdefault("device", "cpu")  # these compare against CPU references, also on a GPU machine
    kw.setdefault("progress", False)
    return st.Trainer(model, opt, kw.pop("loss_fn", jobs.mse), checkpoints=ck, **kw)


class Batches:
    """A resumable list of batches: what the trainer needs from a data object."""

    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def __iter__(self):
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_accumulation_equals_one_big_batch():
    batches = jobs.global_batches(3, 4)
    big = _trainer()
    whole = big.fit(batches, steps=3, resume=None)
    small = _trainer(accumulate=2)
    halves = small.fit([half for b in batches for half in (b[:2], b[2:])], steps=3, resume=None)
    for a, b in zip(big.module.parameters(), small.module.parameters()):
        torch.testing.assert_close(a, b)
    # a step's loss is the mean of its micro-batches' (the mean over the global batch), not their sum
    assert sorted(halves.losses) == sorted(whole.losses) == [1, 2, 3]
    for step, loss in whole.losses.items():
        assert halves.losses[step] == pytest.approx(loss, rel=1e-5)
    assert any(not torch.equal(p, q) for p, q in zip(big.module.parameters(), jobs.Tiny().parameters()))  # trained


def test_resume_continues_with_the_same_batches_rng_and_losses(tmp_path):
    batches = jobs.global_batches(10, 4)

    def noisy_mse(model, batch):  # draws from the global RNG: resumption must restore it
        return jobs.mse(model, batch + 0.01 * torch.randn_like(batch))

    torch.manual_seed(1)
    straight = _trainer(tmp_path / "a", loss_fn=noisy_mse).fit(Batches(batches), steps=8)
    torch.manual_seed(1)
    first = _trainer(tmp_path / "b", loss_fn=noisy_mse).fit(Batches(batches), steps=5)
    assert first.checkpoint.name == "step-000000005.pt"  # the end of a call is saved too
    torch.manual_seed(99)  # a different process state: the checkpoint must override it
    second = _trainer(tmp_path / "b", loss_fn=noisy_mse).fit(Batches(batches), steps=8)
    assert second.start_step == 5 and second.resumed_from == first.checkpoint
    assert sorted(straight.losses) == list(range(1, 9)) and sorted(second.losses) == [6, 7, 8]
    assert {k: v for k, v in straight.losses.items() if k > 5} == second.losses
    assert first.losses == {k: v for k, v in straight.losses.items() if k <= 5}


def test_a_fresh_start_beside_later_checkpoints_is_refused(tmp_path):
    batches = jobs.global_batches(6, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=6)  # checkpoints of steps 2, 4, 6
    with pytest.raises(CheckpointError, match="later steps than this run starts at"):
        _trainer(tmp_path).fit(Batches(batches), steps=4, resume=None)
    with pytest.raises(CheckpointError, match="later steps"):
        _trainer(tmp_path).fit(Batches(batches), steps=8, resume=tmp_path / "ck" / "step-000000004.pt")
    assert [s for s, _ in st.Checkpoints(tmp_path / "ck").list()] == [2, 4, 6]  # nothing deleted


def test_auto_resume_sets_damaged_newer_checkpoints_aside(tmp_path):
    batches = jobs.global_batches(8, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=6)
    newest = tmp_path / "ck" / "step-000000006.pt"
    newest.write_bytes(b"truncated")
    with pytest.warns(RuntimeWarning, match="damaged"):
        r = _trainer(tmp_path).fit(Batches(batches), steps=8)
    assert r.start_step == 4 and r.checkpoint.name == "step-000000008.pt"
    assert (tmp_path / "ck" / "step-000000006.pt.damaged").exists()
    assert st.Checkpoints(tmp_path / "ck").load(r.checkpoint)["step"] == 8


def test_a_checkpoint_with_a_tampered_step_is_set_aside_alone(tmp_path):
    # Its step of -5 once made auto-resume start at -5 and set aside every checkpoint "of a later step".
    batches = jobs.global_batches(8, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=6)
    _rewrite(tmp_path / "ck" / "step-000000006.pt", step=-5)
    with pytest.warns(RuntimeWarning, match="damaged.*step is -5"):
        r = _trainer(tmp_path).fit(Batches(batches), steps=5)
    assert r.start_step == 4 and r.resumed_from.name == "step-000000004.pt"
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["step-000000002.pt", "step-000000004.pt", "step-000000005.pt", "step-000000006.pt.damaged"]


def test_a_checkpoint_missing_keys_is_a_checkpoint_error_naming_them(tmp_path):
    batches = jobs.global_batches(8, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=4)
    newest = tmp_path / "ck" / "step-000000004.pt"
    _rewrite(newest, drop=("optimizer", "rng"))
    with pytest.raises(CheckpointError, match="step-000000004.pt lacks 'optimizer', 'rng'") as info:
        _trainer(tmp_path).fit(Batches(batches), steps=8, resume=newest)
    assert info.value.missing == ["optimizer", "rng"]
    with pytest.warns(RuntimeWarning, match="lacks 'optimizer', 'rng'"):  # auto: the previous one
        r = _trainer(tmp_path).fit(Batches(batches), steps=8)
    assert r.start_step == 2


def test_checkpoints_count_samples_across_resumes(tmp_path):
    batches = jobs.global_batches(8, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=3)
    ck = st.Checkpoints(tmp_path / "ck")
    assert ck.load(ck.path_for(2))["samples"] == 8 and ck.load(ck.path_for(3))["samples"] == 12
    again = _trainer(tmp_path)
    again.fit(Batches(batches), steps=4)
    assert ck.load(ck.path_for(4))["samples"] == 16 and again.samples_seen == 16


def test_without_checkpoints_auto_resume_is_a_no_op():
    r = _trainer().fit(jobs.global_batches(2, 4), steps=2)  # resume="auto" by default
    assert r.start_step == 0 and r.step == 2 and r.resumed_from is None and r.checkpoint is None


def test_a_second_fit_continues_the_same_data():
    trainer = _trainer()
    data = Batches(jobs.global_batches(6, 4))
    trainer.fit(data, steps=2, resume=None)
    r = trainer.fit(data, steps=5)
    assert r.start_step == 2 and r.step == 5 and data.pos == 5


def test_resume_when_already_done_runs_nothing(tmp_path):
    batches = jobs.global_batches(4, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=4)
    again = _trainer(tmp_path).fit(Batches(batches), steps=4)
    assert again.steps_run == 0 and again.step == 4 and again.losses == {}


def test_unused_parameter_is_named(tmp_path):
    trainer = _trainer(unused=True)
    with pytest.raises(UnusedParameters, match=r"spare\.weight, spare\.bias") as info:
        trainer.fit(jobs.global_batches(2, 4), steps=1, resume=None)
    assert info.value.parameters == ["spare.weight", "spare.bias"]
    with pytest.warns(RuntimeWarning, match="spare.weight"):
        _trainer(unused=True, unused_parameters="warn").fit(jobs.global_batches(2, 4), steps=1, resume=None)


def test_time_limit_stops_and_epochs_repeat(tmp_path):
    slow = []

    def loss(model, batch):
        slow.append(1)
        time.sleep(0.05)
        return jobs.mse(model, batch)

    r = _trainer(loss_fn=loss).fit(jobs.global_batches(2, 4), seconds=0.3, resume=None)
    assert 3 <= r.step <= 12 and len(slow) == r.step  # more steps than batches: the list was iterated again


def test_telemetry_records_loss_times_and_memory(tmp_path):
    r = _trainer(telemetry_dir=tmp_path, log_every=2).fit(jobs.global_batches(3, 4), steps=6, resume=None)
    records = [json.loads(line) for line in r.telemetry.read_text().splitlines()]
    assert [rec["step"] for rec in records] == [2, 4, 6]
    assert all({"loss", "data_wait_s", "compute_s", "host_rss_bytes", "host_peak_rss_bytes", "samples_per_s"}
               <= set(rec) for rec in records)
    assert [rec["samples"] for rec in records] == [8, 16, 24] and all(rec["samples_per_s"] > 0 for rec in records)
    assert records[-1]["loss"] == pytest.approx(r.losses[6])
    assert r.samples == 24 and r.samples_per_s > 0 and 0 <= r.data_wait_fraction < 1


@dataclasses.dataclass
class _Crops:
    """A custom batch type: a dataclass of tensors (what persona scripts hand the Trainer)."""

    x: torch.Tensor


def test_samples_of_a_dataclass_batch_are_its_first_tensors_rows():
    """Regression: a dataclass batch was counted as one sample a step (neither tensor, mapping nor sequence),
    so samples and samples/s were B times too small, silently."""
    batches = [_Crops(b) for b in jobs.global_batches(3, 4)]
    r = _trainer(loss_fn=lambda model, b: jobs.mse(model, b.x)).fit(batches, steps=3, resume=None)
    assert r.samples == 12


def test_samples_of_a_nested_batch_are_its_first_tensors_rows():
    """Regression: a dict whose values are dicts or lists of tensors (inputs of a multi-input model) held no
    tensor directly and was counted as one sample a step."""
    batches = [{"inputs": {"x": b}, "frames": [b]} for b in jobs.global_batches(3, 4)]
    r = _trainer(loss_fn=lambda model, b: jobs.mse(model, b["inputs"]["x"])).fit(batches, steps=3, resume=None)
    assert r.samples == 12


@pytest.mark.parametrize("shape", ["names first", "empty list first", "deque"])
def test_samples_of_a_batch_are_counted_from_the_first_container_holding_a_tensor(shape):
    """Regression: a batch whose first container held no tensor (a list of sample names, an empty list) was
    counted by that container (one sample a step), and one holding a deque of frames as one too: samples and
    samples/s silently B times too small. The first tensor's rows count, wherever it is."""
    from collections import deque

    def batch(b):
        return {"names first": {"ids": ["a"] * len(b), "inputs": {"x": b}},
                "empty list first": {"meta": [], "inputs": {"x": b}},
                "deque": {"frames": deque([b])}}[shape]

    def loss(model, b):
        return jobs.mse(model, b["frames"][0] if "frames" in b else b["inputs"]["x"])

    r = _trainer(loss_fn=loss).fit([batch(b) for b in jobs.global_batches(3, 4)], steps=3, resume=None)
    assert r.samples == 12


def test_trainer_arguments_are_checked():
    with pytest.raises(InvalidArgument, match="amp"):
        _trainer(amp="int8")
    with pytest.raises(InvalidArgument, match="accumulate"):
        _trainer(accumulate=0)
    with pytest.raises(InvalidArgument, match="steps=N or seconds"):
        _trainer().fit([], resume=None)
    with pytest.raises(InvalidArgument, match="yields no batches"):
        _trainer().fit([], steps=1, resume=None)
    with pytest.raises(InvalidArgument, match="scalar"):
        _trainer(loss_fn=lambda m, b: m(b[:, :4])).fit(jobs.global_batches(1, 4), steps=1, resume=None)


def test_fp16_grad_scaler_skips_overflowing_steps_and_resumes_its_scale(tmp_path):
    batches = jobs.global_batches(6, 8)
    calls = []

    def loss(model, batch):  # the third micro-batch overflows fp16 in the backward pass
        calls.append(1)
        value = jobs.mse(model, batch)
        return value * 1e30 if len(calls) == 3 else value

    trainer = _trainer(tmp_path, amp="fp16", loss_fn=loss)
    trainer.fit(Batches(batches[:2]), steps=2)
    scale = trainer.scaler.get_scale()
    before = [p.detach().clone() for p in trainer.module.parameters()]
    r = trainer.fit(Batches(batches[2:]), steps=3, resume=None)  # the overflowing step
    after = [p.detach() for p in trainer.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # skipped, not applied
    assert trainer.scaler.get_scale() == scale / 2 and r.step == 3
    assert not r.losses[3] < 1e20  # the overflowing loss (inf or huge) is reported as it was
    saved = st.Checkpoints(tmp_path / "ck").load(r.checkpoint)
    assert saved["scaler"]["scale"] == scale / 2
    resumed = _trainer(tmp_path, amp="fp16")
    assert resumed.scaler.get_scale() != scale / 2
    resumed.fit(Batches(batches), steps=3)  # nothing to run: only the restore
    assert resumed.scaler.get_scale() == scale / 2


def test_bf16_autocast_trains_on_cpu():
    r = _trainer(amp="bf16").fit(jobs.global_batches(4, 8), steps=4, resume=None)
    assert sorted(r.losses) == [1, 2, 3, 4] and all(np.isfinite(list(r.losses.values())))


# -- CropBatches ---------------------------------------------------------------------------------


@pytest.fixture
def volume(tmp_path):
    path = tmp_path / "vol.zarr"
    z = zarr.create_array(str(path), shape=(16, 64, 64), chunks=(8, 32, 32), dtype="uint16")
    z[:] = np.arange(16 * 64 * 64, dtype=np.uint16).reshape(16, 64, 64)
    return str(path)


def test_crop_batches_resume_with_the_next_batch(volume):
    cfg = stoker.Config(batch_size=2, sample_shape=(4, 8, 8), n_compute_threads=1, host_buffer_bytes=4 << 20,
                        device="cpu")
    src = stoker.RandomCrops([volume], (4, 8, 8), seed=3)
    with st.CropBatches(src.for_rank(0, 1), cfg) as data:
        it = iter(data)
        seen = [next(it).clone() for _ in range(5)]
        state = data.state_dict()  # after 5 batches, whatever the pipeline read ahead
        assert state["steps"] == 10
    with st.CropBatches(src.for_rank(0, 1), cfg) as again:
        again.load_state_dict(state)
        nxt = next(iter(again))
    with st.CropBatches(src.for_rank(0, 1), cfg) as straight:
        expected = [x.clone() for _, x in zip(range(6), straight)]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected[:5]))
    assert torch.equal(nxt, expected[5])
    arr = np.asarray(zarr.open_array(volume))
    s = src.sample(0, 0)
    np.testing.assert_array_equal(seen[0][0].numpy(), arr[tuple(slice(a, b) for a, b in s.aabb)])


def test_crop_batches_misuse(volume):
    cfg = stoker.Config(batch_size=2, sample_shape=(4, 8, 8), n_compute_threads=1, host_buffer_bytes=4 << 20,
                        device="cpu")
    src = stoker.RandomCrops([volume], (4, 8, 8)).for_rank(0, 1)
    with pytest.raises(InvalidArgument, match="RankShare"):
        st.CropBatches(stoker.RandomCrops([volume], (4, 8, 8)), cfg)
    data = st.CropBatches(src, cfg)
    next(iter(data))
    with pytest.raises(InvalidArgument, match="before iterating"):
        data.load_state_dict(src.state_dict())
    with pytest.raises(InvalidArgument, match="iterated once"):
        iter(data)
    data.close()
    with pytest.raises(stoker.ShutdownError):
        iter(data)


# -- launch: 2 CPU ranks ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_launch_two_cpu_ranks_returns_rank0_result():
    out = st.launch(jobs.describe, nprocs=2, use_cuda=False)
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["local_rank"] for r in ranks] == [0, 1]
    assert {r["world"] for r in ranks} == {2} and {r["pg_world"] for r in ranks} == {2}
    assert {r["backend"] for r in ranks} == {"gloo"} and {r["device"] for r in ranks} == {"cpu"}
    assert [r["env_rank"] for r in ranks] == ["0", "1"]
    assert {r["threads"] for r in ranks} == {max(1, (os.cpu_count() or 1) // 2)}  # the cores are shared
    assert not torch.distributed.is_initialized()  # the parent never joined a group


@pytest.mark.timeout(120)
def test_launch_splits_the_cpus_the_process_may_run_on(monkeypatch):
    # spawned CPU ranks inherit this process's affinity mask: under taskset or a cpuset they must split
    # those CPUs, not the machine's (16 reported cores with 2 usable gave each of 2 ranks 8 threads)
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity masks on this platform")
    mask = os.sched_getaffinity(0)
    monkeypatch.setattr(os, "cpu_count", lambda: 8 * len(mask))
    out = st.launch(jobs.describe, nprocs=2, use_cuda=False)
    assert {r["threads"] for r in out["ranks"]} == {max(1, len(mask) // 2)}


@pytest.mark.timeout(120)
def test_a_failing_rank_ends_every_rank_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        st.launch(jobs.rank1_raises, nprocs=2, use_cuda=False)
    assert time.monotonic() - t0 < 50  # rank 0 sat in a collective and a 60 s sleep: it was stopped
    assert info.value.rank == 1
    assert "ValueError: boom from rank 1: bad sample 42" in str(info.value)
    assert "rank1_raises" in info.value.traceback  # the failing rank's own traceback


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_as_the_cause():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 was killed by signal SIGKILL") as info:
        st.launch(jobs.rank1_killed, nprocs=2, use_cuda=False)
    assert time.monotonic() - t0 < 50 and info.value.rank == 1


@pytest.mark.timeout(120)
def test_a_failed_checkpoint_write_stops_every_rank_with_the_cause(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(RankFailed) as info:
        st.launch(jobs.rank0_cannot_write_checkpoint, str(blocker / "ck"), nprocs=2, use_cuda=False)
    assert info.value.rank == 0 and "CheckpointError: cannot write checkpoint" in str(info.value)
    assert "rank 1 then failed with CheckpointError: rank 0 could not write" in str(info.value)


@pytest.mark.timeout(120)
def test_a_rank_exits_only_after_its_non_daemon_threads(tmp_path):
    st.launch(jobs.background_writer, str(tmp_path / "flag"), nprocs=2, use_cuda=False)
    assert (tmp_path / "flag.0").read_text() == "done" and (tmp_path / "flag.1").read_text() == "done"


@pytest.mark.timeout(120)
def test_unused_parameter_check_names_the_parameter_under_ddp():
    with pytest.raises(RankFailed, match=r"UnusedParameters.*spare\.weight, spare\.bias"):
        st.launch(jobs.unused_parameter, nprocs=2, use_cuda=False)


@pytest.mark.timeout(120)
def test_ddp_with_accumulation_matches_one_process_on_the_global_batch():
    out = st.launch(jobs.ddp_accumulate, 3, nprocs=2, use_cuda=False)
    assert out["step"] == 3 and out["samples"] == 12
    assert out["no_sync"] == 3  # one of the two micro-steps of each step skipped the all-reduce
    rank0, rank1 = out["params"]
    for a, b in zip(rank0, rank1):
        assert torch.equal(a, b)  # DDP kept the replicas identical
    ref = _trainer()
    ref.fit(jobs.global_batches(3, 4), steps=3, resume=None)
    for a, b in zip(rank0, ref.module.parameters()):
        torch.testing.assert_close(a, b.detach())
    assert any(not torch.equal(p, q) for p, q in zip(rank0, jobs.Tiny().parameters()))  # trained


@pytest.mark.timeout(180)
def test_launch_under_torchrun_runs_fn_as_this_rank(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # two gloo ranks, also beside a GPU
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           jobs.__file__], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / f"rankinfo-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in seen] == [0, 1] and {r["world"] for r in seen} == {2}
    assert {r["backend"] for r in seen} == {"gloo"} and {r["pg_world"] for r in seen} == {2}
    assert {r["threads"] for r in seen} == {1}  # torchrun's OMP_NUM_THREADS: launch leaves it alone


def test_launch_in_process_with_one_rank(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = st.launch(jobs.describe, nprocs=1, use_cuda=False)
    assert out["ranks"][0]["world"] == 1 and out["ranks"][0]["env_rank"] == "0"
    assert not torch.distributed.is_initialized()  # torn down
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the environment is restored


@pytest.mark.timeout(120)
def test_a_launch_removes_the_folders_of_killed_launchers_only(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys
    import tempfile

    from stoker.storage.fsutil import HOST

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    flag = tmp_path / "running"
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import train_jobs, stoker.train as st; "
              "st.launch(train_jobs.wait_to_be_killed, sys.argv[2], nprocs=1, use_cuda=False)")
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    killed = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(jobs.__file__), str(flag)], env=env)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), "the launch never started"
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        left = [p for p in tmpdir.iterdir() if p.name.startswith("stoker-launch-")]
        assert len(left) == 1 and left[0].name.startswith(f"stoker-launch-{HOST}-{killed.pid}-")
        kept = tmpdir / f"stoker-launch-{HOST}-{live.pid}-0123abcd"  # a launcher still running
        kept.mkdir()
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "precious").write_text("keep me")
        planted = tmpdir / f"stoker-launch-{HOST}-{killed.pid}-0badf00d"  # a dead owner's name, a symlink
        planted.symlink_to(victim, target_is_directory=True)
        elsewhere = tmpdir / f"stoker-launch-otherhost-{killed.pid}-0000cafe"  # a day old, on another machine
        elsewhere.mkdir()
        os.utime(elsewhere, (time.time() - 3 * 24 * 3600,) * 2)
        expected = [kept.name, planted.name, elsewhere.name]
        if os.geteuid() == 0:  # only root can make a folder another user's
            theirs = tmpdir / f"stoker-launch-{HOST}-{killed.pid}-0000beef"
            theirs.mkdir()
            os.chown(theirs, 4242, 4242)
            expected.append(theirs.name)
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        out = st.launch(jobs.describe, nprocs=1, use_cuda=False)
        assert out["ranks"][0]["world"] == 1
        assert sorted(p.name for p in tmpdir.iterdir()) == sorted(expected)
        assert (victim / "precious").read_text() == "keep me"
    finally:
        for proc in (killed, live):
            proc.kill()
            proc.wait(timeout=30)


def test_a_torchrun_rank_beyond_the_gpus_is_told_the_fix(monkeypatch):
    import importlib

    launch_module = importlib.import_module("stoker.train.launch")  # the module; stoker.train.launch is the function

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidArgument, match=r"local rank 1 has no GPU: 1 visible.*--nproc_per_node=1.*use_cuda=False"):
        launch_module._run_rank(jobs.describe, (), rank=1, local_rank=1, world_size=2, backend="nccl", cuda=True,
                                timeout_s=5.0, threads=None)


def test_a_cpu_trainer_passes_batches_through_as_they_are():
    # a CPU trainer hands loss_fn the batch object it was given: numpy leaves, string ids and custom
    # objects are the user's business (a GPU trainer moves tensors and must be able to)
    seen = []

    class Meta:
        def __init__(self):
            self.raw = np.zeros(3)

    def loss(model, batch):
        seen.append(batch)
        return jobs.mse(model, batch["x"])

    batches = [{"x": b, "ids": np.array(["a", "b", "c", "d"]), "meta": Meta()} for b in jobs.global_batches(2, 4)]
    _trainer(loss_fn=loss).fit(batches, steps=2, resume=None)
    assert [id(b) for b in seen] == [id(b) for b in batches]


@pytest.mark.cuda
def test_a_cpu_trainer_takes_batches_a_pipeline_left_on_the_gpu():
    batches = jobs.global_batches(3, 4)
    ref = _trainer()
    ref.fit(batches, steps=3, resume=None)
    on_gpu = _trainer()  # CPU model; the batches arrive on the GPU, as from Config(device=None) on a GPU machine
    on_gpu.fit([b.cuda() for b in batches], steps=3, resume=None)
    for a, b in zip(ref.module.parameters(), on_gpu.module.parameters()):
        assert torch.equal(a, b)


def test_under_torchrun_reads_the_launcher_environment(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert st.under_torchrun()
    monkeypatch.delenv("MASTER_PORT")
    assert not st.under_torchrun()


def test_launch_arguments_are_checked():
    with pytest.raises(InvalidArgument, match="nprocs"):
        st.launch(jobs.describe, nprocs=0)
    with pytest.raises(InvalidArgument, match="backend"):
        st.launch(jobs.describe, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="nccl"):
            st.launch(jobs.describe, backend="nccl")
        with pytest.raises(InvalidArgument, match="no CUDA"):
            st.launch(jobs.describe, use_cuda=True)


# -- CUDA (skipped without a GPU) -------------------------------------------------------------------


@pytest.mark.cuda
def test_fp16_with_grad_scaler_on_cuda_checkpoints_the_scaler(tmp_path):
    batches = [b.cuda() for b in jobs.global_batches(4, 8)]
    trainer = _trainer(tmp_path, amp="fp16", device="cuda")
    r = trainer.fit(batches, steps=4)
    assert trainer.scaler is not None and all(np.isfinite(list(r.losses.values())))
    state = st.Checkpoints(tmp_path / "ck").load(r.checkpoint)
    assert state["scaler"]["scale"] > 0 and r.peak_cuda_bytes > 0


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_launch_binds_each_rank_to_its_gpu():
    out = st.launch(jobs.describe, nprocs=1, use_cuda=True)
    assert out["ranks"][0]["device"] == "cuda:0" and out["ranks"][0]["backend"] == "nccl"


# -- non-finite losses, evaluation, what fit says ---------------------------------------------------


def _with_nan(batches, index):
    out = [b.clone() for b in batches]
    out[index][0, 0] = float("nan")
    return out


def test_a_nonfinite_loss_skips_the_step_and_is_counted(tmp_path):
    batches = jobs.global_batches(4, 4)
    trainer = _trainer(tmp_path, telemetry_dir=tmp_path, log_every=1)
    r = trainer.fit(_with_nan(batches, 1), steps=4, resume=None)  # step 2's batch holds a NaN
    assert r.step == 4 and r.skipped_steps == 1 and trainer.skipped_steps == 1
    assert math.isnan(r.losses[2]) and all(math.isfinite(r.losses[s]) for s in (1, 3, 4))
    ref = _trainer()  # the same run without step 2: the NaN batch moved nothing
    ref.fit([batches[0], batches[2], batches[3]], steps=3, resume=None)
    for a, b in zip(trainer.module.parameters(), ref.module.parameters()):
        assert torch.equal(a, b)
    records = [json.loads(line) for line in r.telemetry.read_text().splitlines()]
    assert [rec["skipped_steps"] for rec in records] == [0, 1, 1, 1] and records[1]["loss"] is None
    saved = st.Checkpoints(tmp_path / "ck").load(tmp_path / "ck" / "step-000000002.pt")
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_nonfinite_losses_in_a_row_stop_with_a_typed_error(tmp_path):
    batches = jobs.global_batches(6, 4)
    bad = _with_nan(_with_nan(_with_nan(batches, 2), 3), 4)
    trainer = _trainer(tmp_path, max_nonfinite_steps=3)
    with pytest.raises(stoker.NonFiniteLoss, match=r"NaN or infinite in 3 steps in a row \(steps 3-5") as info:
        trainer.fit(bad, steps=6, resume=None)
    assert info.value.step == 5 and info.value.count == 3 and trainer.skipped_steps == 3
    assert [s for s, _ in st.Checkpoints(tmp_path / "ck").list()] == [2, 4]  # 4: finite weights, steps skipped
    ok = _trainer(max_nonfinite_steps=4).fit(bad, steps=6, resume=None)  # one fewer than the limit: goes on
    assert ok.skipped_steps == 3 and ok.step == 6
    with pytest.raises(InvalidArgument, match="max_nonfinite_steps"):
        _trainer(max_nonfinite_steps=0)


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    calls = []

    def loss(model, batch):  # finite losses; on the second step a weight turns infinite (as by overflow)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                model.body.weight[0, 0] = float("inf")
        return jobs.mse(model, batch)

    trainer = _trainer(tmp_path, loss_fn=loss)
    with pytest.raises(stoker.NonFiniteLoss, match=r"weights hold NaN or infinite values at step 2 \(first: "
                                                   r"body\.weight\); they are not checkpointed") as info:
        trainer.fit(jobs.global_batches(4, 4), steps=4, resume=None)
    assert info.value.parameter == "body.weight"
    assert st.Checkpoints(tmp_path / "ck").list() == []


def test_evaluation_reports_the_loss_and_leaves_training_unchanged(tmp_path):
    batches = jobs.global_batches(5, 4)
    evals = [b[:n] for b, n in zip(jobs.global_batches(7, 4)[5:], (4, 2))]  # 6 samples: weighted by batch size

    def noisy_mse(model, batch):  # noise in training only: eval mode must reach the model
        noise = 0.05 * torch.randn_like(batch) if model.training else 0
        return jobs.mse(model, batch + noise)

    torch.manual_seed(3)
    plain = _trainer(loss_fn=noisy_mse).fit(batches, steps=5, resume=None)
    torch.manual_seed(3)
    trainer = _trainer(loss_fn=noisy_mse, telemetry_dir=tmp_path, log_every=2)
    r = trainer.fit(batches, steps=5, resume=None, eval_data=evals, eval_every=2)
    assert r.losses == plain.losses  # evaluating drew no random numbers training would see
    assert sorted(r.eval_losses) == [2, 4, 5] and trainer.module.training  # every 2 steps, and at the end
    with torch.no_grad():
        expected = sum(float(jobs.mse(trainer.module, b)) * len(b) for b in evals) / 6
    assert r.eval_losses[5] == pytest.approx(expected, rel=1e-6)
    records = [json.loads(line) for line in r.telemetry.read_text().splitlines()]
    assert {rec["step"]: rec["eval_loss"] for rec in records if "eval_loss" in rec} == pytest.approx(r.eval_losses)
    assert [rec["step"] for rec in records if "loss" in rec] == [2, 4]
    with pytest.raises(InvalidArgument, match="eval_every needs eval_data"):
        _trainer().fit(batches, steps=1, resume=None, eval_every=2)
    with pytest.raises(InvalidArgument, match="eval_data .* yields no batches"):
        _trainer().fit(batches, steps=1, resume=None, eval_data=[])


def test_fit_says_where_it_starts_and_when_there_is_nothing_to_do(tmp_path, capsys):
    batches = jobs.global_batches(6, 4)
    _trainer(tmp_path).fit(Batches(batches), steps=4)
    assert capsys.readouterr().out == ""  # progress=False: silent
    _trainer(tmp_path, progress=True).fit(Batches(batches), steps=6)
    out = capsys.readouterr().out
    assert f"training: resuming at step 4 from {tmp_path / 'ck' / 'step-000000004.pt'}" in out
    r = _trainer(tmp_path, progress=True).fit(Batches(batches), steps=6)
    out = capsys.readouterr().out
    assert r.steps_run == 0 and "training: nothing to do, already at step 6 of steps=6" in out
    assert "raise steps to train further" in out


def test_fit_with_no_time_limit_shows_progress_by_step(capsys):
    """seconds=inf (stoker demo --seconds inf) is no time limit, as checks.seconds allows: the progress bar
    counts steps (it once drew a bar of an infinite number of seconds, and tqdm's format failed)."""

    class Stop(Exception):
        pass

    class ThreeThenStop:  # the data a user stops: three batches, then the interruption
        def __iter__(self):
            yield from jobs.global_batches(3, 4)
            raise Stop

    with pytest.raises(Stop):
        _trainer(progress=True).fit(ThreeThenStop(), seconds=math.inf, resume=None)
    assert "3step" in capsys.readouterr().err.replace(" ", "")


@pytest.mark.timeout(120)
def test_ddp_ranks_skip_a_nonfinite_step_together_and_reduce_the_eval_loss():
    out = st.launch(jobs.nonfinite_on_rank1_and_eval, nprocs=2, use_cuda=False)
    rank0, rank1 = out["ranks"]
    assert rank0["skipped"] == rank1["skipped"] == 1  # only rank 1's loss was NaN; both skipped
    assert math.isnan(rank1["losses"][2]) and math.isfinite(rank0["losses"][2])
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)  # still replicas
    ref = _trainer()  # one process on the global batches, without step 2
    gb = jobs.global_batches(3, 4)
    ref.fit([gb[0], gb[2]], steps=2, resume=None)
    for a, b in zip(rank0["params"], ref.module.parameters()):
        torch.testing.assert_close(a, b.detach())
    evals = [*jobs.global_batches(5, 3)[3:], jobs.global_batches(6, 3)[5][:1]]  # rank 0's two, rank 1's one
    with torch.no_grad():
        expected = sum(float(jobs.mse(ref.module, b)) * len(b) for b in evals) / 7
    assert rank0["eval"] == rank1["eval"] and list(rank0["eval"]) == [3]
    assert rank0["eval"][3] == pytest.approx(expected, rel=1e-5)


def test_telemetry_logs_the_mean_of_the_ranks_losses(tmp_path):
    """Two ranks with other losses at every step: the telemetry's ``loss`` is their mean (the loss of the
    global batch), not rank 0's own, nor the sum over ranks."""
    out = st.launch(jobs.telemetry_of_two_ranks, str(tmp_path / "run"), nprocs=2, use_cuda=False)
    rank0, rank1 = out["ranks"]
    path = rank0["telemetry"]
    assert path, "rank 0 wrote no telemetry"
    records = [json.loads(line) for line in open(path).read().splitlines()]
    logged = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(logged) == [1, 2, 3]
    for step, loss in logged.items():
        a, b = rank0["losses"][step], rank1["losses"][step]
        assert a != pytest.approx(b)  # the ranks' losses differ, so a mean, a sum and rank 0's own differ
        assert loss == pytest.approx((a + b) / 2, rel=1e-6)


class Masked(torch.nn.Module):
    """A BatchNorm (running statistics updated by every training forward) and a causal mask buffer of -inf
    (as nn.Transformer.generate_square_subsequent_mask makes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(self.body(x)) @ torch.softmax(self.mask, -1)).sum(-1, keepdim=True)


def _masked_trainer(tmp_path=None, scheduler=False):
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    ck = st.Checkpoints(tmp_path / "ck", every=2) if tmp_path is not None else None
    return st.Trainer(model, opt, jobs.mse, device="cpu", progress=False, checkpoints=ck, scheduler=sched)


def test_infinite_mask_buffers_are_checkpointed_and_a_skipped_step_leaves_the_buffers(tmp_path):
    """A -inf mask buffer is the model's design, not divergence: checkpoints are written. A NaN batch's
    forward turned BatchNorm's running statistics to NaN; skipping the step puts them back, so the model
    equals a run without that batch (buffers included), and the next checkpoint is written."""
    batches = jobs.global_batches(4, 4)
    trainer = _masked_trainer(tmp_path)
    r = trainer.fit(_with_nan(batches, 1), steps=4, resume=None)
    assert r.skipped_steps == 1 and [s for s, _ in st.Checkpoints(tmp_path / "ck").list()] == [2, 4]
    ref = _masked_trainer()
    ref.fit([batches[0], batches[2], batches[3]], steps=3, resume=None)
    got, want = trainer.module.state_dict(), ref.module.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.isinf(got["mask"]).any()
    # a mask that was finite when fit started must stay finite; NaN is refused in any buffer
    model = Masked()
    with torch.no_grad():
        model.mask.fill_(0.0)
    bad = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), jobs.mse, device="cpu", progress=False,
                     checkpoints=st.Checkpoints(tmp_path / "ck2", every=1))

    def poison(m, batch):
        with torch.no_grad():
            m.mask[0, 1] = float("-inf")
        return jobs.mse(m, batch)

    bad.loss_fn = poison
    with pytest.raises(stoker.NonFiniteLoss, match=r"first: mask\)"):
        bad.fit(batches, steps=1, resume=None)


def test_a_skipped_first_step_still_counts_on_the_scheduler_without_a_warning(tmp_path):
    import warnings

    batches = jobs.global_batches(3, 4)
    trainer = _masked_trainer(scheduler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        r = trainer.fit(_with_nan(batches, 0), steps=3, resume=None)
    assert r.skipped_steps == 1 and trainer.scheduler.last_epoch == 3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 8)


def _gen(batches):
    yield from batches


def test_eval_data_that_would_hang_or_run_dry_is_refused(volume):
    batches = jobs.global_batches(2, 4)
    with pytest.raises(InvalidArgument, match=r"eval_data \(generator\) is an iterator: the first evaluation "
                                              r"would use it up.*stoker.CropDataset"):
        _trainer().fit(batches, steps=1, resume=None, eval_data=_gen(batches))
    src = stoker.RandomCrops([volume], sample_shape=(4, 4, 4), seed=0, samples_per_epoch=8).for_rank(0, 1)
    endless = st.CropBatches(src, stoker.Config(batch_size=2, device="cpu", host_buffer_bytes=16 << 20))
    with pytest.raises(InvalidArgument, match=r"eval_data \(CropBatches\) is endless"):
        _trainer().fit(batches, steps=1, resume=None, eval_data=endless)
    with pytest.raises(InvalidArgument, match="is an iterator"):
        _trainer().evaluate(iter(batches))
    assert math.isfinite(_trainer().evaluate(batches))  # a list: fine, any number of times


def test_the_eval_reduction_is_marked_eval_not_a_wait(monkeypatch):
    """The heartbeat blames the rank behind one waiting in a collective ("sync"); a rank that finished its
    evaluation share first waits for the others under "eval", so a long evaluation is never blamed."""
    import stoker.train.trainer as trainer_mod

    phases, seen = [], []
    monkeypatch.setattr(trainer_mod, "mark", lambda step, phase: phases.append(phase))

    def reduce(values, op, group):
        seen.append(phases[-1])
        return list(values)

    monkeypatch.setattr(trainer_mod, "all_reduce", reduce)
    trainer = _trainer()
    trainer.evaluate(jobs.global_batches(2, 4))
    assert seen == ["eval"]
    seen.clear()
    r = trainer.fit(jobs.global_batches(2, 4), steps=2, resume=None, eval_data=jobs.global_batches(2, 4))
    assert list(r.eval_losses) == [2] and "eval" in seen


def test_telemetry_marks_the_steps_a_resumed_run_replays(tmp_path):
    batches = jobs.global_batches(8, 4)
    first = _trainer(tmp_path, telemetry_dir=tmp_path / "run", log_every=1).fit(Batches(batches), steps=5)
    (tmp_path / "ck" / "step-000000005.pt").unlink()  # killed after step 5, before its checkpoint
    second = _trainer(tmp_path, telemetry_dir=tmp_path / "run", log_every=1).fit(Batches(batches), steps=7)
    assert second.start_step == 4 and first.telemetry == second.telemetry
    records = [json.loads(line) for line in second.telemetry.read_text().splitlines()]
    assert [(r["step"], r.get("replayed", False)) for r in records] == [
        (1, False), (2, False), (3, False), (4, False), (5, False), (5, True), (6, False), (7, False)]
    from stoker.cli.plots import read_telemetry

    assert read_telemetry(tmp_path / "run")["loss"][5] == pytest.approx(second.losses[5])  # the last one wins


def test_every_evaluation_over_a_crop_dataset_sees_the_same_samples(volume):
    """Each iteration of a CropDataset runs the next epoch, so every evaluation over RandomCrops drew other
    crops: the eval losses of one run were over different samples, and a resumed run (a fresh dataset, at
    epoch 0 again) evaluated other samples than the uninterrupted run did at the same step. Every
    evaluation of a Trainer now starts where its first one over that data started, directly or through a
    DataLoader."""
    from torch.utils.data import DataLoader

    def make():
        src = stoker.RandomCrops([volume], sample_shape=(4, 8, 8), seed=0, samples_per_epoch=6).for_rank(0, 1)
        return stoker.CropDataset(src, stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1,
                                                     host_buffer_bytes=16 << 20), copy=True)

    def mean(model, batch):  # the loss says which crops were read
        return batch.double().mean().float()

    for wrap in (lambda ds: ds, lambda ds: DataLoader(ds, batch_size=None)):
        trainer = _trainer(loss_fn=mean)
        data = wrap(make())
        losses = [trainer.evaluate(data) for _ in range(3)]
        fresh = _trainer(loss_fn=mean).evaluate(wrap(make()))  # a resumed run's first evaluation
        assert losses[0] == losses[1] == losses[2] == fresh
        # eval data iterated before its first evaluation (a batch taken to check shapes) is evaluated from the
        # start of its epoch, as a fresh dataset is, not from where it stood
        early = make()
        next(iter(early))
        assert _trainer(loss_fn=mean).evaluate(wrap(early)) == fresh
