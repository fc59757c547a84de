"""stoker.records at its edges: values that a narrow dtype cannot hold, and what the data cannot tell.

Tiny records written by zarr-python, read back by zarr-python (or built with numpy) as the oracle; each
test is one edge a silently wrong value would hide behind.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
import zarr

from stoker.arraystats import compute_array_stats
from stoker.errors import DtypeMismatch, InvalidArgument, RankMismatch, StorageError
from stoker.reader.array import ArrayReader
from stoker.records import Concat, Loader, Pad, ZarrRecords, compute_stats, denormalize, knn_graph, normalize, precompute


def _first(loader):
    """``loader``'s first batch, the loader closed after it (its reader threads end with the test)."""
    with loader:
        return next(iter(loader))


def write_graphs(root: str, nodes: list[int], index_dtype: str) -> None:
    """Record i: ``points (nodes[i], 2)`` and ``edges (2, nodes[i])`` (each node to the last one) of
    ``index_dtype``, as compact meshes are stored."""
    for i, n in enumerate(nodes):
        g = zarr.open_group(os.path.join(root, f"g{i:02d}.zarr"), mode="w")
        g.create_array("points", data=np.arange(2 * n, dtype="f4").reshape(n, 2))
        g.create_array("edges", data=np.stack([np.arange(n), np.full(n, n - 1)]).astype(index_dtype))


@pytest.mark.parametrize("index_dtype", ["u1", "i2", "u2"])
def test_incremented_indices_never_wrap_around_a_narrow_dtype(tmp_path, index_dtype):
    # Each record's indices fit its dtype; the batch's offsets do not: they must not wrap silently.
    limit = int(np.iinfo(index_dtype).max)
    nodes = [limit // 2 + 1 + i for i in range(3)]
    write_graphs(str(tmp_path), nodes, index_dtype)
    ds = ZarrRecords(str(tmp_path), fields={"points": ("N", 2), "edges": (2, "E")})
    with pytest.raises(DtypeMismatch, match="'edges'") as info:
        _first(Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False, n_threads=1))
    assert "int64" in str(info.value) and info.value.context["sample"] in ds.names
    # Without named dims (the legacy layout, indexing a field) alike.
    legacy = [{"points": torch.zeros(n, 2), "edges": torch.from_numpy(np.full(n, n - 1, dtype=index_dtype))}
              for n in nodes]
    with pytest.raises(DtypeMismatch, match="'edges'"):
        Concat(increment={"edges": "points"})(legacy)


@pytest.mark.parametrize("index_dtype", ["u1", "i2", "u2", "u4", "u8"])
def test_incremented_indices_keep_their_dtype_where_they_fit(tmp_path, index_dtype):
    # uint16/32/64 tensors have no addition in torch: a NotImplementedError ("add_stub") before.
    nodes = [5, 6, 7]
    write_graphs(str(tmp_path), nodes, index_dtype)
    ds = ZarrRecords(str(tmp_path), fields={"points": ("N", 2), "edges": (2, "E")})
    batch = _first(Loader(ds, 3, collate=Concat(increment={"edges": "N"}), shuffle=False, n_threads=1))
    want = np.concatenate([zarr.open_array(os.path.join(ds.metadata(i).path, "edges"))[:].astype(np.int64)
                           + sum(nodes[:i]) for i in range(3)], axis=1)
    assert batch["edges"].dtype == torch.from_numpy(np.zeros(0, dtype=index_dtype)).dtype
    assert np.array_equal(batch["edges"].numpy().astype(np.int64), want)


@pytest.mark.parametrize("bad", [-1, 5])
def test_an_index_outside_its_own_record_is_refused_not_shifted_into_another(tmp_path, bad):
    # A -1 ("no neighbour") in record 1 was shifted by record 0's 5 nodes to 4: record 0's last node, silently;
    # an index past its own record's nodes pointed into the next record's.
    nodes = [5, 4, 6]
    for i, n in enumerate(nodes):
        g = zarr.open_group(os.path.join(tmp_path, f"g{i}.zarr"), mode="w")
        g.create_array("points", data=np.arange(2 * n, dtype="f4").reshape(n, 2))
        nbr = np.stack([(np.arange(n) + 1) % n, (np.arange(n) + 2) % n], axis=1).astype("i8")
        if i == 1:
            nbr[2, 1] = bad if bad < 0 else n + 1
        g.create_array("nbr", data=nbr)
    ds = ZarrRecords(str(tmp_path), fields={"points": ("N", 2), "nbr": ("N", 2)})
    with pytest.raises(InvalidArgument, match="'nbr'") as info:
        _first(Loader(ds, 3, collate=Concat(increment={"nbr": "N"}), shuffle=False, n_threads=1))
    assert info.value.context["sample"] == "g1.zarr" and info.value.index == (bad if bad < 0 else 5)
    legacy = [{"points": ds[i]["points"], "nbr": ds[i]["nbr"]} for i in range(3)]
    with pytest.raises(InvalidArgument, match="'nbr'"):
        Concat(increment={"nbr": "points"})(legacy)
    # Valid indices (every record's own rows) are shifted as zarr-python's values plus the nodes before.
    good = [{"points": s["points"], "nbr": s["nbr"].clamp(0, s["points"].shape[0] - 1)} for s in legacy]
    want = np.concatenate([g["nbr"].numpy() + sum(nodes[:i]) for i, g in enumerate(good)])
    assert np.array_equal(Concat(increment={"nbr": "points"})(good)["nbr"].numpy(), want)


