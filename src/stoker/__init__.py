"""stoker keeps GPUs fed from Zarr.

>>> import stoker
>>> arr = stoker.open_array("/data/volume.zarr")
>>> crop = arr.read([(0, 32), (0, 128), (0, 128)])
"""

from .reader.array import ArrayReader, open_array
from .config import Config
from .engine.batch import Batch, BatchInfo
from .engine.batch import FieldBatch
from .engine.pipeline.facade import Pipeline
from .engine.stats import Metric, Stats
from .sampling.field import Field
from .sampling.mask import Mask
from .sampling.sample import Sample
from .sampling.samplers import RandomCrops, RankShare, SampleList, SampleSource, TileGrid
from .train.dataset import CropDataset
from .inference.writer import TileWriter
from . import transforms
from .dist.collectives import rank_info
from .dist.reduce import reduce_max
from .engine.reduce import reduce_stats
from .arraystats import compute_stats
from .dist.telemetry import TelemetryWriter, memory_report
from .device.prefetch import DevicePrefetcher
from .device.pin import Pinnable, pin_object
from .errors import (BatchReleased, BudgetExceeded, CheckpointError, ClaimTimeout, DecodeError, DeviceError, DtypeMismatch,
                     ForkedPipeline, IncompleteSource, InternalError, InvalidArgument,
                     MetadataError, MissingDependency, NonFiniteData, NonFiniteLoss, NotFound, NotYetSupported, OutOfBounds, OutOfMemory, PoolStarved,
                     RankFailed, RankMismatch, ShutdownError, StokerError, StorageError, ThreadStartError,
                     UnsupportedFormat, UnusedParameters)

__version__ = "0.1.0"

__all__ = [
    "ArrayReader",
    "Batch",
    "DevicePrefetcher",
    "Pinnable",
    "BatchInfo",
    "Config",
    "CropDataset",
    "Field",
    "FieldBatch",
    "Mask",
    "Metric",
    "Pipeline",
    "RandomCrops",
    "Sample",
    "SampleList",
    "SampleSource",
    "RankShare",
    "TelemetryWriter",
    "TileGrid",
    "TileWriter",
    "compute_stats",
    "memory_report",
    "pin_object",
    "rank_info",
    "reduce_max",
    "reduce_stats",
    "Stats",
    "open_array",
    "transforms",
    "BatchReleased",
    "BudgetExceeded",
    "CheckpointError",
    "ClaimTimeout",
    "DecodeError",
    "DeviceError",
    "DtypeMismatch",
    "IncompleteSource",
    "ForkedPipeline",
    "InternalError",
    "InvalidArgument",
    "MetadataError",
    "MissingDependency",
    "NonFiniteData",
    "NonFiniteLoss",
    "NotFound",
    "NotYetSupported",
    "OutOfBounds",
    "OutOfMemory",
    "PoolStarved",
    "RankFailed",
    "RankMismatch",
    "ShutdownError",
    "StokerError",
    "StorageError",
    "ThreadStartError",
    "UnsupportedFormat",
    "UnusedParameters",
    "__version__",
]

