"""Lanes: a pipeline of samples of named fields makes each field's batches with an executor of its own.

Each field of a sample is a plain sample (one box of one array or several); a field's batch is a plain batch.
So the engine makes it as it makes any batch: a *lane* is one field's executor (:func:`~.choose.make_executor`
with a Config of its own: that field's output dtype, no transform, and a share of ``host_buffer_bytes`` (and on a CUDA
device of ``device_buffer_bytes``): 1 MiB, and of the rest a part proportional to its batch bytes), its slots and its
Python threads. The lanes' executors share one compiled engine (``share_engine``, where they have one): a chunk
two fields' jobs in flight both need is decoded once, and the pipeline runs ``n_compute_threads`` engine threads
in all. The coordinator plans and
submits each field's batch in its lane; a batch in flight is one :class:`Part` (job and target) per field,
ready when all are, failed when one is (the others are stopped and every slot given back). The transform of
a pipeline of fields runs on the dict of the fields' batches, on the consumer's thread at ``pop``
(:func:`transform_fields`).

>>> lanes = Lanes(cfg, make)                 # make(cfg) -> Executor
>>> lanes.setup(first_sample, {"raw": torch.float32, "labels": torch.int64})
>>> [lane.name for lane in lanes]
['raw', 'labels']
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ...config import OUTPUT_DTYPES, Config
from ...errors import BudgetExceeded, StokerError, as_value
from ...sampling.sample import Sample
from ...transforms import apply as apply_transform

if TYPE_CHECKING:
    from ..executor import Executor, Job, Target

_MIN_BUDGET = 1 << 20  # the least a Config accepts for host_buffer_bytes and device_buffer_bytes


def in_field(exc: BaseException, name: str) -> BaseException:
    """``exc`` with the field it happened in named: a StokerError is made again, of its type, with the message
    prefixed by ``field 'name': `` and ``field=name`` added to its context; another Exception gets a note.
    A KeyboardInterrupt (or any BaseException that is no Exception) is left as it is.

    >>> in_field(stoker.DecodeError("chunk c/0/0 is corrupt", uri="l.zarr"), "labels").field
    'labels'
    """
    if isinstance(exc, StokerError):
        if exc.context.get("field") == name:
            return exc
        try:
            named = type(exc)(f"field {name!r}: {exc.message}", **{**exc.context, "field": name})
        except Exception:  # noqa: BLE001 - an error type with an __init__ of its own: keep it, with a note
            named = None
        if named is not None:
            named.__cause__ = as_value(exc)
            return named
    if isinstance(exc, Exception):
        exc.add_note(f"(in field {name!r} of a batch of samples of named fields)")
    return exc


@dataclasses.dataclass
class Lane:
    """One field's executor: ``cfg`` its own Config, ``shape`` its samples' shape, ``dtype`` its batches'."""

    name: str
    executor: Executor
    cfg: Config
    shape: tuple[int, ...]
    dtype: torch.dtype


class Part:
    """One field's batch in flight: the lane's job and the target it is made in."""

    __slots__ = ("name", "executor", "job", "target")

    def __init__(self, name: str, executor: Executor, job: Job | None, target: Target) -> None:
        self.name, self.executor, self.job, self.target = name, executor, job, target


