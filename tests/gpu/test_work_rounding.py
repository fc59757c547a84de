"""A 16-bit batch made in a float32 work buffer (CF decoding, a transform) is rounded once into the output, and a
finite value there past the output's largest (65504 for "f16") fails the batch with the CPU path's
DtypeMismatch naming the array, the chunk and the box, on every executor: the CPU one, the GPU-decode one, the
hybrid and the CUDA transfer (the last three on their CPU stand-ins), never an inf the data did not hold.
Batches whose values fit are the CPU executor's, bit for bit (65519 rounds to 65504); zarr-python and xarray
are the oracles of the stored and decoded values."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine.cuda.transfer import CudaExecutor
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.gpu.streams import HostStreams
from stoker.engine.hybrid.executor import HybridExecutor
from stoker.engine.hybrid.split import Shares
from stoker.engine.pipeline import facade as pipelines
from stoker.engine.rounding import RoundingProbe, chunk_key_at

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:stoker's GPU decode:RuntimeWarning")]

SHAPE, CHUNKS = (8, 12), (4, 4)
TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
BAD = (5, 9)  # in chunk c/1/2

MAKERS = {
    "gpu-host": lambda cfg, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store),
    "hybrid-host": lambda cfg, stats, store: HybridExecutor.on_host(cfg, stats, store, shares=Shares(0.5)),
    "cuda-host": lambda cfg, stats, store: CudaExecutor(cfg, torch.device("cpu"), stats, store,
                                                         streams=HostStreams()),
}


@pytest.fixture(params=["cpu", *MAKERS])
def executor(request, monkeypatch):
    """Pipelines built in the test run on this executor (the CPU one, or a stand-in of a device one)."""
    if request.param != "cpu":
        make = MAKERS[request.param]
        monkeypatch.setattr(pipelines, "make_executor", lambda cfg, device, stats, store: make(cfg, stats, store))
    return request.param


def _cfg(**kw):
    base = dict(batch_size=2, dtype="f16", host_buffer_bytes=16 << 20, device_buffer_bytes=16 << 20,
                n_io_threads=1, n_compute_threads=1, pop_timeout_s=30.0, device="cpu", decode_on="cpu")
    return stoker.Config(**{**base, **kw})


def _packed(root, fmt: int, top: int, scale: float) -> str:
    """int16 counts 0..95 (times 10), packed with ``scale``; the one at BAD is ``top``; fill -1 (a _FillValue)."""
    data = (np.arange(np.prod(SHAPE)) * 10).reshape(SHAPE).astype(np.int16)
    data[BAD] = top
    path = str(root / f"p{fmt}.zarr")
    z = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="int16", fill_value=-1, zarr_format=fmt)
    z[:] = data
    z.attrs.update({"scale_factor": scale, "_FillValue": -1})
    return path


def _decoded(uri, where, scale, offset) -> np.ndarray:
    """xarray's decoding of zarr-python's stored values: float64 ``x * scale + offset``, NaN at the fill."""
    stored = zarr.open_array(uri, mode="r")[where]
    out = stored.astype(np.float64) * scale + offset
    out[stored == -1] = np.nan
    return out


def _batches(cfg, samples):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with stoker.Pipeline(cfg) as p:
            p.push(samples)
            return [torch.from_dlpack(b).clone() for b in p]


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_cf_value_past_f16_fails_naming_its_chunk(tmp_path, executor, fmt):
    """int16 3300 * scale_factor 20.0 = 66000: past f16 after decoding (stored 3300 fits); the batch fails
    naming the array and chunk c/1/2 (v2: "1.2"), as on the CPU; "f32" holds it, as xarray decodes it."""
    uri = _packed(tmp_path, fmt, 3300, 20.0)
    samples = [stoker.Sample(uri, ((0, 8), (4, 12))), stoker.Sample(uri, ((0, 8), (0, 8)))]
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(), samples)
    msg = str(info.value)
    assert info.value.uri == uri and info.value.key == ("c/1/2" if fmt == 3 else "1.2"), msg
    assert "inf" in msg and "f16" in msg and "after CF decoding or the transform" in msg and "'f32'" in msg, msg
    assert "66000" in msg and "((0, 8), (4, 12))" in msg, msg
    got = _batches(_cfg(dtype="f32"), samples)[0][0]
    np.testing.assert_array_equal(got.numpy(), _decoded(uri, np.s_[0:8, 4:12], 20.0, 0.0).astype(np.float32))


def test_values_that_round_into_f16_are_the_cpu_batches(tmp_path, executor):
    """3275.95 * 20 = 65519 rounds to 65504, not inf: the batch is made, the CPU executor's bit for bit (NaN
    where the fill is), on every executor."""
    uri = _packed(tmp_path, 3, 3275, 20.0)
    zarr.open_array(uri, mode="r+").attrs.update({"add_offset": 19.0})  # 3275 * 20 + 19 = 65519
    samples = [stoker.Sample(uri, ((0, 8), (4, 12))), stoker.Sample(uri, ((0, 8), (0, 8)))]
    got = _batches(_cfg(), samples)[0]
    assert got.dtype == torch.float16 and float(got[0][BAD[0], BAD[1] - 4]) == 65504.0
    for row, (y, x) in zip(got, [(slice(0, 8), slice(4, 12)), (slice(0, 8), slice(0, 8))]):
        want = torch.from_numpy(_decoded(uri, (y, x), 20.0, 19.0).astype(np.float32)).to(torch.float16)
        assert torch.equal(torch.isnan(row), torch.isnan(want))
        assert torch.equal(row.nan_to_num(0.5), want.nan_to_num(0.5))


def test_cf_values_near_f16_ties_are_rounded_once(tmp_path, executor):
    """int16 counts 0..95 packed with scale_factor 1e-6 and add_offset 281.125: 281.125001 ... lie just past a
    float16 tie (281.125, between 281.0 and 281.25) that float32 rounds them onto; rounded to nearest in the
    float32 work buffer and again into float16 they went to even, 281.0, on every executor. Now the batch is
    NumPy's one rounding of xarray's float64 values (281.25), NaN at the fill."""
    uri = _packed(tmp_path, 3, 0, 1e-6)
    z = zarr.open_array(uri, mode="r+")
    z[:] = np.arange(np.prod(SHAPE), dtype=np.int16).reshape(SHAPE)
    z[0, 11] = -1
    z.attrs.update({"add_offset": 281.125})
    samples = [stoker.Sample(uri, ((0, 8), (0, 12))), stoker.Sample(uri, ((0, 8), (0, 12)))]
    got = _batches(_cfg(), samples)[0][0]
    want = torch.from_numpy(_decoded(uri, np.s_[0:8, 0:12], 1e-6, 281.125).astype(np.float16))
    assert float(want[0, 1]) == 281.25 and bool(torch.isnan(got[0, 11]))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), (got, want)


@pytest.mark.parametrize("out", ["f16", "bf16"])
def test_a_transform_past_the_output_fails_naming_the_chunk_of_the_value(tmp_path, executor, out):
    """A transform (x * 2**k) that takes one value past the 16-bit output: DtypeMismatch naming the chunk the
    value came from, not an inf; the same transform on the rest of the array makes the batch."""
    data = np.ones(SHAPE, np.float32)
    data[BAD] = 3.0 if out == "f16" else 1.998  # times 2**127: past bf16's largest (0x1.fep127), not float32's
    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="float32", fill_value=0.0)[:] = data
    factor = 2.0 ** (15 if out == "f16" else 127)  # 3 * 2**15 = 98304 > 65504
    cfg = _cfg(dtype=out, transform=lambda x: x.mul_(factor))
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(cfg, [stoker.Sample(uri, ((0, 8), (0, 12))), stoker.Sample(uri, ((0, 8), (0, 12)))])
    assert info.value.uri == uri and info.value.key == "c/1/2" and "inf" in str(info.value), str(info.value)
    got = _batches(cfg, [stoker.Sample(uri, ((0, 4), (0, 8))), stoker.Sample(uri, ((4, 8), (0, 8)))])
    want = torch.full((4, 12), factor, dtype=torch.float32).to(TORCH[out])
    assert all(torch.equal(g, want[:, :g.shape[1]]) for b in got for g in b)


def test_the_probe_finds_the_first_crop_and_element_past_the_output(tmp_path):
    """RoundingProbe on a batch of 3 crops of 2 channels: the first crop holding a value that its rounding made
    inf (not an inf or NaN stored as such), that value's place, and each crop's (min, max) of such values."""
    work = torch.zeros(3, 2, 4, 5)
    work[0, 0, 0, 0] = float("inf")  # stays inf: not the rounding's
    work[0, 1, 1, 1] = float("nan")
    work[1, 1, 2, 3] = 70000.0
    work[2, 0, 0, 1] = -1e6
    out = work.to(torch.float16)
    probe = RoundingProbe(out, work, channels=2)
    assert probe.hit.tolist() == [False, False, False, True, True, False]
    assert int(probe.first[3]) == 2 * 5 + 3 and (float(probe.lo[3]), float(probe.hi[3])) == (70000.0, 70000.0)
    assert (float(probe.lo[4]), float(probe.hi[4])) == (-1e6, -1e6)
    fits = RoundingProbe(work.clamp(-65504, 65504).to(torch.float16), work.clamp(-65504, 65504), channels=2)
    assert fits.hit is None and fits.error(None) is None  # (on the CPU: one look, no reductions)


def test_chunk_keys_of_elements_in_plain_and_sharded_arrays(tmp_path):
    plain = zarr.create_array(str(tmp_path / "a.zarr"), shape=(10, 10), chunks=(4, 4), dtype="uint8")
    sharded = zarr.create_array(str(tmp_path / "s.zarr"), shape=(16, 16), chunks=(2, 2), shards=(8, 8),
                                dtype="uint8")
    assert plain is not None and sharded is not None
    a, s = stoker.open_array(str(tmp_path / "a.zarr")), stoker.open_array(str(tmp_path / "s.zarr"))
    assert chunk_key_at(a, (5, 9)) == "c/1/2" and chunk_key_at(a, (10, 0)) == "padding"
    assert chunk_key_at(a, (-1, 0)) == "padding"
    assert chunk_key_at(s, (9, 3)) == "c/1/0[1]"  # shard (1, 0), inner chunk (0, 1) of 4 x 4


@pytest.mark.parametrize("out", ["f32", "bf16"])
def test_a_cf_value_past_float32_fails_and_a_masked_one_does_not(tmp_path, executor, out):
    """int16 30000 * scale_factor 1e35 = 3e39: finite in xarray's float64, past float32 (the batch's dtype, or
    the work buffer of a bf16 one): DtypeMismatch naming the chunk and Config(cf=False), never inf; the same
    value as the _FillValue is NaN (masked, as xarray masks it), and the rest are xarray's values."""
    data = np.ones(SHAPE, np.int16)
    data[BAD] = 30000
    uri = str(tmp_path / "huge.zarr")
    z = zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="int16", fill_value=0)
    z[:] = data
    z.attrs.update({"scale_factor": 1e35})
    samples = [stoker.Sample(uri, ((0, 8), (4, 12))), stoker.Sample(uri, ((0, 8), (0, 8)))]
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batches(_cfg(dtype=out), samples)
    msg = str(info.value)
    assert info.value.uri == uri and info.value.key == "c/1/2", msg
    assert "3e+39" in msg and "after CF decoding" in msg and "cf=False" in msg and "inf" in msg, msg
    z.attrs.update({"_FillValue": 30000})
    got = _batches(_cfg(dtype=out), samples)[0][0]
    decoded = np.where(data == 30000, np.nan, data * 1e35)[:, 4:12]
    want = torch.from_numpy(decoded.astype(np.float32)).to(TORCH[out])
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5))


