"""Blosc chunks in object stores, fetched whole once, then only the blocks a crop needs
(stoker/engine/cpu/frame_spans.py): the same batches as a local read, bit for bit, with fewer bytes; a chunk
rewritten since its table was kept is fetched whole again (its new data, never a mix); a server that names
no version gets no spans. Also: a batch larger than a fetch holds goes to the store in several calls."""

from __future__ import annotations

import gc
import os
import time
import warnings

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import decode_native, native
from stoker.engine.cpu.decode_python import PythonDecoder
from stoker.engine.cpu.frame_spans import FrameBuffers, FrameTables, assemble
from stoker.storage.objectstore import ObjectStore
from stoker.zarr.codecs import blosc

from range_server import RangeServer
from store_fixtures import BUCKET, FAST_REMOTE, MotoS3, read_tree

PREFIX = "blosc-spans"  # in the bucket the store tests share (one moto backend per process)
FAST = FAST_REMOTE
# uint16: 256 KiB chunks, which blosc (lz4, level 1) cuts into four blocks of 64 KiB (32 rows each)
SHAPE, CHUNKS = (384, 1024), (128, 1024)
# crops of 10 rows: one of a chunk's four blocks, or two across a block boundary
BOXES = [[(3, 13), (0, 1024)], [(130, 140), (0, 1024)], [(60, 70), (0, 1024)], [(200, 210), (0, 1024)]]

pytestmark = pytest.mark.skipif(native.Engine is None or not native.blosc, reason="the compiled engine reads blosc")


def _data(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 300, SHAPE) + np.arange(SHAPE[1])).astype("<u2")


def _write(path: str, seed: int = 1, data: np.ndarray | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="<u2", zarr_format=2, fill_value=0,
                              compressors=numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE))
        z[...] = _data(seed) if data is None else data


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spans") / "data")
    _write(os.path.join(root, "a.zarr"), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.create_array(os.path.join(root, "s.zarr"), shape=SHAPE, chunks=(32, 256), shards=(128, 1024),
                          dtype="<u2", compressors=ZstdCodec(level=1))[...] = _data(3)
    s3 = MotoS3(read_tree(root), PREFIX)
    http = RangeServer(root)
    yield {"root": root, "s3": s3, "http": http}
    http.stop()
    s3.stop()


def _uri(served, kind: str) -> tuple[str, dict]:
    if kind == "s3":
        return f"s3://{BUCKET}/{PREFIX}/a.zarr", {f"s3://{BUCKET}/": {**served["s3"].options, **FAST}}
    return f"{served['http'].url}/a.zarr", {served["http"].url + "/": FAST}


def _passes(uri: str, options: dict | None, n: int = 2, between=lambda: None,
            seen: dict | None = None) -> list[tuple[list, int]]:
    """``n`` passes over BOXES in one pipeline: each pass's batches and the bytes it read (``seen``: gets
    the pipeline's engine decoder, ``"decoder"``)."""
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
        if seen is not None:
            seen["decoder"] = p._executor.decoders.native
    return out


def _local(root: str) -> list:
    return _passes(os.path.join(root, "a.zarr"), None, n=1)[0][0]


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_second_pass_fetches_only_the_blocks_its_crops_need(served, kind, monkeypatch):
    uri, options = _uri(served, kind)
    decoded_in_python = []
    monkeypatch.setattr(PythonDecoder, "decode_bytes", lambda self, *a, **k: decoded_in_python.append(a))
    seen: dict = {}
    (first, read_first), (second, read_second), (third, _) = _passes(uri, options, n=3, seen=seen)
    assert seen["decoder"]._frame_buffers._free  # the frames' buffers came back for later fetches
    local = _local(served["root"])
    for got in (first, second, third):  # the third in buffers the second's frames were laid out in
        assert [b.numpy().tobytes() for b in got] == [b.numpy().tobytes() for b in local]
    # each crop needs one or two of its chunk's four blocks: well under half the bytes of the whole chunks
    assert read_second < 0.5 * read_first, (read_first, read_second)
    assert not decoded_in_python  # the engine decoded every chunk, the spans' assembled frames included


class _Private:
    """A store of its own holding ``values``: a prefix of the shared moto server, or a RangeServer over a
    folder; :meth:`replace` makes it hold other values (keys missing from them deleted)."""

    def __init__(self, served, kind: str, values: dict[str, bytes], folder: str) -> None:
        self.kind, self.served, self.values = kind, served, dict(values)
        if kind == "s3":
            self.prefix = f"{PREFIX}/{os.path.basename(folder)}"
            self._put(values)
            self.uri = f"s3://{BUCKET}/{self.prefix}/a.zarr"
            self.options = {f"s3://{BUCKET}/": {**served["s3"].options, **FAST}}
        else:
            self.folder = folder
            self._put(values)
            self.server = RangeServer(folder)
            self.uri, self.options = f"{self.server.url}/a.zarr", {self.server.url + "/": FAST}

    def _put(self, values: dict[str, bytes]) -> None:
        for key, value in values.items():
            if self.kind == "s3":
                self.served["s3"].client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}", Body=value)
            else:
                os.makedirs(os.path.dirname(os.path.join(self.folder, key)), exist_ok=True)
                with open(os.path.join(self.folder, key), "wb") as f:
                    f.write(value)

    def replace(self, values: dict[str, bytes]) -> None:
        for key in set(self.values) - set(values):
            if self.kind == "s3":
                self.served["s3"].client.delete_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")
            else:
                os.remove(os.path.join(self.folder, key))
        self._put(values)
        self.values = dict(values)

    def close(self) -> None:
        if self.kind == "http":
            self.server.stop()


