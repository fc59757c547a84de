"""Collating record samples (dicts of tensors of varying length) into one batch.

    >>> Concat()([{"x": torch.zeros(2, 3)}, {"x": torch.ones(4, 3)}])
    {'x': tensor (6, 3), 'x_batch': tensor([0, 0, 1, 1, 1, 1])}
    >>> Pad()([{"x": torch.zeros(2, 3)}, {"x": torch.ones(4, 3)}])
    {'x': tensor (2, 4, 3), 'x_lengths': tensor([2, 4])}
    >>> Concat(increment={"knn": "points"})     # per-record indices into "points" become batch indices

``Concat`` is the layout graph libraries use (PyG's ``batch`` vector); ``Pad`` the
one sequence models use. Every sample must have the same fields; a field must
agree in dtype and in every dim but the first across the batch. A 0-d field is
treated as shape ``(1,)``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from ..errors import DtypeMismatch, InvalidArgument, RankMismatch

Batch = dict[str, torch.Tensor]
CollateArg = Union[str, Callable[[list], Any]]


def _fields(samples: Sequence[Mapping[str, Any]], suffix: str) -> dict[str, list[torch.Tensor]]:
    """Per field, the samples' tensors (at least 1-d), after checking keys, dtypes and trailing dims."""
    if not samples:
        raise InvalidArgument("cannot collate an empty batch")
    for j, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise InvalidArgument(f"sample {j} of the batch is a {type(s).__name__}, expected a dict of tensors; "
                                  "pass collate=<your function> for other samples")
    keys = list(samples[0])
    out: dict[str, list[torch.Tensor]] = {}
    for j, s in enumerate(samples):
        if set(s) != set(keys):
            raise InvalidArgument(f"sample {j} of the batch has fields {sorted(s)}, sample 0 has {sorted(keys)}")
    for key in keys:
        if f"{key}{suffix}" in keys:
            raise InvalidArgument(f"fields {key!r} and {key + suffix!r} collide: the batch adds {key + suffix!r}",
                                  field=key)
        ts = []
        for j, s in enumerate(samples):
            t = s[key]
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"field {key!r} of sample {j} is a {type(t).__name__}, not a tensor; pass "
                                      "collate=<your function of the list of samples> to batch other values",
                                      field=key)
            ts.append(t.reshape(1) if t.ndim == 0 else t)
        first = ts[0]
        for j, t in enumerate(ts):
            if t.dtype != first.dtype:
                raise DtypeMismatch(f"field {key!r}: sample {j} is {t.dtype}, sample 0 is {first.dtype}; cast it "
                                    "in the dataset, or pass collate=<your function of the list of samples>",
                                    field=key)
            if t.shape[1:] != first.shape[1:]:
                raise RankMismatch(
                    f"field {key!r}: sample {j} has shape {tuple(t.shape)}, sample 0 {tuple(first.shape)}; only "
                    "the first dim may differ (collate='concat' and 'pad' join along it): pass "
                    "collate=<your function of the list of samples> for other shapes", field=key,
                    shape=tuple(t.shape))
        out[key] = ts
    return out


class Concat:
    """Concatenate each field along dim 0 and add ``{field}_batch``: the sample each row came from.

    ``increment`` maps an index field to the field it indexes: its values are
    shifted by the rows of that field in the samples before it (k-NN tables,
    edge lists and cells stay valid in the concatenated batch).
    """

    def __init__(self, increment: Mapping[str, str] | None = None) -> None:
        self.increment = dict(increment or {})
        for key, target in self.increment.items():
            if not isinstance(key, str) or not isinstance(target, str):
                raise InvalidArgument(f"increment maps field names to field names, got {key!r}: {target!r}")

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        fields = _fields(samples, "_batch")
        for key, target in self.increment.items():
            if key not in fields or target not in fields:
                raise InvalidArgument(f"increment {key!r} -> {target!r}: the samples have fields {sorted(fields)}",
                                      field=key)
            if fields[key][0].is_floating_point() or fields[key][0].dtype == torch.bool:
                raise DtypeMismatch(f"increment {key!r}: index fields must be integers, got {fields[key][0].dtype}",
                                    field=key)
        out: Batch = {}
        for key, ts in fields.items():
            if key in self.increment:
                rows = [t.shape[0] for t in fields[self.increment[key]]]
                offsets = np.cumsum([0] + rows[:-1]).tolist()
                ts = [t + off for t, off in zip(ts, offsets)]
            out[key] = torch.cat(ts, dim=0)
            sizes = torch.tensor([t.shape[0] for t in ts], dtype=torch.long)
            out[f"{key}_batch"] = torch.repeat_interleave(torch.arange(len(ts)), sizes)
        return out

    def __repr__(self) -> str:
        return f"Concat(increment={self.increment})" if self.increment else "Concat()"


class Pad:
    """Pad each field along dim 0 to the batch's longest (with ``value``) and stack: ``(B, L, ...)``,
    plus ``{field}_lengths`` (LongTensor ``(B,)``)."""

    def __init__(self, value: float | int | bool = 0) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"pad value must be a number, got {value!r}")
        self.value = value

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> Batch:
        out: Batch = {}
        for key, ts in _fields(samples, "_lengths").items():
            lengths = [t.shape[0] for t in ts]
            first = ts[0]
            stacked = torch.full((len(ts), max(lengths), *first.shape[1:]), self.value, dtype=first.dtype,
                                 device=first.device)
            for j, t in enumerate(ts):
                stacked[j, : t.shape[0]] = t
            out[key] = stacked
            out[f"{key}_lengths"] = torch.tensor(lengths, dtype=torch.long)
        return out

    def __repr__(self) -> str:
        return f"Pad(value={self.value!r})"


def resolve(collate: CollateArg) -> Callable[[list], Any]:
    """``"concat"``, ``"pad"`` or a callable taking the list of samples."""
    if isinstance(collate, str) and collate == "concat":
        return Concat()
    if isinstance(collate, str) and collate == "pad":
        return Pad()
    if callable(collate):
        return collate
    raise InvalidArgument(f"collate must be 'concat', 'pad' or a function of the list of samples, got {collate!r}")


__all__ = ["Concat", "Pad", "resolve"]
