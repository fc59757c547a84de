"""Arrays read through stores: ``open_array`` and pipelines over ``s3://`` (moto's server), ``http://``
(tests/range_server.py) and zip archives, each equal to the local read bit for bit; consolidated metadata
(a constant number of round trips for many arrays); faults through a pipeline (a 503 storm retried, a
server stopped mid-run, ``close()`` with requests in flight)."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import zipfile

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ZstdCodec

import stoker
from stoker.engine.cpu.decode_native import NativeDecoder
from stoker.engine.cpu.decode_python import PythonDecoder
from stoker.errors import InvalidArgument, NotFound, ShutdownError, StorageError
from stoker.storage.locate import Location, Stores, locate

from range_server import RangeServer
from store_fixtures import BUCKET, FAST_REMOTE, MotoS3, read_tree, write_zip

PREFIX = "remote-arrays"  # in the bucket the store tests share (one moto backend per process)
RECORDS = "remote-records"

SHAPE = (40, 36)
FAST = FAST_REMOTE
KINDS = ["s3", "http", "zip"]

#: path -> how it is written (zarr-python is the oracle); every array has SHAPE
V3 = {"g3.zarr/zstd": dict(chunks=(16, 16), dtype="int32", fill_value=7, compressors=ZstdCodec(level=1)),
      "g3.zarr/gzip_t": dict(chunks=(16, 8), dtype=">f4", filters=None, compressors=GzipCodec(level=1),
                             serializer=BytesCodec(endian="big")),
      "g3.zarr/sub/sharded": dict(chunks=(8, 8), shards=(16, 24), dtype="uint16", fill_value=3,
                                  compressors=ZstdCodec(level=1)),
      "g3.zarr/sharded_blosc": dict(chunks=(8, 12), shards=(24, 24), dtype="float64",
                                    compressors=BloscCodec(cname="lz4", clevel=1))}
V2 = {"g2.zarr/blosc": dict(chunks=(16, 16), dtype="<u2", compressors=numcodecs.Blosc("zstd", 1), fill_value=5),
      "g2.zarr/zlib_f": dict(chunks=(10, 12), dtype="<f8", compressors=numcodecs.Zlib(1), order="F"),
      "g2.zarr/nested": dict(chunks=(16, 16), dtype="<i2", compressors=numcodecs.LZ4(),
                             chunk_key_encoding={"name": "v2", "separator": "/"}),
      "plain2.zarr": dict(chunks=(16, 16), dtype="<i8", compressors=None, fill_value=-1)}
ARRAYS = list(V3) + list(V2)


def _data(path: str, dtype) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(path)) % 2**32)
    data = (rng.random(SHAPE) * 1000).astype(dtype)
    data[:, 30:] = 0  # chunks of fill value only, left unwritten by zarr where the fill is 0
    return data


def _write(root: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.open_group(os.path.join(root, "g3.zarr"), mode="w")
        zarr.open_group(os.path.join(root, "g3.zarr/sub"), mode="w")
        zarr.open_group(os.path.join(root, "g2.zarr"), mode="w", zarr_format=2)
        for path, spec in {**V3, **V2}.items():
            spec = dict(spec)
            fmt = 2 if path in V2 else 3
            arr = zarr.create_array(os.path.join(root, path), shape=SHAPE, zarr_format=fmt, **spec)
            data = _data(path, spec["dtype"])
            arr[:32] = data[:32]  # rows 32.. never written: missing chunks (and a missing shard) read as fill
        zarr.consolidate_metadata(os.path.join(root, "g3.zarr"))
        zarr.consolidate_metadata(os.path.join(root, "g2.zarr"))
        # a chunk holding a value past the fill: written explicitly
        zarr.open_array(os.path.join(root, "g3.zarr/zstd"), mode="r+")[39, 0] = 123


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("remote") / "data")
    _write(root)
    values = read_tree(root)
    archive = os.path.join(os.path.dirname(root), "data.zip")
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(values):
            zf.writestr(key, values[key])
    s3 = MotoS3(values, PREFIX)
    http = RangeServer(root)
    yield {"root": root, "zip": archive, "s3": s3, "http": http}
    http.stop()
    s3.stop()


def remote(tree, kind: str, path: str) -> tuple[str, dict | None]:
    """The URI of ``path`` in the store of ``kind``, and its storage options."""
    if kind == "s3":
        return f"s3://{BUCKET}/{PREFIX}/{path}", {**tree["s3"].options, **FAST}
    if kind == "http":
        return f"{tree['http'].url}/{path}", dict(FAST)
    return f"{tree['zip']}/{path}", None


def bits(a: np.ndarray) -> tuple:
    return a.shape, a.dtype, np.ascontiguousarray(a).tobytes()


BOXES = [(slice(0, 40), slice(0, 36)), (slice(3, 29), slice(5, 33)), (slice(31, 40), slice(0, 9)),
         (slice(15, 17), slice(23, 25))]


@pytest.mark.parametrize("kind", KINDS)
def test_every_array_reads_bit_for_bit_equal_to_local(tree, kind):
    stores = Stores()
    try:
        for path in ARRAYS:
            local = stoker.open_array(os.path.join(tree["root"], path))
            uri, options = remote(tree, kind, path)
            arr = stoker.open_array(uri, options, stores=stores)
            assert arr.kv is not None and arr.uri == uri
            assert (arr.shape, arr.dtype, arr.chunks, arr.shards, arr.zarr_format) == \
                (local.shape, local.dtype, local.chunks, local.shards, local.zarr_format), path
            for box in BOXES:
                assert bits(arr[box]) == bits(local[box]), (path, box)
            ref = zarr.open_array(os.path.join(tree["root"], path), mode="r")[...]
            assert np.ascontiguousarray(arr[...]).tobytes() == np.ascontiguousarray(ref.astype(arr.dtype)).tobytes()
    finally:
        stores.close()


@pytest.mark.parametrize("status", [302, 307])
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "disk-cache"])
def test_an_http_server_that_redirects_every_request_reads_every_array_as_zarr_does(tree, status, cached, tmp_path):
    """Every request (GET, ranged GET, HEAD) of the arrays answered by a redirect to the same file elsewhere on
    the host: followed, each array read equal to zarr-python's (shards' indexes and inner chunks, missing
    chunks and shards as fill values, consolidated groups), and through the disk cache a second read from
    disk at the same values."""
    server = RangeServer(tree["root"])
    server.redirect_status = status
    stores = Stores()
    try:
        options = dict(FAST)
        if cached:
            options.update(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
        for _ in range(2 if cached else 1):
            for path in ARRAYS:
                ref = zarr.open_array(os.path.join(tree["root"], path), mode="r")[...]
                arr = stoker.open_array(f"{server.url}/{path}", options, stores=stores)
                assert np.ascontiguousarray(arr[...]).tobytes() == \
                    np.ascontiguousarray(ref.astype(arr.dtype)).tobytes(), path
                for box in BOXES:
                    assert bits(arr[box]) == bits(np.ascontiguousarray(ref.astype(arr.dtype)[box])), (path, box)
            if cached:
                assert arr.kv.cache.flush(30)
        assert any(p.startswith("/moved/") for p in server.paths) and any(
            not p.startswith("/moved/") for p in server.paths)  # every request went there by the redirect
        if cached:
            assert arr.kv.counters.hit_bytes > 0
    finally:
        stores.close()
        server.stop()


def test_uri_forms():
    assert locate("s3://b/g.zarr/a").root == "s3://b" and locate("s3://b/g.zarr/a").prefix == "g.zarr/a"
    assert locate("https://h:8/x/y/").prefix == "x/y"
    z = locate("zip:///tmp/d.zip!/g.zarr/a")
    assert (z.root, z.prefix, z.archive) == ("/tmp/d.zip", "g.zarr/a", True)
    z = locate("zip:///tmp/no-such.zip/g.zarr/a")  # no "!" and no archive along the path: the whole path
    assert (z.root, z.prefix, z.archive) == ("/tmp/no-such.zip/g.zarr/a", "", True)
    assert locate("/tmp/no-such.zip/a").is_local  # not an archive: a directory path as before
    with pytest.raises(InvalidArgument):
        locate("s3://b/g.zarr/../a")
    with pytest.raises(InvalidArgument):
        stoker.open_array("/tmp/some.zarr", {"region": "x"})  # options for a local path: refused


@pytest.mark.parametrize("path", ["/a/b.zarr", "/a//b.zarr/", "/a/./x/../b.zarr", "//a/b.zarr", "/a/b:c.zarr"])
def test_absolute_local_paths_are_located_as_their_normal_form(path):
    """locate keeps the Location of an absolute path naming no archive (a function of the string alone): the
    same as resolving it each time, also when asked again."""
    for _ in range(2):
        assert locate(path) == Location(path, None, "", os.path.abspath(path))


@pytest.mark.parametrize("uri", ["s3://b/g.zarr/a", "gs://b/x%20y.zarr/a/", "https://h:8/x/y",
                                 "https://s3.eu-west-1.amazonaws.com/bkt/g.zarr/a", "az://c/g.zarr"])
def test_a_remote_uri_is_located_the_same_each_time(uri):
    """locate keeps the Location of a remote URI (a function of the string alone: each open of a pipeline asks
    it three times): equal to what the URI's parts say, also when asked again."""
    from stoker.storage.uri import store_root

    root, inside = store_root(uri)
    for _ in range(2):
        assert locate(uri) == Location(uri, root, inside.strip("/"))


@pytest.mark.parametrize("uri", ["s3://b/g.zarr/../a", "s3:///g.zarr", "https://u:p@h/g.zarr", "s3://b/a?x=1"])
def test_a_refused_remote_uri_is_refused_each_time(uri):
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            locate(uri)


def test_a_relative_path_is_located_from_the_working_folder_of_the_moment(tmp_path, monkeypatch):
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
        monkeypatch.chdir(tmp_path / sub)
        assert locate("a.zarr").path == str(tmp_path / sub / "a.zarr")


