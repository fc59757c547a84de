"""Float outputs never hold an inf that the stored data did not: a finite value past the batch's largest finite
value ("f16": 65504, "bf16" and "f32" near 3.4e38) fails naming its chunk, on the compiled engine, the Python
path and the GPU-decode executor's host stand-in, with lossy_casts too. Values at the boundaries that fit
(65519 rounds to 65504), NaN, inf and -0.0 are NumPy's casts (bfloat16: torch's, through float32), bit for
bit; zarr-python reads the stored values."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cast import OVERFLOW_AT, check_fill, copy_cast

pytestmark = pytest.mark.timeout(60)

SHAPE, CHUNKS = (12, 10), (4, 5)
BOX = ((1, 11), (2, 9))  # touches all 3 x 2 chunks
TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
F32_MAX = float(np.finfo(np.float32).max)


def _cfg(**kw):
    base = dict(batch_size=1, dtype="f32", host_buffer_bytes=16 << 20, n_io_threads=1, n_compute_threads=2,
                pop_timeout_s=60.0, device="cpu", device_buffer_bytes=16 << 20)
    base.update(kw)
    return stoker.Config(**base)


def _write(path, data, fill_value=0, skip_chunk=None):
    z = zarr.create_array(str(path), shape=data.shape, chunks=CHUNKS, dtype=data.dtype, fill_value=fill_value,
                          compressors=ZstdCodec(level=1))
    z[:] = data
    if skip_chunk is not None:
        os.remove(os.path.join(str(path), "c", *map(str, skip_chunk)))
    return zarr.open_array(str(path), mode="r")


def _batch(cfg, uri, box):
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box)])
        return [torch.from_dlpack(b).clone() for b in p][0][0]


def _oracle(values: np.ndarray, out: str) -> torch.Tensor:
    """NumPy's cast (one correct rounding); bfloat16 through float32, torch's round to nearest even."""
    with np.errstate(over="ignore", invalid="ignore"):
        if out == "bf16":
            return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(values.astype(np.float16 if out == "f16" else np.float32))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for a NaN (payloads are not promised)."""
    carrier = torch.int16 if got.element_size() == 2 else torch.int32
    nan = torch.isnan(want)
    return (got.dtype == want.dtype and torch.equal(torch.isnan(got), nan)
            and torch.equal(got.view(carrier)[~nan], want.view(carrier)[~nan]))


@pytest.fixture(params=["cpu", "gpu-host"])
def executor(request, monkeypatch, decode_path):
    """The CPU executor (on both decode paths), or the GPU-decode executor on its host stand-in."""
    if request.param == "gpu-host":
        if decode_path == "python":
            pytest.skip("the GPU-decode executor's CPU casts are its own: one run is enough")
        from stoker.engine.gpu.executor import GpuDecodeExecutor
        from stoker.engine.pipeline import facade

        monkeypatch.setattr(facade, "make_executor",
                            lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
    return request.param


PAST = [  # source dtype, output, a finite value the output would hold as inf
    ("uint16", "f16", 65520),
    ("uint16", "f16", 65535),
    ("float32", "f16", 65520.0),
    ("float32", "f16", -1e30),
    ("float64", "f16", 70000.0),
    ("float64", "f32", 1e39),
    ("float64", "f32", -F32_MAX * 1.0000001),
    ("float32", "bf16", F32_MAX),
    ("float32", "bf16", -3.4e38),
    ("float64", "bf16", 3.4e38),
    ("float64", "bf16", float.fromhex("0x1.feffffp127")),  # float32 rounds it up, to 0x1.ffp127: inf
    ("float64", "bf16", 1e300),
    ("int32", "f16", 2**31 - 1),
    ("uint64", "f16", 65520),
]


@pytest.mark.parametrize("dtype,out,bad", PAST)
def test_a_value_past_a_float_output_names_the_chunk(tmp_path, executor, dtype, out, bad):
    """One finite value past the output in chunk (1, 1): DtypeMismatch naming the array, that chunk and the fix;
    a crop of the chunk without it is exact (only what is read is checked, on the CPU executor)."""
    data = (np.arange(np.prod(SHAPE)) % 100).reshape(SHAPE).astype(dtype)
    data[6, 8] = bad
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data)
    lossy = np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize >= 4
    cfg = _cfg(dtype=out, lossy_casts=lossy)
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batch(cfg, uri, BOX)
    err, msg = info.value, str(info.value)
    assert err.uri == uri and err.key == "c/1/1", msg
    assert "inf" in msg and out in msg and dtype in msg and "'native'" in msg, msg
    if executor == "cpu":
        clear = ((4, 8), (5, 8))  # chunk (1, 1) again, without column 8
        assert _same(_batch(cfg, uri, clear), _oracle(z[4:8, 5:8], out))


