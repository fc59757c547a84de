"""Casts never change a label silently: integer outputs ("i32", "i64") keep every value or fail naming the
chunk, on the compiled engine, the Python path and the CUDA path; 32- and 64-bit integers into float outputs
need ``Config(lossy_casts=True)``. Every batch is checked against zarr-python's read of the same box."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BytesCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.cpu.decode_python import PythonDecoder

from native_testing import one_chunk_tables
from store_fixtures import read_tree, write_zip

pytestmark = pytest.mark.timeout(60)

SHAPE, CHUNKS = (12, 10), (4, 5)
BOX = ((1, 11), (2, 9))  # touches all 3 x 2 chunks
TORCH = {"i32": torch.int32, "i64": torch.int64}
TORCH_NAMES = {v: k for k, v in TORCH.items()}


def _cfg(**kw):
    base = dict(batch_size=2, dtype="i64", host_buffer_bytes=16 << 20, n_io_threads=1, n_compute_threads=2,
                pop_timeout_s=20.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


def _write(path, data, fill_value=0, big_endian=False, skip_chunk=None):
    """``data`` as a zstd array of CHUNKS, written by zarr-python; ``skip_chunk``: a chunk left unwritten (read
    as the fill value)."""
    serializer = BytesCodec(endian="big") if big_endian else "auto"
    z = zarr.create_array(str(path), shape=data.shape, chunks=CHUNKS, dtype=data.dtype, fill_value=fill_value,
                          compressors=ZstdCodec(level=1), serializer=serializer)
    z[:] = data
    if skip_chunk is not None:
        os.remove(os.path.join(str(path), "c", *map(str, skip_chunk)))
    return zarr.open_array(str(path), mode="r")


def _batches(cfg, samples):
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        return [torch.from_dlpack(b).clone() for b in p]


@pytest.fixture
def python_casts(monkeypatch):
    """Counts the chunks the Python path casts (the engine's own casts are not counted)."""
    calls = []
    original = PythonDecoder._cast_copies

    def counting(job, task, chunk):
        calls.append(task.key)
        return original(job, task, chunk)

    monkeypatch.setattr(PythonDecoder, "_cast_copies", staticmethod(counting))
    return calls


def _values(dtype: str, out: str, rng) -> np.ndarray:
    """Values of ``dtype`` spanning what ``out`` can hold of them: its extremes included."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, SHAPE).astype(bool)
    have, room = np.iinfo(dt), torch.iinfo(TORCH[out])
    lo, hi = max(have.min, room.min), min(have.max, room.max)
    data = rng.integers(lo, hi, SHAPE, dtype=dt, endpoint=True)
    data[1, 2], data[10, 8] = lo, hi
    return data


SOURCES = ["uint64", "int64", "uint32", "int16", "uint8", "bool"]


@pytest.mark.parametrize("out", ["i32", "i64"])
@pytest.mark.parametrize("dtype", SOURCES + ["uint64-big"])
def test_integer_outputs_are_exact(tmp_path, decode_path, python_casts, dtype, out):
    """Every integer and bool source into "i32"/"i64": the batch is zarr-python's values, exactly, on both
    decode paths (the engine casts every chunk itself: the Python path casts none), a missing chunk its fill."""
    rng = np.random.default_rng(7)
    big = dtype.endswith("-big")
    data = _values(dtype.removesuffix("-big"), out, rng)
    fill = True if data.dtype == bool else int(data[5, 5])
    z = _write(tmp_path / "a.zarr", data, fill_value=fill, big_endian=big, skip_chunk=(2, 1))
    boxes = [BOX, ((0, 10), (0, 7))]
    got = _batches(_cfg(dtype=out), [stoker.Sample(str(tmp_path / "a.zarr"), b) for b in boxes])
    want = torch.from_numpy(np.stack([z[tuple(slice(a, b) for a, b in box)].astype(np.int64) for box in boxes]))
    assert got[0].dtype == TORCH[out]
    assert torch.equal(got[0].to(torch.int64), want)
    if decode_path == "engine" and dtype != "bool":  # the engine takes no bool arrays: those are the Python path's
        assert python_casts == []
    else:
        assert python_casts


OVERFLOWS = [  # source dtype, output, a value that does not fit it
    ("uint64", "i64", 2**63),
    ("uint64", "i64", 2**64 - 1),
    ("uint64", "i32", 2**31),
    ("int64", "i32", 2**31),
    ("int64", "i32", -2**31 - 1),
    ("uint32", "i32", 2**31),
]


@pytest.mark.parametrize("dtype,out,bad", OVERFLOWS)
def test_a_value_that_does_not_fit_names_the_chunk(tmp_path, decode_path, dtype, out, bad):
    """One value beyond the integer output, in chunk (1, 1): DtypeMismatch naming the array and that chunk, on
    both paths. A crop of the same chunk that does not read the value is exact: only what is read is checked."""
    data = np.arange(np.prod(SHAPE), dtype=dtype).reshape(SHAPE)
    data[6, 8] = bad
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data)
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(dtype=out, batch_size=1), [stoker.Sample(uri, BOX)])
    err = info.value
    assert err.uri == uri and err.key == "c/1/1", str(err)
    assert uri in str(err) and "'c/1/1'" in str(err) and out in str(err) and dtype in str(err)
    clear = ((4, 8), (5, 8))  # chunk (1, 1) again, without column 8
    got = _batches(_cfg(dtype=out, batch_size=1), [stoker.Sample(uri, clear)])
    assert torch.equal(got[0][0].to(torch.int64), torch.from_numpy(z[4:8, 5:8].astype(np.int64)))


def test_chunks_fetched_from_a_store_are_checked_too(tmp_path, decode_path, python_casts):
    """An array in a zip archive: its chunks are fetched, and the engine decodes and casts them from the fetched
    buffers; exact values, and a value past "i32" names its chunk, as for files."""
    data = np.arange(np.prod(SHAPE), dtype=np.int64).reshape(SHAPE) - 60
    bad = data.copy()
    bad[6, 8] = 2**40
    _write(tmp_path / "d" / "ok.zarr", data)
    _write(tmp_path / "d" / "bad.zarr", bad)
    archive = tmp_path / "data.zip"
    write_zip(str(archive), read_tree(str(tmp_path / "d")))
    got = _batches(_cfg(dtype="i32", batch_size=1), [stoker.Sample(f"{archive}/ok.zarr", BOX)])
    assert torch.equal(got[0][0].to(torch.int64), torch.from_numpy(data[1:11, 2:9]))
    assert (python_casts == []) == (decode_path == "engine")
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(dtype="i32", batch_size=1), [stoker.Sample(f"{archive}/bad.zarr", BOX)])
    assert info.value.key == "c/1/1" and "bad.zarr" in info.value.uri


def test_a_fill_value_that_does_not_fit_names_the_missing_chunk(tmp_path, decode_path):
    """A uint64 array whose fill value is past int64: a crop reading a missing chunk fails naming it; crops of
    written chunks only are exact."""
    data = np.arange(np.prod(SHAPE), dtype=np.uint64).reshape(SHAPE)
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=2**64 - 1, skip_chunk=(0, 1))
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(batch_size=1), [stoker.Sample(uri, BOX)])
    assert info.value.key == "c/0/1" and str(2**64 - 1) in str(info.value)
    assert "'c/0/1' is not stored and reads as the array's fill value" in str(info.value)  # no file to look in
    got = _batches(_cfg(batch_size=1), [stoker.Sample(uri, ((4, 12), (0, 10)))])
    assert torch.equal(got[0][0], torch.from_numpy(z[4:12].astype(np.int64)))


@pytest.mark.parametrize("dtype, fill, fits", [
    ("uint64", 2**64 - 1, {torch.float32}),
    ("uint64", 2**63 - 1, {torch.int64, torch.float32}),
    ("uint32", 2**32 - 1, {torch.int64, torch.bfloat16}),
    ("int64", -2**31, {torch.int32, torch.int64}),
    ("int64", -2**31 - 1, {torch.int64}),
    ("uint16", 65535, {torch.int32, torch.int64}),
])
def test_check_fill_refuses_a_fill_value_past_an_integer_batch(tmp_path, dtype, fill, fits):
    """cast.check_fill, the one check of a fill value against the batch dtype (a missing chunk on the Python
    path, the padding of pad="fill"): on arrays zarr-python wrote, a DtypeMismatch naming the array, the key
    and the value where it does not fit an integer batch, nothing where it fits or the batch is a float's."""
    from stoker.engine.cast import check_fill

    z = _write(tmp_path / "a.zarr", np.zeros(SHAPE, dtype), fill_value=fill)
    reader = stoker.open_array(str(z.store.root))
    for out in (torch.int32, torch.int64, torch.float32, torch.bfloat16):
        if out in fits or out.is_floating_point:
            check_fill(reader, out, "c/0/1")
            continue
        with pytest.raises(stoker.DtypeMismatch) as info:
            check_fill(reader, out, "c/0/1")
        assert info.value.uri == reader.uri and info.value.key == "c/0/1", (out, info.value)
        assert f"the value {fill} outside {TORCH_NAMES[out]}" in str(info.value), (out, info.value)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("out", ["i32", "i64"])
def test_float_sources_into_integer_outputs_are_refused_before_any_read(tmp_path, decode_path, dtype, out):
    """Refused when the first batch settles its dtype: every chunk file is garbage, and the error is still the
    dtype's (nothing was read), saying to use a float dtype."""
    uri = str(tmp_path / "a.zarr")
    _write(tmp_path / "a.zarr", np.ones(SHAPE, dtype))
    for root, _, files in os.walk(os.path.join(uri, "c")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"not a chunk")
    with pytest.raises(stoker.DtypeMismatch, match=rf"{dtype}.*'{out}'.*float dtype") as info:
        _batches(_cfg(dtype=out, batch_size=1), [stoker.Sample(uri, BOX)])
    assert info.value.uri == uri


LOSSY = ["int32", "uint32", "int64", "uint64"]


@pytest.mark.parametrize("out", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("dtype", LOSSY)
def test_wide_integers_into_floats_need_lossy_casts(tmp_path, decode_path, dtype, out):
    """32- and 64-bit integer sources into float outputs: refused before any read, naming the array, its dtype,
    the knob and the exact outputs; with lossy_casts=True cast as numpy casts (to float32 first for bf16).
    (Past float16's largest value they would be inf: refused even so, tests/engine/test_float_casts.py.)"""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 2**20 if out != "f16" else 65504, SHAPE).astype(dtype)
    data[0, 3] = np.iinfo(dtype).max if out != "f16" else 65519  # rounds in every float output
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data)
    sample = stoker.Sample(uri, ((0, 12), (0, 10)))
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(dtype=out, batch_size=1), [sample])
    msg = str(info.value)
    assert info.value.uri == uri and uri in msg and dtype in msg
    assert "Config(lossy_casts=True)" in msg and "'i32'" in msg and "'i64'" in msg and "'native'" in msg
    got = _batches(_cfg(dtype=out, batch_size=1, lossy_casts=True), [sample])[0][0]
    full = z[:]
    want = {"f32": lambda: torch.from_numpy(full.astype(np.float32)),
            "f16": lambda: torch.from_numpy(full.astype(np.float16)),
            "bf16": lambda: torch.from_numpy(full.astype(np.float32)).to(torch.bfloat16)}[out]()
    assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                       want.view(torch.int16 if want.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("dtype", ["int16", "uint16", "int8", "uint8", "bool"])
def test_narrow_integers_into_floats_stay_allowed(tmp_path, decode_path, dtype):
    data = np.arange(np.prod(SHAPE)).reshape(SHAPE).astype(dtype)
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=False if dtype == "bool" else 0)
    got = _batches(_cfg(dtype="f32", batch_size=1), [stoker.Sample(uri, BOX)])[0][0]
    assert torch.equal(got, torch.from_numpy(z[1:11, 2:9].astype(np.float32)))


