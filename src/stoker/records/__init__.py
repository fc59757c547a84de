"""Record datasets: one Zarr group per sample, read lazily, with normalisation statistics.

    >>> from stoker.records import ZarrRecords, compute_stats, normalize
    >>> ds = ZarrRecords("/data/crash", fields={"positions": ("T", "N", 3), "cells": ("M", 3)})
    >>> stats = compute_stats(ds, ["positions"])     # collective under torch.distributed; cached on disk
    >>> loader = torch.utils.data.DataLoader(ds.shard(rank, world_size), batch_size=None, num_workers=4)
    >>> for sample in loader:
    ...     x = normalize(sample, stats)

Modules: :mod:`~stoker.records.catalog` (metadata scan and checks),
:mod:`~stoker.records.dataset` (``ZarrRecords``), :mod:`~stoker.records.moments`
(streaming moments), :mod:`~stoker.records.stats` (``compute_stats``),
:mod:`~stoker.records.sidecar` (the statistics file).
"""

from .catalog import Catalog, scan
from .dataset import CacheInfo, FieldInfo, SampleInfo, ZarrRecords
from .moments import Moments
from .stats import FieldStats, compute_stats, denormalize, normalize

__all__ = [
    "CacheInfo",
    "Catalog",
    "FieldInfo",
    "FieldStats",
    "Moments",
    "SampleInfo",
    "ZarrRecords",
    "compute_stats",
    "denormalize",
    "normalize",
    "scan",
]
