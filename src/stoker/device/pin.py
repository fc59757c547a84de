"""Pinning that really pins custom batches, and moving them to a device.

``DataLoader(pin_memory=True)`` silently skips batch types it does not know, so a
custom batch crosses PCIe from pageable memory at a fraction of the bandwidth.
:func:`pin_object` walks the batch and pins every tensor and numpy array in it,
or says exactly which leaf it could not pin:

>>> batch = pin_object({"x": torch.randn(8, 3), "meta": Meta(coords=np.zeros((8, 3)))})
>>> pin_object(Batch(streams=[..., Opaque()]))
TypeError: cannot pin batch.streams[2].coords (Opaque holds array data): implement pin_memory() ...

:func:`to_device` moves such a batch; :class:`~stoker.device.prefetch.DevicePrefetcher` does both ahead of
the consumer.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import torch

from ..runtime.memo import remember

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


def _slot_names(cls: type) -> tuple[str, ...]:
    """The slots of ``cls`` and of every class it derives from (a subclass's ``__slots__`` names only its own;
    a string is one name; a private ``__x`` is stored mangled), without ``__dict__`` and ``__weakref__``; kept
    per class (asked for every object of each batch)."""
    held = _SLOTS.get(cls)
    if held is not None:
        return held
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    return remember(_SLOTS, cls, tuple(names), 1024)


_SLOTS: dict[type, tuple[str, ...]] = {}


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s own attributes, ``(name, value)``: those in its ``__dict__``, then its slots that are set."""
    attrs = list(getattr(obj, "__dict__", {}).items())
    for name in _slot_names(type(obj)):
        try:
            attrs.append((name, object.__getattribute__(obj, name)))
        except AttributeError:  # a slot never set
            pass
    return attrs


def _shallow_copy(obj: Any, path: str) -> Any:
    """A shallow copy of the dataclass ``obj``, never ``obj`` itself: a ``__copy__`` that returns ``self`` (an
    immutable type's) would have its attributes replaced in place, the caller's batch moved under it."""
    new = copy.copy(obj)
    if new is not obj:
        return new
    try:
        new = object.__new__(type(obj))
    except TypeError as exc:
        raise TypeError(f"cannot move {path}: {type(obj).__name__}.__copy__ returns the object itself, and stoker "
                        f"cannot make a copy to move into ({exc}); return a copy from __copy__, or implement "
                        "pin_memory() and to() (see stoker.device.pin.Pinnable)") from exc
    for name, value in _attributes(obj):
        object.__setattr__(new, name, value)
    return new


