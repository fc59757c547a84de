"""The GPU-decode executor, run end to end on CPU tensors (its stream decoder: gpu.reference.HostDecoder).

The executor is the one ``Config(decode_on="gpu")`` builds on a CUDA device; here the pipeline is given it
through its factory (``GpuDecodeExecutor.on_host``), and its batches are held to the CPU executor's and to
zarr-python's, bit for bit. tests/test_gpu_nvcomp.py runs it on a GPU with nvCOMP.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

import stoker
from stoker.engine import choose as executors
from stoker.engine.gpu import executor as gpu_decodes
from stoker.engine.gpu import staging as gpu_staging
from stoker.engine.pipeline import facade as pipelines
from stoker.engine.gpu.executor import GpuDecodeExecutor, device_casts
from stoker.engine.gpu import frames
from stoker.engine.gpu.reference import HostDecoder
from stoker.errors import BudgetExceeded, DecodeError, InvalidArgument
from stoker.runtime import gil

from batch_oracle import bits as _bits, expected as _expected, random_crops as _samples

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu_decode(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on the CPU; yields the executors made."""
    made = []

    def factory(cfg, device, stats, store):
        ex = GpuDecodeExecutor.on_host(cfg, stats, store, max_stream_bytes=made_limit[0])
        made.append(ex)
        return ex

    made_limit = [1 << 24]
    monkeypatch.setattr(pipelines, "make_executor", factory)
    yield made, made_limit


def _write(path, shape, chunks, dtype, compressors, zarr_format=3, fill_value=0, skip=None, seed=0, shards=None):
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, dtype=dtype, fill_value=fill_value,
                          zarr_format=zarr_format, shards=shards, compressors=compressors)
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        data = rng.normal(0, 300, size=shape).astype(dtype)
        data.reshape(-1)[::97] = np.nan
    elif np.dtype(dtype).kind == "b":
        data = rng.integers(0, 2, size=shape).astype(bool)
    else:
        info = np.iinfo(dtype)
        smooth = np.add.outer(np.arange(shape[0]), np.arange(shape[1]))[..., None] + np.arange(shape[2])
        data = (smooth % max(2, min(info.max, 4000)) + rng.integers(0, 3, size=shape)).astype(dtype)
    if skip is None:
        z[:] = data
    else:  # leave the chunks of the first `skip` rows of chunks unwritten: the fill value
        z[skip:] = data[skip:]
        data[:skip] = fill_value
    return z, data


def _arrays(root):
    """Arrays of every codec the device decodes, a few it does not, partial edge chunks and missing chunks."""
    shape, chunks = (20, 37, 29), (8, 16, 16)
    made = {}
    specs = {
        "zstd-u16": ("uint16", ZstdCodec(level=3), 3),
        "lz4-shuffle-u16": ("uint16", BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), 3),
        "lz4-bitshuffle-u8": ("uint8", BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), 3),
        "zstd-shuffle-i16": ("int16", BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"), 3),
        "zstd-bitshuffle-f32": ("float32", BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"), 3),
        "v2-lz4-typesize4-u16": ("uint16", numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=1024), 2),
        "v2-zstd-u8": ("uint8", numcodecs.Zstd(level=1), 2),
        "gzip-u16": ("uint16", GzipCodec(level=1), 3),
        "blosclz-u16": ("uint16", BloscCodec(cname="blosclz", clevel=5, shuffle="shuffle"), 3),
        "zstd-i32": ("int32", ZstdCodec(level=1), 3),
    }
    for i, (name, (dtype, comp, fmt)) in enumerate(specs.items()):
        made[name] = _write(root / f"{name}.zarr", shape, chunks, dtype, comp, zarr_format=fmt,
                            fill_value=7 if i % 2 else 0, skip=8 if i % 3 == 0 else None, seed=i)
    return made


def _run(samples, **kw):
    base = dict(batch_size=4, device="cpu", n_compute_threads=1, n_io_threads=1, host_buffer_bytes=64 << 20,
                device_buffer_bytes=64 << 20, drop_last=False, lossy_casts=True)  # int32 arrays into floats too
    cfg = stoker.Config(**{**base, **kw})
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        out = [torch.from_dlpack(b).clone() for b in p]
        return out, p.stats()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except the bits of NaNs in bfloat16: stoker's paths give 0x7FC0 (the compiled engine's, and
    copy_cast's after torch's cast), the oracle zarr + torch what torch's vectorised cast gives (0xFFFF here)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    same = _bits(a) == _bits(b)
    if a.dtype == torch.bfloat16:
        same |= torch.isnan(a) & torch.isnan(b)
    return bool(same.all())


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    return _arrays(tmp_path_factory.mktemp("gpu-exec"))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "native"])
def test_batches_are_the_cpu_executor_s_and_zarr_s_bit_for_bit(arrays, gpu_decode, dtype):
    made, _ = gpu_decode
    for name, (z, data) in arrays.items():
        samples = _samples(_uri(z), data.shape, (6, 20, 13), 7, seed=len(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got, stats = _run(samples, dtype=dtype)
        made_before = len(made)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipelines, "make_executor", executors.make_executor)
            want, _ = _run(samples, dtype=dtype)
        assert len(made) == made_before and [g.shape for g in got] == [w.shape for w in want], name
        for g, w in zip(got, want):
            assert _same(g, w), (name, dtype)
        flat = torch.cat(got)
        for row, s in zip(flat, samples):
            assert _same(row, _expected(data, s, dtype).to(row.dtype)), (name, dtype)


def _uri(z):
    return str(z.store.root)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "native"])
@pytest.mark.parametrize("array, fill", [("float32", float("nan")), ("float32", -0.0), ("float32", float("-inf")),
                                         ("uint16", 65535), ("int8", -5), ("uint8", 255)])
