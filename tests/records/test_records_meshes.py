"""Records as meshes and graphs: joining along named dims, per-sample transforms, what the Trainer counts.

Crash-simulation records written by zarr-python (``mesh_pos (T, N, 3)``, ``thickness (N,)``,
``edges (2, E)``, ``params (4,)``), batched by the real Loader and checked against numpy
references built from zarr-python's own reads.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
import zarr

import stoker.train as st
from stoker.config import default_compute_threads
from stoker.errors import InvalidArgument, RankMismatch
from stoker.records import Concat, Loader, RecordBatch, ZarrRecords, compute_stats, normalize

from gloo_ranks import gloo_group, spawn_ranks, write_result

T = 4
N_RECORDS = 7
SPEC = {"mesh_pos": ("T", "N", 3), "thickness": ("N",), "edges": (2, "E"), "params": (4,)}


def _first(loader):
    """``loader``'s first batch, the loader closed after it (its reader threads end with the test)."""
    with loader:
        return next(iter(loader))


def write_meshes(root: str, n: int = N_RECORDS, odd: int | None = None) -> None:
    """Record i: N = 3 + i nodes, E = 2 * N edges indexing them; record ``odd`` has a 5-entry ``params``."""
    for i in range(n):
        rng = np.random.default_rng(i)
        nodes = 3 + i
        g = zarr.open_group(os.path.join(root, f"run_{i:03d}.zarr"), mode="w", zarr_format=3 if i % 2 else 2)
        g.create_array("mesh_pos", data=rng.normal(size=(T, nodes, 3)).astype("f4"), chunks=(2, 4, 3))
        g.create_array("thickness", data=rng.random(nodes).astype("f4"))
        g.create_array("edges", data=rng.integers(0, nodes, size=(2, 2 * nodes)).astype("i8"))
        g.create_array("params", data=rng.random(5 if i == odd else 4).astype("f4"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("meshes"))
    write_meshes(path)
    return path


def reference(root: str, ids: list[int]) -> dict[str, np.ndarray]:
    """The batch of records ``ids`` as the user's hand collate made it, from zarr-python reads."""
    groups = [zarr.open_group(os.path.join(root, f"run_{i:03d}.zarr"), mode="r") for i in ids]
    pos = [g["mesh_pos"][:] for g in groups]
    nodes = [p.shape[1] for p in pos]
    offsets = np.cumsum([0] + nodes[:-1])
    edges = [g["edges"][:] + off for g, off in zip(groups, offsets)]
    return {
        "mesh_pos": np.concatenate(pos, axis=1),
        "thickness": np.concatenate([g["thickness"][:] for g in groups]),
        "edges": np.concatenate(edges, axis=1),
        "params": np.stack([g["params"][:] for g in groups]),
        "batch": np.repeat(np.arange(len(ids)), nodes),
        "E_batch": np.repeat(np.arange(len(ids)), [e.shape[1] for e in edges]),
    }


def check(batch, want) -> None:
    assert set(batch) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(batch[key].numpy(), value, err_msg=key)


@pytest.mark.parametrize("collate", [
    Concat(along={"N": ["mesh_pos", "thickness"], "E": ["edges"]}, increment={"edges": "N"}),
    Concat(increment={"edges": "N"}),  # the dims spec alone: N and E vary between records, T does not
    "concat",
], ids=["along", "spec", "default"])
def test_meshes_join_along_their_named_dims(root, collate):
    ds = ZarrRecords(root, fields=SPEC)
    batches = list(Loader(ds, 3, collate=collate, shuffle=False, n_threads=2))
    assert len(batches) == 3
    for j, batch in enumerate(batches):
        ids = list(range(3 * j, min(3 * j + 3, N_RECORDS)))
        want = reference(root, ids)
        if collate == "concat":  # no increment: the edges stay per-record indices, and both dims are nodes
            want["edges"] = np.concatenate([zarr.open_group(os.path.join(root, f"run_{i:03d}.zarr"))["edges"][:]
                                            for i in ids], axis=1)
            want["N_batch"] = want.pop("batch")
        check(batch, want)
        assert isinstance(batch, RecordBatch) and batch.num_samples == len(ids)
        assert batch["mesh_pos"].shape == (T, sum(3 + i for i in ids), 3)


def test_batch_key_names_the_node_vector_and_a_dataloader_binds_by_hand(root):
    ds = ZarrRecords(root, fields=SPEC)
    collate = Concat(increment={"edges": "N"}, batch_key="node_batch").bind(ds)
    batch = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate, num_workers=0)
    first = next(iter(batch))
    want = reference(root, [0, 1, 2, 3])
    want["node_batch"] = want.pop("batch")
    check(first, want)


