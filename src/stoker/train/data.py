"""``CropBatches``: an endless, resumable stream of crop batches for a training loop.

>>> source = stoker.RandomCrops(["/data/vol.zarr"], (32, 64, 64), seed=0).for_rank()   # this rank's part
>>> data = CropBatches(source, stoker.Config(batch_size=8, dtype="f32", sample_shape=(32, 64, 64)))
>>> data.load_state_dict(ckpt["data"])      # optional: continue where a checkpoint stopped
>>> for x in data:                          # (8, 32, 64, 64) float32 tensors, one per training step
...     loss = model(x[:, None]).mean()
>>> data.close()

Samples of named fields give a ``dict[str, Tensor]`` per step (field name to that field's batch).
``CropBatches(..., with_samples=True)`` yields ``(samples, x)`` pairs, ``samples`` the batch's
:class:`~stoker.Sample` s in order (where each crop came from).

One :class:`~stoker.Pipeline` reads ahead (``Config.lookahead_batches``) from the
source's endless cursor (epoch after epoch). Each yielded tensor is a zero-copy
view of a pipeline slot, valid until the next one is requested; keep data longer
with ``.clone()``. ``state_dict()`` is the source position as of the batches
yielded so far, whatever is read ahead, so a checkpoint taken after a step
resumes with the next batch exactly.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..config import Config
from ..engine.batch import Batch
from ..engine.batch import FieldBatch, to_tensors
from ..engine.pipeline.facade import Pipeline
from ..engine.stats import Stats
from ..device.resolve import as_device
from ..errors import InvalidArgument, ShutdownError
from ..sampling.samplers import RankShare

__all__ = ["CropBatches"]


class CropBatches:
    """Endless batches of crops from one rank's :class:`~stoker.RankShare` (see the module docstring).

    ``device``: where the yielded tensors go (``None``: stay on the CPU, zero-copy). ``with_samples``: yield
    ``(samples, x)`` pairs, the batch's samples in order.
    """

    def __init__(self, source: RankShare, cfg: Config, device: torch.device | str | None = None,
                 with_samples: bool = False) -> None:
        if not isinstance(source, RankShare):
            raise InvalidArgument(f"source must be a RankShare (call .for_rank() on a SampleSource), got "
                                  f"{type(source).__name__}")
        if not isinstance(cfg, Config):
            raise InvalidArgument(f"cfg must be a stoker.Config, got {type(cfg).__name__}")
        self.source = source
        self.cfg = cfg
        self.with_samples = bool(with_samples)
        self.device = None if device is None else as_device(device, "CropBatches(device=...)")
        self._pipeline: Pipeline | None = None
        self._held: Batch | FieldBatch | None = None
        self._closed = False

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise ShutdownError("CropBatches is closed")
        if self._pipeline is not None:
            raise InvalidArgument("CropBatches is endless and can be iterated once; make a new one (after "
                                  "load_state_dict) to start again")
        pipeline = Pipeline(self.cfg)
        try:
            pipeline.push(self.source.forever())
        except BaseException:  # refused (a flip that moves the fields apart): nothing was read, iterable again
            pipeline.close()
            raise
        self._pipeline = pipeline
        return self._batches(pipeline)

    def _batches(self, pipeline: Pipeline) -> Iterator[Any]:
        try:
            while True:
                batch = pipeline.pop()
                self._held = batch
                x = to_tensors(batch)  # on the GPU already when the pipeline runs there; a dict for fields
                if self.device is not None and any(t.device != self.device for t in _tensors(x)):
                    x = _to(x, self.device)  # a copy: the slot can go back at once
                    self._release()
                yield (batch.samples, x) if self.with_samples else x
                self._release()  # the step that used x is over
        finally:
            self._release()

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def state_dict(self) -> dict[str, Any]:
        """The source position after the batches yielded so far (not counting those read ahead)."""
        if self._pipeline is None:
            return self.source.state_dict()
        states = self._pipeline.state_dict()["sources"]
        return states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, on any world size); before iterating."""
        if self._pipeline is not None:
            raise InvalidArgument("load_state_dict must come before iterating CropBatches")
        self.source.load_state_dict(state)

    def stats(self) -> Stats | None:
        """The pipeline's counters and stage times (None before the first iteration)."""
        return self._pipeline.stats() if self._pipeline is not None else None

    def close(self) -> None:
        """Stop the pipeline's threads (idempotent)."""
        self._closed = True
        self._release()
        if self._pipeline is not None:
            self._pipeline.close()

    def __enter__(self) -> "CropBatches":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tensors(x: torch.Tensor | dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return list(x.values()) if isinstance(x, dict) else [x]


def _to(x: torch.Tensor | dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """``x`` (a batch's tensor, or a dict of the fields' tensors) copied to ``device``."""
    if isinstance(x, dict):
        return {k: v.to(device, non_blocking=False) for k, v in x.items()}
    return x.to(device, non_blocking=False)