def _tree_of(tmp_path, name: str, data: np.ndarray) -> tuple[dict[str, bytes], list]:
    """The files of array ``a.zarr`` holding ``data`` (zarr leaves chunks of fill values unwritten), and
    the batches a local pipeline reads from it."""
    root = str(tmp_path / name)
    _write(os.path.join(root, "a.zarr"), data=data)
    return read_tree(root), _local(root)


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_chunk_rewritten_deleted_or_shrunk_after_its_table_was_kept_reads_as_it_now_is(served, kind, tmp_path):
    """Between two passes the chunks change under the pipeline: rewritten with other data (a new ETag), or one
    deleted (now the fill value) and one shrunk (compressed smaller than the range its kept table asks):
    the second pass reads the arrays as they now are, never blocks of one version in another's frame."""
    old = _data(1)
    values, _ = _tree_of(tmp_path, "old", old)
    rewritten = _data(2)
    changed = old.copy()
    changed[:128] = 0  # chunk 0 only fill: deleted
    changed[128:] = 7  # chunk 1 one value: a frame far smaller than before
    for name, data in [("rewritten", rewritten), ("changed", changed)]:
        new_values, expected = _tree_of(tmp_path, name, data)
        store = _Private(served, kind, values, str(tmp_path / f"served-{kind}-{name}"))
        try:
            (first, _), (second, _) = _passes(store.uri, store.options, between=lambda: store.replace(new_values))
        finally:
            store.close()
        assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in expected], name
    assert set(new_values) < set(values)  # chunk 0 was deleted


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_rewrite_of_the_same_size_is_told_apart_by_its_etag(served, kind, tmp_path):
    """Blocks 0 and 1 of chunk 0 swapped: the same frame size, another block table; only the version
    (size and ETag) says the kept table is not this object's."""
    old = _data(1)
    old[:32] = old[:32] % 30  # block 0 compresses better than block 1: their stored sizes differ
    new = old.copy()
    new[:32], new[32:64] = old[32:64], old[:32]
    values, _ = _tree_of(tmp_path, "old", old)
    new_values, expected = _tree_of(tmp_path, "new", new)
    assert len(values["a.zarr/0.0"]) == len(new_values["a.zarr/0.0"])
    assert values["a.zarr/0.0"][16:32] != new_values["a.zarr/0.0"][16:32]  # the block tables differ
    store = _Private(served, kind, values, str(tmp_path / f"served-{kind}"))
    try:
        (_, _), (second, _) = _passes(store.uri, store.options, between=lambda: store.replace(new_values))
    finally:
        store.close()
    assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in expected]