EDGES = {  # per (source, output): values that fit, at the edges of the output's range, and the specials
    ("uint16", "f16"): [0, 1, 2049, 65504, 65505, 65519, 65535 - 16, 32768],
    ("int16", "f16"): [-32768, 32767, -1, 0, 2049, -2049],
    ("float32", "f16"): [65504.0, 65519.0, -65519.99, 6e-8, 2.9e-8, -0.0, np.nan, np.inf, -np.inf, 1e-45],
    ("float64", "f16"): [65519.999999, -65504.0, 5.96e-8, 2.98e-8, -0.0, np.nan, np.inf, -np.inf],
    ("float64", "f32"): [F32_MAX, -F32_MAX, F32_MAX * (1 + 2**-25), 1e-45, 7e-46, -0.0, np.nan, np.inf, -np.inf,
                         16777217.0, 0.1],
    ("float32", "bf16"): [float.fromhex("0x1.fefffep127"), -float.fromhex("0x1.fefffep127"), 1e-40, -0.0,
                          np.nan, np.inf, -np.inf, 257.0, 1.0 + 2**-8],
    # the first: float32 rounds it down to 0x1.fefffep127 (bfloat16's largest then), one ulp up it would be inf
    ("float64", "bf16"): [float.fromhex("0x1.feffffp127") * (1 - 2**-40), -1e38, 1e-300, -0.0, np.nan, np.inf,
                          257.0, 1.0 + 2**-8 + 2**-40],
    ("uint16", "bf16"): [65535, 65520, 257, 0],
    ("int32", "f16"): [65519, -65519, 2049, 0],
}


@pytest.mark.parametrize("dtype,out", list(EDGES))
def test_values_at_the_edges_of_a_float_output_are_numpy_casts(tmp_path, executor, dtype, out):
    """The largest values that still fit, subnormals, -0.0, NaN and inf, spread over every chunk: the batch is
    NumPy's cast of zarr-python's values (torch's through float32 for bf16), bit for bit; a missing chunk is the
    fill value's cast."""
    edges = np.array(EDGES[(dtype, out)], dtype=np.float64 if np.dtype(dtype).kind == "f" else object)
    data = (np.arange(np.prod(SHAPE)) % 7).astype(dtype)
    data[::3] = edges.astype(dtype)[np.arange(len(data[::3])) % len(edges)]
    data = data.reshape(SHAPE)
    fill = edges[3].item() if np.dtype(dtype).kind == "f" else int(edges[1])
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=fill, skip_chunk=(2, 1))
    lossy = np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize >= 4
    got = _batch(_cfg(dtype=out, lossy_casts=lossy), uri, ((0, 12), (0, 10)))
    assert _same(got, _oracle(z[:], out)), (got, _oracle(z[:], out))