def test_native_mix_advice_keeps_ids_exact(tmp_path):
    """Sources of two dtypes under "native": the advice names the exact integer output, never a float one."""
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    _write(tmp_path / "a.zarr", np.zeros(SHAPE, np.uint16))
    _write(tmp_path / "b.zarr", np.zeros(SHAPE, np.uint64))
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(dtype="native", batch_size=1), [stoker.Sample([a, b], BOX)])
    msg = str(info.value)
    assert "'i64'" in msg and "bf16" not in msg and "f16" not in msg


def test_config_dtype_and_lossy_casts_are_validated():
    assert stoker.Config(dtype="i32").dtype == "i32" and stoker.Config(dtype=torch.int64).dtype == "i64"
    assert stoker.Config(dtype="i64").output_dtype == torch.int64
    assert stoker.Config().lossy_casts is False and stoker.Config(lossy_casts=True).lossy_casts is True
    with pytest.raises(stoker.InvalidArgument, match="lossy_casts must be True or False") as info:
        stoker.Config(lossy_casts=1)
    assert info.value.knob == "lossy_casts"
    with pytest.raises(stoker.InvalidArgument, match="'i32', 'i64'") as info:
        stoker.Config(dtype="i16")
    assert info.value.knob == "dtype"
    with pytest.raises(stoker.InvalidArgument, match="torch.int32, torch.int64"):
        stoker.Config(dtype=torch.int16)


