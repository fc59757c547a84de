"""Record datasets: one Zarr group per sample, read lazily, with normalisation statistics.

    >>> from stoker.records import ZarrRecords, compute_stats, normalize
    >>> ds = ZarrRecords("/data/crash", fields={"positions": ("T", "N", 3), "cells": ("M", 3)})
    >>> stats = compute_stats(ds, ["positions"])     # collective under torch.distributed; cached on disk
    >>> loader = torch.utils.data.DataLoader(ds.for_rank(rank, world_size), batch_size=None, num_workers=4)
    >>> for sample in loader:
    ...     x = normalize(sample, stats)
    >>> precompute(ds, "knn16", lambda s: knn_graph(s["positions"][0], 16), params={"k": 16},
    ...            normalized_with=stats)           # the graph of what the model sees
    >>> ds = ZarrRecords("/data/crash", fields={"positions": ("T", "N", 3), "knn16": ("N", 16)})
    >>> for batch in Loader(ds, batch_size=8, collate=Concat(increment={"knn16": "N"}),
    ...                     transform=lambda s: normalize(s, stats)):
    ...     ...                                      # positions (T, sum N, 3), batch (sum N,); resumable

Modules: :mod:`~stoker.records.catalog` (metadata scan and checks),
:mod:`~stoker.records.dataset` (``ZarrRecords``), :mod:`~stoker.records.moments`
(streaming moments), :mod:`~stoker.records.stats` (``compute_stats``),
:mod:`~stoker.records.sidecar` (the statistics file), :mod:`~stoker.records.precomputed`
(per-record arrays stored once), :mod:`~stoker.records.knn` (``knn_graph``),
:mod:`~stoker.records.loader` (``Loader``), :mod:`~stoker.records.collate` (batching).
"""

from .catalog import Catalog, scan
from .collate import Concat, Pad, RecordBatch
from .dataset import CacheInfo, FieldInfo, SampleInfo, ZarrRecords
from .knn import TREE_MIN_POINTS, knn_edge_index, knn_graph
from .loader import Loader, LoaderTimeout
from .moments import Moments
from .precomputed import PrecomputeResult, precompute
from .stats import FieldStats, compute_stats, denormalize, normalize, stats_fingerprint

__all__ = [
    "TREE_MIN_POINTS",
    "CacheInfo",
    "Catalog",
    "Concat",
    "FieldInfo",
    "FieldStats",
    "Loader",
    "LoaderTimeout",
    "Moments",
    "Pad",
    "PrecomputeResult",
    "RecordBatch",
    "SampleInfo",
    "ZarrRecords",
    "compute_stats",
    "denormalize",
    "knn_edge_index",
    "knn_graph",
    "normalize",
    "precompute",
    "scan",
    "stats_fingerprint",
]
