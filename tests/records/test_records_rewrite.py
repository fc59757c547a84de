"""Records rewritten in place with the same shapes (new values, same metadata but the files): the sample cache,
the preloaded samples, the statistics' sidecar and precomputed arrays must come back with the new values.
Records written and rewritten by zarr-python; node-local copies (other inodes and times) in a real 2-rank
gloo group."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import zarr

from stoker.records import ZarrRecords, compute_stats, precompute
from stoker.records import sidecar
from stoker.records.precomputed import stored_inputs
from test_records import SPEC, write_dataset  # tests/ is on sys.path

from gloo_ranks import gloo_group, spawn_ranks, write_result


def rewrite(root: str, record: int, name: str, value: np.ndarray, in_place: bool) -> None:
    """New values at the same shape and dtype: the array made again (``overwrite``: a new metadata document and
    chunk files), or assigned into the existing one (chunk files only; the metadata document is untouched)."""
    path = os.path.join(root, f"rec_{record:03d}.zarr")
    if in_place:
        zarr.open_array(os.path.join(path, name), mode="r+")[...] = value
        return
    g = zarr.open_group(path, mode="r+")
    old = g[name]
    g.create_array(name, data=value, chunks=old.chunks, overwrite=True)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_sample_cache_serves_values_rewritten_at_the_same_shape(tmp_path, in_place):
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=3)
    ds = ZarrRecords(root, fields=SPEC, cache_bytes=1 << 24)
    np.testing.assert_array_equal(ds[1]["positions"].numpy(), truth[1]["positions"])
    ds[1]
    assert ds.cache_info().hits == 1  # cached: the second read is a hit
    new = np.full_like(truth[1]["positions"], 9.0)
    rewrite(root, 1, "positions", new, in_place)
    np.testing.assert_array_equal(ds[1]["positions"].numpy(), new)  # not the cached old values
    np.testing.assert_array_equal(ds[1]["velocity"].numpy(), truth[1]["velocity"])
    info = ds.cache_info()
    assert (info.hits, info.misses) == (2, 2)  # the stale entry counted as a miss, the fresh one then hit
    assert info.entries == 1
    np.testing.assert_array_equal(ds.read(1, ["positions"])["positions"].numpy(), new)


@pytest.mark.parametrize("fmt", [2, 3])
def test_the_sample_cache_sees_chunks_written_where_there_were_none(tmp_path, fmt):
    # An array made of its fill value alone stores no chunk file; values written later add files (and folders
    # for v3's c/... keys): no listed file changed, the folders' times say something was added.
    root = str(tmp_path / "d")
    for i in range(2):
        g = zarr.open_group(os.path.join(root, f"rec_{i:03d}.zarr"), mode="w", zarr_format=fmt)
        g.create_array("grid", shape=(8, 4), chunks=(2, 2), dtype="f4", fill_value=0)
    ds = ZarrRecords(root, fields=["grid"], cache_bytes=1 << 20)
    assert float(ds[1]["grid"].abs().sum()) == 0 and float(ds[1]["grid"].abs().sum()) == 0
    new = np.arange(32, dtype="f4").reshape(8, 4)
    zarr.open_array(os.path.join(root, "rec_001.zarr", "grid"), mode="r+")[4:6, 2:4] = new[4:6, 2:4]
    want = np.zeros((8, 4), "f4")
    want[4:6, 2:4] = new[4:6, 2:4]
    np.testing.assert_array_equal(ds[1]["grid"].numpy(), want)
    os.remove(os.path.join(root, "rec_001.zarr", "grid", *(("2.1",) if fmt == 2 else ("c", "2", "1"))))
    np.testing.assert_array_equal(ds[1]["grid"].numpy(), np.zeros((8, 4), "f4"))  # a chunk deleted: fill again


def test_preloaded_samples_are_read_again_once_rewritten(tmp_path):
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=3)
    ds = ZarrRecords(root, fields=SPEC, lazy=False)
    part = ds.for_rank(1, 2)  # record 1, from the same preloaded samples
    new = np.full_like(truth[1]["cells"], 1)
    rewrite(root, 1, "cells", new, in_place=True)
    np.testing.assert_array_equal(ds[1]["cells"].numpy(), new)
    np.testing.assert_array_equal(part[0]["cells"].numpy(), new)  # the view checks on its own
    np.testing.assert_array_equal(ds[0]["cells"].numpy(), truth[0]["cells"])


@pytest.mark.parametrize("in_place", [False, True])
def test_statistics_are_computed_again_after_a_same_shape_rewrite(tmp_path, in_place):
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=4)
    ds = ZarrRecords(root, fields=SPEC)
    before = compute_stats(ds, ["positions"])["positions"]
    new = truth[2]["positions"] * 3 + 100
    rewrite(root, 2, "positions", new, in_place)
    got = compute_stats(ZarrRecords(root, fields=SPEC), ["positions"])["positions"]
    values = np.concatenate([(new if i == 2 else t["positions"]).reshape(-1, 3) for i, t in enumerate(truth)])
    np.testing.assert_allclose(got.mean.numpy(), values.astype("f8").mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(got.max.numpy(), values.max(axis=0))
    assert not torch.equal(got.mean, before.mean)
    # a field the statistics do not cover changes nothing: the entry is used as it is
    mtime = os.stat(sidecar.path_for(root)).st_mtime_ns
    rewrite(root, 2, "velocity", truth[2]["velocity"] + 1, in_place)
    again = compute_stats(ZarrRecords(root, fields=SPEC), ["positions"])["positions"]
    assert torch.equal(again.mean, got.mean) and os.stat(sidecar.path_for(root)).st_mtime_ns == mtime


@pytest.mark.parametrize("in_place", [False, True])
def test_precomputed_arrays_are_computed_again_after_a_same_shape_rewrite(tmp_path, in_place):
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=3)

    def total(s):
        return s["positions"].sum(dim=(0, 1)).double()

    def run():
        return precompute(ZarrRecords(root, fields=["positions", "cells"]), "total", total, {"v": 1})

    assert run().written == 3
    assert run().written == 0  # nothing changed: every record skipped
    new = truth[1]["positions"] + 1
    rewrite(root, 1, "positions", new, in_place)
    res = run()
    assert (res.written, res.skipped) == (1, 2)  # the rewritten record alone
    got = ZarrRecords(root, fields=["total"])[1]["total"].numpy()
    np.testing.assert_allclose(got, new.astype("f8").sum(axis=(0, 1)), rtol=1e-6)
    assert run().written == 0


# -- node-local copies ------------------------------------------------------------------------------------------


def test_a_copy_that_keeps_times_keeps_its_caches_one_that_does_not_recomputes(tmp_path):
    root = str(tmp_path / "d")
    write_dataset(root, n=3)
    stats = compute_stats(ZarrRecords(root, fields=SPEC), ["positions"])
    precompute(ZarrRecords(root, fields=["positions"]), "total", lambda s: s["positions"].sum(), {"v": 1})
    kept = str(tmp_path / "kept")
    shutil.copytree(root, kept)  # copy2: times kept, inodes new (as rsync -a to a node's disk)
    ino = os.stat(sidecar.path_for(kept)).st_ino
    assert torch.equal(compute_stats(ZarrRecords(kept, fields=SPEC), ["positions"])["positions"].mean,
                       stats["positions"].mean)
    assert os.stat(sidecar.path_for(kept)).st_ino == ino  # the entry was used, not written again
    assert precompute(ZarrRecords(kept, fields=["positions"]), "total", lambda s: s["positions"].sum(),
                      {"v": 1}).written == 0
    fresh = str(tmp_path / "fresh")
    shutil.copytree(root, fresh, copy_function=shutil.copy)  # times not kept: other files, as far as is known
    assert precompute(ZarrRecords(fresh, fields=["positions"]), "total", lambda s: s["positions"].sum(),
                      {"v": 1}).written == 3
    assert stored_inputs(os.path.join(fresh, "rec_000.zarr"), "total")["positions"][2] is not None


def _copies_worker(rank: int, world: int, tmp: str, roots: list) -> None:
    with gloo_group(rank, world, tmp, 30):
        ds = ZarrRecords(roots[rank], fields=SPEC)  # each rank its own node's copy
        out = {}
        try:
            out["mean"] = compute_stats(ds, ["positions", "velocity"])["positions"].mean.tolist()
        except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
            out["raised"] = f"{type(exc).__name__}: {exc}"
        write_result(tmp, rank, out)


@pytest.mark.timeout(120)
def test_node_local_copies_pass_the_cross_rank_check(tmp_path):
    root = str(tmp_path / "node0")
    truth = write_dataset(root, n=5)
    copy = str(tmp_path / "node1")
    shutil.copytree(root, copy, copy_function=shutil.copy)  # other inodes and modification times
    a, b = (os.stat(os.path.join(r, "rec_000.zarr", "positions", "zarr.json")) for r in (root, copy))
    assert (a.st_ino, a.st_mtime_ns) != (b.st_ino, b.st_mtime_ns)
    results = spawn_ranks(_copies_worker, 2, tmp_path, [root, copy])
    assert "raised" not in results[0] and "raised" not in results[1], results
    values = np.concatenate([t["positions"].reshape(-1, 3) for t in truth]).astype("f8")
    np.testing.assert_allclose(results[0]["mean"], values.mean(axis=0), rtol=1e-12)
    assert results[1]["mean"] == results[0]["mean"]


def test_an_entry_read_while_its_folder_was_missing_is_checked_again(tmp_path):
    # A writer's overwrite=True removes the array's folder and writes it again: an identity taken in between
    # is empty. What was read after it must not be served as unchanged through later rewrites.
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=2)
    ds = ZarrRecords(root, fields=SPEC, cache_bytes=1 << 24)
    field = os.path.join(root, "rec_000.zarr", "positions")
    shutil.move(field, field + ".away")
    read = ds._read

    def read_once_the_writer_is_done(b, names):
        shutil.move(field + ".away", field)
        return read(b, names)

    ds._read = read_once_the_writer_is_done
    np.testing.assert_array_equal(ds[0]["positions"].numpy(), truth[0]["positions"])
    ds._read = read
    new = np.full_like(truth[0]["positions"], 7.0)
    rewrite(root, 0, "positions", new, in_place=False)
    np.testing.assert_array_equal(ds[0]["positions"].numpy(), new)


def _zip_dataset(path: str, value: float) -> None:
    """Two records in a zip archive written aside and renamed over ``path`` (a new archive, same shapes)."""
    tmp = path + ".new"
    store = zarr.storage.ZipStore(tmp, mode="w")
    g = zarr.open_group(store, mode="w")
    for i in range(2):
        g.create_group(f"rec_{i}").create_array("x", data=np.full((4, 3), value + i, "f4"))
    store.close()
    os.replace(tmp, path)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_replaced_zip_archive_is_read_again_through_a_new_store(tmp_path, lazy):
    # The change is seen by the archive's file; the read after it must go through the archive there now, not
    # the store opened on the old one (which would pair old values with the new identity: stale for ever).
    z = str(tmp_path / "ds.zip")
    _zip_dataset(z, 1.0)
    ds = ZarrRecords(z, fields=["x"], cache_bytes=1 << 20, lazy=lazy)
    assert ds[0]["x"][0, 0].item() == 1.0
    _zip_dataset(z, 10.0)
    assert ds[0]["x"][0, 0].item() == 10.0
    assert ds[1]["x"][0, 0].item() == 11.0  # a first read after the change, too
    assert ds[0]["x"][0, 0].item() == 10.0
    _zip_dataset(z, 20.0)  # again: the store opened on the second archive is dropped too (preloaded: not the first)
    assert ds[0]["x"][0, 0].item() == 20.0
    assert ds[0]["x"][0, 0].item() == 20.0


@pytest.mark.parametrize("lazy", [True, False])
def test_a_zip_archive_replaced_between_the_identity_and_the_read_is_read_again(tmp_path, lazy):
    # A writer replaces the archive right after the stale stores are dropped, before the read: the read goes
    # through the store still open on the old archive, so the identity must be the old archive's (taken before
    # the drop), which the next check sees changed; the new one's would serve the old values for ever.
    z = str(tmp_path / "ds.zip")
    _zip_dataset(z, 1.0)
    ds = ZarrRecords(z, fields=["x"], cache_bytes=1 << 20, lazy=lazy)
    if lazy:
        assert ds[0]["x"][0, 0].item() == 1.0  # opens the archive's store; record 1 is a first read below
        i = 1
    else:  # preloaded: record 1 read again through a store on the archive there now; record 0 is seen changed
        _zip_dataset(z, 5.0)
        assert ds[1]["x"][0, 0].item() == 6.0
        i = 0
    forget = ds._forget_changed_archives

    def forget_then_the_archive_is_replaced() -> None:
        forget()
        _zip_dataset(z, 10.0)
        ds._forget_changed_archives = forget  # type: ignore[method-assign]

    ds._forget_changed_archives = forget_then_the_archive_is_replaced  # type: ignore[method-assign]
    ds[i]
    assert ds._forget_changed_archives is forget  # the replacement happened
    assert [ds[i]["x"][0, 0].item() for _ in range(2)] == [10.0 + i] * 2


def test_preloaded_samples_are_still_served_once_their_files_are_removed(tmp_path):
    # lazy=False holds every sample: removing the files must not turn each access into NotFound. Written again,
    # the record is read again.
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=2)
    ds = ZarrRecords(root, fields=SPEC, lazy=False)
    shutil.rmtree(root)
    for _ in range(2):
        np.testing.assert_array_equal(ds[0]["positions"].numpy(), truth[0]["positions"])
    again = write_dataset(root, n=2, seed=5)
    np.testing.assert_array_equal(ds[0]["positions"].numpy(), again[0]["positions"])


def test_an_entry_that_cannot_be_stated_is_read_again_not_raised(tmp_path):
    # A symlink loop in an array's folder (as EACCES would): the read ignores it; the identity must too, as an
    # entry whose state is unknown (read again each time), never a raw OSError.
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=2)
    os.symlink("loop", os.path.join(root, "rec_000.zarr", "positions", "loop"))
    ds = ZarrRecords(root, fields=SPEC, cache_bytes=1 << 24)
    np.testing.assert_array_equal(ds[0]["positions"].numpy(), truth[0]["positions"])
    new = np.full_like(truth[0]["positions"], 3.0)
    rewrite(root, 0, "positions", new, in_place=True)
    np.testing.assert_array_equal(ds[0]["positions"].numpy(), new)
    assert ds.files_digest(0, ["positions"]) != ds.files_digest(0, ["positions"])  # unknown: equal to none


def test_a_precompute_over_a_folder_that_cannot_be_listed_is_computed_again(tmp_path):
    # An entry of unknown state (a symlink loop, as EACCES): its field's digest was the same at every run, so
    # an array computed from it was kept whatever was written below it since. It is computed again each run.
    root = str(tmp_path / "d")
    write_dataset(root, n=2)
    os.symlink("loop", os.path.join(root, "rec_000.zarr", "positions", "loop"))
    ds = ZarrRecords(root, fields=["positions"])
    runs = [precompute(ds, "total", lambda s: s["positions"].sum(0), {"v": 1}).written for _ in range(3)]
    assert runs == [2, 1, 1]


def test_the_cache_bound_counts_the_identities_it_keeps(tmp_path):
    # A record of many small chunk files keeps an identity far larger than its values: cache_bytes bounds both.
    root = str(tmp_path / "d")
    g = zarr.open_group(os.path.join(root, "rec_000.zarr"), mode="w")
    g.create_array("x", data=np.arange(256, dtype="f4"), chunks=(1,))
    ds = ZarrRecords(root, fields=["x"], cache_bytes=1 << 20)
    ds[0]
    files = sum(len(names) + 1 for _, _, names in os.walk(os.path.join(root, "rec_000.zarr", "x")))
    assert files > 256
    assert ds.cache_info().nbytes >= 256 * 4 + 100 * files
    small = ZarrRecords(root, fields=["x"], cache_bytes=256 * 4 * 2)  # room for the values, not the identity
    small[0]
    assert small.cache_info().entries == 0


def test_chained_precomputes_settle_after_a_rewrite(tmp_path):
    # "a" from "pos", "b" from "a", each on a dataset holding every other array: a rewrite of "pos" recomputes
    # both, then the chain settles (not recomputed at every run for ever); "a" computed anew (other params)
    # recomputes "b".
    root = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    for i in range(2):
        zarr.open_group(os.path.join(root, f"rec_{i}.zarr"), mode="w").create_array(
            "pos", data=rng.random((5, 3), dtype="f4"))

    def run(va: int = 1) -> tuple[int, int]:
        def others(name):
            return [f for f in ZarrRecords(root).fields if f != name]
        ra = precompute(ZarrRecords(root, fields=others("a")), "a", lambda s: s["pos"].sum(0) * va, {"v": va})
        rb = precompute(ZarrRecords(root, fields=others("b")), "b", lambda s: s["a"] * 2, {"v": 1})
        return ra.written, rb.written

    assert run() == (2, 2)
    assert run() == (0, 0)
    g = zarr.open_group(os.path.join(root, "rec_1.zarr"), mode="r+")
    g.create_array("pos", data=rng.random((5, 3), dtype="f4"), overwrite=True)
    runs = [run() for _ in range(5)]
    assert runs[0] == (1, 1) and runs[-2:] == [(0, 0), (0, 0)]
    assert run(va=3) == (2, 2)
    b = ZarrRecords(root, fields=["pos", "b"])[1]
    np.testing.assert_allclose(b["b"].numpy(), b["pos"].sum(0).numpy() * 6, rtol=1e-6)


def test_a_rewrite_reaches_the_end_of_a_chain_of_precomputes(tmp_path):
    # c = f(pos), a = g(c), b = h(a), each on a dataset of its input only: a rewrite of "pos" recomputes all
    # three (b's input "a" is digested with the digests it was computed from, which changed with "c").
    root = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    for i in range(2):
        zarr.open_group(os.path.join(root, f"rec_{i}.zarr"), mode="w").create_array(
            "pos", data=rng.random((5, 3), dtype="f4"))

    def run() -> tuple[int, int, int]:
        rc = precompute(ZarrRecords(root, fields=["pos"]), "c", lambda s: s["pos"] * 2, {"v": 1})
        ra = precompute(ZarrRecords(root, fields=["c"]), "a", lambda s: s["c"] + 1, {"v": 1})
        rb = precompute(ZarrRecords(root, fields=["a"]), "b", lambda s: s["a"] * 10, {"v": 1})
        return rc.written, ra.written, rb.written

    assert run() == (2, 2, 2)
    assert run() == (0, 0, 0)
    g = zarr.open_group(os.path.join(root, "rec_1.zarr"), mode="r+")
    g.create_array("pos", data=np.full((5, 3), 100.0, "f4"), overwrite=True)
    assert run() == (1, 1, 1)
    assert run() == (0, 0, 0)
    r = ZarrRecords(root, fields=["b"])[1]
    np.testing.assert_array_equal(r["b"].numpy(), np.full((5, 3), 2010.0, "f4"))


def test_new_params_mid_chain_reach_its_end_when_the_first_sees_every_array(tmp_path):
    # c over every field but c (pos, and a and b once they exist), a = g(c), b = h(a): new params of c
    # recompute a and then b. b's input a was digested without c, because c's stored inputs name b (it was
    # merely computed over a dataset holding b), so c's change never reached b: b kept values of the old c.
    root = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    for i in range(2):
        zarr.open_group(os.path.join(root, f"rec_{i}.zarr"), mode="w").create_array(
            "pos", data=rng.random((5, 3), dtype="f4"))

    def run(vc: int = 1) -> tuple[int, int, int]:
        others = [f for f in ZarrRecords(root).fields if f != "c"]
        rc = precompute(ZarrRecords(root, fields=others), "c", lambda s: s["pos"] * 2 * vc, {"v": vc})
        ra = precompute(ZarrRecords(root, fields=["c"]), "a", lambda s: s["c"] + 1, {"v": 1})
        rb = precompute(ZarrRecords(root, fields=["a"]), "b", lambda s: s["a"] * 10, {"v": 1})
        return rc.written, ra.written, rb.written

    assert run() == (2, 2, 2)
    assert run() == (0, 0, 0)
    assert run(vc=3) == (2, 2, 2) and run(vc=3) == (0, 0, 0)
    assert run(vc=5) == (2, 2, 2) and run(vc=5) == (0, 0, 0)  # c's stored inputs name a and b by now
    for i in range(2):
        r = ZarrRecords(root, fields=["pos", "b"])[i]
        np.testing.assert_allclose(r["b"].numpy(), (r["pos"].numpy() * 10 + 1) * 10, rtol=1e-6)


def test_what_a_precompute_sees_of_a_long_chain_reads_each_array_once(tmp_path, monkeypatch):
    # p0..p11, each computed over every field before it: a walk per path through them read 2**12 attribute
    # files for one record (23 s at twelve arrays); one visited set reads each array's once
    from stoker.records import precomputed

    root = str(tmp_path / "d")
    zarr.open_group(os.path.join(root, "rec_0.zarr"), mode="w").create_array(
        "pos", data=np.arange(6, dtype="f4").reshape(2, 3))
    n = 12
    for k in range(n):
        precompute(ZarrRecords(root), f"p{k}", lambda s, k=k: s["pos"] + k, {"k": k})
    reads: list[str] = []
    attributes = precomputed._attributes
    monkeypatch.setattr(precomputed, "_attributes", lambda path: reads.append(path) or attributes(path))
    inputs = precomputed.record_inputs(ZarrRecords(root), 0, "new")
    assert sorted(inputs) == sorted(["pos"] + [f"p{k}" for k in range(n)])
    assert len(reads) <= n + 1, len(reads)
    # and a change of the first reaches what the last is seen as
    before = inputs["p11"]
    precompute(ZarrRecords(root, fields=["pos"]), "p0", lambda s: s["pos"] + 100, {"k": 100})
    assert precomputed.record_inputs(ZarrRecords(root), 0, "new")["p11"] != before
