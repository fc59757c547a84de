"""``stoker bench --store http|s3``: every peer reads the scenarios' arrays through one loopback server
(:mod:`stoker.bench.serve`) that delays every request, and the server counts what each peer asked.

The peers read it as their users would: stoker by URI (``http://127.0.0.1:port/s1-lz4/array.zarr``, or
``s3://bench/s1-lz4/array.zarr`` with the server as endpoint), tensorstore with its ``http`` or ``s3``
kvstore, zarr-python through ``zarr.storage.ObjectStore`` over obstore's ``HTTPStore`` or ``S3Store``.
Every peer keeps its own defaults for requests in flight. The S3 peers read anonymously (the server
checks no signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .serve import BUCKET

REGION = "us-east-1"
KINDS = ("http", "s3")


@dataclass(frozen=True)
class Remote:
    """The served data: ``kind`` (http or s3), the server's ``url``, the local ``root`` it serves."""

    kind: str
    url: str
    root: Path
    latency_ms: float

    def uri(self, path: str) -> str:
        """The URI a peer reads the local array ``path`` by."""
        rel = Path(path).resolve().relative_to(Path(self.root).resolve()).as_posix()
        return f"{self.url}/{rel}" if self.kind == "http" else f"s3://{BUCKET}/{rel}"

    def key(self, uri: str) -> str:
        """The array's key under the store root (the data root, or the bucket)."""
        prefix = self.url if self.kind == "http" else f"s3://{BUCKET}"
        return uri[len(prefix):].strip("/")

    def storage_options(self) -> dict | None:
        """``Config.storage_options`` for stoker (HTTP needs none: ``http://`` allows plain HTTP)."""
        if self.kind == "http":
            return None
        return {f"s3://{BUCKET}/": {"endpoint": self.url, "region": REGION, "skip_signature": True,
                                     "allow_http": True}}

    def tensorstore_kvstore(self, uri: str) -> dict:
        if self.kind == "http":
            return {"driver": "http", "base_url": uri}
        return {"driver": "s3", "bucket": BUCKET, "path": self.key(uri) + "/", "endpoint": self.url,
                "aws_region": REGION, "aws_credentials": {"type": "anonymous"}}

    def zarr_store(self):
        """zarr-python's store over obstore (build one per process: obstore's clients do not survive a fork)."""
        import obstore.store
        import zarr.storage

        if self.kind == "http":
            inner = obstore.store.HTTPStore.from_url(self.url, client_options={"allow_http": True})
        else:
            inner = obstore.store.S3Store(BUCKET, endpoint=self.url, region=REGION, skip_signature=True,
                                          client_options={"allow_http": True})
        return zarr.storage.ObjectStore(inner, read_only=True)


class ZarrOpener:
    """Opens arrays for the zarr peers: local paths with ``zarr.open_array``, remote ones through one
    obstore-backed store per process (picklable for DataLoader workers, which build their own)."""

    def __init__(self, remote: Remote | None) -> None:
        self.remote = remote
        self._store = None
        self._pid = None

    def __getstate__(self) -> dict:
        return {"remote": self.remote, "_store": None, "_pid": None}

    def __call__(self, uri: str):
        import os

        import zarr

        if self.remote is None:
            return zarr.open_array(uri, mode="r")
        if self._pid != os.getpid():
            self._store, self._pid = self.remote.zarr_store(), os.getpid()
        return zarr.open_array(store=self._store, path=self.remote.key(uri), mode="r")