def test_chunks_with_nothing_stored_get_every_bit_of_the_fill_value(tmp_path, gpu_decode, array, fill, dtype):
    # the fill is placed as the bits of an integer of the batch dtype's width (held on the host)
    z, data = _write(tmp_path / "f.zarr", (20, 37, 29), (8, 16, 16), array, ZstdCodec(level=1), fill_value=fill,
                     skip=8)
    samples = _samples(_uri(z), data.shape, (12, 20, 13), 6, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (float32 into bfloat16 is cast on the CPU)
        got, _ = _run(samples, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        want, _ = _run(samples, dtype=dtype)
    for g, w in zip(got, want):
        assert _same(g, w), (array, fill, dtype)
    for row, s in zip(torch.cat(got), samples):
        assert _same(row, _expected(data, s, dtype).to(row.dtype)), (array, fill, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stored_nans_into_bfloat16_are_the_cpu_path_s_bits(tmp_path, gpu_decode, dtype):
    # float data into bf16 is cast on the CPU under decode_on="gpu" (through torch, not the compiled engine):
    # its NaNs must be the compiled engine's 0x7FC0 too, not torch's vectorised 0xFFFF
    data = np.random.default_rng(3).random((16, 32, 32)).astype(dtype)
    data[data < 0.2] = np.nan
    data[data > 0.9] = -np.nan
    z = zarr.create_array(str(tmp_path / "n.zarr"), shape=data.shape, chunks=(8, 16, 16), dtype=dtype,
                          compressors=ZstdCodec(level=1))
    z[:] = data
    samples = _samples(_uri(z), data.shape, (8, 16, 16), 4, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (float into bfloat16 is cast on the CPU)
        got, _ = _run(samples, dtype="bf16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        want, _ = _run(samples, dtype="bf16")
    g, w = torch.cat(got), torch.cat(want)
    assert int(torch.isnan(g).sum()) > 100
    assert set((_bits(w)[torch.isnan(w)] & 0xFFFF).tolist()) == {0x7FC0}
    assert torch.equal(_bits(g), _bits(w))


@pytest.mark.parametrize("written", [True, False])
def test_zero_dimensional_arrays_are_planned_and_decoded(tmp_path, gpu_decode, written):
    """A 0-d array (one chunk, an empty grid index) is planned by the one planner, which plans every rank, and
    made into the same batches as the CPU executor's: its value, or its fill value where nothing is stored."""
    made, _ = gpu_decode
    uri = str(tmp_path / "s.zarr")
    z = zarr.create_array(uri, shape=(), chunks=(), dtype="int32", fill_value=-7, compressors=ZstdCodec(level=1))
    if written:
        z[()] = 42
    samples = [stoker.Sample(uri, [])] * 5
    for dtype in ("native", "f32"):
        got, _ = _run(samples, dtype=dtype)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipelines, "make_executor", executors.make_executor)
            want, _ = _run(samples, dtype=dtype)
        assert [g.tolist() for g in got] == [w.tolist() for w in want] == [[42 if written else -7] * 4,
                                                                           [42 if written else -7]]
    assert made


def test_what_crosses_to_the_device_is_the_encoded_bytes_read(arrays, gpu_decode):
    z, data = arrays["lz4-shuffle-u16"]
    got, stats = _run(_samples(_uri(z), data.shape, (8, 16, 16), 8, seed=3))
    assert stats.bytes_read > 0 and stats.bytes_to_device == stats.bytes_read
    assert stats.bytes_decoded == stats.chunks_decoded * 8 * 16 * 16 * 2


def test_chunks_the_device_does_not_decode_are_decoded_on_the_cpu_with_one_notice(arrays, gpu_decode):
    zg, dg = arrays["gzip-u16"]
    zz, dz = arrays["zstd-u16"]
    samples = [s for pair in zip(_samples(_uri(zg), dg.shape, (5, 9, 9), 6, 1), _samples(_uri(zz), dz.shape, (5, 9, 9), 6, 2))
               for s in pair]
    with pytest.warns(RuntimeWarning, match=r"gzip-u16.zarr are decoded on the CPU: codecs gzip") as record:
        got, stats = _run(samples)
    assert sum("gzip-u16" in str(w.message) for w in record) == 1  # once, not per chunk or batch
    flat = torch.cat(got)
    for row, s in zip(flat, samples):
        data = dg if "gzip" in s.uri else dz
        assert torch.equal(row, _expected(data, s, "f32"))
    # the gzip chunks crossed decoded (and cast), the zstd chunks encoded
    assert stats.bytes_to_device > stats.bytes_read



def test_chunks_the_cpu_decodes_are_fetched_and_counted_as_every_chunk_read_again(tmp_path, gpu_decode, monkeypatch):
    """One way a chunk is fetched through its reader (staging.Stager.fetch): the chunks of an array the device
    does not decode (gzip, some missing, some inner chunks of shards) go through it, once each, as the chunks
    the staging reads again do; their bytes are counted read and in the io stage once (bytes_read, all of it
    read by the io stage: the staging's reads and these fetches), and the batches are the CPU path's."""
    zg, dg = _write(tmp_path / "g.zarr", (16, 32, 32), (4, 8, 8), "uint16", GzipCodec(level=1), fill_value=3,
                    skip=4)
    zs, ds = _write(tmp_path / "s.zarr", (16, 32, 32), (4, 8, 8), "uint16", GzipCodec(level=1), fill_value=5,
                    skip=4, shards=(8, 16, 16))
    zz, dz = _write(tmp_path / "z.zarr", (16, 32, 32), (4, 8, 8), "uint16", ZstdCodec(level=1), seed=2)
    samples = [stoker.Sample(str(tmp_path / f"{name}.zarr"), [(2, 10), (4, 28), (0, 32)]) for name in "gsz"]
    fetched: list = []
    fetch = gpu_staging.Stager.fetch

    def counted(self, plan, sources, cids, files, counts):
        fetched.extend((plan.sources[int(plan.chunk_source[c])].uri, plan.key(int(c))) for c in cids)
        return fetch(self, plan, sources, cids, files, counts)
    monkeypatch.setattr(gpu_staging.Stager, "fetch", counted)
    with pytest.warns(RuntimeWarning, match="decoded on the CPU: codecs gzip"):
        got, stats = _run(samples)
    monkeypatch.undo()
    uris = {stoker.open_array(str(tmp_path / f"{name}.zarr")).uri: name for name in "gsz"}
    assert {uris[u] for u, _ in fetched} == {"g", "s"} and len(set(fetched)) == len(fetched)
    # the crop needs 3 x 4 x 4 chunks of each: g's all fetched (those of rows 0..4, never written, found missing
    # there), s's only those its shards' indexes hold (rows 4..12: 2 x 4 x 4)
    assert sum(uris[u] == "g" for u, _ in fetched) == 48 and sum(uris[u] == "s" for u, _ in fetched) == 32
    assert stats.stages["io"].bytes_out == stats.bytes_read > 0
    want, _ = _on_cpu_path(samples)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for row, s, data in zip(torch.cat(got), samples, (dg, ds, dz)):
        assert torch.equal(row, _expected(data, s, "f32"))


def _on_cpu_path(samples, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        return _run(samples, **kw)

def test_streams_over_the_device_s_limit_are_decoded_on_the_cpu(arrays, gpu_decode):
    made, limit = gpu_decode
    limit[0] = 1000  # every zstd chunk (4 KiB) is over it; blosc blocks of 1 KiB / 2-byte items are not
    z, data = arrays["zstd-u16"]
    samples = _samples(_uri(z), data.shape, (6, 20, 13), 5, seed=4)
    with pytest.warns(RuntimeWarning, match="frames the device does not decode"):
        got, _ = _run(samples)
    for row, s in zip(torch.cat(got), samples):
        assert torch.equal(row, _expected(data, s, "f32"))


def test_the_device_casts_only_what_it_rounds_as_the_cpu_does():
    assert device_casts(np.dtype("uint16"), torch.float32) and device_casts(np.dtype("int16"), torch.bfloat16)
    assert device_casts(np.dtype("float32"), torch.float32) and device_casts(np.dtype("uint8"), torch.float16)
    assert not device_casts(np.dtype("float32"), torch.bfloat16)  # NaN conversions differ on the device
    assert not device_casts(np.dtype("int32"), torch.float32)
    assert not device_casts(np.dtype("float16"), torch.float32)


def test_each_array_is_described_once_per_batch_dtype(arrays, monkeypatch):
    """sources.Described, which the GPU-decode executor (its chunks' decode and placement) and the hybrid's
    split (which chunks the device takes) each keep: describe() runs once per reader and batch dtype, and
    ``on_new`` with it; another reader of the same array is described anew; past LIMIT descriptions, all are
    dropped and made again as asked. In a hybrid pipeline, each array is described once by each of the two."""
    from stoker.engine.gpu import sources
    from stoker.engine.hybrid.executor import HybridExecutor

    calls = []
    real = sources.describe
    monkeypatch.setattr(sources, "describe", lambda r, w, *rest: calls.append((r.uri, w)) or real(r, w, *rest))
    (zz, dz), (zg, dg) = arrays["zstd-u16"], arrays["gzip-u16"]
    new: list = []
    described = sources.Described(on_new=new.append)
    a, g = stoker.open_array(_uri(zz)), stoker.open_array(_uri(zg))
    src = described.get(a, torch.float32)
    assert src.how == sources.ZSTD and described.get(a, torch.float32) is src
    assert described.get(g, torch.float32).how == sources.CPU and described.get(g, torch.float32) is new[1]
    half = described.get(a, torch.bfloat16)
    assert half is not src and half.element == torch.uint16 and new == [src, new[1], half]
    assert calls == [(a.uri, torch.float32), (g.uri, torch.float32), (a.uri, torch.bfloat16)]
    again = stoker.open_array(_uri(zz))  # the same array, another reader: described anew
    assert described.get(again, torch.float32) is not src and len(calls) == 4
    described.LIMIT = 3
    described.get(g, torch.bfloat16)  # a fifth: past the limit, the four held are dropped
    assert described.get(a, torch.float32) is not src and len(calls) == 6 and len(new) == 6
    calls.clear()
    samples = _samples(_uri(zz), dz.shape, (5, 9, 9), 8, 1) + _samples(_uri(zg), dg.shape, (5, 9, 9), 8, 2)
    monkeypatch.setattr(pipelines, "make_executor", lambda cfg, device, stats, store: HybridExecutor.on_host(
        cfg, stats, store))
    got, _ = _run(samples, n_compute_threads=2)
    assert len(got) == 4
    assert sorted(calls) == sorted([(_uri(zz), torch.float32), (_uri(zg), torch.float32)] * 2), calls


def _corrupt(path, key, how):
    f = os.path.join(path, *key.split("/"))
    raw = bytearray(open(f, "rb").read())
    if how == "truncate":
        raw = raw[:len(raw) // 2]
    elif raw[:4] == b"\x28\xb5\x2f\xfd":  # zstd: flip bytes of the compressed block
        for i in range(len(raw) // 2, len(raw) // 2 + 16):
            raw[i] ^= 0x5A
    else:  # blosc (lz4 streams decode flipped bytes without noticing): its first block starts past the end
        raw[16:20] = (len(raw) + 100).to_bytes(4, "little")
    open(f, "wb").write(bytes(raw))


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_corrupt_chunk_fails_its_batch_with_the_cpu_path_s_error(tmp_path, codec, how):
    comp = ZstdCodec(level=3) if codec == "zstd" else BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    z, data = _write(tmp_path / "a.zarr", (16, 32, 32), (8, 16, 16), "uint16", comp)
    _corrupt(str(tmp_path / "a.zarr"), "c/1/0/1", how)
    samples = [stoker.Sample(str(tmp_path / "a.zarr"), [(0, 16), (0, 32), (0, 32)])]
    gpu, cpu = _first_pop_errors(samples, DecodeError, n_compute_threads=1)
    assert type(gpu) is type(cpu) and gpu.key == cpu.key == "c/1/0/1" and gpu.uri == cpu.uri
    assert str(tmp_path / "a.zarr") in str(gpu) and "c/1/0/1" in str(gpu)


@pytest.mark.parametrize("threads", [1, 4])  # 4: each group's reads spread over the read threads
def test_sharded_arrays_and_samples_of_several_arrays(tmp_path, gpu_decode, threads):
    z, data = _write(tmp_path / "s.zarr", (32, 32, 32), (8, 8, 8), "uint16",
                     BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"), shards=(16, 16, 32), skip=8)
    z2, data2 = _write(tmp_path / "t.zarr", (32, 32, 32), (16, 16, 16), "uint16", ZstdCodec(level=1), seed=5)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(6):
        c = [int(v) for v in rng.integers(0, 32 - 10, 3)]
        box = [(a, a + 10) for a in c]
        samples.append(stoker.Sample([str(tmp_path / "s.zarr"), str(tmp_path / "t.zarr")], box))
    got, stats = _run(samples, n_compute_threads=threads)
    assert gpu_decode[0][-1]._stager.pool.threads == threads
    for row, s in zip(torch.cat(got), samples):
        sel = tuple(slice(a, b) for a, b in s.aabb)
        assert torch.equal(row, torch.from_numpy(np.stack([data[sel], data2[sel]]).astype(np.float32)))
    assert stats.bytes_to_device == stats.bytes_read


def test_the_transform_runs_on_the_placed_batch(arrays, gpu_decode):
    z, data = arrays["lz4-shuffle-u16"]
    samples = _samples(_uri(z), data.shape, (4, 8, 8), 4, seed=9)
    norm = stoker.transforms.Normalize(mean=100.0, std=3.0)
    got, _ = _run(samples, dtype="bf16", transform=norm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        want, _ = _run(samples, dtype="bf16", transform=norm)
    assert all(_same(g, w) for g, w in zip(got, want))


def test_budgets_too_small_for_one_chunk_are_refused_naming_the_knob(tmp_path, gpu_decode):
    z, data = _write(tmp_path / "big.zarr", (8, 256, 256), (8, 256, 256), "uint16", ZstdCodec(level=1))
    samples = [stoker.Sample(str(tmp_path / "big.zarr"), [(0, 8), (0, 8), (0, 8)])]
    for knob, kw in (("device_buffer_bytes", {"device_buffer_bytes": 1 << 20}),
                     ("host_buffer_bytes", {"host_buffer_bytes": 2 << 20})):
        base = {"host_buffer_bytes": 64 << 20, "device_buffer_bytes": 64 << 20} | kw
        with stoker.Pipeline(stoker.Config(batch_size=1, device="cpu", **base)) as p:
            p.push(samples)
            with pytest.raises(BudgetExceeded) as e:
                p.pop()
        assert e.value.knob == knob and f"Config.{knob}=" in str(e.value)


def test_buffers_stay_within_the_budgets(arrays, gpu_decode):
    made, _ = gpu_decode
    z, data = arrays["zstd-u16"]
    cfg = stoker.Config(batch_size=4, device="cpu", host_buffer_bytes=3 << 20, device_buffer_bytes=2 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push(_samples(_uri(z), data.shape, (6, 20, 13), 8, seed=4))
        for _ in p:
            pass
        ex = made[-1]
        assert 0 < ex.device_nbytes() <= cfg.device_buffer_bytes
        assert 0 < p.stats().peak_host_bytes <= cfg.host_buffer_bytes


def test_decode_on_gpu_needs_a_cuda_device_and_nvcomp():
    with pytest.raises(InvalidArgument, match="runs on cpu: set Config.device to a GPU") as e:
        stoker.Pipeline(stoker.Config(decode_on="gpu", device="cpu"))
    assert e.value.knob == "decode_on"
    cuda = torch.device("cuda", 0)
    with pytest.raises(InvalidArgument, match=r"pip install 'stoker\[gpu\]'"):
        executors.decode_on("gpu", cuda, lambda: False)
    assert executors.decode_on("gpu", cuda, lambda: True) == "gpu"
    # "auto": the GPU decode up to AUTO_GPU_MAX_THREADS compute threads (hybrid only by name, for now)
    assert executors.decode_on("auto", cuda, lambda: True, compute_threads=2) == "gpu"
    assert executors.decode_on("auto", cuda, lambda: True, compute_threads=1) == "gpu"
    assert executors.decode_on("auto", cuda, lambda: True, compute_threads=3) == "cpu"
    assert executors.decode_on("auto", cuda, lambda: False, compute_threads=1) == "cpu"  # no nvCOMP: no error
    assert executors.decode_on("auto", torch.device("cpu"), lambda: True, compute_threads=1) == "cpu"
    assert executors.decode_on("cpu", cuda, lambda: True, compute_threads=1) == "cpu"


def _many_inner_chunks(root):
    """An array of one shard of 64 inner chunks (blosc lz4; a few rows unwritten: the fill value)."""
    comp = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    return _write(root / "one.zarr", (16, 32, 32), (4, 8, 8), "uint16", comp, shards=(16, 32, 32), fill_value=3,
                  skip=4)


def _two_crops(uri):
    """One batch of 56 inner chunks (12 of them unwritten), most but not all of the shard's."""
    return [stoker.Sample(uri, [(0, 12), (0, 24), (0, 32)]), stoker.Sample(uri, [(4, 16), (8, 32), (0, 32)])]


def _check_against_cpu_and_zarr(got, samples, data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        want, _ = _run(samples)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for row, s in zip(torch.cat(got), samples):
        assert torch.equal(row, _expected(data, s, "f32"))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-reads", "python-reads"])
def test_inner_chunks_of_a_shard_are_read_in_few_reads(tmp_path, gpu_decode, monkeypatch, compiled):
    from stoker.engine.gpu import native_reads

    if compiled and not native_reads.available():
        pytest.skip("stoker._native is not built")
    z, data = _many_inner_chunks(tmp_path)
    samples = _two_crops(str(tmp_path / "one.zarr"))
    from stoker.engine.cpu import native

    reads = []
    preadv, read = os.preadv, native.stage_read

    def counted(fd, buffers, offset, *args):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(os.path.join("c", "0", "0", "0")):  # the shard
            reads.append(offset)
        return preadv(fd, buffers, offset, *args)

    def counted_native(buf, paths, files, table, out, whole_base, threads, **kw):
        opens, preads = read(buf, paths, files, table, out, whole_base, threads, **kw)
        paths = [os.fsdecode(p) for p in paths.split(b"\0")[:-1]] if isinstance(paths, bytes) else paths
        shard = [k for k, p in enumerate(paths) if p.endswith(os.path.join("c", "0", "0", "0"))]
        reads.extend(int(row[1]) for row in table if row[0] in shard)  # (one row: one pread, unless cut short)
        assert preads == len(table) and opens == len(paths)
        return opens, preads

    monkeypatch.setattr(os, "preadv", counted)
    monkeypatch.setattr(native, "stage_read", counted_native)
    if not compiled:
        monkeypatch.setattr(native_reads, "available", lambda: False)
    got, stats = _run(samples)
    monkeypatch.undo()
    # 44 stored inner chunks, close together in their shard: one read (the chunks between them read too)
    assert stats.chunks_decoded == 44 and len(reads) == 1, reads
    assert stats.bytes_to_device == stats.bytes_read
    _check_against_cpu_and_zarr(got, samples, data)



@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "sharded"])
def test_a_group_s_reads_take_the_same_python_steps_for_16_or_256_files(tmp_path, gpu_decode, monkeypatch, sharded):
    """A group's local reads are one call into csrc/staging.c, read on its own threads without the GIL: the
    Python calls (functions and builtins, counted by a profiler on the reader thread) that stage a group are
    as many for 256 chunk files (or inner chunks of one shard) as for 16; the batches are the CPU path's."""
    import sys
    from stoker.engine.gpu import native_reads

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    calls: dict[int, list[int]] = {}
    read = gpu_staging.Stager.read

    def profiled(self, plan, *args, **kwargs):
        counted = [0]

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                counted[0] += 1
        sys.setprofile(count)  # (this thread's only: the reader's)
        try:
            return read(self, plan, *args, **kwargs)
        finally:
            sys.setprofile(None)
            calls.setdefault(plan.n_chunks, []).append(counted[0])
    monkeypatch.setattr(gpu_staging.Stager, "read", profiled)
    for n in (16, 256):
        uri = str(tmp_path / f"{n}.zarr")
        z, data = _write(uri, (8, 8 * n, 8), (8, 8, 8), "uint16", ZstdCodec(level=1),
                         shards=(8, 8 * n, 8) if sharded else None)
        samples = [stoker.Sample(uri, [(0, 8), (0, 8 * n), (0, 8)])]
        got, stats = _run(samples, batch_size=1, n_compute_threads=4)
        assert stats.chunks_decoded == n and calls[n] and len(calls[n]) == 1  # one group
        with monkeypatch.context() as mp:
            mp.setattr(gpu_staging.Stager, "read", read)
            _check_against_cpu_and_zarr(got, samples, data)
    assert calls[16] == calls[256], calls

@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "sharded"])
def test_the_compiled_reads_start_their_threads_once_per_pipeline(tmp_path, gpu_decode, sharded):
    """The reader's compiled reads run on persistent threads (native_reads.Readers): 3 started for a pipeline of
    4 compute threads whatever its batches (16 here; threads of each call's own started 3 per round before),
    none left running once it is closed, and the batches are the CPU path's and zarr's, bit for bit."""
    import time

    from stoker.engine.gpu import native_reads

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    z, data = _write(tmp_path / "a.zarr", (16, 64, 36), (4, 8, 12), "uint16", ZstdCodec(level=1), fill_value=3,
                     skip=4, shards=(8, 16, 12) if sharded else None)
    uri = str(tmp_path / "a.zarr")
    samples = [stoker.Sample(uri, [(k % 4, k % 4 + 12), (2 * k, 2 * k + 30), (0, 36)]) for k in range(16)]
    before = native_reads.threads_started()
    got, stats = _run(samples, batch_size=1, n_compute_threads=4, lookahead_batches=1)
    assert len(got) == 16 and stats.chunks_decoded > 16
    assert native_reads.threads_started() - before == 3
    readers = gpu_decode[0][0]._stager.pool.readers()
    deadline = time.monotonic() + 5
    while readers.info()[2] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert readers.info()[1:] == (3, 0, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        want, _ = _run(samples, batch_size=1, n_compute_threads=4, lookahead_batches=1)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for row, s in zip(torch.cat(got), samples):
        assert torch.equal(row, _expected(data, s, "f32"))


def test_batches_come_when_the_second_thread_starts_late(tmp_path, gpu_decode, monkeypatch):
    """The executor starts two threads, the reader and the submitter; the starter may be descheduled between
    the two starts (a loaded machine) for longer than the first one's 0.1 s poll of its empty queue. The
    submitter once took a reader not started yet for one that had ended, and returned: every batch then
    waited for pop_timeout_s and failed with PoolStarved. Forced here: the second start comes 0.5 s late."""
    z, data = _write(tmp_path / "a.zarr", (4, 32, 32), (2, 16, 16), "uint16", ZstdCodec(level=1))
    uri = str(tmp_path / "a.zarr")
    starts = []

    def late_second(thread, knob, *args):
        starts.append(thread.name)
        if len(starts) == 2:
            time.sleep(0.5)  # (the starter descheduled: the first thread's poll has found its queue empty)
        gpu_decodes.start_thread.__wrapped__(thread, knob, *args)

    late_second.__wrapped__ = gpu_decodes.start_thread  # type: ignore[attr-defined]
    monkeypatch.setattr(gpu_decodes, "start_thread", late_second)
    samples = [stoker.Sample(uri, [(k, k + 1), (0, 32), (0, 32)]) for k in range(4)]
    cfg = stoker.Config(batch_size=2, device="cpu", n_compute_threads=1, n_io_threads=1, pop_timeout_s=10.0)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        got = [torch.from_dlpack(b).clone() for b in p]
        assert sorted(starts) == ["stoker-gpu-decode", "stoker-gpu-read"]
        assert all(t.is_alive() for t in gpu_decode[0][0].threads()[:2])
    assert len(got) == 2
    for row, s in zip(torch.cat(got), samples):
        assert torch.equal(row, _expected(data, s, "f32"))


def test_a_thread_the_system_does_not_give_is_the_pipeline_s_error(tmp_path, gpu_decode, monkeypatch):
    """The second of the executor's threads not started (the system gives no thread): ThreadStartError naming
    the knob, not the close's join of the thread never started raising over it, and the first thread ends."""
    from stoker.runtime.workers import no_thread

    _write(tmp_path / "a.zarr", (4, 32, 32), (2, 16, 16), "uint16", ZstdCodec(level=1))
    real, starts = gpu_decodes.start_thread, []

    def second_fails(thread, knob, *args):
        starts.append(thread)
        if len(starts) == 2:
            raise no_thread(thread.name, knob, RuntimeError("can't start new thread"))
        real(thread, knob, *args)

    monkeypatch.setattr(gpu_decodes, "start_thread", second_fails)
    cfg = stoker.Config(batch_size=2, device="cpu", n_compute_threads=1, n_io_threads=1, pop_timeout_s=10.0)
    with pytest.raises(stoker.errors.ThreadStartError) as info:
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(str(tmp_path / "a.zarr"), [(0, 1), (0, 32), (0, 32)])] * 2)
            list(p)
    assert info.value.knob == "n_compute_threads"
    starts[0].join(10.0)
    assert not starts[0].is_alive()


@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "sharded"])
def test_the_compiled_reads_build_the_files_paths_with_no_python_per_file(tmp_path, gpu_decode, monkeypatch,
                                                                          sharded):
    """A wave's files (chunk files, or shards) are named by paths built in C from each array's prefix and the
    files' coordinates, as the CPU engine builds them: no key or path made in Python per file (once one each),
    and the batches are the CPU path's and zarr's, bit for bit."""
    from stoker.engine.gpu import native_reads
    from stoker.engine.planning.tables import TablePlan

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    z, data = _write(tmp_path / "a.zarr", (16, 40, 36), (4, 8, 12), "uint16", ZstdCodec(level=1), fill_value=3,
                     skip=4, shards=(8, 16, 12) if sharded else None)
    uri = str(tmp_path / "a.zarr")
    samples = [stoker.Sample(uri, [(0, 12), (4, 36), (0, 36)]), stoker.Sample(uri, [(4, 16), (2, 34), (0, 36)])]
    keys = []
    file_key = TablePlan.file_key
    monkeypatch.setattr(TablePlan, "file_key", lambda self, f: (keys.append(f), file_key(self, f))[1])
    got, stats = _run(samples)
    monkeypatch.undo()
    assert stats.chunks_decoded > 0 and keys == []
    _check_against_cpu_and_zarr(got, samples, data)


def _zipped(root, name):
    """``root/name`` stored (not compressed) in the zip archive ``root/a.zip``, under its own name."""
    import zipfile

    archive = root / "a.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        for folder, _, names in os.walk(root / name):
            for file in names:
                path = os.path.join(folder, file)
                zf.write(path, os.path.relpath(path, root))
    return archive


def test_inner_chunks_of_a_shard_in_a_store_are_one_request_per_group(tmp_path, gpu_decode, monkeypatch):
    from stoker.storage.zipstore import ZipStore

    z, data = _many_inner_chunks(tmp_path)
    archive = _zipped(tmp_path, "one.zarr")
    samples = _two_crops(f"{archive}/one.zarr")
    calls = []
    get_ranges = ZipStore.get_ranges

    def counted(self, requests):
        calls.append(len(requests))
        return get_ranges(self, requests)

    monkeypatch.setattr(ZipStore, "get_ranges", counted)
    got, stats = _run(samples)
    monkeypatch.setattr(ZipStore, "get_ranges", get_ranges)
    # the shard's index, then one call for the batch's 44 stored inner chunks (which the store coalesces)
    assert stats.chunks_decoded == 44 and calls == [1, 44], calls
    _check_against_cpu_and_zarr(got, samples, data)



def test_inner_chunks_in_a_store_that_the_device_does_not_decode_are_fetched_and_decoded_on_the_cpu(tmp_path,
                                                                                                 gpu_decode):
    # gzip inner chunks of a shard in a zip archive: the device takes none, so each is fetched through its
    # reader at the offset its index gave (checked against the index's generation) and decoded on the CPU
    z, data = _write(tmp_path / "one.zarr", (16, 32, 32), (4, 8, 8), "uint16", GzipCodec(level=1),
                     shards=(16, 32, 32), fill_value=3, skip=4)
    archive = _zipped(tmp_path, "one.zarr")
    samples = _two_crops(f"{archive}/one.zarr")
    with pytest.warns(RuntimeWarning, match="decoded on the CPU: codecs gzip"):
        got, stats = _run(samples)
    assert stats.chunks_decoded == 44
    _check_against_cpu_and_zarr(got, samples, data)


OVERLAP_SHAPE, OVERLAP_CHUNKS = (16, 32, 32), (8, 16, 16)  # 8 chunks of 4096 decoded bytes: one group each (below)
N_GROUPS = 8


@pytest.fixture
def one_chunk_groups(tmp_path, monkeypatch):
    """A zstd array whose chunks are each a group of their own, and a counter of the staging's reads."""
    z, data = _write(tmp_path / "a.zarr", OVERLAP_SHAPE, OVERLAP_CHUNKS, "uint16", ZstdCodec(level=3))
    monkeypatch.setattr(gpu_decodes, "GROUP_BYTES", 8 * 16 * 16 * 2)
    reads = {"started": 0}
    cond = threading.Condition()
    read = gpu_staging.Stager.read

    def counted(self, *args, **kw):
        with cond:
            reads["started"] += 1
            cond.notify_all()
        return read(self, *args, **kw)

    monkeypatch.setattr(gpu_staging.Stager, "read", counted)
    sample = stoker.Sample(str(tmp_path / "a.zarr"), [(0, 16), (0, 32), (0, 32)])
    return sample, data, reads, cond


def _with_decoder(monkeypatch, make_decoder, made):
    def factory(cfg, device, stats, store):
        ex = GpuDecodeExecutor(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: make_decoder())
        made.append(ex)
        return ex

    monkeypatch.setattr(pipelines, "make_executor", factory)


def test_a_batch_s_groups_are_read_while_earlier_ones_decode(one_chunk_groups, monkeypatch):
    sample, data, reads, cond = one_chunk_groups
    overlapped = []

    class Blocking(HostDecoder):
        """Decodes group n only once group n + 1's read has started (2 s at most: then it was not)."""

        def decode_staged(self, *args, **kw):
            n = len(overlapped)
            if n < N_GROUPS - 1:
                with cond:
                    overlapped.append(cond.wait_for(lambda: reads["started"] >= n + 2, timeout=2.0))
            else:
                overlapped.append(True)
            return super().decode_staged(*args, **kw)

    _with_decoder(monkeypatch, Blocking, [])
    got, stats = _run([sample])
    assert overlapped == [True] * N_GROUPS
    assert stats.chunks_decoded == N_GROUPS
    assert torch.equal(got[0][0], _expected(data, sample, "f32"))


def test_close_mid_batch_returns_while_a_read_is_blocked(one_chunk_groups, monkeypatch):
    sample, data, reads, cond = one_chunk_groups
    unblock, entered = threading.Event(), threading.Event()
    read = gpu_staging.Stager.read

    def blocked(self, *args, **kw):  # the batch's third read never finishes before close() returns
        if reads["started"] >= 3:
            entered.set()
            assert unblock.wait(30.0)
        return read(self, *args, **kw)

    monkeypatch.setattr(gpu_staging.Stager, "read", blocked)
    made = []
    _with_decoder(monkeypatch, HostDecoder, made)
    cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=1, host_buffer_bytes=64 << 20,
                        device_buffer_bytes=64 << 20)
    p = stoker.Pipeline(cfg)
    try:
        p.push([sample, sample])
        assert entered.wait(10.0)  # the reader is inside a read, mid-batch
        p.close()
        assert not unblock.is_set()  # close() returned without waiting for the read
    finally:
        unblock.set()
        p.close()
    ex = made[0]
    for thread in (ex._reader, ex._thread):  # both end once the read returns: nothing waits on them
        thread.join(10.0)
        assert not thread.is_alive()
    assert all(not s.busy for s in ex.host_slots.slots)


def test_arrays_decoded_on_the_device_after_a_first_batch_without_any_get_nvcomp_s_scratch(arrays, monkeypatch):
    # the scratch is sized at the first batch; one of CPU-decoded chunks alone still leaves room for a group
    asked = []

    class Scratchy(HostDecoder):
        def temp_bytes(self, n, max_bytes, total_bytes):
            return n * 100 + max_bytes // 8 if n else 0

        def decode_staged(self, staged, layout, *args, temp=None, **kw):
            streams = layout.dsize[~layout.raw]
            if len(streams):  # (the CPU's chunks cross as raw bytes)
                need = self.temp_bytes(len(streams), int(streams.max()), int(streams.sum()))
                asked.append((temp.numel() if temp is not None else 0, need))
            return super().decode_staged(staged, layout, *args, temp=temp, **kw)

    made = []
    _with_decoder(monkeypatch, Scratchy, made)
    zg, dg = arrays["gzip-u16"]
    zz, dz = arrays["zstd-u16"]
    samples = _samples(_uri(zg), dg.shape, (5, 9, 9), 4, 1) + _samples(_uri(zz), dz.shape, (5, 9, 9), 4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got, _ = _run(samples[:4])  # CPU-decoded chunks alone: no scratch is held for the device's decode
        assert made[-1]._temp.numel() == 0 and not asked
        got, _ = _run(samples)
    assert asked and all(have >= need > 0 for have, need in asked), asked  # the second batch's groups
    assert made[-1].device_nbytes() <= 64 << 20  # (the scratch within device_buffer_bytes)
    for row, s in zip(torch.cat(got), samples):
        assert torch.equal(row, _expected(dg if "gzip" in s.uri else dz, s, "f32"))


def test_a_damaged_last_group_fails_its_batch_as_such_even_when_the_transform_fails_too(one_chunk_groups,
                                                                                         gpu_decode, tmp_path):
    # the batch's tail (fills, transform, event) is queued before its last group's decode is checked: the
    # check still decides the batch's error, and a transform that stumbles on the damage does not hide it
    sample, data, reads, cond = one_chunk_groups
    _corrupt(str(tmp_path / "a.zarr"), "c/1/1/1", "flip")  # the last group
    seen = []

    def fussy(batch):
        seen.append(batch.shape)
        raise ValueError("the transform choked")

    cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=1, host_buffer_bytes=64 << 20,
                        device_buffer_bytes=64 << 20, transform=fussy)
    with stoker.Pipeline(cfg) as p:
        p.push([sample])
        with pytest.raises(DecodeError) as e:
            p.pop()
    assert seen and e.value.key == "c/1/1/1"


@pytest.mark.parametrize("when", ["at once", "deferred"])
def test_a_device_failure_on_healthy_chunks_is_a_device_error_not_a_decode_error(one_chunk_groups, monkeypatch,
                                                                                 when):
    # nvCOMP reports the third group damaged (at once, or by its deferred check), but its chunk decodes on
    # the CPU: the data is good, so the batch fails with DeviceError, naming the chunk and the way round it
    sample, data, reads, cond = one_chunk_groups
    calls = []

    class Failing(HostDecoder):
        def decode_staged(self, staged, layout, *args, deferred=None, **kw):
            calls.append(layout.chunk.copy())
            out = super().decode_staged(staged, layout, *args, deferred=deferred, **kw)
            if len(calls) == 3:
                exc = frames.FrameError("nvCOMP status 7 (ERROR_BAD_CHECKSUM)")
                if when == "at once":
                    raise exc
                deferred.append(lambda: (_ for _ in ()).throw(exc))
            return out

    _with_decoder(monkeypatch, Failing, [])
    cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=1, host_buffer_bytes=64 << 20,
                        device_buffer_bytes=64 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push([sample])
        with pytest.raises(stoker.DeviceError, match="which the CPU decodes: nvCOMP status 7") as e:
            p.pop()
    assert not isinstance(e.value, DecodeError)
    assert len(e.value.keys) == 1 and e.value.keys[0] in str(e.value) and "decode_on='cpu'" in str(e.value)
    assert e.value.uris == [sample.uri]


def test_a_damaged_stream_found_after_its_group_fails_the_batch_with_the_cpu_path_s_error(one_chunk_groups,
                                                                                          gpu_decode, tmp_path):
    sample, data, reads, cond = one_chunk_groups
    _corrupt(str(tmp_path / "a.zarr"), "c/0/1/0", "flip")  # its decode is checked once the next group is queued
    cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=1, host_buffer_bytes=64 << 20,
                        device_buffer_bytes=64 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push([sample])
        with pytest.raises(DecodeError) as e:
            p.pop()
    assert e.value.key == "c/0/1/0" and str(tmp_path / "a.zarr") in str(e.value)


def test_a_group_of_many_chunk_files_holds_a_descriptor_per_read_thread_at_most(tmp_path, gpu_decode,
                                                                                monkeypatch):
    # A group held every chunk file of its whole-file reads open at once: thousands of small chunks ran out of
    # descriptors ("Too many open files") where the CPU path read them.
    from stoker.storage.local import LocalStore, OpenFile

    z, data = _write(tmp_path / "small.zarr", (32, 32, 32), (4, 4, 4), "uint16", ZstdCodec(level=1))  # 512 files
    lock, now, peak = threading.Lock(), [0], [0]
    open_file, close = LocalStore.open_file, OpenFile.close

    def opened(self, path):
        f = open_file(self, path)
        if f is not None:
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
        return f

    def closed(self):
        with lock:
            now[0] -= 1
        return close(self)

    monkeypatch.setattr(LocalStore, "open_file", opened)
    monkeypatch.setattr(OpenFile, "close", closed)
    monkeypatch.setattr(gpu_staging.native_reads, "available", lambda: False)  # the Python reads (see also
    # tests/gpu/test_gpu_native_reads.py for the compiled ones)
    samples = [stoker.Sample(str(tmp_path / "small.zarr"), [(0, 32), (0, 32), (0, 32)])] * 2
    got, stats = _run(samples, n_compute_threads=4, batch_size=2)
    assert stats.chunks_decoded == 512 and now[0] == 0  # (the two samples share their chunks)
    assert 1 <= peak[0] <= 4, peak  # one per read thread
    for row in got[0]:
        assert torch.equal(row, torch.from_numpy(data.astype(np.float32)))


def test_auto_never_picks_a_gpu_decode_whose_library_does_not_load(monkeypatch):
    # "auto" is the default: an installed but broken nvCOMP (another CUDA major, a missing symbol) must leave
    # it on the CPU decode instead of failing every pipeline of a user who never asked for the GPU
    import importlib.util

    from stoker.engine.gpu import capi, nvcomp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "nvidia.libnvcomp" else None)

    def broken(*args, **kwargs):
        raise OSError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(capi, "library", broken)
    assert nvcomp.available() is False
    cuda = torch.device("cuda", 0)
    assert executors.decode_on("auto", cuda, nvcomp.available, compute_threads=1) == "cpu"
    with pytest.raises(InvalidArgument, match="not installed or does not load"):
        executors.decode_on("gpu", cuda, nvcomp.available)


def test_close_returns_while_a_read_thread_is_blocked_in_a_chunk_file(tmp_path, monkeypatch):
    # the reads of a group run on the read threads: close() must not wait for one stuck in a read, and every
    # thread ends once the read returns
    from stoker.engine.gpu import native_reads
    from stoker.engine.gpu.staging import Stager

    _write(tmp_path / "w.zarr", (16, 64, 64), (8, 16, 16), "uint16", ZstdCodec(level=1))  # 32 chunk files
    unblock, entered = threading.Event(), threading.Event()
    read_whole = Stager._read_whole

    def stuck(self, read):
        if threading.current_thread().name.startswith("stoker-gpu-read_"):  # a pool thread ("_i"), not the reader
            entered.set()
            assert unblock.wait(30.0)
        return read_whole(self, read)

    monkeypatch.setattr(Stager, "_read_whole", stuck)
    monkeypatch.setattr(native_reads, "available", lambda: False)  # the Python reads, on the read pool's threads
    ex = _closed_while_a_read_is_stuck(tmp_path, monkeypatch, entered, unblock)
    for thread in (ex._reader, ex._thread, *ex._stager.pool._pool.threads):
        thread.join(10.0)
        assert not thread.is_alive(), thread.name


def _closed_while_a_read_is_stuck(tmp_path, monkeypatch, entered, unblock):
    """Push one sample of ``w.zarr`` to a GPU-decode pipeline (host stand-in), wait until a read is stuck
    (``entered``), check ``close()`` returns within 3 s without it, then let it go (``unblock``); the executor."""
    made = []
    _with_decoder(monkeypatch, HostDecoder, made)
    cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=4, host_buffer_bytes=64 << 20,
                        device_buffer_bytes=64 << 20)
    p = stoker.Pipeline(cfg)
    try:
        p.push([stoker.Sample(str(tmp_path / "w.zarr"), [(0, 16), (0, 64), (0, 64)])])
        assert entered.wait(10.0)
        t0 = time.monotonic()
        p.close()  # the read stays stuck (up to 30 s) until unblock is set below: close must not wait for it
        assert time.monotonic() - t0 < 3.0
    finally:
        unblock.set()
        p.close()
    ex = made[0]
    return ex


def test_close_returns_while_the_reader_is_in_a_compiled_read(tmp_path, monkeypatch):
    # the compiled reads run inside one call on the reader thread (the GIL released): close() must not wait for
    # a call that does not return, and the reader ends once it does
    from stoker.engine.gpu import native_reads

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    _write(tmp_path / "w.zarr", (16, 64, 64), (8, 16, 16), "uint16", ZstdCodec(level=1))  # 32 chunk files
    unblock, entered = threading.Event(), threading.Event()
    read = native_reads.read

    def stuck(*args):
        entered.set()
        assert gil.released(unblock.wait, 30.0)
        return read(*args)

    monkeypatch.setattr(native_reads, "read", stuck)
    ex = _closed_while_a_read_is_stuck(tmp_path, monkeypatch, entered, unblock)
    for thread in (ex._reader, ex._thread):
        thread.join(10.0)
        assert not thread.is_alive(), thread.name


def _first_pop_errors(samples, error: type[Exception], n_compute_threads: int,
                      python_reads: bool = False) -> tuple[Exception, Exception]:
    """The ``error`` the first pop of ``samples`` raises with the GPU-decode executor (on the CPU; with
    ``python_reads``, its Python reads rather than the compiled ones) and with the CPU path's executor."""
    from stoker.engine.gpu import native_reads

    errors = []
    for gpu in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if gpu:
                mp.setattr(pipelines, "make_executor",
                           lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
                if python_reads:
                    mp.setattr(native_reads, "available", lambda: False)
            else:
                mp.setattr(pipelines, "make_executor", executors.make_executor)
            cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=n_compute_threads,
                                host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20)
            with stoker.Pipeline(cfg) as p:
                p.push(samples)
                with pytest.raises(error) as e:
                    p.pop()
                errors.append(e.value)
    gpu_error, cpu_error = errors
    return gpu_error, cpu_error


def _damage(root, how):
    """An array damaged ``how``; returns its sample and the key the error names (None: the array's whole)."""
    if how in ("fifo", "directory", "directory, cpu-decoded", "oversized"):
        # (gzip: a codec the device does not decode, its chunks fetched through the reader and decoded on the CPU)
        codec = GzipCodec(level=1) if how.endswith("cpu-decoded") else ZstdCodec(level=3)
        _write(root / "a.zarr", (16, 32, 32), (8, 16, 16), "uint16", codec)
        f = root / "a.zarr" / "c" / "1" / "0" / "1"
        f.unlink()
        if how == "fifo":
            os.mkfifo(f)
        elif how.startswith("directory"):
            f.mkdir()
        else:  # more bytes than zstd can write for the chunk: refused unread
            f.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(16 * 16 * 8 * 2 * 2))
        return "c/1/0/1"
    _write(root / "a.zarr", (16, 32, 32), (8, 16, 16), "uint16", BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"),
           shards=(16, 32, 32))
    shard = root / "a.zarr" / "c" / "0" / "0" / "0"
    raw = shard.read_bytes()
    if how == "truncated shard":  # the index at its end is cut off
        shard.write_bytes(raw[:len(raw) - 20])
        return None
    # "corrupt inner chunk": the first inner chunk's blosc block table pointing past its end
    shard.write_bytes(raw[:16] + (len(raw) + 100).to_bytes(4, "little") + raw[20:])
    return "c/0/0/0"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-reads", "python-reads"])
