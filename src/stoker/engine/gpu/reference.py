"""The CPU reference of the device decode: the same streams and unshuffle, decompressed by c-blosc's own codecs.

Each stream of a :class:`~stoker.engine.gpu.frames.Layout` is decompressed with the LZ4 and zstd that
numcodecs carries in its extensions (``LZ4_decompress_safe`` from ``numcodecs.lz4``,
``ZSTD_decompress`` from ``numcodecs.zstd``, called through ctypes as
:mod:`stoker.zarr.codecs.bounds` does), raw streams are copied, and the blocks are unshuffled with
:func:`stoker.engine.gpu.ops.unshuffle_`, the torch code the device runs. The tests hold the result to
numcodecs' own decode, bit for bit; the device path differs only in who decompresses (raw streams
are copied by :func:`stoker.engine.gpu.ops.copy_segments_` here too).

>>> decode_blosc(frame, nbytes)  # the chunk's bytes, as numcodecs.Blosc().decode(frame) gives them
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any, Sequence

import numpy as np
import torch

from . import ops
from .frames import CODEC_NAMES, LZ4, FrameError, Layout, UnsupportedFrame, parse_blosc, parse_zstd, stage


def _load(module: str, name: str, argtypes: list, restype: Any) -> Any:
    try:
        lib = ctypes.CDLL(importlib.import_module(f"numcodecs.{module}").__file__)
        fn = getattr(lib, name)
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_vp, _int, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
# int LZ4_decompress_safe(const char* src, char* dst, int compressedSize, int dstCapacity): bytes written or < 0
_lz4 = _load("lz4", "LZ4_decompress_safe", [_vp, _vp, _int, _int], _int)
# size_t ZSTD_decompress(void* dst, size_t dstCapacity, const void* src, size_t srcSize)
_zstd = _load("zstd", "ZSTD_decompress", [_vp, _size, _vp, _size], _size)
_zstd_is_error = _load("zstd", "ZSTD_isError", [_size], ctypes.c_uint)


def available() -> bool:
    """True when numcodecs' extensions export the LZ4 and zstd functions this module calls."""
    return None not in (_lz4, _zstd, _zstd_is_error)


def decode_streams(data: np.ndarray, layout: Layout, out: np.ndarray | None = None) -> np.ndarray:
    """The decoded bytes (``layout.out_nbytes``) of the streams of ``layout``, whose input is ``data``,
    in ``out`` (a flat uint8 buffer of at least that many bytes; its first ones are returned) or a new array.

    Raises :class:`UnsupportedFrame` when a stream needs a compressor other than LZ4 and zstd, and
    :class:`FrameError` when a stream does not decode to exactly its size (the first such, once every other
    stream is decoded: as on the device, where each stream decodes into its own bytes whatever the others do).
    """
    if not available():
        raise UnsupportedFrame("numcodecs' lz4 and zstd extensions do not export LZ4_decompress_safe / "
                               "ZSTD_decompress here")
    if not layout.supported:
        raise UnsupportedFrame(f"chunks {layout.unsupported_chunks().tolist()} hold streams that are neither "
                               "lz4 nor zstd")
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if len(data) < layout.in_nbytes:
        raise ValueError(f"decode_streams: {len(data)} input bytes for a layout of {layout.in_nbytes}")
    if out is None:
        out = np.empty(layout.out_nbytes, np.uint8)
    if out.dtype != np.uint8 or out.ndim != 1 or len(out) < layout.out_nbytes or not out.flags.c_contiguous:
        raise ValueError(f"decode_streams: out must be a flat uint8 buffer of at least {layout.out_nbytes} bytes")
    out = out[:layout.out_nbytes]
    base_in = data.ctypes.data
    base_out = out.ctypes.data
    rows = zip(layout.src.tolist(), layout.csize.tolist(), layout.dst.tolist(), layout.dsize.tolist(),
               layout.raw.tolist(), layout.codec.tolist(), layout.chunk.tolist())
    failure = None  # the first stream that failed: raised once every stream is decoded, as the device reports
    for src, csize, dst, dsize, raw, codec, chunk in rows:  # a loop per stream: the reference, not the fast path
        if raw:
            continue
        if codec == LZ4:
            got = _lz4(base_in + src, base_out + dst, csize, dsize)
            failed = got < 0
        else:  # ZSTD: layout.supported leaves no other codec on a stream that is not raw
            got = _zstd(base_out + dst, dsize, base_in + src, csize)
            failed = bool(_zstd_is_error(got))
        if (failed or got != dsize) and failure is None:
            what = "failed" if failed else f"gave {got} bytes"
            failure = FrameError(f"chunk {chunk}: a {CODEC_NAMES[codec]} stream of {csize} bytes {what}, {dsize} "
                                 "expected")
    raw = layout.raw  # copied and unshuffled by the device's own operations, on CPU tensors
    ops.copy_segments_(torch.from_numpy(data), layout.src[raw], torch.from_numpy(out), layout.dst[raw],
                       layout.dsize[raw])
    ops.unshuffle_(torch.from_numpy(out), layout)
    if failure is not None:
        raise failure
    return out


