"""Normalisation statistics of Zarr arrays, and ``stoker.compute_stats``: arrays or record datasets.

    >>> stats = stoker.compute_stats({"raw": ["/d/c0.zarr", "/d/c1.zarr"], "t2m": "/d/t2m.zarr"},
    ...                              region={0: (0, 365)})          # collective under torch.distributed; cached
    >>> stats["raw"].mean.shape, stats["t2m"].std.shape
    (torch.Size([2]), torch.Size([]))
    >>> norm = stoker.transforms.Normalize.from_stats(stats["raw"])
    >>> stoker.compute_stats(records_ds, ["positions"])             # a ZarrRecords: the records' statistics

Modules: :mod:`~stoker.arraystats.inputs` (what is asked for), :mod:`~stoker.arraystats.compute` (the pass,
over ranks), :mod:`~stoker.arraystats.ordered` (reads on threads, in order),
:mod:`~stoker.arraystats.identity` (the cache key and folder).
"""

from __future__ import annotations

from typing import Any

from ..records.dataset import ZarrRecords
from ..records.stats import compute_stats as compute_record_stats
from .compute import compute_array_stats


def compute_stats(data: Any, *args: Any, **kwargs: Any) -> Any:
    """Statistics of ``data``: a :class:`~stoker.records.ZarrRecords` (or one of its rank parts) goes to
    :func:`stoker.records.compute_stats` (``compute_stats(ds, fields, ...)``, unchanged); anything else
    (an array URI, a list of them, lists of them as channels, a dict of fields) to
    :func:`~stoker.arraystats.compute.compute_array_stats` (``compute_stats(arrays_or_fields, region=None,
    channel_axis=None, nonfinite="skip", group=None, cache=True, ...)``). Both are collective under
    torch.distributed and cache their results beside the data.

    >>> st = stoker.compute_stats("/data/volume.zarr")               # FieldStats: count, mean, std, min, max
    >>> st = stoker.compute_stats([["/d/c0.zarr", "/d/c1.zarr"]])[0]   # per channel: shape (2,)
    """
    if isinstance(data, ZarrRecords):
        return compute_record_stats(data, *args, **kwargs)
    return compute_array_stats(data, *args, **kwargs)


__all__ = ["compute_array_stats", "compute_stats"]
