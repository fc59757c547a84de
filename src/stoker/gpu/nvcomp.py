"""The device decode: a batch's streams decompressed by NVIDIA nvCOMP, then unshuffled on the GPU.

For the chunks of a :class:`~stoker.gpu.frames.Layout` (:func:`~stoker.gpu.frames.batch`),
:meth:`DeviceDecoder.decode` does, all on the decoder's CUDA stream:

1. the stored chunks copied end to end into one pinned host buffer (or read there by the caller:
   :meth:`DeviceDecoder.decode_staged`), and that buffer copied to the device in one transfer (the
   encoded bytes are all that cross PCIe);
2. per compressor, one batched nvCOMP decode (``BitstreamKind.RAW``: plain LZ4 blocks and zstd
   frames, as c-blosc and numcodecs write them) of every stream, from its offset in the staged
   bytes straight to its offset in the output; nvCOMP's LZ4 and zstd decoders need no alignment
   (1 byte, input and output), so the streams are decoded where the frames put them;
3. raw streams copied and blocks unshuffled by :mod:`stoker.gpu.ops`, the code the CPU reference
   (:mod:`stoker.gpu.reference`) runs and the tests hold to numcodecs.

nvCOMP trusts its input. The host parse has already checked every offset and size against the
frames and the chunks (a stream can only read its own bytes and write its own output range);
damage inside a stream is reported by nvCOMP or by the decoded sizes checked after the decode.

nvCOMP (``pip install 'stoker[gpu]'``, the ``nvidia-nvcomp-cu12`` package, or ``'stoker[gpu-cu13]'`` with a CUDA 13
torch build; its 6.x Python API) is
imported on first use. Nothing here runs without a CUDA device; ``tests/gpu/test_gpu_nvcomp.py``
checks it against numcodecs on one.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidArgument
from . import ops
from .frames import CODEC_NAMES, LZ4, ZSTD, FrameError, Layout, UnsupportedFrame, stage

#: the largest stream sent to nvCOMP: its batched LZ4 and zstd kernels take chunks up to 16 MiB
#: (larger streams, e.g. plain zstd chunks over 16 MiB, are decoded on the CPU)
MAX_STREAM_BYTES = 1 << 24
_ALGORITHMS = {LZ4: "LZ4", ZSTD: "Zstd"}


def available() -> bool:
    """True when torch sees a CUDA device and nvCOMP's Python package is installed (not imported here)."""
    try:
        found = importlib.util.find_spec("nvidia.nvcomp") is not None
    except (ImportError, ValueError):
        found = False
    return found and torch.cuda.is_available()


def can_decode(layout: Layout) -> bool:
    """True when the device can decode every stream of ``layout`` (raw, lz4 or zstd, each within nvCOMP's size)."""
    return layout.supported and not np.any(~layout.raw & (layout.dsize > MAX_STREAM_BYTES))


def _nvcomp() -> Any:
    try:
        from nvidia import nvcomp
    except ImportError as exc:
        raise InvalidArgument(f"decoding on the GPU needs NVIDIA nvCOMP ({exc}): pip install 'stoker[gpu]' "
                              "(CUDA 12) or 'stoker[gpu-cu13]' (a CUDA 13 torch build)",
                              knob="decode_on") from None
    return nvcomp