HUNG_MAKERS = {
    "gpu-host": lambda cfg, stats, store, backend: GpuDecodeExecutor.on_host(cfg, stats, store, streams=backend),
    "cuda-host": lambda cfg, stats, store, backend: CudaExecutor(cfg, torch.device("cpu"), stats, store,
                                                                  streams=backend),
}


@pytest.mark.parametrize("kind", list(HUNG_MAKERS))
@pytest.mark.parametrize("then", ["limit", "close"])
def test_the_wait_for_a_hung_batch_s_check_ends_at_its_limit_or_the_close(tmp_path, monkeypatch, kind, then):
    """The device hangs in a batch's transform (its event is never done): the check of its rounding, which waits
    for that event, fails the batch with DeviceError at its limit (nvcomp.CHECK_WAIT_S, shortened), or ends at
    the pipeline's close; the executor's threads are gone once close() returns."""
    import threading

    from hung_device import Hung
    from stoker.engine.gpu import nvcomp, streams as gpu_streams

    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 0.3 if then == "limit" else 60.0)
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 0.2)
    backend, hung, made = Hung(), threading.Event(), []

    def factory(cfg, device, stats, store):
        made.append(HUNG_MAKERS[kind](cfg, stats, store, backend))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)

    def hangs(x):
        backend.hang()
        hung.set()
        return x

    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="float32", fill_value=0.0)[:] = np.ones(SHAPE)
    p = stoker.Pipeline(_cfg(transform=hangs, pop_timeout_s=60.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the close's warning of the stream that never ended)
        try:
            p.push([stoker.Sample(uri, ((0, 8), (0, 12)))] * 2)
            if then == "limit":
                with pytest.raises(stoker.DeviceError, match="did not finish"):
                    p.pop()
            else:
                assert hung.wait(30.0)
                closing = threading.Thread(target=p.close, daemon=True)
                closing.start()
                closing.join(30.0)
                assert not closing.is_alive()
        finally:
            p.close()
    threads = [t for ex in made for t in ex.threads()]
    assert made and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("out", ["f32", "f16", "bf16"])
def test_a_typical_packed_batch_makes_no_probe(tmp_path, executor, monkeypatch, out):
    """int16 packed with scale_factor 0.01 and add_offset 280 (xarray's usual temperatures): no decoded value can
    pass 607.68, so no RoundingProbe is made (no reductions queued, no wait for the batch's event), on any
    executor, CF decoding from float64 and 16-bit rounding from the work buffer alike; the batches are xarray's
    values. The same array with scale_factor 1e35 (past float32) makes probes, and fails."""
    made = []
    real = RoundingProbe.__init__

    def counted(self, *args, **kw):
        made.append(args[0].dtype)
        real(self, *args, **kw)

    monkeypatch.setattr(RoundingProbe, "__init__", counted)
    uri = _packed(tmp_path, 3, 32767, 0.01)  # (the largest int16: 607.67)
    zarr.open_array(uri, mode="r+").attrs.update({"add_offset": 280.0})
    samples = [stoker.Sample(uri, ((0, 8), (4, 12))), stoker.Sample(uri, ((0, 8), (0, 8)))]
    got = _batches(_cfg(dtype=out), samples)[0]
    assert made == []
    for row, (y, x) in zip(got, [(slice(0, 8), slice(4, 12)), (slice(0, 8), slice(0, 8))]):
        want = torch.from_numpy(_decoded(uri, (y, x), 0.01, 280.0).astype(np.float32)).to(TORCH[out])
        assert torch.equal(torch.isnan(row), torch.isnan(want))
        assert torch.equal(row.nan_to_num(0.5), want.nan_to_num(0.5))
    zarr.open_array(uri, mode="r+").attrs.update({"scale_factor": 1e35})
    with pytest.raises(stoker.DtypeMismatch, match="after CF decoding"):
        _batches(_cfg(dtype="f32" if out == "f16" else out), samples)
    assert made


@pytest.mark.parametrize("kind", ["gpu-host", "hybrid-host"])
def test_the_submitter_queues_the_next_batch_while_a_rounding_waits(tmp_path, monkeypatch, kind):
    """A batch whose rounding is checked (a transform into f16) is finished once its event is done, and the
    submitter does not wait for that event while it has the next batch to queue: here the first batch's event
    is done only once the second batch's end is queued (its event recorded), so a submitter that waited for it
    first would fail the batch with DeviceError at its limit (nvcomp.CHECK_WAIT_S). Each batch is still its own,
    in order."""
    from stoker.engine.gpu import nvcomp

    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 20.0)
    monkeypatch.setattr(pipelines, "make_executor", lambda cfg, device, stats, store: MAKERS[kind](cfg, stats, store))
    events: list = []

    class BatchEvent:
        """Done once a later batch's event is recorded (the last one: at once)."""

        def __init__(self, n: int) -> None:
            self.n = n
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return len(events) > self.n + 1 or self.n == 3

    def event(self):
        events.append(BatchEvent(len(events)))
        return events[-1]

    monkeypatch.setattr(GpuDecodeExecutor, "_event", event)
    data = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="float32", fill_value=0.0)[:] = data
    boxes = [((0, 4), (0, 4)), ((4, 8), (0, 4)), ((0, 4), (4, 8)), ((4, 8), (4, 8)),
             ((0, 4), (8, 12)), ((4, 8), (8, 12)), ((2, 6), (2, 6)), ((2, 6), (6, 10))]
    got = _batches(_cfg(transform=lambda x: x.mul_(2.0)), [stoker.Sample(uri, box) for box in boxes])
    assert len(got) == 4 and len(events) == 4 and events[0].queries >= 2  # (not done at its first look)
    for i, box in enumerate(boxes):
        want = torch.from_numpy(data[tuple(slice(a, b) for a, b in box)] * 2.0).to(torch.float16)
        assert torch.equal(got[i // 2][i % 2], want), box


def test_a_plain_float64_beside_a_packed_array_is_rounded_once(tmp_path, executor, decode_path):
    """A plain float64 array (no CF attributes) read in an f16 batch beside a packed one goes into the float32
    work buffer the packed one is decoded in: placed there rounded to nearest, 281.125001 landed on the float16
    tie 281.125 and went to even, 281.0, on every executor, where NumPy's one rounding (the "f16" cast rule) is
    281.25. Now its values, and its fill value where no chunk is stored and past its edge, are NumPy's float16
    of zarr-python's."""
    packed = _packed(tmp_path, 3, 0, 0.01)
    plain = str(tmp_path / "plain.zarr")
    data = 281.125 + np.arange(np.prod(SHAPE)).reshape(SHAPE) * 1e-6
    data[4:8, 8:12] = 281.125003  # the fill value: that chunk (c/1/2) is not stored
    z = zarr.create_array(plain, shape=SHAPE, chunks=CHUNKS, dtype="float64", fill_value=281.125003)
    z[:] = data
    assert not os.path.exists(os.path.join(plain, "c", "1", "2"))  # (equal to the fill value: not written)
    past = ((2, 10), (4, 16))  # 2 rows and 4 columns past the array: its fill value there (pad="fill")
    samples = [stoker.Sample(packed, ((0, 8), (0, 12))), stoker.Sample(plain, ((0, 8), (0, 12))),
               stoker.Sample(packed, ((0, 8), (0, 12))), stoker.Sample(plain, past, pad="fill")]
    got = _batches(_cfg(), samples)
    stored = zarr.open_array(plain, mode="r")[:]
    want = torch.from_numpy(stored.astype(np.float16))
    assert float(want[0, 1]) == 281.25 and float(want[5, 9]) == 281.25
    assert torch.equal(got[0][1], want), (got[0][1], want)
    padded = np.full((8, 12), 281.125003)
    padded[:6, :8] = stored[2:, 4:]
    assert torch.equal(got[1][1], torch.from_numpy(padded.astype(np.float16))), got[1][1]


def test_a_float64_array_s_fill_values_stay_missing_in_an_f16_batch(tmp_path, executor, decode_path):
    """A float64 array with a ``_FillValue`` read into "f16" is decoded in float32 work (float64 on the CPU
    executor), its values compared with the fill after placing. Placed as their float16 (the rounding-once rule
    of plain float64 values) -9999.0 became -10000.0 and matched no fill: on the CUDA, GPU-decode and hybrid
    executors the stored fills, the chunk not stored and the padding came out as -10000.0, where xarray has NaN.
    Its values keep their float32 now; a value whose float16 is the fill's (-10001.0) is a value, not missing."""
    uri = str(tmp_path / "f.zarr")
    data = (np.arange(np.prod(SHAPE)) * 0.25).reshape(SHAPE)
    data[1, 1] = data[2, 5] = -9999.0
    data[3, 3] = -10001.0
    data[4:8, 8:12] = -9999.0  # that chunk (c/1/2) is not stored
    z = zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="float64", fill_value=-9999.0)
    z[:] = data
    z.attrs.update({"_FillValue": -9999.0})
    assert not os.path.exists(os.path.join(uri, "c", "1", "2"))
    past = ((2, 10), (4, 16))  # 2 rows and 4 columns past the array: the fill there, decoded to NaN
    got = _batches(_cfg(), [stoker.Sample(uri, ((0, 8), (0, 12))), stoker.Sample(uri, past, pad="fill")])
    stored = zarr.open_array(uri, mode="r")[:]
    want = np.where(stored == -9999.0, np.nan, stored).astype(np.float16)  # xarray's decoding, as float16
    assert np.array_equal(got[0][0].numpy(), want, equal_nan=True), got[0][0]
    assert float(got[0][0][3, 3]) == -10000.0
    padded = np.full((8, 12), np.nan)
    padded[:6, :8] = want[2:, 4:]
    assert np.array_equal(got[0][1].numpy(), padded.astype(np.float16), equal_nan=True), got[0][1]
