"""Non-finite values in record statistics: refused by default (naming the record, the field and the
count, on every rank, nothing cached), or skipped on request and counted, matching numpy's nan-aware
statistics. Records written by zarr-python; a real 2-rank gloo group."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stoker.errors import InvalidArgument, NonFiniteData
from stoker.records import Moments, ZarrRecords, compute_stats, normalize
from stoker.records import sidecar
from test_records import SPEC, record_arrays, write_dataset, write_record  # tests/ is on sys.path

from gloo_ranks import gloo_group, spawn_ranks, write_result

N = 6
BAD = 3  # the record holding the non-finite values: rank 1's of 2 (records rank::2)


def write_with_nonfinite(root: str) -> list[dict[str, np.ndarray]]:
    """``N`` records; record ``BAD`` has two NaNs and an infinity in ``positions`` (channels 0, 0 and 2)."""
    truth = write_dataset(root, n=N, seed=9)
    arrays = record_arrays(BAD, seed=9)
    arrays["positions"][1, 2, 0] = np.nan
    arrays["positions"][4, 0, 0] = np.nan
    arrays["positions"][0, 1, 2] = np.inf
    write_record(os.path.join(root, f"rec_{BAD:03d}.zarr"), arrays, fmt=2 if BAD % 2 else 3)
    truth[BAD] = arrays
    return truth


def nan_aware(arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    """numpy's nan-aware statistics per channel, with infinities counted as missing too."""
    flat = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays]).astype("f8")
    flat = np.where(np.isfinite(flat), flat, np.nan)
    return {"count": flat.shape[0], "skipped": np.isnan(flat).sum(0), "mean": np.nanmean(flat, 0),
            "std": np.sqrt(np.nanvar(flat, 0)), "min": np.nanmin(flat, 0), "max": np.nanmax(flat, 0)}


def assert_matches(got, want: dict) -> None:
    assert int(got.count) == want["count"]
    np.testing.assert_array_equal(got.skipped.numpy(), want["skipped"])
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(getattr(got, key).numpy(), want[key], rtol=1e-12, err_msg=key)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nonfinite"))
    return root, write_with_nonfinite(root)


def test_a_nonfinite_value_is_an_error_naming_record_field_and_count(tmp_path):
    root = str(tmp_path / "d")
    write_with_nonfinite(root)
    ds = ZarrRecords(root, fields=SPEC)
    with pytest.raises(NonFiniteData, match=r"field 'positions' of record 'rec_003.zarr' holds 3 non-finite") as e:
        compute_stats(ds, ["velocity", "positions"])
    assert (e.value.sample, e.value.field, e.value.count) == ("rec_003.zarr", "positions", 3)
    assert isinstance(e.value, ValueError) and "nonfinite='skip'" in str(e.value)
    assert not os.path.exists(sidecar.path_for(root))  # nothing cached
    # A derived quantity that is non-finite is named the same way.
    with pytest.raises(NonFiniteData, match="derived 'ratio' of record 'rec_000.zarr'"):
        compute_stats(ds, ["velocity"], derived={"ratio": lambda s: s["velocity"] / 0.0}, derived_input="normalized", cache=False)
    with pytest.raises(InvalidArgument, match="nonfinite"):
        compute_stats(ds, ["velocity"], nonfinite="ignore")


def test_skipping_matches_numpys_nan_aware_statistics(data):
    root, truth = data
    ds = ZarrRecords(root, fields=SPEC)
    stats = compute_stats(ds, ["positions", "velocity"], nonfinite="skip", cache=False)
    assert_matches(stats["positions"], nan_aware([t["positions"] for t in truth]))
    assert stats["positions"].skipped.tolist() == [2, 0, 1]
    assert_matches(stats["velocity"], nan_aware([t["velocity"] for t in truth]))  # clean: nothing skipped
    # Clean records normalise to finite values (the bug: NaN statistics made every one NaN).
    assert all(bool(torch.isfinite(normalize(ds[i], stats)["positions"]).all()) for i in range(N) if i != BAD)
    scalar = compute_stats(ds, ["positions"], per_channel=False, nonfinite="skip", cache=False)["positions"]
    assert int(scalar.skipped) == 3 and scalar.mean.shape == ()
    with pytest.raises(NonFiniteData, match="holds no finite value in channel"):
        compute_stats(ds, ["velocity"], derived={"nan": lambda s: s["velocity"] * torch.nan}, derived_input="normalized",
                      nonfinite="skip", cache=False)
    # one channel without a finite value: the count is that channel's, not every channel's (the other holds one)
    n = sum(ds[i]["positions"][..., 0].numel() for i in range(len(ds)))
    with pytest.raises(NonFiniteData, match=rf"in channel\(s\) \[0\], only {n} non-finite") as info:
        compute_stats(ds, ["positions"], derived={"x0": lambda s: s["positions"][..., [0, 2]] * torch.tensor(
            [torch.nan, 1.0], dtype=s["positions"].dtype)}, derived_input="raw", nonfinite="skip", cache=False)
    assert info.value.count == n


