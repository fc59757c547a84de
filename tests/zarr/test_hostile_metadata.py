"""Hostile metadata: every malformed document is a typed stoker error, never a bare Python exception.

The table is generated: valid v2 and v3 documents of plain, blosc, sharded and transposed arrays, each
written by zarr-python, with every key dropped and every value replaced in turn by each of a list of
hostile values. For each case ``stoker.open_array`` must either raise a ``StokerError`` naming the
array, or read what zarr-python reads from the same document. Where zarr-python refuses a document
stoker reads, the case must be one of the few deliberate leniencies listed in ``LENIENT`` (and then
stoker reads the unmutated array's data).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, TransposeCodec

import stoker
from stoker.reader.array import MAX_METADATA_BYTES
from stoker.cli import main
from stoker.storage import LocalStore

pytestmark = pytest.mark.timeout(60)

SHAPE = (32, 32)
DATA = (np.arange(32 * 32, dtype="u2").reshape(SHAPE) * 37 % 1000).astype("u2")

DROP = "<drop>"
DEEP = "<deep>"  # 100,000 nested lists: json's decoder recurses once per level
HOSTILE = [DROP, None, "x", 1, -1, 1.5, True, [], {}, DEEP, 2**70]


def _write(root) -> dict[str, str]:
    """The base arrays, each written by zarr-python; name -> path."""
    made = {}

    def create(name, **kw):
        path = os.path.join(root, name + ".zarr")
        z = zarr.create_array(path, shape=SHAPE, dtype="u2", fill_value=0, **kw)
        z[:] = DATA
        z[16:, 16:] = 0  # one chunk (or shard) left unwritten: the fill value
        made[name] = path

    create("v2plain", chunks=(16, 16), zarr_format=2, compressors=None)
    create("v2blosc", chunks=(16, 16), zarr_format=2, compressors=numcodecs.Blosc(cname="lz4"),
           filters=[numcodecs.Delta(dtype="u2")])
    create("v3plain", chunks=(16, 16))  # zstd, zarr-python's default
    create("v3blosc", chunks=(16, 16), compressors=BloscCodec(cname="zstd", shuffle="bitshuffle"))
    create("v3shard", chunks=(8, 8), shards=(16, 16))
    create("v3transpose", chunks=(16, 16), filters=[TransposeCodec(order=(1, 0))],
           serializer=BytesCodec(endian="big"), compressors=GzipCodec(level=1))
    return made


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _write(str(tmp_path_factory.mktemp("bases")))


def _meta_name(path: str) -> str:
    return "zarr.json" if os.path.exists(os.path.join(path, "zarr.json")) else ".zarray"


def _paths(doc, prefix=()):
    """Every key or list position in ``doc``, outermost first."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _mutated(doc: dict, path: tuple, value) -> str:
    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value == DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = "__deep__" if value == DEEP else value
    return json.dumps(doc).replace('"__deep__"', "[" * 100_000 + "]" * 100_000)


#: Documents zarr-python refuses and stoker reads on purpose: (last key, value) -> why.
LENIENT = {
    ("dimension_separator", None): "some writers serialize an unset separator as null: the layout is "
                                   "detected, as when the key is absent",
    ("fill_value", None): "null means 'no fill value' in either format: missing chunks read as 0 "
                          "(tests/zarr/test_fill_values.py::test_fill_value_null_is_zero)",
    ("configuration", DROP): "a v3 codec's configuration is optional in the spec; zstd's and blosc's only "
                             "matter when encoding",
    ("shuffle", 1): "blosc shuffle in numcodecs' numbering; it only matters when encoding",
}


def _read(arr) -> np.ndarray:
    return arr.read([(0, min(s, 32)) for s in arr.shape])


