"""Batches of samples of named fields (``stoker.Sample({name: (uris, box)})``) against zarr-python, bit for bit:
fields of different shapes, boxes, dtypes and channels, on both decode paths (and the GPU-decode executor,
run on the CPU); per-field dtypes; budgets, errors and slots per field; the transform on the dict; the
training side (CropDataset, CropBatches). The CUDA path's tests need a GPU and are skipped without one."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.cpu.executor import engine_available
from stoker.engine.pipeline import facade as pipelines

from interrupts import pop_through_interrupts
from store_fixtures import FAST_REMOTE, random_int_arrays, range_server_fixture, written_tree_fixture, zarr_values

pytestmark = pytest.mark.timeout(90)

SHAPE = (40, 70, 90)


def _write(path, shape, chunks, dtype, seed, shards=None, compressors=None):
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                          compressors=compressors or BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"))
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.uint64:  # instance ids: large, and above float's exact range
        data = rng.integers(0, 2**63, size=shape, dtype=np.uint64)
    else:
        data = rng.integers(0, np.iinfo(dtype).max, size=shape, endpoint=True).astype(dtype)
    z[:] = data
    return str(path), data


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """raw (uint16, two arrays for channels), labels (uint64, sharded zstd), mask (uint8, coarser: half size)."""
    root = tmp_path_factory.mktemp("fields")
    return {
        "raw": _write(root / "raw.zarr", SHAPE, (8, 16, 32), "uint16", 0),
        "raw2": _write(root / "raw2.zarr", SHAPE, (8, 16, 32), "uint16", 1),
        "labels": _write(root / "labels.zarr", SHAPE, (8, 8, 8), "uint64", 2, shards=(16, 16, 16),
                         compressors=ZstdCodec(level=1)),
        "mask": _write(root / "mask.zarr", (20, 35, 45), (8, 8, 8), "uint8", 3),
    }


def _samples(arrays, n, seed=0, channels=True):
    """Samples of three fields: raw (2 channels, 16x24x24), labels (8x12x12, centred in raw's box), mask
    (8x12x12 at half resolution, around the same centre)."""
    rng = np.random.default_rng(seed)
    raw = [arrays["raw"][0], arrays["raw2"][0]] if channels else arrays["raw"][0]
    out = []
    for _ in range(n):
        a = [int(rng.integers(0, s - c + 1)) for s, c in zip(SHAPE, (16, 24, 24))]
        half = [min(x // 2, s - c) for x, s, c in zip(a, (20, 35, 45), (8, 12, 12))]
        out.append(stoker.Sample({
            "raw": (raw, [(x, x + c) for x, c in zip(a, (16, 24, 24))]),
            "labels": (arrays["labels"][0], [(x + o, x + o + c) for x, o, c in zip(a, (4, 6, 6), (8, 12, 12))]),
            "mask": (arrays["mask"][0], [(x, x + c) for x, c in zip(half, (8, 12, 12))]),
        }))
    return out


def _crop(data, sample):
    return data[tuple(slice(a, b) for a, b in sample.aabb)]


def _expected(arrays, name, field, dtype):
    """What zarr-python reads for one field's sample, cast by the pipeline's rules."""
    by_uri = {uri: data for uri, data in arrays.values()}
    crops = [_crop(by_uri[u], field) for u in field.uris]
    crop = np.stack(crops) if field.channels is not None else crops[0]
    if dtype == "native":
        return torch.from_numpy(np.ascontiguousarray(crop))
    if dtype == "bf16":
        return torch.from_numpy(crop.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(crop.astype({"f32": np.float32, "f16": np.float16}[dtype]))


def _cfg(**kw):
    base = dict(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                pop_timeout_s=20.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


def _check(arrays, batch, dtypes):
    assert isinstance(batch, stoker.FieldBatch)
    x = {k: torch.from_dlpack(v) for k, v in batch.items()}
    assert list(x) == list(batch.samples[0].names) and batch.rows == len(batch.samples) == batch.batch_size
    for name, t in x.items():
        assert t.shape[0] == batch.rows
        assert batch[name].samples == tuple(s[name] for s in batch.samples)
        for row, s in enumerate(batch.samples):
            want = _expected(arrays, name, s[name], dtypes[name])
            assert t[row].dtype == want.dtype and torch.equal(t[row], want), (name, row, s)


def _lane_slots_free(p, timeout=5.0):
    """Whether every lane's slots are free again but those of the batches in flight, one per lane each (views
    die a moment after their last use)."""
    deadline = time.monotonic() + timeout
    lanes = list(p._coordinator.lanes)
    while time.monotonic() < deadline:
        gc.collect()
        with p._cond:
            inflight = sum(1 for e in p._coordinator.inflight if e.parts is not None)
        if lanes and all(lane.executor.held() == inflight for lane in lanes):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("dtype", [{"raw": "f32", "labels": "native", "mask": "native"},
                                   {"raw": "bf16", "labels": "native", "mask": "f16"}], ids=["f32", "bf16"])
def test_fields_are_zarr_s_bit_for_bit(arrays, decode_path, dtype):
    samples = _samples(arrays, 24)
    with stoker.Pipeline(_cfg(dtype=dtype)) as p:
        p.push(samples)
        seen = []
        for batch in p:
            assert len(batch) == 3 and batch.rows == 4  # a mapping's length: its fields; rows: its samples
            assert [tuple(batch[n].info.shape) for n in batch] == [(4, 2, 16, 24, 24), (4, 8, 12, 12), (4, 8, 12, 12)]
            _check(arrays, batch, dtype)
            seen += batch.samples
        assert seen == samples  # every sample once, in push order
        stats = p.stats()
        assert stats.samples == 24 and stats.batches_emitted == 6
        # every field's bytes are counted: raw (2 channels of f32 or bf16), labels (uint64), mask
        per_batch = sum(4 * math.prod(shape) * size for shape, size in [
            ((2, 16, 24, 24), 4 if dtype["raw"] == "f32" else 2), ((8, 12, 12), 8), ((8, 12, 12), 1 if dtype["mask"] == "native" else 2)])
        assert stats.bytes_delivered == 6 * per_batch


def test_one_dtype_applies_to_every_field_and_stats_count_every_field(arrays, decode_path):
    samples = _samples(arrays, 8, seed=1, channels=False)
    samples = [stoker.Sample({"raw": s["raw"], "mask": s["mask"]}) for s in samples]  # uint16 and uint8: f32 is exact
    with stoker.Pipeline(_cfg(dtype="f32")) as p:
        p.push(samples)
        for batch in p:
            _check(arrays, batch, {"raw": "f32", "mask": "f32"})
            assert {batch[n].info.dtype for n in batch} == {torch.float32}
        held = sum(lane.executor.host_nbytes() for lane in p._coordinator.lanes)
        assert 0 < held <= p.stats().peak_host_bytes <= 64 << 20  # the lanes' slots and buffers, all within the budget


def test_the_gpu_decode_executor_carries_fields(arrays, monkeypatch):
    """Each lane is an executor like any: here the GPU-decode one, run on CPU tensors (its reference decoder)."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor

    made = []

    def factory(cfg, device, stats, store):
        made.append(GpuDecodeExecutor.on_host(cfg, stats, store))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    dtype = {"raw": "f32", "labels": "native", "mask": "native"}
    with stoker.Pipeline(_cfg(dtype=dtype)) as p:
        p.push(_samples(arrays, 12, seed=2))
        for batch in p:
            _check(arrays, batch, dtype)
    assert len(made) == 4  # the pipeline's own (unused) and one per field
    assert all(ex.slots is not None for ex in made[1:])


