"""The check that a pipeline's flips and transposes keep a sample's fields over one another, made before the
first batch of them (see :mod:`stoker.transforms.layout`).

A pushed source whose fields are :class:`~stoker.Field` volumes (``RandomCrops``, ``TileGrid`` of fields) is
checked once at push, volume by volume, from each field's offset, extent and scale: every sample of a volume
has its fields in the same place around its anchor. Any other sample (a pushed list or iterable, a
``SampleList``, a source of one's own) is checked as it is validated, from its boxes and its arrays' OME-Zarr
levels (each local folder's documents read once per pipeline; a Field source's spacings once per source); a
layout checked once is remembered, so a run of samples alike costs a dict lookup each. A pipeline without such transforms checks nothing.

>>> guard = LayoutGuard(cfg)
>>> guard.pushed(share)          # True: its volumes were checked (InvalidArgument otherwise)
>>> guard.sample(sample)         # a sample of a push the guard could not check whole
"""

from __future__ import annotations

from operator import mul, sub
from typing import Any, Callable

from ...config import Config
from ...errors import InvalidArgument, MetadataError, StokerError, StorageError
from ...reader.ome import level_scale, physical_spacing
from ...sampling.sample import Sample
from ...sampling.samplers import RandomCrops, TileGrid
from ...storage.locate import options_for
from ...transforms.augment import RandomTranspose
from ...transforms.layout import FieldBox, check_layout, find_geometric


def _read(what: Callable[..., Any], uri: str, options: Any, nodes: dict) -> Any:
    """``what(uri, options)``, an OME-Zarr metadata read (local groups read once in ``nodes``): an OSError of a
    store that does not wrap its own (a filesystem of fsspec's) is a StorageError, as on the reading path."""
    try:
        return what(uri, options_for(options, uri), None, nodes)
    except StokerError:
        raise
    except OSError as exc:
        raise StorageError(f"{uri}: reading the OME-Zarr metadata above it (where flips place its box): "
                           f"{type(exc).__name__}: {exc}", uri=uri) from exc


def _unplaced_error(transform: Any, s: Sample, name: str, why: str) -> InvalidArgument:
    """The InvalidArgument for a sample one of whose fields' arrays is an OME-Zarr level stoker cannot place."""
    why = why.split(": ", 1)[-1].split("; ", 1)[0]  # what is wrong with the level, less its uri and advice
    return InvalidArgument(
        f"{transform!r}: sample {s!r}: field {name!r}'s array is a level of an OME-Zarr image that stoker cannot "
        f"place over the image's level 0 ({why}), and a Sample carries no scale of its own, so whether the "
        "fields' boxes share a centre cannot be told (reading the sample is not affected). If its boxes are "
        "centred on one another, pass about='own_centre' to the transform; or draw the samples from Fields with "
        "an explicit scale (RandomCrops or TileGrid over Field(..., scale=...), the source itself pushed)",
        knob="about")


def _own_fields(source: Any) -> bool:
    """Whether ``source`` is stoker's RandomCrops or TileGrid over Fields whose samples come from its volumes
    (a subclass overriding ``sample`` makes samples of its own: checked one by one; a source of one's own with
    an attribute ``volumes`` is no such source)."""
    for base in (RandomCrops, TileGrid):
        if isinstance(source, base) and type(source).sample is base.sample:
            return isinstance(source.volumes, list) and len(source.volumes) > 0
    return False


