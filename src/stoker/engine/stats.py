"""Pipeline statistics: per-stage time and bytes, counters, amplification.

>>> s = pipeline.stats()
>>> s.read_amplification, s.decode_amplification
(1.9, 1.1)
>>> print(s)            # a readable table
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

STAGES = ("plan", "io", "decode", "assemble", "transfer", "pop_wait")
COUNTERS = (
    "batches_emitted", "samples", "chunks_needed", "chunks_decoded", "chunk_dedup_hits",
    "bytes_read", "bytes_decoded", "bytes_delivered", "bytes_needed",
)


@dataclass(frozen=True)
class Metric:
    """One stage: total seconds across threads, how many times it ran, bytes in and out."""

    name: str
    seconds: float = 0.0
    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of a pipeline's work since creation (or ``stats_reset()``)."""

    stages: dict[str, Metric] = field(default_factory=dict)
    batches_emitted: int = 0
    samples: int = 0
    chunks_needed: int = 0  # chunk touches summed over samples
    chunks_decoded: int = 0  # chunks actually decoded (after per-batch de-duplication)
    chunk_dedup_hits: int = 0  # touches served by a chunk another sample of the batch needed too
    bytes_read: int = 0  # encoded bytes read from storage
    bytes_decoded: int = 0  # decoded bytes produced (partial decodes count the blocks decoded)
    bytes_delivered: int = 0  # bytes of popped batches, in the output dtype
    bytes_needed: int = 0  # source-dtype bytes of the samples emitted
    peak_host_bytes: int = 0  # batch slots + peak transient buffers

    @property
    def read_amplification(self) -> float:
        """Encoded bytes read per source byte the samples need (compression lowers it)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0

    @property
    def decode_amplification(self) -> float:
        """Bytes decoded per source byte the samples need (1.0 is perfect)."""
        return self.bytes_decoded / self.bytes_needed if self.bytes_needed else 0.0

    def __str__(self) -> str:
        lines = [f"{'stage':<10}{'seconds':>10}{'count':>10}{'MB in':>12}{'MB out':>12}"]
        for name in STAGES:
            m = self.stages.get(name, Metric(name))
            lines.append(f"{name:<10}{m.seconds:>10.3f}{m.count:>10}{m.bytes_in / 1e6:>12.1f}{m.bytes_out / 1e6:>12.1f}")
        lines.append("")
        for name in COUNTERS:
            lines.append(f"{name:<20}{getattr(self, name):>14,}")
        lines.append(f"{'peak_host_bytes':<20}{self.peak_host_bytes:>14,}")
        lines.append(f"{'read_amplification':<20}{self.read_amplification:>14.2f}")
        lines.append(f"{'decode_amplification':<20}{self.decode_amplification:>14.2f}")
        return "\n".join(lines)


class StatsRecorder:
    """Thread-safe accumulation behind :class:`Stats` (one lock, tiny critical sections)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._stages = {name: [0.0, 0, 0, 0] for name in STAGES}
            self._counters = dict.fromkeys(COUNTERS, 0)

    def stage(self, name: str, seconds: float, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            m = self._stages[name]
            m[0] += seconds
            m[1] += 1
            m[2] += bytes_in
            m[3] += bytes_out

    def chunk(self, decode_s: float, assemble_s: float, bytes_in: int, decoded: int,
              read_s: float | None = None, count: int = 1) -> None:
        """``count`` decoded chunks (one, unless the compiled reader reports a call's worth): their decode
        and assemble stage times, and their reads when ``read_s`` is given, under one lock (the batch's
        counters are added when it is popped)."""
        with self._lock:
            if read_s is not None:
                r = self._stages["io"]
                r[0] += read_s
                r[1] += count
                r[3] += bytes_in
            d = self._stages["decode"]
            d[0] += decode_s
            d[1] += count
            d[2] += bytes_in
            d[3] += decoded
            a = self._stages["assemble"]
            a[0] += assemble_s
            a[1] += count

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counters[name] += value

    def snapshot(self, peak_host_bytes: int = 0) -> Stats:
        with self._lock:
            stages = {n: Metric(n, *v) for n, v in self._stages.items()}
            return Stats(stages=stages, peak_host_bytes=peak_host_bytes, **self._counters)