def test_an_absolute_path_through_a_zip_archive_is_looked_at_each_time(tmp_path):
    path = str(tmp_path / "d.ZIP" / "g.zarr")
    assert locate(path).is_local  # no archive there yet: a folder
    with zipfile.ZipFile(tmp_path / "d.ZIP", "w") as zf:
        zf.writestr("g.zarr/zarr.json", "{}")
    z = locate(path)
    assert (z.root, z.prefix, z.archive) == (str(tmp_path / "d.ZIP"), "g.zarr", True)


def test_consolidated_metadata_costs_constant_round_trips(tree):
    http = tree["http"]
    url = http.url
    for group, names, cost in (("g3.zarr", list(V3), 1), ("g2.zarr", [p for p in V2 if p.startswith("g2.zarr/")], 2)):
        stores = Stores()
        before = http.requests
        for path in names:
            stoker.open_array(f"{url}/{path}", stores=stores)
        # v3: the group's zarr.json (g3.zarr/sub/sharded too: a consolidated ancestor already read is asked
        # first); v2: zarr.json (missing), then .zmetadata. The arrays' own documents are never read.
        assert http.requests - before == cost, group
        stores.close()
    # not consolidated: after the first open, each costs its own documents only (zarr.json missing, .zarray)
    stores = Stores()
    stoker.open_array(f"{url}/plain2.zarr", stores=stores)
    before = http.requests
    for _ in range(3):
        stoker.open_array(f"{url}/plain2.zarr", stores=stores)
    assert http.requests - before == 2 * 3
    stores.close()


def test_missing_array_is_not_found_naming_uri(tree):
    uri, options = remote(tree, "http", "g3.zarr/nope")
    with pytest.raises(NotFound) as info:
        stoker.open_array(uri, options, stores=Stores())
    assert uri in str(info.value)
    with pytest.raises(InvalidArgument, match="group"):
        stoker.open_array(remote(tree, "http", "g3.zarr/sub")[0], stores=Stores())


def test_a_missing_bucket_is_not_found_naming_the_bucket(tree):
    """An array in a bucket that does not exist read as any missing array ("no Zarr array at s3://..."), which
    sends one looking for a wrong path when the bucket name (or the endpoint, or the region) is what is wrong.
    S3 says so in its 404 (NoSuchBucket): NotFound naming the bucket, from the requests made anyway; an array
    missing from a bucket that exists is still "no Zarr array"."""
    _, options = remote(tree, "s3", "plain2.zarr")
    for uri in ("s3://no-such-bucket/a.zarr", "s3://no-such-bucket/g.zarr/sub/a"):
        with pytest.raises(NotFound, match=r"bucket 'no-such-bucket' does not exist") as info:
            stoker.open_array(uri, options, stores=Stores())
        assert info.value.context.get("bucket") == "no-such-bucket"
    with pytest.raises(NotFound, match="no Zarr array at"):
        stoker.open_array(f"s3://{BUCKET}/{PREFIX}/nope.zarr", options, stores=Stores())


def test_a_missing_bucket_found_by_a_listing_is_not_found_naming_the_bucket(tree):
    """Regression: a listing of a bucket that does not exist (a group or records listed, a writer's marks
    counted, ``stoker.inference.record.forget``) raised a StorageError quoting the server's 404, where a read
    gives the NotFound naming the bucket (obstore raises a listing's 404 as its generic error, not as
    FileNotFoundError). A listing of a missing folder in a bucket that exists still lists nothing."""
    from stoker.inference.record import forget

    _, options = remote(tree, "s3", "plain2.zarr")
    stores = Stores()
    try:
        kv, _ = stores.get(locate("s3://no-such-bucket/g.zarr"), options)
        for call in (lambda: kv.list("g"), lambda: kv.list_dir("g"), lambda: kv.list_versions("g"),
                     lambda: kv.start_list_versions("g").result(timeout=30)):
            with pytest.raises(NotFound, match=r"bucket 'no-such-bucket' does not exist .*a listing") as info:
                call()
            assert info.value.context.get("missing") == "bucket"
        with pytest.raises(NotFound, match=r"bucket 'no-such-bucket' does not exist"):
            forget("s3://no-such-bucket/pred.zarr", options)
        kv, _ = stores.get(locate(f"s3://{BUCKET}/{PREFIX}/nope"), options)
        assert kv.list("nope") == [] and kv.list_dir("nope") == ([], [])
    finally:
        stores.close()


def test_storage_error_names_uri_and_key(tree):
    server = RangeServer(tree["root"])
    stores = Stores()
    arr = stoker.open_array(f"{server.url}/g3.zarr/zstd", FAST, stores=stores)
    server.stop()
    with pytest.raises(StorageError) as info:
        arr[0:4, 0:4]
    assert info.value.context.get("key") == "g3.zarr/zstd/c/0/0"
    assert server.url in str(info.value)
    stores.close()


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_403_for_a_missing_key_is_absent_for_probes_and_an_error_for_data(tree, kind):
    """S3 answers 403, not 404, for a missing key without s3:ListBucket: the optional probes (ancestors'
    consolidated metadata, the v3 document of a v2 array) read it as absent; the array's own documents
    and its chunks raise a StorageError that says so."""
    server = RangeServer(os.path.dirname(tree["root"]))  # "/data/<key>": path-style S3 of bucket "data"
    server.missing_status = 403
    if kind == "http":
        base, options = f"{server.url}/data", dict(FAST)
    else:
        base, options = "s3://data", {"endpoint": server.url, "allow_http": True, "skip_signature": True,
                                      "region": "us-east-1", **FAST}
    stores = Stores()
    try:
        for path in ("plain2.zarr", "g2.zarr/zlib_f", "g3.zarr/sub/sharded"):
            arr = stoker.open_array(f"{base}/{path}", options, stores=stores)
            local = stoker.open_array(os.path.join(tree["root"], path))
            assert bits(arr[0:32]) == bits(local[0:32]), path  # rows 0..31: every chunk stored
        with pytest.raises(StorageError, match="s3:ListBucket") as info:
            stoker.open_array(f"{base}/g3.zarr/nope", options, stores=stores)
        assert info.value.context["status"] == 403 and info.value.context["key"].endswith("g3.zarr/nope/zarr.json")
        arr = stoker.open_array(f"{base}/plain2.zarr", options, stores=stores)
        with pytest.raises(StorageError, match="s3:ListBucket"):
            arr[32:40]  # a chunk never written: a 403, not the fill value, when missing keys are refused
    finally:
        stores.close()
        server.stop()


def _small(folder: str, value: int, n: int, consolidate: bool = False) -> dict[str, bytes]:
    """The files of a group ``g.zarr`` holding ``a`` of shape (n,) filled with ``value`` (zarr-python)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.open_group(os.path.join(folder, "g.zarr"), mode="w")
        zarr.create_array(os.path.join(folder, "g.zarr/a"), shape=(n,), chunks=(n,), dtype="f4",
                          compressors=None)[...] = value
        if consolidate:
            zarr.consolidate_metadata(os.path.join(folder, "g.zarr"))
    return read_tree(folder)


def _zip(path: str, values: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(values):
            zf.writestr(key, values[key])


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_open_array_sees_a_rewritten_zip_archive(tmp_path, how):
    """Outside a pipeline each open sees the archive as it is now, as for local files."""
    archive = str(tmp_path / "d.zip")
    _zip(archive, _small(str(tmp_path / "v1"), 1, 4))
    first = stoker.open_array(f"{archive}/g.zarr/a")
    assert first[:].tolist() == [1] * 4
    second = _small(str(tmp_path / "v2"), 2, 6)
    if how == "in place":
        _zip(archive, second)
    else:
        _zip(archive + ".tmp", second)
        os.replace(archive + ".tmp", archive)
    for uri in (f"{archive}/g.zarr/a", f"zip://{archive}!/g.zarr/a"):
        arr = stoker.open_array(uri)
        assert arr.shape == (6,) and arr[:].tolist() == [2] * 6, uri
    if how == "replaced":  # an array opened before keeps reading the archive it was opened from
        assert first[:].tolist() == [1] * 4


def test_open_array_sees_rewritten_consolidated_metadata(tmp_path):
    root = str(tmp_path / "served")
    _small(root, 1, 4, consolidate=True)
    server = RangeServer(root)
    try:
        uri = f"{server.url}/g.zarr/a"
        assert stoker.open_array(uri, FAST).shape == (4,)
        _small(root, 2, 6, consolidate=True)
        arr = stoker.open_array(uri, FAST)
        assert arr.shape == (6,) and arr[:].tolist() == [2] * 6
    finally:
        server.stop()


@pytest.mark.parametrize("layout", ["chunks", "sharded"])
def test_a_zip_archive_rewritten_in_place_under_an_open_array_is_an_error(tmp_path, layout):
    """The open store's central directory is stale: never bytes of the new archive at the old offsets."""
    src, path = str(tmp_path / "src"), str(tmp_path / "d.zip")
    spec = dict(chunks=(4,), shards=(8,)) if layout == "sharded" else dict(chunks=(4,))

    def archive(value: int, prefix: bytes) -> bytes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zarr.create_array(os.path.join(src, "a"), shape=(16,), dtype="i4", compressors=None,
                              overwrite=True, **spec)[...] = value
        values = read_tree(src)
        _zip(str(tmp_path / "new.zip"), {**{f"pad{i}": prefix for i in range(3)}, **values})
        with open(tmp_path / "new.zip", "rb") as f:
            return f.read()

    with open(path, "wb") as f:
        f.write(archive(1, b""))
    stores = Stores()  # a pipeline's: the array keeps the store it opened
    try:
        arr = stoker.open_array(f"{path}/a", stores=stores)
        assert arr[:].tolist() == [1] * 16
        new = archive(2, b"x" * 100)  # members at other offsets
        with open(path, "r+b") as f:  # in place: same inode, other bytes
            f.truncate(0)
            f.write(new)
        with pytest.raises(StorageError, match="changed since it was opened") as info:
            arr[:]
        assert info.value.context["path"] == path
        assert stoker.open_array(f"{path}/a")[:].tolist() == [2] * 16  # opened again: the new archive
    finally:
        stores.close()
    # a pipeline opens each array once: a batch after the rewrite fails, it does not read the new bytes
    with open(path, "wb") as f:
        f.write(archive(1, b""))
    cfg = stoker.Config(batch_size=2, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=60, lookahead_batches=1)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{path}/a", [(0, 16)])] * 2)
        batch = p.pop()
        assert torch.from_dlpack(batch).tolist() == [[1.0] * 16] * 2
        batch.release()
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(new)
        p.push([stoker.Sample(f"{path}/a", [(0, 16)])] * 2)
        with pytest.raises(StorageError, match="changed since it was opened"):
            p.pop()


