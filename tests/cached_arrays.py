"""What the tests of disk-cache hits read by the engines share (tests/storage/test_disk_cache_engine.py and
test_disk_cache_losses.py, the CPU engine's; tests/gpu/test_gpu_remote_entries.py, the GPU staging's): two small
arrays written by zarr-python (one read as whole chunk values, one as ranges of shards), the crops of a batch,
the ``remote`` fixture serving them from moto's S3 server and the loopback HTTP server (``upload``: under a
prefix of a test's own), a cache folder in a test's ``tmp_path``, a batch checked against zarr-python's values,
and the files of a cache folder."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from zarr.codecs import ZstdCodec

import stoker
from stoker.storage.diskcache import DiskCache, disk_cache

from store_fixtures import BUCKET, FAST_REMOTE, random_int_arrays, read_tree, zarr_values

SHAPE = (64, 48)
#: one array read as whole chunk values, one as ranges of shards
ARRAYS = {"plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1)),
          "sharded": dict(chunks=(8, 8), shards=(32, 24), dtype="uint16", compressors=ZstdCodec(level=1))}
#: the crops of one batch
BOXES = [[(0, 20), (0, 20)], [(3, 23), (5, 25)], [(40, 60), (20, 40)], [(30, 50), (28, 48)], [(44, 64), (0, 20)]]

#: ``write(root, seed)``: the arrays, for ``written_tree_fixture``
write = random_int_arrays(ARRAYS, SHAPE)


def upload(s3, data: str, tag: str) -> tuple[str, dict, str]:
    """The arrays under ``data`` uploaded to moto's S3 server ``s3`` under a new prefix ``<tag>-<8 hex digits>``:
    (the uri of their root, the Config's ``storage_options`` for it, the prefix)."""
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    s3.upload(read_tree(data), prefix)
    return f"s3://{BUCKET}/{prefix}", {f"s3://{BUCKET}/": {**s3.options, **FAST_REMOTE}}, prefix


def cache_folder(tmp_path: Path, nbytes: int = 64 << 20) -> tuple[Path, DiskCache]:
    """``tmp_path/cache`` and the process's disk cache of it, bound to ``nbytes`` (the one every pipeline and
    store of the process given that folder uses)."""
    folder = tmp_path / "cache"
    return folder, disk_cache(str(folder), nbytes)


def remote_fixture(tag: str):
    """A fixture: ``(uri of the root, storage_options of the Config, the HTTP server or None)``, once over moto's
    S3 server (the arrays uploaded under a new prefix starting with ``tag``) and once over the loopback HTTP
    server. The module needs the fixtures ``s3``, ``data`` and ``http``. In a test module:
    ``remote = remote_fixture("engine")``."""

    @pytest.fixture(params=["s3", "http"])
    def remote(request, s3, data):
        if request.param == "s3":
            yield *upload(s3, data, tag)[:2], None
            return
        server = request.getfixturevalue("http")
        yield server.url, {server.url + "/": dict(FAST_REMOTE)}, server

    return remote


def check_batch(p, uri: str, data: str, path: str) -> None:
    """Push the crops of ``path`` (:data:`BOXES`), pop them, and check each against zarr-python's values."""
    p.push([stoker.Sample(f"{uri}/{path}", box) for box in BOXES])
    with p.pop() as b:
        got = [t.numpy().copy() for t in torch.from_dlpack(b)]
    want = zarr_values(data, path)
    for crop, box in zip(got, BOXES):
        np.testing.assert_array_equal(crop, want[tuple(slice(*s) for s in box)])


def entries(folder) -> list[str]:
    """The cache's entry files (markers included: they hold no payload)."""
    return [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n != ".index"]


def payloads(folder) -> list[str]:
    """The entries that hold a payload (not the empty markers)."""
    return [e for e in entries(folder) if os.path.getsize(e) > 200]


def damage_entries(folder, how: str) -> list[str]:
    """Damage every entry with a payload in ``folder`` (``how``: "unlink", what another process's eviction does;
    "truncate": its last 3 bytes cut; "flip": one bit of its payload's last byte); returns them (never none)."""
    found = payloads(folder)
    assert found, f"no entry with a payload in {folder}"
    for entry in found:
        if how == "unlink":
            os.unlink(entry)
            continue
        with open(entry, "r+b") as f:
            if how == "truncate":
                f.truncate(os.path.getsize(entry) - 3)
            else:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0x10]))
    return found