# -- what every sample of a pipeline must share ---------------------------------------------------------------


def test_field_names_shapes_and_channels_must_match_the_first_sample(arrays):
    raw, labels = arrays["raw"][0], arrays["labels"][0]
    first = stoker.Sample({"raw": (raw, [(0, 8)] * 3), "labels": (labels, [(0, 4)] * 3)})
    cases = [
        (stoker.Sample({"raw": (raw, [(0, 8)] * 3), "seg": (labels, [(0, 4)] * 3)}), stoker.InvalidArgument,
         r"missing: \['labels'\].*not in the first: \['seg'\]"),
        (stoker.Sample({"raw": (raw, [(0, 8)] * 3), "labels": (labels, [(0, 5)] * 3)}), stoker.InvalidArgument,
         r"field 'labels' .* has shape \(5, 5, 5\); it must be \(4, 4, 4\)"),
        (stoker.Sample({"raw": (raw, [(0, 8)] * 3), "labels": (labels, [(0, 4)] * 2)}), stoker.RankMismatch,
         "field 'labels' .* has 2 axes"),
        (stoker.Sample({"raw": ([raw, raw], [(0, 8)] * 3), "labels": (labels, [(0, 4)] * 3)}), stoker.InvalidArgument,
         "field 'raw' .* reads 2 arrays"),
        (stoker.Sample(raw, [(0, 8)] * 3), stoker.InvalidArgument, "reads samples of one kind"),
    ]
    for bad, error, match in cases:
        with stoker.Pipeline(_cfg()) as p:
            p.push([first])
            with pytest.raises(error, match=match):
                p.push([bad])  # a sized push is checked at once
        with stoker.Pipeline(_cfg(batch_size=2)) as p:
            p.push(iter([first, bad]))  # an iterable: checked as pulled, the error at pop
            with pytest.raises(error, match=match):
                p.pop()
    with stoker.Pipeline(_cfg()) as p:  # plain first, then fields
        p.push([stoker.Sample(raw, [(0, 8)] * 3)])
        with pytest.raises(stoker.InvalidArgument, match="reads samples of one kind"):
            p.push([first])
    with stoker.Pipeline(_cfg(sample_shape=(8, 8, 8))) as p:
        with pytest.raises(stoker.InvalidArgument, match="sample_shape") as got:
            p.push([first])
        assert got.value.knob == "sample_shape"


def test_per_field_dtypes_are_checked(arrays):
    cfg = stoker.Config(dtype={"raw": torch.bfloat16, "labels": "native"})
    assert cfg.dtype == {"raw": "bf16", "labels": "native"} and cfg.field_dtype("raw") == "bf16"
    assert stoker.Config(dtype="f16").field_dtype("anything") == "f16"
    for bad, match in [({}, "at least one field"), ({"raw": "f64"}, r"Config.dtype\['raw'\] must be one of"),
                       ({"": "f32"}, "field names"), ({1: "f32"}, "field names"),
                       ({"raw": torch.float64}, r"Config.dtype\['raw'\]")]:
        with pytest.raises(stoker.InvalidArgument, match=match) as got:
            stoker.Config(dtype=bad)
        assert got.value.knob == "dtype"
    samples = _samples(arrays, 4, channels=False)
    for dtype, match in [({"raw": "f32", "labels": "native"}, "no dtype for field 'mask'"),
                         ({"raw": "f32", "labels": "native", "mask": "native", "seg": "f32"},
                          r"names field\(s\) \['seg'\] that the samples do not have")]:
        with stoker.Pipeline(_cfg(dtype=dtype)) as p:  # checked at the first batch, which knows the fields
            p.push(samples)
            with pytest.raises(stoker.InvalidArgument, match=match) as got:
                p.pop()
            assert got.value.knob == "dtype"
    with stoker.Pipeline(_cfg(dtype={"raw": "f32"})) as p:  # a dict is for samples of fields only
        p.push([stoker.Sample(arrays["raw"][0], [(0, 4)] * 3)] * 4)
        with pytest.raises(stoker.InvalidArgument, match="gives a dtype per field"):
            p.pop()


def test_native_needs_one_source_dtype_per_field_and_names_it(arrays, tmp_path):
    other, _ = _write(tmp_path / "i32.zarr", SHAPE, (8, 16, 32), "int32", 5)
    s = stoker.Sample({"raw": ([arrays["raw"][0], other], [(0, 8)] * 3), "mask": (arrays["mask"][0], [(0, 4)] * 3)})
    with stoker.Pipeline(_cfg(dtype={"raw": "native", "mask": "native"})) as p:
        p.push([s] * 4)
        with pytest.raises(stoker.DtypeMismatch, match="field 'raw': dtype='native' needs one source dtype") as got:
            p.pop()
        assert got.value.field == "raw"


