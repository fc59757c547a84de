"""One conformance class that every store passes: memory, a directory, a zip archive, S3 (moto's server)
and HTTP (a Range-serving server), each on loopback and started here. Every store reads the same fixture
(Zarr arrays written by zarr-python and plain files) bit for bit equal to the local files."""

from __future__ import annotations

import os
import pickle
import struct
import threading

import pytest

from stoker.errors import InvalidArgument, NotFound, StorageError, UnsupportedFormat
from stoker.storage import ByteRange, CountingStore, FileStore, MemoryStore, ObjectStore, Store, ZipStore, open_store
from stoker.storage.uri import REMOTE_SCHEMES, resolve_local_path

from range_server import RangeServer
from store_fixtures import BUCKET, DEFLATED, FAST_REMOTE, PREFIX, MotoS3, write_tree, write_zip

KINDS = ["memory", "file", "zip", "s3", "http"]
FAST = {**FAST_REMOTE, "timeout_s": 10.0, "connect_timeout_s": 5.0}  # ObjectStore's own connect bound


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("store") / "data")
    return root, write_tree(root)


@pytest.fixture(scope="module")
def values(tree):
    return tree[1]


@pytest.fixture(scope="module")
def servers(tree):
    root, values = tree
    s3 = MotoS3(values)
    http = RangeServer(root)
    yield {"s3": s3, "http": http}
    http.stop()
    s3.stop()