def test_a_field_that_cannot_be_stacked_names_its_record(tmp_path):
    write_meshes(str(tmp_path), n=4, odd=2)
    ds = ZarrRecords(str(tmp_path), fields={**SPEC, "params": (None,)})
    with Loader(ds, 4, collate=Concat(increment={"edges": "N"}), shuffle=False) as loader, \
            pytest.raises(RankMismatch, match=r"record 'run_002.zarr'.*field 'params'") as info:
        list(loader)
    assert info.value.sample == "run_002.zarr" and info.value.field == "params"


def test_a_field_varying_along_two_dims_is_refused_up_front(tmp_path):
    for i in range(3):
        g = zarr.open_group(str(tmp_path / f"r{i}.zarr"), mode="w")
        g.create_array("grid", data=np.zeros((2 + i, 3 + i), "f4"))
    ds = ZarrRecords(str(tmp_path), fields={"grid": ("H", "W")})
    with pytest.raises(InvalidArgument, match=r"'grid'.*\['H', 'W'\].*along="):
        Loader(ds, 2)
    with pytest.raises(RankMismatch, match=r"record 'r1.zarr'.*only dim 'H' \(axis 0\) may differ"):
        _first(Loader(ds, 2, collate=Concat(along={"H": ["grid"]}), shuffle=False))
    with pytest.raises(RankMismatch, match="stacked"):
        Concat(along={})([ds[0], ds[1]])


def test_along_checks_its_arguments(root):
    with pytest.raises(InvalidArgument, match="one dim"):
        Concat(along={"N": ["mesh_pos"], "E": ["mesh_pos"]})
    ds = ZarrRecords(root, fields=SPEC)
    with pytest.raises(InvalidArgument, match=r"'edges' under dim 'N'"):
        Concat(along={"N": ["edges"]}).bind(ds)([ds[0]])
    with pytest.raises(InvalidArgument, match="several node dims"):
        Concat(batch_key="b").bind(ds)([ds[0]])  # N and E joined, no increment says which holds the nodes


def test_a_transform_runs_in_the_reader_threads_and_stays_out_of_the_state(root):
    ds = ZarrRecords(root, fields=SPEC)
    stats = compute_stats(ds, ["mesh_pos", "params"], cache=False)
    where: set[str] = set()

    def transform(sample):
        where.add(threading.current_thread().name)
        return normalize(sample, stats)

    loader = Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False, transform=transform)
    got = list(loader)
    assert where and all(name.startswith("stoker-records-") for name in where)
    plain = Concat(increment={"edges": "N"}).bind(ds)
    for j, batch in enumerate(got):
        want = plain([normalize(ds[i], stats) for i in range(3 * j, min(3 * j + 3, N_RECORDS))])
        for key in want:
            torch.testing.assert_close(batch[key], want[key], rtol=0, atol=0)
    state = loader.state_dict()
    assert "function" not in repr(state) and "test_records_meshes" in repr(state)  # its name, not itself
    again = Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False, transform=transform)
    again.load_state_dict(state)  # the same transform: silent
    other = Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False)
    with pytest.warns(RuntimeWarning, match="transformed differently"):
        other.load_state_dict(state)  # a transform is not the position: allowed, and said


def test_transform_errors_reach_the_consumer_naming_the_record(root):
    ds = ZarrRecords(root, fields=SPEC)

    def bad(sample):
        raise ValueError("no")

    with pytest.raises(ValueError, match="no") as info:
        _first(Loader(ds, 2, shuffle=False, transform=bad))
    assert any("transformed record" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(InvalidArgument, match="transform"):
        Loader(ds, 2, transform="normalize")


def test_the_loaders_threads_are_divided_among_the_nodes_ranks(root, monkeypatch):
    ds = ZarrRecords(root, fields=SPEC)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(os.cpu_count() * 4))
    assert default_compute_threads() == 1
    assert Loader(ds, 2).n_threads == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert Loader(ds, 2).n_threads == min(4, default_compute_threads())
    assert Loader(ds, 2, n_threads=3).n_threads == 3


