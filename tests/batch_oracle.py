"""Batches held to their source array in the tests: the array written (zstd chunks), seeded random crops to
read, what a batch row should hold (the crop cast to the batch dtype as zarr + torch would, tests/gpu/; a
padded box's crop as ``numpy.pad`` makes it, tests/engine/test_padding.py and
tests/sampling/test_fields_region_pad.py), and a tensor's bits for bit-for-bit comparisons."""

from __future__ import annotations

import numpy as np
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker

#: Sample.pad's modes as numpy.pad's
NUMPY_MODE = {"zero": "constant", "fill": "constant", "edge": "edge", "reflect": "reflect"}


def zstd_array(path, data: np.ndarray, chunks) -> tuple[str, np.ndarray]:
    """``data`` written at ``path`` as a Zarr v3 array of ``chunks``, each zstd-compressed (level 1); returns
    ``(uri, data)``, as the module-scoped ``volume`` fixtures hand them on."""
    z = zarr.create_array(str(path), shape=data.shape, chunks=chunks, dtype=data.dtype,
                          compressors=ZstdCodec(level=1))
    z[:] = data
    return str(path), data


def first_planes_crops(uri: str, n: int, seed: int = 1) -> list:
    """``n`` samples of ``uri`` (an array of ``(>= 8, 64, 64)``): boxes of 8 x 16 x 16 in its first 8 planes,
    each at a seeded random ``(y, x)``."""
    rng = np.random.default_rng(seed)
    return [stoker.Sample(uri, [(0, 8), (int(y), int(y) + 16), (int(x), int(x) + 16)])
            for y, x in rng.integers(0, 64 - 16, size=(n, 2))]


def random_crops(uri: str, shape, crop, n: int, seed: int = 1) -> list:
    """``n`` samples of ``uri`` (an array of ``shape``), each a box of ``crop`` at a seeded random corner
    inside the array."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        corner = [int(rng.integers(0, s - c + 1)) for s, c in zip(shape, crop)]
        out.append(stoker.Sample(uri, [(a, a + c) for a, c in zip(corner, crop)]))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits: a view as the signed integer of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def expected(data: np.ndarray, sample, dtype: str) -> torch.Tensor:
    """The row of ``sample`` (one box of ``data``) in a batch of ``dtype`` ("native", "bf16", "f32", "f16",
    "i32", "i64").

    >>> torch.equal(batch[i], expected(data, batch.samples[i], "bf16"))
    """
    crop = data[tuple(slice(a, b) for a, b in sample.aabb)]
    if dtype == "native":
        return torch.from_numpy(np.ascontiguousarray(crop))
    if dtype == "bf16":
        return torch.from_numpy(crop.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(crop.astype({"f32": np.float32, "f16": np.float16, "i32": np.int32,
                                         "i64": np.int64}[dtype]))


def padded(data: np.ndarray, box, mode: str, fill) -> np.ndarray:
    """``numpy.pad`` of the whole of ``data`` in Sample.pad's ``mode`` (``fill``: the value of "fill"), cut to
    ``box`` (which may reach past any border).

    >>> padded(np.arange(4), [(-2, 2)], "reflect", None)
    array([2, 1, 0, 1])
    """
    before = [max(0, -a) for a, _ in box]
    after = [max(0, b - n) for (_, b), n in zip(box, data.shape)]
    kw = {"constant_values": fill if mode == "fill" else 0} if mode in ("zero", "fill") else {}
    out = np.pad(data, list(zip(before, after)), mode=NUMPY_MODE[mode], **kw)
    return out[tuple(slice(a + k, b + k) for (a, b), k in zip(box, before))]


def values_of(rng: np.random.Generator, shape, dtype: np.dtype) -> np.ndarray:
    """Values to write into an array of ``dtype`` (either byte order): full-range integers or a few small ones;
    floats with NaN, infinities and -0.0 among them (the layout oracles, tests/engine, tests/reader and the
    tensorstore fixtures of tests/zarr)."""
    nt = np.dtype(dtype).newbyteorder("=")
    if nt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if nt.kind in "iu":
        info = np.iinfo(nt)
        if rng.random() < 0.5:
            return rng.integers(info.min, info.max, size=shape, dtype=nt, endpoint=True).astype(dtype)
        return rng.integers(0, 5, size=shape).astype(dtype)

    def floats() -> np.ndarray:
        v = rng.standard_normal(shape) * 100
        special = rng.random(shape) < 0.05
        v[special] = rng.choice([np.nan, np.inf, -np.inf, -0.0], size=int(special.sum()))
        return v

    if nt.kind != "c":
        return floats().astype(dtype)
    out = np.empty(shape, nt)  # real and imaginary parts drawn apart: NaN or inf in one part only, too
    out.real, out.imag = floats(), floats()
    return out.astype(dtype)


def blend_reference(out: np.ndarray, parts) -> np.ndarray:
    """numpy's blend of ``parts`` ((values, offsets, windows), lanes first) into a copy of ``out``: float64 sums
    of w * v and of w from 0.0 in the parts' order (w the outer product of the windows, as blend.weights makes
    it), the quotient cast; a voxel one part covers, its value cast; none, as it was (inference/weighted.py's
    rules, which the compiled blend_mean keeps bit for bit)."""
    got = out.copy()
    acc, wsum, last = np.zeros(out.shape), np.zeros(out.shape[1:]), np.zeros(out.shape)
    count = np.zeros(out.shape[1:], int)
    for values, offsets, windows in parts:
        w = np.ones(())
        for win in windows:
            w = np.multiply.outer(w, win)
        at = tuple(slice(o, o + n) for o, n in zip(offsets, values.shape[1:]))
        acc[(slice(None),) + at] += np.multiply(w, values, dtype=np.float64)
        wsum[at] += w
        count[at] += 1
        last[(slice(None),) + at] = values
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        got[:, count >= 2] = (acc / wsum).astype(out.dtype)[:, count >= 2]
        got[:, count == 1] = last[:, count == 1].astype(out.dtype)
    return got


def host_executor(kind: str):
    """``pipelines.make_executor``'s stand-in running the GPU decode's executor (``"gpu"``) or the hybrid one
    (``"hybrid"``, half of each wave's chunks each way) on CPU tensors, for a test to monkeypatch in."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.hybrid.executor import HybridExecutor
    from stoker.engine.hybrid.split import Shares

    if kind == "gpu":
        return lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store)
    return lambda cfg, device, stats, store: HybridExecutor.on_host(cfg, stats, store, shares=Shares(0.5))
