"""stoker.records: k-NN graphs and per-record arrays precomputed into the records.

Real data written by zarr-python (v2 and v3 groups alternating); a child process
SIGKILLed in the middle of a write; a real gloo group of two ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import zipfile

import numpy as np
import pytest
import torch
import zarr

from stoker.storage import fsutil
from stoker.errors import DtypeMismatch, InvalidArgument, RankMismatch
from stoker.records import ZarrRecords, knn_edge_index, knn_graph, precompute

from stoker.records import precomputed as pre

from gloo_ranks import gloo_group, spawn_ranks, write_result

N_RECORDS = 7
K = 4


def write_dataset(root: str, n: int = N_RECORDS) -> list[np.ndarray]:
    """``n`` records of ``points`` (N_i, 3) and ``rid`` (1,); v3 and v2 groups alternating."""
    points = []
    for i in range(n):
        rng = np.random.default_rng(100 + i)
        p = rng.normal(size=(12 + 3 * i, 3)).astype("f4")
        g = zarr.open_group(os.path.join(root, f"rec_{i:03d}.zarr"), mode="w", zarr_format=3 if i % 2 == 0 else 2)
        g.create_array("points", data=p, chunks=(8, 3))
        g.create_array("rid", data=np.array([i], dtype="i8"))
        points.append(p)
    return points


def brute_knn(points: torch.Tensor, k: int) -> torch.Tensor:
    """Reference: the full distance matrix, self excluded, stable sort (ties by index)."""
    d = torch.cdist(points, points, compute_mode="donot_use_mm_for_euclid_dist")
    d.fill_diagonal_(float("inf"))
    return torch.sort(d, dim=1, stable=True).indices[:, :k]


class Counter:
    """``fn`` for precompute: k-NN of the record's points, counting and naming the records it saw."""

    def __init__(self, k: int = K) -> None:
        self.k = k
        self.seen: list[int] = []

    def __call__(self, sample: dict) -> torch.Tensor:
        self.seen.append(int(sample["rid"][0]))
        return knn_graph(sample["points"], self.k)


def leftovers(root: str, i: int) -> list[str]:
    """Hidden temporaries (``.knn.tmp-...``, ``.knn.old-...``) in record ``i``."""
    return [e for e in os.listdir(os.path.join(root, f"rec_{i:03d}.zarr")) if e.startswith(".knn.")]