def test_a_fetch_whose_every_span_is_stale_leaves_the_batch_to_its_refetch(served, tmp_path, monkeypatch):
    """Every chunk of a batch asked as a span of an object rewritten since: all are fetched again, whole, in a
    fetch of their own, and nothing is left of the first fetch for the engine. Were that nothing still handed
    to the engine, its (empty) job could reach the finisher after the refetch had finished the batch, and its
    count of none would be taken for a chunk reported twice: an InternalError at pop, the pipeline lost
    (seen over loopback HTTP, where the refetch is quick). Here that empty job is held back until the refetch
    finished the batch."""
    values, _ = _tree_of(tmp_path, "old", _data(1))
    new_values, expected = _tree_of(tmp_path, "new", _data(2))
    store = _Private(served, "http", values, str(tmp_path / "served"))
    seen = {"refetched": 0}
    real_refetch, real_tables = decode_native.NativeDecoder._refetch, decode_native.NativeDecoder._tables

    def refetch(self, job, *args, **kwargs):
        seen["refetched"] += 1
        seen["job"] = job
        return real_refetch(self, job, *args, **kwargs)

    def tables(self, plan, out, kind, sources, eids, fetched=False):
        if fetched and eids is not None and not len(eids) and "job" in seen:  # the refetch finishes first
            seen["job"].done.wait(10)
        return real_tables(self, plan, out, kind, sources, eids, fetched)

    monkeypatch.setattr(decode_native.NativeDecoder, "_refetch", refetch)
    monkeypatch.setattr(decode_native.NativeDecoder, "_tables", tables)
    try:
        (_, _), (second, _) = _passes(store.uri, store.options, between=lambda: store.replace(new_values))
    finally:
        store.close()
    assert seen["refetched"]
    assert [b.numpy().tobytes() for b in second] == [b.numpy().tobytes() for b in expected]


def test_one_fetch_of_a_whole_value_a_known_span_and_a_stale_one(served, tmp_path):
    """Chunk 2 read whole for the first time, chunk 0 as a span, chunk 1 as a span of an object rewritten
    since (the same bytes, a new ETag): each chunk's bytes reach its own place in the batch."""
    data = _data(1)
    values, _ = _tree_of(tmp_path, "a", data)
    store = _Private(served, "http", values, str(tmp_path / "served"))
    cfg = stoker.Config(batch_size=3, dtype="native", host_buffer_bytes=64 << 20, storage_options=store.options)
    try:
        with stoker.Pipeline(cfg) as p:
            for k, boxes in enumerate([[[(3, 13), (0, 1024)], [(130, 140), (0, 1024)], [(5, 15), (0, 1024)]],
                                       [[(260, 270), (0, 1024)], [(3, 13), (0, 1024)], [(130, 140), (0, 1024)]]]):
                if k:
                    time.sleep(0.01)  # a new modification time: a new ETag
                    store.replace({**values, "a.zarr/1.0": bytes(values["a.zarr/1.0"])})
                p.push([stoker.Sample(store.uri, box) for box in boxes])
                with p.pop() as b:
                    got = torch.from_dlpack(b).clone().numpy()
                assert np.array_equal(got, np.stack([data[a:c] for (a, c), _ in boxes])), k
    finally:
        store.close()


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
    # the inner chunks of a shard stay in one call, however many bytes: the store merges their ranges
    sharded = f"s3://{BUCKET}/{PREFIX}/s.zarr"
    monkeypatch.setattr(decode_native, "FETCH_MAX_BYTES", 1)
    calls.clear()
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(sharded, [(0, 64), (0, 1024)]) for _ in range(4)])
        with p.pop() as b:
            got = torch.from_dlpack(b).clone()
    assert len(calls) == 1 and calls[0] == 8, calls  # 2 x 4 inner chunks of 32 x 256, one call
    assert np.array_equal(got.numpy()[0], zarr.open_array(os.path.join(served["root"], "s.zarr"))[:64])


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


