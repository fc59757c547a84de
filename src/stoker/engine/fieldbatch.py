"""``FieldBatch``: what ``Pipeline.pop()`` returns for samples of named fields; a read-only mapping from field
name to that field's :class:`~stoker.Batch`.

>>> with pipeline.pop() as batch:                                   # samples {"raw": ..., "labels": ...}
...     x = {k: torch.from_dlpack(v) for k, v in batch.items()}     # (B, *raw shape), (B, *labels shape)
...     batch.rows, batch.samples[0]["labels"]

Each field's batch is a :class:`~stoker.Batch` of its own slot (a pipeline of fields has one set of slots per
field, see docs/architecture.md, "Lanes"), with ``__dlpack__``, ``info`` and ``samples`` (that field's plain
samples). ``len(batch)`` is the number of fields, as for any mapping; the number of samples is
``batch.rows`` (also ``batch.batch_size``). Releasing the FieldBatch (``release()``, or leaving ``with``)
releases every field's slot; each is reused only once no tensor views it, as for a Batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..sampling.sample import Sample
from .batch import Batch


class FieldBatch(Mapping):
    """One batch of samples of named fields: field name -> :class:`~stoker.Batch`, in the fields' order (see
    the module docstring). ``samples``: the batch's samples of fields, in order; ``rows``: how many."""

    def __init__(self, batches: dict[str, Batch], samples: tuple[Sample, ...], batch_id: int,
                 keys: np.ndarray | None = None) -> None:
        self._batches = dict(batches)
        self.samples = samples
        self.batch_id = batch_id
        #: each sample's (epoch, index), int64 (B, 2): what keyed transforms drew from (as :attr:`Batch.keys`)
        self.keys = keys if keys is not None else next(iter(self._batches.values())).keys

    def __getitem__(self, name: str) -> Batch:
        return self._batches[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._batches)

    def __len__(self) -> int:
        """The number of fields (a mapping's length); the number of samples is :attr:`rows`."""
        return len(self._batches)

    @property
    def rows(self) -> int:
        """The samples in this batch (each field's leading axis)."""
        return len(self.samples)

    batch_size = rows

    def release(self, event: Any = None) -> None:
        """Give every field's slot back (idempotent); ``event`` as for :meth:`Batch.release`. Views obtained
        earlier stay valid (each keeps its slot until it dies)."""
        for batch in self._batches.values():
            batch.release(event)

    def __enter__(self) -> "FieldBatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        inner = ", ".join(f"{name!r}: {tuple(b.info.shape)} {b.info.dtype}" for name, b in self._batches.items())
        return f"FieldBatch(id={self.batch_id}, rows={self.rows}, {{{inner}}})"


def to_tensors(batch: Batch | FieldBatch) -> torch.Tensor | dict[str, torch.Tensor]:
    """``torch.from_dlpack`` of a batch: its tensor, or for a :class:`FieldBatch` a dict of each field's.

    >>> to_tensors(pipeline.pop())     # {"raw": tensor (B, 96, 96, 96), "labels": tensor (B, 56, 56, 56)}
    """
    if isinstance(batch, FieldBatch):
        return {name: torch.from_dlpack(b) for name, b in batch.items()}
    return torch.from_dlpack(batch)
