"""What a batch row should hold, for the tests that compare batches with the source array (tests/gpu/): the
crop cast to the batch dtype as zarr + torch would, and a tensor's bits for bit-for-bit comparisons."""

from __future__ import annotations

import numpy as np
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits: a view as the signed integer of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def expected(data: np.ndarray, sample, dtype: str) -> torch.Tensor:
    """The row of ``sample`` (one box of ``data``) in a batch of ``dtype`` ("native", "bf16", "f32", "f16").

    >>> torch.equal(batch[i], expected(data, batch.samples[i], "bf16"))
    """
    crop = data[tuple(slice(a, b) for a, b in sample.aabb)]
    if dtype == "native":
        return torch.from_numpy(np.ascontiguousarray(crop))
    if dtype == "bf16":
        return torch.from_numpy(crop.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(crop.astype({"f32": np.float32, "f16": np.float16}[dtype]))