# -- budgets ----------------------------------------------------------------------------------------------------


def test_budgets_below_1_mib_per_field_are_refused(arrays):
    samples = _samples(arrays, 4, channels=False)
    with stoker.Pipeline(_cfg(host_buffer_bytes=2 << 20, dtype={"raw": "f32", "labels": "native", "mask": "native"})) as p:
        p.push(samples)
        with pytest.raises(stoker.BudgetExceeded, match=r"cannot hold 3 fields \(raw, labels, mask\)") as got:
            p.pop()
    assert got.value.knob == "host_buffer_bytes" and got.value.needed == 3 << 20
    # device_buffer_bytes counts device memory: a CPU pipeline's fields do not split it
    with stoker.Pipeline(_cfg(device_buffer_bytes=1 << 20, dtype={"raw": "f32", "labels": "native", "mask": "native"})) as p:
        p.push(samples)
        with p.pop() as batch:
            _check(arrays, batch, {"raw": "f32", "labels": "native", "mask": "native"})


def test_a_lane_s_budget_error_names_the_field_and_the_pipeline_s_knob(arrays, tmp_path):
    """The raw array's one large chunk needs more decode room than raw's share of host_buffer_bytes holds: the
    error names raw and the knob's value that gives the share room; with that value the pipeline reads."""
    big, data = _write(tmp_path / "big.zarr", (64, 128, 128), (32, 128, 128), "uint16", 6,
                       compressors=ZstdCodec(level=1))
    arrays = {**arrays, "big": (big, data)}
    samples = [stoker.Sample({"raw": (big, [(i, i + 16)] * 3), "labels": (arrays["labels"][0], [(i, i + 8), (0, 12), (0, 12)])})
               for i in range(8)]
    dtype = {"raw": "f32", "labels": "native"}
    with stoker.Pipeline(_cfg(host_buffer_bytes=3 << 20, dtype=dtype)) as p:
        p.push(samples)
        with pytest.raises(stoker.BudgetExceeded, match="field 'raw' .* of Config.host_buffer_bytes=3,145,728") as got:
            p.pop()
    err = got.value
    assert err.field == "raw" and err.knob == "host_buffer_bytes" and err.needed > 3 << 20
    assert f"must be at least {err.needed:,}" in str(err)
    with stoker.Pipeline(_cfg(host_buffer_bytes=err.needed, dtype=dtype)) as p:
        p.push(samples)
        for batch in p:
            _check(arrays, batch, dtype)


def test_the_lanes_engine_is_sized_once_and_their_buffers_stay_within_the_budget(arrays):
    """The fields' lanes share one compiled engine of n_compute_threads threads: its scratch is what one engine
    of them wants for the fields' arrays (each lane once gave it a whole engine's worth of its own share, so
    three fields gave three, taken from their Python paths), and the lanes' slots, Python budgets and that
    engine together hold at most host_buffer_bytes."""
    from stoker.engine.cpu.executor import engine_available, engine_wants

    if not engine_available():
        pytest.skip("stoker._native is not built")
    samples = _samples(arrays, 8, channels=False)
    dtype = {"raw": "f32", "labels": "native", "mask": "native"}
    cfg = _cfg(host_buffer_bytes=256 << 20, dtype=dtype)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        for batch in p:
            _check(arrays, batch, dtype)
        lanes = list(p._coordinator.lanes)
        decoders = [lane.executor.decoders for lane in lanes]
        engines = {id(d.native.engine) for d in decoders}
        assert len(engines) == 1  # every lane submits to the one engine
        engine = decoders[0].native.engine.info()["budget"]
        readers = [stoker.open_array(arrays[name][0]) for name in ("raw", "labels", "mask")]
        assert engine == engine_wants(cfg.compute_threads, readers)
        held = sum(lane.executor.host_nbytes() + d.budget.capacity for lane, d in zip(lanes, decoders)) + engine
        assert held <= cfg.host_buffer_bytes
        assert p.stats().peak_host_bytes <= cfg.host_buffer_bytes


def test_every_field_s_chunks_are_decoded_by_the_lanes_shared_engine(arrays, monkeypatch):
    """With room for the whole engine in the first lane's share (256 MiB), the later lanes join it with no
    scratch of their own; their arrays' chunks are still the engine's to read and decode (sized against the
    engine's scratch, not the lane's 0): no chunk of any field goes to the Python path."""
    from stoker.engine.cpu.decode_python import PythonDecoder

    if not engine_available():
        pytest.skip("stoker._native is not built")
    python: list[str] = []  # the arrays of the chunks the Python path decoded
    decode = PythonDecoder._decode
    monkeypatch.setattr(PythonDecoder, "_decode", lambda self, job, task, *a, **k:
                        python.append(job.plan.sources[task.source].uri) or decode(self, job, task, *a, **k))
    samples = _samples(arrays, 8, channels=False)
    dtype = {"raw": "f32", "labels": "native", "mask": "native"}
    with stoker.Pipeline(_cfg(host_buffer_bytes=256 << 20, dtype=dtype)) as p:
        p.push(samples)
        for batch in p:
            _check(arrays, batch, dtype)
        stats = p.stats()
        budgets = [lane.executor.decoders.native.budget_bytes for lane in p._coordinator.lanes]
    assert budgets[0] > 0 and 0 in budgets[1:]  # the case: a lane that gave the engine nothing
    assert all(stats.fields[name].chunks_decoded > 0 for name in dtype)
    assert python == []


#: two arrays a loopback HTTP server serves (each field one), in whole zstd chunk values
REMOTE_SHAPE = (64, 48)
REMOTE_ARRAYS = {name: dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1)) for name in ("one", "two")}
REMOTE_BOXES = [[(0, 20), (0, 20)], [(3, 23), (5, 25)], [(40, 60), (20, 40)], [(44, 64), (0, 20)]]
data = written_tree_fixture(random_int_arrays(REMOTE_ARRAYS, REMOTE_SHAPE))
http = range_server_fixture()