def test_stores_kept_outside_a_pipeline_are_bounded(tmp_path):
    """Archives opened once and dropped do not keep their descriptors for the life of the process."""
    import gc

    from stoker.storage.locate import DEFAULT_MAX_STORES

    values = _small(str(tmp_path / "src"), 1, 4)
    n = 2 * DEFAULT_MAX_STORES + 20
    for i in range(n):
        _zip(str(tmp_path / f"{i}.zip"), values)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(n):
        assert stoker.open_array(str(tmp_path / f"{i}.zip/g.zarr/a"))[:].tolist() == [1] * 4
    gc.collect()
    held = len(os.listdir("/proc/self/fd")) - before
    assert held <= 2 * DEFAULT_MAX_STORES + 8  # a kept archive: its descriptor and zipfile's



def test_threads_opening_arrays_of_one_root_at_once_build_one_store(tree, monkeypatch):
    """A pipeline's opener threads open arrays of one root together: one ObjectStore is built (10-20 ms of
    CPU each), not one per thread with all but one thrown away; every thread gets that one."""
    from stoker.storage import objectstore

    built: list[int] = []
    real = objectstore.ObjectStore.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        time.sleep(0.05)  # a slow build: the other threads arrive while it runs
        real(self, *args, **kwargs)

    monkeypatch.setattr(objectstore.ObjectStore, "__init__", counted)
    stores = Stores()
    go = threading.Barrier(8)
    got: list = []

    def open_one(i: int) -> None:
        go.wait(timeout=10)
        got.append(stores.get(locate(f"{tree['http'].url}/{SAMPLE_ARRAYS[i % len(SAMPLE_ARRAYS)]}"), FAST)[0])

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert len(got) == 8 and len({id(s) for s in got}) == 1
        assert len(built) == 1, len(built)
    finally:
        stores.close()


def test_a_failed_first_build_leaves_one_store_built_for_the_threads_after_it(tree, monkeypatch):
    """The first thread's build fails (its open raises it) while a second waits for it: the second builds in
    its place, and a third arriving during that build waits for it and takes its store (before: the second
    held an orphaned lock, so the third built a store of its own, and one of the two was thrown away)."""
    from stoker.storage import objectstore

    built: list[str] = []
    real = objectstore.ObjectStore.__init__
    lock = threading.Lock()
    building = [threading.Event(), threading.Event()]  # the first build began, the second build began

    def slow_then_fail_first(self, *args, **kwargs):
        with lock:
            first = not built
            built.append("failed" if first else "built")
            building[len(built) - 1].set()
        time.sleep(0.4)  # a slow build: the other threads arrive while it runs
        if first:
            raise OSError("credential provider refused")
        real(self, *args, **kwargs)

    monkeypatch.setattr(objectstore.ObjectStore, "__init__", slow_then_fail_first)
    stores = Stores()
    got: dict[int, object] = {}

    def open_one(i: int) -> None:
        try:
            got[i] = stores.get(locate(f"{tree['http'].url}/{SAMPLE_ARRAYS[i]}"), FAST)[0]
        except OSError as exc:
            got[i] = exc

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(3)]
    try:
        # the 2nd arrives once the failing build began, and waits for it; the 3rd once the 2nd's build began (a
        # loaded machine may start a thread late: a sleep let the 2nd arrive first, and build what failed)
        threads[0].start()
        assert building[0].wait(10)
        threads[1].start()
        assert building[1].wait(10)
        threads[2].start()
        for t in threads:
            t.join(timeout=30)
        assert isinstance(got[0], OSError)  # the first open says what its build met
        assert got[1] is got[2] and not isinstance(got[1], Exception)
        assert built == ["failed", "built"], built
    finally:
        stores.close()


# -- pipelines ------------------------------------------------------------------------------------

CROP = (9, 20)
SAMPLE_ARRAYS = ["g3.zarr/zstd", "g3.zarr/sub/sharded", "g3.zarr/sharded_blosc", "g2.zarr/blosc",
                 "g2.zarr/zlib_f", "g2.zarr/nested", "g3.zarr/gzip_t"]


def samples(prefix: str) -> list:
    rng = np.random.default_rng(5)
    out = []
    for k in range(24):
        path = SAMPLE_ARRAYS[k % len(SAMPLE_ARRAYS)]
        y, x = int(rng.integers(0, SHAPE[0] - CROP[0] + 1)), int(rng.integers(0, SHAPE[1] - CROP[1] + 1))
        out.append(stoker.Sample(f"{prefix}/{path}", [(y, y + CROP[0]), (x, x + CROP[1])]))
    return out


def run_pipeline(prefix: str, options: dict | None = None, **cfg) -> list[torch.Tensor]:
    cfg = stoker.Config(batch_size=4, dtype="f32", lossy_casts=True, n_compute_threads=2, pop_timeout_s=30,
                        host_buffer_bytes=64 << 20, storage_options=options, **cfg)
    out = []
    with stoker.Pipeline(cfg) as p:
        todo = samples(prefix)
        p.push(todo)
        for _ in range(len(todo) // 4):
            b = p.pop()
            out.append(torch.from_dlpack(b).clone())
            b.release()
    return out


def _prefix(tree, kind):
    if kind == "s3":
        return f"s3://{BUCKET}/{PREFIX}", {f"s3://{BUCKET}/": {**tree["s3"].options, **FAST}}
    if kind == "http":
        return tree["http"].url, {tree["http"].url + "/": FAST}
    return tree["zip"], None


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_batches_equal_local(tree, kind, decode_path, monkeypatch):
    local = run_pipeline(tree["root"])
    prefix, options = _prefix(tree, kind)
    # which path decodes the fetched chunks: the compiled engine (from the fetched buffers) where it is built
    engine, python = [], []
    fetched, decode = NativeDecoder._fetched, PythonDecoder._decode
    monkeypatch.setattr(NativeDecoder, "_fetched", lambda self, job, fetch, *a, **k: engine.append(len(fetch.cids))
                        or fetched(self, job, fetch, *a, **k))
    monkeypatch.setattr(PythonDecoder, "_decode", lambda self, job, task, *a: python.append(task.key) or
                        decode(self, job, task, *a))
    got = run_pipeline(prefix, options, requests_in_flight=3)
    assert len(got) == len(local) == 6
    for a, b in zip(got, local):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    if decode_path == "engine":  # every sampled array has a codec the engine decodes: none decoded in Python
        assert sum(engine) > 6 and not python, (engine, python)
    else:
        assert not engine and python


def test_requests_in_flight_is_validated():
    with pytest.raises(InvalidArgument, match="requests_in_flight"):
        stoker.Config(requests_in_flight=0)
    with pytest.raises(InvalidArgument, match="storage_options"):
        stoker.Config(storage_options={"/local/": {}})
    with pytest.raises(InvalidArgument, match="storage_options"):
        stoker.Config(storage_options=[1])


def test_503_storm_is_retried_to_success_through_a_pipeline(tree):
    server = RangeServer(tree["root"])
    try:
        local = run_pipeline(tree["root"])
        server.fail(12, 503)
        opts = {server.url + "/": {**FAST, "retries": 20}}
        got = run_pipeline(server.url, opts)
        assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(got, local))
        assert server.requests > 12
    finally:
        server.stop()


def test_server_stopped_mid_run_is_a_storage_error_at_pop(tree):
    server = RangeServer(tree["root"])
    opts = {server.url + "/": {**FAST, "retries": 1, "timeout_s": 2.0, "connect_timeout_s": 1.0}}
    cfg = stoker.Config(batch_size=4, dtype="f32", lossy_casts=True, n_compute_threads=2, pop_timeout_s=60,
                        host_buffer_bytes=64 << 20, storage_options=opts, lookahead_batches=1)
    try:
        with stoker.Pipeline(cfg) as p:
            todo = samples(server.url)
            p.push(todo[:4])
            p.pop().release()
            server.stop()
            p.push(todo[4:8])
            with pytest.raises(StorageError) as info:
                p.pop()
            assert server.url in str(info.value) and info.value.context.get("key")
    finally:
        server.stop()


def test_close_mid_batch_cancels_requests_in_flight(tree):
    server = RangeServer(tree["root"])
    opts = {server.url + "/": {**FAST, "timeout_s": 60.0}}
    cfg = stoker.Config(batch_size=4, dtype="f32", lossy_casts=True, n_compute_threads=2, pop_timeout_s=60,
                        host_buffer_bytes=64 << 20, storage_options=opts, lookahead_batches=1)
    try:
        p = stoker.Pipeline(cfg)
        todo = samples(server.url)
        p.push(todo[:4])
        p.pop().release()  # metadata and the first chunks read at no latency
        server.latency_s = 30.0
        p.push(todo[4:8])
        deadline = time.monotonic() + 10
        while server.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.in_flight > 0  # the batch's requests are waiting on the server
        job = p._coordinator.inflight[0].job
        t0 = time.monotonic()
        p.close()
        assert time.monotonic() - t0 < 5  # far below the server's 30 s
        assert job.wait(5)  # the fetch was cancelled, not left waiting for the server
        assert isinstance(job.error, ShutdownError)
    finally:
        server.latency_s = 0
        server.stop()


