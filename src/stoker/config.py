"""``Config``: every knob of a pipeline, validated in one place.

>>> cfg = stoker.Config(batch_size=8, dtype="bf16", host_buffer_bytes=1 << 30)
>>> stoker.Config(batch_size=0)
Traceback (most recent call last):
stoker.errors.InvalidArgument: Config.batch_size must be an integer >= 1, got 0
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .checks import integer, integers, seconds
from .errors import InvalidArgument
from .storage.diskcache import CacheSettings, cache_settings
from .storage.locate import check_options_by_prefix

#: Output dtypes by name; "native" keeps the source dtype. "i32" and "i64" take integer and bool sources
#: and keep every value exactly (engine/cast.py has the rules).
OUTPUT_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32,
                 "i64": torch.int64, "native": None}

#: Where chunks may be decompressed (Config.decode_on).
DECODE_ON = ("auto", "cpu", "gpu", "hybrid")


_INTEGER_KNOBS = {"batch_size": 1, "host_buffer_bytes": 1 << 20, "device_buffer_bytes": 1 << 20, "n_io_threads": 1,
                  "n_compute_threads": 1, "lookahead_batches": 1, "requests_in_flight": 1,
                  "prefetch_bytes": 0, "prefetch_requests": 1}  # knob -> least value


def least_value(knob: str) -> int:
    """The least value Config takes for the integer knob ``knob``, from its one table of limits: what a command
    line flag that becomes the knob checks at parse time (``stoker bench --host-buffer-bytes``), so the two
    never disagree.

    >>> least_value("host_buffer_bytes")
    1048576
    """
    return _INTEGER_KNOBS[knob]


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, numactl, cpusets), or every CPU
    where the platform has no masks (macOS, Windows). CPU quotas (Docker's ``--cpus``) do not show."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_compute_threads() -> int:
    """This rank's share of the CPUs: the ones the process may run on (its affinity mask, which taskset,
    numactl and cpusets set; CPU quotas such as Docker's ``--cpus`` do not show in it), divided among the
    ranks of the node (torchrun's ``LOCAL_WORLD_SIZE``). Eight ranks of a 64-core node get 8 threads each,
    not 64: more threads than cores cost throughput (numbers in docs/performance.md, "Tuning constants"). A mask no larger than a rank's share of the machine is taken as this rank's own
    binding (``srun --cpu-bind``, numactl per rank) and is not divided again. Pass ``n_compute_threads``
    where neither guess fits.

    >>> default_compute_threads()  # the usable CPUs, on a machine with one rank  # doctest: +SKIP
    """
    cpus = usable_cpus()
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:  # a hint only: malformed means one rank
        ranks = 1
    machine = os.cpu_count() or cpus
    if cpus * ranks <= machine:  # already this rank's own share (per-rank binding)
        return cpus
    return max(1, cpus // ranks)


@dataclass(frozen=True)
class Config:
    """Settings of one :class:`~stoker.Pipeline` (one per rank).

    Fields and their allowed values:

    - ``batch_size`` (>= 1): samples per batch.
    - ``sample_shape``: shape every sample must have (``(C, *box)`` for samples of ``C`` arrays); ``None``
      takes the first sample's.
    - ``dtype``: ``"f32" | "bf16" | "f16" | "i32" | "i64" | "native"`` (the source dtype), or ``torch.float32``,
      ``torch.bfloat16``, ``torch.float16``, ``torch.int32``, ``torch.int64`` (stored as their names); for every field of samples of named fields alike, or per field as a
      dict ``{"raw": "bf16", "labels": "i64"}`` (samples of fields only; its names must be the samples'
      field names, checked at the first batch; see :meth:`field_dtype`).
      ``"i32"``/``"i64"`` take integer and bool sources and keep every value: one that does not fit is a
      ``DtypeMismatch`` naming the array and chunk (float sources are refused). 32- and 64-bit integer
      sources into ``"f32"``/``"bf16"``/``"f16"`` are refused when the first batch settles its dtype, before
      any read (label ids would merge) unless ``lossy_casts``; 8- and 16-bit integers (images) are allowed,
      but for the 16-bit ids of an OME-Zarr label image's levels into ``"bf16"`` or ``"f16"``.
    - ``lossy_casts`` (bool, default False): allow 32- and 64-bit integer sources into float outputs, rounded.
    - ``host_buffer_bytes`` (>= 1 MiB): hard cap on host buffers (batch slots, or the pinned staging
      slots on CUDA, plus read and decode buffers).
    - ``device_buffer_bytes`` (>= 1 MiB): cap on device memory: ``lookahead_batches + 1`` batch slots
      plus staging for the cast on the device (CUDA path only), or with ``decode_on="gpu"`` or ``"hybrid"``
      plus the decode scratch (``"hybrid"`` gives a quarter of ``host_buffer_bytes`` to the GPU decode's
      staging, the rest to the CPU part's pinned slots and scratch).
    - ``n_io_threads`` (>= 1): threads for reads that must wait for buffer memory; local reads
      otherwise run on the compute threads (a page-cache copy costs less than a thread hop). Sixteen times
      as many threads at most open arrays in stores, and read shard indexes ahead (each waits a round trip).
    - ``n_compute_threads``: decode and assembly threads (>= 1); ``None`` means this rank's share of the
      CPUs the process may run on (see :func:`default_compute_threads`). A pipeline of samples of named
      fields runs one compiled engine of this many threads for all its fields.
    - ``device``: ``None | int | "cpu" | "cuda" | "cuda:N"``, or a ``torch.device`` of those (stored as
      the string, so a rank's ``ctx.device`` can be passed as is). ``None`` takes torch's current CUDA
      device when CUDA is available, else the CPU; a GPU must be torch's current device
      (``torch.cuda.set_device(local_rank)`` first), checked at ``Pipeline(cfg)``.
    - ``lookahead_batches`` (>= 1): batches prepared ahead of the consumer. The pipeline holds
      ``lookahead_batches + 1`` batch slots: a slot the consumer gives back is filled again at once, so up
      to ``lookahead_batches + 1`` batches are made ahead between a ``release`` and the next ``pop``, and
      the next batch is planned while they are.
    - ``pop_timeout_s`` (> 0 or ``None``): ``PoolStarved`` after this long without a batch.
    - ``drop_last``: drop a final short batch (default) or emit it. A :class:`~stoker.TileGrid`'s last batch
      is always emitted (its epoch is never cut short: every tile is inferred).
    - ``storage_options``: ``None`` or ``{URI prefix: options}`` for remote arrays (``s3://``, ``gs://``,
      ``az://``, ``http(s)://``): each array takes the options of the longest prefix of its URI
      (credentials, endpoint, region, ``skip_signature``, and stoker's ``timeout_s``, ``retries``...;
      see docs/remote.md). Credentials in the standard environment (``AWS_*``...) need none. A prefix
      ends at a ``/`` of the URI or at its end (``s3://data`` is no prefix of ``s3://data-public/x``).
      Left out of the Config's repr (it may hold secrets).
    - ``requests_in_flight`` (>= 1): the most requests to remote stores the pipeline has open at once
      (a batch's chunks are fetched together; independent of the thread counts). The default, 512, lets a
      store 100 ms away answer 5,120 requests a second (a batch of 64 chunk files: 80 batches a second).
      Each request holds a socket: where the open-file limit (``ulimit -n``) cannot hold twice as many, the
      soft limit is raised toward it, or the requests are capped to fit, with a warning.
    - ``prefetch_bytes`` (>= 0) and ``prefetch_requests`` (>= 1): remote chunks and shard ranges of the batches
      after those in their slots are fetched ahead while the current ones are made, into a buffer in host
      memory of at most ``prefetch_bytes`` (on top of ``host_buffer_bytes``; 0: no prefetch; default 256
      MiB), with at most ``prefetch_requests`` of its values and ranges asked at once (default 384; never
      more than three quarters of ``requests_in_flight``, so the batches being made keep a quarter). The
      pipeline plans batches ahead while the buffer has room, so a batch waits for the network only when it is
      slower than the decode. Local arrays never prefetch. See docs/remote.md, "Prefetch".
    - ``cache_dir``, ``cache_bytes``, ``cache_staleness_s``: a local disk cache of the chunks and shard
      ranges read from remote stores, shared by every rank and process that names the same folder
      (``cache_dir``; ``None``: ``$STOKER_CACHE_DIR``, else no cache), at most ``cache_bytes`` (>= 0, 0: no
      cache; ``None``: 10 GiB), each object's generation (ETag) revalidated when the pipeline starts and at
      most every ``cache_staleness_s`` seconds after (``None``: 60). Local arrays never use it; per-prefix
      ``storage_options`` may set the same keys. See docs/remote.md, "Local cache".
    - ``decode_on``: ``"auto" | "cpu" | "gpu" | "hybrid"``, where chunks are decompressed. ``"gpu"``: chunks
      cross to the GPU encoded, and NVIDIA nvCOMP decodes them there (zstd chunks, blosc frames of lz4 or
      zstd; other chunks are decoded on the CPU, with a one-time warning naming the array); it needs a
      CUDA ``device`` and nvCOMP (``pip install 'stoker[gpu]'``), else ``InvalidArgument`` at
      ``Pipeline(cfg)``. ``"hybrid"``: both at once, with the same needs: each batch's chunks are shared
      between the CPU threads (decoded, cast and placed into a pinned host batch, which crosses as on the
      CPU-decode path) and the GPU decode (chunks cross encoded and are placed over the host part on the
      device), in shares from the two sides' measured rates so both finish together; chunks the GPU does
      not decode go to the CPU threads (its device side has not yet run on a GPU: docs/architecture.md,
      "Decoding on both"). ``"cpu"`` decodes on the CPU. ``"auto"``: ``"gpu"`` on a CUDA ``device`` with
      nvCOMP installed and at most 2 ``compute_threads``, else the CPU (``"hybrid"`` is asked for by name
      until it has been measured on a GPU). See docs/architecture.md, "Decoding on the GPU".
    - ``transform``: ``None``, a callable ``batch -> batch`` or a list of them (run in order), applied to
      every batch on its device after the cast, before the consumer sees it; built-ins in
      :mod:`stoker.transforms` (``Normalize``, ``FillNaN``). See that module for where it runs and what it costs.
      For samples of named fields it runs once per batch on the dict ``{name: tensor}``, on the consumer's
      thread in ``pop`` (docs/dataloader.md, "Samples of named fields").
    - ``cf`` (default True): arrays with CF attributes (``scale_factor``, ``add_offset``, ``_FillValue``,
      ``missing_value``: what xarray writes for packed or masked variables) are decoded as xarray decodes
      them, fills to NaN, in the batch's float dtype before the transform (:mod:`stoker.engine.cpu.cf`);
      such an array read into an integer batch (``dtype='native'``) is a ``DtypeMismatch``. ``False``:
      the stored values, as they are.
    """

    batch_size: int = 8
    sample_shape: tuple[int, ...] | None = None
    dtype: str | torch.dtype = "f32"
    host_buffer_bytes: int = 1 << 30
    device_buffer_bytes: int = 1 << 30
    n_io_threads: int = 4
    n_compute_threads: int | None = None
    device: int | str | torch.device | None = None
    lookahead_batches: int = 2
    pop_timeout_s: float | None = 30.0
    drop_last: bool = True
    decode_on: str = "auto"
    transform: Any = None
    storage_options: dict | None = field(default=None, repr=False)  # may hold secrets: never printed
    requests_in_flight: int = 512
    prefetch_bytes: int = 256 << 20
    prefetch_requests: int = 384
    cache_dir: str | os.PathLike | None = None
    cache_bytes: int | None = None
    cache_staleness_s: float | None = None
    cf: bool = True
    lossy_casts: bool = False

    def __post_init__(self) -> None:
        for name, low in _INTEGER_KNOBS.items():  # numpy integers are stored as ints
            value = integer(f"Config.{name}", getattr(self, name), low, optional=name == "n_compute_threads", knob=name)
            object.__setattr__(self, name, value)
        if self.sample_shape is not None:
            shape = integers("Config.sample_shape", self.sample_shape, 1, knob="sample_shape")  # 2.5 is no 2
            if not shape:
                raise InvalidArgument(
                    f"Config.sample_shape must be non-empty with every extent >= 1, got {self.sample_shape!r}",
                    knob="sample_shape",
                )
            object.__setattr__(self, "sample_shape", shape)
        if isinstance(self.dtype, Mapping):  # per field: each value checked and stored by its name
            object.__setattr__(self, "dtype", field_dtypes(self.dtype))
        elif isinstance(self.dtype, torch.dtype):  # torch.float32 and friends: stored by their name here
            names = {d: n for n, d in OUTPUT_DTYPES.items() if d is not None}
            if self.dtype not in names:
                raise InvalidArgument(
                    f"Config.dtype {self.dtype} is not an output dtype; use torch.float32, torch.bfloat16, "
                    "torch.float16, torch.int32, torch.int64, or 'native' for the source dtype", knob="dtype")
            object.__setattr__(self, "dtype", names[self.dtype])
        if not isinstance(self.dtype, dict) and self.dtype not in OUTPUT_DTYPES:
            raise InvalidArgument(
                f"Config.dtype must be one of {', '.join(map(repr, OUTPUT_DTYPES))}, got {self.dtype!r}",
                knob="dtype",
            )
        object.__setattr__(self, "pop_timeout_s",
                           seconds("Config.pop_timeout_s", self.pop_timeout_s, optional=True, knob="pop_timeout_s"))
        if not isinstance(self.cf, bool):
            raise InvalidArgument(f"Config.cf must be True (decode CF attributes, as xarray) or False (the stored "
                                  f"values), got {self.cf!r}", knob="cf")
        if not isinstance(self.drop_last, bool):
            raise InvalidArgument(f"Config.drop_last must be True or False, got {self.drop_last!r}", knob="drop_last")
        if not isinstance(self.lossy_casts, bool):
            raise InvalidArgument(f"Config.lossy_casts must be True or False, got {self.lossy_casts!r}",
                                  knob="lossy_casts")
        self._check_device()
        self._check_decode_on()
        from .transforms import as_transform  # imports torch only; here to keep config's imports light

        object.__setattr__(self, "transform", as_transform(self.transform))
        object.__setattr__(self, "storage_options",
                           check_options_by_prefix(self.storage_options, "Config.storage_options"))
        cache_settings(self.cache_dir, self.cache_bytes, self.cache_staleness_s)  # checked here, used by `cache`

    @property
    def cache(self) -> CacheSettings:
        """The disk cache of remote chunks these knobs (and ``$STOKER_CACHE_DIR``) ask for."""
        return cache_settings(self.cache_dir, self.cache_bytes, self.cache_staleness_s)

    def _check_device(self) -> None:
        d = self.device
        if isinstance(d, torch.device) and d.type in ("cpu", "cuda"):  # e.g. a rank's ctx.device
            d = "cpu" if d.type == "cpu" else ("cuda" if d.index is None else f"cuda:{d.index}")
            object.__setattr__(self, "device", d)
        if d is None or d == "cpu" or d == "cuda":
            return
        if isinstance(d, int) and not isinstance(d, bool) and d >= 0:
            return
        if isinstance(d, str) and d.startswith("cuda:") and d[5:].isdigit():
            return
        raise InvalidArgument(
            f"Config.device must be None, a GPU index >= 0, 'cpu', 'cuda' or 'cuda:N' (or a torch.device of "
            f"those), got {d!r}", knob="device"
        )

    def _check_decode_on(self) -> None:
        if self.decode_on not in DECODE_ON:
            raise InvalidArgument(f"Config.decode_on must be one of {', '.join(map(repr, DECODE_ON))}, got "
                                  f"{self.decode_on!r}", knob="decode_on")

    @property
    def compute_threads(self) -> int:
        """``n_compute_threads`` with ``None`` resolved by :func:`default_compute_threads`."""
        return self.n_compute_threads or default_compute_threads()

    @property
    def output_dtype(self) -> torch.dtype | None:
        """The torch dtype of batches, or ``None`` for "native" (decided by the source). InvalidArgument for a
        per-field ``dtype`` (a dict), which only samples of named fields take (see :meth:`field_dtype`)."""
        if isinstance(self.dtype, dict):
            raise InvalidArgument(
                f"Config.dtype={self.dtype!r} gives a dtype per field, and this pipeline's samples are of one box "
                "(no named fields): give one dtype (dtype='f32'), or push samples of named fields "
                "(stoker.Sample({name: (uri, box)}))", knob="dtype")
        return OUTPUT_DTYPES[cast(str, self.dtype)]  # __post_init__ turned a torch.dtype into its name

    def field_dtype(self, name: str, names: tuple[str, ...] | None = None) -> str:
        """The output dtype's name for field ``name`` of samples of named fields: ``dtype`` itself, or its
        entry for ``name`` when it is a dict. With ``names`` (the samples' fields), a dict must name exactly
        them: InvalidArgument naming a field it lacks or one the samples do not have.

        >>> Config(dtype={"raw": "bf16", "labels": "native"}).field_dtype("labels")
        'native'
        """
        if not isinstance(self.dtype, dict):
            return cast(str, self.dtype)
        given = self.dtype
        if names is not None:
            unknown = [n for n in given if n not in names]
            if unknown:
                raise InvalidArgument(f"Config.dtype names field(s) {unknown} that the samples do not have (their "
                                      f"fields: {list(names)}); fix the name or drop it", knob="dtype")
        if name not in given:
            raise InvalidArgument(f"Config.dtype={given!r} gives no dtype for field {name!r} of the samples; add "
                                  f"{name!r}: 'f32' (or the dtype it needs)", knob="dtype")
        return given[name]


def field_dtypes(given: Mapping) -> dict[str, str]:
    """A per-field ``Config.dtype``: field name -> output dtype name, each value checked as ``dtype`` is
    (a torch dtype stored as its name).

    >>> field_dtypes({"raw": torch.bfloat16, "labels": "native"})
    {'raw': 'bf16', 'labels': 'native'}
    """
    if not given:
        raise InvalidArgument("Config.dtype as a dict needs at least one field: {name: dtype}", knob="dtype")
    names = {d: n for n, d in OUTPUT_DTYPES.items() if d is not None}
    out = {}
    for name, value in given.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"Config.dtype's keys are field names (non-empty strings), got {name!r}",
                                  knob="dtype")
        if isinstance(value, torch.dtype) and value in names:
            value = names[value]
        if not isinstance(value, str) or value not in OUTPUT_DTYPES:
            raise InvalidArgument(f"Config.dtype[{name!r}] must be one of {', '.join(map(repr, OUTPUT_DTYPES))} "
                                  f"(or their torch dtypes), got {value!r}", knob="dtype")
        out[name] = value
    return out
