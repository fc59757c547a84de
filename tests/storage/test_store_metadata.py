"""Metadata reads through a store (storage/hierarchy.py): a group's consolidated metadata is loaded once
however many threads open arrays under it at once."""

from __future__ import annotations

import threading
import warnings

import pytest
import zarr

from stoker.errors import StorageError
from stoker.storage import CountingStore, MemoryStore
from stoker.storage.hierarchy import Hierarchy

from store_fixtures import read_tree

THREADS = 16


@pytest.fixture(scope="module", params=[3, 2])
def consolidated(request, tmp_path_factory):
    """``{key: bytes}`` of a group of THREADS arrays consolidated by zarr-python, and its format."""
    root = str(tmp_path_factory.mktemp(f"v{request.param}") / "g.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root, mode="w", zarr_format=request.param)
        for i in range(THREADS):
            group.create_array(f"a{i}", shape=(4,), chunks=(2,), dtype="int16")
        zarr.consolidate_metadata(root)
    return {f"g.zarr/{k}": v for k, v in read_tree(root).items()}, request.param


class _Gated(MemoryStore):
    """Holds every read of ``key`` until ``THREADS`` of them arrived, or ``fail`` is set and it raises; at
    most half a second either way (a single-flight load has one read only)."""

    def __init__(self, values, key: str) -> None:
        super().__init__(values)
        self.key, self.arrived, self.fail = key, 0, None
        self._all = threading.Event()
        self._count = threading.Lock()

    def get(self, key: str):
        if key == self.key:
            with self._count:
                self.arrived += 1
                if self.arrived >= THREADS:
                    self._all.set()
            self._all.wait(timeout=0.5)
            if self.fail is not None:
                raise self.fail
        return super().get(key)


def _open_all(hierarchy: Hierarchy) -> tuple[list, list]:
    results, errors = [None] * THREADS, [None] * THREADS
    start = threading.Barrier(THREADS)

    def open_one(i: int) -> None:
        start.wait(timeout=10)
        try:
            results[i] = hierarchy.consolidated(f"g.zarr/a{i}", f"memory://g.zarr/a{i}")
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_concurrent_opens_fetch_consolidated_metadata_once(consolidated):
    values, fmt = consolidated
    document = "g.zarr/zarr.json" if fmt == 3 else "g.zarr/.zmetadata"
    gated = _Gated(values, document)
    counted = CountingStore(gated)
    results, errors = _open_all(Hierarchy(counted))
    assert errors == [None] * THREADS
    assert all(r is not None and r[0] == fmt for r in results)
    assert gated.arrived == 1  # one fetch; the other threads waited for it
    assert counted.counters.requests == 1  # (a missing zarr.json, read first for v2, is not counted)


def test_a_failed_load_is_seen_by_all_waiters_and_not_kept(consolidated):
    values, fmt = consolidated
    document = "g.zarr/zarr.json"  # the first document read, for either format
    gated = _Gated(values, document)
    gated.fail = StorageError("memory://: read failed (injected)", uri="memory://", key=document)
    hierarchy = Hierarchy(gated)
    results, errors = _open_all(hierarchy)
    assert gated.arrived == 1
    assert all(isinstance(e, StorageError) for e in errors), errors
    assert len({id(e) for e in errors}) == THREADS  # each thread its own error (tracebacks are per raise)
    loader = [i for i, e in enumerate(errors) if e is gated.fail]
    assert len(loader) == 1  # the thread that read raised the store's error as it came
    for i, e in enumerate(errors):  # the waiters: naming the array each opened, the store's error inside
        if i != loader[0]:
            assert str(e).startswith(f"memory://g.zarr/a{i}: ") and e.uri == f"memory://g.zarr/a{i}", str(e)
            assert "read failed (injected)" in str(e) and e.__cause__ is gated.fail and e.key == document
    gated.fail = None  # the failure was not kept as "no consolidated metadata": asked again, found
    found = hierarchy.consolidated("g.zarr/a3", "memory://g.zarr/a3")
    assert found is not None and found[0] == fmt and gated.arrived == 2


def test_a_nested_v2_array_reads_its_own_zarray_whatever_was_opened_before(tmp_path):
    """An array in a v2 group without .zmetadata, below a consolidated root, is read from its own .zarray,
    as zarr-python's open_array reads it: after a rewrite the root's consolidated metadata no longer tells,
    the array opened after a sibling or a top-level array is the array opened first (a walk past the group to
    the root's .zmetadata once gave the stale (5, 3) float32 here after the sibling's open, and the root's
    entry, known from the top-level array's open, gave it after that one's)."""
    from stoker.reader.array import read_store_metadata

    root = str(tmp_path / "r.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root, mode="w", zarr_format=2)
        group.create_array("top", shape=(6,), chunks=(4,), dtype="int16")
        group.create_group("a").create_array("b", shape=(6,), chunks=(4,), dtype="int16")
        group["a"].create_array("c", shape=(5, 3), chunks=(2, 3), dtype="float32")
        zarr.consolidate_metadata(root)
        zarr.create_array(root + "/a/c", shape=(50, 30), chunks=(20, 30), dtype="float64", zarr_format=2,
                          overwrite=True)
        want = zarr.open_array(root + "/a/c", mode="r")
    values = {f"x/r.zarr/{k}": v for k, v in read_tree(root).items()}
    # after a top-level array's open the root's .zmetadata is known: its stale entry was taken for a/c
    for order in (["a/c"], ["a/b", "a/c"], ["top", "a/c"], ["top", "a/b", "a/c"]):
        hierarchy = Hierarchy(MemoryStore(values))
        for name in order:
            meta = read_store_metadata(hierarchy, f"x/r.zarr/{name}", f"memory://x/r.zarr/{name}")
        assert (tuple(meta.shape), str(meta.dtype)) == (want.shape, str(want.dtype)), order


def test_a_v2_entry_farther_up_than_the_walk_goes_is_never_taken():
    """The walk up to consolidated metadata stops after MAX_LEVELS groups; the shortcut over groups already
    known went any distance: a v2 array 9 groups below one whose .zmetadata holds a stale entry read its own
    .zarray first, then the stale one once a top-level array of that group was opened."""
    import json

    from stoker.reader.array import read_store_metadata
    from stoker.storage.hierarchy import MAX_LEVELS

    def zarray(shape):
        return json.dumps({"zarr_format": 2, "shape": list(shape), "chunks": list(shape), "dtype": "<f4",
                           "compressor": None, "fill_value": 0, "order": "C", "filters": None})

    groups = [f"g{i}" for i in range(1, MAX_LEVELS + 2)]
    deep = "/".join(groups) + "/arr"
    stale = {"metadata": {".zgroup": {"zarr_format": 2}, "top/.zarray": json.loads(zarray((4,))),
                          "/".join(groups[1:]) + "/arr/.zarray": json.loads(zarray((5, 3)))},
             "zarr_consolidated_format": 1}
    values = {"g1/.zgroup": b'{"zarr_format": 2}', "g1/.zmetadata": json.dumps(stale).encode(),
              "g1/top/.zarray": zarray((4,)).encode(), deep + "/.zarray": zarray((50, 30)).encode()}
    for k in range(2, len(groups) + 1):  # each group below consolidated too, without the array
        g = "/".join(groups[:k])
        values[g + "/.zgroup"] = b'{"zarr_format": 2}'
        values[g + "/.zmetadata"] = json.dumps({"metadata": {".zgroup": {"zarr_format": 2}},
                                                "zarr_consolidated_format": 1}).encode()
    for order in (["deep", "deep"], ["top", "deep", "deep"], ["deep", "top", "deep"]):
        hierarchy = Hierarchy(MemoryStore(values))
        shapes = []
        for name in order:
            path = deep if name == "deep" else "g1/top"
            meta = read_store_metadata(hierarchy, path, f"memory://{path}")
            if name == "deep":
                shapes.append(tuple(meta.shape))
        assert shapes == [(50, 30), (50, 30)], order


@pytest.mark.parametrize("fmt", [3, 2])
def test_a_group_s_document_is_parsed_once(tmp_path, monkeypatch, fmt):
    """group_node of a group with attributes (an OME image's ``multiscales``, written by zarr-python, not
    consolidated) reads its document once and parses it once, and its attributes are zarr-python's: the check
    that the reply was whole parsed it, then reading the node parsed it again."""
    import json

    from stoker.storage import hierarchy as hierarchy_mod

    root = str(tmp_path / "g.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root, mode="w", zarr_format=fmt)
        group.attrs["multiscales"] = [{"version": "0.4", "datasets": [{"path": "0"}]}]
        group.create_array("0", shape=(4,), chunks=(2,), dtype="int16")
        want = dict(zarr.open_group(root, mode="r").attrs)
    values = {f"x/g.zarr/{k}": v for k, v in read_tree(root).items()}
    doc = values["x/g.zarr/" + ("zarr.json" if fmt == 3 else ".zattrs")]
    counted = CountingStore(MemoryStore(values))
    parsed, real = [], json.loads

    def loads(raw, *args, **kw):
        if raw == doc:
            parsed.append(raw)
        return real(raw, *args, **kw)

    monkeypatch.setattr(hierarchy_mod.json, "loads", loads)
    node = Hierarchy(counted).group_node("x/g.zarr", "memory://x/g.zarr", fmt)
    assert node == (fmt, want, True)
    assert len(parsed) == 1 and counted.counters.requests == 1, (len(parsed), counted.counters.requests)
