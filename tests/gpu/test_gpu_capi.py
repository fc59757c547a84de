"""nvCOMP's C API as stoker binds it (stoker.engine.gpu.capi), checked against the library without a GPU.

Its host-only calls (alignments, scratch sizes) run anywhere the library is installed (the test extra
installs it), so the ctypes structures and signatures are held to nvCOMP 6's here; the decode itself runs
in tests/gpu/test_gpu_nvcomp.py on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP's library is not installed (pip install 'stoker[gpu]')")

from stoker.engine.gpu import frames  # noqa: E402
from stoker.engine.gpu.capi import Batched, NvcompError  # noqa: E402
from stoker.engine.gpu.nvcomp import DeviceDecoder  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", ["LZ4", "Zstd"])
def test_streams_need_no_alignment_where_the_frames_put_them(name):
    # the layouts decode every stream in place, at any byte offset of the staged frames and of the output
    batched = Batched(name)
    assert batched.alignments[:2] == (1, 1)
    assert batched.alignments[2] in (1, 2, 4, 8)  # the scratch: torch's allocations are aligned far more


def test_scratch_sizes_come_from_the_library():
    zstd, lz4 = Batched("Zstd"), Batched("LZ4")
    assert zstd.temp_bytes(0, 1 << 16, 0) == lz4.temp_bytes(0, 1 << 16, 0) == 0
    one = zstd.temp_bytes(1, 1 << 16, 1 << 16)
    assert one > 0
    many = zstd.temp_bytes(432, 1 << 16, 432 << 16)
    assert many >= 400 * one // 2  # grows with the streams
    assert zstd.temp_bytes(432, 1 << 16, 108 << 16) < many  # and with the bytes in all
    assert lz4.temp_bytes(432, 1 << 16, 432 << 16) == 0  # (LZ4 decodes without scratch)


def test_a_refused_call_is_a_typed_error_naming_the_status():
    zstd = Batched("Zstd")
    with pytest.raises(NvcompError, match=r"nvCOMP Zstd DecompressGetTempSize: status 18 \(chunk size too large\)"):
        zstd.temp_bytes(4, 1 << 40, 4 << 40)
    zstd.opts.backend = 7  # no such backend: the options structure reaches the library as laid out
    with pytest.raises(NvcompError, match=r"status 10 \(invalid value\)"):
        zstd.temp_bytes(4, 1 << 16, 4 << 16)


def _decoder() -> DeviceDecoder:
    d = DeviceDecoder.__new__(DeviceDecoder)  # the parts need no device: only the library's sizes
    d._codecs = {frames.LZ4: Batched("LZ4"), frames.ZSTD: Batched("Zstd")}
    return d


def _layout(dsize: np.ndarray) -> frames.Layout:
    n = len(dsize)
    z = np.zeros(n, np.int64)
    e = np.zeros(0, np.int64)
    return frames.Layout(z, z + 1, np.cumsum(dsize) - dsize, dsize, np.zeros(n, bool), z + frames.ZSTD,
                         np.arange(n), e, e, e, e, np.arange(n), z + 1, np.cumsum(dsize) - dsize, dsize, n,
                         int(dsize.sum()))


@pytest.mark.parametrize("room_chunks", [1, 3, 50, 1000])
def test_streams_are_decoded_in_parts_that_fit_the_scratch(room_chunks):
    d = _decoder()
    rng = np.random.default_rng(room_chunks)
    dsize = rng.integers(1 << 10, 1 << 17, 300).astype(np.int64)
    layout = _layout(dsize)
    zstd = d._codecs[frames.ZSTD]
    room = zstd.temp_bytes(room_chunks, 1 << 17, room_chunks << 17)
    rows = np.arange(300)
    parts = d._parts(frames.ZSTD, layout, rows, torch.empty(room, dtype=torch.uint8))
    assert np.array_equal(np.concatenate(parts), rows)  # every stream once, in order
    for part in parts:
        need = zstd.temp_bytes(len(part), int(dsize[part].max()), int(dsize[part].sum()))
        assert need <= room or len(part) == 1
    if room_chunks >= 300:
        assert len(parts) == 1
    whole = d._parts(frames.ZSTD, layout, rows, None)  # no scratch given: one decode, its scratch made for it
    assert len(whole) == 1 and np.array_equal(whole[0], rows)
    assert d._parts(frames.ZSTD, layout, rows[:0], None) == []