@pytest.mark.parametrize("decode_on", ["cpu", "gpu-host"])
def test_a_fill_value_past_a_float_output_is_refused(tmp_path, monkeypatch, decode_path, decode_on):
    """A uint16 array whose fill value is 65535: into "f16" a crop reading a missing chunk fails naming it on the
    CPU (the GPU-decode executor, which fills on the device, refuses the array up front); written chunks only
    are exact; check_fill refuses it for "f16" only."""
    if decode_on == "gpu-host":
        from stoker.engine.gpu.executor import GpuDecodeExecutor
        from stoker.engine.pipeline import facade

        monkeypatch.setattr(facade, "make_executor",
                            lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
    data = (np.arange(np.prod(SHAPE)) % 50).reshape(SHAPE).astype(np.uint16)
    uri = str(tmp_path / "a.zarr")
    z = _write(tmp_path / "a.zarr", data, fill_value=65535, skip_chunk=(0, 1))
    with pytest.raises(stoker.DtypeMismatch) as info:
        _batch(_cfg(dtype="f16"), uri, BOX)
    assert info.value.uri == uri and "65535" in str(info.value)
    if decode_on == "cpu":
        assert info.value.key == "c/0/1"
        assert _same(_batch(_cfg(dtype="f16"), uri, ((4, 12), (0, 10))), _oracle(z[4:12], "f16"))
    reader = stoker.open_array(uri)
    for dtype in (torch.float32, torch.bfloat16):
        check_fill(reader, dtype, "c/0/1")
    with pytest.raises(stoker.DtypeMismatch, match="inf"):
        check_fill(reader, torch.float16, "c/0/1")


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("pad", [None, "fill"])
def test_a_fill_value_past_a_float_output_warns_nothing(tmp_path, decode_path, pad):
    """The refusal of a fill value past "f16" is the DtypeMismatch alone: casting the fill value before its
    check once printed numpy's "overflow encountered in cast", which under warnings-as-errors (pytest's
    ``filterwarnings = error``) reached the consumer as a bare RuntimeWarning instead of the typed error."""
    data = (np.arange(np.prod(SHAPE)) % 50).reshape(SHAPE).astype(np.uint16)
    uri = str(tmp_path / "a.zarr")
    _write(tmp_path / "a.zarr", data, fill_value=65535, skip_chunk=(0, 1))
    box = ((-2, 4), (5, 10)) if pad else ((0, 4), (5, 10))  # the padding, or the missing chunk c/0/1
    with pytest.raises(stoker.DtypeMismatch, match="65535"):
        with stoker.Pipeline(_cfg(dtype="f16")) as p:
            p.push([stoker.Sample(uri, box, pad=pad)])
            [b.release() for b in p]


def test_overflow_thresholds_are_where_the_casts_reach_inf():
    """OVERFLOW_AT is the first magnitude NumPy (f16, f32) and torch through float32 (bf16) round to inf."""
    below = {torch.float16: np.float16, torch.float32: np.float32}
    for dtype, at in OVERFLOW_AT.items():
        before = np.nextafter(at, 0.0)
        if dtype in below:
            with np.errstate(over="ignore"):
                assert np.isinf(np.array([at]).astype(below[dtype]))[0], dtype
                assert np.isfinite(np.array([before]).astype(below[dtype]))[0], dtype
        else:
            f32 = torch.tensor([at, np.nextafter(np.float32(at), np.float32(0))], dtype=torch.float32)
            assert torch.isinf(f32.to(torch.bfloat16)).tolist() == [True, False]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", ">f4"])
def test_nans_cast_into_bfloat16_by_torch_are_the_compiled_engine_s_0x7fc0(dtype):
    # the Python path and the GPU decode's CPU fallback cast through torch, whose vectorised cast gives 0xFFFF
    src = np.array([np.nan, -np.nan, 1.0, np.inf] * 8, dtype)
    src[4] = np.frombuffer(np.array([0x7FC01234], np.uint32).tobytes(), np.float32)[0]  # a payload NaN
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    copy_cast(dst, src)
    bits = dst.view(torch.int16).int() & 0xFFFF
    assert set(bits[torch.isnan(dst)].tolist()) == {0x7FC0}
    assert int(torch.isnan(dst).sum()) == 16
    assert torch.equal(dst[~torch.isnan(dst)], torch.tensor([1.0, float("inf")] * 8, dtype=torch.bfloat16))