def test_every_field_s_disk_cache_hits_are_read_by_the_lanes_shared_engine(http, data, tmp_path, monkeypatch):
    """The disk cache's hits of a known generation are read by the compiled engine from their entry files
    (csrc/entries.c), for every field: a lane that joined the shared engine with no scratch of its own
    (256 MiB: the first lane's share sizes it) has its arrays' entries sized against the engine's scratch too,
    so none of its hits is read in Python."""
    from stoker.storage.diskcache import DiskCache, disk_cache

    if not engine_available() or not native.zstd:
        pytest.skip("stoker._native is not built with zstd")
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)  # the process's one for the folder: the pipelines' too
    cfg = _cfg(batch_size=len(REMOTE_BOXES), dtype="native", host_buffer_bytes=256 << 20, cache_dir=str(folder),
               cache_bytes=64 << 20, prefetch_bytes=0, storage_options={http.url + "/": dict(FAST_REMOTE)})
    samples = [stoker.Sample({"a": (f"{http.url}/one", box), "b": (f"{http.url}/two", box)}) for box in REMOTE_BOXES]
    want = {"a": zarr_values(data, "one"), "b": zarr_values(data, "two")}

    def batch(p) -> None:
        p.push(samples)
        with p.pop() as b:
            for name, values in want.items():
                got = torch.from_dlpack(b[name]).numpy()
                for row, box in enumerate(REMOTE_BOXES):
                    np.testing.assert_array_equal(got[row], values[tuple(slice(*s) for s in box)])

    with stoker.Pipeline(cfg) as p:  # epoch 1: fetched, kept
        batch(p)
    assert cache.flush(30)
    read: dict[str, list[str]] = {"python": [], "engine": []}  # the chunk keys of the entries each read
    get_many = DiskCache.get_many
    chunk = lambda ident: ident.split("\n")[1]  # noqa: E731 - its key (an array's zarr.json is no chunk)
    monkeypatch.setattr(DiskCache, "get_many", lambda cache, idents, read_files=None: read["python"].extend(
        chunk(i) for i in idents if "/c/" in chunk(i)) or get_many(cache, idents, read_files))
    from stoker.engine.cpu import decode_native

    class FromDisk(decode_native._FromDisk):  # an engine job reading disk-cache entries: its batch's arrays
        __slots__ = ()

        def __init__(self, stores, owner, kind, sources) -> None:
            super().__init__(stores, owner, kind, sources)
            if len(owner):
                read["engine"].extend(reader.path for reader in sources.readers)

    # entries found in the decoder's table (what the first batch's reads made) ask the cache for no entry file
    monkeypatch.setattr(decode_native, "_FromDisk", FromDisk)
    with stoker.Pipeline(cfg) as p:  # epoch 2, a new pipeline
        batch(p)  # HTTP: the first batch revalidates (HEAD) and reads the hits in Python
        budgets = [lane.executor.decoders.native.budget_bytes for lane in p._coordinator.lanes]
        read["python"].clear()
        read["engine"].clear()
        asked = http.requests
        batch(p)  # generations known now: the engine reads every field's entries itself
        assert http.requests == asked  # no request: every chunk a hit
    assert budgets[0] > 0 and budgets[1] == 0  # the case: a lane that gave the engine nothing
    assert read["python"] == [], "a hit of a known generation was read in Python"
    assert {key.split("/")[0] for key in read["engine"]} == {"one", "two"}


# -- failures and slots ---------------------------------------------------------------------------------------


@pytest.fixture
def corrupt_labels(tmp_path):
    """Labels whose chunk c/1/0/0 (rows 8-15) is truncated: batches reading rows 0-7 are fine."""
    uri, data = _write(tmp_path / "bad.zarr", (16, 12, 12), (8, 12, 12), "uint64", 7, compressors=ZstdCodec(level=1))
    chunk = Path(uri) / "c" / "1" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-9])
    return uri, data


def test_a_corrupt_chunk_in_one_field_fails_the_batch_naming_the_field(arrays, corrupt_labels, decode_path):
    labels, data = corrupt_labels
    arrays = {**arrays, "bad": corrupt_labels}
    raw = arrays["raw"][0]

    def sample(i, row):
        return stoker.Sample({"raw": (raw, [(i, i + 16), (0, 24), (0, 24)]), "labels": (labels, [(row, row + 4), (0, 12), (0, 12)])})

    good = [sample(i, i % 4) for i in range(4)]
    bad = [sample(i, 10) for i in range(4)]
    dtype = {"raw": "f32", "labels": "native"}
    with stoker.Pipeline(_cfg(dtype=dtype, lookahead_batches=1)) as p:
        p.push(good + bad + good)
        with p.pop() as first:
            _check(arrays, first, dtype)
        with pytest.raises(stoker.DecodeError, match="field 'labels'") as got:
            p.pop()
        assert got.value.field == "labels" and "bad.zarr" in str(got.value)
        with pytest.raises(stoker.DecodeError) as again:  # sticky, as for batches of one box
            p.pop()
        assert again.value is got.value
        with pytest.raises(stoker.DecodeError):
            p.push(good)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.5  # closed promptly, the third batch in flight or not


def test_many_batches_with_a_small_lookahead_leak_no_slot(arrays, decode_path):
    dtype = {"raw": "f32", "labels": "native", "mask": "native"}
    with stoker.Pipeline(_cfg(dtype=dtype, lookahead_batches=1, batch_size=2)) as p:
        p.push(_samples(arrays, 80, seed=4))
        n = 0
        for batch in p.batches(40):  # each released when the next is asked for
            _check(arrays, batch, dtype)
            n += 1
        assert n == 40
        assert all(lane.executor.n_slots == 2 for lane in p._coordinator.lanes)
        assert _lane_slots_free(p)
    with stoker.Pipeline(_cfg(dtype=dtype, lookahead_batches=1, batch_size=2, pop_timeout_s=1.0)) as p:
        p.push(_samples(arrays, 16, seed=5))
        held = [p.pop(), p.pop()]  # both slots of every lane held: no third batch until one is released
        with pytest.raises(stoker.PoolStarved, match="holds all 2 batch slots"):
            p.pop(timeout=0.5)
        held[0].release()
        with p.pop() as third:
            _check(arrays, third, dtype)
        held[1].release()
        with pytest.raises(RuntimeError, match="released"):
            torch.from_dlpack(held[1]["raw"])