# -- get_many's lenient ranges, on their own ---------------------------------------------------------------


def test_lenient_ranges_get_gone_or_shorter_in_place_and_every_other_error_raises(tmp_path):
    """What a span may meet, an object now missing (404) or shorter than its range (a short answer, or 416
    past the end), comes back in the range's place; anything else (5xx after the retries, a 403, a body cut
    short, a range the caller did not mark) fails the call as it would without ``lenient``."""
    import gc

    from stoker.errors import NotFound, StorageError
    from stoker.storage import ByteRange

    root = str(tmp_path)
    with open(os.path.join(root, "k"), "wb") as f:
        f.write(bytes(range(256)) * 40)
    with open(os.path.join(root, "small"), "wb") as f:
        f.write(b"x" * 100)
    server = RangeServer(root)
    store = ObjectStore(server.url, None, **FAST)
    R = ByteRange
    try:
        values, parts, _, versions = store.get_many(
            [], [R("nope", 10, 20), R("small", 50, 100), R("small", 500, 10), R("k", 0, 8)], versions=True,
            lenient=[0, 1, 2, 3])
        assert isinstance(parts[0], NotFound) and isinstance(parts[1], StorageError)
        assert isinstance(parts[2], StorageError) and bytes(parts[3]) == bytes(range(8))
        assert parts[0].__traceback__ is None and versions[3] is not None and versions[0] is None
        gc.collect()
        assert not gc.garbage
        with pytest.raises(NotFound):
            store.get_many([], [R("nope", 10, 20)], versions=True)  # not marked lenient
        for fault, status in [("fail", 503), ("fail", 403), ("truncate", None)]:
            getattr(server, fault)(10, status) if status else getattr(server, fault)(10)
            with pytest.raises(StorageError):
                store.get_many([], [R("k", 10, 2000)], versions=True, lenient=[0])
            server._faults.clear()
    finally:
        store.close()
        server.stop()


def test_frame_buffers_are_used_again_and_kept_within_their_bound():
    pool = FrameBuffers(max_bytes=3 * FrameBuffers.ROUND)
    a = pool.take(100_000)
    assert len(a) == 100_000 and len(a.base) == 2 * FrameBuffers.ROUND
    pool.give([a])
    b = pool.take(70_000)  # the free buffer is large enough: the same memory
    assert np.shares_memory(a, b) and len(b) == 70_000
    c = pool.take(70_000)  # none free: a new one
    assert not np.shares_memory(b, c)
    pool.give([b, c])  # 4 x ROUND would pass the bound: one is dropped
    assert sum(len(x) for same in pool._free.values() for x, _ in same) <= pool.max_bytes
    frame = numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE).encode(np.arange(1 << 17, dtype="<u2") % 300)
    tables = FrameTables()
    tables.learn("s", "k", frame, 1 << 18, version=(len(frame), '"a"'))
    lo, hi, table = tables.span("s", "k", 1 << 18, 0, 1000)
    dirty = pool.take(len(frame))
    dirty[:] = 0xAB  # what an earlier frame left
    out = assemble(table, lo, memoryview(frame)[lo:hi], dirty)
    assert len(out) == len(frame) and out[:hi].tobytes() == (frame[:len(table.head)] + bytes(lo - len(table.head))
                                                             + frame[lo:hi])
    assert not out[hi:].any()