# -- records and inspect ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Two record datasets written by zarr-python: v3 consolidated at the root, and v2 not consolidated."""
    base = str(tmp_path_factory.mktemp("records"))
    rng = np.random.default_rng(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fmt in (("rec3", 3), ("rec2", 2)):
            root = zarr.open_group(os.path.join(base, name), mode="w", zarr_format=fmt)
            for i in range(3):
                g = root.create_group(f"run_{i:03d}")
                n = 5 + i
                g.create_array("positions", shape=(4, n, 3), chunks=(2, 4, 3), dtype="float32")[...] = \
                    rng.random((4, n, 3)).astype("float32")
                g.create_array("cells", shape=(n, 2), chunks=(3, 2), dtype="int32")[...] = \
                    rng.integers(0, 9, (n, 2)).astype("int32")
        zarr.consolidate_metadata(os.path.join(base, "rec3"))
    values = read_tree(base)
    s3 = MotoS3(values, RECORDS)
    http = RangeServer(base)
    yield {"root": base, "s3": s3, "http": http}
    http.stop()
    s3.stop()


@pytest.mark.parametrize("name", ["rec3", "rec2"])
def test_record_datasets_over_s3_equal_local(records, name):
    from stoker.records import ZarrRecords

    local = ZarrRecords(os.path.join(records["root"], name), fields={"positions": ("T", "N", 3), "cells": ("N", 2)})
    remote_ds = ZarrRecords(f"s3://{BUCKET}/{RECORDS}/{name}", fields={"positions": ("T", "N", 3), "cells": ("N", 2)},
                            storage_options={**records["s3"].options, **FAST})
    assert len(remote_ds) == len(local) == 3
    assert remote_ds.metadata(1).name == "run_001"
    for i in range(3):
        a, b = local[i], remote_ds[i]
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].numpy().tobytes() == b[k].numpy().tobytes()
    import pickle
    copy = pickle.loads(pickle.dumps(remote_ds))  # a worker's copy opens its own store
    assert copy[2]["cells"].numpy().tobytes() == local[2]["cells"].numpy().tobytes()


@pytest.mark.parametrize("kind", ["s3", "zip"])
def test_records_are_found_by_one_level_listings_not_every_chunk_key(records, kind, tmp_path, monkeypatch):
    """Finding a dataset's records lists one level (a delimiter listing: a request per 1,000 records),
    never the keys of every chunk of every record."""
    from stoker.records import ZarrRecords
    from stoker.storage import ObjectStore, ZipStore

    cls = ObjectStore if kind == "s3" else ZipStore
    listed: list[tuple[str, list[str]]] = []
    real = cls.list_dir

    def spy(self, prefix=""):
        keys, folders = real(self, prefix)
        listed.append((prefix, keys + folders))
        return keys, folders

    def deep(self, prefix=""):
        raise AssertionError(f"deep listing of {prefix!r}")

    monkeypatch.setattr(cls, "list_dir", spy)
    monkeypatch.setattr(cls, "list", deep)
    if kind == "s3":
        root, options = f"s3://{BUCKET}/{RECORDS}/rec2", {**records["s3"].options, **FAST}
    else:
        archive = str(tmp_path / "rec2.zip")
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
            for key, value in sorted(read_tree(os.path.join(records["root"], "rec2")).items()):
                zf.writestr(key, value)
        root, options = archive, None
    ds = ZarrRecords(root, storage_options=options)  # fields found in the first record: a second listing
    local = ZarrRecords(os.path.join(records["root"], "rec2"))
    assert len(ds) == 3 and sorted(ds[0].keys()) == sorted(local[0].keys()) == ["cells", "positions"]
    top = f"{RECORDS}/rec2" if kind == "s3" else ""
    assert [p for p, _ in listed] == [top, f"{top}/run_000".lstrip("/")]
    seen = [key for _, keys in listed for key in keys]
    assert not [k for k in seen if "/c/" in k or k.rsplit("/", 1)[-1][:1].isdigit()], seen  # no chunk key


def test_record_names_a_uri_would_decode_read_their_own_record(records, tmp_path):
    """A remote URI's path is percent-decoded: listed names holding '%', '?', '#' or a space are encoded when
    made into URIs, so each record reads its own data (not 'x y.zarr' for 'x%20y.zarr'), in a store as locally."""
    from stoker.records import ZarrRecords

    names = ["x y.zarr", "x%20y.zarr", "q?.zarr", "r#1.zarr", "e\u0301.zarr"]
    base = str(tmp_path / "odd")
    for i, name in enumerate(names):
        g = zarr.open_group(os.path.join(base, name), mode="w")
        g.create_array("p", shape=(4, 2), chunks=(2, 2), dtype="float32")[...] = np.full((4, 2), i, "float32")
    for key, value in read_tree(base).items():
        records["s3"].client.put_object(Bucket=BUCKET, Key=f"{RECORDS}/odd/{key}", Body=value)
    local = ZarrRecords(base)
    remote_ds = ZarrRecords(f"s3://{BUCKET}/{RECORDS}/odd", storage_options={**records["s3"].options, **FAST})
    assert sorted(remote_ds.metadata(i).name for i in range(len(remote_ds))) == sorted(names)
    for ds in (local, remote_ds):
        for i in range(len(ds)):
            want = names.index(ds.metadata(i).name)
            assert ds[i]["p"].numpy().tolist() == [[want, want]] * 4, (ds.metadata(i).name, ds.root)


def test_record_datasets_in_a_zip_archive_under_every_uri_form(records, tmp_path):
    """The archive found along a ``zip://`` path without ``!`` too, as along a plain path."""
    from stoker.records import ZarrRecords

    whole, flat = str(tmp_path / "all.zip"), str(tmp_path / "rec3.zip")  # records in a folder; at the root
    for archive, prefix in ((whole, ""), (flat, "rec3/")):
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
            for key, value in sorted(read_tree(records["root"]).items()):
                if key.startswith(prefix):
                    zf.writestr(key[len(prefix):], value)
    local = ZarrRecords(os.path.join(records["root"], "rec3"))
    for root in (f"{whole}/rec3", f"zip://{whole}!/rec3", f"zip://{whole}/rec3", flat, f"zip://{flat}!",
                 f"zip://{flat}", f"zip://{flat}/"):
        ds = ZarrRecords(root)
        assert len(ds) == len(local) == 3, root
        for i in range(3):
            a, b = local[i], ds[i]
            assert a.keys() == b.keys() and all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a), root


def test_record_dataset_over_http_needs_consolidated_metadata(records):
    from stoker.errors import UnsupportedFormat
    from stoker.records import ZarrRecords

    http = records["http"]
    before = http.requests
    ds = ZarrRecords(f"{http.url}/rec3", fields=["positions", "cells"])
    assert len(ds) == 3 and ds[0]["cells"].shape[1] == 2
    assert http.requests - before <= 1 + 3 * 2 * 2  # the root's zarr.json, then only chunks of record 0
    # later samples cost their chunks only: the dataset keeps its stores' metadata, as a pipeline does
    chunks = sum(len(files) for folder, _, files in os.walk(os.path.join(records["root"], "rec3/run_001"))
                 if "c" in folder.split(os.sep))
    before = http.requests
    assert ds[1]["cells"].shape == (6, 2)
    assert http.requests - before == chunks
    with pytest.raises(UnsupportedFormat, match="consolidate"):
        ZarrRecords(f"{http.url}/rec2")  # an HTTP server cannot be listed


def _record_uri(records, kind: str, tmp_path) -> tuple[str, dict | None]:
    """rec3 in a store of ``kind``: its URI and storage options (the S3 secret is a marker to look for)."""
    if kind == "s3":
        return (f"s3://{BUCKET}/{RECORDS}/rec3",
                {**records["s3"].options, "secret_access_key": "SECRET-d41d8cd9", **FAST})
    if kind == "http":
        return f"{records['http'].url}/rec3", None
    archive = str(tmp_path / "rec3.zip")
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, value in sorted(read_tree(os.path.join(records["root"], "rec3")).items()):
            zf.writestr(key, value)
    return archive, None


@pytest.mark.parametrize("kind", KINDS)
def test_stats_of_a_store_dataset_are_cached_in_the_local_cache(records, kind, tmp_path, monkeypatch):
    """compute_stats on a dataset in a store keeps its result in $STOKER_CACHE, keyed by the dataset and the
    fingerprint: a second call reads no record, other fields are a new entry, and no secret is written."""
    from stoker.records import ZarrRecords, compute_stats
    from stoker.storage.artifacts import dataset_dir

    cache = tmp_path / "cache"
    monkeypatch.setenv("STOKER_CACHE", str(cache))
    uri, options = _record_uri(records, kind, tmp_path)
    spec = {"positions": ("T", "N", 3), "cells": ("N", 2)}
    local = ZarrRecords(os.path.join(records["root"], "rec3"), fields=spec)
    ds = ZarrRecords(uri, fields=spec, storage_options=options)
    reads = []
    real = ZarrRecords.read
    monkeypatch.setattr(ZarrRecords, "read", lambda self, i, *a, **k: reads.append(i) or real(self, i, *a, **k))

    first = compute_stats(ds, ["positions"])
    assert reads, "the first call reads the records"
    want = compute_stats(local, ["positions"], cache=False)
    assert first["positions"].mean.numpy().tobytes() == want["positions"].mean.numpy().tobytes()
    folder = dataset_dir(uri, options)
    assert folder.parent.parent == cache and (folder / ".stoker-stats.json").is_file()

    reads.clear()
    again = compute_stats(ZarrRecords(uri, fields=spec, storage_options=options), ["positions"])
    assert reads == [], "a matching entry is reused without reading a record"
    assert again["positions"].std.numpy().tobytes() == first["positions"].std.numpy().tobytes()

    both = compute_stats(ds, ["positions", "cells"])  # another fingerprint: computed, kept beside the first
    assert reads and both["cells"].mean.numpy().tobytes() == \
        compute_stats(local, ["cells"], cache=False)["cells"].mean.numpy().tobytes()
    reads.clear()
    compute_stats(ds, ["positions"])
    compute_stats(ds, ["positions", "cells"])
    assert reads == []
    for path in cache.rglob("*"):
        assert "SECRET" not in str(path) and (path.is_dir() or b"SECRET" not in path.read_bytes()), path