def test_ctrl_c_anywhere_in_pop_loses_no_batch_of_fields(arrays, decode_path):
    """A KeyboardInterrupt at every point of a pop in turn: the batch of fields stays for the next pop, each comes
    once and in order, state_dict counts only those received, and no field's slot leaks."""
    bs, n_batches = 2, 4
    samples = _samples(arrays, bs * n_batches, seed=6)
    dtype = {"raw": "f32", "labels": "native", "mask": "native"}

    def keep(batch) -> list:
        _check(arrays, batch, dtype)
        return list(batch.samples)

    with stoker.Pipeline(_cfg(dtype=dtype, batch_size=bs, lookahead_batches=1, pop_timeout_s=5)) as p:
        received, interrupts = pop_through_interrupts(p, samples, bs, keep)
        assert _lane_slots_free(p)
    assert interrupts > 10 * n_batches
    assert [s for got in received for s in got] == samples


# -- the transform ----------------------------------------------------------------------------------------------


def test_the_transform_runs_once_on_the_dict_of_fields(arrays, decode_path):
    calls = []

    def flip_both(x):  # the same flip on every field: what RandomFlip-like transforms do
        calls.append(sorted(x))
        x["raw"] = x["raw"].flip(-1)  # a new tensor put in the dict: copied into the slot
        x["mask"].copy_(x["mask"].flip(-1))  # in place
        return x

    dtype = {"raw": "f32", "mask": "native"}
    samples = [stoker.Sample({"raw": s["raw"], "mask": s["mask"]}) for s in _samples(arrays, 8, seed=7)]
    with stoker.Pipeline(_cfg(dtype=dtype, transform=flip_both)) as p:
        p.push(samples)
        for batch in p:
            x = {k: torch.from_dlpack(v) for k, v in batch.items()}
            for row, s in enumerate(batch.samples):
                for name in x:
                    assert torch.equal(x[name][row], _expected(arrays, name, s[name], dtype[name]).flip(-1))
        assert calls == [["mask", "raw"]] * 2  # once per batch
        assert p.stats().stages["transform"].count == 2


def test_a_failing_transform_fails_its_batch(arrays):
    def bad(x):
        return {"raw": x["raw"]}  # a field missing

    samples = [stoker.Sample({"raw": s["raw"], "labels": s["labels"]}) for s in _samples(arrays, 4, seed=8)]
    with stoker.Pipeline(_cfg(dtype={"raw": "f32", "labels": "native"}, transform=bad)) as p:
        p.push(samples)
        with pytest.raises(stoker.InvalidArgument, match=r"must return the batch \(fields \['labels', 'raw'\]\)") as got:
            p.pop()
        assert got.value.knob == "transform"


# -- the training side ------------------------------------------------------------------------------------------


def test_crop_dataset_and_crop_batches_yield_dicts(arrays, decode_path):
    samples = [stoker.Sample({"raw": s["raw"], "labels": s["labels"]}) for s in _samples(arrays, 8, seed=9)]
    dtype = {"raw": "f32", "labels": "native"}
    ds = stoker.CropDataset(stoker.SampleList(samples), _cfg(dtype=dtype), with_samples=True)
    got = list(ds)
    assert len(got) == 2
    for batch_samples, x in got:
        assert isinstance(x, dict) and list(x) == ["raw", "labels"]
        for row, s in enumerate(batch_samples):
            for name in x:
                assert torch.equal(x[name][row], _expected(arrays, name, s[name], dtype[name]))
    ds = stoker.CropDataset(stoker.SampleList(samples), _cfg(dtype=dtype), copy=True)
    first = next(iter(ds))
    assert {k: v.shape for k, v in first.items()} == {"raw": (4, 2, 16, 24, 24), "labels": (4, 8, 12, 12)}

    from stoker.train.data import CropBatches

    with CropBatches(stoker.SampleList(samples).for_rank(0, 1), _cfg(dtype=dtype), with_samples=True) as data:
        for step, (batch_samples, x) in zip(range(3), data):
            assert isinstance(x, dict)
            for row, s in enumerate(batch_samples):
                assert torch.equal(x["labels"][row], _expected(arrays, "labels", s["labels"], "native"))


def test_the_trainer_s_loss_fn_gets_the_dict(arrays):
    from stoker.train.trainer import Trainer

    samples = [stoker.Sample({"raw": s["raw"], "labels": s["labels"]}) for s in _samples(arrays, 8, seed=10)]
    model = torch.nn.Linear(1, 1)
    seen = []

    def loss_fn(m, batch):
        seen.append({k: (tuple(v.shape), v.dtype) for k, v in batch.items()})
        return m(batch["raw"].mean().reshape(1, 1)).sum() * 0 + batch["labels"].float().mean() * 0

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.0), loss_fn, device="cpu", progress=False)
    ds = stoker.CropDataset(stoker.SampleList(samples), _cfg(dtype={"raw": "f32", "labels": "native"}))
    trainer.fit(ds, steps=2, resume=None)
    assert seen and seen[0] == {"raw": ((4, 2, 16, 24, 24), torch.float32), "labels": ((4, 8, 12, 12), torch.uint64)}


# -- on a GPU ---------------------------------------------------------------------------------------------------


