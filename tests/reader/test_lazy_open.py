"""Opening an array reads its metadata document and nothing else.

1,000 arrays (v2 with both key separators, v3 plain and sharded) are opened; two independent
witnesses check that no chunk or shard file is touched:

* the store's own counters (``LocalStore.counters``), and
* a ``sys.addaudithook`` hook that sees every ``open`` the interpreter makes (``os.open``
  raises the ``open`` audit event), plus every directory listing.

Both witnesses are then shown to notice chunk reads, so the test can fail.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.reader import metacache
from stoker.storage import LocalStore

pytestmark = pytest.mark.timeout(60)

N_ARRAYS = 1000
METADATA_NAMES = {"zarr.json", ".zarray", ".zgroup"}
DATA = np.arange(16 * 24, dtype="u2").reshape(16, 24) % 97

# ---------------------------------------------------------------------------------------------
# the audit hook: installed once per process (hooks cannot be removed), recording only while
# _RECORDING is set, and only on the thread that set it (open_array and read run on the caller's
# thread; stray threads left by other tests must not pollute the record).

_HOOK_INSTALLED = False
_RECORDING = False
_RECORDING_THREAD: int | None = None
_EVENTS: list[tuple[str, str]] = []
_EVENTS_LOCK = threading.Lock()
_WATCHED = {"open", "os.listdir", "os.scandir"}


def _audit(event: str, args: tuple) -> None:
    if not _RECORDING or event not in _WATCHED or threading.get_ident() != _RECORDING_THREAD:
        return
    target = args[0] if args else None
    if isinstance(target, (str, bytes, os.PathLike)):
        target = os.fsdecode(target)
    else:
        target = repr(target)
    with _EVENTS_LOCK:
        _EVENTS.append((event, target))


def _install_hook() -> None:
    global _HOOK_INSTALLED
    if not _HOOK_INSTALLED:
        sys.addaudithook(_audit)
        _HOOK_INSTALLED = True


class recording:
    """Collect audit events inside a ``with`` block."""

    def __enter__(self) -> list[tuple[str, str]]:
        global _RECORDING, _RECORDING_THREAD
        _install_hook()
        _RECORDING_THREAD = threading.get_ident()
        with _EVENTS_LOCK:
            _EVENTS.clear()
        self.events: list[tuple[str, str]] = []
        _RECORDING = True
        return self.events

    def __exit__(self, *exc) -> None:
        global _RECORDING
        _RECORDING = False
        with _EVENTS_LOCK:
            self.events.extend(_EVENTS)
            _EVENTS.clear()


# ---------------------------------------------------------------------------------------------
# 1,000 arrays: four templates written by zarr, then copied


def _write_templates(root: str) -> dict[str, str]:
    templates = {
        "v2_dot": dict(zarr_format=2, compressors=numcodecs.Blosc()),
        "v2_slash": dict(zarr_format=2, compressors=numcodecs.Zstd(), chunk_key_encoding={"name": "v2", "separator": "/"}),
        "v3_plain": dict(zarr_format=3, compressors=ZstdCodec()),
        "v3_sharded": dict(zarr_format=3, shards=(16, 16), compressors=ZstdCodec()),
    }
    paths = {}
    for name, kw in templates.items():
        path = os.path.join(root, f"template_{name}.zarr")
        arr = zarr.create_array(path, shape=DATA.shape, chunks=(8, 8), dtype=DATA.dtype, fill_value=0, **kw)
        arr[...] = DATA
        paths[name] = path
    return paths


def _is_data_file(path: str) -> bool:
    return os.path.basename(path) not in METADATA_NAMES | {".zattrs"}


@pytest.fixture(scope="module")
def thousand_arrays(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("thousand"))
    templates = _write_templates(root)
    kinds = ["v2_dot", "v2_slash", "v3_plain", "v3_sharded"]  # 250 each: half v2, half v3
    arrays = []
    for i in range(N_ARRAYS):
        kind = kinds[i % 4]
        dst = os.path.join(root, "arrays", f"{i:04d}_{kind}.zarr")
        shutil.copytree(templates[kind], dst)
        arrays.append((dst, kind))
    # Sanity: every copy really holds chunk data that an open could read.
    for dst, kind in arrays[:4]:
        names = {os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs}
        data_files = {n for n in names if _is_data_file(n)}
        assert data_files, (kind, names)
    return root, arrays


def _metadata_file(path: str, kind: str) -> str:
    return os.path.join(path, ".zarray" if kind.startswith("v2") else "zarr.json")


def _under(path: str, root: str) -> bool:
    return os.path.abspath(path).startswith(root.rstrip(os.sep) + os.sep)


# ---------------------------------------------------------------------------------------------


def test_kinds_and_templates_are_what_they_claim(thousand_arrays):
    root, arrays = thousand_arrays
    assert len(arrays) == N_ARRAYS
    by_kind = {}
    for path, kind in arrays:
        by_kind.setdefault(kind, path)
    assert os.path.exists(os.path.join(by_kind["v2_dot"], "0.0"))
    assert os.path.exists(os.path.join(by_kind["v2_slash"], "0", "0"))
    assert os.path.exists(os.path.join(by_kind["v3_plain"], "c", "0", "0"))
    assert os.path.exists(os.path.join(by_kind["v3_sharded"], "c", "0", "1"))
    store = LocalStore()
    for kind, path in by_kind.items():
        arr = stoker.open_array(path, store=store)
        assert arr.zarr_format == (2 if kind.startswith("v2") else 3)
        assert (arr.shards is not None) == (kind == "v3_sharded")
        np.testing.assert_array_equal(arr.read([(0, 16), (0, 24)]), DATA)


def test_opening_1000_arrays_reads_only_metadata(thousand_arrays):
    root, arrays = thousand_arrays
    store = LocalStore()
    # Warm up imports and caches on an array outside the 1,000 so lazy imports do not show up.
    stoker.open_array(os.path.join(root, "template_v3_plain.zarr"), store=LocalStore())

    before = store.counters.reads, store.counters.bytes_read, store.counters.files_opened
    assert before == (0, 0, 0)
    # Documents opened by an earlier test once they had settled (copied over 3 s before) would not be read
    # again (metacache): this counts the reads of a process's first opens.
    metacache.clear()
    with recording() as events:
        readers = [stoker.open_array(path, store=store) for path, _ in arrays]
    assert len(readers) == N_ARRAYS

    # (a) the store's counters: one whole-file read of one metadata document per array
    metadata_bytes = sum(os.path.getsize(_metadata_file(path, kind)) for path, kind in arrays)
    assert store.counters.files_opened == N_ARRAYS
    assert store.counters.reads == N_ARRAYS
    assert store.counters.bytes_read == metadata_bytes
    assert metadata_bytes < N_ARRAYS * 2048  # metadata-sized, not chunk-sized

    # (b) the audit hook: every open under the root is a metadata document
    opens = [path for event, path in events if event == "open"]
    listings = [path for event, path in events if event != "open"]
    outside = [p for p in opens if not _under(p, root)]
    assert outside == [], f"unexpected opens outside the store: {outside[:5]}"
    data_opens = [p for p in opens if _is_data_file(p)]
    assert data_opens == [], f"chunk/shard files opened during open_array: {data_opens[:5]}"
    assert not any(os.path.basename(p) == ".zattrs" for p in opens)
    assert listings == [], f"directories listed during open_array: {listings[:5]}"
    # ... and it is cheap: v3 opens zarr.json once; v2 tries zarr.json, then opens .zarray.
    n_v2 = sum(kind.startswith("v2") for _, kind in arrays)
    assert len(opens) == (N_ARRAYS - n_v2) * 1 + n_v2 * 2
    per_array: dict[str, int] = {}
    for p in opens:
        per_array[os.path.dirname(p)] = per_array.get(os.path.dirname(p), 0) + 1
    assert set(per_array) == {path for path, _ in arrays}
    assert max(per_array.values()) <= 2

    # Metadata is right for all of them.
    for reader, (path, kind) in zip(readers, arrays):
        assert reader.shape == DATA.shape and reader.dtype == DATA.dtype
        assert reader.chunks == (8, 8)
        assert reader.shards == ((16, 16) if kind == "v3_sharded" else None)
    store.close()


@pytest.mark.parametrize("kind,chunk_rel", [
    ("v2_dot", ["0.1"]),
    ("v2_slash", ["0/1"]),
    ("v3_plain", ["c/0/1"]),
    ("v3_sharded", ["c/0/0"]),
])
def test_reading_a_box_is_seen_by_both_witnesses(thousand_arrays, kind, chunk_rel):
    """The witnesses are not blind: after open, a read shows chunk files in both of them."""
    root, arrays = thousand_arrays
    path = next(p for p, k in arrays if k == kind)
    store = LocalStore()
    with recording() as open_events:
        arr = stoker.open_array(path, store=store)
    after_open = (store.counters.reads, store.counters.bytes_read, store.counters.files_opened)
    assert not [p for e, p in open_events if e == "open" and _is_data_file(p)]

    with recording() as read_events:
        crop = arr.read([(0, 8), (8, 16)])
    np.testing.assert_array_equal(crop, DATA[0:8, 8:16])

    # (a) counters moved: a data file was opened and chunk bytes were read
    assert store.counters.files_opened > after_open[2]
    assert store.counters.reads > after_open[0]
    assert store.counters.bytes_read > after_open[1]
    # (b) the hook saw exactly the chunk (or shard) file
    data_opens = sorted({os.path.relpath(p, path) for e, p in read_events
                         if e == "open" and _is_data_file(p)})
    assert data_opens == chunk_rel
    store.close()


def test_default_store_open_is_lazy_too(thousand_arrays):
    """The same guarantee through the process-wide store that ``open_array`` uses by default."""
    root, arrays = thousand_arrays
    subset = arrays[:200]
    with recording() as events:
        for path, _ in subset:
            stoker.open_array(path)
    opens = [p for e, p in events if e == "open"]
    assert opens and all(_under(p, root) for p in opens)
    assert [p for p in opens if _is_data_file(p)] == []
    # Reading afterwards does open a data file through the default store.
    with recording() as events:
        stoker.open_array(subset[3][0]).read([(15, 16), (23, 24)])
    assert [os.path.relpath(p, subset[3][0]) for e, p in events if e == "open" and _is_data_file(p)] \
        == ["c/0/1"]