def test_store_dataset_cache_folders_name_the_dataset_and_its_endpoint(tmp_path, monkeypatch):
    """One folder per dataset whatever URI form names it; another endpoint or prefix is another dataset."""
    from stoker.storage.artifacts import dataset_dir, dataset_identity

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT", raising=False)
    archive = tmp_path / "d.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("recs/zarr.json", b"{}")
    forms = {dataset_dir(u) for u in (f"{archive}/recs", f"zip://{archive}!/recs", f"zip://{archive}/recs/")}
    assert len(forms) == 1
    a = dataset_dir("s3://b/recs", {"endpoint": "http://127.0.0.1:9000", "secret_access_key": "x"})
    assert a == dataset_dir("s3://b/recs/", {"endpoint": "http://127.0.0.1:9000", "secret_access_key": "y"})
    assert a != dataset_dir("s3://b/recs", {"endpoint": "http://127.0.0.1:9001"})
    assert a != dataset_dir("s3://b/other", {"endpoint": "http://127.0.0.1:9000"})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert dataset_dir("s3://b/recs") == a  # the endpoint from the environment counts as one given
    ident = dataset_identity("https://host/recs", {"default_headers": {"Authorization": "Bearer T0KEN"}})
    assert "T0KEN" not in json.dumps(ident)


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_reads_remote_arrays(tree, kind, monkeypatch):
    from stoker.cli.inspect import facts

    if kind == "s3":  # credentials and endpoint from the standard environment, as a user's would be
        monkeypatch.setenv("AWS_ENDPOINT_URL", tree["s3"].endpoint)
        monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
    for path in ("g3.zarr/sub/sharded", "g2.zarr/blosc"):
        uri = remote(tree, kind, path)[0]
        got = facts(uri, (8, 8))
        want = facts(os.path.join(tree["root"], path), (8, 8))
        assert got.pop("uri") == uri
        want.pop("uri")
        assert got == want


def test_inspect_cli_takes_storage_options_and_never_prints_them(tree, monkeypatch, capsys):
    import json

    from stoker.cli import main

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)  # only the flags say where the server is
    secret = "s3cr3t-never-printed"
    uri = f"s3://{BUCKET}/{PREFIX}/g2.zarr/blosc"
    flags = [f"--storage-option=endpoint={tree['s3'].endpoint}", "--storage-option", "allow_http=true",
             "--storage-option", "region=us-east-1", "--storage-option", "access_key_id=testing",
             "--storage-option", f"secret_access_key={secret}", "--storage-option", "retries=1"]
    assert main(["inspect", uri, "--json", *flags]) == 0
    out, err = capsys.readouterr()
    got, want = json.loads(out), facts_of(os.path.join(tree["root"], "g2.zarr/blosc"))
    assert got.pop("uri") == uri and got == want
    assert secret not in out + err
    assert main(["inspect", uri, *flags, f"--storage-option=bogus_key={secret}"]) == 2  # obstore refuses the key
    out, err = capsys.readouterr()
    assert "bogus_key" in err and secret not in out + err
    with pytest.raises(SystemExit):
        main(["inspect", uri, "--storage-option", secret])  # no KEY=: a usage error that does not echo it
    out, err = capsys.readouterr()
    assert "KEY=VALUE" in err and secret not in out + err
    assert main(["inspect", uri, "--storage-option", "region=a", "--storage-option", "region=b"]) == 2
    assert "twice" in capsys.readouterr().err


def facts_of(path: str) -> dict:
    from stoker.cli.inspect import facts

    out = facts(path)
    out.pop("uri")
    return out


def test_sampler_over_many_arrays_of_a_consolidated_group_reads_its_metadata_once(tree):
    http = tree["http"]
    before = http.requests
    src = stoker.RandomCrops([f"{http.url}/{p}" for p in V3], CROP, storage_options={http.url: FAST})
    assert src.shapes == [SHAPE] * len(V3)
    assert http.requests - before == 1  # g3.zarr/zarr.json


def test_samplers_over_s3_give_the_local_batches(tree):
    prefix, options = _prefix(tree, "s3")
    paths = ["g3.zarr/sub/sharded", "g2.zarr/zlib_f"]

    def batches(root, opts):
        src = stoker.RandomCrops([f"{root}/{p}" for p in paths], CROP, seed=3, samples_per_epoch=8,
                                 storage_options=opts)
        grid = stoker.TileGrid([f"{root}/{p}" for p in paths], CROP, storage_options=opts)
        assert src.shapes == grid.shapes == [SHAPE, SHAPE]
        cfg = stoker.Config(batch_size=4, n_compute_threads=2, host_buffer_bytes=64 << 20, storage_options=opts)
        out = []
        with stoker.Pipeline(cfg) as p:
            p.push(src.for_rank(0, 1))
            for _ in range(2):
                b = p.pop()
                out.append(torch.from_dlpack(b).clone())
                b.release()
        return out

    local, got = batches(tree["root"], None), batches(prefix, options)
    assert [a.numpy().tobytes() for a in got] == [a.numpy().tobytes() for a in local]


def test_requests_in_flight_caps_the_pipelines_open_requests(tree):
    server = RangeServer(tree["root"])
    try:
        server.latency_s = 0.05  # requests overlap: the cap, not the server, bounds them
        got = run_pipeline(server.url, {server.url + "/": FAST}, requests_in_flight=2)
        assert len(got) == 6
        assert 1 <= server.peak_in_flight <= 2
    finally:
        server.latency_s = 0
        server.stop()


def test_a_batchs_new_remote_arrays_are_opened_together(tree, monkeypatch):
    # A batch's arrays not open yet are opened at once, their metadata requests overlapping: the first two
    # opens must be under way together to pass the barrier (one after the other, the first would wait
    # alone until the barrier breaks, and its batch fail).
    import stoker.engine.pipeline.coordinator as coordinator

    real, barrier, lock, opened = coordinator.open_array, threading.Barrier(2, timeout=20), threading.Lock(), []

    def open_array(uri, *args, **kwargs):
        with lock:
            opened.append(uri)
            first_two = len(opened) <= 2
        if first_two:
            barrier.wait()
        return real(uri, *args, **kwargs)

    monkeypatch.setattr(coordinator, "open_array", open_array)
    prefix, options = _prefix(tree, "http")
    got = run_pipeline(prefix, options)
    assert len(got) == 6 and not barrier.broken
    assert [a.numpy().tobytes() for a in got] == [a.numpy().tobytes() for a in run_pipeline(tree["root"])]