def _find_array_leaf(obj: Any, path: str, depth: int = 0) -> str | None:
    """Path of the first attribute holding array data inside an unknown object, if any."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or _holds_array_data(obj):
        return path
    if depth > 4 or isinstance(obj, _SCALARS):
        return None
    if isinstance(obj, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, deque, set, frozenset)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        items = [(f"{path}.{k}", v) for k, v in _attributes(obj)]
    for p, v in items:
        found = _find_array_leaf(v, p, depth + 1)
        if found:
            return found
    return None


def map_batch(obj: Any, leaf: Callable[[torch.Tensor, str], torch.Tensor], path: str = "batch",
              hook: Callable[[Any], Any] | None = None, remedy: str = "pin_memory()") -> Any:
    """Rebuild ``obj`` with ``leaf(tensor, path)`` applied to every tensor (numpy arrays become tensors).

    Containers keep their types: dicts (a subclass its attributes, a defaultdict its default_factory), lists,
    tuples, namedtuples, deques (their maxlen), sets, frozensets, dataclasses (a copy, its fields mapped and its
    other attributes' tensors in containers too, their other leaves and dunder attributes kept as they are:
    ``__init__`` and ``__post_init__`` are not run again). ``hook(obj)`` lets an object handle itself (e.g.
    call its own ``pin_memory()``, the :class:`Pinnable` protocol); it returns
    ``NotImplemented`` for objects it does not apply to. Scalars and strings pass
    through; any other object that holds array data raises ``TypeError`` naming the
    path to the leaf and the ``remedy`` (the method its type should implement; where it has that method and
    the hook declined it, that it is no such move). An object met twice (a tensor in two places) is mapped
    once, both places holding the one result as in ``obj``; a batch that contains itself is a ``TypeError``.

    >>> t = torch.zeros(3)
    >>> out = map_batch({"a": t, "b": [t]}, lambda x, path: x.clone())
    >>> out["a"] is out["b"][0]
    True
    """
    return _Mapper(leaf, hook, remedy).map(obj, path)


class _Mapper:
    """One :func:`map_batch` call: what was mapped so far, by the input's id (with the input, so that its id
    is not reused by another object meanwhile), and the paths of the containers being rebuilt (a cycle)."""

    def __init__(self, leaf: Callable[[torch.Tensor, str], torch.Tensor], hook: Callable[[Any], Any] | None,
                 remedy: str) -> None:
        self.leaf, self.hook, self.remedy = leaf, hook, remedy
        self.done: dict[int, tuple[Any, Any]] = {}  # id(input) -> (input, its result)
        self.open: dict[int, str] = {}  # id(input) -> its path, while it is being rebuilt

    def map(self, obj: Any, path: str) -> Any:
        if isinstance(obj, _SCALARS):
            return obj
        held = self.done.get(id(obj))
        if held is not None:  # a tensor met again: its one copy (two would double the memory and part aliases)
            return held[1]
        if id(obj) in self.open:
            raise TypeError(f"cannot move {path}: it is {self.open[id(obj)]} again (the batch contains itself), and "
                            "a batch with a reference cycle cannot be rebuilt; hold a key or an index in place of "
                            "the reference")
        self.open[id(obj)] = path
        try:
            out = self._rebuilt(obj, path)
        finally:
            del self.open[id(obj)]
        self.done[id(obj)] = (obj, out)
        return out

    def _rebuilt(self, obj: Any, path: str) -> Any:
        leaf, hook, remedy, walk = self.leaf, self.hook, self.remedy, self.map
        if isinstance(obj, torch.Tensor):
            return leaf(obj, path)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.kind in "USV":
                raise TypeError(f"cannot move {path}: numpy array of {obj.dtype} holds no numeric data")
            # C order in the native byte order (torch refuses a big-endian array, as zarr v2 stores '>i4'); not
            # np.ascontiguousarray, which makes a 0-d array (a per-batch weight) one of shape (1,)
            return leaf(torch.from_numpy(np.asarray(obj, dtype=obj.dtype.newbyteorder("="), order="C")), path)
        refused: BaseException | None = None  # what the object's own method raised, where the hook declined it so
        if hook is not None and not isinstance(obj, (Mapping, list, tuple)):
            handled = hook(obj)
            if isinstance(handled, _Declined):
                refused = handled.error
            elif handled is not NotImplemented:
                return handled

        if isinstance(obj, Mapping):
            items = {k: walk(v, f"{path}[{k!r}]") for k, v in obj.items()}
            if type(obj) is dict:
                return items
            return _rebuilt_mapping(obj, items, lambda name, v: walk(v, f"{path}.{name}"))
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*(walk(v, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{path}[{i}]") for i, v in enumerate(obj))
        if isinstance(obj, deque):  # a history of frames: neither list nor tuple, so it was passed over unmoved
            return type(obj)((walk(v, f"{path}[{i}]") for i, v in enumerate(obj)), obj.maxlen)
        if isinstance(obj, (set, frozenset)):
            return type(obj)(walk(v, f"{path}{{{i}}}") for i, v in enumerate(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # a copy, its attributes set: not dataclasses.replace, whose __init__ runs __post_init__ again (a
            # scaling there applied twice, silently) and refuses an InitVar; the attributes __post_init__ made,
            # and those set since, are mapped with the fields (a mask derived there is moved too)
            new = _shallow_copy(obj, path)
            fields = {f.name for f in dataclasses.fields(obj)}
            for name, value in _attributes(obj):
                # a field is mapped; another attribute leniently (a mask made by __post_init__, a list of a
                # tensor and a helper: its tensors moved), its other leaves (a helper object, an enum, a model)
                # as they are; a dunder one (typing's __orig_class__, a Generic's: a class) is never walked
                if name in fields:
                    object.__setattr__(new, name, walk(value, f"{path}.{name}"))  # (a frozen one's too)
                elif not (name.startswith("__") and name.endswith("__")):
                    object.__setattr__(new, name, self.lenient(value, f"{path}.{name}"))
            return new
        found = _find_array_leaf(obj, path)
        if found is not None:
            name = type(obj).__name__
            method = remedy.split("(", 1)[0]
            if callable(getattr(obj, method, None)):  # it has one, which the hook found no move (to_device's)
                why = f"{type(refused).__name__}: {refused}" if refused is not None else "it refused the device"
                fix = (f"its own {method}() is no device move ({why}); put its values in the batch as a tensor, or "
                       f"in a dataclass, or make its {remedy} work")
            else:
                fix = f"implement {remedy} on {name} (see stoker.device.pin.Pinnable) or make it a dataclass"
            raise TypeError(f"cannot move {found} ({name} at {path} holds array data stoker does not know how to "
                            f"reach): {fix}") from refused
        return obj


    def lenient(self, value: Any, path: str, depth: int = 0) -> Any:
        """A dataclass's attribute that is no field, mapped leniently: its tensors and numeric arrays, in dicts,
        lists, tuples, sets, deques (at most 6 deep) and dataclasses, are mapped (a tensor beside an enum or a
        helper object too, not left behind); any other leaf (an object of the user's own, an enum, a class)
        passes as it is, never a TypeError. A container holding no tensor is the input itself."""
        if isinstance(value, torch.Tensor):
            return self.map(value, path)
        if isinstance(value, np.ndarray):
            return value if value.dtype.hasobject or value.dtype.kind in "USV" else self.map(value, path)
        if isinstance(value, (_SCALARS, type)) or depth >= _MAX_OBJECT_DEPTH or id(value) in self.open:
            return value  # (a reference back to a container being rebuilt: as it is, no cycle error)
        held = self.done.get(id(value))
        if held is not None:
            return held[1]
        if dataclasses.is_dataclass(value):
            return self.map(value, path)
        out = self._lenient_container(value, path, depth)
        if out is not value:  # met again (in another attribute): the one copy, as map_batch maps objects
            self.done[id(value)] = (value, out)
        return out

    def _lenient_container(self, value: Any, path: str, depth: int) -> Any:
        """:meth:`lenient`'s containers: rebuilt where they hold a tensor, else as they are."""
        walk = self.lenient
        if isinstance(value, Mapping):
            items = {k: walk(v, f"{path}[{k!r}]", depth + 1) for k, v in value.items()}
            if all(items[k] is v for k, v in value.items()):
                return value
            if type(value) is dict:
                return items
            return _rebuilt_mapping(value, items, lambda name, v: walk(v, f"{path}.{name}", depth + 1))
        if isinstance(value, (list, tuple, deque, set, frozenset)):
            names = value._fields if isinstance(value, tuple) and hasattr(value, "_fields") else None
            mapped = [walk(v, f"{path}.{names[i]}" if names else f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
            if all(m is v for m, v in zip(mapped, value)):
                return value
            if names is not None:
                return type(value)(*mapped)
            if isinstance(value, deque):
                return type(value)(mapped, value.maxlen)
            return type(value)(mapped)
        return value


class _Declined:
    """What a :func:`map_batch` hook returns for an object whose own method it called and found no such move
    (NotImplemented, with what that method raised: the TypeError naming the object's leaves says it and
    is caused by it, so a ``to()`` that merely lacks ``non_blocking`` is not taken for a unit conversion)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _rebuilt_mapping(obj: Mapping, items: dict, attribute: Callable[[str, Any], Any]) -> Any:
    """``obj``'s type holding ``items`` (its values mapped), with ``obj``'s own attributes (a RecordBatch's
    ``num_samples``) mapped by ``attribute(name, value)`` (as a dataclass's fields are: a tensor attribute, a
    batch's mask, is moved with its items, not left behind on the CPU), else a plain dict of them.

    Built from the items where the constructor takes them; an attribute that would put other items back
    (a UserDict's ``data``: the input's, unmoved) is not copied. A dict subclass whose constructor wants
    more (a defaultdict's factory, a batch class's own arguments) is copied and its items replaced; a
    copy's storage is its own only for a dict, so another mapping is never filled through a shared one.
    """
    def holds_items(m: Any) -> bool:
        return len(m) == len(items) and all(k in m and m[k] is v for k, v in items.items())

    try:
        rebuilt = cast(Any, type(obj))(items)
    except TypeError:
        if not isinstance(obj, dict):
            return items
        rebuilt = copy.copy(obj)
        rebuilt.update(items)
        if not holds_items(rebuilt):
            return items
        for name, value in _attributes(rebuilt):  # the copy's are the input's: mapped (a dict keeps no items there)
            _set_attribute(rebuilt, name, attribute(name, value))
        return rebuilt if holds_items(rebuilt) else items
    for name, value in _attributes(obj):
        had = _get_attribute(rebuilt, name)
        if not _set_attribute(rebuilt, name, value):
            continue
        if not holds_items(rebuilt):  # the attribute was the items' storage: keep the rebuilt one
            _set_attribute(rebuilt, name, had)
        else:  # an attribute of its own: mapped (not walked before this test: the storage is walked once)
            _set_attribute(rebuilt, name, attribute(name, value))
    return rebuilt if holds_items(rebuilt) else items


def _get_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own attribute ``name`` (in its ``__dict__`` or a slot), or :data:`_MISSING`."""
    held = getattr(obj, "__dict__", {})
    if name in held:
        return held[name]
    try:
        return object.__getattribute__(obj, name) if name in _slot_names(type(obj)) else _MISSING
    except AttributeError:
        return _MISSING


def _set_attribute(obj: Any, name: str, value: Any) -> bool:
    """Set (or, to :data:`_MISSING`, delete) ``obj``'s own attribute ``name``: a slot where its type has one,
    else in its ``__dict__`` (no ``__setattr__`` of its own run). False where it can hold no such attribute."""
    if name in _slot_names(type(obj)):
        if value is _MISSING:
            try:
                object.__delattr__(obj, name)
            except AttributeError:
                pass
        else:
            object.__setattr__(obj, name, value)
        return True
    held = getattr(obj, "__dict__", None)
    if held is None:
        return False
    if value is _MISSING:
        held.pop(name, None)
    else:
        held[name] = value
    return True


_MISSING = object()


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
    by a shorter path (so a deep path seen first cannot hide what a short one reaches): cycles end. A
    mapping's own attributes are walked with its items (a batch dict's mask, which :func:`map_batch` moves);
    a tensor is yielded once, however many ways lead to it (a UserDict's items, and its ``data``)."""
    walked: dict[int, int] = {}  # id -> fewest plain objects passed on the way, when it was walked
    found: set[int] = set()  # the tensors yielded (held by ``obj``: their ids are not reused meanwhile)
    todo = [(obj, 0)]
    while todo:
        obj, in_objects = todo.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in found:
                found.add(id(obj))
                yield obj
            continue
        if isinstance(obj, (_SCALARS, np.ndarray)) or walked.get(id(obj), _MAX_OBJECT_DEPTH + 1) <= in_objects:
            continue
        walked[id(obj)] = in_objects
        if isinstance(obj, Mapping):
            values = list(obj.values()) + list(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, (list, tuple, deque, set, frozenset)):
            values = list(obj)
        elif in_objects < _MAX_OBJECT_DEPTH:
            in_objects += 1
            values = [v for _, v in _attributes(obj)]
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


#: What a ``to`` that is no device move raises given a device (pint's Quantity, whose ``to`` converts units:
#: AttributeError or its own TypeError; a unit table: KeyError; a parser: ValueError). Not RuntimeError: a
#: device's own failure (out of memory) is raised, never taken for "no device move".
_NOT_A_MOVE = (TypeError, AttributeError, LookupError, ValueError)


def _move_hook(device: torch.device, non_blocking: bool) -> Callable[[Any], Any]:
    """:func:`to_device`'s hook: an object with a ``to`` is moved by ``obj.to(device, non_blocking=...)``.
    A module and a Pinnable (one with ``pin_memory()`` too: torch_geometric's ``Data``) declare that is a
    device move: what it raises is raised. Any other object's ``to`` may be something else (pint's Quantity
    converts units with it): where it refuses a device (raises one of :data:`_NOT_A_MOVE`) the object is taken
    as one without a ``to`` (:class:`_Declined`: :func:`map_batch` passes it as it is, or names the tensors it
    holds), with a RuntimeWarning naming its type."""
    def hook(obj: Any) -> Any:
        fn = getattr(obj, "to", None)
        if not callable(fn):
            return NotImplemented
        if isinstance(obj, torch.nn.Module) or callable(getattr(obj, "pin_memory", None)):
            return fn(device, non_blocking=non_blocking)
        try:
            return fn(device, non_blocking=non_blocking)
        except _NOT_A_MOVE as exc:
            warnings.warn(f"stoker.to_device: a {type(obj).__name__} was not moved: its "
                          f"to(device, non_blocking={non_blocking}) refused the device ({type(exc).__name__}: "
                          f"{exc}), so it is no device move (a unit conversion?); it is taken as an object "
                          "without to(): passed as it is, or named if it holds array data", RuntimeWarning,
                          stacklevel=2)
            return _Declined(exc)
    return hook


def to_device(obj: T, device: torch.device, non_blocking: bool = True) -> T:
    """``obj`` with every tensor moved to ``device`` (same traversal and types as :func:`pin_object`).

    An object with its own ``to(device, non_blocking=...)`` (as torch_geometric's ``Data``, a Pinnable batch
    class, a module) moves itself. A ``to`` that refuses a device is no device move (pint's Quantity converts
    units with its ``to``): such an object passes as it is (with a RuntimeWarning naming it), or is a
    TypeError naming where it holds tensors; it is never called with anything but the device.
    """
    return map_batch(obj, lambda t, _: t.to(device, non_blocking=non_blocking),
                     hook=_move_hook(device, non_blocking), remedy="to(device, non_blocking=False)")
