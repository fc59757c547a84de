"""Metadata kept between opens (stoker.reader.metacache): an unchanged document is parsed once, a rewritten
one is read again, one just written is read on every open, and the cache is bounded."""

from __future__ import annotations

import functools
import json
import os
import types

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ShardingCodec, TransposeCodec, ZstdCodec

import stoker
from stoker.reader import array as array_module
from stoker.reader import metacache
from stoker.storage import LocalStore
from stoker.zarr import metadata
from stoker.storage.cache import SizedLRU

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settled(monkeypatch):
    """Every document counts as settled (as if written long ago), so opens keep what they parse."""
    monkeypatch.setattr(metacache, "SETTLE_NS", -(1 << 62))


def _write(path, data, **kw) -> None:
    z = zarr.create_array(str(path), shape=data.shape, chunks=(4, 8), dtype=data.dtype,
                          compressors=ZstdCodec(level=1), fill_value=0, **kw)
    z[:] = data


def _rewrite(doc_path, edit) -> None:
    """Rewrite a JSON document in place (same inode), as an editor or ``open(..., "w")`` does."""
    with open(doc_path) as f:
        doc = json.load(f)
    edit(doc)
    with open(doc_path, "r+") as f:
        text = json.dumps(doc)
        f.write(text)
        f.truncate(len(text))


def _opened(store: LocalStore, uri) -> tuple:
    before = store.counters.files_opened
    arr = stoker.open_array(uri, store=store)
    return arr, store.counters.files_opened - before


DATA = (np.arange(12 * 16, dtype="u1").reshape(12, 16) * 7) % 251


def test_zarr_json_rewritten_in_place_at_the_same_size_is_seen_by_the_next_open(tmp_path):
    _write(tmp_path / "a.zarr", DATA)
    doc_path = tmp_path / "a.zarr" / "zarr.json"
    assert stoker.open_array(tmp_path / "a.zarr").fill_value == 0
    size = os.path.getsize(doc_path)
    raw = doc_path.read_bytes()
    assert raw.count(b'"fill_value": 0') == 1
    with open(doc_path, "r+b") as f:  # in place, one digit for another: the same inode and size
        f.write(raw.replace(b'"fill_value": 0', b'"fill_value": 7'))
    assert os.path.getsize(doc_path) == size
    assert stoker.open_array(tmp_path / "a.zarr").fill_value == 7


def test_a_document_just_written_is_read_on_every_open(tmp_path):
    """Its identity may not change when it is rewritten within one timestamp tick, so it is not kept yet."""
    _write(tmp_path / "a.zarr", DATA)
    store = LocalStore()
    for _ in range(3):
        _, opened = _opened(store, tmp_path / "a.zarr")
        assert opened == 1


def test_a_settled_document_is_parsed_once_and_read_again_once_replaced(tmp_path, settled):
    _write(tmp_path / "a.zarr", DATA)
    store = LocalStore()
    first, opened = _opened(store, tmp_path / "a.zarr")
    assert opened == 1
    again, opened = _opened(store, tmp_path / "a.zarr")
    assert opened == 0  # a stat, no read
    assert again.metadata == first.metadata
    np.testing.assert_array_equal(again[:], zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[:])
    # replaced by a new file (another inode) with another shape: read again
    doc_path = tmp_path / "a.zarr" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["shape"] = [8, 16]
    (tmp_path / "new.json").write_text(json.dumps(doc))
    os.replace(tmp_path / "new.json", doc_path)
    arr, opened = _opened(store, tmp_path / "a.zarr")
    assert opened == 1 and arr.shape == (8, 16)
    np.testing.assert_array_equal(arr[:], zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[:])
    # rewritten in place at another size
    _rewrite(doc_path, lambda d: d.update(shape=[12, 16], attributes={"note": "longer now"}))
    arr, opened = _opened(store, tmp_path / "a.zarr")
    assert opened == 1 and arr.shape == (12, 16)


def test_kept_metadata_names_the_uri_it_was_opened_as(tmp_path, settled, monkeypatch):
    _write(tmp_path / "a.zarr", DATA)
    monkeypatch.chdir(tmp_path)
    stoker.open_array(tmp_path / "a.zarr")
    assert stoker.open_array("a.zarr").uri == "a.zarr"
    assert stoker.open_array(f"file://{tmp_path}/a.zarr").metadata.codec.uri == f"file://{tmp_path}/a.zarr"


