"""Where a sample's fields lie, and whether a flip or transpose keeps them over one another.

``RandomFlip`` and ``RandomTranspose`` change each field of a batch in its own voxels: a flip turns a field's
box about its own centre, a transpose swaps its axes about its own diagonal. The fields stay over one another
only when their centres coincide on the axes changed and, for a transpose, when each field's voxels have one
spacing on the axes it swaps. The pipeline knows the boxes (a :class:`~stoker.Field`'s offset, extent and
scale; a :class:`~stoker.Sample`'s boxes and its arrays' OME-Zarr levels) and checks them before the first
batch through :func:`check_layout`; the batch itself carries no geometry.

>>> layout = {"raw": FieldBox((96, 96), (1.0, 1.0)), "labels": FieldBox((56, 56), (1.0, 1.0))}
>>> check_layout(find_geometric(RandomFlip(axes=(-2, -1))), layout, "RandomCrops volume 0")
Traceback (most recent call last):
InvalidArgument: RandomFlip(...): RandomCrops volume 0: the fields' boxes have other centres ...
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import itertools
import types
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Sequence

from ..errors import InvalidArgument

#: how far two voxel spacings (floats from OME-Zarr metadata) may differ relatively and still be one spacing
_TOLERANCE = 1e-6
#: how deep find_geometric looks into a transform's attributes, closures and containers for the built-ins
_DEPTH = 4
#: how many items of one container (list, dict, an object's attributes) find_geometric looks at, and how many
#: objects in all (a wrapper holding a large model is not walked through)
_ITEMS = 64
_OBJECTS = 500
#: what holds no transform: not walked into
_LEAVES = (str, bytes, int, float, complex, type(None), type, types.ModuleType)


class FieldBox(NamedTuple):
    """One field of a sample: ``centre2`` twice its box's centre per axis of the box, in reference voxels from
    an origin the sample's fields share (twice, so it is an integer); ``spacing`` the extent of one of its
    voxels per axis (physical units from OME-Zarr metadata, else reference voxels: only their ratios within a
    field count); ``offset`` and ``scale`` a :class:`~stoker.Field`'s (None for a sample's box), to say which
    offset would centre it (a multiple of the scale)."""

    centre2: tuple[int, ...]
    spacing: tuple[float, ...]
    offset: tuple[int, ...] | None = None
    scale: tuple[int, ...] | None = None


Layout = Mapping[str, FieldBox]  # field name -> its box ("" for a sample of one box)


def find_geometric(transform: Any) -> list[Any]:
    """The flips and transposes in ``transform`` that turn fields about their shared centre (the built-ins, and
    any object with a ``check_layout`` method and an ``about`` other than ``"own_centre"``): itself, the members
    of a :class:`~.compose.Compose` or list, and those a wrapper of one's own holds: in its attributes (its own
    and its classes'), a closure, a ``functools.partial``, a bound method, the module globals a function's
    code names; breadth first, ``_DEPTH`` steps deep, ``_ITEMS`` items of a container, ``_OBJECTS`` objects
    in all. Looked up statically (no ``__getattr__`` of the user's runs); an object raising is skipped. Not
    found: a flip created lazily on the first call, or beyond those bounds.

    >>> flip = RandomFlip()
    >>> find_geometric(lambda b, k: flip(b, k)) == [flip]
    True
    """
    found: list[Any] = []
    seen: set[int] = set()
    queue = collections.deque([(transform, 0)] if not issubclass(type(transform), _LEAVES) else [])  # breadth first: what a wrapper holds itself is found first
    while queue and len(seen) < _OBJECTS:
        obj, depth = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:  # a user's object may answer any attribute (a dict with __getattr__) or raise on any: skipped
            about = _geometric(obj)
            if about is not None:
                if about != "own_centre":
                    found.append(obj)
            elif depth < _DEPTH:
                queue.extend((item, depth + 1) for item in itertools.islice(_parts(obj), _ITEMS)
                             if not issubclass(type(item), _LEAVES))
        except Exception:  # noqa: BLE001 - what cannot be walked holds nothing found
            continue
    return found


def _geometric(obj: Any) -> Any:
    """``obj.about`` when ``obj`` is a flip or transpose to check (its class defines ``check_layout``, it has
    an ``about``), else None; looked up without running a ``__getattr__`` of the object's own."""
    if not callable(inspect.getattr_static(obj, "check_layout", None)):
        return None
    about = inspect.getattr_static(obj, "about", None)
    if isinstance(about, property):
        return obj.about
    if isinstance(about, types.MemberDescriptorType):  # a slot's (``__slots__``, ``dataclass(slots=True)``)
        return _slot(obj, "about")
    return about


def _parts(obj: Any) -> Iterable[Any]:
    """What ``obj`` may hold a transform in: a container's items, a partial's function and arguments, a
    function's closure, an object's attributes (torch tensors and numpy arrays hold none)."""
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, Mapping):
        return obj.values()
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, (staticmethod, classmethod)):
        return [obj.__func__]
    if isinstance(obj, property):
        return [obj.fget]
    if isinstance(obj, types.FunctionType):  # its closure, and the module globals its code names (FLIP(batch))
        used = [obj.__globals__[n] for n in _globals_loaded(obj.__code__) if n in obj.__globals__]
        return [c.cell_contents for c in obj.__closure__ or () if _filled(c)] + used
    if _foreign(type(obj)):
        return []
    # object's own lookup: no __getattr__ or __getattribute__ of the object's class runs
    own = _slot(obj, "__dict__")  # None for an object of slots only
    parts = list(own.values()) if isinstance(own, dict) else []
    parts += [_slot(obj, s) for s in getattr(type(obj), "__slots__", ()) if isinstance(s, str)]
    for cls in type(obj).__mro__:  # its classes' attributes (a flip as a class attribute) and methods
        if not _foreign(cls) and not cls.__module__.startswith("stoker."):
            parts += [v for k, v in vars(cls).items() if k not in _CLASS_PLUMBING]
    return parts