class HostDecoder:
    """:class:`~stoker.engine.gpu.nvcomp.DeviceDecoder`'s interface on the CPU, over :func:`decode_streams`.

    What the GPU-decode executor runs in place of nvCOMP where there is no GPU (its tests run the
    executor end to end on CPU tensors with it): the same layouts, the same raw copies and torch
    unshuffle, and the same limit on the streams it takes (:attr:`max_stream_bytes`, nvCOMP's by
    default), so the same chunks go to the CPU decode.
    """

    device = torch.device("cpu")
    stream = None

    def __init__(self, max_stream_bytes: int = 1 << 24) -> None:
        self.max_stream_bytes = max_stream_bytes

    def temp_bytes(self, n: int, max_bytes: int, total_bytes: int) -> int:
        """No scratch: the CPU decodes each stream into its place."""
        return 0

    def decode_staged(self, staged: torch.Tensor, layout: Layout, data: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, deferred: list | None = None,
                      temp: torch.Tensor | None = None, copied: bool = False) -> torch.Tensor:
        """The decoded bytes of the chunks in ``staged`` (``data`` is not needed: the input is read where it is),
        or with ``copied`` in ``data`` (the executor's copy of the staging, which it may write again meanwhile).
        With ``deferred`` (a list), a stream that fails is reported by a check appended there, as the device
        reports the decoded sizes (the worst case: a whole group's failure found late)."""
        if np.any(~layout.raw & (layout.dsize > self.max_stream_bytes)):
            raise UnsupportedFrame(f"streams over {self.max_stream_bytes} bytes")
        if out is None:
            out = torch.empty(layout.out_nbytes, dtype=torch.uint8)
        try:
            source = data if copied and data is not None else staged
            decode_streams(source[:layout.in_nbytes].numpy(), layout, out.numpy())
        except FrameError as exc:
            if deferred is None:
                raise

            def check(exc=exc):
                raise exc

            deferred.append(check)
        return out[:layout.out_nbytes]


def decode(frames: Sequence[Any], layout: Layout) -> np.ndarray:
    """Decode a batch: ``frames`` (one stored chunk each) staged as ``layout`` expects, then :func:`decode_streams`."""
    data = np.empty(layout.in_nbytes, np.uint8)
    stage(frames, layout, data)
    return decode_streams(data, layout)


def decode_blosc(frame: Any, nbytes: int) -> np.ndarray:
    """One blosc1 frame decoded through its streams (:func:`~stoker.engine.gpu.frames.parse_blosc`)."""
    return decode([frame], parse_blosc(frame, nbytes))


def decode_zstd(frame: Any, nbytes: int) -> np.ndarray:
    """One plain zstd chunk decoded as the device would (one stream)."""
    return decode([frame], parse_zstd(frame, nbytes))