def _zarr_read(path: str, shape) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_array(path, mode="r")[tuple(slice(0, min(s, 32)) for s in shape)]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("base", ["v2plain", "v2blosc", "v3plain", "v3blosc", "v3shard", "v3transpose"])
def test_malformed_metadata_is_a_typed_error_or_reads_like_zarr(bases, tmp_path, base, value):
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases[base], path)
    meta = os.path.join(path, _meta_name(path))
    with open(meta) as f:
        doc = json.load(f)
    escapes, refused, accepted = [], 0, 0
    for key_path in _paths(doc):
        if value == DROP and isinstance(key_path[-1], int):
            continue
        with open(meta, "w") as f:
            f.write(_mutated(doc, key_path, value))
        case = f"{base} {'/'.join(map(str, key_path))} = {value!r}"
        try:
            arr = stoker.open_array(path)
            got = _read(arr)
        except stoker.StokerError as exc:
            refused += 1
            if path not in str(exc):
                escapes.append(f"{case}: message does not name the array: {exc}")
            continue
        except BaseException as exc:  # noqa: BLE001 - exactly what this test hunts
            escapes.append(f"{case}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        accepted += 1
        try:
            theirs = _zarr_read(path, arr.shape)
        except Exception:  # noqa: BLE001 - zarr-python refuses it: only a listed leniency may be read
            reason = next((why for (key, v), why in LENIENT.items()
                           if key == key_path[-1] and type(v) is type(value) and v == value), None)
            if reason is None:
                escapes.append(f"{case}: stoker reads a document zarr-python refuses")
            elif not np.array_equal(got, DATA * ((np.arange(32)[:, None] < 16) | (np.arange(32) < 16))):
                escapes.append(f"{case}: read as a leniency ({reason}) but not the array's data")
            continue
        if got.shape != theirs.shape or not np.array_equal(got, theirs):
            escapes.append(f"{case}: stoker and zarr-python read different values")
    assert not escapes, "\n".join(escapes)
    assert refused + accepted >= 5  # the loop ran


@pytest.mark.parametrize("value", [{"must_understand": True}, {"must_understand": "false"}, {}, 1, "x", None,
                                   {"must_understand": False, "x": 1}], ids=repr)
@pytest.mark.parametrize("base", ["v3plain", "v3shard"])
def test_v3_extension_fields_are_refused_unless_marked_ignorable(bases, tmp_path, base, value):
    """An unknown member of a v3 array document is an extension that may change what the bytes mean: refused
    (UnsupportedFormat naming the array and the field), as zarr-python refuses it, unless it is an object
    saying "must_understand": false, which the specification lets a reader ignore (the data is read)."""
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases[base], path)
    meta = os.path.join(path, "zarr.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["frobnicate"] = value
    with open(meta, "w") as f:
        json.dump(doc, f)
    if isinstance(value, dict) and value.get("must_understand") is False:
        want = DATA * ((np.arange(32)[:, None] < 16) | (np.arange(32) < 16))
        assert np.array_equal(_read(stoker.open_array(path)), want)
        return
    with pytest.raises(stoker.UnsupportedFormat, match="extension field 'frobnicate'") as info:
        stoker.open_array(path)
    assert info.value.uri == path
    with pytest.raises(Exception):  # noqa: B017 - the oracle: zarr-python refuses it too, with its own error
        _zarr_read(path, SHAPE)


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("ndim,ok", [(64, True), (65, False), (200, False)])
def test_more_than_64_dimensions_is_refused_clearly(tmp_path, fmt, ndim, ok):
    path = str(tmp_path / "a.zarr")
    zarr.create_array(path, shape=(2,), chunks=(1,), dtype="u1", zarr_format=fmt, fill_value=3)
    meta = os.path.join(path, _meta_name(path))
    with open(meta) as f:
        doc = json.load(f)
    doc["shape"] = [1] * ndim
    if fmt == 2:
        doc["chunks"] = [1] * ndim
    else:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [1] * ndim
    with open(meta, "w") as f:
        json.dump(doc, f)
    if ok:
        assert _read(stoker.open_array(path)).shape == (1,) * ndim
        return
    with pytest.raises(stoker.UnsupportedFormat, match=f"{ndim} dimensions; stoker reads at most 64"):
        stoker.open_array(path)


@pytest.mark.parametrize("order", [[0, 0], [1], ["0", "1"], [0, 1, 2], "x", [0, 1.0], [True, False], {}, None,
                                   [[0], [1]], [0, -1]])
def test_bad_transpose_order(bases, tmp_path, order):
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases["v3transpose"], path)
    meta = os.path.join(path, "zarr.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["codecs"][0]["configuration"]["order"] = order
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(stoker.MetadataError, match="transpose"):
        stoker.open_array(path)


@pytest.mark.parametrize("depth", [100_000, 500])
@pytest.mark.parametrize("where", ["document", "attributes", "shape"])
def test_deeply_nested_json(bases, tmp_path, depth, where):
    """json's decoder recurses once per level: 100,000 levels end in RecursionError inside it; 500 levels
    parse, and must then not break a message that shows the value."""
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases["v3plain"], path)
    meta = os.path.join(path, "zarr.json")
    nested = "[" * depth + "]" * depth
    if where == "document":
        text = nested
    else:
        with open(meta) as f:
            doc = json.load(f)
        doc[where] = "__deep__"
        text = json.dumps(doc).replace('"__deep__"', nested)
    with open(meta, "w") as f:
        f.write(text)
    if where == "attributes" and depth < 1000:  # parsed, and attributes are not stoker's business
        np.testing.assert_array_equal(_read(stoker.open_array(path)), _zarr_read(bases["v3plain"], SHAPE))
        return
    needle = "nested too deeply" if depth > 1000 else "must hold a JSON object" if where == "document" else \
        "shape entry must be an integer"
    with pytest.raises(stoker.MetadataError, match=needle) as info:
        stoker.open_array(path)
    assert len(str(info.value)) < 400  # the value is shown elided