def test_frame_buffers_lend_the_smallest_free_buffer_that_fits():
    r = FrameBuffers.ROUND
    pool = FrameBuffers(max_bytes=64 * r)
    taken = [pool.take(n * r) for n in (4, 1, 3, 3, 6)]
    pool.give(taken)
    got = pool.take(2 * r + 1)  # 3 x ROUND: the smallest that fits (of the two, the one given back last)
    assert len(got.base) == 3 * r and np.shares_memory(got, taken[3])
    assert len(pool.take(3 * r).base) == 3 * r and len(pool.take(3 * r).base) == 4 * r  # then the next size up
    assert len(pool.take(r).base) == r and len(pool.take(5 * r).base) == 6 * r
    fresh = pool.take(r)  # none free: a new one
    assert not any(np.shares_memory(fresh, t) for t in taken)


def test_a_pooled_frame_is_byte_for_byte_the_frame_assemble_lays_out_whatever_its_buffer_held():
    # frames of two sizes, each with spans at its start, middle and end, laid out in turn in the pool's
    # buffers: each must equal the frame assemble() lays out in a new buffer (zeros wherever no block is),
    # whatever an earlier frame (or a buffer taken and written by anyone) left in the same memory
    rng = np.random.default_rng(3)
    frames = [numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE).encode(
        (np.arange(n, dtype="<u2") // 8 % 250 + rng.integers(0, 2, n)).astype("<u2")) for n in (1 << 17, 1 << 16)]
    tables = FrameTables()
    for i, frame in enumerate(frames):
        tables.learn("s", f"k{i}", frame, (1 << 17 >> i) * 2, version=(len(frame), '"a"'))
    pool = FrameBuffers(max_bytes=FrameBuffers.ROUND * 8)
    used = pool.take(len(frames[0]))
    used[:] = 0xAB  # a buffer taken and written by anyone: every byte of it may hold something
    pool.give([used])
    laid = 0
    for i, start, stop in [(0, 0, 1000), (0, 200_000, 201_000), (1, 50_000, 50_100), (0, 262_000, 262_144),
                           (1, 0, 10), (0, 0, 1000), (1, 131_000, 131_072)]:
        frame, nbytes = frames[i], (1 << 17 >> i) * 2
        lo, hi, table = tables.span("s", f"k{i}", nbytes, start, stop)
        out = pool.assemble(table, lo, memoryview(frame)[lo:hi])
        expected = assemble(table, lo, memoryview(frame)[lo:hi])
        assert out.tobytes() == expected.tobytes()
        assert out.tobytes() == frame[:len(table.head)] + bytes(lo - len(table.head)) + frame[lo:hi] + \
            bytes(len(frame) - hi)
        decoded = np.zeros(nbytes, np.uint8)
        blosc.decode_range(out, start, stop, decoded)
        whole = np.frombuffer(numcodecs.Blosc().decode(frame), np.uint8)
        assert decoded[start:stop].tobytes() == whole[start:stop].tobytes()
        laid += np.shares_memory(out, used)
        pool.give([out])
    assert laid >= 2  # the dirtied buffer was laid out in, more than once


def test_a_taken_buffer_that_dies_lent_leaves_no_record_a_later_buffer_could_pick_up():
    # what assemble wrote is kept by the buffer's id: a buffer first made by take(), given back, lent by
    # assemble and dropped lent (a failed batch) must take that record with it, or a later buffer at the same id
    # would be given back with it (zeros skipped over bytes an earlier frame left: wrong frames)
    frame = numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE).encode(np.arange(1 << 17, dtype="<u2") % 300)
    tables = FrameTables()
    tables.learn("s", "k", frame, 1 << 18, version=(len(frame), '"a"'))
    lo, hi, table = tables.span("s", "k", 1 << 18, 0, 1000)
    pool = FrameBuffers(max_bytes=FrameBuffers.ROUND * 8)
    taken = pool.take(len(frame))
    pool.give([taken])
    out = pool.assemble(table, lo, memoryview(frame)[lo:hi])
    assert np.shares_memory(out, taken) and len(pool._written) == 1
    del taken, out  # dies lent
    gc.collect()
    assert pool._written == {}
