"""The hybrid executor (``Config(decode_on="hybrid")``), run end to end on CPU tensors: its GPU part is the
GPU-decode executor with its host stand-in (``gpu.reference.HostDecoder``), its CPU part the CPU executor's
decoders, the host part copied into the batch on the CPU. Batches are held to the CPU path's and to
zarr-python's, bit for bit; errors to the CPU path's types. The test marked ``cuda`` at the end runs the real
thing on a GPU with nvCOMP (skipped here).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Callable

import numcodecs
import numpy as np
import pytest
import torch
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

import stoker
from stoker.engine import choose as executors
from stoker.engine.gpu import executor as gpu_executors
from stoker.engine.gpu.reference import HostDecoder
from stoker.engine.hybrid import executor as hybrids
from stoker.engine.hybrid.executor import HybridExecutor
from stoker.engine.hybrid.split import MIN_SHARE, Shares, chunk_costs, split, subset
from stoker.engine.pipeline import facade as pipelines
from stoker.engine.planning.tables import plan_tables
from stoker.errors import DecodeError, InvalidArgument
from test_gpu_executor import _expected, _same, _samples, _write  # tests/gpu is on sys.path (prepend mode)

pytestmark = pytest.mark.timeout(90)


class _Made:
    """What the ``hybrid`` fixture builds from: the GPU part's share (None: measured) and stream decoder."""

    def __init__(self) -> None:
        self.fraction: float | None = None
        self.decoder = None
        self.executors: list[HybridExecutor] = []


@pytest.fixture
def hybrid(monkeypatch):
    """Pipelines built in the test make their batches with the hybrid executor on CPU tensors."""
    made = _Made()

    def factory(cfg, device, stats, store):
        ex = HybridExecutor.on_host(cfg, stats, store, decoder=made.decoder, shares=Shares(made.fraction))
        made.executors.append(ex)
        return ex

    monkeypatch.setattr(pipelines, "make_executor", factory)
    return made


def _cfg(**kw):
    base = dict(batch_size=4, device="cpu", n_compute_threads=2, n_io_threads=1, host_buffer_bytes=64 << 20,
                device_buffer_bytes=64 << 20, drop_last=False)
    return stoker.Config(**{**base, **kw})


def _run(samples, **kw):
    with stoker.Pipeline(_cfg(**kw)) as p:
        p.push(samples)
        out = []
        for b in p:
            if isinstance(b, stoker.FieldBatch):
                out.append({k: torch.from_dlpack(v).clone() for k, v in b.items()})
            else:
                out.append(torch.from_dlpack(b).clone())
        return out, p.stats()


