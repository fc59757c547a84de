"""How the hybrid executor shares a batch's chunks between the CPU engine and the GPU decode.

Each unique chunk of a batch (a row of its :class:`~stoker.engine.planning.tables.TablePlan`) is placed by
exactly one side. Chunks of arrays the device does not decode (other codecs, filters, casts it could round
differently: :func:`stoker.engine.gpu.sources.describe`) always go to the CPU engine, which decodes them
with every thread; the rest are cut by their decoded bytes so that each side's share takes the same time at
its measured rate (:class:`Shares`). :func:`subset` makes a side's plan: the same batch (samples, rows,
sources, keys) with only its chunks and their copies.

>>> shares = Shares()
>>> shares.record("cpu", 100 << 20, 0.1); shares.record("gpu", 300 << 20, 0.1)
>>> round(shares.gpu_fraction(), 2)
0.75
>>> cpu, gpu = split(cost, on_device, shares.gpu_fraction())
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ..planning.padding import PadCrop
from ..planning.tables import TablePlan

__all__ = ["MIN_SHARE", "SMOOTHING", "Shares", "chunk_costs", "split", "subset"]

#: each side keeps at least this fraction of the chunks it may take, so its rate goes on being measured (a
#: side given nothing could never show it got faster)
MIN_SHARE = 0.05
#: weight of the newest batch in each side's smoothed rate (an exponential moving average)
SMOOTHING = 0.3


class Shares:
    """Each side's decode rate (decoded bytes per second of its own work, smoothed) and the share of a batch
    the GPU decode gets from them. Thread-safe: rates are recorded by the sides' threads, read by the
    coordinator. ``fixed`` pins the GPU's share (tests, and a user who measured it)."""

    def __init__(self, fixed: float | None = None) -> None:
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._rates: dict[str, float] = {}
        self.fixed = fixed

    def record(self, side: str, nbytes: int, seconds: float) -> None:
        """``side`` ("cpu" or "gpu") decoded and placed ``nbytes`` in ``seconds`` of its own work."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(side)
            self._rates[side] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    def gpu_fraction(self) -> float:
        """The share of a batch's decoded bytes the GPU decode should place: its rate over both (one half
        until both have been measured), within ``[MIN_SHARE, 1 - MIN_SHARE]``."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            cpu, gpu = self._rates.get("cpu"), self._rates.get("gpu")
        if cpu is None or gpu is None:
            return 0.5
        return min(1 - MIN_SHARE, max(MIN_SHARE, gpu / (cpu + gpu)))


def chunk_costs(plan: TablePlan) -> np.ndarray:
    """Each chunk's decoded bytes (int64; 0 for a chunk with nothing stored: a fill costs next to nothing)."""
    nbytes = np.array([r.metadata.codec.nbytes for r in plan.sources], np.int64)
    return np.where(plan.chunk_file >= 0, nbytes[plan.chunk_source], 0)


def split(cost: np.ndarray, on_device: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(cpu, gpu)``: the chunk numbers (ascending) each side places, every chunk in exactly one.

    Chunks with ``on_device`` False go to the CPU; of the others the GPU takes a run at the end of the
    plan's order whose bytes come closest to ``fraction`` of the whole batch's (all of them for 1, none for
    0; for any other fraction at least one, and, of two or more, not all: both rates go on being measured)."""
    n = len(cost)
    free = np.flatnonzero(on_device)
    if n == 0 or not len(free) or fraction <= 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, np.int64)
    if fraction >= 1:
        k = len(free)
    else:  # bytes the GPU holds taking the last k free chunks, k = 0..len(free): the k closest to the target
        taken = np.concatenate([[0], np.cumsum(cost[free][::-1])])
        k = max(1, int(np.argmin(np.abs(taken - fraction * float(cost.sum())))))
        if len(free) > 1:
            k = min(k, len(free) - 1)
    mine = np.zeros(n, bool)
    mine[free[len(free) - k:]] = True
    return np.flatnonzero(~mine), np.flatnonzero(mine)


def subset(plan: TablePlan, ids: np.ndarray, pads: tuple[PadCrop, ...] = ()) -> TablePlan:
    """``plan`` with only chunks ``ids`` (ascending) and their copies: the same batch (samples, rows, sources,
    files, keys), so its copies land where the whole plan's would; ``pads``: the padded crops it fills."""
    ids = np.asarray(ids, np.int64)
    count = plan.n_copies[ids]
    at = (np.cumsum(count) - count).astype(plan.first_copy.dtype)  # each chunk's first copy in the subset
    rows = plan.copy_rows(ids)  # the chosen chunks' copies, in order
    return dataclasses.replace(
        plan,
        copy_row=plan.copy_row[rows], copy_chunk_start=plan.copy_chunk_start[rows],
        copy_box_start=plan.copy_box_start[rows], copy_extent=plan.copy_extent[rows],
        copy_src_offset=plan.copy_src_offset[rows],
        chunk_source=plan.chunk_source[ids], chunk_index=plan.chunk_index[ids], first_copy=at,
        n_copies=count, byte_start=plan.byte_start[ids], byte_stop=plan.byte_stop[ids],
        chunk_file=plan.chunk_file[ids], chunk_offset=plan.chunk_offset[ids], chunk_length=plan.chunk_length[ids],
        chunk_inner=plan.chunk_inner[ids], pads=pads)