# ---------------------------------------------------------------------------------------------
# The engine's casts, table by table (csrc/place.c): every layout and byte order, ST_RANGE and zero in place

@pytest.mark.skipif(native.Engine is None, reason="the compiled engine is not built")
@pytest.mark.parametrize("out", ["i32", "i64"])
@pytest.mark.parametrize("layout", ["C", "F", "C-swapped"])
@pytest.mark.parametrize("dtype", [str(d) for d in native.SOURCE_KINDS])
def test_engine_integer_kinds(tmp_path, dtype, layout, out):
    """A chunk placed by the engine into an integer batch: the values that fit exactly, each one that does not
    zero with the chunk's status ST_RANGE; float sources are refused when the job is submitted."""
    dt = np.dtype(dtype)
    kind = native.KIND_I32 if out == "i32" else native.KIND_I64
    room = torch.iinfo(TORCH[out])
    rng = np.random.default_rng(11)
    if dt.kind == "f":
        chunk = np.ones((6, 20), dt)
    else:
        have = np.iinfo(dt)
        chunk = rng.integers(max(have.min, room.min), min(have.max, room.max), (6, 20), dtype=dt, endpoint=True)
    bad = dt.kind in "iu" and (np.iinfo(dt).max > room.max or np.iinfo(dt).min < room.min)
    if bad:  # one value past the output's range, inside the copy below
        chunk[2, 5] = np.iinfo(dt).max if np.iinfo(dt).max > room.max else np.iinfo(dt).min
    chunks, sources, files, blob, strides = one_chunk_tables(str(tmp_path), chunk, layout, 1)
    copies = np.array([[1 * strides[0] + 3 * strides[1], 17, 4, 17]], np.int64)  # rows 1..4, columns 3..19
    batch = torch.full((2, 5, 17), -7, dtype=TORCH[out])
    engine = native.Engine(1, 1 << 20)
    args = (chunks, copies, sources, files, blob, batch.view(-1).view(torch.uint8).numpy(), kind, False,
            np.array([17, 1], np.int64))
    if dt.kind == "f":
        with pytest.raises(ValueError, match="cannot be cast"):
            engine.submit(*args)
        return
    job = engine.submit(*args)
    assert job.wait(10)
    status = np.frombuffer(job.results()[0], np.int32).tolist()
    assert status == [native.ST_RANGE if bad else native.ST_OK]
    want = torch.full((2, 5, 17), -7, dtype=torch.int64)
    part = chunk[1:5, 3:20].astype(object)
    fits = np.vectorize(lambda v: room.min <= v <= room.max)(part)
    want[0, 1:5] = torch.from_numpy(np.where(fits, part, 0).astype(np.int64))
    assert torch.equal(batch.to(torch.int64), want)


