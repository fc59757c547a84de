"""Deprecated: the rank partition is :mod:`stoker.partition` ("shard" is kept for Zarr shards).

Every name still resolves to the one in :mod:`stoker.partition`, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import partition


def __getattr__(name: str) -> Any:
    value = getattr(partition, name)  # AttributeError for names partition lacks too
    warnings.warn(f"stoker.shard is deprecated; use stoker.partition.{name}", DeprecationWarning, stacklevel=2)
    return value
