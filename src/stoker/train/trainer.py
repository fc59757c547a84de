"""``Trainer``: the DDP training loop users copy, with the parts that usually go wrong done right.

>>> def loss_fn(model, x):
...     return torch.nn.functional.mse_loss(model(x + 0.1 * torch.randn_like(x)), x)
>>> trainer = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3), loss_fn, device=ctx.device,
...                   amp="bf16", accumulate=2, checkpoints=Checkpoints("runs/a/ckpt", every=50),
...                   telemetry_dir="runs/a", log_every=10)
>>> result = trainer.fit(data, steps=1_000, resume="auto")     # on every rank
>>> print(result.samples_per_s, result.data_wait_fraction)

What it does for you, on every rank in lockstep:

- wraps the model in ``DistributedDataParallel`` when a process group is up;
- autocast in bf16, or fp16 with a ``GradScaler`` (meant for CUDA; it also runs, slowly, on the CPU);
- gradient accumulation: ``accumulate`` micro-batches per optimizer step, all but
  the last under ``no_sync()`` so gradients cross the network once per step;
- after the first backward, names every parameter that got no gradient (a DDP job
  would otherwise fail on the next step, or need ``find_unused_parameters=True``);
- times each step as data wait (blocked on the next batch) and compute;
- skips the optimizer step when the loss is NaN or infinite on any rank (all ranks skip it
  together, and put back the buffers its forwards changed), counts it, and stops with
  :class:`~stoker.NonFiniteLoss` after ``max_nonfinite_steps`` such steps in a row; weights
  gone non-finite (parameters; buffers holding NaN, or infinity where they were finite) are
  never checkpointed;
- every ``log_every`` steps, logs loss (mean over ranks), step times, memory (max over
  ranks), skipped steps and the data pipeline's counters with :class:`~stoker.TelemetryWriter`;
- with ``fit(eval_data=..., eval_every=N)``, the mean loss over ``eval_data`` (eval mode,
  no gradients, over all ranks) every N steps and at the end of the call;
- checkpoints model, optimizer, scaler, scheduler, step, every rank's RNG states and
  data position (rank 0 writes atomically, then a barrier), every
  ``checkpoints.every`` steps and at the end; ``resume="auto"`` continues from the
  newest readable checkpoint so the next batch and loss equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
from collections import abc, deque
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from .. import checks
from ..engine.reduce import ReducedStats, reduce_stats
from ..dist.collectives import all_reduce
from ..dist.reduce import reduce_max
from ..engine.stats import Stats
from ..errors import CheckpointError, InvalidArgument, NonFiniteLoss, UnusedParameters
from ..device.pin import tensors_in, to_device
from ..device.resolve import as_device
from ..dist.telemetry import TelemetryWriter, memory_report, peak_rss_bytes
from .checkpoint import Checkpoints
from .heartbeat import mark

__all__ = ["FitResult", "Trainer"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
_AMP = (None, "bf16", "fp16")
_UNUSED = ("error", "warn", "ignore")
# What _save writes and _restore reads: a checkpoint lacking any of these, or holding another type, is damaged.
_STATE = {"model": abc.Mapping, "optimizer": abc.Mapping, "scaler": (abc.Mapping, type(None)),
          "scheduler": (abc.Mapping, type(None)), "samples": int, "world_size": int, "rng": list,
          "data": (list, type(None))}


@dataclass(frozen=True)
class FitResult:
    """What one ``fit`` call did, over all ranks.

    ``samples`` and ``samples_per_s`` cover all ranks (per the longest rank's wall time
    ``elapsed_s``, evaluations left out). ``data_wait_s``, ``compute_s`` and
    ``data_wait_fraction`` are each the largest over ranks; the fraction is a rank's data
    wait over its step time (wait + compute), so it says how much the slowest-fed rank
    starved. ``skipped_steps``: steps of this call whose loss was not finite (no optimizer
    step); ``eval_losses``: the evaluation loss by step (empty without ``eval_data``).
    """

    start_step: int
    step: int
    losses: dict[int, float] = field(repr=False)  # this rank's loss per optimizer step of this call
    samples: int
    elapsed_s: float
    samples_per_s: float
    data_wait_s: float
    compute_s: float
    data_wait_fraction: float
    peak_host_rss_bytes: int
    peak_cuda_bytes: int | None
    pipeline: ReducedStats | None
    checkpoint: Path | None
    resumed_from: Path | None
    telemetry: Path | None
    world_size: int
    skipped_steps: int = 0
    eval_losses: dict[int, float] = field(default_factory=dict)

    @property
    def steps_run(self) -> int:
        return self.step - self.start_step


def _wait_share(wait: float, compute: float) -> float:
    """Data wait as a fraction of step time (wait + compute)."""
    return wait / (wait + compute) if wait + compute > 0 else 0.0


def _batch_len(batch: Any) -> int:
    """Samples in a batch, as the batch says: its ``num_samples`` (a records ``RecordBatch``, a
    ``CropDataset`` batch) or ``num_graphs`` (torch_geometric's ``Batch``); else the first tensor's first dim
    (a dict's values, a dataclass's fields, a list's, tuple's or deque's items in order: a tensor among them,
    else the first of them that holds one, so a list of sample names or an empty list before the inputs is
    not what is counted). Key names are never read: PyG's ``batch`` vector and a ``{field}_batch`` one both
    count nodes, not samples."""
    for attr in ("num_samples", "num_graphs"):
        n = getattr(batch, attr, None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    # a dataclass batch's fields in order, as a dict's values: counted as 1 before, B times too few samples
    sequence = isinstance(batch, (list, tuple, deque))
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch) if sequence else \
        [getattr(batch, f.name, None) for f in dataclasses.fields(batch)] \
        if dataclasses.is_dataclass(batch) and not isinstance(batch, type) else []
    for value in values:
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else 1
    for value in values:  # no tensor of its own: the first container holding one ({"inputs": {...}}, frames)
        if isinstance(value, (Mapping, list, tuple, deque)) or (dataclasses.is_dataclass(value)
                                                                and not isinstance(value, type)):
            if next(tensors_in(value), None) is not None:
                return _batch_len(value)
    if sequence and values:  # items that are no container (objects counting themselves): the first's count
        return _batch_len(values[0])
    return 1


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """One rank's training loop; see the module docstring. Construct and ``fit`` on every rank.

    ``loss_fn(model, batch)`` returns the scalar loss of one (micro-)batch; ``model``
    is the DDP-wrapped module. ``device``: where the model and batches go (default:
    the current CUDA device, else the CPU). ``unused_parameters``: ``"error"``
    (default), ``"warn"`` or ``"ignore"`` for the first-backward check.
    ``max_nonfinite_steps``: how many optimizer steps in a row may have a NaN or infinite
    loss (each is skipped) before ``fit`` raises :class:`~stoker.NonFiniteLoss`.

    Every rank must build its Trainer alike (the same ``checkpoints``, ``telemetry_dir``,
    ``log_every``, ``accumulate``): logging and checkpointing are collectives, and a rank
    that skips one leaves the others waiting in it.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
                 device: torch.device | str | None = None, amp: str | None = None, accumulate: int = 1,
                 grad_clip: float | None = None, scheduler: Any = None, checkpoints: Checkpoints | None = None,
                 telemetry_dir: str | Path | None = None, log_every: int = 10, unused_parameters: str = "error",
                 ddp_kwargs: Mapping[str, Any] | None = None, progress: bool = True,
                 max_nonfinite_steps: int = 10) -> None:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgument(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise InvalidArgument("loss_fn must be a function (model, batch) -> scalar loss")
        if amp not in _AMP:
            raise InvalidArgument(f"amp must be one of {_AMP}, got {amp!r}")
        accumulate, log_every = checks.integer("accumulate", accumulate, 1), checks.integer("log_every", log_every, 1)
        self.max_nonfinite_steps = checks.integer("max_nonfinite_steps", max_nonfinite_steps, 1)
        if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
            raise InvalidArgument(f"grad_clip must be a number > 0 or None, got {grad_clip!r}")
        if unused_parameters not in _UNUSED:
            raise InvalidArgument(f"unused_parameters must be one of {_UNUSED}, got {unused_parameters!r}")
        if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
            raise InvalidArgument(f"checkpoints must be a stoker.train.Checkpoints, got {type(checkpoints).__name__}")
        self.device = as_device(device, "Trainer(device=...)")

        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.module = model.to(self.device)
        ddp_kwargs = dict(ddp_kwargs or {})
        if self.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(
                self.module, device_ids=ids, **ddp_kwargs)
        else:
            self.model = self.module
        if unused_parameters == "error" and ddp_kwargs.get("find_unused_parameters"):
            unused_parameters = "warn"  # the user told DDP to cope with them
        self.unused_parameters = unused_parameters
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.amp = amp
        self.accumulate = accumulate
        self.grad_clip = grad_clip
        # fp16 gradients underflow without loss scaling; the scaler also skips steps with inf/NaN gradients.
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.checkpoints = checkpoints
        self.telemetry_dir = Path(telemetry_dir) if telemetry_dir is not None else None
        self.log_every = log_every
        self.progress = progress
        self.step = 0
        self.samples_seen = 0  # all ranks, over the whole run including resumed parts
        self.skipped_steps = 0  # steps of this Trainer's fits whose loss was not finite
        self._nonfinite_in_a_row = 0
        self._checked_unused = False
        self._finite_at_start: set[str] = set()  # buffers finite when fit started (see _check_finite_weights)
        self._buffer_backup: dict[str, torch.Tensor] = {}  # the buffers before this step's forwards
        self._fitted = False  # only the first fit resumes from a checkpoint
        self._epochs: _Epochs | None = None
        self._eval_starts: list[tuple[Any, Any]] = []  # (eval data, where its evaluations start: see _rewind)
        self._log_mark = (0.0, 0.0)  # (perf_counter, samples of all ranks) at the last telemetry record

    # -- collectives -------------------------------------------------------------------------

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        mark(self.step, "sync")
        return all_reduce(values, op, None)

    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        mark(self.step, "sync")
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # -- checkpoints -------------------------------------------------------------------------

    def _agree(self, ok: bool) -> bool:
        """Collective: True when every rank says ok (MIN as -MAX(-x)); also a barrier."""
        return -self._all_reduce([-1.0 if ok else -0.0], "MAX")[0] >= 1.0

    def _save(self, data: Any, samples: int) -> Path:
        """Collective: gather every rank's RNG, data position and sample count; rank 0 writes; all agree."""
        assert self.checkpoints is not None
        self._check_finite_weights()
        error: BaseException | None = None
        try:
            mine = (_rng_state(), data.state_dict() if callable(getattr(data, "state_dict", None)) else None,
                    samples)
        except Exception as exc:  # noqa: BLE001 - shared below, so no rank is left in the gather
            error, mine = exc, (None, None, 0)
        gathered = self._gather(mine)
        if error is None and any(g[0] is None for g in gathered):
            error = CheckpointError(f"another rank could not report its state for the checkpoint of step "
                                    f"{self.step}; its error says why", elsewhere=True)
        if self.rank == 0 and error is None:
            mark(self.step, "checkpoint")
            try:
                data_states = [g[1] for g in gathered]
                state = {
                    "model": self.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                    "samples": self.samples_seen + sum(int(g[2]) for g in gathered),
                    "world_size": self.world_size,
                    "rng": [g[0] for g in gathered],
                    "data": data_states if data_states[0] is not None else None,
                }
                self.checkpoints.save(state, self.step)
            except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement below
                error = exc
        # Everyone learns whether the write worked before going on; this doubles as the barrier.
        if not self._agree(error is None):
            if error is not None:
                raise error
            raise CheckpointError(f"rank 0 could not write the checkpoint of step {self.step}; its error says why",
                                  elsewhere=True)
        return self.checkpoints.path_for(self.step)

    def _finite_buffers(self) -> set[str]:
        """Names of the floating buffers that hold no NaN or infinity (what fit starts from)."""
        return {n for n, t in self.module.named_buffers()
                if (t.is_floating_point() or t.is_complex()) and bool(torch.isfinite(t).all())}

    def _check_finite_weights(self) -> None:
        """Collective: NonFiniteLoss on every rank when any rank's weights went non-finite (a checkpoint of
        them would poison every resumption). Parameters must be finite. Buffers may hold infinity by design
        (an attention mask of -inf): a buffer must hold no NaN, and one that was finite when fit started must
        still be."""
        finite = self._finite_at_start
        tensors = [(n, t, True) for n, t in self.module.named_parameters()]
        tensors += [(n, t, n in finite) for n, t in self.module.named_buffers()]
        tensors = [(n, t, whole) for n, t, whole in tensors if t.is_floating_point() or t.is_complex()]

        def bad(t: torch.Tensor, whole: bool) -> torch.Tensor:
            return ~torch.isfinite(t).all() if whole else torch.isnan(t).any()

        ok = not bool(torch.stack([bad(t, whole) for _, t, whole in tensors]).any()) if tensors else True
        if self._agree(ok):
            return
        first = next((n for n, t, whole in tensors if bool(bad(t, whole))), "another rank's replica")
        newest = self.checkpoints.list()[-1][1] if self.checkpoints is not None and self.checkpoints.list() else None
        where = f"the newest checkpoint is {newest}" if newest else "none written"
        raise NonFiniteLoss(f"the weights hold NaN or infinite values at step {self.step} (first: {first}); they "
                            f"are not checkpointed ({where}). "
                            "Lower the learning rate, set grad_clip=, or check the data for NaN and infinity.",
                            step=self.step, count=self._nonfinite_in_a_row, parameter=first)

    def _resume(self, resume: Any, data: Any) -> Path | None:
        """Collective: rank 0 picks the checkpoint, every rank loads the same one, all agree it worked."""
        if resume is None or resume is False:
            if self.checkpoints is not None:
                self._check_no_later_checkpoints(0, auto=False)
            return None
        if resume != "auto":
            path = Path(resume)
            error: BaseException | None = None
            try:
                self._restore((self.checkpoints or Checkpoints(path.parent)).load(path, _STATE), data)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = exc
            self._raise_unless_all_ok(error, f"resuming from {path}")
            if self.checkpoints is not None:
                self._check_no_later_checkpoints(self.step, auto=False)
            return path
        if self.checkpoints is None:
            return None  # nothing is ever saved, so there is nothing to resume from
        found = None
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                self.checkpoints.cleanup()
                found = self.checkpoints.load_latest(_STATE)
                choice = [str(found[0]) if found else None]
            except Exception as exc:  # noqa: BLE001 - broadcast, so no rank waits for a choice
                choice = [f"error:{type(exc).__name__}: {exc}"]
        if self.world_size > 1:
            mark(self.step, "sync")
            dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], str) and choice[0].startswith("error:"):
            raise CheckpointError(f"cannot resume from {self.checkpoints.directory}: {choice[0][6:]}")
        path = Path(choice[0]) if choice[0] is not None else None
        error = None
        if path is not None:
            try:
                self._restore(found[1] if found else self.checkpoints.load(path, _STATE), data)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = exc
        self._raise_unless_all_ok(error, f"resuming from {path}")
        self._check_no_later_checkpoints(self.step, auto=True)
        return path

    def _raise_unless_all_ok(self, error: BaseException | None, what: str) -> None:
        if not self._agree(error is None):
            if error is not None:
                raise error
            raise CheckpointError(f"another rank failed {what}; its error says why", elsewhere=True)

    def _check_no_later_checkpoints(self, start: int, auto: bool) -> None:
        """Collective: refuse to start at ``start`` beside checkpoints of later steps.

        They belong to another run; the rotation would delete this run's new checkpoints
        in their favour, and the next ``resume="auto"`` would pick them up. With auto
        resume, later ones exist only when they could not be read: they are set aside.
        """
        assert self.checkpoints is not None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                later = [p for step, p in self.checkpoints.list() if step > start]
                if later and auto:
                    for p in later:
                        p.rename(p.with_name(p.name + ".damaged"))
                elif later:
                    error = CheckpointError(
                        f"{self.checkpoints.directory} holds checkpoints of later steps than this run starts at "
                        f"(step {start}): {', '.join(p.name for p in later[-3:])}. Use resume='auto' to continue "
                        "them, another directory, or delete them.", path=str(self.checkpoints.directory))
            except OSError as exc:
                error = CheckpointError(f"cannot check {self.checkpoints.directory}: {exc}")
        self._raise_unless_all_ok(error, "checking the checkpoint directory")

    def _restore(self, state: Mapping[str, Any], data: Any) -> None:
        if state["world_size"] == self.world_size and len(state["rng"]) != self.world_size:
            raise CheckpointError(f"the checkpoint of step {state['step']} is damaged: it holds {len(state['rng'])} "
                                  f"RNG states for {self.world_size} ranks")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.samples_seen = int(state.get("samples", 0))
        same_world = int(state.get("world_size", -1)) == self.world_size
        if same_world:
            _set_rng_state(state["rng"][self.rank])
        elif self.rank == 0:
            warnings.warn(f"checkpoint was written by {state.get('world_size')} ranks, this run has "
                          f"{self.world_size}: RNG states are not restored (data positions are)", RuntimeWarning,
                          stacklevel=3)
        states = state.get("data")
        if states is not None and callable(getattr(data, "load_state_dict", None)):
            # A source's position is global (every rank's state describes the whole epoch), so rank 0's
            # state serves a resumed run of another size.
            data.load_state_dict(states[self.rank] if same_world else states[0])
        elif self.rank == 0 and states is None:
            warnings.warn("the checkpoint holds no data position (the data object has no state_dict); the data "
                          "starts from its beginning", RuntimeWarning, stacklevel=3)

    # -- the loop ------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if self.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.amp == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _check_unused(self) -> None:
        """After the first backward: the parameters no rank produced a gradient for."""
        self._checked_unused = True
        if self.unused_parameters == "ignore":
            return
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        mask = [1.0 if p.grad is None else 0.0 for _, p in named]
        # A parameter unused on any rank breaks DDP on every rank: agree before raising.
        mask = self._all_reduce(mask, "MAX") if named else mask
        unused = [n for (n, _), m in zip(named, mask) if m > 0]
        if not unused:
            return
        listed = ", ".join(unused[:20]) + (f" and {len(unused) - 20} more" if len(unused) > 20 else "")
        message = (f"{len(unused)} parameter(s) received no gradient in the first backward: {listed}. DDP "
                   "expects every parameter to contribute to the loss. Remove them, freeze them with "
                   "requires_grad_(False), or accept the cost with ddp_kwargs={'find_unused_parameters': True}.")
        if self.unused_parameters == "error":
            raise UnusedParameters(message, parameters=unused)
        if self.rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _place(self, batch: Any) -> Any:
        """The batch on the model's device."""
        if self.device.type != "cpu":
            return to_device(batch, self.device)
        if any(t.device.type != "cpu" for t in tensors_in(batch)):
            # a GPU batch for a CPU model (a pipeline left on device=None in a CPU rank of a GPU machine)
            # comes back synchronously, so it is whole when used; CPU batches pass as they are
            return to_device(batch, self.device, non_blocking=False)
        return batch

    def _micro_step(self, batch: Any, last: bool) -> torch.Tensor:
        sync = contextlib.nullcontext() if last or not self.distributed else self.model.no_sync()
        with sync:
            mark(self.step, "forward")
            with self._autocast():
                loss = self.loss_fn(self.model, batch)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise InvalidArgument(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
            scaled = loss / self.accumulate
            # DDP all-reduces gradients inside the last micro-step's backward; the others are local compute
            mark(self.step, "backward" if last else "forward")
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if not self._checked_unused:
            self._check_unused()
        return loss.detach()

    def _backup_buffers(self) -> None:
        """Copy the buffers before the step's forwards, which update some (BatchNorm's running statistics):
        a skipped step puts them back (:meth:`_skip_step`). Copies are kept and refilled, not reallocated."""
        backup = self._buffer_backup
        for name, buf in self.module.named_buffers():
            held = backup.get(name)
            if held is None or held.shape != buf.shape or held.dtype != buf.dtype or held.device != buf.device:
                backup[name] = buf.detach().clone()
            else:
                held.copy_(buf)

    def _skip_step(self) -> None:
        """A step whose loss was not finite: no optimizer step, and the buffers its forwards changed (a
        BatchNorm's running statistics, now NaN) are put back, so the model is as before the step. fp16's
        scaler backs off as it would on overflowing gradients. The scheduler still counts the step (it
        schedules by step number), also before the first optimizer step, whose warning is not shown."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                held = self._buffer_backup.get(name)
                if held is not None and held.shape == buf.shape and held.dtype == buf.dtype:
                    buf.copy_(held)
        if self.scaler is not None:
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        if self.scheduler is not None:
            with warnings.catch_warnings():  # skipping the optimizer step is the point: not the misuse torch means
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.scheduler.step()

    def evaluate(self, data: Any) -> float:
        """Collective: the mean loss over every batch of ``data`` (weighted by samples, over all ranks), with
        the model in eval mode and no gradients. Training's state is untouched: the model's mode and the RNG
        states (a ``loss_fn`` that draws noise) are as before, so evaluating never changes the training run.
        Ranks may hold different numbers of batches; every rank must call it. ``data`` is iterated once per
        call and must end, and be iterable again for the next call: a list, a CropDataset, a DataLoader;
        not a generator or a CropBatches (InvalidArgument). Data that keeps a position (a CropDataset, also
        in a DataLoader) is rewound to the start of the epoch it was in at the first evaluation: every
        evaluation sees the same samples, also in a resumed run, not the next epoch of its source."""
        _check_eval_data(data)
        mark(self.step, "eval")
        self._rewind(data)
        rng = _rng_state()
        was_training = self.module.training
        self.module.eval()
        total, count = 0.0, 0
        try:
            # the bare module: DDP's forward may broadcast buffers, a collective ranks with unequal batch
            # counts would not all join
            with torch.no_grad():
                for batch in data:
                    n = _batch_len(batch)
                    with self._autocast():
                        loss = self.loss_fn(self.module, self._place(batch))
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise InvalidArgument(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
                    total += float(loss) * n
                    count += n
        finally:
            self.module.train(was_training)
            _set_rng_state(rng)
        # Phase "eval", not "sync": a rank waiting here for one still evaluating a larger share is not held
        # up by it in the heartbeat's sense (the evaluating rank is busy, not stuck); only timeout_s bounds it.
        total, count = all_reduce([total, float(count)], "SUM", None)
        if count == 0:
            raise InvalidArgument(f"eval_data ({type(data).__name__}) yields no batches on any rank")
        return total / count

    def _rewind(self, data: Any) -> None:
        """Start an evaluation over ``data`` at the start of the epoch it was in at this Trainer's first
        evaluation over it (where it stood, when it has no ``set_epoch``), when it keeps a position (a CropDataset, directly or as a DataLoader's dataset; a StatefulDataLoader): each
        iteration of a CropDataset runs its next epoch, so evaluations over RandomCrops would each see other
        crops, and a resumed run (a fresh dataset) other crops than the uninterrupted one at the same step."""
        target = next((obj for obj in (data, getattr(data, "dataset", None))
                       if callable(getattr(obj, "state_dict", None))
                       and callable(getattr(obj, "load_state_dict", None))), None)
        if target is None:
            return  # a list, a DataLoader over a map-style dataset: the same batches every pass
        for obj, start in self._eval_starts:
            if obj is target:
                target.load_state_dict(copy.deepcopy(start))
                return
        state = target.state_dict()
        epoch = state.get("epoch") if isinstance(state, dict) else None
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch) and isinstance(epoch, int) and not isinstance(epoch, bool):
            # from the start of the epoch it is in, not where it stands: a dataset iterated before its first
            # evaluation (a batch taken to check shapes) would replay only its rest, where a resumed run's fresh
            # dataset evaluates the whole epoch
            set_epoch(epoch)
            state = target.state_dict()
        self._eval_starts.append((target, copy.deepcopy(state)))

    def _optimizer_step(self) -> None:
        if self.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def fit(self, data: Any, steps: int | None = None, seconds: float | None = None,
            resume: str | Path | None = "auto", *, eval_data: Any = None, eval_every: int | None = None) -> FitResult:
        """Train until optimizer step ``steps`` (counted from the run's start, resumed steps included)
        or for ``seconds`` of this call, whichever comes first. Collective: call it on every rank.

        ``data``: an iterable of batches (iterated again when exhausted: epochs), optionally with
        ``state_dict``/``load_state_dict`` (its position goes into checkpoints) and ``stats()``
        (a :class:`~stoker.Stats` for telemetry and the summary). ``resume``: ``"auto"`` (newest
        readable checkpoint, if any; nothing without ``checkpoints``), a checkpoint path, or None.
        Only the first ``fit`` of a Trainer resumes; later calls continue where the previous one
        stopped (with the same data, from the same position).

        ``eval_data``: an iterable of batches (this rank's share), passed whole through
        :meth:`evaluate` every ``eval_every`` steps and after the call's last step; its loss goes
        to telemetry (``eval_loss``), the progress output and ``FitResult.eval_losses``. It must end and
        be iterable again: a list of batches, a :class:`~stoker.CropDataset` or a DataLoader over one;
        not a generator (used up by the first evaluation) nor a ``CropBatches`` (endless):
        :class:`~stoker.InvalidArgument`. Ranks that finish their share first wait in the reduction
        for the others; the imbalance must stay well below ``launch(timeout_s=...)``.
        """
        if steps is None and seconds is None:
            raise InvalidArgument("fit needs steps=N or seconds=S (or both)")
        steps = checks.integer("steps", steps, 0, optional=True)
        seconds = checks.seconds("seconds", seconds, optional=True)
        eval_every = checks.integer("eval_every", eval_every, 1, optional=True)
        if eval_every is not None and eval_data is None:
            raise InvalidArgument("eval_every needs eval_data=, the batches to evaluate on")
        _check_eval_data(eval_data)
        resumed_from = self._resume(resume, data) if not self._fitted else None
        self._fitted = True
        self._finite_at_start = self._finite_buffers()
        start_step = self.step
        todo = steps is None or self.step < steps
        if self.progress and self.rank == 0:
            self._say_where_it_starts(resumed_from, steps, todo)
        writer = TelemetryWriter(self.telemetry_dir) if self.telemetry_dir else None  # fit picks the steps
        bar = _Progress(start_step, steps, seconds) if self.progress and self.rank == 0 and todo else None
        losses: dict[int, float] = {}
        eval_losses: dict[int, float] = {}
        wait_total = compute_total = eval_s = 0.0
        samples = skipped = 0
        last_saved: Path | None = resumed_from
        self.model.train()
        t_start = time.perf_counter()
        self._log_mark = (t_start, 0.0)
        if self._epochs is None or self._epochs.data is not data:
            self._epochs = _Epochs(data)  # kept: a later fit on the same data continues its iterator
        batches = self._epochs
        try:
            while steps is None or self.step < steps:
                t0 = time.perf_counter()
                wait = 0.0
                self.optimizer.zero_grad(set_to_none=True)
                self._backup_buffers()
                total = torch.zeros((), device=self.device)
                for micro in range(self.accumulate):
                    tw = time.perf_counter()
                    mark(self.step, "data")
                    batch = next(batches)
                    wait += time.perf_counter() - tw
                    samples += _batch_len(batch)
                    total += self._micro_step(self._place(batch), last=micro == self.accumulate - 1)
                loss = float(total) / self.accumulate  # waits for the device: compute time is real
                # A NaN or infinite loss on any rank: every rank skips the step, so the replicas stay equal.
                mark(self.step, "optimizer")
                if self._agree(math.isfinite(loss)):
                    self._optimizer_step()
                    self._nonfinite_in_a_row = 0
                else:
                    self._skip_step()
                    skipped += 1
                    self.skipped_steps += 1
                    self._nonfinite_in_a_row += 1
                self.step += 1
                mark(self.step, "sync")  # under NCCL the host waits here for the step's collectives too
                losses[self.step] = loss
                if self._nonfinite_in_a_row >= self.max_nonfinite_steps:
                    raise NonFiniteLoss(
                        f"the loss was NaN or infinite in {self._nonfinite_in_a_row} steps in a row (steps "
                        f"{self.step - self._nonfinite_in_a_row + 1}-{self.step}, on at least one rank); none "
                        "was applied and training stops (max_nonfinite_steps="
                        f"{self.max_nonfinite_steps}). Check the data for NaN and infinity, lower the learning "
                        "rate, or set grad_clip=.", step=self.step, count=self._nonfinite_in_a_row)
                step_s = time.perf_counter() - t0
                wait_total += wait
                compute_total += step_s - wait
                if writer is not None and self.step % self.log_every == 0:
                    self._log(writer, data, loss, wait, step_s, wait_total, compute_total, samples)
                if bar is not None:
                    bar.update(self.step, loss, _wait_share(wait_total, compute_total), self.skipped_steps)
                if eval_every is not None and self.step % eval_every == 0:
                    eval_s += self._run_eval(eval_data, eval_losses, writer, bar)
                if self.checkpoints is not None and self.checkpoints.due(self.step):
                    last_saved = self._save(data, samples)
                if seconds is not None and self._time_is_up(time.perf_counter() - t_start, seconds):
                    break
            if eval_data is not None and self.step > start_step and self.step not in eval_losses:
                eval_s += self._run_eval(eval_data, eval_losses, writer, bar)  # the call's result
            elapsed = time.perf_counter() - t_start - eval_s
            if self.checkpoints is not None and self.step > start_step and not self.checkpoints.due(self.step):
                last_saved = self._save(data, samples)  # the end of a call is a natural place to resume from
            return self._result(data, start_step, losses, samples, elapsed, wait_total, compute_total,
                                last_saved, resumed_from, writer, skipped, eval_losses)
        finally:
            mark(self.step, "idle")
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()

    def _say_where_it_starts(self, resumed_from: Path | None, steps: int | None, todo: bool) -> None:
        """Rank 0's opening line: where training starts (a resumed run: from which step and checkpoint), or
        that there is nothing left to do."""
        if not todo:
            print(f"training: nothing to do, already at step {self.step} of steps={steps}"
                  + (f" (resumed from {resumed_from})" if resumed_from is not None else "")
                  + "; raise steps to train further", flush=True)
        elif resumed_from is not None:
            print(f"training: resuming at step {self.step} from {resumed_from}", flush=True)
        elif self.step > 0:
            print(f"training: continuing at step {self.step}", flush=True)

    def _run_eval(self, eval_data: Any, eval_losses: dict[int, float], writer: TelemetryWriter | None,
                  bar: "_Progress | None") -> float:
        """Collective: evaluate, record and report at this step; returns the seconds it took."""
        t0 = time.perf_counter()
        mark(self.step, "eval")
        value = self.evaluate(eval_data)
        eval_losses[self.step] = value
        when, samples = self._log_mark
        self._log_mark = (when + time.perf_counter() - t0, samples)  # samples/s leaves evaluations out
        if writer is not None:
            writer.log(self.step, {"eval_loss": value})
        if bar is not None:
            bar.write(f"step {self.step}: eval loss {value:.4g}")
        return time.perf_counter() - t0

    def _time_is_up(self, elapsed: float, seconds: float) -> bool:
        # Every rank must stop after the same step, or the others wait in a collective for ever.
        return self._all_reduce([1.0 if elapsed >= seconds else 0.0], "MAX")[0] > 0

    def _log(self, writer: TelemetryWriter, data: Any, loss: float, wait: float, step_s: float,
             wait_total: float, compute_total: float, samples: int) -> None:
        loss_sum, samples_all = self._all_reduce([loss, float(samples)], "SUM")
        now = time.perf_counter()
        since, before = self._log_mark
        self._log_mark = (now, samples_all)
        metrics: dict[str, Any] = {
            "loss": loss_sum / self.world_size,
            "samples": self.samples_seen + int(samples_all),  # all ranks, resumed parts of the run included
            "samples_per_s": (samples_all - before) / (now - since) if now > since else 0.0,  # since the last record
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "data_wait_s": wait,
            "compute_s": step_s - wait,
            "step_s": step_s,
            "data_wait_fraction": _wait_share(wait_total, compute_total),
            "skipped_steps": self.skipped_steps,
            "host_peak_rss_bytes": peak_rss_bytes(),
            **memory_report(),
        }
        stats = data.stats() if callable(getattr(data, "stats", None)) else None
        if isinstance(stats, Stats):
            metrics.update(read_amplification=stats.read_amplification,
                           decode_amplification=stats.decode_amplification,
                           pipeline_samples=stats.samples)
        writer.log(self.step, metrics)

    def _result(self, data: Any, start_step: int, losses: dict[int, float], samples: int, elapsed: float,
                wait_total: float, compute_total: float, last_saved: Path | None, resumed_from: Path | None,
                writer: TelemetryWriter | None, skipped: int, eval_losses: dict[int, float]) -> FitResult:
        """Collective: totals over ranks and the worst rank's times and memory."""
        samples_all = int(self._all_reduce([float(samples)], "SUM")[0])
        self.samples_seen += samples_all
        cuda_peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else -1)
        worst = reduce_max({"wait": wait_total, "compute": compute_total, "elapsed": elapsed,
                            "wait_share": _wait_share(wait_total, compute_total),
                            "rss": peak_rss_bytes(), "cuda": cuda_peak})
        stats = data.stats() if callable(getattr(data, "stats", None)) else None
        pipeline = reduce_stats(stats, elapsed_s=elapsed) if isinstance(stats, Stats) and elapsed > 0 else None
        return FitResult(
            start_step=start_step, step=self.step, losses=losses, samples=samples_all, elapsed_s=worst["elapsed"],
            samples_per_s=samples_all / worst["elapsed"] if worst["elapsed"] > 0 else 0.0,
            data_wait_s=worst["wait"], compute_s=worst["compute"],
            data_wait_fraction=worst["wait_share"],
            peak_host_rss_bytes=int(worst["rss"]), peak_cuda_bytes=int(worst["cuda"]) if worst["cuda"] >= 0 else None,
            pipeline=pipeline, checkpoint=last_saved, resumed_from=resumed_from,
            telemetry=writer.path if writer is not None else None, world_size=self.world_size,
            skipped_steps=skipped, eval_losses=eval_losses,
        )


def _check_eval_data(data: Any) -> None:
    """InvalidArgument unless ``data`` can be evaluated on every time: it must end, and iterate anew."""
    if data is None:
        return
    from .data import CropBatches

    why = ("is endless: an evaluation over it would never end" if isinstance(data, CropBatches) else
           "is an iterator: the first evaluation would use it up" if isinstance(data, abc.Iterator) else
           "is not iterable" if not isinstance(data, abc.Iterable) else None)
    if why is not None:
        raise InvalidArgument(f"eval_data ({type(data).__name__}) {why}. Evaluate on something that ends and can "
                              "be iterated again: a list of batches, a stoker.CropDataset (with its own source "
                              "of samples_per_epoch samples) or a torch DataLoader over one", knob="eval_data")


class _Progress:
    """Rank 0's progress bar: by steps towards a step target, else by seconds of the time budget; with
    neither (``seconds=inf``, no time limit), a count of steps."""

    def __init__(self, start: int, steps: int | None, seconds: float | None) -> None:
        from tqdm import tqdm

        # an infinite budget has no bar to fill: tqdm takes total=inf as no total, and its bar format fails
        self.by_time = steps is None and seconds is not None and math.isfinite(seconds)
        self.t0 = time.perf_counter()
        if self.by_time:
            self.bar = tqdm(total=float(seconds or 0), desc="training", dynamic_ncols=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")
        else:
            self.bar = tqdm(total=steps, initial=start, desc="training", unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, wait_share: float, skipped: int = 0) -> None:
        self.bar.set_postfix_str(f"step {step}, loss {loss:.4g}, data wait {100 * wait_share:.0f}%"
                                 + (f", {skipped} skipped (loss not finite)" if skipped else ""), refresh=False)
        if self.by_time:
            self.bar.n = min(self.bar.total, time.perf_counter() - self.t0)
            self.bar.refresh()
        else:
            self.bar.update(1)

    def write(self, line: str) -> None:
        """A line above the bar (the bar redraws below it)."""
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


class _Epochs:
    """Batches from ``data``, starting a new pass (epoch) whenever one ends."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self._it: Iterator[Any] | None = None

    def __next__(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.data)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise InvalidArgument(f"the data ({type(self.data).__name__}) yields no batches; check the dataset, the "
                              "batch size and drop_last")