class Points(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("fields, key", [({"pos": ("N", 3)}, "batch"), (["pos"], "pos_batch")])
def test_the_trainer_counts_samples_not_nodes(tmp_path, fields, key):
    for i in range(6):
        g = zarr.open_group(str(tmp_path / f"cloud_{i}.zarr"), mode="w")
        g.create_array("pos", data=np.random.default_rng(i).normal(size=(50 + 10 * i, 3)).astype("f4"))
    ds = ZarrRecords(str(tmp_path), fields=fields)
    loader = Loader(ds, 2, shuffle=False)
    assert key in _first(Loader(ds, 2, shuffle=False))
    model = Points()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                         lambda m, b: m(b["pos"]).pow(2).mean(), device="cpu", progress=False,
                         telemetry_dir=tmp_path / "run", log_every=1)
    r = trainer.fit(loader, steps=3, resume=None)
    assert r.samples == 6  # graphs, not the 420 nodes nor the key's guess
    import json
    records = [json.loads(line) for line in r.telemetry.read_text().splitlines()]
    assert [rec["samples"] for rec in records] == [2, 4, 6]


def test_the_trainer_asks_the_batch_before_anything_else():
    from stoker.train.trainer import _batch_len  # noqa: F401 - nothing public counts a batch

    b = RecordBatch({"batch": torch.zeros(100, dtype=torch.long), "x": torch.zeros(100, 3)}, num_samples=4)
    assert _batch_len(b) == 4
    from stoker.device.pin import to_device  # a move to a device rebuilds the dict: the count stays

    assert to_device(b, torch.device("cpu")).num_samples == 4


# -- statistics of meshes: per entry, derived inputs, reuse, precompute on what the model sees ---------------


def _stack(root: str, name: str) -> list[np.ndarray]:
    return [zarr.open_group(os.path.join(root, f"run_{i:03d}.zarr"), mode="r")[name][:].astype(np.float64)
            for i in range(N_RECORDS)]


def test_a_fixed_size_1d_field_gets_statistics_per_entry(root):
    ds = ZarrRecords(root, fields=SPEC)
    stats = compute_stats(ds, ["params", "mesh_pos", "thickness"], cache=False)
    params = np.stack(_stack(root, "params"))  # (records, 4)
    assert stats["params"].mean.shape == (4,) and int(stats["params"].count) == N_RECORDS
    np.testing.assert_allclose(stats["params"].mean.numpy(), params.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats["params"].std.numpy(), params.std(axis=0), rtol=1e-10)
    pos = np.concatenate([p.reshape(-1, 3) for p in _stack(root, "mesh_pos")])
    np.testing.assert_allclose(stats["mesh_pos"].mean.numpy(), pos.mean(axis=0), rtol=1e-12)
    assert stats["thickness"].mean.shape == ()  # a named (varying) dim: one statistic
    batch = Concat(increment={"edges": "N"}).bind(ds)([normalize(ds[i], stats) for i in range(3)])
    assert batch["params"].shape == (3, 4)  # per-entry statistics broadcast over the stacked batch


def _edge_len(s):
    pos, edges = s["mesh_pos"][0], s["edges"]
    return (pos[edges[0]] - pos[edges[1]]).norm(dim=-1)


def test_a_derived_function_never_silently_reads_normalised_fields(root):
    ds = ZarrRecords(root, fields=SPEC)
    with pytest.raises(InvalidArgument, match=r"derived 'edge_len' reads field 'mesh_pos'.*derived_input") as info:
        compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, cache=False)
    assert info.value.field == "mesh_pos"
    raw = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="raw", cache=False)
    lengths = []
    for pos, edges in zip(_stack(root, "mesh_pos"), _stack(root, "edges")):
        e = edges.astype(np.int64)
        lengths.append(np.linalg.norm(pos[0][e[0]] - pos[0][e[1]], axis=-1))
    np.testing.assert_allclose(float(raw["edge_len"].mean), np.concatenate(lengths).mean(), rtol=1e-6)
    normed = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="normalized",
                           cache=False)
    assert abs(float(normed["edge_len"].mean) - float(raw["edge_len"].mean)) > 1e-3
    # fields compute_stats does not normalise pass as they are, unwatched: edges here
    ok = compute_stats(ds, ["params"], derived={"n_edges": lambda s: torch.tensor([float(s["edges"].shape[1])])},
                       cache=False)
    assert float(ok["n_edges"].mean) == pytest.approx(np.mean([2 * (3 + i) for i in range(N_RECORDS)]))


