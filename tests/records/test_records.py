"""stoker.records: lazy Zarr record datasets and their normalisation statistics.

Real data (written by zarr-python, v2 and v3, plain and sharded) in temporary
directories; real gloo process groups of 1, 2 and 3 ranks (spawned once each);
a real DataLoader with spawned workers. Two witnesses watch the file system:
the store's own counters and a ``sys.addaudithook`` hook.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import resource
import shutil
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr

from stoker.errors import InvalidArgument, NotFound, OutOfBounds, RankMismatch
from stoker.records import FieldStats, Moments, ZarrRecords, compute_stats, denormalize, normalize
from stoker.records import sidecar
from stoker.records.identity import identity_nbytes, record_identity
from stoker.storage import LocalStore

from gloo_ranks import gloo_group, spawn_ranks, write_result

METADATA_NAMES = {"zarr.json", ".zarray", ".zgroup", ".zattrs"}
SPEC = {"positions": ("T", "N", 3), "velocity": ("T", "N", 3), "cells": ("M", 3)}
T_STEPS = 6
N_RECORDS = 7

# -- the audit hook: installed once per process (hooks cannot be removed), recording only while
# asked to, on the recording thread only (other tests' stray threads must not pollute it).

_HOOK = {"installed": False, "on": False, "thread": None}
_EVENTS: list[tuple[str, str, object]] = []
_EVENTS_LOCK = threading.Lock()


def _audit(event: str, args: tuple) -> None:
    if not _HOOK["on"] or event not in ("open", "os.rename") or threading.get_ident() != _HOOK["thread"]:
        return
    target = args[0]
    target = os.fsdecode(target) if isinstance(target, (str, bytes, os.PathLike)) else repr(target)
    with _EVENTS_LOCK:
        _EVENTS.append((event, target, args[1:]))


class recording:
    """Collect ``(event, path, rest)`` of every open/rename inside a ``with`` block."""

    def __enter__(self) -> list:
        if not _HOOK["installed"]:
            sys.addaudithook(_audit)
            _HOOK["installed"] = True
        with _EVENTS_LOCK:
            _EVENTS.clear()
        self.events: list = []
        _HOOK["thread"] = threading.get_ident()
        _HOOK["on"] = True
        return self.events

    def __exit__(self, *exc) -> None:
        _HOOK["on"] = False
        with _EVENTS_LOCK:
            self.events.extend(_EVENTS)
            _EVENTS.clear()


def opened_under(events: list, root: str) -> list[str]:
    root = os.path.realpath(root)
    return [os.path.realpath(p) for e, p, _ in events if e == "open" and os.path.realpath(p).startswith(root + os.sep)]


def is_chunk(path: str) -> bool:
    return os.path.basename(path) not in METADATA_NAMES


def stats_writes(events: list) -> int:
    """Opens for writing and renames that touch the statistics sidecar (its writers' claims aside)."""
    n = 0
    for e, p, rest in events:
        name = os.path.basename(p)
        if name.endswith(".claim"):
            continue
        if e == "os.rename" and os.path.basename(os.fsdecode(rest[0])) == sidecar.FILENAME:
            n += 1
        elif e == "open" and sidecar.FILENAME in name:
            mode, flags = rest[0], rest[1]
            if (mode and any(c in mode for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                n += 1
    return n


# -- data --------------------------------------------------------------------------------------


def record_arrays(i: int, seed: int = 0, t: int = T_STEPS) -> dict[str, np.ndarray]:
    """Record ``i``: N differs per record and so does the offset, so record weights matter."""
    rng = np.random.default_rng(seed * 1000 + i)
    n = 3 + 5 * i
    m = 2 + i % 3
    return {
        "positions": (rng.normal(size=(t, n, 3)) * (1 + i) + 10.0 * i).astype("f4"),
        "velocity": rng.normal(size=(t, n, 3)).astype("f4"),
        "cells": rng.integers(0, n, size=(m, 3)).astype("i4"),
    }


def write_record(path: str, arrays: dict[str, np.ndarray], fmt: int, sharded: bool = False) -> None:
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    for name, a in arrays.items():
        chunks = tuple(max(1, (s + 1) // 2) for s in a.shape)  # several chunk files per array
        kw = {}
        if sharded and fmt == 3 and name == "velocity":
            kw["shards"] = tuple(2 * c for c in chunks)
        g.create_array(name, data=a, chunks=chunks, **kw)


def write_dataset(root: str, n: int = N_RECORDS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` records under ``root``: v2 and v3 alternating, some v3 ones sharded."""
    truth = []
    for i in range(n):
        arrays = record_arrays(i, seed)
        write_record(os.path.join(root, f"rec_{i:03d}.zarr"), arrays, fmt=2 if i % 2 else 3, sharded=i % 4 == 0)
        truth.append(arrays)
    return truth


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("records"))
    return root, write_dataset(root)


def assert_sample_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        w = torch.as_tensor(np.ascontiguousarray(want[name]))
        assert got[name].dtype == w.dtype, name
        assert torch.equal(got[name], w), name


# -- construction reads metadata only ---------------------------------------------------------------


def test_construction_reads_metadata_only_and_reading_opens_chunks(data):
    root, truth = data
    store = LocalStore()
    with recording() as events:
        ds = ZarrRecords(root, fields=SPEC, store=store)
    opened = opened_under(events, root)
    assert opened, "the hook saw no metadata reads: it is not watching"
    assert [p for p in opened if is_chunk(p)] == []
    # Second witness: the store read no more bytes than all metadata documents under root hold.
    meta_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                     if f in METADATA_NAMES)
    assert 0 < store.counters.bytes_read <= meta_bytes
    assert len(ds) == N_RECORDS and ds.fields == tuple(SPEC)

    # Shard views and metadata read nothing at all.
    with recording() as events:
        part = ds.for_rank(1, 3)
        infos = [ds.metadata(i) for i in range(len(ds))]
    assert opened_under(events, root) == []
    assert infos[2].fields["positions"].shape == truth[2]["positions"].shape
    assert infos[2].fields["cells"].dtype == np.dtype("i4")

    # Reading opens chunk files, of that record only: the witnesses can fail.
    before = store.counters.files_opened
    with recording() as events:
        sample = ds[0]
    chunks = [p for p in opened_under(events, root) if is_chunk(p)]
    assert chunks and all(f"{os.sep}rec_000.zarr{os.sep}" in p for p in chunks)
    assert store.counters.files_opened > before
    assert_sample_equal(sample, truth[0])

    with recording() as events:
        part[1]  # record 4 (records 1, 4 are this part)
    chunks = [p for p in opened_under(events, root) if is_chunk(p)]
    assert chunks and all(f"{os.sep}rec_004.zarr{os.sep}" in p for p in chunks)


def test_lazy_equals_eager_and_truth(data):
    root, truth = data
    lazy = ZarrRecords(root, fields=SPEC)
    eager = ZarrRecords(root, fields=SPEC, lazy=False)
    assert len(lazy) == len(eager) == len(truth)
    for i in range(len(truth)):
        assert_sample_equal(lazy[i], truth[i])
        assert_sample_equal(eager[i], truth[i])
    assert_sample_equal(lazy[-1], truth[-1])
    # Eager samples are copies: changing one does not change the dataset.
    eager[0]["positions"].zero_()
    assert_sample_equal(eager[0], truth[0])
    with pytest.raises(OutOfBounds):
        lazy[len(truth)]
    with pytest.raises(InvalidArgument):
        lazy["0"]
    assert [s["cells"].shape for s in lazy] == [t["cells"].shape for t in truth]  # iteration stops


def test_time_slice_and_field_subsets(data):
    root, truth = data
    ds = ZarrRecords(root, fields=SPEC, time_slice=2)
    for i in (0, 3):
        s = ds[i]
        assert torch.equal(s["positions"], torch.from_numpy(truth[i]["positions"][:2]))
        assert torch.equal(s["velocity"], torch.from_numpy(truth[i]["velocity"][:2]))
        assert torch.equal(s["cells"], torch.from_numpy(truth[i]["cells"]))  # no "T": untouched
        assert ds.metadata(i).fields["positions"].shape == (2,) + truth[i]["positions"].shape[1:]
        assert ds.metadata(i).fields["positions"].stored_shape == truth[i]["positions"].shape

    # Without a spec the time axis is axis 0; a slice longer than the data keeps it all (with a warning).
    sub = ZarrRecords(root, fields=["velocity"], time_slice=4)
    assert list(sub[1]) == ["velocity"]
    assert torch.equal(sub[1]["velocity"], torch.from_numpy(truth[1]["velocity"][:4]))
    with pytest.warns(RuntimeWarning, match="time_slice=100"):
        long = ZarrRecords(root, fields=["positions"], time_slice=100)
    assert torch.equal(long[1]["positions"], torch.from_numpy(truth[1]["positions"]))

    # fields=None: every array of the first record, in name order.
    every = ZarrRecords(root)
    assert every.fields == ("cells", "positions", "velocity")
    assert_sample_equal(every.read(2, ["positions", "cells"]), {k: truth[2][k] for k in ("positions", "cells")})
    with pytest.raises(InvalidArgument, match="unknown fields"):
        every.read(0, ["nope"])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument, match="time_slice"):
            ZarrRecords(root, time_slice=bad)


def test_a_time_slice_longer_than_a_record_warns_naming_the_records_it_clips(tmp_path):
    """time_slice=k keeps the first k steps, Python's slicing: a record with fewer keeps all of its own, so
    batches hold fewer steps than asked. That was silent; now one RuntimeWarning at construction names the
    records (and their lengths) that keep fewer than k, and none when every record has k."""
    root = str(tmp_path / "t")
    lengths = [8, 4, 8, 5]
    for i, t in enumerate(lengths):
        write_record(os.path.join(root, f"rec_{i}.zarr"), record_arrays(i, seed=2, t=t), fmt=3)
    with pytest.warns(RuntimeWarning, match=r"time_slice=6\): field 'positions': 2 of 4 records .*"
                                            r"'rec_1\.zarr' \(T=4\), 'rec_3\.zarr' \(T=5\)") as seen:
        ds = ZarrRecords(root, fields=SPEC, time_slice=6)
    assert len([w for w in seen if "time_slice" in str(w.message)]) == 1
    assert [ds[i]["positions"].shape[0] for i in range(4)] == [6, 4, 6, 5]  # clipped, as documented
    assert ds.for_rank(1, 2)[0]["velocity"].shape[0] == 4  # rank 1 of 2: records 1 and 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZarrRecords(root, fields=SPEC, time_slice=4)  # every record has 4 steps: nothing to say
        ZarrRecords(root, fields={"cells": ("M", 3)}, time_slice=100)  # no time axis among the fields
    with pytest.warns(RuntimeWarning, match="'rec_1.zarr' \\(T=4\\)"):  # fields without dims: axis 0
        ZarrRecords(root, fields=["positions"], time_slice=6)


def test_the_time_slice_warning_judges_each_field_alone(tmp_path):
    """Fields given without dims are sliced along axis 0, so a per-record field (label, shape (1,)) has one
    "step". The warning took each record's minimum over all fields: with points (20, 3) and label (1,) and
    time_slice=8 it said every record held 1 step and advised time_slice=1 (cutting points to 1 step), though
    ds[i] gave points (8, 3) as asked, and under -W error the dataset could not be built. Each field is judged
    alone: one that reaches time_slice in some record but not in others is named with those records; one that
    reaches it in none while another field does (a label) is no time series, and comes out whole, unwarned."""
    root = str(tmp_path / "pl")
    truth = []
    for i, t in enumerate([20, 20, 5]):
        g = zarr.open_group(os.path.join(root, f"rec{i}.zarr"), mode="w")
        g.create_array("points", data=np.arange(t * 3, dtype="f4").reshape(t, 3) + i)
        g.create_array("label", data=np.array([i]))
        truth.append({"points": g["points"][:], "label": g["label"][:]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fields in (None, ["points", "label"]):
            ds = ZarrRecords(root, fields=fields, time_slice=5)  # points has 5 steps everywhere
            for i in range(3):
                assert torch.equal(ds[i]["points"], torch.from_numpy(truth[i]["points"][:5]))
                assert torch.equal(ds[i]["label"], torch.from_numpy(truth[i]["label"]))
    with pytest.warns(RuntimeWarning, match=r"time_slice=8\): field 'points': 1 of 3 records .*'rec2\.zarr' "
                                            r"\(T=5\)") as seen:
        ds = ZarrRecords(root, time_slice=8)
    [message] = [str(w.message) for w in seen if "time_slice" in str(w.message)]
    assert "label" not in message and "time_slice=1" not in message
    assert [tuple(ds[i]["points"].shape) for i in range(3)] == [(8, 3), (8, 3), (5, 3)]
    assert tuple(ds[0]["label"].shape) == (1,)
    with pytest.warns(RuntimeWarning, match=r"field 'points': 3 of 3 records"):  # longer than every record
        ZarrRecords(root, fields=["points"], time_slice=100)


def test_group_of_groups_root(tmp_path):
    root = zarr.open_group(str(tmp_path / "all.zarr"), mode="w", zarr_format=3)
    truth = []
    for i in range(3):
        arrays = record_arrays(i, seed=5)
        g = root.create_group(f"r{i}")
        for name, a in arrays.items():
            g.create_array(name, data=a, chunks=a.shape)
        truth.append(arrays)
    ds = ZarrRecords(str(tmp_path / "all.zarr"), fields=SPEC)
    assert ds.names == ["r0", "r1", "r2"]
    for i in range(3):
        assert_sample_equal(ds[i], truth[i])


def _headless(tmp_path) -> tuple[str, str]:
    """13 record folders, two of them (one per Zarr format) with arrays written straight to
    ``root/rec_k.zarr/<name>`` by zarr-python, which writes no group document for the folder."""
    import zipfile

    root = str(tmp_path / "headless")
    for i in range(13):
        arrays = record_arrays(i, seed=3)
        path = os.path.join(root, f"rec_{i:02d}.zarr")
        if i in (4, 9):
            for name, a in arrays.items():
                zarr.create_array(os.path.join(path, name), data=a, zarr_format=3 if i == 4 else 2)
        else:
            write_record(path, arrays, fmt=3)
    os.makedirs(os.path.join(root, "logs", "empty"))  # no Zarr at all: not a record, and no error
    archive = str(tmp_path / "headless.zip")
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for folder, _, files in os.walk(root):
            for f in files:
                zf.write(os.path.join(folder, f), os.path.relpath(os.path.join(folder, f), root))
    return root, archive


def test_a_folder_of_arrays_without_a_group_document_warns_naming_it(tmp_path):
    """Arrays written straight to root/rec.zarr/positions leave rec.zarr without zarr.json or .zgroup: such a
    folder is no group, so no record, and was once skipped without a word (13 records became 11). Refusing the
    dataset broke roots that keep other arrays beside their records (split indices in root/splits/train):
    such folders are left out with one RuntimeWarning per construction naming them and how to make one a record,
    locally and in a store (a zip archive); folders without Zarr arrays are left out silently. The warning
    points at the user's line (it pointed at stoker's records/catalog.py)."""
    root, archive = _headless(tmp_path)
    for where in (root, archive):
        with pytest.warns(RuntimeWarning, match=r"'rec_04\.zarr', 'rec_09\.zarr' hold Zarr arrays but are no "
                                                r"groups.*not records.*open_group") as seen:
            ds = ZarrRecords(where, fields=SPEC)
        [warned] = [w for w in seen if "no groups" in str(w.message)]
        assert "logs" not in str(warned.message)
        assert warned.filename == __file__  # the user's call, not the library's listing (stacklevel)
        assert len(ds) == 11 and "rec_04.zarr" not in ds.names
    for i in (4, 9):
        zarr.open_group(os.path.join(root, f"rec_{i:02d}.zarr"), mode="a", zarr_format=3 if i == 4 else 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ZarrRecords(root, fields=SPEC)
    assert len(ds) == 13
    assert_sample_equal(ds[4], record_arrays(4, seed=3))

    # Dataset-level arrays beside the records (zarr.create_array writes no document for root/splits).
    zarr.create_array(os.path.join(root, "splits", "train"), data=np.arange(2))
    with pytest.warns(RuntimeWarning, match=r"'splits' hold"):
        assert len(ZarrRecords(root, fields=SPEC)) == 13


def _mutant(tmp_path, name: str, change) -> str:
    """A small dataset whose record 1 is altered by ``change(arrays)``."""
    root = str(tmp_path / name)
    for i in range(3):
        arrays = record_arrays(i, seed=9)
        if i == 1:
            change(arrays)
        write_record(os.path.join(root, f"rec_{i}.zarr"), arrays, fmt=3)
    return root


def test_metadata_mismatches_name_record_field_and_dims(tmp_path):
    def bad_n(a):
        a["velocity"] = a["velocity"][:, :-1]

    root = _mutant(tmp_path, "bad_n", bad_n)
    with pytest.raises(InvalidArgument) as info:
        ZarrRecords(root, fields=SPEC)
    msg = str(info.value)
    assert "rec_1.zarr" in msg and "'velocity'" in msg and "'positions'" in msg and "'N'" in msg
    assert info.value.sample == "rec_1.zarr" and info.value.field == "velocity"
    assert ZarrRecords(root, fields=["positions", "velocity"]).metadata(1)  # no spec: nothing to agree on

    def bad_channels(a):
        a["cells"] = a["cells"][:, :2]

    with pytest.raises(InvalidArgument, match=r"rec_1.zarr.*'cells'.*axis 1 has size 2"):
        ZarrRecords(_mutant(tmp_path, "bad_c", bad_channels), fields=SPEC)

    def bad_rank(a):
        a["positions"] = a["positions"][0]

    root = _mutant(tmp_path, "bad_rank", bad_rank)
    with pytest.raises(RankMismatch, match=r"rec_1.zarr.*'positions'"):
        ZarrRecords(root, fields=SPEC)
    with pytest.raises(RankMismatch, match=r"rec_1.zarr.*'positions'"):  # ranks differ between records
        ZarrRecords(root)

    root = _mutant(tmp_path, "missing", lambda a: a.pop("cells"))
    with pytest.raises(NotFound) as info:
        ZarrRecords(root, fields=SPEC)
    assert info.value.sample == "rec_1.zarr" and info.value.field == "cells"
    with pytest.raises(NotFound, match=r"rec_1.zarr.*'cells'"):
        ZarrRecords(root)  # fields=None: the first record's arrays are required everywhere

    with pytest.raises(NotFound):
        ZarrRecords(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="no Zarr groups"):
        ZarrRecords(str(tmp_path / "empty"))
    with pytest.raises(InvalidArgument, match="relative path"):
        ZarrRecords(root, fields=["../x"])


# -- cache and memory ---------------------------------------------------------------------------


def test_cache_respects_cache_bytes(data):
    root, truth = data
    plain = ZarrRecords(root, fields=SPEC)
    # an entry holds the sample and the identity it is checked against: both count
    one = plain.metadata(6).nbytes + identity_nbytes(record_identity(plain._catalog, 6, plain.fields))
    store = LocalStore()
    ds = ZarrRecords(root, fields=SPEC, cache_bytes=int(2.5 * one), store=store)
    for i in range(N_RECORDS):
        ds[i]
        info = ds.cache_info()
        assert 0 < info.nbytes <= info.max_bytes == int(2.5 * one)
        assert info.entries >= 1
    reads = store.counters.reads
    s = ds[N_RECORDS - 1]  # cached: no read at all
    assert store.counters.reads == reads and ds.cache_info().hits == 1
    s["positions"].zero_()  # a copy: the cached sample is unchanged
    assert_sample_equal(ds[N_RECORDS - 1], truth[N_RECORDS - 1])
    ds[0]  # evicted long ago: read again
    assert store.counters.reads > reads
    assert ZarrRecords(root).cache_info().max_bytes == 0


def _measure_rss(root: str) -> dict:
    def peak_kb() -> int:
        gc.collect()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def now_kb() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    ds = ZarrRecords(root)
    for i in range(10):  # warm up: imports, codec state, allocator arenas
        ds[i]
    peak, rss = peak_kb(), now_kb()
    for _epoch in range(2):
        for i in range(len(ds)):
            sample = ds[i]
        del sample
    out = {"flat_peak_kb": peak_kb() - peak, "flat_rss_kb": now_kb() - rss}
    cached = ZarrRecords(root, cache_bytes=1 << 30)
    peak, rss = peak_kb(), now_kb()
    for i in range(len(cached)):
        cached[i]
    out.update(cached_peak_kb=peak_kb() - peak, cached_rss_kb=now_kb() - rss,
               total_kb=cached.cache_info().nbytes // 1024)
    return out


def _rss_child(root: str, queue) -> None:
    # ru_maxrss survives exec, so this spawned process starts with the test runner's peak; a forked
    # process starts its own peak at its current size, so the measurement runs in a fork of it.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = _measure_rss(root)
        except BaseException as exc:
            out = {"error": repr(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    queue.put(json.loads(raw))


@pytest.mark.timeout(120)
def test_rss_stays_flat_over_epochs_without_cache(tmp_path):
    # 300 records of 160 KiB (47 MiB in all, well above the process's start-up slack under its
    # peak): one written by zarr, the rest copies.
    template = str(tmp_path / "template")
    rng = np.random.default_rng(1)
    write_record(template, {"positions": rng.normal(size=(4, 2560, 3)).astype("f4"),
                            "features": rng.normal(size=(2560, 4)).astype("f4")}, fmt=3)
    root = tmp_path / "many"
    root.mkdir()
    for i in range(300):
        shutil.copytree(template, root / f"r{i:03d}.zarr")
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter (see _rss_child for the peak)
    queue = ctx.Queue()
    proc = ctx.Process(target=_rss_child, args=(str(root), queue))
    proc.start()
    got = queue.get(timeout=100)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert got["total_kb"] > 45 * 1024, got
    # Nothing retained across two epochs: neither the peak nor the current RSS grows.
    assert got["flat_peak_kb"] < 4 * 1024 and got["flat_rss_kb"] < 4 * 1024, got
    # The witness: retaining the epoch (a cache large enough) shows up in both measures.
    assert got["cached_peak_kb"] > 24 * 1024 and got["cached_rss_kb"] > 40 * 1024, got


def test_pickled_state_holds_no_store_or_cache(data):
    root, truth = data
    ds = ZarrRecords(root, fields=SPEC, cache_bytes=1 << 20, store=LocalStore())
    ds[0]
    blob = pickle.dumps(ds.for_rank(0, 2))
    assert b"LocalStore" not in blob and b"SizedLRU" not in blob and b"Lock" not in blob
    copy = pickle.loads(blob)
    assert copy.cache_info().entries == 0 and copy.part == (0, 2)
    assert_sample_equal(copy[1], truth[2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_match_indexing(data, context):
    root, truth = data
    store = LocalStore()
    ds = ZarrRecords(root, fields=SPEC, time_slice=3, store=store)
    opened = store.counters.files_opened
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    got = list(loader)
    assert store.counters.files_opened == opened  # workers opened their own stores
    assert len(got) == len(ds)
    for i, sample in enumerate(got):
        assert_sample_equal(sample, ds[i])


def _forked_child(ds: ZarrRecords, want: dict, queue) -> None:
    queue.put({
        "own_store": ds._store() is not ds._user_store,  # the parent's store object is not reused
        "same": all(torch.equal(ds[2][k], torch.from_numpy(want[k])) for k in want),
    })


def test_forked_process_opens_its_own_store(data):
    root, truth = data
    store = LocalStore()
    ds = ZarrRecords(root, fields=SPEC, store=store)
    ds[2]  # the parent has descriptors open in its store
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_forked_child, args=(ds, truth[2], queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=30)
    assert got == {"own_store": True, "same": True}
    assert ds._store() is store  # the parent keeps using the store it was given


# -- shards --------------------------------------------------------------------------------------


def test_shards_are_disjoint_and_compose(data):
    root, _ = data
    ds = ZarrRecords(root)
    parts = [ds.for_rank(r, 3) for r in range(3)]
    names = [n for p in parts for n in p.names]
    assert sorted(names) == ds.names and len(set(names)) == len(names)
    assert parts[1].names == ds.names[1::3]
    nested = ds.for_rank(1, 2).for_rank(1, 2)  # records 3, 7, ...: part (3, 4)
    assert nested.part == (3, 4) and nested.names == ds.names[3::4]
    with pytest.raises(InvalidArgument):
        ds.for_rank(3, 3)
    with pytest.raises(InvalidArgument, match="part"):
        compute_stats(ds.for_rank(1, 2), ["cells"], cache=False)  # rank 0 of 1 here


# -- statistics ---------------------------------------------------------------------------------


def numpy_stats(arrays: list[np.ndarray], per_channel: bool = True) -> dict[str, np.ndarray]:
    flat = np.concatenate([a.reshape(-1, a.shape[-1]) if per_channel else a.reshape(-1) for a in arrays]).astype("f8")
    return {"count": flat.shape[0], "mean": flat.mean(0), "std": flat.std(0), "min": flat.min(0), "max": flat.max(0)}


def edge_vectors(sample: dict) -> torch.Tensor:
    p = sample["positions"]
    return p[:, 1:] - p[:, :-1]


def edge_length(sample: dict) -> torch.Tensor:
    return torch.linalg.vector_norm(edge_vectors(sample), dim=-1, keepdim=True)


DERIVED = {"edge": edge_vectors, "edge_len": edge_length}


def numpy_derived(truth: list[dict], stats: dict) -> dict[str, dict]:
    """Edges from positions normalised as ``normalize`` does (float32 ops on float32 data)."""
    mean = stats["mean"].astype("f4")
    std = stats["std"].astype("f4")
    edges, lengths = [], []
    for rec in truth:
        p = (rec["positions"] - mean) / std
        e = p[:, 1:] - p[:, :-1]
        edges.append(e)
        lengths.append(np.sqrt((e.astype("f4") ** 2).sum(-1, keepdims=True)))
    return {"edge": numpy_stats(edges), "edge_len": numpy_stats(lengths)}


def assert_stats_close(got: FieldStats, want: dict, rtol: float) -> None:
    assert int(got.count) == want["count"]
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(getattr(got, key).numpy(), want[key], rtol=rtol, atol=rtol, err_msg=key)


def test_stats_weigh_elements_not_records(data):
    root, truth = data
    ds = ZarrRecords(root, fields=SPEC)
    stats = compute_stats(ds, ["positions", "cells"], cache=False)
    want = numpy_stats([t["positions"] for t in truth])
    assert_stats_close(stats["positions"], want, rtol=1e-12)
    assert_stats_close(stats["cells"], numpy_stats([t["cells"] for t in truth]), rtol=1e-12)
    # The witness: a mean of per-record means (or a first record weighted N times) is far off here.
    naive = np.mean([t["positions"].reshape(-1, 3).astype("f8").mean(0) for t in truth], axis=0)
    assert np.abs(naive - want["mean"]).max() > 1.0
    # Scalar statistics, and a time slice changes what is counted.
    scalar = compute_stats(ZarrRecords(root, fields=SPEC, time_slice=2), ["velocity"], per_channel=False, cache=False)
    assert scalar["velocity"].mean.shape == ()
    assert_stats_close(scalar["velocity"], numpy_stats([t["velocity"][:2] for t in truth], per_channel=False), 1e-12)
    assert not os.path.exists(sidecar.path_for(root))  # cache=False writes nothing


def test_moments_merge_is_stable_with_a_large_offset():
    rng = np.random.default_rng(3)
    parts = [1e8 + rng.normal(scale=1e-3, size=(n, 2)) for n in (5, 400, 37, 1)]
    m = Moments.empty(2)
    for p in parts:
        m = m.merge(Moments.of(torch.from_numpy(p)))
    flat = np.concatenate(parts)
    np.testing.assert_allclose(m.std.numpy(), flat.std(0), rtol=1e-6)
    np.testing.assert_allclose(m.mean.numpy(), flat.mean(0), rtol=1e-15)
    # The witness: E[x^2] - E[x]^2 loses every digit of this variance.
    naive = np.sqrt(np.abs((flat ** 2).mean(0) - flat.mean(0) ** 2))
    assert np.abs(naive / flat.std(0) - 1).max() > 0.5
    back = Moments.unpack(m.pack(), 2)
    assert back.count == m.count
    assert all(torch.equal(getattr(back, k), getattr(m, k)) for k in ("mean", "m2", "min", "max"))


def _exact_mean_std(values: np.ndarray) -> tuple[float, float]:
    """Mean and population std of ``values`` (1-d float64) in exact rational arithmetic, rounded once."""
    from fractions import Fraction

    xs = [Fraction(float(v)) for v in values]
    mean = sum(xs) / len(xs)
    return float(mean), float(sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5


def test_moments_merge_keeps_every_digit_of_a_spread_near_the_mean_s_resolution():
    """Pieces of 1e12 + noise of 1e-3 (float64 resolves 1.2e-4 there): each piece's mean rounded to float64 is
    off by up to half that, a tenth of the noise, and a merge that takes the rounded means' differences for the
    spread between pieces made the std 0.7 % too large. Against exact rational arithmetic."""
    rng = np.random.default_rng(5)
    parts = [1e12 + rng.normal(scale=1e-3, size=(n, 2)) for n in rng.integers(1, 8, size=600)]
    parts[3][1, 1] = np.nan  # the masked path too
    m = Moments.empty(2)
    for p in parts:
        m = m.merge(Moments.of(torch.from_numpy(p)))
    m = Moments.unpack(m.pack(), 2)  # as ranks exchange them
    st = FieldStats.from_moments(m)
    flat = np.concatenate(parts)
    for c in range(2):
        col = flat[:, c][np.isfinite(flat[:, c])]
        mean, std = _exact_mean_std(col)
        assert float(st.mean[c]) == pytest.approx(mean, rel=1e-15, abs=0)
        assert float(st.std[c]) == pytest.approx(std, rel=1e-9, abs=0)


def test_derived_stats_come_from_normalised_positions(data):
    root, truth = data
    ds = ZarrRecords(root, fields=SPEC)
    stats = compute_stats(ds, ["positions"], derived=DERIVED, derived_input="normalized", cache=False)
    plain = numpy_stats([t["positions"] for t in truth])
    want = numpy_derived(truth, plain)
    assert_stats_close(stats["edge"], want["edge"], rtol=1e-6)
    assert_stats_close(stats["edge_len"], want["edge_len"], rtol=1e-6)
    # The witness: edges of the raw positions have a very different spread.
    raw = numpy_stats([t["positions"][:, 1:] - t["positions"][:, :-1] for t in truth])
    assert np.abs(raw["std"] / want["edge"]["std"] - 1).min() > 1.0
    # normalize / denormalize round trip; fields without stats pass through.
    s = ds[3]
    n = normalize(s, stats)
    assert n["cells"] is s["cells"] and n["positions"].dtype == torch.float32
    torch.testing.assert_close(denormalize(n, stats)["positions"], s["positions"], rtol=1e-5, atol=1e-4)


def test_stats_file_written_once_reused_and_recomputed(tmp_path):
    root = str(tmp_path / "d")
    write_dataset(root, n=4, seed=2)
    store = LocalStore()
    ds = ZarrRecords(root, fields=SPEC, store=store)
    path = sidecar.path_for(root)
    with recording() as events:
        first = compute_stats(ds, ["positions"], derived=DERIVED, derived_input="normalized")
    assert stats_writes(events) == 2  # one temporary file opened, one rename
    st = os.stat(path)

    reads = store.counters.reads
    with recording() as events:
        again = compute_stats(ds, ["positions"], derived=DERIVED, derived_input="normalized")
    assert stats_writes(events) == 0 and store.counters.reads == reads  # no record read either
    st2 = os.stat(path)
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    for name in first:  # loaded from JSON bit for bit
        for key in ("count", "mean", "std", "min", "max"):
            assert torch.equal(getattr(first[name], key), getattr(again[name], key)), (name, key)

    with recording() as events:  # other fields: recomputed, added next to the first entry
        other = compute_stats(ds, ["positions", "velocity"])
    assert stats_writes(events) == 2 and "velocity" in other
    assert len(json.loads(open(path).read())["entries"]) == 2
    with recording() as events:
        compute_stats(ds, ["positions"], derived=DERIVED, derived_input="normalized")
        compute_stats(ds.for_rank(0, 1), ["positions", "velocity"])
    assert stats_writes(events) == 0

    with recording() as events:  # the data changed shape: the fingerprint no longer matches
        compute_stats(ZarrRecords(root, fields=SPEC, time_slice=2), ["positions"], derived=DERIVED, derived_input="normalized")
    assert stats_writes(events) == 2


def test_unwritable_stats_file_only_warns(tmp_path, monkeypatch):
    root = str(tmp_path / "d")
    truth = write_dataset(root, n=3, seed=4)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(sidecar, "write", refuse)
    with pytest.warns(RuntimeWarning, match="could not write"):
        stats = compute_stats(ZarrRecords(root, fields=SPEC), ["velocity"])
    assert_stats_close(stats["velocity"], numpy_stats([t["velocity"] for t in truth]), rtol=1e-12)


def test_stats_argument_errors(data):
    root, _ = data
    ds = ZarrRecords(root, fields=SPEC)
    with pytest.raises(InvalidArgument, match="unknown field"):
        compute_stats(ds, ["nope"], cache=False)
    with pytest.raises(InvalidArgument, match="also a field"):
        compute_stats(ds, ["positions"], derived={"cells": edge_vectors}, derived_input="normalized", cache=False)
    with pytest.raises(InvalidArgument, match="channels"):
        # 2 channels for records with odd N, 1 for even N
        odd = {"bad": lambda s: s["positions"][..., : 1 + s["positions"].shape[1] % 2]}
        compute_stats(ds, ["positions"], derived=odd, derived_input="normalized", cache=False)
    with pytest.raises(InvalidArgument):
        compute_stats([1, 2], ["positions"])
    for fields in (None, 3):  # a bare TypeError of list() before; the message lists the fields to name
        with pytest.raises(InvalidArgument, match="positions"):
            compute_stats(ds, fields, cache=False)


# -- real process groups ------------------------------------------------------------------------

STAT_FIELDS = ["positions", "velocity"]


def _hexes(st: FieldStats) -> dict:
    keys = ("count", "mean", "std", "min", "max")
    return {k: [float(v).hex() for v in getattr(st, k).reshape(-1).tolist()] for k in keys}


def boom(sample: dict) -> torch.Tensor:
    if sample["positions"].shape[1] == 8:  # record 1 only
        raise ValueError("boom on record 1")
    return sample["positions"]


def _stats_worker(rank: int, world: int, tmp: str, root: str, small: str) -> None:
    with gloo_group(rank, world, tmp):
        out: dict = {}
        path = sidecar.path_for(root)
        ds = ZarrRecords(root, fields=SPEC)
        out["plain"] = {k: _hexes(v) for k, v in compute_stats(ds, STAT_FIELDS, cache=False).items()}
        out["from_shard"] = {k: _hexes(v) for k, v in
                             compute_stats(ds.for_rank(rank, world), STAT_FIELDS, cache=False).items()}
        out["exists_before"] = os.path.exists(path)
        dist.barrier()
        with recording() as events:
            first = compute_stats(ds, STAT_FIELDS, derived=DERIVED, derived_input="normalized")
            st1 = os.stat(path)
            second = compute_stats(ds, STAT_FIELDS, derived=DERIVED, derived_input="normalized")
            st2 = os.stat(path)
        out["writes"] = stats_writes(events)
        out["stat"] = [[st1.st_ino, st1.st_mtime_ns], [st2.st_ino, st2.st_mtime_ns]]
        out["first"] = {k: _hexes(v) for k, v in first.items()}
        out["second"] = {k: _hexes(v) for k, v in second.items()}
        # A failure on one rank is raised on every rank instead of leaving the others in a collective.
        try:
            compute_stats(ds, ["positions"], derived={"boom": boom}, derived_input="normalized", cache=False)
        except Exception as exc:
            out["boom"] = type(exc).__name__
        if world > 1:  # ranks that see different data refuse together
            try:
                compute_stats(ZarrRecords(root, fields=SPEC, time_slice=2 + rank), ["positions"], cache=False)
            except InvalidArgument as exc:
                out["different"] = str(exc)
        # Two records over up to three ranks: a rank with nothing to read still takes part.
        out["small"] = _hexes(compute_stats(ZarrRecords(small, fields=SPEC), ["positions"], cache=False)["positions"])
        write_result(tmp, rank, out)
        dist.barrier()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["world1", "world2", "world3"])
def group_run(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"stats_world{world}")
    root, small = str(tmp / "data"), str(tmp / "small")
    truth = write_dataset(root, n=N_RECORDS, seed=world)
    small_truth = write_dataset(small, n=2, seed=40 + world)
    results = spawn_ranks(_stats_worker, world, tmp, root, small)
    return world, truth, small_truth, results


def _unhex(d: dict) -> dict:
    return {k: np.array([float.fromhex(v) for v in vals]).reshape(-1) for k, vals in d.items()}


def _close(got_hex: dict, want: dict, rtol: float) -> None:
    got = _unhex(got_hex)
    assert int(got["count"][0]) == want["count"]
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(got[key], np.reshape(want[key], -1), rtol=rtol, atol=rtol, err_msg=key)


spawned = pytest.mark.timeout(120)


@spawned
def test_stats_across_ranks_equal_numpy_on_every_rank(group_run):
    world, truth, small_truth, results = group_run
    for name in STAT_FIELDS:
        want = numpy_stats([t[name] for t in truth])
        for res in results:
            _close(res["plain"][name], want, rtol=1e-12)
            _close(res["first"][name], want, rtol=1e-12)
    for res in results:  # bit-identical on every rank, whichever way the rank's part was given
        assert res["plain"] == results[0]["plain"] == res["from_shard"]
        assert res["first"] == results[0]["first"] and res["second"] == res["first"]
        _close(res["small"], numpy_stats([t["positions"] for t in small_truth]), rtol=1e-12)
    naive = np.mean([t["positions"].reshape(-1, 3).astype("f8").mean(0) for t in truth], axis=0)
    assert np.abs(naive - numpy_stats([t["positions"] for t in truth])["mean"]).max() > 1.0


@spawned
def test_derived_stats_across_ranks(group_run):
    world, truth, _, results = group_run
    want = numpy_derived(truth, numpy_stats([t["positions"] for t in truth]))
    for res in results:
        _close(res["first"]["edge"], want["edge"], rtol=1e-6)
        _close(res["first"]["edge_len"], want["edge_len"], rtol=1e-6)


@spawned
def test_stats_file_written_once_by_rank_zero(group_run):
    world, _, _, results = group_run
    assert [res["writes"] for res in results] == [2] + [0] * (world - 1)  # temp file + rename, rank 0 only
    for res in results:
        assert not res["exists_before"]
        assert res["stat"][0] == res["stat"][1] == results[0]["stat"][0]  # never rewritten, seen by all


@spawned
def test_a_failing_rank_fails_every_rank(group_run):
    world, _, _, results = group_run
    owner = 1 % world  # the rank that reads record 1
    assert [res["boom"] for res in results] == ["ValueError" if r == owner else "StokerError" for r in range(world)]
    for res in results:
        assert ("different datasets" in res["different"]) if world > 1 else "different" not in res


def test_a_huge_group_document_is_refused_unread(tmp_path):
    """A record's zarr.json is metadata like an array's: one larger than the cap is a MetadataError before
    a byte of it is read (it was read whole), and invalid JSON names the file."""
    from stoker.errors import MetadataError

    for i in range(2):
        g = zarr.open_group(str(tmp_path / "ds" / f"rec_{i}"), mode="w")
        g.create_array("x", data=np.arange(3, dtype=np.float32))
    doc = tmp_path / "ds" / "rec_1" / "zarr.json"
    with open(doc, "r+b") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    with pytest.raises(MetadataError, match="more than the"):
        ZarrRecords(str(tmp_path / "ds"))
    doc.write_text('{"zarr_format": 3, "node_type": ')
    with pytest.raises(MetadataError, match="not valid JSON"):
        ZarrRecords(str(tmp_path / "ds"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_of_a_16_bit_field_rounds_once_and_is_not_biased(dtype):
    """A bf16/f16 field normalised in its own dtype had its mean rounded first (283.7 to 284 in bfloat16):
    every value shifted alike, the result's mean about -0.1 where the data gives ~0. In float32, rounded
    once: equal to the float32 reference rounded to the field's dtype, and so is denormalize."""
    values = torch.linspace(276.0, 291.4, 4096, dtype=torch.float32).reshape(-1, 1).to(dtype)
    stats = {"t": FieldStats(torch.tensor(4096), torch.tensor(283.7, dtype=torch.float64),
                             torch.tensor(3.0, dtype=torch.float64), torch.tensor(276.0, dtype=torch.float64),
                             torch.tensor(291.4, dtype=torch.float64), torch.tensor(0))}
    got = normalize({"t": values}, stats)["t"]
    want = ((values.float() - 283.7) / 3.0).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert abs(float(got.float().mean()) - float(((values.float() - 283.7) / 3.0).mean())) < 0.01
    back = denormalize({"t": got}, stats)["t"]
    assert back.dtype == dtype and torch.equal(back, (got.float() * 3.0 + 283.7).to(dtype))


def test_the_time_slice_warning_names_a_field_of_varied_lengths_short_everywhere(tmp_path):
    """Regression: a field given without dims whose length differs between records but falls short of
    time_slice in every one, beside a field that reaches it, was taken as "no time series" (the rule meant for
    a label of one shape everywhere) and not named, though it is sliced along axis 0 as a series and its
    samples hold fewer steps than asked. A field of one length everywhere (the label) is still unwarned."""
    root = str(tmp_path / "pv")
    for i, (t, n) in enumerate([(20, 3), (20, 6), (12, 4)]):
        g = zarr.open_group(os.path.join(root, f"rec{i}.zarr"), mode="w")
        g.create_array("points", data=np.zeros((t, 3), "f4"))
        g.create_array("ids", data=np.arange(n))  # per-record lengths, all short of 8
        g.create_array("label", data=np.array([i]))
    with pytest.warns(RuntimeWarning, match=r"time_slice=8\): field 'ids': 3 of 3 records .*'rec0\.zarr' "
                                            r"\(T=3\)") as seen:
        ds = ZarrRecords(root, time_slice=8)
    [message] = [str(w.message) for w in seen if "time_slice" in str(w.message)]
    assert "'points'" not in message and "'label'" not in message and "give dims" in message
    assert [tuple(ds[i]["ids"].shape) for i in range(3)] == [(3,), (6,), (4,)]  # whole: nothing cut
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZarrRecords(root, fields=["points", "label"], time_slice=8)


def _world_worker(rank: int, world: int, tmp: str, root: str) -> None:
    """compute_stats of one dataset, plain and derived, with the default blocks and with blocks of 3 records."""
    from stoker.records import stats as stats_module

    with gloo_group(rank, world, tmp):
        ds = ZarrRecords(root, fields=SPEC)
        out = {}
        for blocks in (getattr(stats_module, "MAX_BLOCKS", 1024), 3):
            stats_module.MAX_BLOCKS = blocks
            got = compute_stats(ds, STAT_FIELDS, derived=DERIVED, derived_input="normalized", cache=False)
            out[str(blocks)] = {k: _hexes(v) for k, v in got.items()}
            out[f"{blocks}_fp"] = stats_module.stats_fingerprint(got)
        write_result(tmp, rank, out)
        dist.barrier()


@spawned
def test_stats_are_bit_identical_on_every_world_size(tmp_path):
    """Statistics of one dataset on 1, 2 and 3 ranks: the same bits (they differed by ~1e-14 when each rank
    merged its records rank::world_size and the ranks' sums were merged in rank order), so their fingerprint
    (precompute's normalized_with=) is the same on any world size."""
    root = str(tmp_path / "data")
    truth = write_dataset(root, n=N_RECORDS, seed=11)
    runs = []
    for world in (1, 2, 3):
        (tmp_path / f"w{world}").mkdir()
        runs.append(spawn_ranks(_world_worker, world, tmp_path / f"w{world}", root))
    for results in runs:
        assert all(res == results[0] for res in results)  # every rank alike
        assert results[0] == runs[0][0], "statistics differ between world sizes"
    for name in STAT_FIELDS:
        _close(runs[0][0]["3"][name], numpy_stats([t[name] for t in truth]), rtol=1e-12)