@pytest.mark.parametrize("how", ["fifo", "directory", "directory, cpu-decoded", "oversized", "truncated shard",
                                 "corrupt inner chunk"])
def test_damaged_files_fail_with_the_cpu_path_s_typed_error(tmp_path, compiled, how):
    from stoker.engine.gpu import native_reads

    if compiled and not native_reads.available():
        pytest.skip("stoker._native is not built")
    key = _damage(tmp_path, how)
    samples = [stoker.Sample(str(tmp_path / "a.zarr"), [(0, 16), (0, 32), (0, 32)])]
    gpu, cpu = _first_pop_errors(samples, stoker.errors.StokerError, n_compute_threads=2,
                                 python_reads=not compiled)
    assert type(gpu) is type(cpu), (gpu, cpu)
    assert getattr(gpu, "key", None) == getattr(cpu, "key", None)
    if key is not None:  # the chunk, by its key (an inner chunk: its shard's key and index) or its file's path
        assert key in str(gpu) or os.path.join(*key.split("/")) in str(gpu), gpu
    assert str(tmp_path / "a.zarr") in str(gpu)


_OUT_OF_DESCRIPTORS = r"""
import os, resource, sys
import numpy as np, torch, zarr
import stoker
from stoker.engine.gpu import native_reads
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.pipeline import facade as pipelines

uri, executor, when = sys.argv[1:]
if executor == "gpu":
    pipelines.make_executor = lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store)
held = []

def exhaust():  # every descriptor the limit leaves taken: the next open is EMFILE, a stat still works
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass

def release():
    while held:
        os.close(held.pop())

if when == "transient":  # descriptors freed once the compiled reads failed (their other user closed them)
    compiled = native_reads.read
    def read(*args):
        try:
            return compiled(*args)
        finally:
            release()
    native_reads.read = read
cfg = stoker.Config(batch_size=1, device="cpu", n_compute_threads=2, host_buffer_bytes=64 << 20,
                    device_buffer_bytes=64 << 20, pop_timeout_s=20)
with stoker.Pipeline(cfg) as p:
    p.push([stoker.Sample(uri, [(0, 8), (0, 32), (0, 32)])])
    with p.pop():  # the array opened, its metadata read: only chunk files are opened from here on
        pass
    exhaust()  # (before the push: its batch is read as soon as it is pushed)
    p.push([stoker.Sample(uri, [(8, 16), (0, 32), (0, 32)])])
    try:
        with p.pop() as b:
            release()
            same = np.array_equal(torch.from_dlpack(b).numpy()[0], zarr.open_array(uri, mode="r")[8:16])
            print("batch", same)
    except stoker.StokerError as exc:
        release()
        print(type(exc).__name__, isinstance(exc, OSError), getattr(exc, "path", None))
        print(exc)
"""