def test_a_v2_separator_not_named_is_detected_on_every_open(tmp_path, settled):
    """.zarray without dimension_separator (zarr-python before 2.8): the separator comes from the chunks
    present, which may be written after an open that kept the document."""
    path = tmp_path / "v2.zarr"
    zarr.create_array(str(path), shape=(8, 8), chunks=(4, 4), dtype="u1", fill_value=0, zarr_format=2,
                          compressors=None)
    doc_path = path / ".zarray"
    doc = json.loads(doc_path.read_text())
    doc.pop("dimension_separator", None)
    doc_path.write_text(json.dumps(doc))
    store = LocalStore()
    assert stoker.open_array(path, store=store)[:].sum() == 0  # nothing written: '.'
    # chunks written nested ("0/0"), as zarr-python before 2.8 wrote them
    data = np.arange(64, dtype="u1").reshape(8, 8)
    writer = zarr.create_array(str(tmp_path / "w.zarr"), shape=(8, 8), chunks=(4, 4), dtype="u1", fill_value=0,
                               zarr_format=2, compressors=None, chunk_key_encoding={"name": "v2", "separator": "/"})
    writer[:] = data
    for name in os.listdir(tmp_path / "w.zarr"):
        if name.isdigit():
            os.rename(tmp_path / "w.zarr" / name, path / name)
    arr, opened = _opened(store, path)
    assert opened == 0  # the document was kept; the separator was detected anew
    assert arr.metadata.key_encoding.separator == "/"
    np.testing.assert_array_equal(arr[:], data)


def test_the_cache_is_bounded(tmp_path, settled, monkeypatch):
    doc_bytes = None
    for i in range(12):
        _write(tmp_path / f"a{i}.zarr", DATA)
        doc_bytes = doc_bytes or os.path.getsize(tmp_path / f"a{i}.zarr" / "zarr.json")
    room = 5 * (doc_bytes + metacache.ENTRY_BYTES)
    small = SizedLRU(room, lambda entry: entry[1])
    monkeypatch.setattr(metacache, "_cache", small)
    store = LocalStore()
    for i in range(12):
        stoker.open_array(tmp_path / f"a{i}.zarr", store=store)
        assert small.nbytes <= room
    assert len(small) == 5
    _, opened = _opened(store, tmp_path / "a11.zarr")  # the most recent: kept
    assert opened == 0
    _, opened = _opened(store, tmp_path / "a0.zarr")  # the oldest: dropped, read again
    assert opened == 1


def _batch(uri, crop=(slice(0, 12), slice(0, 16))) -> np.ndarray:
    aabb = [(s.start, s.stop) for s in crop]
    with stoker.Pipeline(stoker.Config(batch_size=1, dtype="f32", n_compute_threads=1, device="cpu",
                                     decode_on="cpu")) as p:
        p.push([stoker.Sample(str(uri), aabb)])
        with p.pop(timeout=30) as batch:
            return torch.from_dlpack(batch).clone()[0].numpy()


def test_pipelines_share_what_the_engine_knows_of_an_unchanged_array_and_not_of_a_replaced_one(
        tmp_path, settled, monkeypatch):
    """The engine's description of a local array (decode_native.shared_source) is made once per process and
    kept by the metadata object metacache hands out: a second pipeline makes none, a replaced array (other
    dtype, codec and chunks) is described anew and read right."""
    decode_native = pytest.importorskip("stoker.engine.cpu.decode_native")
    from stoker.engine.cpu.executor import engine_available

    if not engine_available():
        pytest.skip("the compiled engine is not built")
    made = []
    init = decode_native._Source.__init__
    monkeypatch.setattr(decode_native._Source, "__init__", lambda self, *a: made.append(a[0].uri) or init(self, *a))
    monkeypatch.setattr(decode_native, "_shared_sources", {})
    uri = tmp_path / "a.zarr"
    _write(uri, DATA)
    np.testing.assert_array_equal(_batch(uri), DATA.astype(np.float32))
    np.testing.assert_array_equal(_batch(uri), DATA.astype(np.float32))
    assert made == [str(uri)]  # the second pipeline found the first one's description
    wide = (DATA.astype(np.uint16) * 257)[:, ::-1].copy()
    zarr.create_array(str(uri), shape=wide.shape, chunks=(6, 4), dtype=wide.dtype, fill_value=0,
                      overwrite=True)[:] = wide  # no compressor now, other chunks, two bytes an element
    np.testing.assert_array_equal(_batch(uri), wide.astype(np.float32))
    assert made == [str(uri)] * 2