class _MeetingServer(RangeServer):
    """Once armed, holds the next two requests until both have arrived (or the barrier breaks)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.barrier = threading.Barrier(2, timeout=15)
        self.armed = 0

    def next_fault(self):
        with self._lock:
            meet = self.armed > 0
            self.armed -= meet
        if meet:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                pass
        return super().next_fault()


def test_fetches_in_flight_are_not_bounded_by_io_threads(tree):
    # One I/O thread, two batches of one chunk each: both fetches are in flight together (the thread only
    # starts them), so the server sees both requests before it answers either. A thread waiting for the
    # first answer would leave the second request unsent until the barrier broke.
    server = _MeetingServer(tree["root"])
    try:
        cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_io_threads=1, n_compute_threads=1, lookahead_batches=3,
                            pop_timeout_s=60, host_buffer_bytes=64 << 20,
                            storage_options={server.url + "/": {**FAST, "timeout_s": 40.0}})  # no retry meets it
        uri = f"{server.url}/g3.zarr/zstd"
        with stoker.Pipeline(cfg) as p:
            p.push(stoker.Sample(uri, [(0, 4), (0, 4)]))  # opens the array
            p.pop().release()
            server.armed = 2
            p.push([stoker.Sample(uri, [(16, 20), (0, 4)]), stoker.Sample(uri, [(0, 4), (16, 20)])])
            got = [torch.from_dlpack(p.pop()).clone() for _ in range(2)]
        assert not server.barrier.broken
        local = stoker.open_array(os.path.join(tree["root"], "g3.zarr/zstd"))
        assert np.array_equal(got[0][0].numpy(), local[16:20, 0:4].astype(np.float32))
        assert np.array_equal(got[1][0].numpy(), local[0:4, 16:20].astype(np.float32))
    finally:
        server.stop()


def test_transform_never_runs_on_the_stores_event_loop_thread(tree):
    # A batch of missing chunks only (plain2.zarr's rows 32.. were never written): nothing to decode, so the
    # fetch's completion would fill and finish the batch, and run the transform, right on the event-loop
    # thread every object store shares (stalling every store's requests while it runs).
    names = []

    def transform(batch):
        names.append(threading.current_thread().name)
        return batch

    prefix, options = _prefix(tree, "http")
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=30,
                        host_buffer_bytes=16 << 20, transform=transform, storage_options=options)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{prefix}/plain2.zarr", [(32, 40), (0, 16)]) for _ in range(3)])
        got = []
        for _ in range(3):
            b = p.pop()
            got.append(torch.from_dlpack(b).clone())
            b.release()
    assert len(names) == 3 and not any(n.startswith("stoker-objectstore") for n in names), names
    assert all(bool((g == -1).all()) for g in got)


def test_a_failed_concurrent_open_is_not_tried_again(tree):
    # Two arrays new to the pipeline are opened together; their metadata answers 503 for ever. Each open
    # costs one retry budget (retries=2: 3 requests), once: not a second time by an open one after the other.
    server = RangeServer(tree["root"])
    cfg = stoker.Config(batch_size=2, dtype="f32", lossy_casts=True, pop_timeout_s=60, host_buffer_bytes=16 << 20,
                        storage_options={server.url + "/": FAST})
    try:
        server.fail(1000, 503)
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(f"{server.url}/g3.zarr/zstd", [(0, 4), (0, 4)]),
                    stoker.Sample(f"{server.url}/g2.zarr/blosc", [(0, 4), (0, 4)])])
            with pytest.raises(StorageError) as info:
                p.pop()
        assert info.value.status == 503 and info.value.attempts == 3
        assert "g3.zarr" in info.value.key  # the first array's failure, in sample order
        assert server.requests == 2 * 3
    finally:
        server.stop()


def test_closed_stores_open_no_more(tree):
    # A pipeline's stores are closed with it; a store opened after that would never be closed.
    uri, options = remote(tree, "http", "g3.zarr/zstd")
    stores = Stores()
    kv, _ = stores.get(locate(uri), options)
    stores.close()
    with pytest.raises(ShutdownError) as info:
        stores.get(locate(uri), options)
    assert info.value.context["uri"] == uri
    with pytest.raises(ShutdownError):
        kv.get("g3.zarr/zstd/zarr.json")  # the store it held is closed too
    with pytest.raises(ShutdownError):
        stoker.open_array(uri, options, stores=stores)


def test_array_uris_with_credentials_are_refused_never_printed(tree):
    # An array URI is in every message about it and in ArrayReader.uri: no user:password, no query in it.
    host = tree["http"].url.split("://", 1)[1]
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, pop_timeout_s=30, host_buffer_bytes=16 << 20)
    for uri in (f"http://user:s3cr3tpw@{host}/g3.zarr/zstd", f"{tree['http'].url}/g3.zarr/zstd?sig=s3cr3tpw"):
        with pytest.raises(InvalidArgument) as info:
            stoker.open_array(uri, FAST, stores=Stores())
        assert "s3cr3tpw" not in str(info.value) and "s3cr3tpw" not in info.value.context["uri"]
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, [(0, 4), (0, 4)])])
            with pytest.raises(InvalidArgument) as info:
                p.pop()
        assert "s3cr3tpw" not in str(info.value)


# -- round trips: a batch's shard indexes, and a box's chunks, fetched together ---------------------------------

MANY_SHAPE = (32, 32)
MANY_FILL = 9


class _Many:
    """An array of 16 shards of 2 x 2 inner chunks (``many.zarr``; its last row of shards never written,
    missing) and an unsharded one (``plain.zarr``) written by zarr-python under ``root``, read over HTTP
    or from a zip archive (made when first asked for, so shards damaged before are damaged in it too)
    through a :class:`CountingStore`."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.data = (np.arange(32 * 32, dtype="uint16") * 7).reshape(MANY_SHAPE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for path, kw in (("many.zarr", dict(shards=(8, 8))), ("plain.zarr", {})):
                z = zarr.create_array(os.path.join(root, path), shape=MANY_SHAPE, chunks=(4, 4), dtype="uint16",
                                      fill_value=MANY_FILL, compressors=ZstdCodec(level=1), **kw)
                z[:24] = self.data[:24]
        self.server = RangeServer(root)
        self.stores = Stores()
        self._zip: str | None = None

    def open(self, kind: str, path: str):
        from stoker.storage import CountingStore

        if kind == "http":
            uri, options = f"{self.server.url}/{path}", dict(FAST)
        else:
            if self._zip is None:
                self._zip = self.root + ".zip"
                _zip(self._zip, read_tree(self.root))
            uri, options = f"{self._zip}/{path}", None
        arr = stoker.open_array(uri, options, stores=self.stores)  # its own index cache: every index cold
        arr.kv = CountingStore(arr.kv)
        return arr

    def local(self, path: str):
        return stoker.open_array(os.path.join(self.root, path))

    def close(self) -> None:
        self.stores.close()
        self.server.stop()


@pytest.fixture
def many(tmp_path):
    m = _Many(str(tmp_path / "many"))
    yield m
    m.close()


def _planner():
    from stoker.engine.planning.tables import plan_tables

    return plan_tables


def _shard_samples(uri: str, shards: list[tuple[int, int]]) -> list:
    """One sample per shard (grid position), the whole shard."""
    return [stoker.Sample(uri, [(8 * i, 8 * i + 8), (8 * j, 8 * j + 8)]) for i, j in shards]


def _located(plan) -> list[tuple]:
    """Where each chunk of a plan is stored: (key, offset, length), None for the fill value."""
    return [(t.key, t.offset, t.length) if t.path is not None else (t.key, None) for t in
            (plan.chunks[i] for i in range(plan.n_chunks))]


ALL_SHARDS = [(i, j) for i in range(4) for j in range(4)]


@pytest.mark.parametrize("kind", ["http", "zip"])
def test_a_batchs_shard_indexes_cost_one_store_call(many, kind):
    # 16 shards (4 of them missing): their indexes are asked in one call, not one call (a round trip) each;
    # every chunk is located where the local plan locates it; planned again, nothing is read.
    plan = _planner()
    arr, local = many.open(kind, "many.zarr"), many.local("many.zarr")
    got = plan(0, _shard_samples(arr.uri, ALL_SHARDS), lambda uri: arr)
    assert (arr.kv.counters.calls, arr.kv.counters.requests) == (1, 16)
    want = plan(0, _shard_samples(local.uri, ALL_SHARDS), lambda uri: local)
    assert _located(got) == _located(want) and sum(t[1] is None for t in _located(got)) == 16
    arr.kv.reset()
    assert _located(plan(1, _shard_samples(arr.uri, ALL_SHARDS), lambda uri: arr)) == _located(want)
    assert arr.kv.counters.calls == 0


@pytest.mark.parametrize("kind", ["http", "zip"])
def test_a_damaged_shard_index_fails_its_first_chunk_and_costs_the_others_nothing(many, kind):
    plan = _planner()
    shards = os.path.join(many.root, "many.zarr", "c")
    raw = bytearray(open(os.path.join(shards, "1", "2"), "rb").read())
    raw[-5] ^= 0xFF  # its index fails its checksum
    open(os.path.join(shards, "1", "2"), "wb").write(bytes(raw))
    open(os.path.join(shards, "2", "1"), "wb").write(b"short")  # shorter than its index
    open(os.path.join(shards, "0", "3"), "wb").write(b"")  # empty (a server answers 416 to its index range)
    # what reading each index alone raises (the reads one at a time of before): the same error, typed
    alone = many.open(kind, "many.zarr")
    local = many.local("many.zarr")
    errors = {}
    for key in ("c/1/2", "c/2/1", "c/0/3"):
        with pytest.raises(stoker.StokerError) as info:
            alone.shard_entry(key)
        errors[key] = info.value
        # corrupt data, as the local read says it: a DecodeError naming the shard, not a storage failure
        assert type(info.value) is stoker.DecodeError and info.value.key == key, info.value
        with pytest.raises(stoker.DecodeError) as here:
            local.shard_entry(key)
        if key != "c/1/2":  # (a checksum message names the sums, which the two reads see alike anyway)
            assert str(info.value).replace(alone.uri, "") == str(here.value).replace(local.uri, "")
    assert "is truncated: 5 bytes, but its index alone needs" in str(errors["c/2/1"])
    assert "is truncated: 0 bytes" in str(errors["c/0/3"])
    good = [s for s in ALL_SHARDS if s not in ((1, 2), (2, 1), (0, 3))]
    arr = many.open(kind, "many.zarr")
    for order, first in (([(1, 2), (2, 1)], "c/1/2"), ([(2, 1), (1, 2)], "c/2/1")):
        samples = _shard_samples(arr.uri, good[:5] + order[:1] + good[5:9] + order[1:] + good[9:])
        with pytest.raises(type(errors[first])) as info:
            plan(0, samples, lambda uri: arr)
        assert str(info.value) == str(errors[first])  # the first damaged shard in the batch's chunk order
    samples = _shard_samples(arr.uri, good[:3] + [(0, 3)] + good[3:])
    with pytest.raises(stoker.DecodeError, match="is truncated: 0 bytes"):  # read in the batch's one call too
        plan(0, samples, lambda uri: many.open(kind, "many.zarr"))
    # nothing else lost: every good shard's index was read (together) and kept
    arr.kv.reset()
    got = plan(1, _shard_samples(arr.uri, good), lambda uri: arr)
    assert arr.kv.counters.calls == 0
    assert _located(got) == _located(plan(1, _shard_samples(local.uri, good), lambda uri: local))


@pytest.mark.parametrize("kind", ["http", "zip"])
def test_reading_a_box_costs_one_call_for_its_indexes_and_one_for_its_chunks(many, kind, monkeypatch):
    import stoker.reader.array

    boxes = ((slice(3, 29), slice(1, 30)), (slice(0, 32), slice(0, 32)), (slice(25, 27), slice(5, 6)))
    # the shards: indexes, then chunks (none for the last box: its shard is missing); unsharded: the chunks
    for path, calls in (("many.zarr", (2, 2, 1)), ("plain.zarr", (1, 1, 1))):
        ref = zarr.open_array(os.path.join(many.root, path), mode="r")
        for box, n in zip(boxes, calls):
            arr = many.open(kind, path)
            assert bits(arr[box]) == bits(ref[box]), (path, box)
            assert arr.kv.counters.calls == n, (path, box)
    # a box whose chunks are more than one call fetches: several calls, the same values
    monkeypatch.setattr(stoker.reader.array, "STORE_READ_BYTES", 100)
    for path in ("many.zarr", "plain.zarr"):
        arr = many.open(kind, path)
        assert bits(arr[...]) == bits(zarr.open_array(os.path.join(many.root, path), mode="r")[...])
        assert arr.kv.counters.calls > 10