def _out_of_descriptors(uri: str, executor: str, when: str) -> list[str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS, uri, executor, when], capture_output=True,
                         text=True, timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.timeout(240)
def test_a_chunk_file_the_system_will_not_open_is_the_cpu_path_s_storage_error(tmp_path):
    # EMFILE (as EACCES, EIO) on open while stat works: the compiled read's OS error is read again the Python
    # way, which raises the store's StorageError naming the file and the system's words, as the CPU path does
    from stoker.engine.gpu import native_reads

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    _write(tmp_path / "a.zarr", (16, 32, 32), (8, 16, 16), "uint16", ZstdCodec(level=3))
    uri = str(tmp_path / "a.zarr")
    cpu, gpu = (_out_of_descriptors(uri, executor, "exhausted") for executor in ("cpu", "gpu"))
    assert cpu[0].split()[:2] == gpu[0].split()[:2] == ["StorageError", "True"], (cpu, gpu)
    chunk_files = {os.path.join(uri, "c", "1", "0", k) for k in ("0", "1")}
    assert gpu[0].split()[2] in chunk_files and gpu[0].split()[2] in gpu[1], gpu
    assert os.strerror(24) in gpu[1], gpu  # EMFILE: "Too many open files"


@pytest.mark.timeout(240)
def test_a_chunk_file_the_system_opens_again_once_it_can_is_read(tmp_path):
    # descriptors run out for the compiled reads only: the Python read that follows them reads the chunk
    from stoker.engine.gpu import native_reads

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    _write(tmp_path / "a.zarr", (16, 32, 32), (8, 16, 16), "uint16", ZstdCodec(level=3))
    assert _out_of_descriptors(str(tmp_path / "a.zarr"), "gpu", "transient") == ["batch True"]