def test_exclusive_end_bounds_may_equal_the_rows_when_named_in_ends():
    # Segment stops (a CSR indptr's ends) equal their record's rows: shifted, the next sample's start, right;
    # refused unless named (an edge_index holding its record's row count points at the next record's node 0).
    s0 = {"atoms": torch.zeros(5, 3), "start": torch.tensor([0, 2]), "stop": torch.tensor([2, 5])}
    s1 = {"atoms": torch.zeros(4, 3), "start": torch.tensor([0, 1]), "stop": torch.tensor([1, 4])}
    with pytest.raises(InvalidArgument, match=r"ends=\{'stop'\}"):
        Concat(increment={"start": "atoms", "stop": "atoms"})([s0, s1])
    batch = Concat(increment={"start": "atoms", "stop": "atoms"}, ends={"stop"})([s0, s1])
    assert batch["start"].tolist() == [0, 2, 5, 6] and batch["stop"].tolist() == [2, 5, 6, 9]
    atoms = torch.cat([s0["atoms"], s1["atoms"]])
    assert all(batch["stop"][i] <= len(atoms) for i in range(4))
    s1["stop"] = torch.tensor([1, 5])  # past the record's end even as an end bound
    with pytest.raises(InvalidArgument, match="index 5, outside the 4 rows"):
        Concat(increment={"start": "atoms", "stop": "atoms"}, ends={"stop"})([s0, s1])
    with pytest.raises(InvalidArgument, match="not increment fields"):
        Concat(increment={"start": "atoms"}, ends={"stop"})
    for bad in (5, None, [1], {"stop": 1.5}.values()):  # a bare TypeError of frozenset() before
        with pytest.raises(InvalidArgument, match="ends must be a field name or a collection of them"):
            Concat(increment={"start": "atoms", "stop": "atoms"}, ends=bad)


def test_exclusive_end_bounds_on_the_named_dims_path_and_through_bind(tmp_path):
    """``ends`` where the records' dims spec joins the fields (``Concat()`` bound by the Loader, and
    ``along=`` given): stops equal to a record's rows shift to the next sample's start, as on the legacy path;
    without ``ends`` they are refused. Values read back by zarr-python are the oracle."""
    nodes, stops = (5, 4, 3), ([2, 5], [1, 4], [3])
    for i, (n, st) in enumerate(zip(nodes, stops)):
        g = zarr.open_group(os.path.join(tmp_path, f"r{i}.zarr"), mode="w")
        g.create_array("atoms", data=np.arange(3 * n, dtype="f4").reshape(n, 3))
        g.create_array("stop", data=np.array(st, "i8"))
    ds = ZarrRecords(str(tmp_path), fields={"atoms": ("N", 3), "stop": ("S",)})
    read = [zarr.open_array(os.path.join(tmp_path, f"r{i}.zarr", "stop"))[:] for i in range(3)]
    want = np.concatenate([r + sum(nodes[:i]) for i, r in enumerate(read)]).tolist()
    for collate in (Concat(increment={"stop": "N"}, ends={"stop"}),  # dims from the dataset, through bind
                    Concat(increment={"stop": "N"}, ends="stop", along={"N": ["atoms"], "S": ["stop"]})):
        batch = _first(Loader(ds, 3, collate=collate, shuffle=False, n_threads=1))
        assert batch["stop"].tolist() == want and batch["atoms"].shape == (sum(nodes), 3)
    bound = Concat(increment={"stop": "N"}, ends={"stop"}).bind(ds)
    assert bound.dims is not None and bound.ends == {"stop"}
    with pytest.raises(InvalidArgument, match=r"ends=\{'stop'\}"):
        _first(Loader(ds, 3, collate=Concat(increment={"stop": "N"}), shuffle=False, n_threads=1))

