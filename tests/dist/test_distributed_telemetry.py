"""stoker.dist and stoker.dist.telemetry, over real gloo process groups (no fakes).

Each world size (2 and 3) is spawned once per module: the workers run every
collective check and leave their results as JSON in a temporary directory, which
the tests below then read. Single-process (no-op) paths run in the test process.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stoker.dist.collectives import RankInfo, rank_info
from stoker.engine.reduce import ReducedStats, reduce_stats
from stoker.dist.reduce import reduce_max
from stoker.engine.stats import COUNTERS, FIELD_COUNTERS, STAGES, FieldCounts, Metric, Stats
from stoker.errors import InvalidArgument, ShutdownError
from stoker.dist.telemetry import (CUDA_MEMORY_KEYS, MEMORY_KEYS, TelemetryWriter, memory_report, pinned_host_bytes,
                                   register_pinned, unregister_pinned)

from gloo_ranks import gloo_group, spawn_ranks, write_result

EVERY = 3
STEPS = 10
LOGGED = list(range(0, STEPS, EVERY))  # 0, 3, 6, 9


# -- per-rank inputs, shared by the workers and the expectations -----------------------------


def rank_metrics(rank: int) -> dict:
    return {
        "wait_s": 0.25 + 0.5 * rank,  # float, max on the last rank
        "rss_bytes": 1000 + 7 * rank,  # int
        "neg": -rank,  # int, max (0) on rank 0
        "flag": rank == 1,  # bool, True on one rank only
        "whole_float": 3.0,  # a float that looks like an int stays a float
        "mid": float((rank * 5) % 3),  # max on neither the first nor the last rank
        "mixed": 0 if rank == 0 else 0.5 * rank + 0.25,  # an int 0 on rank 0 (not yet measured), fractions after
    }


def rank_stats(rank: int) -> Stats:
    stages = {
        name: Metric(name, seconds=0.125 * (i + 1) * (rank + 1), count=i + rank, bytes_in=100 * rank + i,
                     bytes_out=50 * (rank + 1) * (i + 1))
        for i, name in enumerate(STAGES)
    }
    counters = {name: (j + 1) * 10 + rank * (j + 2) for j, name in enumerate(COUNTERS)}
    counters["samples"] = 60 * (rank + 1)
    return Stats(stages=stages, peak_host_bytes=[5000, 9000, 7000][rank % 3], gil_seconds=0.0625 * (rank + 1),
                 **counters)


def rank_fields(rank: int) -> dict[str, FieldCounts]:
    """Each rank's per-field counts: the same fields in another order on rank 1, which also has one the others
    lack; none on rank 2 (it popped no batch of fields yet)."""
    def counts(seed: int) -> FieldCounts:
        return FieldCounts(**{c: 1000 * seed + 17 * j + 3 for j, c in enumerate(FIELD_COUNTERS)})

    return [{"raw": counts(1), "labels": counts(2)},
            {"labels": counts(3), "mask": counts(4), "raw": counts(5)},
            {}][rank % 3]


def rank_elapsed(rank: int) -> float:
    return [3.0, 4.0, 2.0][rank % 3]


def step_metrics(rank: int, step: int) -> dict:
    return {"loss_like": float(step * (rank + 1)) / 4.0, "count": step + 10 * rank}


def typed(d: dict) -> dict:
    return {k: [type(v).__name__, v] for k, v in d.items()}


# -- the worker ------------------------------------------------------------------------------------


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        out: dict = {"pid": os.getpid(), "rank_info": list(vars(rank_info()).values())}

        m = rank_metrics(rank)
        before = dict(m)
        reduced = reduce_max(m)
        assert m == before and typed(m) == typed(before), "reduce_max mutated its input"
        assert reduced is not m
        out["reduce_max"] = typed(reduced)
        # Same keys in a different insertion order on each rank: packing must still pair keys up.
        items = list(m.items())
        out["reduce_max_reordered"] = typed(reduce_max(dict(items[rank:] + items[:rank])))
        out["empty"] = reduce_max({})

        # Groups of one (every rank must take part in creating every group).
        singles = [dist.new_group([r]) for r in range(world)]
        out["single_group"] = typed(reduce_max(m, group=singles[rank]))
        out["single_group_info"] = list(vars(rank_info(singles[rank])).values())

        r = reduce_stats(rank_stats(rank), elapsed_s=rank_elapsed(rank))
        out["reduce_stats"] = _stats_record(r)
        out["reduce_stats_no_elapsed"] = _stats_record(reduce_stats(rank_stats(rank)))
        with_fields = reduce_stats(Stats(samples=rank + 1, fields=rank_fields(rank)))
        out["reduce_stats_fields"] = {name: [getattr(c, k) for k in FIELD_COUNTERS]
                                      for name, c in with_fields.totals.fields.items()}
        out["reduce_stats_fields_samples"] = with_fields.totals.samples

        # Rank 0 alone writes; the others run straight into the next collective.
        returned = {}
        with TelemetryWriter(Path(tmp) / "tel", every=EVERY) as tw:
            for step in range(STEPS):
                if rank:
                    time.sleep(0.002 * rank)
                res = tw.log(step, step_metrics(rank, step))
                if res is not None:
                    returned[step] = res
        out["returned"] = returned
        with TelemetryWriter(Path(tmp) / f"per_rank_{rank}", every=1, tensorboard=False) as tw:
            tw.log(0, {"x": rank})

        # A subgroup without rank 0: its own rank 0 (global rank 1) writes, over its members only.
        members = sorted({1, world - 1})  # [1] for two ranks (a group of one), [1, 2] for three
        sub = dist.new_group(members)
        if rank in members:
            with TelemetryWriter(Path(tmp) / "sub", group=sub, tensorboard=False) as tw:
                out["sub"] = tw.log(0, {"r": rank})
        else:
            try:
                reduce_max({"r": rank}, group=sub)
            except InvalidArgument:
                out["non_member_rejected"] = True

        write_result(tmp, rank, out)
        dist.barrier()


def _stats_record(r: ReducedStats) -> dict:
    t = r.totals
    return {
        "stages": {n: [m.seconds, m.count, m.bytes_in, m.bytes_out] for n, m in t.stages.items()},
        "counters": typed({n: getattr(t, n) for n in COUNTERS + ("peak_host_bytes",)}),
        "gil_seconds": t.gil_seconds,
        "max_pop_wait_s": r.max_pop_wait_s,
        "max_peak_host_bytes": r.max_peak_host_bytes,
        "min_samples_per_s": r.min_samples_per_s,
        "max_samples_per_s": r.max_samples_per_s,
        "world_size": r.world_size,
        "read_amplification": r.read_amplification,
        "decode_amplification": r.decode_amplification,
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def group_run(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    results = spawn_ranks(_worker, world, tmp)
    return world, tmp, results


# -- spawned groups --------------------------------------------------------------------------------

spawned = pytest.mark.timeout(120)


@spawned
def test_rank_info_from_group(group_run):
    world, _, results = group_run
    for r, res in enumerate(results):
        assert res["rank_info"] == [r, world, r]
        assert res["single_group_info"] == [0, 1, r]  # rank in the group; local rank stays the global one


@spawned
def test_reduce_max_per_key_max_and_types(group_run):
    world, _, results = group_run
    per_rank = [rank_metrics(r) for r in range(world)]
    expected = {k: max(m[k] for m in per_rank) for k in per_rank[0]}
    expected = typed(expected)
    assert expected["flag"] == ["bool", True]  # the max of bools is "any rank True"
    assert expected["rss_bytes"][0] == "int" and expected["whole_float"] == ["float", 3.0]
    assert expected["mixed"][0] == "float"  # rank 0's int 0 does not truncate the others' fractional max
    for res in results:
        assert res["reduce_max"] == expected
        assert res["reduce_max_reordered"] == expected
        assert res["empty"] == {}


@spawned
def test_reduce_max_group_of_one_is_a_no_op(group_run):
    world, _, results = group_run
    for r, res in enumerate(results):
        assert res["single_group"] == typed(rank_metrics(r))


@spawned
def test_reduce_stats_sums_max_min(group_run):
    world, _, results = group_run
    ranks = [rank_stats(r) for r in range(world)]
    rates = [s.samples / rank_elapsed(r) for r, s in enumerate(ranks)]
    stages = {
        n: [sum(s.stages[n].seconds for s in ranks), sum(s.stages[n].count for s in ranks),
            sum(s.stages[n].bytes_in for s in ranks), sum(s.stages[n].bytes_out for s in ranks)]
        for n in STAGES
    }
    counters = {n: sum(getattr(s, n) for s in ranks) for n in COUNTERS + ("peak_host_bytes",)}
    for res in results:
        got = res["reduce_stats"]
        assert got["world_size"] == world
        assert got["stages"].keys() == stages.keys()
        for n in STAGES:
            assert got["stages"][n] == pytest.approx(stages[n], rel=1e-12)
            assert all(type(v) is int for v in got["stages"][n][1:])
        assert got["counters"] == typed(counters)
        assert got["gil_seconds"] == pytest.approx(sum(s.gil_seconds for s in ranks))  # GIL time sums over ranks
        assert got["max_pop_wait_s"] == pytest.approx(max(s.stages["pop_wait"].seconds for s in ranks))
        assert got["max_peak_host_bytes"] == max(s.peak_host_bytes for s in ranks)
        assert got["min_samples_per_s"] == pytest.approx(min(rates))
        assert got["max_samples_per_s"] == pytest.approx(max(rates))
        assert got["read_amplification"] == pytest.approx(counters["bytes_read"] / counters["bytes_needed"])
        assert got["decode_amplification"] == pytest.approx(counters["bytes_decoded"] / counters["bytes_needed"])
        no_elapsed = res["reduce_stats_no_elapsed"]
        assert no_elapsed["min_samples_per_s"] is None and no_elapsed["max_samples_per_s"] is None
        assert no_elapsed["counters"] == got["counters"]


@spawned
def test_reduce_stats_sums_each_field_over_the_ranks_that_have_it(group_run):
    world, _, results = group_run
    ranks = [rank_fields(r) for r in range(world)]
    names = list(dict.fromkeys(name for fields in ranks for name in fields))  # as the ranks first name them
    want = {name: [sum(getattr(f[name], k) for f in ranks if name in f) for k in FIELD_COUNTERS] for name in names}
    assert list(want) == ["raw", "labels", "mask"]
    for res in results:  # every rank gets the sums, the rank without fields too
        assert res["reduce_stats_fields"] == want
        assert list(res["reduce_stats_fields"]) == names
        assert res["reduce_stats_fields_samples"] == sum(r + 1 for r in range(world))


@spawned
def test_writer_rank0_writes_exactly_the_logged_steps(group_run):
    world, tmp, results = group_run
    lines = (tmp / "tel" / "telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [rec["step"] for rec in records] == LOGGED
    times = [rec.pop("time") for rec in records]
    assert all(isinstance(t, float) for t in times) and times == sorted(times)
    for rec in records:
        step = rec.pop("step")
        want = {k: max(step_metrics(r, step)[k] for r in range(world)) for k in step_metrics(0, step)}
        assert typed(rec) == typed(want)
        for res in results:  # every rank gets the reduced values back, not only rank 0
            assert typed(res["returned"][str(step)]) == typed(want)
    assert all(set(map(int, res["returned"])) == set(LOGGED) for res in results)
    # Only rank 0 created anything.
    assert (tmp / "per_rank_0" / "telemetry.jsonl").exists()
    assert not any((tmp / f"per_rank_{r}").exists() for r in range(1, world))
    assert os.listdir(tmp / "per_rank_0") == ["telemetry.jsonl"]  # tensorboard=False: no event file


@spawned
def test_writer_on_a_subgroup(group_run):
    world, tmp, results = group_run
    members = sorted({1, world - 1})
    want = {"r": max(members)}
    for r in members:
        assert results[r]["sub"] == want
    assert "sub" not in results[0] and results[0].get("non_member_rejected")
    records = [json.loads(line) for line in (tmp / "sub" / "telemetry.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in rec.items() if k != "time"} for rec in records] == [{"step": 0, **want}]


@spawned
def test_writer_output_reads_back_in_tensorboard(group_run):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    world, tmp, results = group_run
    events = [f for f in os.listdir(tmp / "tel") if f.startswith("events.out.tfevents")]
    assert len(events) == 1 and f".{results[0]['pid']}." in events[0]  # rank 0's file, nobody else's
    acc = event_accumulator.EventAccumulator(str(tmp / "tel"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(step_metrics(0, 0))
    for tag in step_metrics(0, 0):
        scalars = acc.Scalars(tag)
        assert [e.step for e in scalars] == LOGGED
        want = [max(step_metrics(r, s)[tag] for r in range(world)) for s in LOGGED]
        assert [e.value for e in scalars] == pytest.approx(want)  # TensorBoard stores float32


# -- one process, no group -----------------------------------------------------------------------


@pytest.fixture
def no_rank_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def test_rank_info_without_group(no_rank_env, monkeypatch):
    assert rank_info() == RankInfo(0, 1, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_info() == RankInfo(3, 8, 1)
    monkeypatch.setenv("RANK", "8")
    with pytest.raises(InvalidArgument):
        rank_info()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(InvalidArgument, match="RANK"):
        rank_info()


def test_reduce_max_not_initialised_returns_local_values(no_rank_env):
    m = rank_metrics(1)
    before = typed(m)
    out = reduce_max(m)
    assert typed(out) == before and out is not m and typed(m) == before
    assert reduce_max({}) == {}


@pytest.mark.parametrize("bad", [{"a": "1"}, {"a": None}, {"a": torch.tensor(1.0)}, {1: 2.0}, {"a": 2**60}, [1.0]])
def test_reduce_max_rejects_bad_input(bad):
    with pytest.raises(InvalidArgument):
        reduce_max(bad)


def test_reduce_stats_not_initialised(no_rank_env):
    s = rank_stats(1)
    r = reduce_stats(s, elapsed_s=4.0)
    assert r.world_size == 1
    assert r.totals == Stats(stages={n: s.stages[n] for n in STAGES}, **{n: getattr(s, n) for n in COUNTERS},
                             peak_host_bytes=s.peak_host_bytes, gil_seconds=s.gil_seconds)
    assert r.min_samples_per_s == r.max_samples_per_s == s.samples / 4.0
    assert r.max_pop_wait_s == s.stages["pop_wait"].seconds and r.max_peak_host_bytes == s.peak_host_bytes
    assert r.read_amplification == s.read_amplification
    metrics = r.to_metrics()
    assert metrics["samples"] == s.samples and metrics["world_size"] == 1 and metrics["gil_s"] == s.gil_seconds
    # A partial snapshot (missing stages) reduces with zeros in their place.
    partial = reduce_stats(Stats(stages={"io": Metric("io", 1.5, 2)}, samples=3))
    assert partial.totals.stages["io"] == Metric("io", 1.5, 2) and partial.totals.stages["plan"] == Metric("plan")
    assert partial.max_pop_wait_s == 0.0 and partial.min_samples_per_s is None
    # Per-field counts come back as they are.
    assert reduce_stats(Stats(fields=rank_fields(1))).totals.fields == rank_fields(1)


@pytest.mark.parametrize("elapsed_s", [0, -1.0, math.nan, math.inf, True, "1"])
def test_reduce_stats_rejects_bad_elapsed(elapsed_s):
    with pytest.raises(InvalidArgument, match="elapsed_s"):
        reduce_stats(rank_stats(0), elapsed_s=elapsed_s)


def test_reduce_stats_rejects_bad_stats():
    with pytest.raises(InvalidArgument):
        reduce_stats({"samples": 1})
    with pytest.raises(InvalidArgument, match="unknown stages"):
        reduce_stats(Stats(stages={"mystery": Metric("mystery")}))
    with pytest.raises(InvalidArgument, match="'raw.bytes_read' = 1152921504606846976 is beyond 2\\*\\*53"):
        reduce_stats(Stats(fields={"raw": FieldCounts(bytes_read=2**60)}))


def test_memory_report_keys_and_types():
    report = memory_report()
    expected = set(MEMORY_KEYS)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        expected |= set(CUDA_MEMORY_KEYS)
    assert set(report) == expected
    assert all(type(v) is int and v >= 0 for v in report.values())
    assert report["host_rss_bytes"] > 10 * 2**20  # this process has torch loaded


def test_pinned_registry_is_thread_safe():
    base = pinned_host_bytes()

    def churn():
        for _ in range(2000):
            register_pinned(3)
        for _ in range(1000):
            unregister_pinned(3)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert pinned_host_bytes() == base + 4 * 1000 * 3
        assert memory_report()["pinned_host_bytes"] == base + 12000
    finally:
        unregister_pinned(12000)
    assert pinned_host_bytes() == base
    with pytest.raises(InvalidArgument):
        unregister_pinned(base + 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgument):
            register_pinned(bad)


def test_writer_single_process(no_rank_env, tmp_path):
    log_dir = tmp_path / "logs"
    with TelemetryWriter(log_dir, every=2, tensorboard=False) as tw:
        assert not log_dir.exists()  # nothing is created before the first logged step
        assert tw.log(1, {"a": 1}) is None
        assert tw.log(2, {"a": 2, "b": math.inf}) == {"a": 2, "b": math.inf}
        tw.log(4, {"a": 5, "ok": True})
    records = [json.loads(line) for line in tw.path.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"step": 2, "a": 2, "b": None},  # non-finite values become null: strict JSON
        {"step": 4, "a": 5, "ok": True},
    ]
    assert os.listdir(log_dir) == ["telemetry.jsonl"]
    with pytest.raises(ShutdownError):
        tw.log(6, {"a": 1})
    tw.close()  # idempotent


def test_writer_rejects_bad_input(tmp_path):
    for every in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument):
            TelemetryWriter(tmp_path, every=every)
    with TelemetryWriter(tmp_path / "w", tensorboard=False) as tw:
        for step in (-1, 1.0, True):
            with pytest.raises(InvalidArgument):
                tw.log(step, {"a": 1})
        with pytest.raises(InvalidArgument, match="reserved"):
            tw.log(0, {"step": 1})
        with pytest.raises(InvalidArgument):
            tw.log(0, {"a": "x"})
    assert not (tmp_path / "w").exists()


def test_writer_tensorboard_required_but_missing(monkeypatch, tmp_path):
    # What an environment without tensorboard looks like, even if torch's wrapper was imported earlier.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(InvalidArgument, match="tensorboard"):
        TelemetryWriter(tmp_path, tensorboard=True)
    with TelemetryWriter(tmp_path / "auto") as tw:  # auto: JSON lines only
        tw.log(0, {"a": 1.0})
    assert os.listdir(tmp_path / "auto") == ["telemetry.jsonl"]


def _mismatch_worker(rank: int, world: int, tmp: str) -> None:
    """Ranks calling reduce_max (and a TelemetryWriter) with different metric names: each case's outcome."""
    with gloo_group(rank, world, tmp, timeout_s=20):
        out = {}
        cases = {
            "renamed": {"a": 1.0} if rank == 0 else {"b": 5.0},  # same count: the values would pair up wrong
            "extra": {"a": 1.0} if rank == 0 else {"a": 2.0, "b": 5.0},  # another count: would hang
            "none": {} if rank == 0 else {"a": 2.0},  # rank 0 would skip the collective the other waits in
            "joined": {"a\0b": 1.0, "c": 2.0} if rank == 0 else {"a": 1.0, "b\0c": 2.0},  # alike, joined by NUL
        }
        for name, metrics in cases.items():
            try:
                out[name] = ["ok", reduce_max(metrics)]
            except InvalidArgument as exc:
                out[name] = ["InvalidArgument", str(exc)]
            except Exception as exc:  # noqa: BLE001 - recorded: the test says what it should have been
                out[name] = [type(exc).__name__, str(exc)[:200]]
        out["after"] = reduce_max({"x": float(rank)})  # the group still works
        with TelemetryWriter(Path(tmp) / "tel", tensorboard=False) as tw:
            try:
                tw.log(0, {"loss": 1.0} if rank == 0 else {"lr": 0.1})
                out["writer"] = "ok"
            except InvalidArgument as exc:
                out["writer"] = str(exc)
        write_result(tmp, rank, out)


