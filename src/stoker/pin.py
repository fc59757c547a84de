"""Pinning that really pins custom batches, and prefetching batches onto a device.

``DataLoader(pin_memory=True)`` silently skips batch types it does not know, so a
custom batch crosses PCIe from pageable memory at a fraction of the bandwidth.
:func:`pin_object` walks the batch and pins every tensor and numpy array in it,
or says exactly which leaf it could not pin:

>>> batch = pin_object({"x": torch.randn(8, 3), "meta": Meta(coords=np.zeros((8, 3)))})
>>> pin_object(Batch(streams=[..., Opaque()]))
TypeError: cannot pin batch.streams[2].coords (Opaque holds array data): implement pin_memory() ...

:class:`DevicePrefetcher` wraps any iterable of batches: it pins on a background
thread of the main process (never in forked DataLoader workers), copies with
``non_blocking=True`` on a side stream, and fences the consumer's stream on an
event. On a CPU device (``device="cpu"``, or ``None`` without CUDA) it passes batches through
unchanged; naming a CUDA device torch cannot see is an InvalidArgument.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import torch

from .checks import integer, seconds
from .errors import InvalidArgument

T = TypeVar("T")

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, np.generic, slice)


@runtime_checkable
class Pinnable(Protocol):
    """A batch type that pins itself: returns a copy whose tensors live in pinned memory.

    A class that is not a dataclass also needs ``to(device, non_blocking=False)`` to
    travel through :func:`to_device` and :class:`DevicePrefetcher`.
    """

    def pin_memory(self: T) -> T: ...


def _holds_array_data(obj: Any) -> bool:
    return any(hasattr(obj, a) for a in ("__array__", "__array_interface__", "__dlpack__",
                                         "__cuda_array_interface__"))


def _find_array_leaf(obj: Any, path: str, depth: int = 0) -> str | None:
    """Path of the first attribute holding array data inside an unknown object, if any."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or _holds_array_data(obj):
        return path
    if depth > 4 or isinstance(obj, _SCALARS):
        return None
    if isinstance(obj, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        attrs = dict(getattr(obj, "__dict__", {}))
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
        items = [(f"{path}.{k}", v) for k, v in attrs.items()]
    for p, v in items:
        found = _find_array_leaf(v, p, depth + 1)
        if found:
            return found
    return None


def map_batch(obj: Any, leaf: Callable[[torch.Tensor, str], torch.Tensor], path: str = "batch",
              hook: Callable[[Any], Any] | None = None, remedy: str = "pin_memory()") -> Any:
    """Rebuild ``obj`` with ``leaf(tensor, path)`` applied to every tensor (numpy arrays become tensors).

    Containers keep their types: dicts, lists, tuples, namedtuples, dataclasses
    (fields replaced, type kept). ``hook(obj)`` lets an object handle itself (e.g.
    call its own ``pin_memory()``, the :class:`Pinnable` protocol); it returns
    ``NotImplemented`` for objects it does not apply to. Scalars and strings pass
    through; any other object that holds array data raises ``TypeError`` naming the
    path to the leaf and the ``remedy`` (the method its type should implement).
    """
    if isinstance(obj, torch.Tensor):
        return leaf(obj, path)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.kind in "USV":
            raise TypeError(f"cannot move {path}: numpy array of {obj.dtype} holds no numeric data")
        return leaf(torch.from_numpy(np.ascontiguousarray(obj)), path)
    if isinstance(obj, _SCALARS):
        return obj
    if hook is not None and not isinstance(obj, (Mapping, list, tuple)):
        handled = hook(obj)
        if handled is not NotImplemented:
            return handled

    def walk(value: Any, where: str) -> Any:
        return map_batch(value, leaf, where, hook, remedy)

    if isinstance(obj, Mapping):
        items = {k: walk(v, f"{path}[{k!r}]") for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return cast(Any, type(obj))(items)  # a Mapping subclass built from a dict, when it can be
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(walk(v, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(walk(v, f"{path}[{i}]") for i, v in enumerate(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        init = {f.name: walk(getattr(obj, f.name), f"{path}.{f.name}") for f in dataclasses.fields(obj) if f.init}
        new = dataclasses.replace(obj, **init)
        for f in dataclasses.fields(obj):
            if not f.init and hasattr(obj, f.name):
                object.__setattr__(new, f.name, walk(getattr(obj, f.name), f"{path}.{f.name}"))
        return new
    found = _find_array_leaf(obj, path)
    if found is not None:
        raise TypeError(
            f"cannot move {found} ({type(obj).__name__} at {path} holds array data stoker does not know how to "
            f"reach): implement {remedy} on {type(obj).__name__} (see stoker.pin.Pinnable) or make it a dataclass"
        )
    return obj


def _method_hook(name: str, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """A :func:`map_batch` hook calling ``obj.name(*args, **kwargs)`` on objects that have that method."""
    def hook(obj: Any) -> Any:
        fn = getattr(obj, name, None)
        return fn(*args, **kwargs) if callable(fn) else NotImplemented
    return hook


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj``: through containers at any depth, as :func:`map_batch` moves
    them, and through plain objects' attributes (self-moving batches) at most 6 objects deep, so a batch
    that refers to a model or dataset is not walked whole. An object is walked again only when reached
    by a shorter path (so a deep path seen first cannot hide what a short one reaches): cycles end."""
    walked: dict[int, int] = {}  # id -> fewest plain objects passed on the way, when it was walked
    todo = [(obj, 0)]
    while todo:
        obj, in_objects = todo.pop()
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if isinstance(obj, (_SCALARS, np.ndarray)) or walked.get(id(obj), _MAX_OBJECT_DEPTH + 1) <= in_objects:
            continue
        walked[id(obj)] = in_objects
        if isinstance(obj, Mapping):
            values = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            values = list(obj)
        elif in_objects < _MAX_OBJECT_DEPTH:
            in_objects += 1
            values = list(getattr(obj, "__dict__", {}).values())
            values += [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
        else:
            continue
        todo.extend((v, in_objects) for v in reversed(values))


_MAX_OBJECT_DEPTH = 6  # plain objects' attributes followed by tensors_in


_warned_no_cuda = False
_warn_lock = threading.Lock()


def _pin_leaf(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.device.type != "cpu" or t.is_pinned():
        return t  # on a device already, or pinned already: never copied again
    return t.pin_memory()


def pin_object(obj: T) -> T:
    """A pinned version of ``obj`` (tensors, numpy arrays, containers, dataclasses, Pinnable objects).

    Without CUDA nothing can be pinned: the input comes back unchanged, with a
    one-time warning.
    """
    global _warned_no_cuda
    if not torch.cuda.is_available():
        with _warn_lock:
            if not _warned_no_cuda:
                _warned_no_cuda = True
                warnings.warn("stoker.pin_object: CUDA is not available, nothing was pinned", RuntimeWarning,
                              stacklevel=2)
        return obj
    return map_batch(obj, _pin_leaf, hook=_method_hook("pin_memory"), remedy="pin_memory()")


def to_device(obj: T, device: torch.device, non_blocking: bool = True) -> T:
    """``obj`` with every tensor moved to ``device`` (same traversal and types as :func:`pin_object`).

    An object with its own ``to(device, non_blocking=...)`` (as torch_geometric's
    ``Data`` or a Pinnable batch class) moves itself.
    """
    return map_batch(obj, lambda t, _: t.to(device, non_blocking=non_blocking),
                     hook=_method_hook("to", device, non_blocking=non_blocking),
                     remedy="to(device, non_blocking=False)")


def _record_stream(obj: Any, stream: Any) -> None:
    """Tell the caching allocator the consumer's stream uses these tensors (no early reuse)."""
    for t in tensors_in(obj):
        if t.is_cuda:
            t.record_stream(stream)


_DONE = object()  # the end of a prefetcher's pass
_RESTART_WAIT_S = 60.0  # how long a new pass waits for the previous pass's producer to leave the source


def _prefetch_device(device: torch.device | str | int | None) -> torch.device:
    """The device a DevicePrefetcher delivers to, with a CUDA index always set (from the caller's thread)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise InvalidArgument(f"DevicePrefetcher(device={device!r}) but torch sees no CUDA device; pass "
                              "device=None (CUDA when there is one) or 'cpu'", device=str(device))
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class _Feed:
    """One pass of a prefetcher: its bounded queue, stop flag and producer thread."""

    def __init__(self, depth: int, poll: float) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.poll = poll
        self.thread: threading.Thread | None = None

    def get(self) -> Any:
        while True:
            try:
                return self.queue.get(timeout=self.poll)
            except queue.Empty:
                if self.thread is not None and not self.thread.is_alive() and self.queue.empty():
                    return _DONE

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=self.poll)
                return True
            except queue.Full:
                continue
        return False

    def wait_stopped(self, timeout: float) -> None:
        """Wait for the producer to leave the source (it stops after its current ``next()``)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(f"DevicePrefetcher: the previous pass is still waiting on the source's next() "
                                   f"after {timeout:.0f} s; a new pass would read the source from a second thread")

    def close(self) -> None:
        self.stop.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)


class DevicePrefetcher:
    """Iterate batches already on ``device``, prepared ``depth`` ahead on a background thread.

    >>> for batch in DevicePrefetcher(loader, device="cuda:0"):
    ...     loss = model(batch["x"])         # consumption is fenced on the copy's event

    ``device=None`` is the current CUDA device when there is one, else the CPU; ``"cuda"``
    means the current CUDA device (``torch.cuda.set_device(local_rank)`` first). On a CPU
    device it is a transparent pass-through. Every iteration is a fresh pass over
    ``iterable``. Exceptions from the source reach the consumer; ``close()`` (or leaving
    the ``with`` block) stops the thread promptly.
    """

    def __init__(self, iterable: Iterable[Any], device: torch.device | str | int | None = None,
                 depth: int = 2, timeout_s: float = 0.1) -> None:
        self.device = _prefetch_device(device)
        self._source = iterable
        self._depth = integer("depth", depth, 1)
        self._poll = seconds("timeout_s", timeout_s, finite=True)
        self._feed: _Feed | None = None

    @property
    def passthrough(self) -> bool:
        return self.device.type != "cuda"

    def __iter__(self) -> Iterator[Any]:
        if self.passthrough:
            yield from self._source
            return
        if self._feed is not None:  # a pass still running ends before this one starts: one thread drives
            self._feed.close()      # the source at a time (a shared iterator must not be read twice over)
            self._feed.wait_stopped(_RESTART_WAIT_S)
        feed = self._feed = _Feed(self._depth, self._poll)
        feed.thread = threading.Thread(target=self._produce, args=(feed,), name="stoker-prefetch", daemon=True)
        feed.thread.start()
        try:
            while True:
                item = feed.get()
                if item is _DONE:
                    return
                kind, payload, event = item
                if kind == "error":
                    raise payload
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)  # fence: the consumer's kernels wait for the copy, the host does not
                _record_stream(payload, stream)
                yield payload
        finally:
            feed.close()

    def _produce(self, feed: "_Feed") -> None:
        try:
            # A new thread starts on CUDA device 0: make the prefetch device current, so that nothing
            # this thread does (pinning, allocator state, a context) lands on GPU 0 on every rank.
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
            for batch in self._source:
                if feed.stop.is_set():
                    return
                pinned = pin_object(batch)  # CUDA is available here: pins, never warns
                with torch.cuda.stream(stream):
                    moved = to_device(pinned, self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                if not feed.put(("batch", moved, event)):
                    return
            feed.put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            feed.put(("error", exc, None))

    def close(self) -> None:
        """Stop the background thread (returns within about ``timeout_s``)."""
        if self._feed is not None:
            self._feed.close()

    def __enter__(self) -> "DevicePrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