def test_a_field_empty_in_every_record_is_an_error_not_statistics_of_nothing(tmp_path):
    """An optional field written empty in every training record (``vel (0, 3)``) gave count 0, mean 0, std NaN,
    min inf, max -inf, cached; normalize then passed a validation record's velocities through unscaled."""
    import zarr

    for i in range(3):
        g = zarr.open_group(str(tmp_path / f"r{i}.zarr"), mode="w")
        g.create_array("pos", data=np.arange(12.0).reshape(4, 3) + i)
        g.create_array("vel", data=np.zeros((0, 3)))
    ds = ZarrRecords(str(tmp_path), fields={"pos": ("N", 3), "vel": ("M", 3)})
    for policy in ("raise", "skip"):
        with pytest.raises(InvalidArgument, match="'vel' holds no value in any record"):
            compute_stats(ds, ["pos", "vel"], nonfinite=policy)
        assert not os.path.exists(sidecar.path_for(str(tmp_path)))  # nothing cached
    with pytest.raises(InvalidArgument, match="derived 'none' holds no value"):
        compute_stats(ds, ["pos"], derived={"none": lambda s: s["vel"]}, derived_input="raw", cache=False)
    # The field beside it, with values, as numpy computes its statistics.
    stats = compute_stats(ds, ["pos"], cache=False)["pos"]
    want = np.concatenate([zarr.open_array(str(tmp_path / f"r{i}.zarr" / "pos"))[:] for i in range(3)])
    assert int(stats.count) == 12 and np.allclose(stats.mean.numpy(), want.mean(0), rtol=1e-15)


def test_an_empty_fields_entry_cached_by_an_older_build_is_recomputed_and_refused(tmp_path, monkeypatch):
    """A sidecar written before empty fields were refused holds ``vel`` as count 0, mean 0, std NaN; read
    back as is, normalize passed a later record's velocities through unscaled. The entry now counts as
    absent: the call recomputes and raises as the uncached call does."""
    import zarr

    from stoker.records import stats as stats_mod

    for i in range(3):
        g = zarr.open_group(str(tmp_path / f"r{i}.zarr"), mode="w")
        g.create_array("pos", data=np.arange(12.0).reshape(4, 3) + i)
        g.create_array("vel", data=np.zeros((0, 3)))
    ds = ZarrRecords(str(tmp_path), fields={"pos": ("N", 3), "vel": ("M", 3)})
    with monkeypatch.context() as m:  # the older build: no check, the entry written
        m.setattr(stats_mod, "_check_some_finite", lambda merged, kind: None)
        old = compute_stats(ds, ["pos", "vel"])
    assert int(old["vel"].count) == 0 and bool(torch.isnan(old["vel"].std).all())
    assert os.path.exists(sidecar.path_for(str(tmp_path)))
    with pytest.raises(InvalidArgument, match="'vel' holds no value in any record"):
        compute_stats(ds, ["pos", "vel"])


