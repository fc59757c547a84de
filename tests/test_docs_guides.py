"""The guides docs/segmentation.md and docs/forecasting.md run as written (all their Python blocks, in order,
as one script), and what they make is checked against zarr-python's and xarray's reads of the same boxes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import stoker

DOCS = Path(__file__).resolve().parents[1] / "docs"


def run_page(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Every ```python block of docs/<name>, in order, executed in ``tmp_path``; the script's namespace."""
    page = DOCS / name
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) >= 4, f"{name}: the guide's script is its python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    exec(compile("\n".join(blocks), str(page), "exec"), namespace)
    return namespace


def slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@pytest.mark.timeout(180)
def test_segmentation_guide_runs(tmp_path, monkeypatch):
    pytest.importorskip("ome_zarr", minversion="0.18")  # scale_factors per axis, levels named s0, s1, ...
    ns = run_page("segmentation.md", tmp_path, monkeypatch)
    first, samples = ns["first"], ns["samples"]
    assert {k: (tuple(v.shape), v.dtype) for k, v in first.items()} == {
        "raw": ((4, 48, 48, 48), torch.float32), "labels": ((4, 32, 32, 32), torch.int64),
        "context": ((4, 24, 24, 24), torch.float32)}
    s0 = zarr.open_array(str(tmp_path / "raw.ome.zarr" / "s0"), mode="r")
    s2 = zarr.open_array(str(tmp_path / "raw.ome.zarr" / "s2"), mode="r")
    labels = zarr.open_array(str(tmp_path / "labels.zarr"), mode="r")
    mask = zarr.open_array(str(tmp_path / "mask.zarr"), mode="r")[:]
    assert s2.shape == (32, 32, 32) and labels.dtype == np.uint64
    for i, s in enumerate(samples):
        raw_box, lab_box, ctx_box = s["raw"].aabb, s["labels"].aabb, s["context"].aabb
        anchor = [a for a, _ in raw_box]
        assert [a for a, _ in lab_box] == [a + 8 for a in anchor]             # centred in raw
        assert [4 * a for a, _ in ctx_box] == [a - 24 for a in anchor]        # scale 4 from the metadata
        want = labels[slices(lab_box)]
        assert (want > 2**24).any()
        assert torch.equal(first["labels"][i], torch.from_numpy(want.astype(np.int64)))  # every id exact
        assert torch.equal(first["raw"][i], torch.from_numpy(s0[slices(raw_box)].astype(np.float32)))
        assert torch.equal(first["context"][i], torch.from_numpy(s2[slices(ctx_box)].astype(np.float32)))

    def coverage(sample) -> float:
        return float(mask[tuple(slice(a // 4, b // 4) for a, b in sample["labels"].aabb)].mean())

    source = ns["source"]
    epoch = [source.sample(0, i) for i in range(source.samples_per_epoch)]
    assert min(coverage(s) for s in epoch) >= 0.25                             # the mask's promise
    unmasked = stoker.RandomCrops(ns["fields"], seed=0, samples_per_epoch=64)
    assert min(coverage(unmasked.sample(0, i)) for i in range(64)) < 0.25    # without it, empty crops come

    losses = ns["losses"] + ns["more"]
    assert len(losses) == 5 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    state = ns["state"]
    assert (state["world_size"], state["steps"], state["position"]) == (2, 6, 12)  # 3 steps of 2 on rank 0 of 2


@pytest.mark.timeout(180)
def test_forecasting_guide_runs(tmp_path, monkeypatch):
    xr = pytest.importorskip("xarray")
    ns = run_page("forecasting.md", tmp_path, monkeypatch)
    look, samples, time = ns["look"], ns["samples"], ns["time"]
    assert {k: tuple(v.shape) for k, v in look.items()} == {"inputs": (4, 3, 2, 16, 32),
                                                          "target": (4, 3, 1, 16, 32)}
    decoded = xr.open_zarr(str(tmp_path / "era5.zarr"))
    names = ("t2m", "msl", "u10")
    assert zarr.open_array(str(tmp_path / "era5.zarr" / "t2m"), mode="r").dtype == np.int16  # packed on disk
    for i, s in enumerate(samples):
        for field in ("inputs", "target"):
            box = s[field].aabb
            want = np.stack([decoded[v].isel(time=slices(box)[0]).values for v in names]).astype(np.float32)
            np.testing.assert_array_equal(look[field][i].numpy(), want)          # NaN where xarray has NaN
        assert s["target"].aabb[0][0] == s["inputs"].aabb[0][0] + 7
    assert np.isnan(look["inputs"].numpy()).sum() == sum(
        int(np.isnan(decoded["t2m"].isel(time=slices(s["inputs"].aabb)[0]).values).sum()) for s in samples)

    def days(source):
        return [time[source.sample(0, i)["inputs"].aabb[0][0]] for i in range(source.samples_per_epoch)]

    train, valid = days(ns["train_source"]), days(ns["valid_source"])
    assert min(train) >= np.datetime64("2000-01-01") and max(train) <= np.datetime64("2000-12-24")
    assert min(valid) >= np.datetime64("2001-01-01")

    stats, year = ns["stats"], decoded.sel(time=slice("2000-01-01", "2000-12-31"))
    assert stats.skipped.tolist() == [9, 0, 0]
    for c, v in enumerate(names):
        x = year[v].values.astype(np.float64)
        np.testing.assert_allclose(float(stats.mean[c]), np.nanmean(x), rtol=1e-6)
        np.testing.assert_allclose(float(stats.std[c]), np.nanstd(x), rtol=1e-4)
    losses = ns["losses"]
    assert len(losses) == 8 and all(np.isfinite(losses)) and np.isfinite(ns["valid_loss"])