#: what every class holds and no transform is in
_CLASS_PLUMBING = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__slots__",
                             "__annotations__", "__parameters__", "__orig_bases__", "__abstractmethods__",
                             "_abc_impl"})


def _foreign(cls: type) -> bool:
    """A class of torch, numpy or the builtins: its objects hold no transform of the user's."""
    return str(getattr(cls, "__module__", "")).split(".")[0] in ("torch", "numpy", "builtins")


def _globals_loaded(code: types.CodeType) -> list[str]:
    """The global names ``code`` loads (``FLIP(b, k)``), not every name it holds: ``co_names`` has attribute
    and method names too, and ``x.flip(-1)`` must not find a module's unrelated ``flip = RandomFlip()``."""
    return [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
            and isinstance(i.argval, str)]


def _slot(obj: Any, name: str) -> Any:
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:  # a slot not yet assigned
        return None


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def check_layout(transforms: Sequence[Any], layout: Layout, where: str) -> None:
    """InvalidArgument (from the first of ``transforms`` it breaks) where the fields of ``layout`` would not
    stay over one another; ``where`` names the samples in the message (a source's volume, a sample)."""
    for t in transforms:
        t.check_layout(layout, where)


def centres_apart(layout: Layout, axes: Sequence[int]) -> list[int]:
    """Those of ``axes`` (trailing, negative) on which the fields' centres differ (fields of fewer axes, whose
    channel axis that is, left out)."""
    apart = []
    for a in axes:
        centres = {box.centre2[a] for box in layout.values() if len(box.centre2) >= -a}
        if len(centres) > 1:
            apart.append(a)
    return apart


def uneven(box: FieldBox, axes: Sequence[int]) -> bool:
    """Whether ``box``'s voxels have other spacings on ``axes`` (those it has)."""
    spacing = [box.spacing[a] for a in axes if len(box.spacing) >= -a]
    return bool(spacing) and max(spacing) - min(spacing) > _TOLERANCE * max(abs(s) for s in spacing)


def describe(layout: Layout, axes: Sequence[int]) -> str:
    """Each field's centre on ``axes`` for a message: ``'raw' (48, 48), 'labels' (28, 28)``."""
    def centre(box: FieldBox) -> str:
        values = [box.centre2[a] / 2 for a in axes if len(box.centre2) >= -a]
        return "(" + ", ".join(f"{v:g}" for v in values) + ")"
    return ", ".join(f"{name!r} {centre(box)}" for name, box in layout.items())


def apart_error(who: str, layout: Layout, axes: Sequence[int], apart: Sequence[int], where: str,
                verb: str, done: str, least: int = 1) -> InvalidArgument:
    """The InvalidArgument for fields whose centres differ on ``apart`` (of the transform's ``axes``): first the
    axes that would pass, then how to centre the fields (a Field's offset that does, where a whole multiple of
    its scale does), then ``about``."""
    keep = [a for a in axes if a not in apart]
    first = next(iter(layout.values()))
    only = f"{verb} only the axes where they are centred (axes={tuple(keep)}), " if len(keep) >= least else ""
    if first.offset is None:  # a Sample's boxes: no offset to give
        centre = ("where they are to overlap, centre the fields' boxes on one another (each box's start + end, times its array's scale, the "
                  "same on those axes for every field)")
    else:
        fixes, stuck = _offsets(layout, apart)
        centre = ("where they are to overlap, centre the fields' boxes on one another (a Field's offset = the first field's offset + (its "
                  "extent - this field's extent) / 2, in reference voxels")
        if fixes:
            centre += f"; here offset={', '.join(f'{o} for {n!r}' for n, o in fixes.items())}"
        if stuck:
            centre += (f"; no offset centres {', '.join(map(repr, stuck))}, that gives a half voxel or no multiple "
                       "of its scale: change its extent or the first field's, the two in reference voxels differing "
                       "by an even multiple of its scale")
        centre += ")"
    advice = only + centre
    return InvalidArgument(
        f"{who}: {where}: the fields' boxes have other centres on axes {tuple(apart)} (reference voxels"
        f"{' from the anchor' if first.offset is not None else ''}: "
        f"{describe(layout, apart)}); each field is {done} about its own centre, so after it the fields would "
        f"no longer lie over one another (a label box beside its raw box). {advice[0].upper()}{advice[1:]}, or "
        f"pass about='own_centre' to {verb} each field about its own centre anyway", knob="about")


def _offsets(layout: Layout, apart: Sequence[int]) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The offsets that centre each Field on the first field that has the axis, on ``apart``; and the fields no
    offset centres (a half voxel, or not a multiple of the field's scale)."""
    fixes: dict[str, tuple[int, ...]] = {}
    stuck: list[str] = []
    for name, box in layout.items():
        if box.offset is None:
            continue
        scale = box.scale or (1,) * len(box.offset)
        new, ok = list(box.offset), True
        for i, (o, c, s) in enumerate(zip(box.offset, box.centre2, scale)):
            a = i - len(box.centre2)
            ref = next((b.centre2[a] for b in layout.values() if len(b.centre2) >= -a), c)
            if a not in apart or ref == c:
                continue
            twice = 2 * o + ref - c  # 2 * the offset whose centre is ref's
            if twice % 2 or (twice // 2) % s:
                ok = False
                break
            new[i] = twice // 2
        if not ok:
            stuck.append(name)
        elif tuple(new) != tuple(box.offset):
            fixes[name] = tuple(new)
    return fixes, stuck
