"""``Batch``: what ``Pipeline.pop()`` returns; a DLPack exporter that gives its slot back on release.

>>> with pipeline.pop() as batch:
...     x = torch.from_dlpack(batch)        # zero-copy view, (rows, *sample_shape)
...     batch.samples[0], batch.info.shape
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..sample import Sample


@dataclass(frozen=True)
class BatchInfo:
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ready_stream: Any  # the CUDA stream that produced the batch; None on CPU
    batch_id: int


class Batch:
    """One batch of crops. Export it with ``torch.from_dlpack(batch)`` (or ``numpy.from_dlpack``).

    The slot behind it is reused only after :meth:`release` (or leaving the
    ``with`` block) **and** once no tensor viewing it is alive, so holding
    ``x = torch.from_dlpack(batch)`` past release is safe; it just keeps the slot.
    Call ``x.clone()`` to keep data without holding a slot.
    """

    def __init__(self, view: torch.Tensor, samples: tuple[Sample, ...], batch_id: int,
                 on_release: Callable[[], None]) -> None:
        self._view: torch.Tensor | None = view
        self.samples = samples
        self.info = BatchInfo(
            data_ptr=view.data_ptr(), shape=tuple(view.shape), dtype=view.dtype, device=view.device,
            ready_stream=None, batch_id=batch_id,
        )
        self._on_release: Callable[[], None] | None = on_release

    def _tensor(self) -> torch.Tensor:
        if self._view is None:
            raise RuntimeError(f"batch {self.info.batch_id} was released; export it before release()")
        return self._view

    def __dlpack__(self, *args: Any, **kwargs: Any):
        return self._tensor().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._tensor().__dlpack_device__()

    def release(self) -> None:
        """Give the slot back (idempotent). Views obtained earlier stay valid."""
        callback, self._on_release = self._on_release, None
        self._view = None
        if callback is not None:
            callback()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __len__(self) -> int:
        return self.info.shape[0]

    def __repr__(self) -> str:
        return f"Batch(id={self.info.batch_id}, shape={self.info.shape}, dtype={self.info.dtype})"