@pytest.fixture(scope="module")
def zip_path(tree, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zip") / "data.zip")
    write_zip(path, tree[1])
    return path


def make_store(kind, tree, zip_path, servers):
    root, values = tree
    if kind == "memory":
        return MemoryStore(values)
    if kind == "file":
        return open_store(root)
    if kind == "zip":
        return open_store(zip_path)
    if kind == "s3":
        return open_store(f"s3://{BUCKET}/{PREFIX}", servers["s3"].options, **FAST)
    return open_store(servers["http"].url + "/", **FAST)


@pytest.fixture(params=KINDS)
def store(request, tree, zip_path):
    servers = request.getfixturevalue("servers") if request.param in ("s3", "http") else None
    s = make_store(request.param, tree, zip_path, servers)
    yield s
    s.close()


def shard_ranges(values: dict[str, bytes], key: str) -> list[ByteRange]:
    """The inner chunks of a zarr-python shard, located by its index (the file's last 16 n + 4 bytes)."""
    data = values[key]
    n = 2 * 3  # shards of (16, 24) with chunks of (8, 8)
    index = data[-(16 * n + 4):-4]
    out = []
    for i in range(n):
        offset, length = struct.unpack_from("<QQ", index, 16 * i)
        if offset != 2**64 - 1:
            out.append(ByteRange(key, offset, length))
    return out


class TestStoreConformance:
    """What every store does the same way."""

    def test_is_a_store(self, store):
        assert isinstance(store, Store)
        assert isinstance(store.uri, str) and store.uri
        assert store.supports_ranges in (True, False) and store.is_local in (True, False)

    def test_get_every_value_bit_for_bit(self, store, values):
        for key, value in values.items():
            assert bytes(store.get(key)) == value, key

    def test_zarr_chunks_by_ranges_equal_local_bytes(self, store, values):
        shards = sorted(k for k in values if k.startswith("sharded/c/"))
        assert len(shards) == 6
        for key in shards:
            index_len = 16 * 6 + 4
            index, = store.get_ranges([ByteRange.suffix(key, index_len)])
            assert bytes(index) == values[key][-index_len:]
            requests = shard_ranges(values, key)
            got = store.get_ranges(requests)
            assert [bytes(g) for g in got] == [values[key][r.start:r.start + r.length] for r in requests]

    def test_many_ranges_of_several_keys_in_one_call(self, store, values):
        blob = values["blob.bin"]
        requests = [ByteRange("blob.bin", 0, 10), ByteRange("v3/zarr.json", 5, 20), ByteRange("blob.bin", 5, 10),
                    ByteRange("blob.bin", 5, 10), ByteRange("blob.bin", 200_000, 99_999),
                    ByteRange.suffix("blob.bin", 7), ByteRange("blob.bin", 100, 0), ByteRange(DEFLATED, 1000, 300),
                    ByteRange.suffix(DEFLATED, 256), ByteRange("blob.bin", 0, len(blob)),
                    ByteRange("blob.bin", 150_000, 1)]
        got = store.get_ranges(requests)
        assert len(got) == len(requests)
        for r, g in zip(requests, got):
            value = values[r.key]
            want = value[len(value) - r.length:] if r.is_suffix else value[r.start:r.start + r.length]
            assert bytes(g) == want, r

    def test_no_ranges(self, store):
        assert store.get_ranges([]) == []

    def test_empty_value(self, store):
        assert bytes(store.get("empty")) == b""
        assert store.size("empty") == 0

    def test_size_and_exists(self, store, values):
        for key in ("blob.bin", "v3/zarr.json", "deep/a/b/c.txt", DEFLATED):
            assert store.size(key) == len(values[key])
            assert store.exists(key)
        assert not store.exists("nope")
        assert not store.exists("deep/a")  # a "directory" holds no value
        assert not store.exists("blob.bin/x")

    def test_missing_key_is_not_found(self, store):
        for call in (lambda: store.get("nope"), lambda: store.size("nope"), lambda: store.get("deep/a"),
                     lambda: store.get_ranges([ByteRange("blob.bin", 0, 1), ByteRange("nope/x", 0, 1)]),
                     lambda: store.get_ranges([ByteRange.suffix("nope", 4)])):
            with pytest.raises(NotFound) as info:
                call()
            assert info.value.key in ("nope", "nope/x", "deep/a")
            assert info.value.uri == store.uri

    def test_range_past_the_end_is_an_error_not_fewer_bytes(self, store, values):
        n = len(values["blob.bin"])
        for r in (ByteRange("blob.bin", n - 10, 20), ByteRange("blob.bin", n + 5, 3),
                  ByteRange.suffix("blob.bin", n + 1), ByteRange(DEFLATED, len(values[DEFLATED]) - 1, 2)):
            with pytest.raises(StorageError) as info:
                store.get_ranges([r])
            assert info.value.key == r.key and info.value.uri == store.uri

    def test_get_each_gives_each_range_its_bytes_or_its_own_error(self, store, values):
        from stoker.storage.store import get_each

        n = len(values["blob.bin"])
        requests = [ByteRange("blob.bin", 10, 20), ByteRange.suffix("nope", 4), ByteRange("blob.bin", n - 5, 10),
                    ByteRange.suffix("sharded/c/0/0", 16 * 6 + 4), ByteRange(DEFLATED, 7, 9)]
        for counted in (store, CountingStore(store)):
            got = get_each(counted, requests)
            assert len(got) == len(requests)
            assert bytes(got[0]) == values["blob.bin"][10:30]
            assert isinstance(got[1], NotFound) and got[1].key == "nope"
            assert isinstance(got[2], StorageError) and got[2].key == "blob.bin"
            assert bytes(got[3]) == values["sharded/c/0/0"][-(16 * 6 + 4):]
            assert bytes(got[4]) == values[DEFLATED][7:16]
        assert (counted.counters.calls, counted.counters.requests) == (1, len(requests))
        assert get_each(store, []) == []

    def test_keys_never_leave_the_root(self, store):
        for key in ("../blob.bin", "/blob.bin", "deep//a", "deep/./a", "a\\b", ""):
            with pytest.raises(InvalidArgument):
                store.get(key)
            with pytest.raises(InvalidArgument):
                store.exists(key)

    def test_list(self, store, values):
        if not store.supports_list:
            with pytest.raises(UnsupportedFormat):
                store.list()
            return
        assert store.list() == sorted(values)
        assert store.list("") == sorted(values)
        assert store.list("deep") == ["deep/a/b/c.txt"]
        assert store.list("deep/a/") == ["deep/a/b/c.txt"]
        assert store.list("sharded") == sorted(k for k in values if k.startswith("sharded/"))
        assert store.list("dee") == []  # prefixes are directories, not strings
        assert store.list("nope") == []

    def test_list_dir_is_one_level(self, store, values):
        if not store.supports_list:
            with pytest.raises(UnsupportedFormat):
                store.list_dir()
            return
        top = sorted({k.split("/")[0] for k in values if "/" in k})
        assert store.list_dir() == (sorted(k for k in values if "/" not in k), top)
        assert store.list_dir("") == store.list_dir()
        assert store.list_dir("deep") == ([], ["deep/a"])
        assert store.list_dir("deep/a/") == ([], ["deep/a/b"])
        assert store.list_dir("deep/a/b") == (["deep/a/b/c.txt"], [])
        keys, folders = store.list_dir("sharded")  # the chunks' folder, not their keys
        assert keys == ["sharded/zarr.json"] and folders == ["sharded/c"]
        assert store.list_dir("dee") == ([], []) and store.list_dir("nope") == ([], [])
        assert store.list_dir("blob.bin") == ([], [])  # a value is no folder
        with pytest.raises(InvalidArgument):
            store.list_dir("../x")

    def test_concurrent_readers(self, store, values):
        requests = [ByteRange("blob.bin", i * 1000, 777) for i in range(0, 290, 7)]
        want = [values["blob.bin"][r.start:r.start + r.length] for r in requests]
        errors, results = [], []

        def read():
            try:
                for _ in range(5):
                    results.append([bytes(g) for g in store.get_ranges(requests)])
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and len(results) == 30
        assert all(r == want for r in results)

    def test_counting_wrapper(self, store, values):
        counted = CountingStore(store)
        assert counted.supports_ranges == store.supports_ranges and counted.uri == store.uri
        counted.get("v3/zarr.json")
        counted.get_ranges([ByteRange("blob.bin", 0, 10), ByteRange.suffix("blob.bin", 5)])
        counted.exists("nope")
        c = counted.counters
        assert (c.calls, c.requests, c.bytes) == (3, 3, len(values["v3/zarr.json"]) + 15)
        assert counted.reset().calls == 3 and counted.counters.calls == 0

    def test_pickles_for_worker_processes(self, store, values):
        copy = pickle.loads(pickle.dumps(store))
        try:
            assert type(copy) is type(store) and copy.uri == store.uri
            assert bytes(copy.get_ranges([ByteRange("blob.bin", 99, 50)])[0]) == values["blob.bin"][99:149]
        finally:
            copy.close()


def test_open_store_picks_by_uri(tree, zip_path, servers):
    root, _ = tree
    assert isinstance(open_store(root), FileStore)
    assert isinstance(open_store("file://" + root), FileStore)
    assert isinstance(open_store(zip_path), ZipStore)
    assert isinstance(open_store("zip://" + zip_path), ZipStore)
    assert isinstance(open_store("memory://a"), MemoryStore)
    assert open_store("memory://a") is open_store("memory://a")
    assert open_store("memory://a") is not open_store("memory://b")
    named = open_store("memory://a")
    named.set("k", b"v")
    named.close()  # forgets the name
    assert open_store("memory://a") is not named and not open_store("memory://a").exists("k")
    s3 = open_store(f"s3://{BUCKET}/{PREFIX}", servers["s3"].options)
    assert isinstance(s3, ObjectStore) and s3.supports_list
    http = open_store(servers["http"].url)
    assert isinstance(http, ObjectStore) and not http.supports_list
    for uri in ("gs://bucket/x", "gcs://bucket/x"):  # built without a request
        gcs = open_store(uri, {"skip_signature": True})
        assert isinstance(gcs, ObjectStore) and gcs.uri == uri
    with pytest.raises(UnsupportedFormat):
        open_store("ftp://host/x")
    with pytest.raises(InvalidArgument):
        open_store(root, {"region": "us-east-1"})  # options for a local path: a mistake, said so
    with pytest.raises(NotFound):
        open_store("zip://" + os.path.join(root, "missing.zip"))


HTTPS_ROUTES = [  # URL, obstore store, its config (what matters), store root, key prefix of the array
    ("https://acct.blob.core.windows.net/cont/g.zarr/a", "AzureStore",
     {"account_name": "acct", "container_name": "cont"}, "https://acct.blob.core.windows.net/cont", "g.zarr/a"),
    ("https://s3.eu-west-1.amazonaws.com/bkt/g.zarr/a", "S3Store", {"bucket": "bkt", "region": "eu-west-1"},
     "https://s3.eu-west-1.amazonaws.com/bkt", "g.zarr/a"),
    ("https://bkt.s3.eu-west-1.amazonaws.com/g.zarr/a", "S3Store", {"bucket": "bkt", "region": "eu-west-1"},
     "https://bkt.s3.eu-west-1.amazonaws.com", "g.zarr/a"),
    ("https://data.example.org/bkt/g.zarr/a", "HTTPStore", None, "https://data.example.org", "bkt/g.zarr/a"),
    ("https://amazonaws.com.example.org/bkt/a", "HTTPStore", None, "https://amazonaws.com.example.org", "bkt/a"),
]


@pytest.mark.parametrize("url, kind, config, root, prefix", HTTPS_ROUTES)
def test_https_urls_of_object_stores_open_the_providers_store(url, kind, config, root, prefix):
    """Built, never asked: no request leaves the machine."""
    from stoker.storage.locate import Stores, locate

    loc = locate(url)
    assert (loc.root, loc.prefix) == (root, prefix)
    stores = Stores()
    try:
        for store in (stores.get(loc)[0], open_store(url)):
            inner = store._obstore()
            assert type(inner).__name__ == kind, store
            assert store.supports_list is (kind != "HTTPStore")
            if config is not None:
                assert {k: inner.config.get(k) for k in config} == config
        assert getattr(stores.get(loc)[0]._obstore(), "prefix", None) is None  # the root holds no key prefix
    finally:
        stores.close()


def test_s3_list_dir_follows_pages(servers):
    """More folders than one listing page holds (1,000): every page is read, no key below them."""
    from concurrent.futures import ThreadPoolExecutor

    client = servers["s3"].client
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=f"paged/r{i:04d}/c/0", Body=b"x"), range(1005)))
    client.put_object(Bucket=BUCKET, Key="paged/zarr.json", Body=b"{}")
    store = open_store(f"s3://{BUCKET}/paged", servers["s3"].options, **FAST)
    assert store.list_dir() == (["zarr.json"], [f"r{i:04d}" for i in range(1005)])