def test_the_sidecar_records_skipped_counts_under_its_own_policy(tmp_path):
    root = str(tmp_path / "d")
    truth = write_with_nonfinite(root)
    ds = ZarrRecords(root, fields=SPEC)
    first = compute_stats(ds, ["positions"], nonfinite="skip")
    entries = json.loads(open(sidecar.path_for(root)).read())["entries"]
    (entry,) = entries.values()
    assert entry["nonfinite"] == "skip" and entry["stats"]["positions"]["skipped"] == [2, 0, 1]
    again = compute_stats(ds, ["positions"], nonfinite="skip")  # from the file, bit for bit
    for key in ("count", "mean", "std", "min", "max", "skipped"):
        assert torch.equal(getattr(first["positions"], key), getattr(again["positions"], key)), key
    with pytest.raises(NonFiniteData):  # the skipping entry does not stand in for the refusing policy
        compute_stats(ds, ["positions"])
    # An entry holding NaN statistics (as written before non-finite values were refused) is recomputed.
    clean = ZarrRecords(root, fields=SPEC)
    fp = sidecar.fingerprint(clean, ["velocity"], True, [])
    nan = {"count": 1, "mean": [float("nan")] * 3, "std": [1.0] * 3, "min": [0.0] * 3, "max": [1.0] * 3,
           "skipped": [0] * 3}
    sidecar.write(root, fp, {"stats": {"velocity": nan}})
    got = compute_stats(clean, ["velocity"])["velocity"]
    np.testing.assert_allclose(got.mean.numpy(), nan_aware([t["velocity"] for t in truth])["mean"], rtol=1e-12)
    assert sidecar.load(root, fp)["stats"]["velocity"]["mean"] == got.mean.tolist()  # rewritten in its place


def test_moments_skip_nonfinite_values_and_merge_their_counts():
    rng = np.random.default_rng(5)
    parts = [rng.normal(size=(n, 2)) * 3 + 7 for n in (4, 50, 9)]
    parts[1][[3, 8, 20], 0] = np.nan
    parts[2][[0, 1, 2, 3, 4, 5, 6, 7, 8], 1] = -np.inf  # a part whose channel 1 is all non-finite
    m = Moments.empty(2)
    for p in parts:
        m = m.merge(Moments.of(torch.from_numpy(p)))
    want = nan_aware(parts)
    assert m.count == want["count"] and m.skipped.tolist() == want["skipped"].tolist() == [3, 9]
    np.testing.assert_allclose(m.mean.numpy(), want["mean"], rtol=1e-13)
    np.testing.assert_allclose(m.std.numpy(), want["std"], rtol=1e-12)
    np.testing.assert_array_equal(m.min.numpy(), want["min"])
    back = Moments.unpack(m.pack(), 2)
    assert back.count == m.count and torch.equal(back.skipped, m.skipped)
    assert all(torch.equal(getattr(back, k), getattr(m, k)) for k in ("mean", "m2", "min", "max"))


# -- two ranks: only rank 1's shard holds the non-finite values ---------------------------------


def _worker(rank: int, world: int, tmp: str, root: str) -> None:
    with gloo_group(rank, world, tmp, 30):
        out: dict = {}
        ds = ZarrRecords(root, fields=SPEC)
        try:
            compute_stats(ds, ["velocity", "positions"])
        except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
            out["raised"] = [type(exc).__name__, str(exc), getattr(exc, "sample", None), getattr(exc, "count", None)]
        out["sidecar_after_error"] = os.path.exists(sidecar.path_for(root))
        dist.barrier()
        stats = compute_stats(ds, ["positions"], nonfinite="skip")  # the same group still works
        out["skip"] = {k: getattr(stats["positions"], k).tolist() for k in ("count", "skipped", "mean", "std")}
        write_result(tmp, rank, out)


@pytest.mark.timeout(120)
def test_a_nonfinite_value_on_one_rank_fails_every_rank_alike(tmp_path):
    root = str(tmp_path / "data")
    truth = write_with_nonfinite(root)
    assert f"rec_{BAD:03d}.zarr" in ZarrRecords(root, fields=SPEC).for_rank(1, 2).names  # rank 1's alone
    results = spawn_ranks(_worker, 2, tmp_path, root)
    for res in results:
        assert res["raised"][0] == "NonFiniteData" and res["raised"][2:] == ["rec_003.zarr", 3]
        assert res["raised"] == results[0]["raised"]  # the same error, word for word, on both ranks
        assert not res["sidecar_after_error"]
        assert res["skip"] == results[0]["skip"]
    want = nan_aware([t["positions"] for t in truth])
    np.testing.assert_allclose(results[0]["skip"]["mean"], want["mean"], rtol=1e-12)
    assert results[0]["skip"]["skipped"] == [2, 0, 1]
