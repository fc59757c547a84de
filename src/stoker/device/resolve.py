"""Which device a pipeline runs on: the one resolver of ``Config.device`` against torch's current device.

Binding follows torch's own notion of "this rank's GPU" (``torch.cuda.set_device``):

>>> torch.cuda.set_device(local_rank)
>>> stoker.Pipeline(stoker.Config(device=local_rank))   # bound to cuda:<local_rank>, checked

- ``device=None``: torch's current device when CUDA is available, else the CPU.
- ``device="cpu"``: the CPU, always.
- ``device=N`` / ``"cuda:N"`` / ``"cuda"``: that GPU; it must be torch's current device, or the ranks'
  own CUDA work and stoker's would land on different GPUs (:class:`~stoker.InvalidArgument`).

:func:`bind` is the decision alone (plain values in, a device and maybe a warning out), so every case
is tested without a GPU; :func:`resolve` feeds it torch's state and warns once per process.

Everything else that takes a device (``DevicePrefetcher``, the records ``Loader``, the ``Trainer``,
``CropBatches``) reads it with :func:`as_device`: the same spellings, no binding to the current device.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch

from ..checks import env_int
from ..errors import InvalidArgument


@dataclass(frozen=True)
class Binding:
    device: torch.device
    warning: str | None = None


def _requested_index(requested: int | str, current: int) -> int:
    if isinstance(requested, int):
        return requested
    return current if requested == "cuda" else int(requested[5:])


def bind(requested: int | str | None, *, cuda_available: bool, device_count: int, current: int | None,
         local_rank: int | None) -> Binding:
    """The device for ``Config.device=requested`` given torch's CUDA state; raises InvalidArgument."""
    if requested == "cpu" or (requested is None and not cuda_available):
        return Binding(torch.device("cpu"))
    if not cuda_available:
        raise InvalidArgument(
            f"Config.device={requested!r} asks for CUDA, but torch sees no CUDA device; use device=None "
            "(the CPU here) or 'cpu'",
            knob="device",
        )
    assert current is not None
    index = current if requested is None else _requested_index(requested, current)
    if index >= device_count:
        raise InvalidArgument(
            f"Config.device={requested!r}, but torch sees only {device_count} CUDA device(s) "
            f"(cuda:0..cuda:{device_count - 1}); check CUDA_VISIBLE_DEVICES and the rank's local index",
            knob="device",
        )
    if index != current:
        raise InvalidArgument(
            f"Config.device={requested!r} (cuda:{index}) but torch's current device is cuda:{current}: this "
            f"rank's tensors and stoker's batches would live on different GPUs. Call "
            f"torch.cuda.set_device(local_rank) before building the Pipeline and pass the same index as "
            f"Config(device=local_rank)",
            knob="device",
        )
    warning = None
    if local_rank is not None and local_rank != index and local_rank < device_count:
        warning = _rank_warning(local_rank, index)
    elif requested is None and local_rank is None and device_count > 1:
        warning = (f"stoker.Pipeline bound to cuda:{index} (torch's current device) while {device_count} GPUs "
                   "are visible and no device was named: pass Config(device=local_rank) after "
                   "torch.cuda.set_device(local_rank) so each rank uses its own GPU")
    return Binding(torch.device("cuda", index), warning)


def _rank_warning(local_rank: int, index: int) -> str:
    return (f"LOCAL_RANK={local_rank} but stoker.Pipeline is bound to cuda:{index}: every rank may be sharing "
            f"one GPU (about 1/N throughput). Call torch.cuda.set_device(local_rank) and pass "
            f"Config(device=local_rank); ignore this if CUDA_VISIBLE_DEVICES maps this rank's GPU to {index}")


_warned: set[tuple[int | None, str]] = set()
_warned_lock = threading.Lock()


def resolve(requested: int | str | None) -> torch.device:
    """:func:`bind` against torch's current state; its warning is issued once per (LOCAL_RANK, device)."""
    if requested != "cpu" and torch.cuda._is_in_bad_fork():
        # A process forked after its parent used CUDA cannot use it (a DataLoader worker, say).
        if requested is None:
            return torch.device("cpu")
        raise InvalidArgument(
            f"Config.device={requested!r}: this process was forked after its parent used CUDA, and CUDA cannot "
            "be used here; build the Pipeline in the main process (or a spawned one), or use device='cpu'",
            knob="device",
        )
    cuda = requested != "cpu" and torch.cuda.is_available()
    local_rank = env_int("LOCAL_RANK", -1)
    local_rank = None if local_rank < 0 else local_rank
    binding = bind(requested, cuda_available=cuda, device_count=torch.cuda.device_count() if cuda else 0,
                   current=torch.cuda.current_device() if cuda else None, local_rank=local_rank)
    if binding.warning is not None:
        key = (local_rank, str(binding.device))
        with _warned_lock:
            fresh = key not in _warned
            _warned.add(key)
        if fresh:
            warnings.warn(binding.warning, UserWarning, stacklevel=3)
    return binding.device


def as_device(device: torch.device | str | int | None, who: str) -> torch.device:
    """``device`` as a ``torch.device`` whose CUDA index is always set.

    ``None``: torch's current CUDA device when CUDA is available, else the CPU; ``N``: ``cuda:N``;
    ``"cuda"``: the current CUDA device. A name torch does not know, or CUDA where torch sees none, is an
    :class:`~stoker.InvalidArgument` naming ``who`` (the argument, e.g. ``"Loader(device=...)"``).

    >>> as_device("cpu", "Trainer(device=...)")
    device(type='cpu')
    """
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"{who}: {device!r} is not a torch device ({exc})", device=str(device)) from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise InvalidArgument(f"{who}: {device!r} asks for CUDA, but torch sees no CUDA device; pass device=None "
                              "(CUDA when there is one) or 'cpu'", device=str(device))
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
