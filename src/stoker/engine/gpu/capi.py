"""nvCOMP's batched LZ4 and zstd decompression, called through its C API (``libnvcomp.so.6``, ctypes).

Why not nvCOMP's Python ``Codec.decode``: without a decompression config it parses every stream on the
device first and waits for that on the host (for LZ4, a whole decode pass without output, to find the
sizes), and it allocates its temporary memory on each call; with a config it reports the sizes the config
states, whatever the streams decode to. The C API's ``nvcompBatched*DecompressAsync`` queues the decode
and nothing else: the caller gives the output capacity of every stream, the temporary memory, and device
arrays where nvCOMP writes each stream's decoded size and status. :meth:`Batched.decompress` queues it on
a CUDA stream and returns those two arrays' host copies (queued too), read once the stream is past them.

The library comes in the package ``nvidia-libnvcomp-cu12`` / ``-cu13`` (what ``stoker[gpu]`` /
``stoker[gpu-cu13]`` install); ``NVCOMP_PREFER_SYSTEM_LIBRARY=true`` loads a system one first, as that
package's own loader does. The structures below are those of nvCOMP 6's headers (``nvcomp/lz4.h``, ``nvcomp/zstd.h``):
64 bytes of options, zeroed but for the backend.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
import torch

#: nvcompDecompressBackend_t: the CUDA kernels (the default may pick a hardware engine whose buffers need
#: allocations made for it, which torch's are not)
BACKEND_CUDA = 2
SONAME = "libnvcomp.so.6"

STATUS_NAMES = {0: "success", 10: "invalid value", 11: "not supported", 12: "cannot decompress",
                13: "bad checksum", 15: "output buffer too small", 17: "alignment", 18: "chunk size too large",
                20: "wrong input length", 21: "batch size too large", 1000: "CUDA error", 10000: "internal error"}


class _ZstdOpts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class _LZ4Opts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("sort_before_hw_decompress", ctypes.c_int),
                ("data_type", ctypes.c_int), ("bitshuffle_mode", ctypes.c_int), ("reserved", ctypes.c_char * 48)]


class _Alignments(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


_OPTS = {"LZ4": _LZ4Opts, "Zstd": _ZstdOpts}
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """libnvcomp, loaded once: the one nvCOMP's Python package ships (or the system's, as it would)."""
    global _lib
    if _lib is None:
        import nvidia.libnvcomp as pkg  # ImportError: not installed (the caller says what to install)

        here = os.path.dirname(pkg.__file__)
        paths = [os.path.join(here, sub, SONAME) for sub in ("lib64", "lib", "bin")]
        if os.getenv("NVCOMP_PREFER_SYSTEM_LIBRARY", "false").lower() == "true":
            paths.insert(0, SONAME)
        for path in paths:
            if path == SONAME or os.path.isfile(path):
                try:
                    _lib = ctypes.CDLL(path, ctypes.RTLD_LOCAL)
                    break
                except OSError:
                    continue
        else:
            raise ImportError(f"{SONAME} was not found beside nvidia.libnvcomp ({here})")
    return _lib


class NvcompError(RuntimeError):
    """nvCOMP refused a call (its status names why)."""


@dataclass
class Queued:
    """A queued batched decode: once the stream is past ``event``, ``sizes`` and ``statuses`` (pinned host
    tensors) hold each stream's decoded size and nvCOMP status."""

    sizes: torch.Tensor
    statuses: torch.Tensor
    event: object


class Batched:
    """One algorithm's batched decompression (``"LZ4"`` or ``"Zstd"``) on the CUDA kernels.

    >>> zstd = Batched("Zstd")                        # doctest: +SKIP
    >>> queued = zstd.decompress(src, csize, dst, dsize, temp, stream)  # device pointers: int64 numpy arrays
    """

    def __init__(self, name: str, lib: ctypes.CDLL | None = None) -> None:
        lib = lib if lib is not None else library()
        self.name = name
        self.opts = _OPTS[name]()
        self.opts.backend = BACKEND_CUDA
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        self._temp = getattr(lib, f"nvcompBatched{name}DecompressGetTempSize")
        self._temp.argtypes = [size, size, _OPTS[name], ctypes.POINTER(size), size, ptr]
        self._temp.restype = ctypes.c_int
        self._run = getattr(lib, f"nvcompBatched{name}DecompressAsync")
        self._run.argtypes = [ptr, ptr, ptr, ptr, size, ptr, size, ptr, _OPTS[name], ptr, ptr]
        self._run.restype = ctypes.c_int
        align = getattr(lib, f"nvcompBatched{name}DecompressGetRequiredAlignments")
        align.argtypes = [_OPTS[name], ctypes.POINTER(_Alignments)]
        align.restype = ctypes.c_int
        got = _Alignments()
        self._check(align(self.opts, ctypes.byref(got)), "GetRequiredAlignments")
        self.alignments = (got.input, got.output, got.temp)

    def _check(self, status: int, call: str) -> None:
        if status:
            raise NvcompError(f"nvCOMP {self.name} {call}: status {status} ({STATUS_NAMES.get(status, 'unknown')})")

    def temp_bytes(self, n: int, max_bytes: int, total_bytes: int) -> int:
        """Device bytes of temporary memory to decompress ``n`` streams of at most ``max_bytes`` decoded
        bytes each, ``total_bytes`` in all (host only: no device work)."""
        if n <= 0:
            return 0
        out = ctypes.c_size_t()
        self._check(self._temp(n, max(1, max_bytes), self.opts, ctypes.byref(out), max(1, total_bytes), None),
                    "DecompressGetTempSize")
        return int(out.value)

    def decompress(self, src: np.ndarray, csize: np.ndarray, dst: np.ndarray, dsize: np.ndarray,
                   temp: torch.Tensor, stream: torch.cuda.Stream) -> Queued:
        """Queue on ``stream`` the decode of streams ``src[i]`` (device address, ``csize[i]`` bytes) into
        ``dst[i]`` (device address, room for ``dsize[i]`` bytes), with ``temp`` (device, at least
        :meth:`temp_bytes`). The pointer and size arrays cross to the device in one copy from pinned memory;
        nothing here waits for the device. The caller keeps the buffers behind the addresses alive until the
        stream is past the decode (torch's allocator does, for tensors allocated on ``stream``)."""
        n = len(src)
        device = temp.device
        with torch.cuda.stream(stream):
            table = torch.empty((5, n), dtype=torch.int64, pin_memory=True)
            rows = table.numpy()
            rows[0], rows[1], rows[2], rows[3] = src, csize, dsize, dst
            on_device = torch.empty((5, n), dtype=torch.int64, device=device)
            on_device[:4].copy_(table[:4], non_blocking=True)
            statuses = torch.empty(n, dtype=torch.int32, device=device)
            a = [on_device[k].data_ptr() for k in range(5)]
            status = self._run(a[0], a[1], a[2], a[4], n, temp.data_ptr(), temp.numel(), a[3], self.opts,
                               statuses.data_ptr(), stream.cuda_stream)
            self._check(status, "DecompressAsync")
            sizes_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            statuses_host = torch.empty(n, dtype=torch.int32, pin_memory=True)
            sizes_host.copy_(on_device[4], non_blocking=True)
            statuses_host.copy_(statuses, non_blocking=True)
            # the decode's check waits for this event (nvcomp.CHECK_WAIT_S at most) through a thread that
            # synchronize()s it (streams.EventWaiter) while the device decodes, for milliseconds a group;
            # blocking: that wait sleeps in the driver, GIL released, rather than spin a core as a default
            # event's would.
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        return Queued(sizes_host, statuses_host, event)