@pytest.mark.timeout(180)
def test_reduce_max_refuses_metric_names_that_differ_between_ranks(tmp_path):
    """Different names on the ranks are an InvalidArgument on every rank, never rank 0's "a" taking rank 1's
    "b" (silently wrong) nor a collective of another length (a hang until the group's timeout)."""
    results = spawn_ranks(_mismatch_worker, 2, tmp_path)
    for rank, res in enumerate(results):
        for name in ("renamed", "extra", "none", "joined"):
            kind, message = res[name]
            assert kind == "InvalidArgument", (rank, name, res[name])
            assert "metric names" in message and "rank" in message
        assert res["after"] == {"x": 1.0}
        assert "metric names" in res["writer"]
    assert not (tmp_path / "tel" / "telemetry.jsonl").exists() or \
        (tmp_path / "tel" / "telemetry.jsonl").read_text() == ""


def _nan_worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp, timeout_s=20):
        nan = float("nan")
        metrics = {"on_first": nan if rank == 0 else 1.0, "on_last": nan if rank == world - 1 else 1.0,
                   "over_inf": nan if rank == world - 1 else math.inf, "none": float(rank), "count": rank}
        reduced = reduce_max(metrics)
        with TelemetryWriter(Path(tmp) / "tel", tensorboard=False) as tw:
            logged = tw.log(0, metrics)
        write_result(tmp, rank, {"reduced": typed(reduced), "logged": typed(logged)})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_max_a_nan_on_any_rank_is_nan(tmp_path, world):
    """A metric that is NaN on one rank (a diverged loss) is NaN in the maximum whichever rank it is on, as
    torch.max and numpy.max have it; gloo's MAX kept it only where it came first in the reduction (rank 1's
    NaN against rank 0's 1.0 gave 1.0)."""
    results = spawn_ranks(_nan_worker, world, tmp_path)
    want = np.max([[np.nan if r == 0 else 1.0, np.nan if r == world - 1 else 1.0,
                    np.nan if r == world - 1 else np.inf] for r in range(world)], axis=0)
    assert np.isnan(want).all()  # numpy's max: NaN wherever a rank has it
    for res in results:
        for name in ("on_first", "on_last", "over_inf"):
            for got in (res["reduced"], res["logged"]):
                assert got[name][0] == "float" and math.isnan(got[name][1]), (name, got)
        assert res["reduced"]["none"] == ["float", world - 1.0] and res["reduced"]["count"] == ["int", world - 1]
    line = json.loads((tmp_path / "tel" / "telemetry.jsonl").read_text())
    assert line["on_first"] is None and line["on_last"] is None and line["over_inf"] is None  # JSON null