def test_a_pad_value_the_field_cannot_hold_is_refused_not_changed(tmp_path):
    # Pad(-1) on uint8 labels (an ignore_index) was 255, Pad(0.5) on int32 was 0: another value, silently.
    for i, n in enumerate((2, 3)):
        g = zarr.open_group(os.path.join(tmp_path, f"s{i}.zarr"), mode="w")
        g.create_array("labels", data=np.arange(n, dtype="u1"))
        g.create_array("ids", data=np.arange(n, dtype="i4"))
        g.create_array("x", data=np.ones(n, dtype="f2"))
    ds = ZarrRecords(str(tmp_path))
    samples = [ds[0], ds[1]]
    for value, field in ((-1, "labels"), (256, "labels"), (0.5, "ids"), (1e6, "x")):
        with pytest.raises(DtypeMismatch, match=f"'{field}'"):
            Pad(value)([{field: s[field]} for s in samples])
    batch = Pad(-1)([{"ids": s["ids"], "x": s["x"]} for s in samples])
    assert batch["ids"].dtype == torch.int32 and batch["ids"][0].tolist() == [0, 1, -1]
    assert batch["x"].dtype == torch.float16 and batch["x"][0].tolist() == [1.0, 1.0, -1.0]
    nan = Pad(float("nan"))([{"x": s["x"]} for s in samples])["x"]
    assert torch.isnan(nan[0, 2]) and not torch.isnan(nan[1]).any()
    # an ignore index for one field beside fields that cannot hold it: each its own value, the error says how
    with pytest.raises(DtypeMismatch, match=r"values=\{'labels': \.\.\.\}"):
        Pad(-100)([{"labels": s["labels"], "ids": s["ids"]} for s in samples])
    mixed = Pad(0, values={"ids": -100})([{"labels": s["labels"], "ids": s["ids"]} for s in samples])
    assert mixed["ids"][0].tolist() == [0, 1, -100] and mixed["labels"][0].tolist() == [0, 1, 0]


def test_integer_fields_normalise_from_their_exact_values(tmp_path):
    # Seconds since 1970: float32 holds them in steps of 128, 0.2 std here, before any subtraction.
    for i in range(2):
        g = zarr.open_group(os.path.join(tmp_path, f"t{i}.zarr"), mode="w")
        g.create_array("time", data=1_700_000_000 + np.arange(i * 1000, (i + 1) * 1000, dtype="i8"))
    ds = ZarrRecords(str(tmp_path))
    stats = compute_stats(ds, ["time"], cache=False)
    stored = np.concatenate([zarr.open_array(os.path.join(ds.metadata(i).path, "time"))[:] for i in range(2)])
    assert float(stats["time"].mean) == stored.mean() and np.isclose(float(stats["time"].std), stored.std(), rtol=1e-12)
    x = normalize(ds[0], stats)["time"]
    want = ((stored[:1000] - stored.mean()) / stored.std()).astype(np.float32)
    assert x.dtype == torch.float32
    np.testing.assert_allclose(x.numpy(), want, rtol=0, atol=1e-6)
    back = denormalize({"time": x.double()}, stats)["time"].numpy()
    np.testing.assert_allclose(back, stored[:1000], rtol=0, atol=1e-3)


@pytest.mark.parametrize("channel_axis", [None, 1])
def test_statistics_of_an_array_without_elements_name_it(tmp_path, channel_axis):
    # An AssertionError from deep inside the merge before.
    uri = str(tmp_path / "empty.zarr")
    zarr.create_array(store=uri, shape=(0, 4), chunks=(2, 4), dtype="f4")
    with pytest.raises(InvalidArgument, match="no elements") as info:
        compute_array_stats(uri, channel_axis=channel_axis)
    assert info.value.context["uri"] == uri


def test_precompute_keeps_the_shape_of_a_scalar_result(tmp_path):
    # np.ascontiguousarray makes a 0-d result 1-d: a per-record scalar came back as shape (1,).
    for i in range(2):
        g = zarr.open_group(os.path.join(tmp_path, f"p{i}.zarr"), mode="w", zarr_format=2 + i)
        g.create_array("points", data=np.arange(6 * (i + 1), dtype="f4").reshape(-1, 3))
    ds = ZarrRecords(str(tmp_path), fields=["points"])
    precompute(ds, "extent", lambda s: s["points"].max() - s["points"].min(), {"v": 1})
    precompute(ds, "centre", lambda s: s["points"].mean(0).numpy(), {"v": 1})
    for i in range(2):
        g = zarr.open_group(ds.metadata(i).path, mode="r")
        assert g["extent"].shape == () and g["centre"].shape == (3,)
    ds = ZarrRecords(str(tmp_path), fields=["points", "extent"])
    assert ds[1]["extent"].shape == () and float(ds[1]["extent"]) == 11.0