def _on_cpu(samples, **kw):
    """The same batches made by the CPU path (decode_on="cpu", the CPU executor)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        return _run(samples, decode_on="cpu", **kw)


def _arrays(root):
    """v2 and v3 arrays: plain zstd, blosc lz4 / zstd with shuffles, a sharded one, one the device does not
    decode (gzip), missing chunks, partial edge chunks."""
    shape, chunks = (20, 37, 29), (8, 16, 16)
    specs = {
        "v3-zstd-u16-missing": dict(dtype="uint16", compressors=ZstdCodec(level=3), skip=8, fill_value=7),
        "v3-blosc-lz4-shuffle-i16": dict(dtype="int16", compressors=BloscCodec(cname="lz4", clevel=5,
                                                                                shuffle="shuffle")),
        "v3-sharded-zstd-u16": dict(dtype="uint16", compressors=ZstdCodec(level=1), shards=(16, 32, 32)),
        "v2-blosc-zstd-bitshuffle-f32": dict(dtype="float32", zarr_format=2,
                                             compressors=numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE)),
        "v2-zstd-u8-missing": dict(dtype="uint8", zarr_format=2, compressors=numcodecs.Zstd(level=1), skip=8),
        "v3-gzip-u16": dict(dtype="uint16", compressors=GzipCodec(level=1)),
    }
    return {name: _write(root / f"{name}.zarr", shape, chunks, seed=i, **spec)
            for i, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    return _arrays(tmp_path_factory.mktemp("hybrid"))


def _uri(z):
    return str(z.store.root)


@pytest.mark.parametrize("fraction", [None, 0.0, 1.0])
@pytest.mark.parametrize("dtype", ["bf16", "native"])
def test_batches_are_the_cpu_path_s_and_zarr_s_bit_for_bit(arrays, hybrid, dtype, fraction):
    """Whatever the split (measured, the GPU part's least, all it may take), every layout: each batch is the
    CPU path's and zarr-python's; both parts crossed (the host part's bytes and the encoded ones)."""
    hybrid.fraction = fraction
    for name, (z, data) in arrays.items():
        samples = _samples(_uri(z), data.shape, (6, 20, 13), 10, seed=len(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # float32 into bf16 is cast on the CPU
            got, stats = _run(samples, dtype=dtype)
        want, _ = _on_cpu(samples, dtype=dtype)
        assert [g.shape for g in got] == [w.shape for w in want], name
        for g, w in zip(got, want):
            assert _same(g, w), (name, dtype, fraction)
        for row, s in zip(torch.cat(got), samples):
            assert _same(row, _expected(data, s, dtype).to(row.dtype)), (name, dtype, fraction)
        if fraction is None:  # measured: both parts placed chunks (those the device does not take: the CPU's alone)
            host_only = name == "v3-gzip-u16" or (dtype == "bf16" and name.endswith("f32"))
            assert 0 < stats.bytes_to_device_host == stats.bytes_to_device if host_only else \
                0 < stats.bytes_to_device_host < stats.bytes_to_device, name
        elif fraction == 0.0:  # the GPU part places nothing, but finishes every batch
            assert 0 < stats.bytes_to_device_host == stats.bytes_to_device, name
    assert hybrid.executors and all(isinstance(ex, HybridExecutor) for ex in hybrid.executors)


@pytest.mark.parametrize("dtype", ["f32", "native"])
@pytest.mark.parametrize("array, fill", [("float32", float("nan")), ("float32", -0.0), ("uint16", 65535),
                                         ("int8", -5)])
def test_chunks_with_nothing_stored_get_every_bit_of_the_fill_value_on_either_part(tmp_path, hybrid, array, fill,
                                                                                   dtype):
    hybrid.fraction = 0.5  # missing chunks on both parts: the CPU engine writes some, the GPU part the others
    z, data = _write(tmp_path / "f.zarr", (20, 37, 29), (8, 16, 16), array, ZstdCodec(level=1), fill_value=fill,
                     skip=8)
    samples = _samples(_uri(z), data.shape, (12, 20, 13), 8, seed=5)
    got, _ = _run(samples, dtype=dtype)
    want, _ = _on_cpu(samples, dtype=dtype)
    for g, w in zip(got, want):
        assert _same(g, w), (array, fill, dtype)
    for row, s in zip(torch.cat(got), samples):
        assert _same(row, _expected(data, s, dtype).to(row.dtype)), (array, fill, dtype)


def test_padded_boxes_integer_outputs_and_channels_are_the_cpu_path_s(arrays, hybrid, decode_path):
    """On the compiled engine and on the Python path (the CPU part's decoders either way)."""
    z, data = arrays["v3-zstd-u16-missing"]
    z2, _ = arrays["v3-sharded-zstd-u16"]
    uri, uri2 = _uri(z), _uri(z2)
    padded = [stoker.Sample(uri, [(-3, 5), (30, 42), (10, 20)], pad=mode) for mode in ("reflect", "edge", "zero")]
    padded.append(stoker.Sample(uri, [(14, 22), (-5, 7), (25, 35)], pad="edge"))
    plain = _samples(uri, data.shape, (8, 12, 10), 6, seed=3)
    channels = [stoker.Sample([uri, uri2], s.aabb) for s in _samples(uri, data.shape, (4, 9, 7), 6, seed=4)]
    for samples, kw in [(padded + plain[:4], dict(dtype="f32")), (plain, dict(dtype="i32")),
                        (channels, dict(dtype="bf16"))]:
        got, _ = _run(samples, **kw)
        want, _ = _on_cpu(samples, **kw)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert _same(g, w), kw


def test_fields_and_a_transform_are_the_cpu_path_s(arrays, hybrid):
    (z, data), (z2, _) = arrays["v3-blosc-lz4-shuffle-i16"], arrays["v2-zstd-u8-missing"]
    boxes = [s.aabb for s in _samples(_uri(z), data.shape, (5, 11, 9), 9, seed=8)]
    samples = [stoker.Sample({"raw": (_uri(z), b), "labels": (_uri(z2), b)}) for b in boxes]
    kw = dict(dtype={"raw": "bf16", "labels": "native"})
    got, _ = _run(samples, **kw)
    want, _ = _on_cpu(samples, **kw)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(_same(g[k], w[k]) for k in g)

    def scale(x):  # a transform of a 16-bit batch: made in float32, rounded once after it
        x.mul_(3).add_(0.5)
    plain = _samples(_uri(z), data.shape, (6, 10, 10), 8, seed=9)
    got, _ = _run(plain, dtype="bf16", transform=scale)
    want, _ = _on_cpu(plain, dtype="bf16", transform=scale)
    assert got and all(_same(g, w) for g, w in zip(got, want, strict=True))


def test_cf_attributes_are_decoded_as_on_the_cpu_path(tmp_path, hybrid):
    pytest.importorskip("xarray")
    import cf_data  # tests/ is on sys.path

    path = cf_data.write_dataset(tmp_path, 3)
    for var in cf_data.VARS:
        samples = [stoker.Sample(f"{path}/{var}", b) for b in cf_data.boxes(6)]
        for dtype in ("f32", "bf16"):
            got, _ = _run(samples, dtype=dtype)
            want, _ = _on_cpu(samples, dtype=dtype)
            assert got and all(_same(g, w) for g, w in zip(got, want, strict=True)), (var, dtype)
    cf_data.check_batches_equal_xarray(_cfg(dtype="f32"), path)  # and xarray's decoded values, on both parts


# -- the split --------------------------------------------------------------------------------------------------


def test_every_chunk_is_placed_by_exactly_one_part_and_the_device_takes_only_what_it_decodes(arrays):
    (z, data), (zg, _) = arrays["v3-sharded-zstd-u16"], arrays["v3-gzip-u16"]
    samples = (_samples(_uri(z), data.shape, (9, 20, 13), 5, seed=1)
               + _samples(_uri(zg), data.shape, (9, 20, 13), 3, seed=2))
    cache: dict = {}
    plan = plan_tables(0, samples, lambda uri: cache.setdefault(uri, stoker.open_array(uri)))
    cost = chunk_costs(plan)
    on_device = np.array([r.uri != _uri(zg) for r in plan.sources])[plan.chunk_source]
    assert on_device.any() and not on_device.all()
    for fraction in (0.0, 0.1, 0.5, 0.9, 1.0):
        cpu, gpu = split(cost, on_device, fraction)
        assert np.array_equal(np.sort(np.concatenate([cpu, gpu])), np.arange(plan.n_chunks))
        assert on_device[gpu].all() and (len(gpu) >= 1) == (fraction > 0)
        if fraction == 1.0:
            assert on_device[cpu].sum() == 0 and len(cpu) == (~on_device).sum()
        want = min(fraction * cost.sum(), cost[on_device].sum())  # (at most what the device decodes)
        assert abs(cost[gpu].sum() - want) <= cost.max()
        if 0 < fraction < 1:  # each part keeps some of what both may take: both rates go on being measured
            assert 0 < len(gpu) < on_device.sum()
        for ids in (cpu, gpu):  # each part's plan: its chunks, each with all of its copies, in the same places
            part = subset(plan, ids)
            assert part.n_chunks == len(ids) and int(part.n_copies.sum()) == len(part.copy_row)
            for k, c in enumerate(ids.tolist()):
                lo, n = int(plan.first_copy[c]), int(plan.n_copies[c])
                plo = int(part.first_copy[k])
                assert int(part.n_copies[k]) == n
                assert np.array_equal(part.copy_row[plo:plo + n], plan.copy_row[lo:lo + n])
                assert np.array_equal(part.copy_box_start[plo:plo + n], plan.copy_box_start[lo:lo + n])
                assert np.array_equal(part.copy_src_offset[plo:plo + n], plan.copy_src_offset[lo:lo + n])
                assert part.key(k) == plan.key(c)
    one, two = np.array([5, 5]), np.ones(2, bool)
    assert [len(ids) for ids in split(one, two, 0.95)] == [1, 1]  # (9.5 of 10 is closest to both: the CPU keeps one)
    assert [len(ids) for ids in split(one, two, 0.05)] == [1, 1]
    assert [len(ids) for ids in split(one[:1], two[:1], 0.05)] == [0, 1]


def test_shares_follow_the_measured_rates():
    s = Shares()
    assert s.gpu_fraction() == 0.5
    s.record("cpu", 100, 1.0)
    assert s.gpu_fraction() == 0.5  # until both are measured
    s.record("gpu", 300, 1.0)
    assert s.gpu_fraction() == pytest.approx(0.75)
    for _ in range(40):
        s.record("gpu", 1, 1.0)  # the GPU part got very slow
    assert s.gpu_fraction() == MIN_SHARE  # it keeps its least share: its rate goes on being measured
    assert Shares(0.3).gpu_fraction() == 0.3


class _SlowDecoder(HostDecoder):
    """The GPU part's stream decoder made slower (a test-only delay per group: ``delay()`` seconds)."""

    def __init__(self, delay: Callable[[], float]) -> None:
        super().__init__(1 << 24)
        self.delay = delay

    def decode_staged(self, *args, **kwargs):
        time.sleep(self.delay())
        return super().decode_staged(*args, **kwargs)


class _Slower:
    """Delays that keep one side ``FACTOR`` times slower than the other side's last batch took (as the executor
    measured it, :meth:`Shares.record`), whatever the load: a fixed delay is not, where the other side's own
    time grows with the load past it (the GPU part's first batches take 0.3-1.3 s on a busy machine: torch's
    first index operations in the host stand-in's placement)."""

    FACTOR, FLOOR, CAP = 4.0, 0.05, 2.0

    def __init__(self, monkeypatch) -> None:
        self.last: dict[str, float] = {}
        record = Shares.record

        def watched(shares, side, nbytes, seconds):
            self.last[side] = seconds
            record(shares, side, nbytes, seconds)
        monkeypatch.setattr(Shares, "record", watched)

    def than(self, other: str) -> float:
        """Seconds to add to a batch of the side made slower than ``other``."""
        return min(self.CAP, max(self.FLOOR, self.FACTOR * self.last.get(other, self.FLOOR)))


def _fraction_after(samples, **kw) -> float:
    with stoker.Pipeline(_cfg(lookahead_batches=1, **kw)) as p:
        p.push(samples)
        for b in p:
            b.release()
        return p._executor.shares.gpu_fraction()


def test_shares_adapt_when_one_side_is_made_slower(arrays, hybrid, monkeypatch):
    """Each side in turn made FACTOR times slower than the other (by a delay inside what the executor times of
    it): the GPU part's share goes down, then up. The delay follows the other side's measured time, so the
    outcome does not hang on the machine's load (a fixed 0.15 s did: under load the GPU part's own batches
    took longer than that, and the shares, which drift towards the side whose batches take less time, went
    the other way); it fails where the executor measures a side wrongly (the GPU part's wait for the host part
    counted as its own work, the sides' bytes or times swapped)."""
    z, data = arrays["v3-sharded-zstd-u16"]
    samples = _samples(_uri(z), data.shape, (12, 30, 20), 40, seed=6)
    slower = _Slower(monkeypatch)
    hybrid.decoder = lambda stream: _SlowDecoder(lambda: slower.than("cpu"))
    slow_gpu = _fraction_after(samples, dtype="bf16")
    hybrid.decoder = None
    slower.last.clear()
    real = hybrids.HybridExecutor._cpu_done

    def slow_cpu(self, parts):  # the CPU part's batch is complete later
        time.sleep(slower.than("gpu"))
        real(self, parts)
    monkeypatch.setattr(hybrids.HybridExecutor, "_cpu_done", slow_cpu)
    slow_host = _fraction_after(samples, dtype="bf16")
    assert slow_gpu < 0.35 and slow_host > 0.65, (slow_gpu, slow_host)


# -- errors -----------------------------------------------------------------------------------------------------


def _corrupt_first_chunk(tmp_path):
    z, data = _write(tmp_path / "c.zarr", (16, 32, 32), (8, 16, 16), "uint16", ZstdCodec(level=1), seed=3)
    (tmp_path / "c.zarr" / "c" / "0" / "0" / "0").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    return [stoker.Sample(_uri(z), [(0, 8), (0, 16), (0, 16)])] * 2 + \
        _samples(_uri(z), data.shape, (8, 16, 16), 6, seed=1)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_corrupt_chunk_on_either_part_fails_the_batch_with_the_cpu_path_s_error(tmp_path, hybrid, fraction):
    """fraction 0: the corrupt chunk is the CPU part's; 1: the GPU part's (it decodes it again on the CPU)."""
    hybrid.fraction = fraction
    samples = _corrupt_first_chunk(tmp_path)
    for run in (_run, _on_cpu):
        t0 = time.monotonic()
        with pytest.raises(DecodeError) as e:
            run(samples, dtype="f32")
        assert time.monotonic() - t0 < 20
        assert "c/0/0/0" in str(e.value), (run, str(e.value))


class _FailingDecoder(HostDecoder):
    """A device that fails every decode (what a lost device gives)."""

    def decode_staged(self, *args, **kwargs):
        raise RuntimeError("the device is gone")


def test_a_failing_gpu_part_fails_the_batch_and_hangs_nothing(arrays, hybrid):
    z, data = arrays["v3-zstd-u16-missing"]
    hybrid.decoder = lambda stream: _FailingDecoder(1 << 24)
    samples = _samples(_uri(z), data.shape, (6, 20, 13), 12, seed=2)
    t0 = time.monotonic()
    with stoker.Pipeline(_cfg(dtype="f32")) as p:
        p.push(samples)
        with pytest.raises(RuntimeError, match="the device is gone"):
            p.pop()
        with pytest.raises(RuntimeError, match="the device is gone"):  # sticky
            p.pop()
    assert time.monotonic() - t0 < 20


def test_close_during_a_batch_is_prompt_and_stops_every_thread(arrays, hybrid, monkeypatch):
    z, data = arrays["v3-sharded-zstd-u16"]
    real = hybrids.HybridExecutor._cpu_done
    started = threading.Event()

    def slow_cpu(self, parts):
        started.set()
        time.sleep(0.5)
        real(self, parts)
    monkeypatch.setattr(hybrids.HybridExecutor, "_cpu_done", slow_cpu)
    samples = _samples(_uri(z), data.shape, (8, 20, 13), 40, seed=4)
    p = stoker.Pipeline(_cfg(dtype="f32"))
    p.push(samples)
    assert started.wait(10)
    ex = hybrid.executors[0]
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 3
    deadline = time.monotonic() + 5
    for t in ex.threads():
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t.name for t in ex.threads() if t.is_alive() and not t.daemon]
    assert not ex.gpu._thread.is_alive() and not ex.gpu._reader.is_alive()


# -- the choice -------------------------------------------------------------------------------------------------


def test_hybrid_is_asked_for_by_name_until_measured_on_a_gpu():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert executors.decode_on("auto", cuda, lambda: True, 16) == "cpu"
    assert executors.decode_on("auto", cuda, lambda: True, 1) == "gpu"
    assert executors.decode_on("auto", cuda, lambda: False) == "cpu"
    assert executors.decode_on("auto", cpu, lambda: True) == "cpu"
    assert executors.decode_on("hybrid", cuda, lambda: True) == "hybrid"
    with pytest.raises(InvalidArgument, match="needs NVIDIA nvCOMP") as e:
        executors.decode_on("hybrid", cuda, lambda: False)
    assert e.value.knob == "decode_on"
    with pytest.raises(InvalidArgument, match="decode_on='hybrid' decodes chunks on a CUDA device"):
        stoker.Pipeline(stoker.Config(decode_on="hybrid", device="cpu"))


def test_make_executor_builds_the_hybrid_one_for_hybrid(monkeypatch):
    """Built (nothing touches the device before the first batch) where nvCOMP says it is there."""
    from stoker.engine.gpu import nvcomp
    from stoker.engine.stats import StatsRecorder
    from stoker.storage import LocalStore

    monkeypatch.setattr(nvcomp, "available", lambda: True)
    made = {where: type(executors.make_executor(stoker.Config(decode_on=where, device="cuda", n_compute_threads=2),
                                                torch.device("cuda", 0), StatsRecorder(), LocalStore())).__name__
            for where in ("auto", "hybrid", "gpu", "cpu")}
    assert made == {"auto": "GpuDecodeExecutor", "hybrid": "HybridExecutor", "gpu": "GpuDecodeExecutor",
                    "cpu": "CudaExecutor"}


def test_the_host_budget_is_split_and_a_short_one_says_so(arrays, hybrid):
    z, data = arrays["v3-zstd-u16-missing"]
    samples = _samples(_uri(z), data.shape, (20, 37, 29), 8, seed=1)
    with stoker.Pipeline(_cfg(dtype="f32", batch_size=8, host_buffer_bytes=2 << 20)) as p:
        p.push(samples)
        with pytest.raises(stoker.BudgetExceeded, match="decode_on='hybrid' splits Config.host_buffer_bytes") as e:
            p.pop()
    assert e.value.knob == "host_buffer_bytes"
    assert gpu_executors.GpuDecodeExecutor is type(hybrid.executors[0].gpu)


# -- on a GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_a_gpu_hybrid_batches_are_the_cpu_path_s(arrays):
    pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")
    torch.cuda.set_device(0)
    for name, (z, data) in arrays.items():
        samples = _samples(_uri(z), data.shape, (6, 20, 13), 24, seed=len(name))
        outs = {}
        for where in ("hybrid", "cpu"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with stoker.Pipeline(_cfg(dtype="bf16", device=0, decode_on=where)) as p:
                    p.push(samples)
                    outs[where] = [torch.from_dlpack(b).to("cpu", copy=True) for b in p]
                    stats = p.stats()
            if where == "hybrid":
                assert type(p._executor).__name__ == "HybridExecutor"
                assert stats.bytes_to_device_host > 0 and stats.bytes_to_device > stats.bytes_to_device_host
        assert outs["hybrid"] and all(_same(g, w) for g, w in zip(outs["hybrid"], outs["cpu"], strict=True)), name


def test_a_slow_host_part_does_not_hold_back_the_batches_before_it(arrays, hybrid, monkeypatch):
    """The GPU part of batch k+1 waits for its host part before writing; that wait must not hold back the decode
    and delivery of batch k, whose chunks may still be in the wave the GPU side has open (the reviewer's
    trace: batch 0 finished only after the host parts of batches 1 and 2)."""
    z, data = arrays["v3-zstd-u16-missing"]
    samples = _samples(_uri(z), data.shape, (6, 20, 13), 12, seed=1)
    hybrid.fraction = 0.5
    events: list = []
    cpu_done, gpu_done = hybrids.HybridExecutor._cpu_done, hybrids.HybridExecutor._gpu_done

    def slow_cpu(self, parts):  # each host part is complete 0.3 s after the one before
        time.sleep(0.3)
        cpu_done(self, parts)
        events.append(("host", parts.job.plan.batch_id))

    def logged_gpu(self, parts, gpu_job):
        events.append(("done", parts.job.plan.batch_id))
        gpu_done(self, parts, gpu_job)

    monkeypatch.setattr(hybrids.HybridExecutor, "_cpu_done", slow_cpu)
    monkeypatch.setattr(hybrids.HybridExecutor, "_gpu_done", logged_gpu)
    out, _ = _run(samples, lookahead_batches=3)
    ref, _ = _on_cpu(samples, lookahead_batches=3)
    assert all(_same(a, b) for a, b in zip(out, ref)) and len(out) == len(ref) == 3
    order = [e for e in events if e in (("done", 0), ("host", 1), ("host", 2))]
    assert order.index(("done", 0)) < order.index(("host", 2)), events


# -- fields -----------------------------------------------------------------------------------------------------


def _native_threads() -> int:
    """OS threads of this process that are no Python thread (the compiled engines')."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def _settled(floor: int) -> int:
    """The native threads once a closed pipeline's have ended (five seconds at most for them to reach ``floor``)."""
    deadline = time.monotonic() + 5
    while _native_threads() > floor and time.monotonic() < deadline:
        time.sleep(0.02)
    return _native_threads()


def _steady() -> int:
    """The native threads once their count has not changed for 0.3 s (five seconds at most)."""
    deadline = time.monotonic() + 5
    count, since = _native_threads(), time.monotonic()
    while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        now = _native_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_fields_pipeline_on_both_runs_one_engine_of_n_compute_threads(arrays, hybrid):
    """Each field's lane is a hybrid executor of its own; their CPU parts submit to one compiled engine (the
    lanes' shared one, as on the CPU path): n_compute_threads engine threads in all, not that many per field,
    each reported once; the batches are the CPU path's; closed, none is left."""
    from stoker.engine.cpu.executor import engine_available

    if not engine_available():
        pytest.skip("the compiled engine is not built")
    (z, data), (z2, _) = arrays["v3-sharded-zstd-u16"], arrays["v3-zstd-u16-missing"]
    boxes = [s.aabb for s in _samples(_uri(z), data.shape, (6, 12, 10), 8, seed=12)]
    samples = [stoker.Sample({"raw": (_uri(z), b), "labels": (_uri(z2), b)}) for b in boxes]
    hybrid.fraction = 0.5  # both parts of every lane take chunks
    kw = dict(dtype={"raw": "bf16", "labels": "native"}, n_compute_threads=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP team for the host stand-in's copies (one per calling thread)
    try:
        before = _steady()  # (the threads of pipelines closed before, ending, have ended)
        got = _fields_run(samples, kw, before)
        assert _settled(before) == before  # closed: none is left
    finally:
        torch.set_num_threads(threads)
    want, _ = _on_cpu(samples, **kw)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(_same(g[k], w[k]) for k in g)


def _fields_run(samples, kw, before: int) -> list:
    """The batches of a hybrid pipeline of ``samples`` (fields), its native threads counted once they are made."""
    got = []
    with stoker.Pipeline(_cfg(**kw)) as p:
        p.push(samples)
        for b in p:
            got.append({k: torch.from_dlpack(v).clone() for k, v in b.items()})
        engines = {id(lane.executor.cpu.decoders.native.engine) for lane in p._coordinator.lanes}
        # the engine's 3, and each GPU part's persistent staging readers (csrc/staging.c's stage_pool: helpers
        # kept between waves, a stager's own)
        readers = [lane.executor.gpu._stager.pool.readers().info()[2] for lane in p._coordinator.lanes]
        assert _native_threads() - before == 3 + sum(readers) and all(n <= 2 for n in readers)
        assert len(engines) == 1 and len(p._coordinator.lanes.lanes) == 2
        assert len(p.stats().workers) == 3
    return got


def test_a_prepare_tried_again_keeps_the_host_ring_with_the_gpu_part_once(arrays, hybrid, monkeypatch):
    z, data = arrays["v3-zstd-u16-missing"]
    samples = _samples(_uri(z), data.shape, (6, 20, 13), 4, seed=2)
    with stoker.Pipeline(_cfg(dtype="f32")) as p:
        p.push(samples)
        with p.pop():
            pass
        ex = hybrid.executors[0]
        ring = ex.cpu.host_slots
        assert ring is not None and [r for r in ex.gpu.keep_with if r is ring] == [ring]
        # a CPU part not prepared in full (its prepare failed past its ring, say): the next prepare passes the
        # guard again, with the same ring (before, kept with the GPU part once more each time)
        for _ in range(3):
            monkeypatch.setattr(ex.cpu, "slots", None)
            monkeypatch.setattr(ex.cpu, "prepare", lambda *a: setattr(ex.cpu, "slots", ring))
            ex.prepare((6, 20, 13), [], torch.float32)
        assert [r for r in ex.gpu.keep_with if r is ring] == [ring]