def test_s3_credentials_and_endpoint_from_the_environment(servers, values, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", servers["s3"].endpoint)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    store = open_store(f"s3://{BUCKET}/{PREFIX}", **FAST)
    assert bytes(store.get("v3/zarr.json")) == values["v3/zarr.json"]


def test_s3_anonymous_access_to_a_public_bucket(servers, values, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    endpoint = servers["s3"].endpoint
    anonymous = {"endpoint": endpoint, "allow_http": True, "region": "us-east-1", "skip_signature": True}
    private = open_store(f"s3://{BUCKET}/{PREFIX}", anonymous, **FAST)
    with pytest.raises(StorageError) as info:  # not public yet: the server refuses unsigned requests
        private.get("blob.bin")
    assert info.value.status == 403 and info.value.attempts == 1 and info.value.key == "blob.bin"
    policy = ('{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject",'
              f'"Resource":"arn:aws:s3:::{BUCKET}/*"}}]}}')
    servers["s3"].client.put_bucket_policy(Bucket=BUCKET, Policy=policy)
    try:
        assert bytes(private.get("blob.bin")) == values["blob.bin"]
    finally:
        servers["s3"].client.delete_bucket_policy(Bucket=BUCKET)


def test_every_store_reports_the_generation_of_each_read(store, values):
    """``get_many`` and ``get_each`` with ``versions=True`` name the generation each value and range came from:
    the same for reads of one unchanged value, None only for what was not read."""
    from stoker.storage.store import get_each, get_many

    assert store.reports_versions
    key = next(k for k in sorted(values) if len(values[k]) > 8)
    got, parts, value_versions, part_versions = get_many(
        store, [key, "no/such/key"], [ByteRange(key, 0, 4), ByteRange(key, 4, 4)], versions=True)
    assert bytes(got[0]) == values[key] and got[1] is None and [bytes(p) for p in parts] == [values[key][:4],
                                                                                           values[key][4:8]]
    assert value_versions[0] is not None and value_versions[1] is None
    assert part_versions[0] == part_versions[1] == value_versions[0]
    out, generations = get_each(store, [ByteRange.suffix(key, 4), ByteRange("no/such/key", 0, 1)], versions=True)
    assert bytes(out[0]) == values[key][-4:] and isinstance(out[1], NotFound)
    assert generations == [value_versions[0], None]
    counted = CountingStore(store)  # a wrapper passes them on
    assert get_each(counted, [ByteRange(key, 0, 1)], versions=True)[1] == [value_versions[0]]


def test_a_memory_store_gives_a_rewritten_value_a_new_generation():
    from stoker.storage.store import get_many

    store = MemoryStore({"a": b"old value"})
    first = get_many(store, ["a"], [], versions=True)[2][0]
    store.set("a", b"old value")  # the same bytes written again: another write, another generation
    second = get_many(store, [], [ByteRange("a", 0, 3)], versions=True)[3][0]
    assert first != second
    assert get_many(store, ["a"], [], versions=True)[2][0] == second


def test_a_file_changed_while_it_was_read_gets_a_generation_equal_to_no_other(tmp_path, monkeypatch):
    from stoker.storage.store import get_each

    (tmp_path / "v").write_bytes(b"0123456789")
    store = FileStore(tmp_path)
    (_,), (before,) = get_each(store, [ByteRange("v", 0, 4)], versions=True)
    read_ranges = FileStore._get_ranges  # what every read of ranges goes through

    def rewrite_after(self, requests, expected=None):
        got = read_ranges(self, requests, expected)
        os.replace(_write(tmp_path / "w", b"abcdefghij"), tmp_path / "v")
        return got

    monkeypatch.setattr(FileStore, "_get_ranges", rewrite_after)
    (data,), (during,) = get_each(store, [ByteRange("v", 0, 4)], versions=True)
    monkeypatch.undo()
    (_,), (after,) = get_each(store, [ByteRange("v", 0, 4)], versions=True)
    assert bytes(data) == b"0123" and during not in (before, after) and before != after


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("scheme", sorted(REMOTE_SCHEMES))
def test_every_remote_scheme_is_remote_everywhere(scheme):
    """One list of remote schemes: a path-only API refuses each as remote (not as an unknown scheme)."""
    with pytest.raises(UnsupportedFormat, match="names no local path"):
        resolve_local_path(f"{scheme}://bucket/a.zarr")