def test_reuse_adds_derived_quantities_to_statistics_computed_before(root, tmp_path):
    ds = ZarrRecords(root, fields=SPEC)
    full = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="normalized",
                         cache=False)
    plain = compute_stats(ds, ["mesh_pos"], cache=False)
    again = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="normalized",
                          reuse=plain, cache=False)
    for key in ("mean", "std", "min", "max"):
        assert torch.equal(getattr(again["edge_len"], key), getattr(full["edge_len"], key))
    assert again["mesh_pos"] is plain["mesh_pos"]
    # Other statistics given: they are what is returned and what the derived pass normalises with (no pass 1).
    other = {"mesh_pos": plain["mesh_pos"].__class__(plain["mesh_pos"].count, plain["mesh_pos"].mean + 1.0,
                                                     plain["mesh_pos"].std * 2, plain["mesh_pos"].min,
                                                     plain["mesh_pos"].max)}
    shifted = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="normalized",
                            reuse=other)
    assert torch.equal(shifted["mesh_pos"].mean, other["mesh_pos"].mean)
    torch.testing.assert_close(shifted["edge_len"].mean, full["edge_len"].mean / 2)
    # The cache keys on the statistics reused: the same call with the first ones is not served the other entry.
    cached = compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, derived_input="normalized",
                           reuse=plain)
    assert torch.equal(cached["edge_len"].mean, full["edge_len"].mean)
    with pytest.raises(InvalidArgument, match="reuse holds no statistics of field 'params'"):
        compute_stats(ds, ["params"], reuse=plain, cache=False)


def test_precompute_normalized_with_builds_the_graph_the_model_sees(tmp_path):
    from stoker.records import knn_graph, precompute

    for i in range(4):
        rng = np.random.default_rng(i)
        pts = rng.normal(size=(40, 3)) * np.array([1.0, 50.0, 0.02])  # anisotropic: normalising moves neighbours
        g = zarr.open_group(str(tmp_path / f"cloud_{i}.zarr"), mode="w")
        g.create_array("points", data=pts.astype("f4"))
    ds = ZarrRecords(str(tmp_path), fields={"points": ("N", 3)})
    stats = compute_stats(ds, ["points"], cache=False)
    r = precompute(ds, "knn4", lambda s: knn_graph(s["points"], 4), {"k": 4}, normalized_with=stats)
    assert (r.written, r.skipped) == (4, 0)
    seen = ZarrRecords(str(tmp_path), fields=["points", "knn4"])
    differs = 0
    for i in range(4):
        want = knn_graph(normalize(seen[i], stats)["points"], 4)
        assert torch.equal(seen[i]["knn4"], want)
        differs += int(not torch.equal(want, knn_graph(seen[i]["points"], 4)))
    assert differs > 0
    assert precompute(ds, "knn4", lambda s: knn_graph(s["points"], 4), {"k": 4}, normalized_with=stats).skipped == 4
    moved = {"points": stats["points"].__class__(stats["points"].count, stats["points"].mean,
                                                 stats["points"].std.flip(0), stats["points"].min,
                                                 stats["points"].max)}
    assert precompute(ds, "knn4", lambda s: knn_graph(s["points"], 4), {"k": 4}, normalized_with=moved).written == 4


