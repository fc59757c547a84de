"""The hybrid executor's CPU part: the CPU executor's decoders filling ``lookahead_batches`` host slots
(pinned on a CUDA pipeline, as the CUDA path's staging), in the dtype the GPU decode assembles its batch in.

Its batches are only the chunks the hybrid gives it, decoded, cast and placed by the compiled engine (or the
Python path) exactly as on the CPU path; nothing after them (no CF decoding, padding or transform: the GPU
decode's executor does those once the whole batch is on the device).

>>> part = HostPart(cfg, device, stats, store)
>>> part.prepare(sample_shape, readers, torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..buffers import SlotRing, pinned_footprint
from ..cpu.executor import CpuExecutor

if TYPE_CHECKING:
    from ...config import Config
    from ...storage import LocalStore
    from ..stats import StatsRecorder


class HostPart(CpuExecutor):
    """A :class:`~stoker.engine.cpu.executor.CpuExecutor` whose slots stage the hybrid's host part: one per
    batch being made (``lookahead_batches``), pinned on a CUDA ``device`` (the copy to the device is then
    asynchronous), freed again once its copy is done."""

    staging = "pinned staging slots of the CPU part (lookahead_batches)"
    exact_cf = False  # its batches are the GPU part's dtype: no float64 work (cf.check_output refuses)

    def __init__(self, cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore) -> None:
        # its batches are plain: CF decoding and the transform run once, on the device, after both parts
        super().__init__(dataclasses.replace(cfg, transform=None, cf=False), stats, store)
        self.device = device
        self.n_slots = cfg.lookahead_batches

    def host_rings(self, dtype: torch.dtype) -> list[tuple[int, torch.dtype, str]]:
        return [(self.n_slots, dtype, self.staging)]

    def host_slot_bytes(self, slot_bytes: int) -> int:
        return pinned_footprint(slot_bytes) if self.device.type == "cuda" else slot_bytes

    def _make_slots(self, batch_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # pinning needs a CUDA context: this GPU's, not GPU 0's
                self.slots = self.host_slots = SlotRing(self.n_slots, batch_shape, dtype, pin=True)
        else:
            self.slots = self.host_slots = SlotRing(self.n_slots, batch_shape, dtype)