def test_a_bounded_number_of_engine_descriptions_is_kept(tmp_path, settled, monkeypatch):
    decode_native = pytest.importorskip("stoker.engine.cpu.decode_native")
    from stoker.engine.cpu import native

    if native.Engine is None:
        pytest.skip("the compiled engine is not built")
    monkeypatch.setattr(decode_native, "SHARED_SOURCES", 3)
    monkeypatch.setattr(decode_native, "_shared_sources", {})
    readers = []
    for i in range(5):
        _write(tmp_path / f"{i}.zarr", DATA)
        readers.append(stoker.open_array(tmp_path / f"{i}.zarr"))
    got = [decode_native.shared_source(r, torch.float32, native.KIND_F32, 1 << 20) for r in readers]
    assert len(decode_native._shared_sources) <= 3
    assert decode_native.shared_source(readers[4], torch.float32, native.KIND_F32, 1 << 20) is got[4]
    assert decode_native.shared_source(readers[4], torch.float32, native.KIND_F32, 1 << 10) is not got[4]  # budget
    assert decode_native.shared_source(readers[4], torch.bfloat16, native.KIND_BF16, 1 << 20) is not got[4]


def _strings(obj, seen=None):
    """Every string reachable from ``obj``: fields, containers, instance dicts, and what functions close over
    (a codec's decode stages are closures and bound methods)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (bytes, int, float, np.ndarray, np.dtype, type, type(None),
                                           types.ModuleType)):  # (a builtin's __self__ is its module)
        return
    seen.add(id(obj))
    if isinstance(obj, str):
        yield obj
        return
    if isinstance(obj, (tuple, list, set, frozenset)):
        parts = list(obj)
    elif isinstance(obj, dict):
        parts = [*obj.keys(), *obj.values()]
    elif isinstance(obj, functools.partial):
        parts = [obj.func, obj.args, obj.keywords]
    elif callable(obj) and not hasattr(obj, "__dataclass_fields__"):
        parts = [getattr(obj, "__self__", None), getattr(obj, "__defaults__", None),
                 getattr(obj, "__kwdefaults__", None),
                 *(c.cell_contents for c in (getattr(obj, "__closure__", None) or ()))]
    else:
        parts = [getattr(obj, f) for f in getattr(obj, "__dataclass_fields__", ())]
        parts += list(getattr(obj, "__dict__", {}).values())
    for part in parts:
        yield from _strings(part, seen)


def _layouts():
    """Arrays of every kind of codec chain metadata parses into: (name, writer)."""
    yield "v3 zstd", lambda p: zarr.create_array(p, shape=(16, 16), chunks=(8, 8), dtype="<u2",
                                                 compressors=ZstdCodec(level=1), fill_value=3)
    yield "v3 sharded", lambda p: zarr.create_array(p, shape=(16, 16), chunks=(4, 4), shards=(8, 8), dtype="<u2",
                                                    compressors=ZstdCodec(level=1), fill_value=0)
    yield "v3 shard compressed whole", lambda p: zarr.create_array(
        p, shape=(16, 16), chunks=(8, 8), dtype="<u2", fill_value=0, compressors=ZstdCodec(level=1),
        serializer=ShardingCodec(chunk_shape=(4, 4)))
    yield "v3 big-endian, transposed", lambda p: zarr.create_array(
        p, shape=(16, 16), chunks=(8, 8), dtype=">u2", fill_value=0, filters=TransposeCodec(order=(1, 0)),
        compressors=None)
    yield "v2 nested keys", lambda p: zarr.create_array(
        p, shape=(16, 16), chunks=(8, 8), dtype="<u2", fill_value=0, zarr_format=2, compressors=numcodecs.Zstd(1),
        chunk_key_encoding={"name": "v2", "separator": "/"})
    yield "v2 F order, delta filter", lambda p: zarr.create_array(
        p, shape=(16, 16), chunks=(8, 8), dtype="<u2", fill_value=0, zarr_format=2, order="F",
        filters=numcodecs.Delta(dtype="<u2"), compressors=numcodecs.Zlib(1))


@pytest.mark.parametrize("layout", [name for name, _ in _layouts()])
def test_a_document_of_the_same_bytes_is_parsed_once_and_names_each_array(tmp_path, layout, monkeypatch):
    """Arrays whose documents hold the same bytes share one parse (metacache.parse_of), renamed: equal to a
    parse of its own, naming its own URI everywhere (messages of its chunks' errors), reading its own data."""
    write = dict(_layouts())[layout]
    metacache.clear()
    data = {}
    for name in ("first", "second"):
        z = write(str(tmp_path / f"{name}.zarr"))
        data[name] = z[:] = (np.arange(256, dtype="<u2").reshape(16, 16) * (7 if name == "first" else 13)) % 65521
    doc = "zarr.json" if (tmp_path / "first.zarr" / "zarr.json").exists() else ".zarray"
    assert (tmp_path / "first.zarr" / doc).read_bytes() == (tmp_path / "second.zarr" / doc).read_bytes()
    parses = []
    for fn in ("parse_v3", "parse_v2"):
        real = getattr(metadata, fn)
        monkeypatch.setattr(array_module, fn, lambda *a, real=real, **k: parses.append(a[1]) or real(*a, **k))
    first = stoker.open_array(tmp_path / "first.zarr")
    second = stoker.open_array(tmp_path / "second.zarr")
    assert parses == [str(tmp_path / "first.zarr")]
    own = getattr(metadata, "parse_v3" if doc == "zarr.json" else "parse_v2")(
        json.loads((tmp_path / "second.zarr" / doc).read_text()), str(tmp_path / "second.zarr"),
        **({} if doc == "zarr.json" else {"separator": second.metadata.key_encoding.separator}))
    assert second.metadata == own and repr(second.metadata) == repr(own)
    names = {"first": set(_strings(first.metadata)), "second": set(_strings(second.metadata))}
    assert str(tmp_path / "second.zarr") in names["second"] and str(tmp_path / "first.zarr") not in names["second"]
    assert str(tmp_path / "first.zarr") in names["first"] and str(tmp_path / "second.zarr") not in names["first"]
    np.testing.assert_array_equal(first[:], data["first"])
    np.testing.assert_array_equal(second[:], data["second"])
    # a chunk of the second array damaged: its error names the second array
    chunk = max((p for p in (tmp_path / "second.zarr").rglob("*") if p.is_file() and p.name != doc),
                key=lambda p: p.stat().st_size)
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    with pytest.raises(stoker.errors.StokerError) as info:
        stoker.open_array(tmp_path / "second.zarr")[:]
    assert str(tmp_path / "second.zarr") in str(info.value) and str(tmp_path / "first.zarr") not in str(info.value)


def test_v2_documents_of_the_same_bytes_keep_each_arrays_own_separator(tmp_path, monkeypatch):
    """Two v2 arrays with the same .zarray naming no separator, one with flat chunk keys and one nested: the
    shared parse does not carry one array's separator to the other."""
    metacache.clear()
    data = np.arange(64, dtype="u1").reshape(8, 8)
    for name, separator in (("flat", "."), ("nested", "/")):
        z = zarr.create_array(str(tmp_path / f"{name}.zarr"), shape=(8, 8), chunks=(4, 4), dtype="u1",
                              fill_value=0, zarr_format=2, compressors=None,
                              chunk_key_encoding={"name": "v2", "separator": separator})
        z[:] = data + len(name)
        doc_path = tmp_path / f"{name}.zarr" / ".zarray"
        doc = json.loads(doc_path.read_text())
        doc.pop("dimension_separator", None)
        doc_path.write_text(json.dumps(doc))
    assert (tmp_path / "flat.zarr" / ".zarray").read_bytes() == (tmp_path / "nested.zarr" / ".zarray").read_bytes()
    parses = []
    monkeypatch.setattr(array_module, "parse_v2", lambda *a, **k: parses.append(k) or metadata.parse_v2(*a, **k))
    for name, separator in (("flat", "."), ("nested", "/"), ("flat", ".")):
        arr = stoker.open_array(tmp_path / f"{name}.zarr")
        assert arr.metadata.key_encoding.separator == separator
        assert arr.uri == str(tmp_path / f"{name}.zarr")
        np.testing.assert_array_equal(arr[:], data + len(name))
    # the nested array's separator differs from the shared parse's: parsed for it; the flat one's again: shared
    assert parses == [{"separator": "."}, {"separator": "/"}]


@pytest.mark.parametrize("layout", [name for name, _ in _layouts() if name.startswith("v3")])
def test_a_store_document_of_the_same_bytes_is_parsed_once_and_names_each_array(tmp_path, layout, monkeypatch):
    """Arrays read through a store (here a zip archive; an object store's the same way) whose zarr.json hold
    the same bytes share one parse, as local files do: equal to a parse of its own, naming its own URI,
    reading its own data; opened again (a new pipeline's open), not parsed again."""
    import zipfile

    from stoker.storage.locate import Stores

    write = dict(_layouts())[layout]
    metacache.clear()
    data = {}
    for name in ("first", "second"):
        z = write(str(tmp_path / "g" / f"{name}.zarr"))
        data[name] = z[:] = (np.arange(256, dtype="<u2").reshape(16, 16) * (7 if name == "first" else 13)) % 65521
    archive = tmp_path / "d.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted((tmp_path / "g").rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(tmp_path / "g").as_posix())
    parses = []
    real = metadata.parse_v3
    monkeypatch.setattr(array_module, "parse_v3", lambda *a, **k: parses.append(a[1]) or real(*a, **k))
    stores = Stores()
    try:
        uris = {name: f"zip://{archive}!/{name}.zarr" for name in ("first", "second")}
        first = stoker.open_array(uris["first"], stores=stores)
        second = stoker.open_array(uris["second"], stores=stores)
        again = stoker.open_array(uris["first"], stores=stores)
        assert parses == [uris["first"]]
        own = real(json.loads((tmp_path / "g" / "second.zarr" / "zarr.json").read_text()), uris["second"])
        assert second.metadata == own and repr(second.metadata) == repr(own)
        assert again.metadata == first.metadata
        assert set(_strings(second.metadata)) >= {uris["second"]} and uris["first"] not in _strings(second.metadata)
        np.testing.assert_array_equal(first[:], data["first"])
        np.testing.assert_array_equal(second[:], data["second"])
        np.testing.assert_array_equal(again[:], data["first"])
    finally:
        stores.close()


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_a_pipeline_opening_a_new_local_array_stats_each_metadata_file_once(tmp_path, monkeypatch, zarr_format):
    """A pipeline's open of a local array it has not opened yet (one a batch of many small arrays makes several,
    under the GIL) takes one ``stat`` of each of its metadata files: the one of zarr.json that tells a rewrite
    between epochs (Coordinator.forget_rewritten) is the one its parse is kept by, not taken twice."""
    uris = []
    for i in range(2):
        uris.append(str(tmp_path / f"a{i}.zarr"))
        z = zarr.create_array(uris[-1], shape=(8, 8), chunks=(4, 4), dtype="u1", zarr_format=zarr_format)
        z[:] = i + 1
    cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", sample_shape=(4, 4), pop_timeout_s=20)
    stats, real_stat = [], os.stat
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uris[0], ((0, 4), (0, 4)))])
        p.pop().release()
        monkeypatch.setattr(os, "stat", lambda path, *a, **k: (stats.append(path), real_stat(path, *a, **k))[1])
        p.push([stoker.Sample(uris[1], ((0, 4), (0, 4)))])
        batch = p.pop()
        assert np.array_equal(torch.from_dlpack(batch).numpy(), np.full((1, 4, 4), 2, np.float32))
        batch.release()
    documents = [os.path.relpath(s, uris[1]) for s in map(os.fspath, stats) if str(s).startswith(uris[1] + os.sep)]
    assert sorted(documents) == [".zarray", ".zattrs", "zarr.json"]