class Lanes:
    """The lanes of a pipeline (none until its first batch of fields, whose samples and dtypes size them)."""

    def __init__(self, cfg: Config, make: Callable[[Config], Executor], on_device: bool = False) -> None:
        self.cfg = cfg
        self.make = make
        # device_buffer_bytes is split only where there is device memory to count (a CUDA pipeline)
        self.knobs = ("host_buffer_bytes", "device_buffer_bytes") if on_device else ("host_buffer_bytes",)
        self.lanes: dict[str, Lane] = {}
        self.names: tuple[str, ...] | None = None  # the fields, in the first sample's order
        self.nbytes: dict[str, int] = {}  # each field's batch bytes (its slots'), which split the budgets

    def __iter__(self) -> Iterator[Lane]:
        return iter(list(self.lanes.values()))

    def __getitem__(self, name: str) -> Lane:
        return self.lanes[name]

    @property
    def ready(self) -> bool:
        return bool(self.lanes)

    def requested(self, name: str, names: tuple[str, ...]) -> torch.dtype | None:
        """The output dtype asked for field ``name`` (None: native); InvalidArgument naming a field a per-field
        ``Config.dtype`` lacks or has too many."""
        return OUTPUT_DTYPES[self.cfg.field_dtype(name, names)]

    def setup(self, first: Sample, dtypes: dict[str, torch.dtype]) -> None:
        """One executor per field of ``first`` (the pipeline's first sample of fields), its batches of
        ``dtypes[name]``, each with its share of the budgets (:meth:`share`). BudgetExceeded when a budget
        is below 1 MiB per field (the least a Config takes)."""
        assert first.fields is not None
        cfg = self.cfg
        shapes = {name: tuple(f.shape) for name, f in first.fields.items()}
        self.nbytes = {name: cfg.batch_size * math.prod(shapes[name]) * dtypes[name].itemsize for name in shapes}
        for knob in self.knobs:
            whole, need = getattr(cfg, knob), _MIN_BUDGET * len(shapes)
            if whole < need:
                raise BudgetExceeded(
                    f"Config.{knob}={whole:,} cannot hold {len(shapes)} fields ({', '.join(shapes)}): each field's "
                    f"executor takes 1 MiB at least; raise {knob} to at least {need:,}", knob=knob, needed=need)
        lanes = {}
        for name in shapes:
            budgets = {knob: self.share(name, getattr(cfg, knob)) for knob in self.knobs}
            lane_cfg = dataclasses.replace(cfg, dtype=cfg.field_dtype(name), transform=None, sample_shape=None,
                                           **budgets)
            lanes[name] = Lane(name, self.make(lane_cfg), lane_cfg, shapes[name], dtypes[name])
        # one compiled engine for every lane that has one (the CPU's and CUDA's executors): a chunk the fields'
        # jobs in flight both need (input and target steps that overlap) is decoded once, and the pipeline
        # runs n_compute_threads engine threads in all
        shared = None
        for lane in lanes.values():
            share = getattr(lane.executor, "share_engine", None)
            if share is not None:
                shared = share(shared)
        self.lanes = lanes
        self.names = tuple(shapes)

    def share(self, name: str, whole: int) -> int:
        """Field ``name``'s share of a budget of ``whole`` bytes: 1 MiB (the least a Config takes: room to decode
        a small field's chunks), and of the rest a part proportional to its batch bytes (its slots)."""
        rest = whole - _MIN_BUDGET * len(self.nbytes)
        return _MIN_BUDGET + rest * self.nbytes[name] // sum(self.nbytes.values())

    def whole_for(self, name: str, need: int) -> int:
        """The least budget whose :meth:`share` for field ``name`` is at least ``need`` bytes."""
        whole = _MIN_BUDGET * len(self.nbytes) + math.ceil(
            max(0, need - _MIN_BUDGET) * sum(self.nbytes.values()) / self.nbytes[name])
        while self.share(name, whole) < need:  # the floor of the share: a byte or so more
            whole += 1
        return whole

    def budget_error(self, lane: Lane, exc: BudgetExceeded) -> BudgetExceeded:
        """``exc`` (a lane's budget refused its batch) said in the pipeline's terms: the field, its share of
        the pipeline's budget, and what the pipeline's knob must be for that share to fit."""
        knob = exc.context.get("knob") or "host_buffer_bytes"
        whole, share = getattr(self.cfg, knob), getattr(lane.cfg, knob)
        needed = exc.context.get("needed")
        total = self.whole_for(lane.name, needed) if isinstance(needed, int) else None
        advice = f"; for this field's share to hold it, Config.{knob} must be at least {total:,}" if total else ""
        err = BudgetExceeded(
            f"field {lane.name!r} ({lane.shape}, {lane.dtype}) has {share:,} B of Config.{knob}={whole:,} (each "
            f"field gets 1 MiB and a part of the rest proportional to its batch bytes), and its batches need more: "
            f"{exc.message}{advice}",
            **{**exc.context, "field": lane.name, **({"needed": total} if total else {})})
        err.__cause__ = as_value(exc)
        return err

    # -- what the pipeline asks of all its executors ------------------------------------------------

    def executors(self) -> list[Executor]:
        # a snapshot taken in one step: push() asks from the caller's thread while the coordinator may add a lane
        return [lane.executor for lane in list(self.lanes.values())]


def transform_fields(transform: Callable, parts: list[Part], rows: int, keys: Any = None) -> tuple[Any, Any]:
    """Run ``transform`` on ``{name: field batch}`` of a finished batch of fields, in the fields' slots, on
    the calling thread (the consumer's, at ``pop``). On CUDA its kernels are queued on the caller's current
    stream after each field's ready event; returns ``(event, stream)`` recorded after them (the fields'
    new ready event), or ``(None, None)`` on the CPU. ``keys``: each sample's (epoch, index), for a keyed
    transform."""
    views = {}
    for part in parts:
        view, _, event, _ = part.executor.deliver(part.target, rows)  # changes nothing: the release is dropped
        if view.is_cuda and event is not None:
            torch.cuda.current_stream(view.device).wait_event(event)
        views[part.name] = view
    apply_transform(transform, views, keys)
    first = next(iter(views.values()))
    if not first.is_cuda:
        return None, None
    stream = torch.cuda.current_stream(first.device)
    done = torch.cuda.Event()
    done.record(stream)
    return done, stream
