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

T = 4
N_RECORDS = 7
SPEC = {"mesh_pos": ("T", "N", 3), "thickness": ("N",), "edges": (2, "E"), "params": (4,)}


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
    with pytest.raises(RankMismatch, match=r"record 'run_002.zarr'.*field 'params'") as info:
        list(Loader(ds, 4, collate=Concat(increment={"edges": "N"}), shuffle=False))
    assert info.value.sample == "run_002.zarr" and info.value.field == "params"


def test_a_field_varying_along_two_dims_is_refused_up_front(tmp_path):
    for i in range(3):
        g = zarr.open_group(str(tmp_path / f"r{i}.zarr"), mode="w")
        g.create_array("grid", data=np.zeros((2 + i, 3 + i), "f4"))
    ds = ZarrRecords(str(tmp_path), fields={"grid": ("H", "W")})
    with pytest.raises(InvalidArgument, match=r"'grid'.*\['H', 'W'\].*along="):
        Loader(ds, 2)
    with pytest.raises(RankMismatch, match=r"record 'r1.zarr'.*only dim 'H' \(axis 0\) may differ"):
        next(iter(Loader(ds, 2, collate=Concat(along={"H": ["grid"]}), shuffle=False)))
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
    assert "transform" not in repr(state)
    again = Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False, transform=transform)
    again.load_state_dict(state)  # a transform is the loader's, not the position's


def test_transform_errors_reach_the_consumer_naming_the_record(root):
    ds = ZarrRecords(root, fields=SPEC)

    def bad(sample):
        raise ValueError("no")

    with pytest.raises(ValueError, match="no") as info:
        next(iter(Loader(ds, 2, shuffle=False, transform=bad)))
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
    assert key in next(iter(Loader(ds, 2, shuffle=False)))
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