def test_a_fetch_reserves_what_it_holds(tmp_path, decode_path, monkeypatch):
    # A column of inner chunks of one shard in a zip archive: the store fetches them as one read, the gaps
    # between them included (its max_gap), and that is what the fetch holds until its chunks are decoded: the
    # reservation covers it (not just the chunks' own bytes).
    from store_fixtures import write_zip

    root = str(tmp_path / "src")
    z = zarr.create_array(os.path.join(root, "s.zarr"), shape=(40, 40), chunks=(4, 4), shards=(40, 40),
                          dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = np.arange(1600, dtype=np.uint16).reshape(40, 40) * 7
    write_zip(str(tmp_path / "a.zip"), read_tree(root))
    seen = []
    fetch = PythonDecoder._fetch

    def recorded(self, job, f, then, users):
        def record(job, f, values, parts, res):
            held = {id(memoryview(v).obj): memoryview(memoryview(v).obj).nbytes for v in values + parts if v is not None}
            seen.append((f.cost, sum(held.values()), sum(r.length for r in f.requests)))
            return then(job, f, values, parts, res)
        return fetch(self, job, f, record, users)

    monkeypatch.setattr(PythonDecoder, "_fetch", recorded)
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=30, host_buffer_bytes=16 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push(stoker.Sample(str(tmp_path / "a.zip/s.zarr"), [(0, 40), (0, 4)]))
        got = torch.from_dlpack(p.pop()).clone()
    assert np.array_equal(got[0].numpy(), z[:, :4].astype(np.float32))
    assert seen and all(cost >= held for cost, held, _ in seen), seen
    assert any(held > chunks for _, held, chunks in seen), seen  # gaps were fetched too


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5000), st.integers(0, 700)), max_size=30),
       st.integers(0, 600), st.sampled_from([1, 100, 1000, 1 << 40]))
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_span_bytes_is_what_the_stores_coalescing_fetches(ranges, gap, cap):
    # What a fetch reserves for its ranges covers what coalesce (the stores' merging, per key) reads, and is
    # exactly that with no cap on a read's length and no overlapping ranges.
    from types import SimpleNamespace

    from stoker.engine.cpu.decode_python import span_bytes
    from stoker.storage.ranges import coalesce

    kv = SimpleNamespace(max_gap=gap)
    keys, offsets, lengths = (np.array([r[i] for r in ranges], np.int64) for i in range(3))
    fetched = sum(read.length for k in set(keys.tolist())
                  for read in coalesce([(o, n) for key, o, n in ranges if key == k], gap, cap))
    got = span_bytes(kv, keys, offsets, lengths)
    overlap = any(k == k2 and o < o2 + n2 and o2 < o + n and n and n2
                  for i, (k, o, n) in enumerate(ranges) for k2, o2, n2 in ranges[:i])
    assert got >= fetched
    if cap == 1 << 40 and not overlap:
        assert got == fetched



def test_a_fetch_over_its_share_of_the_budget_is_split_where_gaps_would_coalesce(tmp_path, monkeypatch,
                                                                                 decode_path):
    # Fetch groups were cut by the chunks' lengths, but a fetch holds the gaps its store coalesces too: 8 inner
    # chunks of 128 KiB spread over their shard (under a store gap of 8 MiB), were one fetch
    # holding 3.75 MiB against a share of the budget of 3.5 MiB (and a batch past the budget failed). Every fetch
    # of more than one chunk now holds at most its share: a quarter of the transient budget.
    root = str(tmp_path / "src")
    z = zarr.create_array(os.path.join(root, "s.zarr"), shape=(8, 8 << 16), chunks=(1, 1 << 16),
                          shards=(8, 8 << 16), dtype="uint16", compressors=ZstdCodec(level=1), fill_value=0)
    z[...] = np.random.default_rng(3).integers(0, 2**16, (8, 8 << 16), dtype=np.uint16)
    server = RangeServer(root)
    seen = []
    fetch = PythonDecoder.fetch

    def recorded(self, job, f, then, users=1):
        seen.append((f.cost, len(f.cids), self.budget.capacity // 4))
        return fetch(self, job, f, then, users)

    monkeypatch.setattr(PythonDecoder, "fetch", recorded)
    cfg = stoker.Config(batch_size=8, dtype="native", n_compute_threads=1, pop_timeout_s=30,
                        host_buffer_bytes=16 << 20, lookahead_batches=1,
                        storage_options={server.url + "/": {**FAST, "max_gap": 8 << 20}})
    try:
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(server.url + "/s.zarr", [(r, r + 1), (0, 1 << 16)]) for r in range(8)])
            got = torch.from_dlpack(p.pop()).clone()
    finally:
        server.stop()
    assert np.array_equal(got[:, 0].numpy(), z[:, : 1 << 16])
    limit = seen[0][2]
    assert len(seen) > 1, seen  # one fetch of the 8 chunks would hold more than its share
    assert all(cost <= limit for cost, n, _ in seen if n > 1), seen


@pytest.fixture
def zipped(tmp_path) -> str:
    """The URI of an array of 8 zstd chunks (8 x 64 uint16) in a zip archive."""
    root = str(tmp_path / "src")
    z = zarr.create_array(os.path.join(root, "a.zarr"), shape=(8, 64), chunks=(8, 8), dtype="uint16",
                          compressors=ZstdCodec(level=1))
    z[...] = np.arange(512, dtype="uint16").reshape(8, 64)
    write_zip(str(tmp_path / "a.zip"), read_tree(root))
    return str(tmp_path / "a.zip/a.zarr")


def test_a_fetch_the_engine_refuses_fails_its_batch_with_that_error(zipped, monkeypatch):
    # A fetched group the engine could not take (its tables refused, memory short) failed the batch with an
    # UnboundLocalError of the hand-off's own, the real error only in its context.
    from stoker.engine.cpu import native

    if native.Engine is None:
        pytest.skip("the compiled engine is not built")
    tables = NativeDecoder._tables

    def refuse(self, *args, fetched=False, **kwargs):
        if fetched:
            raise MemoryError("no memory for the tables")
        return tables(self, *args, fetched=fetched, **kwargs)

    monkeypatch.setattr(NativeDecoder, "_tables", refuse)
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=2, pop_timeout_s=20)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(zipped, [(0, 8), (0, 64)])])
        with pytest.raises(MemoryError, match="no memory for the tables"):
            p.pop()


def test_a_fetch_handed_over_while_the_pipeline_closes_is_ended_not_left(zipped, monkeypatch):
    # A finished fetch submitted to the engine just as the pipeline closed was queued for a finisher that had
    # already left: its batch never ended and its reservation of the budget was never given back.
    from stoker.engine.cpu import native

    if native.Engine is None:
        pytest.skip("the compiled engine is not built")
    jobs = []
    fetched = NativeDecoder._fetched

    class ClosingEngine:  # the compiled engine, but the pipeline closes right after a submission
        def __init__(self, decoder, engine):
            self.decoder, self.engine = decoder, engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def submit(self, *args):
            bjob = self.engine.submit(*args)
            self.decoder.shutdown()  # between the engine's submission and the hand-over to the finisher
            return bjob

    def closing_meanwhile(self, job, *args, **kwargs):
        if not isinstance(self.engine, ClosingEngine):
            self.engine = ClosingEngine(self, self.engine)
        jobs.append(job)
        return fetched(self, job, *args, **kwargs)

    monkeypatch.setattr(NativeDecoder, "_fetched", closing_meanwhile)
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=2, pop_timeout_s=20)
    p = stoker.Pipeline(cfg)
    try:
        p.push([stoker.Sample(zipped, [(0, 8), (0, 64)])])
        deadline = time.monotonic() + 10
        while not jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert jobs and jobs[0].wait(5), "the batch never ended"
        assert isinstance(jobs[0].error, ShutdownError)
        budget = p._coordinator.executor.decoders.python.budget
        assert budget.reserved == 0
    finally:
        p.close()


def _index_first_array(root: str, cut: bool):
    """``root/a.zarr``: 32 x 32 uint16 in shards of 16 x 16 whose index comes first (8 x 8 zstd inner chunks);
    with ``cut``, its first shard loses its last 10 bytes, so its last inner chunks reach past its end."""
    from zarr.codecs import ShardingCodec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(os.path.join(root, "a.zarr"), shape=(32, 32), chunks=(16, 16), dtype="uint16",
                              serializer=ShardingCodec(chunk_shape=(8, 8), index_location="start",
                                                       codecs=[BytesCodec(), ZstdCodec(level=1)]),
                              compressors=None)
        z[:] = np.arange(32 * 32, dtype="uint16").reshape(32, 32)
    if cut:
        shard = os.path.join(root, "a.zarr", "c", "0", "0")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 10)
    return z


