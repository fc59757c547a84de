"""The scale of an OME-Zarr pyramid level relative to its level 0, from the image's ``multiscales`` metadata.

>>> level_scale("/data/raw.ome.zarr/2")          # an image whose level 2 is 4x coarser in y and x
(1, 4, 4)
>>> level_scale("/data/plain.zarr") is None       # not a level of an OME-Zarr image (or level 0): scale 1
True

The image group holds the metadata: the array's parent, or the group above that a nested dataset ``path``
(``"s/1"``) is relative to. OME-Zarr 0.5 (Zarr v3) under ``attributes["ome"]["multiscales"]``,
0.4 (Zarr v2 ``.zattrs``, or a v3 group's attributes) under ``"multiscales"``. Each dataset names its
``path`` and its ``coordinateTransformations``; the ``scale`` transform of the level over that of the first
dataset (level 0) is the number of level-0 voxels one of the level's voxels spans, per axis. The
multiscale's own transforms apply to every level alike and cancel in that ratio.

A label image (``image-label`` in its group's metadata, at ``<image>/labels/<name>`` as the spec has it) is a
pyramid of its own, and its level 0 may be coarser than its image's (a segmentation at half the resolution):
its levels are placed over the level 0 of the image that holds it, the label's own level 0 over that and each
level over the label's level 0. The two level-0 arrays' shapes decide (one metadata read each): the same shape
is scale 1 on every axis, whatever the physical scales say (ome-zarr-py writes a label image at scale 1 when
given no transforms, over an image in micrometres); another shape takes the ratio of their physical scales
(the multiscales' own transforms included), which must be whole, make the label's shape from the image's
(rounded down or up) and come with translations that agree, else a MetadataError says to pass the scale.

stoker places voxel ``i`` of a level of scale ``r`` over level-0 voxels ``[i * r, (i + 1) * r)``. A level's
``translation`` relative to level 0's must say the same: 0, or the half-voxel shift ``(r - 1) / 2`` level-0
voxels that block-downsampling writers (ome-zarr-py) record; any other shift (a level covering a part of the
image) is a MetadataError, never a context read from the wrong place.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Callable, Iterator, NamedTuple

from ..errors import MetadataError
from ..storage.hierarchy import read_group_node
from ..storage.local import read_regular
from ..storage import default_store
from ..storage.locate import Stores, default_stores, locate

#: how far a ratio of float scales may be from an integer and still be that integer (they are written as
#: products of floats, e.g. 0.36039815 * 4)
_TOLERANCE = 1e-6
#: How many groups above an array are asked whether their ``multiscales`` list it: a dataset ``path`` is
#: relative to its image group and may be nested (``"s/1"``, two folders below it); the search stops at the
#: first group that has ``multiscales``, listing the array or not, or at a node that is no group (folders with
#: no document are stepped over).
MAX_PATH_DEPTH = 4


def level_scale(uri: str | os.PathLike, storage_options: dict | None = None,
                stores: Stores | None = None, nodes: Nodes | None = None) -> tuple[int, ...] | None:
    """Per axis, how many level-0 voxels one voxel of the array at ``uri`` spans, when the array is a level
    of an OME-Zarr image (the ``multiscales`` of its parent, or of the nearest group above that has them,
    list its path below that group; a level of a label image: over its parent image's level 0); None for level
    0 and for an array that is no such level (both span one reference voxel per voxel). A level whose scale
    is missing, or not a whole multiple of level 0's, is a :class:`~stoker.errors.MetadataError` that says
    to give the scale explicitly. ``nodes``: the local groups read so far (see :data:`Nodes`)."""
    uri = os.fspath(uri)
    ancestors = _ancestor_attributes(uri, storage_options, stores, nodes)
    for attrs, name in ancestors:
        multiscales = _multiscales(attrs)
        if multiscales is None:
            continue  # a plain group between the array and its image group (a nested dataset path)
        for multiscale in multiscales:
            datasets = multiscale.get("datasets") if isinstance(multiscale, dict) else None
            if not isinstance(datasets, list) or not datasets:
                continue
            paths = [_dataset_path(d) for d in datasets]
            if name not in paths:
                continue
            level = paths.index(name)
            for i in {0, level}:
                if not isinstance(datasets[i], dict):
                    raise MetadataError(
                        f"{uri}: dataset {i} of the OME-Zarr multiscales above it is {datasets[i]!r}, not an object "
                        "with a path and coordinateTransformations; fix the image's multiscales metadata, or pass "
                        "the scale explicitly (Field(..., scale=...), Mask(..., scale=...))", uri=uri)
            own = None
            if level > 0:  # the multiscale's own transforms apply to both levels alike: left out, they cancel
                base = (_scale(datasets[0], uri, paths[0]), _transform(datasets[0], "translation", uri, paths[0]))
                own = _ratios(base, (_scale(datasets[level], uri, name),
                                     _transform(datasets[level], "translation", uri, name)), uri, name,
                              f"level {paths[0]!r}")
            if not _is_label_image(attrs):
                return own  # level 0 is the reference: scale 1 on every axis (None, whatever its rank)
            # a label image's level 0 is placed over its parent image's level 0 (see _parent_base), and its
            # levels over its level 0, each step checked on its own (a writer may shift one and not the other)
            parent = _parent_base(ancestors, name, uri, _axis_names(multiscale))
            first = None if parent is None else \
                _label_over_image(parent, _physical(multiscale, datasets[0], uri, paths[0]), uri, name, paths[0],
                                  storage_options, stores)
            if first is None or own is None:
                return first or own
            return tuple(a * b for a, b in zip(first, own))
        return None  # the nearest image group does not list the array: no level of it
    return None


Transform = tuple["list[float] | None", "list[float] | None"]


def physical_spacing(uri: str | os.PathLike, storage_options: dict | None = None,
                     stores: Stores | None = None, nodes: Nodes | None = None) -> tuple[float, ...] | None:
    """The physical extent of one voxel of the array at ``uri`` per axis, when it is a level of an OME-Zarr image
    (its dataset's ``scale``, the multiscale's own applied); None for an array no multiscales list, or a level
    without a scale. What a transpose must keep equal on the axes it swaps.

    >>> physical_spacing("/data/em.ome.zarr/0")       # 4 nm sections, 1 nm pixels
    (4.0, 1.0, 1.0)
    """
    uri = os.fspath(uri)
    for attrs, name in _ancestor_attributes(uri, storage_options, stores, nodes):
        multiscales = _multiscales(attrs)
        if multiscales is None:
            continue
        for multiscale in multiscales:
            datasets = multiscale.get("datasets") if isinstance(multiscale, dict) else None
            if not isinstance(datasets, list):
                continue
            paths = [_dataset_path(d) for d in datasets]
            if name in paths and isinstance(datasets[paths.index(name)], dict):
                scale = _physical(multiscale, datasets[paths.index(name)], uri, name)[0]
                return None if not scale else tuple(scale)
        return None  # the nearest image group does not list the array
    return None


def is_label_level(uri: str | os.PathLike, storage_options: dict | None = None,
                   stores: Stores | None = None) -> bool:
    """Whether the array at ``uri`` is a level of an OME-Zarr label image (``<image>/labels/<name>/<level>``, its
    group marked ``image-label``): its values are ids, which a float batch must hold exactly. Only arrays with
    a ``labels`` folder within :data:`MAX_PATH_DEPTH` above them are looked at (where the spec puts label
    images): the others cost no read.

    >>> is_label_level("/data/raw.ome.zarr/labels/cells/0")   # its group "cells" holds "image-label"
    True
    """
    uri = os.fspath(uri)
    loc = locate(uri)
    path = loc.path if loc.is_local else loc.prefix
    parts = (path or "").replace(os.sep, "/").rstrip("/").split("/")
    if "labels" not in parts[-MAX_PATH_DEPTH - 2:-1]:
        return False
    for attrs, name in _ancestor_attributes(uri, storage_options, stores):
        multiscales = _multiscales(attrs)
        if multiscales is None:
            continue
        listed = any(name in [_dataset_path(d) for d in m["datasets"]] for m in multiscales
                     if isinstance(m, dict) and isinstance(m.get("datasets"), list))
        return listed and _is_label_image(attrs)
    return False


def _ratios(base: Transform, mine: Transform, uri: str, name: str, against: str) -> tuple[int, ...] | None:
    """The level's scale over ``base``'s as whole ratios (None where every one is 1), its translation checked
    (:func:`_check_shift`); each a ``(scale, translation)`` pair of one dataset."""
    if base[0] is None or mine[0] is None or len(base[0]) != len(mine[0]):
        raise MetadataError(
            f"{uri}: level {name!r} of the OME-Zarr image's multiscales has no scale transform comparable "
            f"to {against}'s ({mine[0]} against {base[0]}); pass the scale explicitly "
            "(Field(..., scale=...), Mask(..., scale=...))", uri=uri)
    ratios = tuple(_ratio(m, b, uri, name, axis) for axis, (m, b) in enumerate(zip(mine[0], base[0])))
    _check_shift(base, mine, base[0], ratios, uri, name)
    return None if all(r == 1 for r in ratios) else ratios


def _is_label_image(attrs: Any) -> bool:
    """Whether a group's attributes say it is a label image (``image-label``: 0.4 at the top, 0.5 under ``ome``)."""
    if not isinstance(attrs, dict):
        return False
    ome = attrs.get("ome")
    return "image-label" in (ome if isinstance(ome, dict) else attrs)


def _axis_names(multiscale: Any) -> list[str] | None:
    """A multiscale's axis names (0.4 and 0.5: ``axes`` of ``{"name": ...}``), or None where it has none."""
    axes = multiscale.get("axes") if isinstance(multiscale, dict) else None
    if not isinstance(axes, list):
        return None
    names = [a.get("name") if isinstance(a, dict) else a for a in axes]
    return [str(n) for n in names] if all(isinstance(n, str) for n in names) else None


def _by_names(transform: "Transform", names: list[str] | None, mine: list[str] | None) -> "Transform":
    """The parent image's ``transform`` on the label image's axes, picked by name where the two have other axes
    (a ``zyx`` label image of a ``czyx`` image); as it is where the names do not say."""
    pick = _pick(names, mine)
    if pick is None or names is None:
        return transform
    return tuple(None if t is None or len(t) != len(names) else [t[i] for i in pick]  # type: ignore[return-value]
                 for t in transform)


class _Parent(NamedTuple):
    """The level 0 of the image a label image belongs to (see :func:`_parent_base`)."""

    transform: "Transform"  # its physical (scale, translation), on the label image's axes
    path: str  # its array's path below the image group
    below: str  # the label array's path below the image group
    pick: list[int] | None  # the image axes the label image's are, in its order (None: all, as they are)


def _parent_base(ancestors: Iterator[tuple[Any, str]], name: str, uri: str,
                 axes: list[str] | None = None) -> "_Parent | None":
    """Level 0 of the image a label image belongs to (the spec puts it at ``<image>/labels/<label>``): the
    label's levels are placed over that image's voxels, so a label image written at half the image's
    resolution (its own level 0 of scale 2) is not taken as the reference. None where no such image is found
    above it (the label image's own level 0 is the reference then, as before)."""
    for attrs, path in ancestors:
        multiscales = _multiscales(attrs)
        if multiscales is None:
            continue
        parts = path.split("/")
        if len(parts) < 3 or parts[0] != "labels" or "/".join(parts[2:]) != name:
            return None  # the nearest image above is not the one whose labels/ holds it
        for multiscale in multiscales:
            datasets = multiscale.get("datasets") if isinstance(multiscale, dict) else None
            if isinstance(datasets, list) and datasets and isinstance(_dataset_path(datasets[0]), str):
                names = _axis_names(multiscale)
                pick = _pick(names, axes)
                physical = _physical(multiscale, datasets[0], uri, _dataset_path(datasets[0]))
                return _Parent(_by_names(physical, names, axes), _dataset_path(datasets[0]), path, pick)
        return None
    return None


def _pick(names: list[str] | None, mine: list[str] | None) -> list[int] | None:
    """Which of the image's axes (``names``) the label image's (``mine``) are, by name; None where they are
    the same or the names do not say (the axes are taken as they are)."""
    if names is None or mine is None or names == mine or not set(mine) <= set(names):
        return None
    return [names.index(n) for n in mine]


def _label_over_image(parent: _Parent, label: "Transform", uri: str, name: str, level0: str,
                      storage_options: dict | None, stores: Stores | None) -> tuple[int, ...] | None:
    """How many of the image's level-0 voxels one voxel of the label image's level 0 spans, per axis; the
    shapes of the two level-0 arrays are the arbiter (one metadata read each). The same shape: 1 on every axis,
    whatever the physical scales say (ome-zarr-py writes a label image's level 0 at scale 1 when given no
    transforms, over an image of micrometre scales: it is the image's voxel grid all the same), unless the
    label gives a translation of its own other than the image's (a MetadataError). Another shape:
    the physical ratio, which must be whole and give the label's shape from the image's (divided by it,
    rounded down or up, as block-downsampling writers do), and the translations must agree; else a
    MetadataError naming both, that says to give the scale."""
    image_shape = _shape_beside(uri, name, parent.below, parent.path, storage_options, stores)
    label_shape = _shape_beside(uri, name, name, level0, storage_options, stores)
    if parent.pick is not None and all(i < len(image_shape) for i in parent.pick):  # the label's axes of it
        image_shape = tuple(image_shape[i] for i in parent.pick)
    if label_shape == image_shape:
        _check_same_place(parent, label, uri, level0, label_shape)
        return None
    scales = f"the physical scales {label[0]} and {parent.transform[0]}"

    def mismatch(why: str) -> MetadataError:
        return MetadataError(
            f"{uri}: the OME-Zarr label image's level 0 {level0!r} has shape {label_shape}, its image's level 0 "
            f"{parent.path!r} {image_shape}, and {scales} {why}; stoker cannot tell which image voxels a label "
            "voxel covers: pass the label's scale over the image's level 0 explicitly (Field(..., scale=...), "
            "Mask(..., scale=...))", uri=uri)
    if len(label_shape) != len(image_shape) or label[0] is None or parent.transform[0] is None \
            or len(label[0]) != len(parent.transform[0]):
        raise mismatch("do not give a ratio per axis")
    try:
        ratios = tuple(_ratio(m, b, uri, level0, axis) for axis, (m, b) in enumerate(zip(label[0], parent.transform[0])))
    except MetadataError:
        raise mismatch("give a ratio that is not a whole number >= 1 on some axis") from None
    if any(n not in (size // r, -(-size // r)) for n, size, r in zip(label_shape, image_shape, ratios)):
        raise mismatch(f"give the ratio {ratios}, which does not make the one shape from the other")
    _check_shift(parent.transform, label, parent.transform[0], ratios, uri, level0,
                 against="the level 0 of the image whose labels/ holds it")
    return None if all(r == 1 for r in ratios) else ratios


def _check_same_place(parent: _Parent, label: "Transform", uri: str, level0: str, shape: tuple[int, ...]) -> None:
    """MetadataError where a label image's level 0 of its image's shape gives a physical translation of its own
    that is not the image level 0's: it lies elsewhere than voxel for voxel, and stoker would read it there
    (silently off). No translation (ome-zarr-py's ``write_labels`` default) or the same one: voxel for voxel."""
    mine, theirs = label[1], parent.transform[1]
    if mine is None:
        return
    first = theirs if theirs is not None else [0.0] * len(mine)
    scale = parent.transform[0] if parent.transform[0] is not None and len(parent.transform[0]) == len(mine) \
        else [1.0] * len(mine)
    if len(first) == len(mine) and all(abs(a - b) <= _TOLERANCE * max(abs(a), abs(b), abs(s), 1e-300)
                                       for a, b, s in zip(mine, first, scale)):
        return
    raise MetadataError(
        f"{uri}: the OME-Zarr label image's level 0 {level0!r} has its image's level-0 shape {shape} but the "
        f"physical translation {mine}, its image's level 0 {parent.path!r} {theirs if theirs is not None else 'none'} "
        "(the physical scales "
        f"{label[0]} and {parent.transform[0]}); stoker cannot tell where the label lies over the image: pass "
        "its placement explicitly (Field(..., scale=..., offset=...))", uri=uri)


def _shape_beside(uri: str, name: str, below: str, path: str, storage_options: dict | None,
                  stores: Stores | None) -> tuple[int, ...]:
    """The shape of the array at ``path`` below the group that holds the array at ``uri`` as ``below`` (``name``
    is its path below its own group, both as :func:`_ancestor_attributes` gives them): its metadata read."""
    from .array import read_metadata, read_store_metadata  # (array.py is heavy; only label images need it)

    loc = locate(uri)
    up = len(below.split("/"))
    if loc.is_local:
        assert loc.path is not None
        group = os.path.normpath(loc.path)
        for _ in range(up):
            group = os.path.dirname(group)
        target = os.path.join(group, *path.split("/"))
        return tuple(read_metadata(target, default_store(), uri=target).shape)
    group = loc.prefix or ""
    for _ in range(up):
        group = posixpath.dirname(group)
    key = f"{group}/{path}" if group else path
    _, hierarchy = (stores or default_stores()).get(loc, storage_options)
    return tuple(read_store_metadata(hierarchy, key, f"{uri} ({key})").shape)


def _physical(multiscale: Any, dataset: dict, uri: str, name: Any) -> Transform:
    """A dataset's scale and translation in the image's physical space: its own transforms followed by its
    multiscale's (which apply to every dataset of that multiscale); None where it has none."""
    scale, shift = _scale(dataset, uri, name), _transform(dataset, "translation", uri, name)
    outer_scale = _transform(multiscale, "scale", uri, name) if isinstance(multiscale, dict) else None
    outer_shift = _transform(multiscale, "translation", uri, name) if isinstance(multiscale, dict) else None
    if scale is not None and outer_scale is not None and len(outer_scale) == len(scale):
        shift = [t * o for t, o in zip(shift, outer_scale)] if shift is not None else None
        scale = [v * o for v, o in zip(scale, outer_scale)]
    if outer_shift is not None and scale is not None and len(outer_shift) == len(scale):
        shift = [a + b for a, b in zip(shift or [0.0] * len(scale), outer_shift)]
    return scale, shift


def _multiscales(attrs: Any) -> list | None:
    """A group's ``multiscales`` (0.5: under ``ome``; 0.4: at the top), or None."""
    if not isinstance(attrs, dict):
        return None
    ome = attrs.get("ome")
    multiscales = ome.get("multiscales") if isinstance(ome, dict) else attrs.get("multiscales")
    return multiscales if isinstance(multiscales, list) else None


def _dataset_path(dataset: Any) -> Any:
    """A dataset's ``path`` as the array's name below the image group is written (no ``./``, no trailing or
    doubled ``/``); anything not a string as it is (it names no array)."""
    path = dataset.get("path") if isinstance(dataset, dict) else None
    return posixpath.normpath(path).lstrip("/") if isinstance(path, str) and path.strip("/.") else path


def _transform(dataset: dict, kind: str, uri: str, name: Any) -> list[float] | None:
    """The ``kind`` ("scale" or "translation") transform of ``dataset`` as floats; None when it has none (or is
    no object: a malformed entry, which names no level)."""
    transforms = dataset.get("coordinateTransformations") if isinstance(dataset, dict) else None
    for t in transforms if isinstance(transforms, list) else []:
        if isinstance(t, dict) and t.get("type") == kind and isinstance(t.get(kind), list):
            try:
                return [float(v) for v in t[kind]]
            except (TypeError, ValueError):
                raise MetadataError(f"{uri}: the {kind} of OME-Zarr level {name!r} is not a list of numbers: "
                                    f"{t[kind]!r}", uri=uri) from None
    return None


def _check_shift(base_set: Transform, level_set: Transform, base: list[float], ratios: tuple[int, ...], uri: str,
                 name: str, against: str = "level 0") -> None:
    """MetadataError unless the level's translation relative to ``against``'s (its level 0, or a label image's
    image's) places its voxel ``i`` over that level's voxels ``[i * r, (i + 1) * r)``: a shift of 0 or
    ``(r - 1) / 2`` of them on every axis (each set a ``(scale, translation)`` pair)."""
    zero = [0.0] * len(base)
    mine = level_set[1] or zero
    first = base_set[1] or zero
    if len(mine) != len(base) or len(first) != len(base):
        raise MetadataError(f"{uri}: the translation of OME-Zarr level {name!r} ({mine}) or of {against} ({first}) "
                            f"does not have one value per axis ({len(base)}); fix the image's multiscales metadata",
                            uri=uri)
    for axis, (t, t0, b, r) in enumerate(zip(mine, first, base, ratios)):
        shift = (t - t0) / b if b > 0 else float("nan")
        allowed = (0.0,) if r == 1 else (0.0, (r - 1) / 2)
        if not any(abs(shift - ok) <= _TOLERANCE * max(1, r) for ok in allowed):
            said = "0" if r == 1 else f"0 or {(r - 1) / 2:g}"
            voxels = "level-0 voxels" if against == "level 0" else "of its voxels"
            raise MetadataError(
                f"{uri}: OME-Zarr level {name!r} is translated {shift:g} {voxels} from {against} on axis {axis}; "
                f"stoker places its voxel i over those voxels [i*{r}, (i+1)*{r}) (a translation of {said}), "
                "so it would read the wrong place: pass the scale explicitly (Field(..., scale=...), "
                "Mask(..., scale=...)) and fold the shift into the offset", uri=uri, axis=axis)


def _scale(dataset: dict, uri: str, name: Any) -> list[float] | None:
    return _transform(dataset, "scale", uri, name)


def _ratio(mine: float, base: float, uri: str, name: str, axis: int) -> int:
    ratio = mine / base if base > 0 else float("nan")
    whole = round(ratio) if ratio == ratio else 0
    if whole < 1 or abs(ratio - whole) > _TOLERANCE * max(1, whole):
        raise MetadataError(
            f"{uri}: OME-Zarr level {name!r} spans {ratio:g} level-0 voxels on axis {axis}, not a whole number >= 1; "
            "stoker places boxes of levels on whole voxels: pass the scale explicitly (Field(..., scale=...)) or "
            "use a level whose scale is an integer multiple of level 0's", uri=uri, axis=axis)
    return int(whole)


#: local groups' nodes already read, ``(folder, format) -> read_group_node's answer``: given by a caller that
#: asks about many arrays under one folder (the pipeline's flip check), so each folder's documents are read once
Nodes = dict


def _ancestor_attributes(uri: str, storage_options: dict | None,
                         stores: Stores | None, nodes: Nodes | None = None) -> Iterator[tuple[Any, str]]:
    """``(attributes of an ancestor group of the array, the array's path below it)``, from its parent up, at
    most :data:`MAX_PATH_DEPTH` folders (a dataset ``path`` may be nested: ``"s/1"``). A folder with no
    document is stepped over (zarr-python writes none for the ``s`` of ``s/1``, and reads the level through
    the image group all the same); the walk ends at a node that is no group (a v3 array: nothing above it
    holds the array). A remote store's groups are read through its
    :class:`~stoker.storage.hierarchy.Hierarchy`: what opening the array read of them is not asked again, nor
    what an earlier lookup did. Past the nearest group, only its format's documents are asked for."""
    loc = locate(uri)
    if loc.is_local:
        assert loc.path is not None
        split: Callable[[str], tuple[str, str]] = os.path.split
        parent, name = split(os.path.normpath(loc.path))

        def node(group: str, fmt: int | None) -> tuple[int, Any, bool] | None:
            if nodes is None:
                return read_group_node(lambda doc: read_regular(os.path.join(group, doc)), fmt)
            if (group, fmt) not in nodes:
                nodes[group, fmt] = read_group_node(lambda doc: read_regular(os.path.join(group, doc)), fmt)
            return nodes[group, fmt]
    else:
        if not loc.prefix:
            return
        split = posixpath.split
        parent, name = split(loc.prefix)
        _, hierarchy = (stores or default_stores()).get(loc, storage_options)

        def node(group: str, fmt: int | None) -> tuple[int, Any, bool] | None:
            return hierarchy.group_node(group, uri, fmt)
    fmt = None
    for _ in range(MAX_PATH_DEPTH):
        found = node(parent, fmt)
        if found is not None:
            fmt, attrs, is_group = found
            if not is_group:
                return  # no group: no image holds the array through it
            yield attrs, name
        up, folder = split(parent)
        if not folder:
            return  # that was the file system's or the store's root
        parent, name = up, f"{folder}/{name}"
