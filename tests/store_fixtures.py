"""The values every store test reads: Zarr arrays written by zarr-python plus plain files, laid out as a
directory, a zip archive, an S3 bucket (moto's server) and an HTTP root (tests/range_server.py)."""

from __future__ import annotations

import logging
import os
import zipfile

import numpy as np
import pytest
import zarr

BUCKET = "stoker-test"
PREFIX = "root"
#: Written deflated into the zip fixture (every other member is stored, as Zarr zip stores are).
DEFLATED = "deflated.bin"


def write_tree(root: str) -> dict[str, bytes]:
    """Write the fixture under ``root``; returns ``{key: bytes}`` of every file."""
    rng = np.random.default_rng(21)
    os.makedirs(root, exist_ok=True)
    data = rng.integers(0, 1000, size=(40, 36), dtype="int32")
    zarr.create_array(os.path.join(root, "v3"), shape=data.shape, chunks=(16, 16), dtype="int32")[...] = data
    zarr.create_array(os.path.join(root, "sharded"), shape=data.shape, chunks=(8, 8), shards=(16, 24),
                      dtype="int32")[...] = data
    zarr.create_array(os.path.join(root, "v2"), shape=data.shape, chunks=(16, 16), dtype="int32",
                      zarr_format=2)[...] = data
    files = {"blob.bin": rng.bytes(300_000), "empty": b"", "deep/a/b/c.txt": b"hello stores\n",
             DEFLATED: bytes(range(256)) * 400}
    for key, value in files.items():
        path = os.path.join(root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(value)
    return read_tree(root)


def read_tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` by its key (``/``-separated path relative to ``root``)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return out


def write_zip(path: str, values: dict[str, bytes]) -> None:
    """The Zarr zip store layout: members stored, at the archive's root; :data:`DEFLATED` deflated."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(values):
            zf.writestr(key, values[key], compress_type=zipfile.ZIP_DEFLATED if key == DEFLATED else None)


class MotoS3:
    """moto's S3 server on loopback (a free port) with the fixture uploaded under ``s3://BUCKET/PREFIX``."""

    def __init__(self, values: dict[str, bytes], prefix: str = PREFIX) -> None:
        # moto's servers in one process share one backend: test modules upload under prefixes of their own
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        self.client = client
        self.upload(values, prefix)

    def upload(self, values: dict[str, bytes], prefix: str) -> None:
        """Put ``values`` (``{key: bytes}``, e.g. :func:`read_tree`'s) under ``s3://BUCKET/prefix/``."""
        for key, value in values.items():
            self.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=value)

    @property
    def options(self) -> dict:
        """storage_options for the server with credentials (moto accepts any)."""
        return {"endpoint": self.endpoint, "allow_http": True, "region": "us-east-1",
                "access_key_id": "testing", "secret_access_key": "testing"}

    def stop(self) -> None:
        self.server.stop()


def zarr_values(root: str, path: str):
    """zarr-python's values of the whole array at ``path`` under the folder ``root`` (the tests' oracle)."""
    return zarr.open_array(os.path.join(root, path), mode="r")[...]


#: storage options of a loopback remote store in tests: short timeouts, a few quick retries
FAST_REMOTE = {"timeout_s": 5.0, "connect_timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05}


def random_int_arrays(arrays: dict, shape: tuple):
    """``write(root, seed)``: writes each of ``arrays`` (path under ``root`` -> keywords of
    ``zarr.create_array``) at ``shape`` with random integers below 5,000 drawn from ``seed``, in order.
    In a test module: ``_write = random_int_arrays(ARRAYS, SHAPE)``."""

    def write(root: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for path, spec in arrays.items():
            arr = zarr.create_array(os.path.join(root, path), shape=shape, overwrite=True, **spec)
            arr[...] = rng.integers(0, 5000, size=shape).astype(spec["dtype"])

    return write


def written_tree_fixture(write):
    """A fixture: a folder "data" of the test's tmp_path holding what ``write(root, 1)`` writes (generation 1 of
    the module's arrays), its path. In a test module: ``data = written_tree_fixture(_write)``."""

    @pytest.fixture
    def data(tmp_path):
        root = str(tmp_path / "data")
        write(root, 1)
        return root

    return data


def empty_s3_fixture():
    """A module-scoped fixture: moto's S3 server with an empty bucket, stopped after the module's tests (which
    upload under prefixes of their own). In a test module: ``s3 = empty_s3_fixture()``."""

    @pytest.fixture(scope="module")
    def s3():
        server = MotoS3({}, "unused")
        yield server
        server.stop()

    return s3


def range_server_fixture(server_class=None):
    """A fixture: the loopback HTTP server (tests/range_server.py's ``RangeServer``, or ``server_class``, one
    of its subclasses) serving the module's ``data`` folder, stopped after the test (its latency set back to
    none first, so answers still pending end at once). In a test module: ``http = range_server_fixture()``."""

    @pytest.fixture
    def http(data):
        from range_server import RangeServer

        server = (server_class or RangeServer)(data)
        yield server
        server.latency_s = 0
        server.stop()

    return http