class DeviceDecoder:
    """Decodes batches of chunks on one CUDA device, in order on one CUDA stream.

    One per thread: nvCOMP's codecs hold per-call state. The output of :meth:`decode` is ready
    once :attr:`stream` has run the work queued so far (``torch.cuda.current_stream().wait_stream``).
    """

    #: streams that decode to more than this go to the CPU (:func:`can_decode`)
    max_stream_bytes = MAX_STREAM_BYTES

    def __init__(self, device: torch.device | int | str, stream: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise InvalidArgument(f"DeviceDecoder needs a CUDA device, got {self.device}", knob="decode_on")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        self._nv = _nvcomp()
        kind = self._nv.BitstreamKind.RAW
        self._codecs = {c: self._nv.Codec(algorithm=name, bitstream_kind=kind, device_id=self.device.index,
                                          cuda_stream=self.stream.cuda_stream)
                        for c, name in _ALGORITHMS.items()}

    def decode(self, frames: Sequence[Any], layout: Layout) -> torch.Tensor:
        """The decoded, unshuffled bytes (``layout.out_nbytes``, uint8 on the device) of ``frames``.

        Raises :class:`UnsupportedFrame` when a stream is not for the device (:func:`can_decode`:
        decode those chunks on the CPU) and :class:`FrameError` when nvCOMP fails or a stream does
        not decode to its size.
        """
        staged = torch.empty(layout.in_nbytes, dtype=torch.uint8, pin_memory=True)
        stage(frames, layout, staged.numpy())
        return self.decode_staged(staged, layout)

    def decode_staged(self, staged: torch.Tensor, layout: Layout, data: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, deferred: list | None = None) -> torch.Tensor:
        """As :meth:`decode`, for chunks already in ``staged`` (pinned, uint8) where ``layout`` has them
        (:func:`~stoker.gpu.frames.parse_blosc_batch` parses them there). ``staged`` must not be
        written again before :attr:`stream` has run past this call (its copy to the device is
        queued there; an event recorded on :attr:`stream` tells when). ``data`` and ``out``: device
        buffers (flat uint8, at least ``layout.in_nbytes`` and ``layout.out_nbytes``) for the staged
        copy and the decoded bytes, allocated here when not given; the result is ``out``'s first
        ``layout.out_nbytes`` bytes."""
        if not can_decode(layout):
            raise UnsupportedFrame(f"chunks {layout.unsupported_chunks().tolist()} hold streams that are neither lz4 "
                                   f"nor zstd, or streams over {MAX_STREAM_BYTES} bytes")
        if staged.dtype != torch.uint8 or staged.dim() != 1 or staged.numel() < layout.in_nbytes:
            raise ValueError(f"decode_staged: needs a flat uint8 tensor of {layout.in_nbytes} bytes")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # allocated on this stream, so the caching allocator reuses them only after its work
            if data is None:
                data = torch.empty(layout.in_nbytes, dtype=torch.uint8, device=self.device)
            ops.check_flat(data, layout.in_nbytes, "decode_staged")
            data = data[:layout.in_nbytes]
            data.copy_(staged[:layout.in_nbytes], non_blocking=True)
            if out is None:
                out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device=self.device)
            ops.check_flat(out, layout.out_nbytes, "decode_staged")
            out = out[:layout.out_nbytes]
            for codec in _ALGORITHMS:
                rows = np.flatnonzero(~layout.raw & (layout.codec == codec))
                if len(rows):
                    check = self._decompress(codec, data, out, layout, rows)
                    if deferred is None:
                        check()
                    else:
                        deferred.append(check)
            raw = layout.raw
            ops.copy_segments_(data, layout.src[raw], out, layout.dst[raw], layout.dsize[raw])
            ops.unshuffle_(out, layout)
        return out

    def _decompress(self, codec: int, data: torch.Tensor, out: torch.Tensor, layout: Layout, rows: np.ndarray):
        """Queue one batched decode; returns the check of its decoded sizes (which waits for the decode)."""
        nv, nvc, s = self._nv, self._codecs[codec], self.stream.cuda_stream
        sizes = layout.dsize[rows].tolist()
        srcs = nv.as_arrays(data, layout.src[rows].tolist(), layout.csize[rows].tolist(), cuda_stream=s)
        dsts = nv.as_arrays(out, layout.dst[rows].tolist(), sizes, cuda_stream=s)
        name = CODEC_NAMES[codec]
        chunks = np.unique(layout.chunk[rows]).tolist()
        try:
            # no decompression config built from the sizes the frames state: with one, nvCOMP reports those
            # sizes back whatever the streams decode to, and a damaged stream would pass unnoticed
            got = nvc.decode(srcs, out=dsts)
        except (RuntimeError, ValueError) as exc:
            raise FrameError(f"nvCOMP could not decode {len(rows)} {name} streams of chunks {chunks}: {exc}") from None
        expected = layout.dsize[rows]
        stream_chunks = layout.chunk[rows]

        def check(held=(srcs, dsts)) -> None:  # holds nvCOMP's arrays of the decode until it is checked
            try:
                got_sizes = list(got.buffer_sizes)  # waits for the decode
            except (RuntimeError, ValueError) as exc:
                raise FrameError(f"nvCOMP could not decode {len(rows)} {name} streams of chunks {chunks}: "
                                 f"{exc}") from None
            bad = np.flatnonzero(np.asarray(got_sizes, dtype=np.int64) != expected)
            if len(bad):
                raise FrameError(f"chunk {int(stream_chunks[bad[0]])}: a {name} stream decoded to "
                                 f"{got_sizes[bad[0]]} bytes, {int(expected[bad[0]])} expected")

        return check
