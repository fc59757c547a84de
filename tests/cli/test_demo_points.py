"""stoker.demo.points: the point-cloud denoising task (dataset writer, k-NN, Chamfer loss, model).

Real datasets written to tmp_path and read back through ZarrRecords and Loader;
the Chamfer distance checked against a numpy brute force and autograd of the
full-matrix formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from stoker.storage import fsutil
from stoker.demo import points as pts
from stoker.demo.points import PointDenoiser, chamfer_distance, ensure_knn, loss_fn, make_loss_fn, write_point_clouds
from stoker.errors import InvalidArgument
from stoker.records import Concat, Loader, ZarrRecords, knn_edge_index, knn_graph

SMALL = {"n_records": 6, "min_points": 40, "max_points": 90, "progress": False}


def read_all(root) -> list[dict[str, np.ndarray]]:
    ds = ZarrRecords(root, fields=["clean", "noisy"])
    return [{k: v.numpy() for k, v in ds[i].items()} for i in range(len(ds))]


def file_stamps(root) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file under ``root``."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_ino, st.st_mtime_ns)
    return out


def batches(root, knn: str, batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
    ds = ZarrRecords(root, fields=["noisy", "clean", knn])
    with Loader(ds, batch_size=batch_size, collate=Concat(increment={knn: "noisy"}), shuffle=False) as loader:
        return list(loader)


# -- the writer ----------------------------------------------------------------------------------


def test_writer_creates_a_record_dataset(tmp_path):
    root = write_point_clouds(tmp_path / "clouds", noise=0.05, **SMALL)
    assert root == tmp_path / "clouds"
    ds = ZarrRecords(root)
    assert ds.fields == ("clean", "noisy")
    assert ds.names == [f"r{i:05d}" for i in range(6)]
    sizes = set()
    for i in range(len(ds)):
        s = ds[i]
        n = s["clean"].shape[0]
        sizes.add(n)
        assert 40 <= n <= 90
        assert s["clean"].shape == s["noisy"].shape == (n, 3)
        assert s["clean"].dtype == s["noisy"].dtype == torch.float32
        assert bool(torch.isfinite(s["clean"]).all())
        assert float(s["clean"].std(dim=0).min()) > 0.05  # a spread-out solid, not a point or a line
        diff = (s["noisy"] - s["clean"]).double()
        assert abs(float(diff.std()) - 0.05) < 0.015  # noisy = clean + noise * N(0, 1)
    assert len(sizes) > 1
    marker = json.loads((root / pts.MARKER).read_text())
    assert marker["params"]["n_records"] == 6 and marker["params"]["noise"] == 0.05


def test_noise_zero_gives_identical_clouds(tmp_path):
    for rec in read_all(write_point_clouds(tmp_path / "c", noise=0.0, **SMALL)):
        np.testing.assert_array_equal(rec["clean"], rec["noisy"])


def test_writer_is_deterministic_per_seed(tmp_path):
    a = read_all(write_point_clouds(tmp_path / "a", seed=3, **SMALL))
    b = read_all(write_point_clouds(tmp_path / "b", seed=3, **SMALL))
    c = read_all(write_point_clouds(tmp_path / "c", seed=4, **SMALL))
    assert len(a) == len(b) == len(c) == SMALL["n_records"]
    for ra, rb in zip(a, b):
        for name in ("clean", "noisy"):
            np.testing.assert_array_equal(ra[name], rb[name])
    differ = [ra["clean"].shape != rc["clean"].shape or not np.array_equal(ra["clean"], rc["clean"])
              for ra, rc in zip(a, c)]
    assert all(differ)


def test_second_call_reuses_the_dataset(tmp_path, monkeypatch):
    root = write_point_clouds(tmp_path / "clouds", **SMALL)
    before = file_stamps(root)
    assert len(before) > 6 * 2

    def no_writing(*args, **kwargs):
        raise AssertionError("a record was generated again")

    monkeypatch.setattr(pts, "make_cloud", no_writing)
    assert write_point_clouds(tmp_path / "clouds", **SMALL) == root
    assert file_stamps(root) == before
    # No temporary sibling was left behind by either call.
    assert sorted(os.listdir(tmp_path)) == ["clouds"]


def test_other_parameters_replace_the_dataset(tmp_path):
    write_point_clouds(tmp_path / "clouds", **SMALL)
    root = write_point_clouds(tmp_path / "clouds", **{**SMALL, "n_records": 3})
    assert len(ZarrRecords(root)) == 3
    assert sorted(os.listdir(tmp_path)) == ["clouds"]


def test_an_unfinished_dataset_is_replaced(tmp_path):
    reference = read_all(write_point_clouds(tmp_path / "ref", **SMALL))
    root = write_point_clouds(tmp_path / "clouds", **SMALL)
    # A crash's remains: the marker and a record missing, plus a dead writer's temporary sibling.
    (root / pts.MARKER).unlink()
    for f in sorted((root / "r00003").rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    (root / "r00003").rmdir()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f".clouds.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    (stale / "r00000").mkdir(parents=True)

    assert write_point_clouds(tmp_path / "clouds", **SMALL) == root
    assert (root / pts.MARKER).exists()
    got = read_all(root)
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g["noisy"], r["noisy"])
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == ["clouds", "ref"]


def test_foreign_directory_is_refused_and_kept(tmp_path):
    root = tmp_path / "precious"
    root.mkdir()
    (root / "thesis.txt").write_text("do not delete")
    with pytest.raises(InvalidArgument, match="not a point-cloud dataset"):
        write_point_clouds(root, **SMALL)
    assert (root / "thesis.txt").read_text() == "do not delete"


@pytest.mark.parametrize("kwargs, name", [
    ({"n_records": 0}, "n_records"),
    ({"n_records": True}, "n_records"),
    ({"seed": -1}, "seed"),
    ({"min_points": 0}, "min_points"),
    ({"min_points": 50, "max_points": 49}, "max_points"),
    ({"max_points": 2.5}, "max_points"),
    ({"noise": -0.1}, "noise"),
    ({"noise": float("nan")}, "noise"),
    ({"noise": "0.1"}, "noise"),
])
def test_writer_rejects_bad_arguments(tmp_path, kwargs, name):
    with pytest.raises(InvalidArgument, match=name):
        write_point_clouds(tmp_path / "x", **{**SMALL, **kwargs})
    assert not (tmp_path / "x").exists()


# -- k-NN ----------------------------------------------------------------------------------------


def test_ensure_knn_stores_the_graph_once(tmp_path):
    root = write_point_clouds(tmp_path / "clouds", **SMALL)
    assert ensure_knn(root, k=5) == "knn5"
    ds = ZarrRecords(root, fields=["noisy", "clean", "knn5"])
    for i in range(len(ds)):
        s = ds[i]
        assert s["knn5"].shape == (s["noisy"].shape[0], 5)
        assert s["knn5"].dtype == torch.int64
        torch.testing.assert_close(s["knn5"], knn_graph(s["noisy"], 5), rtol=0, atol=0)
    stamps = file_stamps(root)
    assert ensure_knn(root, k=5) == "knn5"
    assert file_stamps(root) == stamps
    assert ensure_knn(root) == "knn16"
    assert ZarrRecords(root, fields=["knn16"])[0]["knn16"].shape[1] == 16
    with pytest.raises(InvalidArgument, match="k must be"):
        ensure_knn(root, k=0)


# -- Chamfer -------------------------------------------------------------------------------------


def brute_chamfer(pred: np.ndarray, target: np.ndarray, pb: np.ndarray, tb: np.ndarray) -> float:
    per = []
    for b in range(int(max(pb.max(), tb.max())) + 1):
        p, t = pred[pb == b].astype(np.float64), target[tb == b].astype(np.float64)
        d = ((p[:, None, :] - t[None, :, :]) ** 2).sum(-1)
        per.append(d.min(axis=1).mean() + d.min(axis=0).mean())
    return float(np.mean(per))


def two_samples(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(70, 3, generator=g, dtype=dtype)
    target = torch.randn(55, 3, generator=g, dtype=dtype)
    pb = torch.tensor([0] * 30 + [1] * 40)
    tb = torch.tensor([0] * 35 + [1] * 20)
    return pred, target, pb, tb


def test_chamfer_is_zero_on_identical_clouds():
    pred, _, pb, _ = two_samples(dtype=torch.float32)
    # Far from the origin and close together: |a|^2 + |b|^2 - 2ab would round to the wrong neighbours.
    pred = pred * 1e-2 + 1e4
    assert float(chamfer_distance(pred, pred.clone(), pb, pb)) == 0.0
    shuffled = torch.randperm(len(pred))
    assert float(chamfer_distance(pred, pred[shuffled], pb, pb[shuffled])) == 0.0


def test_chamfer_matches_brute_force_and_is_symmetric():
    pred, target, pb, tb = two_samples()
    want = brute_chamfer(pred.numpy(), target.numpy(), pb.numpy(), tb.numpy())
    got = chamfer_distance(pred, target, pb, tb)
    assert got.ndim == 0 and got.dtype == torch.float64
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert float(chamfer_distance(target, pred, tb, pb)) == float(got)
    # Rows in any order: the batch vectors say which sample each belongs to.
    perm = torch.randperm(len(pred))
    assert float(chamfer_distance(pred[perm], target, pb[perm], tb)) == pytest.approx(want, rel=1e-12)
    p32 = chamfer_distance(pred.float(), target.float(), pb, tb)
    assert p32.dtype == torch.float32 and float(p32) == pytest.approx(want, rel=1e-5)


def test_chamfer_gradient_is_that_of_the_full_formula():
    pred, target, pb, tb = two_samples(seed=1)
    pred.requires_grad_(True)
    target.requires_grad_(True)
    chamfer_distance(pred, target, pb, tb).backward()

    p2, t2 = pred.detach().clone().requires_grad_(True), target.detach().clone().requires_grad_(True)
    per = []
    for b in range(2):
        d = ((p2[pb == b][:, None] - t2[tb == b][None]) ** 2).sum(-1)
        per.append(d.min(dim=1).values.mean() + d.min(dim=0).values.mean())
    torch.stack(per).mean().backward()

    assert bool(torch.isfinite(pred.grad).all()) and float(pred.grad.abs().sum()) > 0
    torch.testing.assert_close(pred.grad, p2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(target.grad, t2.grad, rtol=1e-10, atol=1e-12)


def test_chamfer_rejects_empty_samples_and_bad_batches():
    pred, target, pb, tb = two_samples()
    with pytest.raises(InvalidArgument, match="sample 2 has no pred points"):
        chamfer_distance(pred, target, pb, tb, n_samples=3)
    with pytest.raises(InvalidArgument, match="outside"):
        chamfer_distance(pred, target, pb, tb, n_samples=1)
    with pytest.raises(InvalidArgument, match="pred_batch"):
        chamfer_distance(pred, target, pb[:-1], tb)
    with pytest.raises(InvalidArgument, match="integer"):
        chamfer_distance(pred, target, pb.double(), tb)


# -- the model and the loss ----------------------------------------------------------------------


def cloud_and_edges(n: int = 60, k: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, 3, generator=g)
    return p, knn_edge_index(knn_graph(p, k))


def test_denoiser_output_shape_and_equivariance():
    torch.manual_seed(0)
    model = PointDenoiser(hidden=16, layers=2)
    p, ei = cloud_and_edges()
    with torch.no_grad():
        out = model(p, ei)
    assert out.shape == p.shape and out.dtype == p.dtype
    assert float((out - p).abs().max()) > 0  # it does move points
    shift = torch.tensor([0.5, -1.0, 2.0])
    with torch.no_grad():
        torch.testing.assert_close(model(p + shift, ei), out + shift, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(3.0 * p, ei), 3.0 * out, rtol=1e-5, atol=1e-5)
    # Edges are neighbour -> centre: reversing them changes what each point aggregates.
    with torch.no_grad():
        assert not torch.allclose(model(p, ei.flip(0)), out)
    with pytest.raises(InvalidArgument):
        model(p[:, :2], ei)


def test_loss_fn_on_a_loader_batch_reaches_every_parameter(tmp_path):
    root = write_point_clouds(tmp_path / "clouds", n_records=8, min_points=32, max_points=64, progress=False)
    knn = ensure_knn(root)
    assert knn == loss_fn.knn_field == "knn16"
    batch = batches(root, knn)[0]
    assert int(batch["noisy_batch"].max()) == 3
    torch.manual_seed(0)
    model = PointDenoiser(hidden=16, layers=2)
    loss = loss_fn(model, batch)
    assert loss.ndim == 0 and float(loss.detach()) > 0
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert bool(torch.isfinite(param.grad).all()), name
        assert float(param.grad.abs().sum()) > 0, name
    with pytest.raises(InvalidArgument, match="knn8"):
        make_loss_fn("knn8")(model, batch)


def test_training_reduces_the_loss(tmp_path):
    root = write_point_clouds(tmp_path / "clouds", n_records=8, min_points=64, max_points=128, noise=0.05,
                              progress=False)
    knn = ensure_knn(root, k=8)
    data = batches(root, knn)
    loss = make_loss_fn(knn)
    torch.manual_seed(0)
    model = PointDenoiser(hidden=32, layers=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def mean_loss() -> float:
        with torch.no_grad():
            return float(np.mean([float(loss(model, b)) for b in data]))

    initial = mean_loss()
    # Before any step the model is close to the identity: the loss is that of the noisy clouds.
    noisy = float(np.mean([float(chamfer_distance(b["noisy"], b["clean"], b["noisy_batch"], b["clean_batch"]))
                           for b in data]))
    assert initial == pytest.approx(noisy, rel=0.05)
    for _ in range(40):
        for b in data:
            opt.zero_grad()
            loss(model, b).backward()
            opt.step()
    assert mean_loss() < 0.9 * initial
