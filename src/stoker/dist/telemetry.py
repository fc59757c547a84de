"""Memory reports and a rank-0 telemetry log (JSON lines, plus TensorBoard when installed).

>>> from stoker.dist.telemetry import TelemetryWriter, memory_report
>>> with TelemetryWriter("runs/exp1", every=100) as tw:      # on every rank
...     for step in range(1000):
...         ...
...         tw.log(step, {**memory_report(), "pop_wait_s": wait})

``log`` takes the maximum of each metric over all ranks (a collective, so every rank
calls it with the same steps and keys); only rank 0 writes
``runs/exp1/telemetry.jsonl`` and the TensorBoard event file.

One process appends to ``telemetry.jsonl`` at a time: the writer holds its claim
(:func:`stoker.storage.fsutil.try_claim`) while open, and a second job logging into the same
folder at the same moment writes ``telemetry-<host>-<pid>.jsonl`` instead (with a
warning). Appending alone would not do: ``O_APPEND`` keeps whole lines apart on a
local disk, but NFS clients on two machines overwrite each other's lines. A later
run (a resumed job) appends to the same file once the claim is free; a resumed job
replays the steps between its checkpoint and where the killed run stopped, and its
lines for steps the file already holds carry ``"replayed": true`` (a reader wanting
one line per step keeps the last, the one on the path to the final model).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from ..checks import integer
from .collectives import rank_info
from .reduce import reduce_max
from ..errors import InvalidArgument, ShutdownError
from ..storage.fsutil import HOST, try_claim

__all__ = [
    "MEMORY_KEYS",
    "CUDA_MEMORY_KEYS",
    "TelemetryWriter",
    "host_rss_bytes",
    "memory_report",
    "peak_rss_bytes",
    "pinned_host_bytes",
    "register_pinned",
    "unregister_pinned",
]

MEMORY_KEYS = ("host_rss_bytes", "pinned_host_bytes", "shm_used_bytes")
# Our name -> torch.cuda.memory_stats() key.
_CUDA_STATS = {
    "cuda_allocated_bytes": "allocated_bytes.all.current",
    "cuda_allocated_peak_bytes": "allocated_bytes.all.peak",
    "cuda_reserved_bytes": "reserved_bytes.all.current",
    "cuda_reserved_peak_bytes": "reserved_bytes.all.peak",
    "cuda_alloc_retries": "num_alloc_retries",
}
CUDA_MEMORY_KEYS = tuple(_CUDA_STATS)

_pinned_lock = threading.Lock()
_pinned_bytes = 0


def _check_nbytes(nbytes: Any) -> int:
    return integer("nbytes", nbytes, 0)


def register_pinned(nbytes: int) -> None:
    """Count ``nbytes`` of page-locked host memory stoker now holds (thread-safe)."""
    global _pinned_bytes
    n = _check_nbytes(nbytes)
    with _pinned_lock:
        _pinned_bytes += n


def unregister_pinned(nbytes: int) -> None:
    """Stop counting ``nbytes`` of pinned memory released; more than is registered is an error."""
    global _pinned_bytes
    n = _check_nbytes(nbytes)
    with _pinned_lock:
        if n > _pinned_bytes:
            raise InvalidArgument(f"unregister_pinned({n}) but only {_pinned_bytes} bytes are registered")
        _pinned_bytes -= n


def pinned_host_bytes() -> int:
    """Pinned host bytes currently registered."""
    with _pinned_lock:
        return _pinned_bytes


def peak_rss_bytes() -> int:
    """The largest resident set size this process has had (getrusage)."""
    import resource  # Unix only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def host_rss_bytes() -> int:
    """Resident set size now; where /proc is missing, the peak RSS getrusage reports."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def _shm_used_bytes() -> int:
    """Bytes in use on the /dev/shm filesystem (all processes: DataLoader workers share through it)."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return 0
    return int((st.f_blocks - st.f_bfree) * st.f_frsize)


def memory_report() -> dict[str, int]:
    """Host and, when CUDA is in use, allocator memory, as integer bytes (and a retry count).

    Keys: ``host_rss_bytes``, ``pinned_host_bytes`` (registered by stoker),
    ``shm_used_bytes``; plus ``cuda_allocated_bytes``, ``cuda_allocated_peak_bytes``,
    ``cuda_reserved_bytes``, ``cuda_reserved_peak_bytes`` and ``cuda_alloc_retries`` for
    the current device once this process has initialised CUDA. The report never
    initialises CUDA itself.
    """
    report = {
        "host_rss_bytes": host_rss_bytes(),
        "pinned_host_bytes": pinned_host_bytes(),
        "shm_used_bytes": _shm_used_bytes(),
    }
    # is_initialized() first: creating a CUDA context just to report on it costs memory (and breaks fork).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        for name, key in _CUDA_STATS.items():
            report[name] = int(stats.get(key, 0))
    return report


def _json_value(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity; null keeps every line parseable by any reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TelemetryWriter:
    """Every ``every`` steps, reduce metrics (max over ranks) and let rank 0 log them.

    Rank 0 of ``group`` appends one JSON line per logged step to
    ``log_dir/telemetry.jsonl`` and writes TensorBoard scalars when ``tensorboard`` is
    importable (``tensorboard=True`` requires it, ``False`` turns it off). Other ranks
    create nothing. The rank is looked up at the first logged step, so the writer may
    be built before ``init_process_group``. Not thread-safe: one caller per process.
    """

    FILENAME = "telemetry.jsonl"

    def __init__(
        self, log_dir: str | os.PathLike, every: int = 1, group: Any = None, *, tensorboard: bool | None = None
    ) -> None:
        every = integer("every", every, 1)
        if tensorboard is not None and not isinstance(tensorboard, bool):
            raise InvalidArgument(f"tensorboard must be True, False or None, got {tensorboard!r}")
        self.log_dir = Path(log_dir)
        self.every = int(every)
        self.group = group
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise InvalidArgument("tensorboard=True but the tensorboard package is not installed")
        self._tensorboard = tensorboard
        self._is_writer: bool | None = None  # decided at the first logged step
        self._file: int | None = None  # a descriptor opened O_APPEND
        self._path: Path | None = None
        self._claim: Any = None
        self._logged_before = -1  # the highest step the file held when this writer opened it
        self._tb: Any = None
        self._closed = False

    @property
    def path(self) -> Path:
        """The JSON lines file (written by rank 0 only): ``telemetry.jsonl``, or this process's own file where
        another live writer held that one when logging started."""
        return self._path or self.log_dir / self.FILENAME

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Log ``metrics`` at ``step`` when ``step % every == 0``; returns the reduced values there, else None.

        Collective at logged steps: every rank of the group must call it with the same
        steps and metric names.
        """
        if self._closed:
            raise ShutdownError("TelemetryWriter is closed")
        step = integer("step", step, 0)
        if not isinstance(metrics, Mapping):
            raise InvalidArgument(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
        clash = {"step", "time", "replayed"} & set(metrics)
        if clash:
            raise InvalidArgument(f"metric names {sorted(clash)} are reserved for the log record itself")
        if step % self.every:
            return None
        reduced = reduce_max(metrics, self.group)  # every rank, before any rank-0-only work
        if self._is_writer is None:
            self._is_writer = rank_info(self.group).rank == 0
        if self._is_writer:
            self._write(int(step), reduced)
        return reduced

    def _open(self) -> None:
        """Claim ``telemetry.jsonl`` and open it for appending; a file of this process's own when another live
        writer (a second job logging into this folder) holds it."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / self.FILENAME
        self._claim = try_claim(path)
        if self._claim is None:
            path = self.log_dir / f"telemetry-{HOST}-{os.getpid()}.jsonl"
            warnings.warn(f"another process is logging to {self.log_dir / self.FILENAME}; this one logs to {path}",
                          RuntimeWarning, stacklevel=4)
        try:
            self._file = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except BaseException:
            if self._claim is not None:
                self._claim.release()
            raise
        self._path = path
        self._logged_before = _last_step(path)

    def _write(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            self._open()
            summary_writer = _summary_writer_class(self._tensorboard)  # imported by rank 0 alone
            if summary_writer is not None:
                self._tb = summary_writer(log_dir=str(self.log_dir))
        record = {"step": step, "time": time.time(), **{k: _json_value(v) for k, v in metrics.items()}}
        if step <= self._logged_before:  # an earlier run logged this step: a resumed run replays it
            record["replayed"] = True
        line = (json.dumps(record) + "\n").encode()
        fd = self._file
        assert fd is not None  # opened above
        while line:  # whole lines, appended (a short write only on a full disk: the rest follows)
            line = line[os.write(fd, line):]
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, float(value), step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the files (idempotent)."""
        self._closed = True
        if self._file is not None:
            os.close(self._file)
            self._file = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "TelemetryWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_step(path: Path) -> int:
    """The highest step a telemetry file holds (-1 for none); lines that do not parse are passed over."""
    last = -1
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int) and not isinstance(step, bool):
                    last = max(last, step)
    except OSError:
        return -1
    return last


def _summary_writer_class(tensorboard: bool | None) -> Any:
    """``torch.utils.tensorboard.SummaryWriter`` when wanted and importable, else None."""
    if tensorboard is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package
    except ImportError:
        if tensorboard:
            raise InvalidArgument("tensorboard=True but the tensorboard package is not installed") from None
        return None
    return SummaryWriter