def _on_host(monkeypatch, hybrid: bool = False):
    """Pipelines built from here on decode with the GPU-decode executor (``hybrid``: the hybrid one) run on CPU
    tensors (its host stand-in), so the logic of a CUDA test's ``decode_on="gpu"`` (``"hybrid"``) runs where no
    GPU is; returns the executors made."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.hybrid.executor import HybridExecutor

    kind = HybridExecutor if hybrid else GpuDecodeExecutor
    made: list = []
    monkeypatch.setattr(pipelines, "make_executor",
                        lambda cfg, device, stats, store: made.append(kind.on_host(cfg, stats, store)) or made[-1])
    return made


#: on a GPU, every decode path; "host", "hybrid-host": the GPU-decode and hybrid executors' logic on CPU tensors
_DECODE_ON = pytest.mark.parametrize("decode_on", [pytest.param("cpu", marks=pytest.mark.cuda),
                                                   pytest.param("gpu", marks=pytest.mark.cuda),
                                                   pytest.param("hybrid", marks=pytest.mark.cuda),
                                                   "host", "hybrid-host"])


def _decode_on(decode_on: str, monkeypatch) -> tuple[bool, list | None, dict]:
    """A ``_DECODE_ON`` test's set-up: whether it runs on a GPU, the executors made on the host ("host",
    "hybrid-host"; None on a GPU), and the Config knobs of its pipelines."""
    from stoker.engine.gpu import nvcomp

    if decode_on in ("gpu", "hybrid") and not nvcomp.available():
        pytest.skip("nvCOMP is not installed")
    on_gpu = not decode_on.endswith("host")
    made = None
    if on_gpu:
        torch.cuda.set_device(0)
    else:
        made = _on_host(monkeypatch, hybrid=decode_on == "hybrid-host")
    return on_gpu, made, dict(device=0 if on_gpu else "cpu", device_buffer_bytes=64 << 20,
                              decode_on=decode_on if on_gpu else "gpu")


@_DECODE_ON
def test_cuda_batches_of_fields_are_the_cpu_s(arrays, decode_on, monkeypatch):
    """On a GPU, every decode path; "host", "hybrid-host": the GPU-decode and hybrid executors' logic on CPU
    tensors."""
    on_gpu, made, knobs = _decode_on(decode_on, monkeypatch)
    dtype = {"raw": "bf16", "labels": "native", "mask": "f32"}
    samples = _samples(arrays, 16, seed=11)
    with stoker.Pipeline(_cfg(dtype=dtype, **knobs)) as p:
        p.push(samples)
        n = 0
        for batch in p:
            assert all(batch[k].info.device == (torch.device("cuda", 0) if on_gpu else torch.device("cpu"))
                       and (batch[k].info.ready_event is not None) == on_gpu for k in batch)
            # copies (on the host .cpu() would be the slot itself, held past its batch)
            x = {k: torch.from_dlpack(v).to("cpu", copy=True) for k, v in batch.items()}
            for row, s in enumerate(batch.samples):
                for name in x:
                    assert torch.equal(x[name][row], _expected(arrays, name, s[name], dtype[name]))
            n += 1
        assert n == 4
        assert _lane_slots_free(p)
    if not on_gpu:
        assert len(made) == 4 and all(ex.slots is not None for ex in made[1:])  # the pipeline's, one per field


@_DECODE_ON
def test_cuda_transform_of_fields_is_fenced_for_the_consumer(arrays, decode_on, monkeypatch):
    """On a GPU, every decode path; "host", "hybrid-host": the GPU-decode and hybrid executors' logic on CPU
    tensors (no fence there)."""
    on_gpu, _, knobs = _decode_on(decode_on, monkeypatch)
    dtype = {"raw": "f32", "labels": "native"}
    samples = [stoker.Sample({"raw": s["raw"], "labels": s["labels"]}) for s in _samples(arrays, 8, seed=12)]

    def scale(x):
        x["raw"].mul_(2)

    with stoker.Pipeline(_cfg(dtype=dtype, transform=scale, **knobs)) as p:
        p.push(samples)
        side = torch.cuda.Stream() if on_gpu else None
        for batch in p:
            # another stream than the transform's: it waits on the batch's event
            with torch.cuda.stream(side) if on_gpu else contextlib.nullcontext():
                x = {k: torch.from_dlpack(v).cpu() for k, v in batch.items()}
            for row, s in enumerate(batch.samples):
                assert torch.equal(x["raw"][row], _expected(arrays, "raw", s["raw"], "f32") * 2)
                assert torch.equal(x["labels"][row], _expected(arrays, "labels", s["labels"], "native"))


def test_an_interrupt_inside_the_transform_loses_that_batch_rather_than_transforming_it_twice(arrays):
    """The transform of fields runs in pop, on the consumer's thread: a Ctrl-C inside it leaves the fields part
    transformed, so the next pop says the batch is lost instead of running the transform on it again."""
    calls = []

    def interrupted(x):
        calls.append(1)
        x["raw"].mul_(2)
        if len(calls) == 1:
            raise KeyboardInterrupt

    samples = [stoker.Sample({"raw": s["raw"], "mask": s["mask"]}) for s in _samples(arrays, 8, seed=13)]
    with stoker.Pipeline(_cfg(dtype={"raw": "f32", "mask": "native"}, transform=interrupted)) as p:
        p.push(samples)
        with pytest.raises(KeyboardInterrupt):
            p.pop()
        with pytest.raises(stoker.StokerError, match="interrupted while its transform ran on its fields"):
            p.pop()
    assert len(calls) == 1


def test_batches_of_one_box_take_no_lane(arrays, decode_path):
    uri, data = arrays["raw"]
    with stoker.Pipeline(_cfg()) as p:
        p.push([stoker.Sample(uri, [(i, i + 8), (0, 16), (0, 16)]) for i in range(8)])
        for batch in p:
            assert type(batch) is stoker.Batch
            x = torch.from_dlpack(batch)
            for row, s in enumerate(batch.samples):
                assert torch.equal(x[row], torch.from_numpy(_crop(data, s).astype(np.float32)))
        assert not p._coordinator.lanes.ready and p._executors() == [p._executor]


def _chunk_files(path: str, box, chunks) -> set[str]:
    """The chunk files zarr-python wrote for the chunks ``box`` touches (v3 default keys ``c/i/j/k``)."""
    ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, chunks)]
    return {str(Path(path) / "c" / "/".join(map(str, idx))) for idx in np.ndindex(*[len(r) for r in ranges])
            for idx in [tuple(r[i] for r, i in zip(ranges, idx))]}


def test_stats_report_amplification_per_field(tmp_path, decode_path):
    """Stats.fields: each field's bytes needed, read and decoded, from its own chunks only: against the sizes
    of the chunk files zarr-python wrote for the distinct chunks each batch's crops of that field touch."""
    rng = np.random.default_rng(7)
    img = zarr.create_array(str(tmp_path / "img.zarr"), shape=(32, 48, 48), chunks=(8, 16, 16), dtype="u2",
                            compressors=ZstdCodec(level=3))
    img[:] = rng.integers(0, 50, img.shape, dtype=np.uint16)  # compressible: read < decoded
    lab = zarr.create_array(str(tmp_path / "lab.zarr"), shape=(32, 48, 48), chunks=(4, 4, 4), dtype="u1",
                            compressors=ZstdCodec(level=3))
    lab[:] = rng.integers(0, 3, lab.shape, dtype=np.uint8)
    samples = []
    for _ in range(12):  # img's box straddles its chunks; lab's box is exactly chunk-aligned: amplification 1
        z, y, x = (int(v) for v in rng.integers(0, 4, 3) * 4)
        samples.append(stoker.Sample({"img": (str(tmp_path / "img.zarr"),
                                              [(z + 1, z + 13), (y + 3, y + 19), (x + 5, x + 21)]),
                                      "lab": (str(tmp_path / "lab.zarr"), [(z + 4, z + 12), (y + 4, y + 12),
                                                                           (x + 4, x + 12)])}))
    with stoker.Pipeline(_cfg(dtype={"img": "f32", "lab": "native"})) as p:
        p.push(samples)
        assert sum(1 for _ in p) == 3
        stats = p.stats()
    assert list(stats.fields) == ["img", "lab"]
    for name, itemsize, chunks in (("img", 2, (8, 16, 16)), ("lab", 1, (4, 4, 4))):
        got = stats.fields[name]
        path = str(tmp_path / f"{name}.zarr")
        files = [set().union(*(_chunk_files(path, s[name].aabb, chunks) for s in samples[b:b + 4]))
                 for b in range(0, 12, 4)]  # a batch decodes a chunk its samples share once
        assert got.bytes_needed == sum(math.prod(s[name].shape) * itemsize for s in samples)
        assert got.chunks_needed == sum(len(_chunk_files(path, s[name].aabb, chunks)) for s in samples)
        # once a batch at most; batches in flight together may share one read and decode (the engine's jobs)
        every = set().union(*files)
        assert len(every) <= got.chunks_decoded <= sum(len(f) for f in files)
        assert got.bytes_decoded == got.chunks_decoded * math.prod(chunks) * itemsize
        assert (sum(Path(f).stat().st_size for f in every) <= got.bytes_read
                <= sum(Path(f).stat().st_size for fs in files for f in fs))
        assert got.bytes_delivered == sum(math.prod(s[name].shape) for s in samples) * (4 if name == "img" else 1)
    # lab's aligned boxes decode nothing they do not need (less than 1: chunks its samples share are decoded
    # once a batch); img's straddle its chunks (8 chunks, 5.3 times its bytes, a box). How many of those are
    # decoded depends on how many batches are in flight together (they share them): bounded above, not here
    assert stats.fields["lab"].decode_amplification <= 1.0
    assert stats.fields["img"].chunks_needed * 8 * 16 * 16 * 2 > 5 * stats.fields["img"].bytes_needed
    assert stats.fields["img"].read_amplification < stats.fields["img"].decode_amplification
    # the fields' counts are the pipeline's, split
    for key in ("bytes_needed", "bytes_read", "bytes_decoded", "chunks_needed", "chunks_decoded", "bytes_delivered"):
        assert getattr(stats, key) == sum(getattr(c, key) for c in stats.fields.values()), key
    assert "decode amp" in str(stats) and "\nlab " in str(stats)