@pytest.mark.parametrize("kind", ["http", "zip"])
def test_a_shard_shorter_than_its_index_claims_is_the_local_read_s_decode_error(tmp_path, kind, decode_path,
                                                                               monkeypatch):
    """A shard cut short after its index (index at the start): the ranges of its last inner chunks reach past
    the value's end. The store's short read is that array's DecodeError naming the shard, as the local read
    says, in open_array, in a pipeline (either decode path) and in the GPU decode's staging."""
    from stoker.engine.pipeline import facade as pipelines
    from stoker.engine.gpu.executor import GpuDecodeExecutor

    root = str(tmp_path / "src")
    z = _index_first_array(root, cut=True)
    server = RangeServer(root) if kind == "http" else None
    stores = Stores()
    try:
        if kind == "http":
            uri, options = f"{server.url}/a.zarr", dict(FAST)
        else:
            _zip(str(tmp_path / "a.zip"), read_tree(root))
            uri, options = f"{tmp_path}/a.zip/a.zarr", None
        with pytest.raises(stoker.DecodeError, match="shard 'c/0/0' is shorter than its index claims") as info:
            stoker.open_array(uri, options, stores=stores)[:16, :16]
        assert info.value.key == "c/0/0" and info.value.uri == uri
        with pytest.raises(stoker.DecodeError, match="shorter than its index claims"):
            stoker.open_array(os.path.join(root, "a.zarr"))[:16, :16]  # the local read, for comparison
        assert stoker.open_array(uri, options, stores=stores)[16:, :].tolist() == z[16:, :].tolist()  # others read
        storage = {uri: options} if options else None
        cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=30,
                            storage_options=storage)
        for gpu in (False, True):
            if gpu:  # the GPU decode's executor on CPU tensors: its staging reads the store too
                monkeypatch.setattr(pipelines, "make_executor", lambda c, d, s, st: GpuDecodeExecutor.on_host(c, s, st))
            with stoker.Pipeline(cfg) as p:
                p.push([stoker.Sample(uri, [(0, 16), (0, 16)])])
                with pytest.raises(stoker.DecodeError, match="shard 'c/0/0' is shorter than its index claims"):
                    p.pop()
    finally:
        stores.close()
        if server is not None:
            server.stop()


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_precompute_on_a_remote_dataset_keeps_its_arrays_in_the_local_cache(records, kind, tmp_path, monkeypatch):
    """precompute over S3 and HTTP: the derived arrays go to the dataset's local cache folder (nothing is
    written to the server), and a new ZarrRecords asking for the field reads them there, in a worker's copy
    too; the secret among the storage options appears in no path or file."""
    import pickle

    from stoker.records import ZarrRecords, precompute

    cache = tmp_path / "cache"
    monkeypatch.setenv("STOKER_CACHE", str(cache))
    uri, options = _record_uri(records, kind, tmp_path)
    requests = records["http"].requests if kind == "http" else None
    ds = ZarrRecords(uri, fields=["positions", "cells"], storage_options=options)

    def count(sample):  # the number of points of the first step, per point: a small derived array
        return torch.full((sample["positions"].shape[1],), sample["positions"].shape[1], dtype=torch.int32)

    result = precompute(ds, "npoints", count, params={"v": 1})
    assert result.written == 3
    fresh = ZarrRecords(uri, fields=["cells", "npoints"], storage_options=options)
    for i in range(3):
        assert fresh[i]["npoints"].tolist() == [5 + i] * (5 + i)
        assert fresh[i]["cells"].shape == (5 + i, 2)
    assert pickle.loads(pickle.dumps(fresh))[2]["npoints"].tolist() == [7] * 7
    assert precompute(ds, "npoints", count, params={"v": 1}).skipped == 3
    if requests is not None:
        assert records["http"].requests > requests  # (it read over HTTP; a plain server takes no writes)
    for path in cache.rglob("*"):
        assert "SECRET" not in str(path) and (path.is_dir() or b"SECRET" not in path.read_bytes()), path


def test_a_short_shard_is_blamed_on_its_own_array_not_one_at_the_same_key_elsewhere(tmp_path, decode_path):
    """Two zip archives each holding ``a.zarr``, the second with a shard cut short: the batch's DecodeError
    names the second (the store that answered short), not the intact first, whose keys read the same."""
    uris = []
    for name, cut in (("one", False), ("two", True)):
        root = str(tmp_path / name)
        _index_first_array(root, cut)
        _zip(str(tmp_path / f"{name}.zip"), read_tree(root))
        uris.append(str(tmp_path / f"{name}.zip" / "a.zarr"))
    cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=30)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uris, [(0, 16), (0, 16)])])
        with pytest.raises(stoker.DecodeError, match="shorter than its index claims") as info:
            p.pop()
    assert info.value.uri == uris[1], info.value


def test_a_remote_v3_array_s_zarr_json_is_requested_once_for_its_metadata_and_attributes(tmp_path):
    """A pipeline decoding CF attributes (Config.cf, the default) reads them from the zarr.json its metadata
    came from: one request for that document, not a second one for the attributes; and they are applied."""
    root = str(tmp_path / "data")
    data = np.arange(24 * 20, dtype=np.int16).reshape(24, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.create_array(os.path.join(root, "t.zarr"), shape=data.shape, chunks=(8, 10), dtype="int16",
                                attributes={"scale_factor": 0.5, "add_offset": 10.0})
        arr[:] = data
    http = RangeServer(root)
    try:
        cfg = stoker.Config(batch_size=2, dtype="f32", n_compute_threads=1, pop_timeout_s=30,
                            storage_options={http.url: dict(FAST)})
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(f"{http.url}/t.zarr", [(0, 8), (0, 10)]),
                    stoker.Sample(f"{http.url}/t.zarr", [(8, 16), (5, 15)])])
            got = torch.from_dlpack(p.pop()).clone()
        assert torch.equal(got[0], torch.from_numpy(data[0:8, 0:10] * np.float32(0.5) + np.float32(10.0)))
        assert torch.equal(got[1], torch.from_numpy(data[8:16, 5:15] * np.float32(0.5) + np.float32(10.0)))
        assert [p for p in http.paths if p.endswith("t.zarr/zarr.json")] == ["/t.zarr/zarr.json"], http.paths
    finally:
        http.stop()


@pytest.mark.parametrize("cf", [True, False])
def test_a_v2_array_without_zattrs_behind_403s_reads_in_a_pipeline(tmp_path, cf):
    """A v2 array with no .zattrs on a server that answers 403 for a missing key (S3 without s3:ListBucket):
    its attributes (CF coding, dimension names for the channel check) are optional documents, so the refusal
    reads as none, as the hierarchy's probes read it; before, Config(cf=True) failed the batch with the 403.
    The two arrays are one sample's channels, so the dimension check asks for them too."""
    a = np.arange(64, dtype="f4").reshape(8, 8)
    for name in ("a", "b"):
        z = zarr.create_array(str(tmp_path / f"{name}.zarr"), shape=(8, 8), chunks=(4, 4), dtype="f4",
                              zarr_format=2)
        z[:] = a + (name == "b")
        if (tmp_path / f"{name}.zarr" / ".zattrs").exists():
            (tmp_path / f"{name}.zarr" / ".zattrs").unlink()
    server = RangeServer(str(tmp_path))
    server.missing_status = 403
    try:
        cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0,
                            cf=cf, storage_options={server.url: dict(FAST)})
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample([f"{server.url}/a.zarr", f"{server.url}/b.zarr"], [(0, 8), (0, 8)])])
            (got,) = [torch.from_dlpack(b).clone() for b in p]
    finally:
        server.stop()
    np.testing.assert_array_equal(got[0].numpy(), np.stack([a, a + 1]))


def _shard_with_entry(root: str, entry: int, offset: int | None = None, length: int | None = None):
    """``root/a.zarr``: 32 x 32 uint16 in one shard of 8 x 8 zstd inner chunks, its index (at the end, with its
    crc32c, as zarr-python writes it) rewritten so that inner chunk ``entry`` has ``offset`` / ``length``:
    a shard corrupt in a way its checksum cannot see."""
    import struct

    import google_crc32c

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(os.path.join(root, "a.zarr"), shape=(32, 32), chunks=(8, 8), shards=(32, 32),
                              dtype="uint16", compressors=ZstdCodec(level=1))
        z[:] = np.arange(32 * 32, dtype="uint16").reshape(32, 32)
    path = os.path.join(root, "a.zarr", "c", "0", "0")
    raw = bytearray(open(path, "rb").read())
    n = 16 * 16 + 4  # 16 inner chunks of (offset, length), then the crc32c
    index = np.frombuffer(bytes(raw[-n:-4]), "<u8").copy().reshape(16, 2)
    if offset is not None:
        index[entry, 0] = offset
    if length is not None:
        index[entry, 1] = length
    body = index.tobytes()
    with open(path, "wb") as f:
        f.write(bytes(raw[:-n]) + body + struct.pack("<I", google_crc32c.value(body)))
    return path


@pytest.mark.timeout(120)
def test_a_shard_index_entry_starting_past_the_shard_s_end_is_the_array_s_decode_error(tmp_path, decode_path):
    """An inner chunk whose index entry (checksum intact) starts past its shard's end: the server answers its
    range 416, which says the value is shorter than the range's start. That is the array's DecodeError naming
    the shard, as the local read of the same shard says, in open_array and in a pipeline; not a StorageError
    of a short read (which sends one checking the server)."""
    root = str(tmp_path / "src")
    _shard_with_entry(root, entry=5, offset=10 ** 12)
    with pytest.raises(stoker.DecodeError, match="shard 'c/0/0' is shorter than its index claims"):
        stoker.open_array(os.path.join(root, "a.zarr"))[:]  # the local read, for comparison
    server = RangeServer(root)
    try:
        uri = f"{server.url}/a.zarr"
        with pytest.raises(stoker.DecodeError, match="shard 'c/0/0' is shorter than its index claims") as info:
            stoker.open_array(uri, dict(FAST))[:]
        assert info.value.key == "c/0/0" and info.value.uri == uri
        cfg = stoker.Config(batch_size=1, dtype="f32", lossy_casts=True, n_compute_threads=1, pop_timeout_s=30,
                            storage_options={uri: dict(FAST)})
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, [(0, 32), (0, 32)])])
            with pytest.raises(stoker.DecodeError, match="shard 'c/0/0' is shorter than its index claims"):
                p.pop()
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_remote_shard_s_index_entry_past_any_size_names_no_made_up_file_size(tmp_path):
    """An index entry of a length past 2**63 in a remote shard (its size not known from the index's suffix
    read): the DecodeError names the entry and does not claim the shard holds 2**63 - 1 bytes."""
    root = str(tmp_path / "src")
    _shard_with_entry(root, entry=7, length=2 ** 63)
    server = RangeServer(root)
    try:
        with pytest.raises(stoker.DecodeError, match="inner chunk 7") as info:
            stoker.open_array(f"{server.url}/a.zarr", dict(FAST))[:]
        assert str((1 << 63) - 1) not in str(info.value), info.value
    finally:
        server.stop()
