"""stoker keeps GPUs fed from Zarr.

>>> import stoker
>>> arr = stoker.open_array("/data/volume.zarr")
>>> crop = arr.read([(0, 32), (0, 128), (0, 128)])
"""

from . import _moved
from .reader.array import ArrayReader, open_array
from .config import Config
from .engine.batch import Batch, BatchInfo
from .engine.pipeline import Pipeline
from .engine.stats import Metric, Stats
from .sampling.sample import Sample
from .sampling.samplers import RandomCrops, RankShare, SampleList, SampleSource, TileGrid
from .train.dataset import CropDataset
from . import transforms
from .dist.collectives import rank_info
from .dist.reduce import reduce_max
from .engine.reduce import reduce_stats
from .dist.telemetry import TelemetryWriter, memory_report
from .device.prefetch import DevicePrefetcher
from .device.pin import Pinnable, pin_object
from .errors import (BudgetExceeded, CheckpointError, ClaimTimeout, DecodeError, DeviceError, DtypeMismatch,
                     ForkedPipeline, InvalidArgument,
                     MetadataError, NonFiniteData, NonFiniteLoss, NotFound, OutOfBounds, PoolStarved, RankFailed,
                     RankMismatch, ShutdownError, StokerError, StorageError, UnsupportedFormat, UnusedParameters)

_moved.install()  # the module paths before the folders by layer, as aliases that warn

__version__ = "0.1.0"

__all__ = [
    "ArrayReader",
    "Batch",
    "DevicePrefetcher",
    "Pinnable",
    "BatchInfo",
    "Config",
    "CropDataset",
    "Metric",
    "Pipeline",
    "RandomCrops",
    "Sample",
    "SampleList",
    "SampleSource",
    "RankShare",
    "TelemetryWriter",
    "TileGrid",
    "memory_report",
    "pin_object",
    "rank_info",
    "reduce_max",
    "reduce_stats",
    "Stats",
    "open_array",
    "transforms",
    "BudgetExceeded",
    "CheckpointError",
    "ClaimTimeout",
    "DecodeError",
    "DeviceError",
    "DtypeMismatch",
    "ForkedPipeline",
    "InvalidArgument",
    "MetadataError",
    "NonFiniteData",
    "NonFiniteLoss",
    "NotFound",
    "OutOfBounds",
    "PoolStarved",
    "RankFailed",
    "RankMismatch",
    "ShutdownError",
    "StokerError",
    "StorageError",
    "UnsupportedFormat",
    "UnusedParameters",
    "__version__",
]


def __getattr__(name: str) -> object:
    if name == "ShardedSource":  # the name before RankShare (a rank's share, not a Zarr shard)
        import warnings

        warnings.warn("stoker.ShardedSource is deprecated; use stoker.RankShare", DeprecationWarning, stacklevel=2)
        return RankShare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