@pytest.mark.skipif(native.Engine is None, reason="the compiled engine is not built")
@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
@pytest.mark.parametrize("dtype,out", [("uint64", "i64"), ("int64", "i64"), ("uint32", "i64"), ("uint64", "i32"),
                                       ("int64", "i32"), ("uint16", "i32")])
def test_engine_integer_casts_in_whole_lines(tmp_path, dtype, out, stream):
    """Rows long enough to be written in whole cache lines (streamed: the 64-byte lines go through a buffer
    and out with streaming stores, 8-byte words for 8-byte elements): values past the output at a line's first,
    middle and last element and in a row's unaligned head and tail are zero with ST_RANGE, every other value
    exact, the batch outside the copy untouched."""
    dt, kind = np.dtype(dtype), native.KIND_I32 if out == "i32" else native.KIND_I64
    room, have = torch.iinfo(TORCH[out]), np.iinfo(dt)
    rng = np.random.default_rng(5)
    chunk = rng.integers(max(have.min, room.min), min(have.max, room.max), (4, 100), dtype=dt, endpoint=True)
    # the copy: rows 0..3, columns 3..99, to batch columns 5..101 of rows 104 elements apart
    col = 5 - 3  # batch column minus chunk column
    per_line = 64 // TORCH[out].itemsize
    first_full = -(-8 * 5 // 64) * per_line if out == "i64" else 16  # the first element of a whole line (row 0)
    spots = [(0, 3), (0, first_full - col), (0, first_full - col + per_line // 2),
             (0, first_full - col + per_line - 1), (3, 99)]
    past = have.max > room.max or have.min < room.min
    if past:
        for r, c in spots:
            chunk[r, c] = have.max if have.max > room.max else have.min
    chunks, sources, files, blob, _ = one_chunk_tables(str(tmp_path) + "/", chunk, "C", 1)
    copies = np.array([[3, 5, 4, 97]], np.int64)
    batch = torch.full((5, 104), -7, dtype=TORCH[out])
    engine = native.Engine(1, 1 << 20)
    job = engine.submit(chunks, copies, sources, files, blob, batch.view(-1).view(torch.uint8).numpy(), kind,
                        stream, np.array([104, 1], np.int64))
    assert job.wait(10)
    assert np.frombuffer(job.results()[0], np.int32).tolist() == [native.ST_RANGE if past else native.ST_OK]
    want = torch.full((5, 104), -7, dtype=torch.int64)
    part = chunk[:, 3:].astype(object)
    fits = np.vectorize(lambda v: room.min <= v <= room.max)(part)
    want[:4, 5:102] = torch.from_numpy(np.where(fits, part, 0).astype(np.int64))
    assert torch.equal(batch.to(torch.int64), want)


@pytest.mark.parametrize("out", ["i32", "i64"])
@pytest.mark.parametrize("dtype", SOURCES)
def test_gpu_decode_executor_integer_outputs(tmp_path, monkeypatch, dtype, out):
    """The GPU-decode executor (run on the CPU by its host stand-in): exact values, a value past the output a
    DtypeMismatch naming its chunk (it casts whole chunks on the CPU), a fill value past it refused up front."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.pipeline import facade

    monkeypatch.setattr(facade, "make_executor",
                        lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
    rng = np.random.default_rng(7)
    data = _values(dtype, out, rng)
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=True if data.dtype == bool else 0, skip_chunk=(2, 1))
    boxes = [BOX, ((0, 10), (0, 7))]
    cfg = _cfg(dtype=out, device_buffer_bytes=16 << 20)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _batches(cfg, [stoker.Sample(uri, b) for b in boxes])
    want = np.stack([z[tuple(slice(a, b) for a, b in box)].astype(np.int64) for box in boxes])
    assert got[0].dtype == TORCH[out] and torch.equal(got[0].to(torch.int64), torch.from_numpy(want))
    on_cpu = [str(w.message) for w in seen if "decoded on the CPU" in str(w.message)]
    room = torch.iinfo(TORCH[out])
    widening = data.dtype == bool or (data.dtype.itemsize < TORCH[out].itemsize and data.dtype != np.uint32)
    # widenings are cast on the device (nothing to check); the others on the CPU, every value checked
    assert on_cpu == [] if widening or data.dtype == np.dtype(out.replace("i", "int")) else "every value is checked" in on_cpu[0], on_cpu
    if data.dtype == bool or np.iinfo(data.dtype).max <= room.max:
        return
    data[6, 8] = np.iinfo(data.dtype).max
    _write(tmp_path / "b.zarr", data)
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(cfg, [stoker.Sample(str(tmp_path / "b.zarr"), BOX)] * 2)
    assert info.value.key == "c/1/1"
    _write(tmp_path / "c.zarr", data[:4] * 0, fill_value=np.iinfo(data.dtype).max)
    with pytest.raises(stoker.DtypeMismatch, match="fill value"):
        _batches(cfg, [stoker.Sample(str(tmp_path / "c.zarr"), ((0, 4), (0, 5)))] * 2)


# ---------------------------------------------------------------------------------------------
# The CUDA path: narrow sources cross as themselves and are cast on the GPU, wide ones are cast on the host


@pytest.mark.cuda
@pytest.mark.parametrize("decode_on", ["cpu", "gpu", "hybrid"])
@pytest.mark.parametrize("out", ["i32", "i64"])
@pytest.mark.parametrize("dtype", SOURCES)
def test_cuda_integer_outputs_are_exact(tmp_path, dtype, out, decode_on):
    """On a GPU (the CUDA transfer path, and the GPU decode where nvCOMP is installed): the batch is
    zarr-python's values, exactly; a value past the output fails naming its chunk."""
    if decode_on in ("gpu", "hybrid"):
        pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed")
    torch.cuda.set_device(0)
    rng = np.random.default_rng(7)
    data = _values(dtype, out, rng)
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=True if data.dtype == bool else 0, skip_chunk=(2, 1))
    boxes = [BOX, ((0, 10), (0, 7))]
    cfg = _cfg(dtype=out, device=0, device_buffer_bytes=16 << 20, decode_on=decode_on)
    got = _batches(cfg, [stoker.Sample(uri, b) for b in boxes])
    want = np.stack([z[tuple(slice(a, b) for a, b in box)].astype(np.int64) for box in boxes])
    assert got[0].is_cuda and got[0].dtype == TORCH[out]
    assert torch.equal(got[0].cpu().to(torch.int64), torch.from_numpy(want))
    room = torch.iinfo(TORCH[out])
    if data.dtype != bool and np.iinfo(data.dtype).max > room.max:
        data[6, 8] = np.iinfo(data.dtype).max
        _write(tmp_path / "b.zarr", data)
        with pytest.raises(stoker.DtypeMismatch) as info:
            _batches(cfg, [stoker.Sample(str(tmp_path / "b.zarr"), BOX)] * 2)
        assert info.value.key == "c/1/1"