# ---------------------------------------------------------------------------------------------
# bool fill values


def _bool_array(tmp_path, fmt, fill):
    """A bool array with one chunk written (False, True alternating) and one missing; fill_value edited."""
    path = str(tmp_path / f"b{fmt}.zarr")
    z = zarr.create_array(path, shape=(8,), chunks=(4,), dtype="bool", zarr_format=fmt, fill_value=False)
    z[:4] = [False, True, False, True]
    meta = os.path.join(path, _meta_name(path))
    with open(meta) as f:
        doc = json.load(f)
    doc["fill_value"] = fill
    with open(meta, "w") as f:
        json.dump(doc, f)
    return path


@pytest.mark.parametrize("fmt,fill,expected", [
    (2, True, True), (2, False, False), (2, 1, True), (2, 0, False),
    (3, True, True), (3, False, False),
])
def test_bool_fill_values_that_are_read(tmp_path, fmt, fill, expected):
    path = _bool_array(tmp_path, fmt, fill)
    got = stoker.open_array(path).read([(0, 8)])
    assert got.tolist() == [False, True, False, True] + [expected] * 4
    np.testing.assert_array_equal(got, _zarr_read(path, (8,)))


@pytest.mark.parametrize("fmt,fill", [
    (2, "false"), (3, "false"), (2, "true"), (3, "False"), (2, ""), (3, "0"), (2, 2), (2, -1), (2, 1.0),
    (3, 0), (3, 1), (3, 0.0), (2, "AA=="), (3, [False]),
])
def test_bool_fill_values_that_are_refused(tmp_path, fmt, fill):
    """Python's truthiness read ``"false"`` as True (so does zarr-python 3.1): only JSON true/false are a
    bool fill value, and for v2 also 0 and 1, as zarr-python 2 wrote them."""
    path = _bool_array(tmp_path, fmt, fill)
    with pytest.raises(stoker.MetadataError, match="bool array must be true") as info:
        stoker.open_array(path)
    assert path in str(info.value)


# ---------------------------------------------------------------------------------------------
# the size of a metadata document


def test_oversized_metadata_is_refused_before_it_is_read(bases, tmp_path):
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases["v3plain"], path)
    with open(os.path.join(path, "zarr.json"), "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: costs no disk
    store = LocalStore()
    with pytest.raises(stoker.MetadataError, match=f"zarr.json is {MAX_METADATA_BYTES + 1} bytes") as info:
        stoker.open_array(path, store=store)
    assert path in str(info.value)
    assert store.counters.bytes_read == 0


def test_oversized_metadata_costs_no_memory(bases, tmp_path):
    """A 512 MiB (sparse) .zarray: refused with its size, peak RSS growth a few MiB, not the file's size."""
    path = str(tmp_path / "a.zarr")
    shutil.copytree(bases["v2plain"], path)
    with open(os.path.join(path, ".zarray"), "r+b") as f:
        f.truncate(512 << 20)
    script = textwrap.dedent(f"""
        import resource, stoker
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            stoker.open_array({path!r})
        except stoker.StokerError as exc:
            message = str(exc)
        else:
            message = "opened"
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
        print(message)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    grown, message = out.stdout.split("\n", 1)
    assert int(grown) < 32, f"peak RSS grew by {grown} MiB"
    assert f"{512 << 20} bytes" in message, message


# ---------------------------------------------------------------------------------------------
# stoker inspect


def _malformed(bases, tmp_path) -> str:
    path = str(tmp_path / "bad.zarr")
    shutil.copytree(bases["v2blosc"], path)
    meta = os.path.join(path, ".zarray")
    with open(meta) as f:
        doc = json.load(f)
    doc["compressor"] = "blosc"  # a string, not an object: an AttributeError once
    with open(meta, "w") as f:
        json.dump(doc, f)
    return path


def test_inspect_shows_a_stoker_error_as_one_line_and_exits_2(bases, tmp_path, capsys):
    path = _malformed(bases, tmp_path)
    assert main(["inspect", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"stoker inspect: {path}: compressor must be a JSON object")


def test_inspect_cli_process_prints_no_traceback(bases, tmp_path):
    path = _malformed(bases, tmp_path)
    out = subprocess.run([sys.executable, "-m", "stoker", "inspect", path], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0
    assert path in out.stderr and out.stdout == ""