def test_batches_in_flight_that_share_chunks_are_zarr_s_bit_for_bit(tmp_path, decode_path):
    """Segmentation's layout (raw uint16 in shards of zstd inner chunks, uint64 labels centred in its box),
    crops drawn close together and several batches in flight: inner chunks that batches in flight share are
    read and decoded once by the engine, placed into each batch with its own copies and cast (raw to f32,
    labels to i64, their ids checked). Every batch is zarr-python's values, bit for bit."""
    shape = (64, 128, 128)
    raw, raw_data = _write(tmp_path / "raw.zarr", shape, (32, 64, 64), "uint16", 8, shards=(64, 128, 128),
                           compressors=ZstdCodec(level=3))
    labels, label_data = _write(tmp_path / "labels.zarr", shape, (32, 64, 64), "uint64", 9, shards=(64, 128, 128),
                                compressors=ZstdCodec(level=1))
    rng = np.random.default_rng(10)
    samples = []
    for _ in range(96):
        a = [int(rng.integers(0, s - 40 + 1)) for s in shape]
        samples.append(stoker.Sample({"raw": (raw, [(x, x + 40) for x in a]),
                                      "labels": (labels, [(x + 8, x + 32) for x in a])}))
    with stoker.Pipeline(_cfg(dtype={"raw": "f32", "labels": "i64"}, lookahead_batches=3, n_compute_threads=1,
                              batch_size=8, host_buffer_bytes=96 << 20)) as p:
        p.push(samples)
        # kept and checked after: a consumer as quick as training's lets the engine run batches ahead
        got = [({k: torch.from_dlpack(v).clone() for k, v in b.items()}, b.samples) for b in p.batches(12)]
        fields = p.stats().fields
    assert len(got) == 12
    for x, batch_samples in got:
        for row, s in enumerate(batch_samples):
            assert torch.equal(x["raw"][row], torch.from_numpy(_crop(raw_data, s["raw"]).astype(np.float32)))
            assert torch.equal(x["labels"][row], torch.from_numpy(_crop(label_data, s["labels"]).astype(np.int64)))
    print({k: (f.chunks_decoded, f.chunks_needed) for k, f in fields.items()})