class LayoutGuard:
    """The geometric built-ins of ``cfg.transform`` and what was found of the samples so far."""

    def __init__(self, cfg: Config) -> None:
        self.transforms = find_geometric(cfg.transform)
        self.options = cfg.storage_options
        self.spacing = any(isinstance(t, RandomTranspose) for t in self.transforms)  # spacings count
        self._scales: dict[str, tuple[int, ...]] = {}  # per array: its OME-Zarr level's scale (1 otherwise)
        self._spacings: dict[str, tuple[float, ...] | None] = {}  # per array: its OME-Zarr voxel spacing
        self._nodes: dict = {}  # the local groups read above the arrays: a folder of many arrays read once
        self._unplaced: dict[str, str] = {}  # per array its metadata cannot place over its level 0: why
        self._passed: set[Any] = set()  # layouts (relative to the first field) already checked

    def pushed(self, it: Any) -> bool:
        """Check a pushed iterator's source when it is made of Field volumes; whether it was (its samples then
        need no look of their own)."""
        if not self.transforms:
            return True
        source = getattr(getattr(it, "src", it), "source", None)
        if not _own_fields(source):
            return False  # each sample is checked as it comes
        volumes = source.volumes
        who = type(source).__name__
        # the spacings a transpose needs, kept with the source as its shapes and scales are: a CropDataset's
        # pipeline of each epoch reads none again
        known = getattr(source, "_spacing_cache", None)
        if not isinstance(known, dict):
            known = {}
            try:
                source._spacing_cache = known
            except AttributeError:  # a subclass with __slots__: read by each pipeline
                pass
        for uri, spacing in list(known.items()):  # (another pipeline pushing the source may add to it)
            self._spacings.setdefault(uri, spacing)
        for i, mv in enumerate(volumes):
            vol = mv.volume
            layout = {}
            for name in vol.names:
                f, scale = vol.fields[name], vol.scales[name]
                centre2 = tuple(2 * o + c * s for o, c, s in zip(f.offset, f.shape, scale))  # from the anchor
                layout[name] = FieldBox(centre2, self._spacing(f.uris[0], scale), f.offset, tuple(scale))
            where = f"{who} volume {i}" + (f" ({vol.fields[vol.names[0]].uris[0]})" if len(volumes) > 1 else "")
            known.update({f.uris[0]: self._spacings[f.uris[0]] for f in vol.fields.values()
                          if f.uris[0] in self._spacings})
            check_layout(self.transforms, layout, where)
        return True

    def sample(self, s: Sample) -> None:
        """Check one sample (InvalidArgument naming it where a transform would move its fields apart)."""
        if not self.transforms:
            return
        if s.fields is None:
            if not self.spacing or s.uri in self._passed:
                return
            spacing = self._spacing(s.uri, (1,) * len(s.aabb or ()))  # a transpose's only concern here
            check_layout(self.transforms, {"": FieldBox((0,) * len(spacing), spacing)}, f"sample {s!r}")
            self._passed.add(s.uri)
            return
        if len(s.fields) == 1 and not self.spacing:
            return  # one field: nothing to move apart
        # the key: each field's array, rank and centre on every axis relative to the fields' centre on that axis
        # (trailing axes aligned: the first field that has the axis gives it), exact (a few microseconds a
        # sample: samples alike, boxes moved together, hit the same key)
        centres = []
        for f in s.fields.values():
            box = f.aabb or ()
            scale = self._scales.get(f.uri)
            if scale is None or len(scale) != len(box):
                scale = self._frame(f.uri, len(box))[0]
            centres.append((f.uri, tuple(map(mul, scale, map(sum, box)))[::-1]))  # trailing axes first
        origin: list[int] = []
        for _, c in centres:
            origin += c[len(origin):]
        key = tuple((uri, len(c), tuple(map(sub, c, origin))) for uri, c in centres)
        if key in self._passed:
            return
        unplaced = [(name, self._unplaced[f.uri]) for name, f in s.fields.items() if f.uri in self._unplaced]
        if unplaced and len(s.fields) > 1:
            raise _unplaced_error(self.transforms[0], s, *unplaced[0])
        layout, unit = {}, []
        for name, f in s.fields.items():
            box = f.aabb or ()
            scale, spacing = self._frame(f.uri, len(box))
            layout[name] = FieldBox(tuple(k * (a + b) for k, (a, b) in zip(scale, box)), spacing)
            unit += [name] if all(k == 1 for k in scale) else []
        try:
            check_layout(self.transforms, layout, f"sample {s!r}")
        except InvalidArgument as exc:
            if not unit or len(layout) < 2:
                raise
            # a Sample has no scale of its own: a coarse plain array a Field(scale=) made it from counts as 1
            raise InvalidArgument(
                f"{exc.message}. A Sample carries no scale: each array is placed by its OME-Zarr level's "
                f"metadata, at scale 1 where none lists it ({', '.join(map(repr, unit))} here); samples of a "
                "RandomCrops or TileGrid over Field(..., scale=...) are placed by those scales only when the source "
                "itself is pushed (source.for_rank(...))", **exc.context) from None
        self._passed.add(key)

    def _frame(self, uri: str, ndim: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """``uri``'s scale (reference voxels per voxel: its OME-Zarr level's, else 1) and voxel spacing (its
        OME-Zarr one, else its scale), each read once."""
        if uri not in self._scales:
            try:
                self._scales[uri] = _read(level_scale, uri, self.options, self._nodes) or ()  # () for scale 1
            except MetadataError as exc:  # read fine all the same: only a sample of other fields is refused
                self._scales[uri], self._unplaced[uri] = (), exc.message
        scale = self._scales[uri]
        scale = scale if len(scale) == ndim else (1,) * ndim
        if not self._scales[uri]:
            self._scales[uri] = scale  # a plain array's scale 1 of this rank, found at once next time
        return scale, self._spacing(uri, scale)

    def _spacing(self, uri: str, scale: tuple[int, ...]) -> tuple[float, ...]:
        """The voxel spacing of ``uri`` (placed at ``scale``): its OME-Zarr one, else ``scale``; only asked for
        with a transpose among the transforms (a flip needs no spacing)."""
        if self.spacing and uri not in self._spacings:
            self._spacings[uri] = _read(physical_spacing, uri, self.options, self._nodes)
        spacing = self._spacings.get(uri)
        return spacing if spacing is not None and len(spacing) == len(scale) else tuple(map(float, scale))