def test_a_transform_that_changes_a_field_s_dims_is_not_joined_by_the_stored_spec(tmp_path):
    # The bound spec says mesh_pos (T, N, 3): after a transform keeping step 0, (N, 3), "axis 1" is the
    # channels. One record per batch (or equal N) joined there silently: batch had 3 entries, not N.
    for i in range(3):
        g = zarr.open_group(os.path.join(tmp_path, f"m{i}.zarr"), mode="w")
        g.create_array("mesh_pos", data=np.arange(2 * (4 + i) * 3, dtype="f4").reshape(2, 4 + i, 3))
        g.create_array("edges", data=np.stack([np.arange(4 + i), np.zeros(4 + i)]).astype("i8"))
    ds = ZarrRecords(str(tmp_path), fields={"mesh_pos": ("T", "N", 3), "edges": (2, "E")})

    def first_step(s):
        return {**s, "mesh_pos": s["mesh_pos"][0]}

    with pytest.raises(RankMismatch, match="'mesh_pos'.*dims="):
        _first(Loader(ds, 1, collate=Concat(increment={"edges": "N"}), shuffle=False, transform=first_step))
    # Told the samples' dims, it joins them right: the oracle is zarr-python's step 0 of each record.
    collate = Concat(increment={"edges": "N"}, dims={"mesh_pos": ("N", 3), "edges": (2, "E")})
    batch = _first(Loader(ds, 3, collate=collate, shuffle=False, transform=first_step))
    stored = [zarr.open_group(ds.metadata(i).path, mode="r") for i in range(3)]
    assert np.array_equal(batch["mesh_pos"].numpy(), np.concatenate([g["mesh_pos"][0] for g in stored]))
    assert batch["batch"].tolist() == [0] * 4 + [1] * 5 + [2] * 6
    assert batch["edges"][0].tolist() == list(range(15))


def test_an_error_of_a_user_function_names_the_record_it_was_computing(tmp_path):
    # "k=4 neighbours asked for but there are only 3 points", and no word of which record has 3.
    for i, n in enumerate((9, 3, 12)):
        g = zarr.open_group(os.path.join(tmp_path, f"cloud_{i}.zarr"), mode="w")
        g.create_array("x", data=np.random.default_rng(i).random((n, 3)).astype("f4"))
    ds = ZarrRecords(str(tmp_path))
    with pytest.raises(InvalidArgument, match="only 3 points") as info:
        precompute(ds, "knn4", lambda s: knn_graph(s["x"], 4), {"k": 4})
    assert "'cloud_1.zarr'" in " ".join(getattr(info.value, "__notes__", []))
    with pytest.raises(InvalidArgument, match="only 3 points") as info:
        compute_stats(ds, ["x"], derived={"nb": lambda s: knn_graph(s["x"], 4)}, derived_input="raw", cache=False)
    assert "'cloud_1.zarr'" in " ".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("copy", [dict, lambda s: {**s}, lambda s: s.copy(), lambda s: s | {}, lambda s: {
    "x": s.pop("x")}, lambda s: {"x": s.setdefault("x", None)}])
def test_a_derived_function_cannot_read_normalised_fields_through_a_copy(tmp_path, copy):
    # Only s[...] and s.get were watched: {**s} (the usual way to extend a sample) read normalised values
    # without derived_input saying so, silently.
    for i in range(2):
        g = zarr.open_group(os.path.join(tmp_path, f"r{i}.zarr"), mode="w")
        g.create_array("x", data=np.arange(3 * (i + 2), dtype="f4").reshape(-1, 3))
    ds = ZarrRecords(str(tmp_path))
    with pytest.raises(InvalidArgument, match="derived 'spread' reads field 'x'.*derived_input"):
        compute_stats(ds, ["x"], derived={"spread": lambda s: copy(s)["x"].std(0)}, cache=False)


@pytest.mark.parametrize("threads,chunks", [(1, (4, 4)), (4, (8, 8))])
def test_a_stuck_read_times_out_with_one_thread_or_one_chunk(tmp_path, monkeypatch, threads, chunks):
    # One thread (a one-CPU container's default) or one chunk read on the calling thread, unbounded:
    # timeout_s was not applied and a hung mount hung compute_stats for ever.
    uri = str(tmp_path / "a.zarr")
    zarr.create_array(store=uri, data=np.ones((8, 8), dtype="f4"), chunks=chunks)
    release = threading.Event()
    real = ArrayReader.read

    def stuck(self, box):
        release.wait(30)
        return real(self, box)

    monkeypatch.setattr(ArrayReader, "read", stuck)
    try:
        with pytest.raises(StorageError, match=r"a\.zarr: reading .*took more than 0\.2 s"):
            compute_array_stats(uri, cache=False, threads=threads, timeout_s=0.2)
    finally:
        release.set()
