"""The device decode: a batch's streams decompressed by NVIDIA nvCOMP, then unshuffled on the GPU.

For the chunks of a :class:`~stoker.engine.gpu.frames.Layout` (:func:`~stoker.engine.gpu.frames.batch`),
:meth:`DeviceDecoder.decode` does, all on the decoder's CUDA stream:

1. the stored chunks copied end to end into one pinned host buffer (or read there by the caller:
   :meth:`DeviceDecoder.decode_staged`), and that buffer copied to the device in one transfer (the
   encoded bytes are all that cross PCIe);
2. per compressor, one batched nvCOMP decode (:mod:`.capi`: its C API, plain LZ4 blocks and zstd
   frames, as c-blosc and numcodecs write them) of every stream, from its offset in the staged
   bytes straight to its offset in the output; nvCOMP's LZ4 and zstd decoders need no alignment
   of their input or output (1 byte), so the streams are decoded where the frames put them. Each
   decode writes every stream's status and decoded size on the device; their host copies are
   checked later (``deferred``), so nothing here waits for the device (the check does: for the decode to
   start, without a limit since the stream's waits before it may wait for the consumer's stream, until the
   pipeline closes; then :data:`CHECK_WAIT_S` at most for it to finish, woken once by a thread that waits
   for the decoder's events in order, :class:`~stoker.engine.gpu.streams.EventWaiter`. A decode not done by
   then raises DeviceError, and the buffers that check's decode may still write are kept referenced until
   it is done, never freed under it; the executor runs the wave's other checks too, so each keeps its own);
3. raw streams copied and blocks unshuffled by :mod:`stoker.engine.gpu.ops`, the code the CPU reference
   (:mod:`stoker.engine.gpu.reference`) runs and the tests hold to numcodecs.

nvCOMP trusts its input. The host parse has already checked every offset and size against the
frames and the chunks (a stream can only read its own bytes and write its own output range);
damage inside a stream is reported by nvCOMP's statuses or by the decoded sizes checked after the
decode.

nvCOMP 6 (``pip install 'stoker[gpu]'``: the ``nvidia-libnvcomp-cu12`` package; ``'stoker[gpu-cu13]'``
with a CUDA 13 torch build) is loaded on first use. Nothing here runs without a CUDA device; ``tests/gpu/test_gpu_nvcomp.py``
checks it against numcodecs on one.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import DeviceError, InternalError, InvalidArgument, pipeline_closed
from . import ops, streams
from .capi import STATUS_NAMES, Batched, NvcompError
from .frames import CODEC_NAMES, LZ4, ZSTD, FrameError, Layout, UnsupportedFrame, stage

#: the largest stream sent to nvCOMP: its batched LZ4 and zstd kernels take chunks up to 16 MiB
#: (larger streams, e.g. plain zstd chunks over 16 MiB, are decoded on the CPU)
MAX_STREAM_BYTES = 1 << 24
_ALGORITHMS = {LZ4: "LZ4", ZSTD: "Zstd"}
#: the longest a decode's check waits for the decode (a wave decodes in milliseconds; past this the device
#: is hung, and the check raises DeviceError rather than hold the executor for ever); read at each check
CHECK_WAIT_S = 60.0
#: how often a check waiting for the device looks whether the pipeline is closing (the wait itself wakes
#: once, when the decode is done: streams.EventWaiter)
CANCEL_PAUSE_S = 0.1


def _never() -> bool:
    return False


def available() -> bool:
    """True when torch sees a CUDA device and nvCOMP's library is installed and loads (its LZ4 and zstd
    decoders found in it), so ``decode_on="auto"`` never picks a GPU decode that cannot run."""
    try:
        found = importlib.util.find_spec("nvidia.libnvcomp") is not None
    except (ImportError, ValueError):
        found = False
    if not found or not torch.cuda.is_available():
        return False
    try:
        _batched()
    except InvalidArgument:
        return False
    return True


def can_decode(layout: Layout) -> bool:
    """True when the device can decode every stream of ``layout`` (raw, lz4 or zstd, each within nvCOMP's size)."""
    return layout.supported and not np.any(~layout.raw & (layout.dsize > MAX_STREAM_BYTES))


class DeviceDecoder:
    """Decodes batches of chunks on one CUDA device, in order on one CUDA stream.

    One per thread (each holds its own queued work). The output of :meth:`decode` is ready once
    :attr:`stream` has run the work queued so far (``torch.cuda.current_stream().wait_stream``).
    """

    #: streams that decode to more than this go to the CPU (:func:`can_decode`)
    max_stream_bytes = MAX_STREAM_BYTES
    # a check's decode past CHECK_WAIT_S (its error and event): the later checks fail as soon as they see it
    # still not done (their decodes are queued behind it on the stream)
    _late: tuple[DeviceError, Any] | None = None
    _waiting: streams.EventWaiter | None = None
    #: true once the checks' waits should end (the pipeline's close: the executor sets it)
    cancelled: Callable[[], bool] = staticmethod(_never)

    def __init__(self, device: torch.device | int | str, stream: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise InvalidArgument(f"DeviceDecoder needs a CUDA device, got {self.device}", knob="decode_on")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        self._codecs = _batched()

    def temp_bytes(self, n: int, max_bytes: int, total_bytes: int) -> int:
        """Device scratch nvCOMP needs to decode ``n`` streams of at most ``max_bytes`` (``total_bytes`` in all)
        with any of its codecs: what ``decode_staged``'s ``temp`` should hold."""
        return max(c.temp_bytes(n, min(max_bytes, MAX_STREAM_BYTES), total_bytes) for c in self._codecs.values())

    def decode(self, frames: Sequence[Any], layout: Layout) -> torch.Tensor:
        """The decoded, unshuffled bytes (``layout.out_nbytes``, uint8 on the device) of ``frames``.

        Raises :class:`UnsupportedFrame` when a stream is not for the device (:func:`can_decode`:
        decode those chunks on the CPU), :class:`FrameError` when nvCOMP reports a stream damaged or it does
        not decode to its size, and :class:`~stoker.errors.DeviceError` when nvCOMP refuses the call.
        """
        staged = torch.empty(layout.in_nbytes, dtype=torch.uint8, pin_memory=True)
        stage(frames, layout, staged.numpy())
        return self.decode_staged(staged, layout)

    def decode_staged(self, staged: torch.Tensor, layout: Layout, data: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, deferred: list | None = None,
                      temp: torch.Tensor | None = None, copied: bool = False) -> torch.Tensor:
        """As :meth:`decode`, for chunks already in ``staged`` (pinned, uint8) where ``layout`` has them
        (:func:`~stoker.engine.gpu.frames.parse_blosc_batch` parses them there). ``staged`` must not be
        written again before :attr:`stream` has run past this call (its copy to the device is
        queued there; an event recorded on :attr:`stream` tells when). ``data``, ``out`` and ``temp``:
        device buffers (flat uint8, at least ``layout.in_nbytes``, ``layout.out_nbytes`` and a
        :meth:`temp_bytes`) for the staged copy, the decoded bytes and nvCOMP's scratch, allocated here
        when not given (a ``temp`` too small for all streams at once decodes them in parts that fit);
        the result is ``out``'s first ``layout.out_nbytes`` bytes. With ``deferred`` (a list), the
        checks of the decoded sizes and statuses (each waits for its decode) are appended there
        instead of run. With ``copied``, ``data`` holds the staged bytes already (copied by the caller on
        another stream, which it made :attr:`stream` wait for): ``staged`` is not read here."""
        if not can_decode(layout):
            raise UnsupportedFrame(f"chunks {layout.unsupported_chunks().tolist()} hold streams that are neither lz4 "
                                   f"nor zstd, or streams over {MAX_STREAM_BYTES} bytes")
        if staged.dtype != torch.uint8 or staged.dim() != 1 or staged.numel() < layout.in_nbytes:
            raise ValueError(f"decode_staged: needs a flat uint8 tensor of {layout.in_nbytes} bytes")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # allocated on this stream, so the caching allocator reuses them only after its work
            if data is None:
                if copied:
                    raise ValueError("decode_staged(copied=True) needs the device copy (data)")
                data = torch.empty(layout.in_nbytes, dtype=torch.uint8, device=self.device)
            ops.check_flat(data, layout.in_nbytes, "decode_staged")
            data = data[:layout.in_nbytes]
            if not copied:
                data.copy_(staged[:layout.in_nbytes], non_blocking=True)
            if out is None:
                out = torch.empty(layout.out_nbytes, dtype=torch.uint8, device=self.device)
            ops.check_flat(out, layout.out_nbytes, "decode_staged")
            out = out[:layout.out_nbytes]
            for codec in _ALGORITHMS:
                rows = np.flatnonzero(~layout.raw & (layout.codec == codec))
                for part in self._parts(codec, layout, rows, temp):
                    check = self._decompress(codec, data, out, layout, part, temp)
                    if deferred is None:
                        check()
                    else:
                        deferred.append(check)
            raw = layout.raw
            ops.copy_segments_(data, layout.src[raw], out, layout.dst[raw], layout.dsize[raw])
            ops.unshuffle_(out, layout)
        return out

    def _parts(self, codec: int, layout: Layout, rows: np.ndarray, temp: torch.Tensor | None) -> list[np.ndarray]:
        """``rows`` in consecutive parts whose decode fits ``temp`` (all of them at once without one)."""
        if temp is None or not len(rows):
            return [rows] if len(rows) else []
        batched, room = self._codecs[codec], temp.numel()
        sizes = layout.dsize[rows]
        parts, lo = [], 0
        while lo < len(rows):
            hi = len(rows)
            while hi - lo > 1 and batched.temp_bytes(hi - lo, int(sizes[lo:hi].max()), int(sizes[lo:hi].sum())) > room:
                hi = lo + (hi - lo) // 2
            parts.append(rows[lo:hi])
            lo = hi
        return parts

    def _decompress(self, codec: int, data: torch.Tensor, out: torch.Tensor, layout: Layout, rows: np.ndarray,
                    temp: torch.Tensor | None):
        """Queue one batched decode of streams ``rows``; returns the check of their decoded sizes and statuses
        (which waits for the decode)."""
        batched, name = self._codecs[codec], CODEC_NAMES[codec]
        expected = layout.dsize[rows]
        need = batched.temp_bytes(len(rows), int(expected.max()), int(expected.sum()))
        if temp is None or temp.numel() < need:  # (a single stream over the given scratch: its own)
            temp = torch.empty(need, dtype=torch.uint8, device=self.device)
        # before the launch, after the stream's waits (the copy; the placement of an earlier wave, itself
        # behind the consumer's release of a batch slot: a training step, an NCCL barrier): the check's limit
        # counts from here, the decode's own time, not the consumer's
        started = self._mark()
        try:
            queued = batched.decompress(data.data_ptr() + layout.src[rows], layout.csize[rows],
                                        out.data_ptr() + layout.dst[rows], expected, temp[:max(need, 1)],
                                        self.stream)
        except NvcompError as exc:  # refused before it read a byte: not the data's fault
            raise DeviceError(f"nvCOMP refused to decode {len(rows)} {name} streams of chunks "
                              f"{np.unique(layout.chunk[rows]).tolist()}: {exc}; Config(decode_on='cpu') "
                              "decodes them on the CPU") from None
        stream_chunks = layout.chunk[rows]

        def check() -> None:
            self._wait(started, queued.event, (queued, data, out, temp),
                       f"{len(rows)} {name} streams of chunks {np.unique(stream_chunks).tolist()}")
            statuses = queued.statuses.numpy()
            bad = np.flatnonzero(statuses != 0)
            if len(bad):
                code = int(statuses[bad[0]])
                raise FrameError(f"chunk {int(stream_chunks[bad[0]])}: nvCOMP could not decode a {name} stream "
                                 f"(status {code}: {STATUS_NAMES.get(code, 'unknown')})")
            got = queued.sizes.numpy()
            bad = np.flatnonzero(got != expected)
            if len(bad):
                raise FrameError(f"chunk {int(stream_chunks[bad[0]])}: a {name} stream decoded to "
                                 f"{int(got[bad[0]])} bytes, {int(expected[bad[0]])} expected")

        return check

    def _mark(self) -> Any:
        """A blocking event recorded on :attr:`stream` now (its wait sleeps rather than spin a core)."""
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def _waiter(self) -> streams.EventWaiter:
        """The thread that waits for this decoder's events, in the stream's order (made at the first decode)."""
        if self._waiting is None:
            self._waiting = streams.EventWaiter(f"stoker-nvcomp-check {self.device}")
        return self._waiting

    def _wait(self, started: Any, done: Any, writes: Sequence[Any], what: str) -> None:
        """Wait for a queued decode (of ``what``): for it to start (``started``: the stream's waits before it,
        which may wait for the consumer's stream, take no limit, but the close ends them), then
        :data:`CHECK_WAIT_S` at most for it to finish (``done``); no time at all while an earlier decode is
        still past its own limit (this one is queued behind it). Not done, or the close came: ``writes`` (the
        buffers it may still write: device output, scratch, statuses) are kept referenced until it is
        (:func:`~.streams.keep`) rather than freed under it, and DeviceError says what to change (ShutdownError
        at the close)."""
        late = self._late
        if late is not None:
            if not self._looked(late[1], late[1], writes, what):
                streams.keep(writes, until=done)
                raise DeviceError(f"nvCOMP's decode of {what} on {self.device} is queued behind one that has not "
                                  f"finished ({late[0]})") from None
            self._late = None
        self._until(started, None, done, writes, what)
        limit = CHECK_WAIT_S
        if self._until(done, time.monotonic() + limit, done, writes, what):
            return
        error = DeviceError(
            f"nvCOMP's decode of {what} on {self.device} did not finish within {limit} s of its start (a hung "
            "kernel? check the device: nvidia-smi; dmesg for Xid errors). The buffers it may still write are "
            "kept, not freed, until it does (restart the process to free them); Config(decode_on='cpu') decodes "
            "on the CPU, without the GPU decode")
        self._late = (error, done)
        raise error

    def _until(self, event: Any, deadline: float | None, done: Any, writes: Sequence[Any], what: str) -> bool:
        """Wait for ``event`` until ``deadline`` (None: no limit) or the close; True once it is done. A look
        first (often it is: the check runs after the next wave is queued), else one wake by this decoder's
        :class:`~.streams.EventWaiter` (the checks run in the stream's order, so it is given the events in
        theirs). Raises ShutdownError at the close and DeviceError for a device fault (``writes`` kept until
        ``done``)."""
        if self._looked(event, done, writes, what):
            return True
        watch = self._waiter().watch(event)
        while not watch.query():
            if watch.error is not None:
                streams.keep(writes)  # (never known to be done: kept for ever)
                if isinstance(watch.error, InternalError):  # the waiter's own fault (a bug), not the device's
                    raise watch.error
                raise streams.device_failed(f"nvCOMP's decode of {what} on {self.device}", watch.error) from None
            if self.cancelled():
                streams.keep(writes, until=done)
                raise pipeline_closed()
            left = CANCEL_PAUSE_S if deadline is None else min(CANCEL_PAUSE_S, deadline - time.monotonic())
            if left <= 0:
                streams.keep(writes, until=done)
                return False
            watch.wait(left)
        return True

    def _looked(self, event: Any, done: Any, writes: Sequence[Any], what: str) -> bool:
        """``event.query()``; a look that raises (a device fault) is DeviceError (``writes`` kept for ever)."""
        try:
            return bool(event.query())
        except RuntimeError as exc:  # (torch.AcceleratorError is one) any status but "not ready"
            streams.keep(writes)
            raise streams.device_failed(f"nvCOMP's decode of {what} on {self.device}", exc) from None


def _batched() -> dict[int, Batched]:
    try:
        return {c: Batched(name) for c, name in _ALGORITHMS.items()}
    except (ImportError, OSError) as exc:
        raise InvalidArgument(f"decoding on the GPU needs NVIDIA nvCOMP ({exc}): pip install 'stoker[gpu]' "
                              "(CUDA 12) or 'stoker[gpu-cu13]' (a CUDA 13 torch build)",
                              knob="decode_on") from None
