"""The CPU executor: which decode path makes a batch, and the memory each may use.

With the compiled engine (``stoker._native.Engine``, see :mod:`.decode_native`) a batch is planned as flat
tables (:mod:`.tables`) and made in one call on the engine's threads; the chunks it leaves (other codecs and
layouts, doubtful frames, rewritten shards) take the Python path. Without the engine (no compiler,
``STOKER_NATIVE=0``), or for arrays of rank 0, batches are planned by :func:`~.plan.plan_batch` and made by
the Python path (:mod:`.decode_python`) alone.

Memory: the engine's threads take their scratch from ``engine_budget`` bytes, the Python path its buffers
from the :class:`~.buffers.TransientBudget`; the pipeline splits what ``host_buffer_bytes`` leaves next to
its batch slots between the two, so together they never pass it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import native
from ..storage import LocalStore
from .buffers import TransientBudget, size_class
from .decode_native import NativeDecoder, native_codec, scratch_need
from .decode_python import PythonDecoder
from .executor import Job
from .plan import BatchPlan, plan_batch
from .stats import StatsRecorder
from .tables import TablePlan, plan_tables

__all__ = ["CpuExecutor", "Job", "engine_available", "native_codec", "scratch_need"]


def engine_available() -> bool:
    """True when the compiled engine is built and loaded (and ``STOKER_NATIVE`` does not turn it off)."""
    return native.Engine is not None


class CpuExecutor:
    """Plans and makes batches in CPU memory; one per pipeline."""

    def __init__(self, n_io: int, n_compute: int, budget: TransientBudget, stats: StatsRecorder,
                 store: LocalStore, engine_budget: int = 0, group_limit: int = 8 << 20) -> None:
        self.budget = budget
        self.python = PythonDecoder(n_io, n_compute, budget, stats, store)
        self.native = (NativeDecoder(n_compute, engine_budget, self.python, stats, max_group=group_limit)
                       if engine_available() and engine_budget > 0 else None)
        self._group_limit = group_limit

    def plan(self, batch_id: int, samples: Sequence, open_reader: Callable) -> BatchPlan | TablePlan:
        """The batch's plan: flat tables for the engine, or plan_batch's tasks for the Python path."""
        if self.native is not None and samples and samples[0].shape:
            return plan_tables(batch_id, samples, open_reader)
        return plan_batch(batch_id, samples, open_reader, max_group=self._group_limit, sizing=size_class)

    def submit(self, plan: BatchPlan | TablePlan, out: torch.Tensor,
               then: Callable[[Job], None] | None = None) -> Job:
        """Start making ``plan`` into ``out``; ``then(job)`` runs once every chunk is in place."""
        job = Job(plan, out, len(plan.chunks), then)
        if isinstance(plan, TablePlan):
            self.native.submit(job)
        else:
            self.python.submit_fills(job, plan.fill_chunks)
            self.python.submit_reads(job, plan.file_reads)
        return job

    def shutdown(self) -> None:
        """Cancel work in flight: once this returns the engine writes into no batch; Python tasks stop at
        their next check."""
        if self.native is not None:
            self.native.shutdown()
        self.python.shutdown()

    def peak_bytes(self) -> int:
        """The most the decode paths' buffers held at once (the engine's scratch and the transient budget)."""
        return self.budget.peak + (self.native.peak_bytes() if self.native is not None else 0)