# -- one compiled engine for a pipeline's fields ----------------------------------------------------------------


def _steps(tmp_path, n=12):
    """A forecasting variable as xarray writes it: (time, 24, 36) float32, one step a chunk (zstd)."""
    z = zarr.create_array(str(tmp_path / "t2m.zarr"), shape=(n, 24, 36), chunks=(1, 24, 36), dtype="f4",
                          compressors=ZstdCodec(level=1))
    z[:] = np.random.default_rng(5).standard_normal(z.shape).astype(np.float32)
    return str(tmp_path / "t2m.zarr")


def _engines(p) -> list:
    """The distinct compiled engines of a pipeline's lanes."""
    engines = {}
    for lane in p._coordinator.lanes:
        native = lane.executor.decoders.native
        engines[id(native.engine)] = native.engine
    return list(engines.values())


def _tasks() -> set[int]:
    """The OS thread ids of this process."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _engine_threads(engine) -> set[int]:
    """The OS thread ids of ``engine``'s threads (each says its own as it starts: waited for, 10 s at most).
    Its own, not a count of the process's threads that are no Python thread: in a long test run's process,
    others (an HTTP client's runtime, a thread being started) come and go meanwhile."""
    deadline = time.monotonic() + 10
    while True:
        clocks = np.frombuffer(engine.worker_clocks(), np.int64).reshape(-1, native.N_WORKER_COLS)
        tids = clocks[:, native.W_TID]
        if (tids != 0).all() or time.monotonic() > deadline:
            return set(tids.tolist())
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_fields_pipeline_runs_one_engine_of_n_compute_threads(tmp_path):
    """Every lane (field) submits to one compiled engine: a pipeline of two fields runs n_compute_threads
    engine threads, not that many per field, and reports each once (Stats.workers); closed, none is left."""
    if not engine_available():
        pytest.skip("the compiled engine is not built")
    uri = _steps(tmp_path)
    with stoker.Pipeline(_cfg(batch_size=2, n_compute_threads=3)) as p:
        p.push([stoker.Sample({"input": (uri, [(t, t + 2), (0, 24), (0, 36)]),
                               "target": (uri, [(t + 4, t + 5), (0, 24), (0, 36)])}) for t in range(4)])
        for batch in p:
            batch.release()
        engines = _engines(p)
        assert len(engines) == 1
        threads = _engine_threads(engines[0])
        assert len(threads) == 3 and 0 not in threads and threads <= _tasks()
        assert len(p.stats().workers) == 3
    deadline = time.monotonic() + 5
    while threads & _tasks() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not threads & _tasks()


@pytest.mark.parametrize("host_buffer_bytes", [64 << 20, 256 << 20], ids=["topped-up", "sized-by-one-lane"])
def test_a_chunk_two_fields_in_flight_need_is_decoded_once(tmp_path, host_buffer_bytes):
    """Input and target steps that overlap (input t=3..4, target t=4: a step one sample reads as input and
    another as target) are one chunk file: with both fields' jobs in flight together (the engine's thread held
    busy until both are submitted, as test_native_engine does), it is read and decoded once, placed into both
    fields (values as zarr-python reads them), and counted decoded in one field only. At 64 MiB the first lane's
    share holds less than the engine wants and the second tops it up; at 256 MiB the first lane's share sizes the
    whole engine and the second joins with no scratch of its own, its chunks still the engine's."""
    if not engine_available():
        pytest.skip("the compiled engine is not built")
    from test_native_engine import Tables

    uri = _steps(tmp_path)
    data = zarr.open_array(uri, mode="r")[:]
    with stoker.Pipeline(_cfg(batch_size=1, n_compute_threads=1, lookahead_batches=1,
                              host_buffer_bytes=host_buffer_bytes)) as p:
        p.push(stoker.Sample({"input": (uri, [(0, 2), (0, 24), (0, 36)]), "target": (uri, [(6, 7), (0, 24), (0, 36)])}))
        p.pop().release()  # the lanes and their engines exist now
        budgets = [lane.executor.decoders.native.budget_bytes for lane in p._coordinator.lanes]
        assert (budgets[1] == 0) == (host_buffer_bytes == 256 << 20), budgets  # the two cases, as named
        # a second or so of the one thread's work: 500,000 tiny chunks decoded from one buffer (none shareable)
        t = Tables(tmp_path / "busy", 500000)
        value = Path(t.write(0)).read_bytes()
        t.chunks[:, native.C_FILE] = -1
        t.chunks[:, native.C_BUFFER] = 0
        # every engine's thread held (one per pipeline; one per field before they shared), so no job starts alone
        busy = [engine.submit(*t.args(), [value]) for engine in _engines(p)]
        p.stats_reset()
        p.push(stoker.Sample({"input": (uri, [(3, 5), (0, 24), (0, 36)]), "target": (uri, [(4, 5), (0, 24), (0, 36)])}))
        deadline = time.monotonic() + 20
        while not p._coordinator.inflight and time.monotonic() < deadline:  # both fields' jobs submitted
            time.sleep(0.005)
        assert p._coordinator.inflight
        for job in busy:
            assert not job.done
            job.cancel()
        batch = p.pop()
        np.testing.assert_array_equal(torch.from_dlpack(batch["input"]).numpy()[0], data[3:5])
        np.testing.assert_array_equal(torch.from_dlpack(batch["target"]).numpy()[0], data[4:5])
        batch.release()
        stats = p.stats()
    assert stats.fields["input"].chunks_needed == 2 and stats.fields["target"].chunks_needed == 1
    # step 4 decoded once, by the input's job (the first in chunk order), placed into the target's too
    assert (stats.fields["input"].chunks_decoded, stats.fields["target"].chunks_decoded) == (2, 0)
    assert stats.stages["decode"].count == 2