def array_files(root: str, name: str) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file of array ``name`` in every record."""
    out = {}
    for rec in sorted(os.listdir(root)):
        base = os.path.join(root, rec, name)
        for dirpath, _, files in os.walk(base):
            for f in files:
                st = os.stat(os.path.join(dirpath, f))
                out[os.path.join(dirpath, f)] = (st.st_ino, st.st_mtime_ns)
    return out


# -- k-NN --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_knn_equals_brute_force_for_any_chunk(dtype):
    gen = torch.Generator().manual_seed(0)
    pts = torch.randn(301, 3, generator=gen, dtype=dtype)
    d = torch.cdist(pts, pts)
    d.fill_diagonal_(float("inf"))
    by_topk = torch.topk(d, 7, dim=1, largest=False).indices  # random points: no ties, topk is exact
    for chunk in (1, 16, 300, 301, 4096):
        got = knn_graph(pts, 7, chunk=chunk)
        assert got.dtype == torch.long and got.shape == (301, 7)
        assert torch.equal(got, brute_knn(pts, 7)), chunk
        assert torch.equal(got, by_topk), chunk
    assert not (knn_graph(pts, 7) == torch.arange(301)[:, None]).any()  # never itself


def test_knn_ties_go_to_the_lower_index_in_every_chunk_size():
    grid = torch.stack(torch.meshgrid(torch.arange(7), torch.arange(6), indexing="ij"), -1).reshape(-1, 2)
    pts = torch.cat([grid, grid[:9]]).double()  # a grid (many equal distances) plus duplicate points
    want = brute_knn(pts, 6)
    for chunk in (1, 5, 13, 51, 1000):
        assert torch.equal(knn_graph(pts, 6, chunk=chunk), want), chunk
    # Point 0 sits at the corner: its duplicate (42, distance 0) first, then 1 and 6 (distance 1), index order.
    assert knn_graph(pts, 3)[0].tolist() == [42, 1, 6]
    assert torch.equal(knn_graph(grid, 6), brute_knn(grid.double(), 6))  # integers: computed in float64


def test_knn_never_computes_more_than_a_chunk_of_rows(monkeypatch):
    shapes = []
    real = torch.cdist

    def spy(a, b, *args, **kwargs):
        shapes.append((a.shape[0], b.shape[0]))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "cdist", spy)
    pts = torch.randn(1000, 3)
    got = knn_graph(pts, 5, chunk=128)
    monkeypatch.undo()
    assert torch.equal(got, brute_knn(pts, 5))
    assert shapes and max(r for r, _ in shapes) <= 128 and sum(r for r, _ in shapes) == 1000


def test_knn_edge_index_layout():
    nbr = knn_graph(torch.randn(20, 2), 3)
    ei = knn_edge_index(nbr)
    assert ei.shape == (2, 60)
    assert torch.equal(ei[0], nbr.reshape(-1)) and torch.equal(ei[1], torch.arange(20).repeat_interleave(3))


def test_knn_bad_input():
    with pytest.raises(InvalidArgument, match="k=5"):
        knn_graph(torch.randn(5, 3), 5)
    with pytest.raises(InvalidArgument, match="NaN"):
        knn_graph(torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]]), 1)
    with pytest.raises(RankMismatch):
        knn_graph(torch.randn(4, 3, 2), 1)
    with pytest.raises(InvalidArgument, match="chunk"):
        knn_graph(torch.randn(4, 3), 1, chunk=0)
    with pytest.raises(DtypeMismatch):
        knn_graph(torch.ones(4, 3, dtype=torch.bool), 1)


# -- precompute in one process -----------------------------------------------------------------


@pytest.fixture
def data(tmp_path):
    root = str(tmp_path / "data")
    return root, write_dataset(root)


def test_precompute_stores_fn_of_every_record_and_a_new_dataset_sees_it(data):
    root, points = data
    fn = Counter()
    res = precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", fn, params={"k": K})
    assert (res.written, res.skipped, res.total_written) == (N_RECORDS, 0, N_RECORDS)
    assert sorted(fn.seen) == list(range(N_RECORDS))
    ds = ZarrRecords(root, fields=["points", "knn"])
    for i, p in enumerate(points):
        got = ds[i]
        assert got["knn"].dtype == torch.long
        assert torch.equal(got["knn"], brute_knn(torch.from_numpy(p), K))
        rec = os.path.join(root, f"rec_{i:03d}.zarr")
        # The array follows its group's format; its fingerprint and params sit in its attributes.
        assert os.path.exists(os.path.join(rec, "knn", "zarr.json" if i % 2 == 0 else ".zarray"))
        attrs = dict(zarr.open_array(os.path.join(rec, "knn"), mode="r").attrs)
        assert attrs[pre.ATTR]["fingerprint"] == res.fingerprint and attrs[pre.ATTR]["params"] == {"k": K}
        assert leftovers(root, i) == []  # no temporary left behind


def test_second_run_writes_nothing_and_new_params_recompute(data):
    root, points = data
    ds = ZarrRecords(root, fields=["points", "rid"])
    precompute(ds, "knn", Counter(), params={"k": K})
    before = array_files(root, "knn")
    again = Counter()
    res = precompute(ds, "knn", again, params={"k": K})
    assert again.seen == [] and (res.written, res.skipped) == (0, N_RECORDS)
    assert array_files(root, "knn") == before  # same inodes, same mtimes: nothing rewritten

    changed = Counter(k=2)
    res = precompute(ds, "knn", changed, params={"k": 2})
    assert sorted(changed.seen) == list(range(N_RECORDS)) and res.written == N_RECORDS
    new = ZarrRecords(root, fields=["knn"])
    for i, p in enumerate(points):
        assert torch.equal(new[i]["knn"], brute_knn(torch.from_numpy(p), 2))
        assert leftovers(root, i) == []
    # Key order and tuples/lists do not change the fingerprint: JSON is canonicalised.
    assert pre.fingerprint("knn", {"a": 1, "b": (1, 2)}) == pre.fingerprint("knn", {"b": [1, 2], "a": 1})


def test_a_record_rewritten_at_another_size_is_computed_again(data):
    # A record remeshed (its points rewritten, 20 instead of 18) after its k-NN table was stored: a new dataset's
    # precompute recomputes that record alone, not skipping it for its unchanged name and params (a table of
    # 18 rows would index points that no longer exist); the others are skipped as before.
    root, points = data
    precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", Counter(), params={"k": K})
    g = zarr.open_group(os.path.join(root, "rec_003.zarr"), mode="r+")
    remeshed = np.random.default_rng(9).normal(size=(20, 3)).astype("f4")
    del g["points"]
    g.create_array("points", data=remeshed, chunks=(8, 3))
    fn = Counter()
    res = precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", fn, params={"k": K})
    assert fn.seen == [3] and (res.written, res.skipped) == (1, N_RECORDS - 1)
    got = ZarrRecords(root, fields=["knn"])[3]["knn"]
    assert torch.equal(got, brute_knn(torch.from_numpy(remeshed), K))
    inputs = pre.stored_inputs(os.path.join(root, "rec_003.zarr"), "knn")  # shape, dtype, digest of the files
    assert {f: v[:2] for f, v in inputs.items()} == {"points": [[20, 3], "<f4"], "rid": [[1], "<i8"]}
    assert all(isinstance(v[2], str) for v in inputs.values())
    # Opened with other fields (one left out): nothing changed, nothing computed
    for fields in (["points"], ["rid"]):
        again = Counter()
        res = precompute(ZarrRecords(root, fields=fields), "knn", again, params={"k": K})
        assert again.seen == [] and (res.written, res.skipped) == (0, N_RECORDS), fields


def test_only_records_without_a_matching_array_are_computed(data):
    root, _ = data
    ds = ZarrRecords(root, fields=["points", "rid"])
    precompute(ds.for_rank(1, 3), "knn", Counter(), params={"k": K})  # a shard: records 1 and 4 only
    fn = Counter()
    res = precompute(ds, "knn", fn, params={"k": K})
    assert sorted(fn.seen) == [0, 2, 3, 5, 6] and (res.written, res.skipped) == (5, 2)


def test_precompute_refuses_bad_input_and_foreign_arrays(data):
    root, _ = data
    ds = ZarrRecords(root, fields=["points", "rid"])
    with pytest.raises(InvalidArgument, match="JSON"):
        precompute(ds, "knn", Counter(), params={"k": object()})
    with pytest.raises(InvalidArgument, match="field of ds"):
        precompute(ds, "points", Counter(), params=None)
    for bad in ("", "a/b", ".hidden", "__x", 3):
        with pytest.raises(InvalidArgument, match="name"):
            precompute(ds, bad, Counter(), params=None)
    with pytest.raises(InvalidArgument, match="ZarrRecords"):
        precompute([1, 2], "knn", Counter(), params=None)
    with pytest.raises(InvalidArgument, match="torch.Tensor"):
        precompute(ds, "knn", lambda s: [1, 2], params=None)
    with pytest.raises(DtypeMismatch, match="bfloat16"):
        precompute(ds, "knn", lambda s: torch.zeros(2, dtype=torch.bfloat16), params=None)
    # An array the user wrote under that name is never replaced.
    rec0 = os.path.join(root, "rec_000.zarr")
    zarr.open_group(rec0, mode="r+").create_array("mine", data=np.arange(3))
    with pytest.raises(InvalidArgument, match="did not write"):
        precompute(ds, "mine", Counter(), params=None)
    assert np.array_equal(zarr.open_array(os.path.join(rec0, "mine"), mode="r")[:], np.arange(3))


# -- a crash in the middle of a write ---------------------------------------------------------------


def _crash_child(root: str, signal_path: str, params: dict, where: str) -> None:
    """Run precompute, freezing (to be SIGKILLed) at ``where`` on the 4th record (rid 3)."""
    import zarr.storage

    def freeze() -> None:
        with open(signal_path, "w") as f:
            f.write("frozen")
        time.sleep(600)

    if where == "chunks":
        # Inside zarr-python's write: metadata (fingerprint included) is on disk, the chunk is not.
        real_set = zarr.storage.LocalStore.set

        async def slow_set(self, key, value, *args, **kwargs):
            if "rec_003" in str(self.root) and not key.endswith(("zarr.json", ".zarray", ".zattrs")):
                freeze()
            await real_set(self, key, value, *args, **kwargs)

        zarr.storage.LocalStore.set = slow_set
    else:
        # Between moving the outdated array aside and renaming the new one in.
        real_replace = os.replace

        def slow_replace(src, dst):
            real_replace(src, dst)
            if "rec_003" in str(dst) and ".knn.old-" in str(dst):
                freeze()

        pre.os.replace = slow_replace
    ds = ZarrRecords(root, fields=["points", "rid"])
    precompute(ds, "knn", lambda s: knn_graph(s["points"], params["k"]), params=params)


def _kill_when_frozen(root: str, tmp: str, params: dict, where: str) -> None:
    signal_path = os.path.join(tmp, f"frozen-{where}")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_crash_child, args=(root, signal_path, params, where))
    proc.start()
    deadline = time.monotonic() + 90
    while not os.path.exists(signal_path):
        assert proc.is_alive(), "the child exited before reaching the crash point"
        assert time.monotonic() < deadline, "the child never reached the crash point"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL


def _check_complete_or_absent(root: str, points: list[np.ndarray], k_by_fp: dict[str, int]) -> list[int]:
    """Every record: no ``knn`` at all, or a complete one under a known fingerprint. Returns the absent."""
    absent = []
    for i, p in enumerate(points):
        rec = os.path.join(root, f"rec_{i:03d}.zarr")
        if not os.path.exists(os.path.join(rec, "knn")):
            absent.append(i)
            continue
        fp = pre.stored_fingerprint(rec, "knn")
        assert fp in k_by_fp, f"record {i}: an array without a known fingerprint"
        got = zarr.open_array(os.path.join(rec, "knn"), mode="r")[:]
        assert np.array_equal(got, brute_knn(torch.from_numpy(p), k_by_fp[fp]).numpy()), i
    return absent


def test_a_leftover_named_with_an_impossible_pid_is_cleaned_not_fatal(tmp_path):
    root = str(tmp_path / "data")
    write_dataset(root)
    rec = os.path.join(root, "rec_000.zarr")
    junk = os.path.join(rec, f".knn.tmp-{fsutil.HOST}-{2**70}-0123abcd")
    os.makedirs(junk)
    res = precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", Counter(), params={"k": K})
    assert res.written == N_RECORDS and not os.path.exists(junk)


@pytest.mark.timeout(120)
def test_killed_mid_write_leaves_complete_arrays_or_none(tmp_path):
    root = str(tmp_path / "data")
    points = write_dataset(root)
    params = {"k": K}
    fp = pre.fingerprint("knn", params)

    _kill_when_frozen(root, str(tmp_path), params, "chunks")
    absent = _check_complete_or_absent(root, points, {fp: K})
    assert absent == [3, 4, 5, 6]  # 0-2 done; 3 died mid-write; its partial array is hidden, not at "knn"
    assert [e for e in leftovers(root, 3) if e.startswith(".knn.tmp-")]
    assert ZarrRecords(root, fields=["points"]).fields == ("points",)  # the leftover is never a field
    with pytest.raises(FileNotFoundError):
        ZarrRecords(root, fields=["knn"])

    fn = Counter()
    res = precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", fn, params=params)
    assert sorted(fn.seen) == absent and res.skipped == 3
    assert _check_complete_or_absent(root, points, {fp: K}) == []
    for i in range(N_RECORDS):  # the dead writer's leftovers were cleaned up
        assert leftovers(root, i) == []

    # Recomputing with new params, killed between moving the old array aside and renaming the new one in.
    new_params = {"k": 2}
    new_fp = pre.fingerprint("knn", new_params)
    _kill_when_frozen(root, str(tmp_path), new_params, "rename")
    absent = _check_complete_or_absent(root, points, {fp: K, new_fp: 2})
    assert absent == [3]
    assert [pre.stored_fingerprint(os.path.join(root, f"rec_{i:03d}.zarr"), "knn") for i in (0, 2, 4, 6)] == \
        [new_fp, new_fp, fp, fp]
    fn = Counter(k=2)
    precompute(ZarrRecords(root, fields=["points", "rid"]), "knn", fn, params=new_params)
    assert sorted(fn.seen) == [3, 4, 5, 6]
    assert _check_complete_or_absent(root, points, {new_fp: 2}) == []


# -- two ranks -------------------------------------------------------------------------------


def _rank_worker(rank: int, world: int, tmp: str, root: str) -> None:
    with gloo_group(rank, world, tmp):
        out: dict = {}
        ds = ZarrRecords(root, fields=["points", "rid"])
        fn = Counter()
        res = precompute(ds, "knn", fn, params={"k": K})
        out["seen"] = fn.seen
        out["first"] = [res.written, res.skipped, res.total_written, res.total_skipped]
        again = Counter()
        res = precompute(ds.for_rank(rank, world), "knn", again, params={"k": K})  # this rank's shard works too
        out["again"] = again.seen
        out["second"] = [res.written, res.skipped, res.total_written, res.total_skipped]

        def boom(sample: dict) -> torch.Tensor:
            if int(sample["rid"][0]) == 1:
                raise ValueError("boom on record 1")
            return sample["points"]

        try:
            precompute(ds, "boom", boom, params=None)
        except Exception as exc:
            out["boom"] = type(exc).__name__
        try:
            precompute(ds, "knn", Counter(), params={"k": K + rank})
        except InvalidArgument as exc:
            out["different"] = str(exc)
        write_result(tmp, rank, out)


@pytest.mark.timeout(120)
def test_two_ranks_write_each_record_exactly_once(tmp_path):
    root = str(tmp_path / "data")
    points = write_dataset(root)
    results = spawn_ranks(_rank_worker, 2, tmp_path, root)
    assert results[0]["seen"] == [0, 2, 4, 6] and results[1]["seen"] == [1, 3, 5]
    assert [r["first"] for r in results] == [[4, 0, 7, 0], [3, 0, 7, 0]]
    assert [r["again"] for r in results] == [[], []]
    assert [r["second"] for r in results] == [[0, 4, 0, 7], [0, 3, 0, 7]]
    assert [r["boom"] for r in results] == ["StokerError", "ValueError"]  # rank 1 reads record 1
    assert all("different name or params" in r["different"] for r in results)
    ds = ZarrRecords(root, fields=["knn"])
    for i, p in enumerate(points):
        assert torch.equal(ds[i]["knn"], brute_knn(torch.from_numpy(p), K))


def _zipped(tmp_path, n: int = 3) -> tuple[str, list[np.ndarray]]:
    root = str(tmp_path / "data")
    points = write_dataset(root, n=n)
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for folder, _, files in os.walk(root):
            for f in files:
                path = os.path.join(folder, f)
                zf.write(path, os.path.relpath(path, root))
    return str(archive), points


def test_a_dataset_in_a_store_gets_its_arrays_in_the_local_cache(tmp_path, monkeypatch):
    """stoker writes nothing into a store: precompute on a dataset in one (here a zip archive) keeps its
    arrays in the dataset's folder of the local cache, where a ZarrRecords of the dataset asking for the field
    finds them; a second run skips every record, and the archive is never touched."""
    from stoker.storage.artifacts import precomputed_dir

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    archive, points = _zipped(tmp_path)
    before = os.stat(archive).st_mtime_ns, os.path.getsize(archive)
    ds = ZarrRecords(archive, fields=["points", "rid"])
    fn = Counter()
    result = precompute(ds, "knn4", fn, params={"k": 4})
    assert (result.written, result.skipped) == (3, 0) and sorted(fn.seen) == [0, 1, 2]
    assert (os.stat(archive).st_mtime_ns, os.path.getsize(archive)) == before
    folder = precomputed_dir(archive)
    assert sorted(os.listdir(folder)) == [f"rec_{i:03d}.zarr" for i in range(3)]
    assert zarr.open_group(str(folder / "rec_001.zarr"), mode="r")["knn4"].shape == (15, 4)  # plain Zarr
    fresh = ZarrRecords(archive, fields=["points", "knn4"])
    assert fresh.fields == ("points", "knn4")
    for i, p in enumerate(points):
        assert torch.equal(fresh[i]["knn4"], brute_knn(torch.from_numpy(p), K))
        assert torch.equal(fresh[i]["points"], torch.from_numpy(p))
    assert "knn4" not in ZarrRecords(archive).fields  # every array of the first record: the store's own
    again = precompute(ds, "knn4", Counter(), params={"k": 4})
    assert (again.written, again.skipped) == (0, 3)
    redo = precompute(ds, "knn4", Counter(), params={"k": 4, "v": 2})  # other params: computed again
    assert redo.written == 3


def test_a_store_dataset_missing_a_record_s_precomputed_array_says_so(tmp_path, monkeypatch):
    import shutil

    from stoker.errors import NotFound
    from stoker.storage.artifacts import precomputed_dir

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    archive, _ = _zipped(tmp_path)
    precompute(ZarrRecords(archive, fields=["points", "rid"]), "knn4", Counter(), params={"k": 4})
    shutil.rmtree(precomputed_dir(archive) / "rec_002.zarr" / "knn4")
    with pytest.raises(NotFound, match="record 'rec_002.zarr' has no precomputed 'knn4'.*run precompute again") as e:
        ZarrRecords(archive, fields=["points", "knn4"])
    assert e.value.field == "knn4"
    with pytest.raises(NotFound, match="record 'rec_000.zarr' has no field 'nope'"):  # never precomputed
        ZarrRecords(archive, fields=["points", "nope"])

def _store_rank_worker(rank: int, world: int, tmp: str, archive: str, shared: bool) -> None:
    os.environ["STOKER_CACHE"] = os.path.join(tmp, "cache" if shared else f"cache_node{rank}")
    with gloo_group(rank, world, tmp):
        out: dict = {}
        ds = ZarrRecords(archive, fields=["points", "rid"])
        fn = Counter()
        res = precompute(ds, "knn", fn, params={"k": K})
        out["seen"] = sorted(fn.seen)
        out["first"] = [res.written, res.total_written]
        res = precompute(ds, "knn", Counter(), params={"k": K})
        out["again"] = [res.written, res.skipped]
        fresh = ZarrRecords(archive, fields=["points", "knn"])
        out["knn"] = [fresh[i]["knn"].tolist() for i in range(len(fresh))]
        write_result(tmp, rank, out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [False, True])
def test_two_ranks_precompute_a_store_dataset_into_their_caches(tmp_path, shared):
    """Two ranks, as on two nodes with node-local caches (or one shared cache): after precompute every rank's
    cache holds every record, so a ZarrRecords asking for the field opens on each; a rerun writes nothing."""
    archive, points = _zipped(tmp_path, n=4)
    results = spawn_ranks(_store_rank_worker, 2, tmp_path, archive, shared)
    want = [brute_knn(torch.from_numpy(p), K).tolist() for p in points]
    assert all(r["knn"] == want for r in results)
    assert all(r["again"] == [0, 2] for r in results)  # (skipped: its share; the rest only looked at)
    if shared:  # the work split: each record computed once
        assert sorted(results[0]["seen"] + results[1]["seen"]) == [0, 1, 2, 3]
        assert results[0]["first"][1] == 4
    else:  # every node computed every record once, its share first
        assert results[0]["seen"] == results[1]["seen"] == [0, 1, 2, 3]
        assert results[0]["first"] == [4, 8]


# -- the k-d tree method: the same table as the brute force ----------------------------------------


def _tree_spy(monkeypatch):
    """Counts the real scipy cKDTree constructions knn_graph makes."""
    spatial = pytest.importorskip("scipy.spatial")
    built = []
    real = spatial.cKDTree

    def spy(*args, **kwargs):
        built.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(spatial, "cKDTree", spy)
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_knn_tree_and_brute_force_give_the_same_table(dtype, monkeypatch):
    built = _tree_spy(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    if dtype == torch.int32:  # small integers: a lattice full of equal distances and duplicate points
        pts = torch.randint(0, 9, (3000, 3), generator=gen, dtype=dtype)
    else:
        pts = torch.randn(3000, 3, generator=gen, dtype=dtype)
        pts[1000:1100] = pts[:100]  # duplicates
    for k in (1, 6, 16):
        want = knn_graph(pts, k, method="brute")
        assert torch.equal(knn_graph(pts, k, method="tree"), want), k
        if dtype != torch.int32:
            assert torch.equal(want, brute_knn(pts, k)), k
    assert len(built) == 3


def test_knn_tree_breaks_ties_among_more_duplicates_than_it_asks_for():
    # 40 copies of one point at scattered indices: the tree returns only k + 9 candidates at distance 0, so which
    # of the copies are the nearest (the lowest indices) is not decided by them; each copy's row must still be
    # the lowest-index copies, as the full distance matrix has it
    gen = torch.Generator().manual_seed(5)
    pts = torch.randn(3000, 3, generator=gen, dtype=torch.float64)
    copies = torch.randperm(3000, generator=gen)[:40]
    pts[copies] = pts[copies[0]].clone()
    for k in (1, 4, 16):
        got = knn_graph(pts, k, method="tree")
        assert torch.equal(got, brute_knn(pts, k)), k
        assert torch.equal(got, knn_graph(pts, k, method="brute")), k


def test_knn_auto_takes_the_tree_for_large_cpu_clouds_only(monkeypatch):
    from stoker.records import TREE_MIN_POINTS

    built = _tree_spy(monkeypatch)
    small = torch.randn(TREE_MIN_POINTS - 1, 3)
    knn_graph(small, 4)
    assert built == []
    big = torch.randn(TREE_MIN_POINTS, 2)
    assert torch.equal(knn_graph(big, 4), knn_graph(big, 4, method="brute"))
    assert built == [(TREE_MIN_POINTS, 2)]
    knn_graph(torch.randn(TREE_MIN_POINTS, 12), 4)  # many dims: the brute force
    assert len(built) == 1


def test_knn_without_scipy_falls_back_to_the_brute_force(monkeypatch):
    import sys

    from stoker.records import TREE_MIN_POINTS

    pts = torch.randn(TREE_MIN_POINTS, 3)
    want = knn_graph(pts, 3, method="brute")
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.spatial", None)
    assert torch.equal(knn_graph(pts, 3), want)
    with pytest.raises(InvalidArgument, match=r"stoker\[knn\]"):
        knn_graph(pts, 3, method="tree")
    with pytest.raises(InvalidArgument, match="method"):
        knn_graph(pts, 3, method="kd")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_knn_on_a_gpu_is_the_brute_force_and_matches_the_tree():
    pts = torch.randn(20_000, 3, dtype=torch.float64)
    got = knn_graph(pts.cuda(), 8)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), knn_graph(pts, 8, method="tree"))
