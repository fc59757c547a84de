"""Blosc chunks in object stores, fetched whole once, then only the blocks a crop needs
(stoker/engine/frame_spans.py): the same batches as a local read, bit for bit, with fewer bytes; a chunk
rewritten since its table was kept is fetched whole again (its new data, never a mix); a server that names
no version gets no spans. Also: a batch larger than a fetch holds goes to the store in several calls."""

from __future__ import annotations

import os
import warnings

import numcodecs
import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine import decode_native, native
from stoker.engine.frame_spans import FrameTables, assemble
from stoker.storage.objectstore import ObjectStore
from stoker.zarr.codecs import blosc

from range_server import RangeServer
from store_fixtures import BUCKET, MotoS3, read_tree

PREFIX = "blosc-spans"  # in the bucket the store tests share (one moto backend per process)
FAST = {"timeout_s": 5.0, "connect_timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05}
# uint16: 256 KiB chunks, which blosc (lz4, level 1) cuts into four blocks of 64 KiB (32 rows each)
SHAPE, CHUNKS = (256, 1024), (128, 1024)
# crops of 10 rows: one of a chunk's four blocks, or two across a block boundary
BOXES = [[(3, 13), (0, 1024)], [(130, 140), (0, 1024)], [(60, 70), (0, 1024)], [(200, 210), (0, 1024)]]

pytestmark = pytest.mark.skipif(native.Engine is None or not native.blosc, reason="the compiled engine reads blosc")


def _write(path: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = (rng.integers(0, 300, SHAPE) + np.arange(SHAPE[1])).astype("<u2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="<u2", zarr_format=2, fill_value=0,
                              compressors=numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE))
        z[...] = data


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spans") / "data")
    _write(os.path.join(root, "a.zarr"), 1)
    s3 = MotoS3(read_tree(root), PREFIX)
    http = RangeServer(root)
    yield {"root": root, "s3": s3, "http": http}
    http.stop()
    s3.stop()


def _uri(served, kind: str) -> tuple[str, dict]:
    if kind == "s3":
        return f"s3://{BUCKET}/{PREFIX}/a.zarr", {f"s3://{BUCKET}/": {**served["s3"].options, **FAST}}
    return f"{served['http'].url}/a.zarr", {served["http"].url + "/": FAST}


def _passes(uri: str, options: dict | None, n: int = 2, between=lambda: None) -> list[tuple[list, int]]:
    """``n`` passes over BOXES in one pipeline: each pass's batches and the bytes it read."""
    out = []
    cfg = stoker.Config(batch_size=2, dtype="native", host_buffer_bytes=64 << 20, storage_options=options)
    with stoker.Pipeline(cfg) as p:
        for k in range(n):
            if k:
                between()
            p.stats_reset()
            p.push([stoker.Sample(uri, box) for box in BOXES])
            batches = []
            for _ in range(len(BOXES) // 2):
                with p.pop() as b:
                    batches.append(torch.from_dlpack(b).clone())
            out.append((batches, p.stats().bytes_read))
    return out


def _local(root: str) -> list:
    return _passes(os.path.join(root, "a.zarr"), None, n=1)[0][0]


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_second_pass_fetches_only_the_blocks_its_crops_need(served, kind):
    uri, options = _uri(served, kind)
    (first, read_first), (second, read_second) = _passes(uri, options)
    local = _local(served["root"])
    for got in (first, second):
        assert [b.numpy().tobytes() for b in got] == [b.numpy().tobytes() for b in local]
    # each crop needs one or two of its chunk's four blocks: well under half the bytes of the whole chunks
    assert read_second < 0.5 * read_first, (read_first, read_second)


def test_a_chunk_rewritten_after_its_table_was_kept_is_fetched_whole_again(served, tmp_path):
    """Over S3 (moto: a new ETag per upload) and HTTP (the file's identity): the second pass reads the new
    chunks, never blocks of the new object placed in the old one's frame."""
    new_root = str(tmp_path / "new")
    _write(os.path.join(new_root, "a.zarr"), 2)
    new_values = read_tree(new_root)
    expected = _local(new_root)

    def rewrite_s3() -> None:
        for key, value in new_values.items():
            served["s3"].client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=value)

    uri, options = _uri(served, "s3")
    try:
        (_, _), (second, _) = _passes(uri, options, between=rewrite_s3)
        assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in expected]
    finally:  # the fixture's values again, for the other tests
        for key, value in read_tree(served["root"]).items():
            served["s3"].client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=value)

    http_root = str(tmp_path / "served")
    _write(os.path.join(http_root, "a.zarr"), 1)
    server = RangeServer(http_root)
    try:
        def rewrite_files() -> None:
            for key, value in new_values.items():
                with open(os.path.join(http_root, key), "wb") as f:
                    f.write(value)

        uri, options = f"{server.url}/a.zarr", {server.url + "/": FAST}
        (_, _), (second, _) = _passes(uri, options, between=rewrite_files)
        assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in expected]
    finally:
        server.stop()