def test_the_docs_pyg_recipe_matches_pygs_own_batching(root):
    pyg = pytest.importorskip("torch_geometric.data")
    ds = ZarrRecords(root, fields=SPEC)
    b = _first(Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False))
    counts = torch.bincount(b["batch"], minlength=b.num_samples)  # the recipe of docs/records.md
    mine = pyg.Batch(pos=b["mesh_pos"][0], thickness=b["thickness"], edge_index=b["edges"], params=b["params"],
                     batch=b["batch"], ptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
    theirs = pyg.Batch.from_data_list([
        pyg.Data(pos=ds[i]["mesh_pos"][0], thickness=ds[i]["thickness"], edge_index=ds[i]["edges"],
                 params=ds[i]["params"][None]) for i in range(3)])
    assert mine.num_graphs == theirs.num_graphs == 3
    for key in ("pos", "thickness", "edge_index", "params", "batch", "ptr"):
        assert torch.equal(getattr(mine, key), getattr(theirs, key)), key


# -- under a real 2-process gloo group ----------------------------------------------------------------------


def _hex(st) -> dict:
    return {k: [float(v).hex() for v in getattr(st, k).reshape(-1).tolist()] for k in ("mean", "std", "min", "max")}


def _mesh_worker(rank: int, world: int, tmp: str, root: str) -> None:
    import torch.distributed as dist

    from stoker.records import knn_graph, precompute

    with gloo_group(rank, world, tmp):
        out: dict = {}
        ds = ZarrRecords(root, fields=SPEC)
        stats = compute_stats(ds, ["mesh_pos", "params"])
        out["params_shape"] = list(stats["params"].mean.shape)
        out["plain"] = {k: _hex(v) for k, v in stats.items()}
        more = compute_stats(ds, ["mesh_pos", "params"], derived={"edge_len": _edge_len},
                             derived_input="normalized", reuse=stats)
        out["edge_len"] = _hex(more["edge_len"])
        r = precompute(ds, "knn2", lambda s: knn_graph(s["mesh_pos"][0], 2), {"k": 2}, normalized_with=stats)
        out["written"] = [r.written, r.total_written]
        try:  # reading a normalised field without derived_input: an error on every rank, no hang
            compute_stats(ds, ["mesh_pos"], derived={"edge_len": _edge_len}, cache=False)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            out["unsaid"] = type(exc).__name__
        write_result(tmp, rank, out)
        dist.barrier()


@pytest.mark.timeout(180)
def test_reuse_and_normalized_with_across_two_ranks(tmp_path):
    data = str(tmp_path / "data")
    write_meshes(data)
    results = spawn_ranks(_mesh_worker, 2, tmp_path, data)
    assert results[0] == {**results[1], "written": results[0]["written"]}  # bit-identical statistics
    assert results[0]["params_shape"] == [4]
    assert results[0]["unsaid"] == "InvalidArgument" and results[1]["unsaid"] in ("InvalidArgument", "StokerError")
    assert results[0]["written"][1] == N_RECORDS and sum(r["written"][0] for r in results) == N_RECORDS
    ds = ZarrRecords(data, fields=SPEC)
    full = compute_stats(ds, ["mesh_pos", "params"], derived={"edge_len": _edge_len}, derived_input="normalized",
                         cache=False)  # one process, both passes
    got = {k: np.array([float.fromhex(v) for v in vals]) for k, vals in results[0]["edge_len"].items()}
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(got[key], getattr(full["edge_len"], key).reshape(-1).numpy(), rtol=1e-6)
    seen = ZarrRecords(data, fields={**SPEC, "knn2": ("N", 2)})
    stats = compute_stats(ds, ["mesh_pos", "params"])  # the cached entry rank 0 wrote
    for i in range(N_RECORDS):
        assert torch.equal(seen[i]["knn2"], knn_graph_of(normalize(seen[i], stats)["mesh_pos"][0]))


def knn_graph_of(points):
    from stoker.records import knn_graph

    return knn_graph(points, 2)


def test_a_dim_that_index_fields_point_into_is_joined_even_when_every_record_has_its_size(tmp_path):
    for i in range(4):
        g = zarr.open_group(str(tmp_path / f"c{i}.zarr"), mode="w")
        g.create_array("points", data=np.full((5, 3), i, "f4"))
        g.create_array("knn", data=np.tile(np.arange(5, dtype="i8")[:, None], (1, 2)))
    ds = ZarrRecords(str(tmp_path), fields={"points": ("N", 3), "knn": ("N", 2)})
    stacked = _first(Loader(ds, 4, shuffle=False))  # nothing varies, nothing points into N: stacked
    assert stacked["points"].shape == (4, 5, 3) and set(stacked) == {"points", "knn"}
    joined = _first(Loader(ds, 4, collate=Concat(increment={"knn": "N"}), shuffle=False))
    assert joined["points"].shape == (20, 3) and joined["knn"].shape == (20, 2)
    assert torch.equal(joined["knn"][5:10, 0], torch.arange(5, 10))
    assert torch.equal(joined["batch"], torch.arange(4).repeat_interleave(5))