def test_a_server_that_names_no_version_gets_no_spans(served):
    """Without an ETag nothing tells an object's versions apart: every pass fetches whole chunks."""
    server = RangeServer(served["root"])
    server.etags = False
    try:
        uri, options = f"{server.url}/a.zarr", {server.url + "/": FAST}
        (first, read_first), (second, read_second) = _passes(uri, options)
        assert read_second == read_first
        local = _local(served["root"])
        assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in local]
    finally:
        server.stop()


def test_a_batch_larger_than_a_fetch_goes_to_the_store_in_several_calls(served, monkeypatch):
    """The engine decodes a batch's first chunks while its others are in flight: one store call per
    FETCH_MAX_BYTES of the batch, the batches unchanged."""
    calls = []
    start = ObjectStore.start_get_many
    monkeypatch.setattr(ObjectStore, "start_get_many",
                        lambda self, keys, requests, *a, **k: calls.append(len(keys) + len(requests))
                        or start(self, keys, requests, *a, **k))
    uri, options = _uri(served, "s3")
    local = _local(served["root"])
    cfg = stoker.Config(batch_size=4, dtype="native", host_buffer_bytes=64 << 20, storage_options=options)
    for limit, n_calls in [(1 << 30, 1), (100_000, 2)]:  # the batch's two chunk files: 180 KB each
        monkeypatch.setattr(decode_native, "FETCH_MAX_BYTES", limit)
        calls.clear()
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(uri, box) for box in BOXES])
            with p.pop() as b:
                got = torch.from_dlpack(b).clone()
        assert got.numpy().tobytes() == b"".join(x.numpy().tobytes() for x in local)
        assert sum(calls) == 2 and len(calls) == n_calls, calls


# -- the frame tables on their own ------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [numcodecs.Blosc.NOSHUFFLE, numcodecs.Blosc.SHUFFLE, numcodecs.Blosc.BITSHUFFLE])
@pytest.mark.parametrize("dtype", ["<u1", "<u2", "<f4", "<i8"])
def test_an_assembled_frame_decodes_its_span_as_the_whole_frame_does(shuffle, dtype):
    rng = np.random.default_rng(7)
    n = (256 << 10) // np.dtype(dtype).itemsize
    data = (np.arange(n) // 16 % 200 + rng.integers(0, 2, n)).astype(dtype)  # compressible: not memcpy'd
    frame = numcodecs.Blosc("lz4", 1, shuffle).encode(data)
    assert blosc.frame_info(frame)[2] < data.nbytes  # several blocks
    whole = np.frombuffer(numcodecs.Blosc().decode(frame), np.uint8)
    nbytes = data.nbytes
    tables = FrameTables()
    tables.learn("store", "k", frame, nbytes, version=(len(frame), '"v1"'))
    assert len(tables) == 1
    for start, stop in [(0, 100), (65535, 65537), (nbytes - 10, nbytes), (70_000, 130_000)]:
        got = tables.span("store", "k", nbytes, start, stop)
        assert got is not None
        lo, hi, table = got
        buffer = assemble(table, lo, memoryview(frame)[lo:hi])
        assert len(buffer) == len(frame) and not buffer[hi:].any()
        out = np.zeros(nbytes, np.uint8)
        blosc.decode_range(buffer, start, stop, out)
        assert out[start:stop].tobytes() == whole[start:stop].tobytes()
    # most of the chunk: decoded whole, so fetched whole
    assert tables.span("store", "k", nbytes, 0, nbytes) is None


def test_frame_tables_keep_only_what_a_later_read_can_check_and_use():
    data = np.random.default_rng(3).integers(0, 300, 128 << 10).astype("<u2")
    frame = numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE).encode(data)
    tables = FrameTables()
    tables.learn("s", "no-version", frame, data.nbytes, version=None)
    tables.learn("s", "other-size", frame, data.nbytes * 2, version=(len(frame), '"a"'))
    tables.learn("s", "not-blosc", b"\x00" * 64, data.nbytes, version=(64, '"a"'))
    one_block = numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE).encode(data[:1024])
    tables.learn("s", "one-block", one_block, 2048, version=(len(one_block), '"a"'))
    memcpyed = numcodecs.Blosc("lz4", 0, numcodecs.Blosc.SHUFFLE).encode(data)
    tables.learn("s", "memcpyed", memcpyed, data.nbytes, version=(len(memcpyed), '"a"'))
    assert len(tables) == 0
    tables.learn("s", "k", frame, data.nbytes, version=(len(frame), '"a"'))
    lo, hi, table = tables.span("s", "k", data.nbytes, 0, 100)
    assert table.cbytes == len(frame) and lo >= len(table.head) and hi <= len(frame)
    assert tables.span("s", "k", data.nbytes, 100, 100) is None and tables.span("s", "other", data.nbytes, 0, 1) is None
    assert tables.fits("s", "k", table, (len(frame), '"a"'))
    assert not tables.fits("s", "k", table, (len(frame), '"b"'))  # another version: forgotten
    assert tables.span("s", "k", data.nbytes, 0, 100) is None
