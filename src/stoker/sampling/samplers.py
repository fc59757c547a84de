"""Sample sources: a deterministic global order per epoch, split across ranks, resumable.

>>> src = stoker.RandomCrops(["/data/a.zarr", "/data/b.zarr"], sample_shape=(32, 128, 128), seed=0)
>>> mine = src.for_rank()                       # rank and world size from torch.distributed or RANK/WORLD_SIZE
>>> mine.set_epoch(3)
>>> pipeline.push(mine)                      # this rank's samples of epoch 3, in order
>>> state = pipeline.state_dict()["sources"][0]   # as of the last popped batch
>>> mine.load_state_dict(state)              # later, on any world size: continue where it stopped

Each entry of ``arrays`` is one array, or a group of arrays of one shape read as channels of every sample
(``[[t2m, u10, v10], ...]``: samples of shape ``(3, *sample_shape)``, see :class:`~stoker.Sample`).

The global order of an epoch depends only on ``(seed, epoch)``; ``for_rank()`` splits
it so that within an epoch the ranks' samples are disjoint, cover the order, and
every rank gets the same number (short ranks wrap around, or all drop the tail
with ``even="drop"``). Nothing here holds a table of an epoch's samples: orders,
shuffles and shares are computed per index, so memory does not grow with the epoch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import operator
import os
import warnings
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from . import partition
from .cursor import CursorState, EpochCursor
from .field import Field, MaskedVolume, check_fields, open_volume
from ..checks import integer, integers
from ..dist.collectives import resolve_rank
from ..errors import IncompleteSource, InvalidArgument, NotYetSupported, RankMismatch
from .permutation import ORDER_VERSION, Permutation
from .sample import Sample, box_of, check_pad, given_uri

_BLOCK = 1024  # RandomCrops draws samples in seeded blocks: cheap, and any index is reachable directly
# Positions are int64 where they meet numpy (a rank's share as an array, seeds); with at most 2**62
# samples an epoch, W ranks' wrapped shares (W * ceil(n / W) < n + W) stay below 2**63 too.
MAX_SAMPLES = 2**62


class SampleSource:
    """Base class of sample sources: ``len(source)`` samples per epoch, ``source.sample(epoch, i)`` the i-th
    of epoch's global order, and ``source.identity()`` what the samples are made of.

    A source of one's own implements ``__len__`` and ``sample(epoch, index)`` (the same sample for the same
    ``(epoch, index)`` in every process), and may set ``seed``. Its position is saved with a fingerprint of
    :meth:`identity`, so a state is never resumed into another sample list. The default identity is the
    source's length, ``seed`` and public attributes, when they are plain data (numbers, strings, paths,
    samples and lists, tuples and dicts of them); override :meth:`identity` otherwise (``IncompleteSource``
    says so, naming the attribute):

    >>> class EveryOther(stoker.SampleSource):
    ...     def __init__(self, uri, n):
    ...         self.uri, self.n = uri, n
    ...     def __len__(self):
    ...         return self.n
    ...     def sample(self, epoch, index):
    ...         return stoker.Sample(self.uri, [(2 * index, 2 * index + 1)])
    >>> src = EveryOther("/data/line.zarr", 50)
    >>> src.identity()
    {'len': 50, 'seed': 0, 'fields': {'uri': '/data/line.zarr', 'n': 50}}
    >>> src.for_rank(0, 1).state_dict()["fingerprint"] == src.fingerprint
    True

    A source is fixed once made: the fingerprint is computed once, at the first state saved or loaded, and
    kept (it is recomputed only when ``len(source)``, ``seed`` or ``shuffle`` change).
    """

    seed: int = 0
    #: Every sample of an epoch must be delivered (the tiles of an inference): a rank split refuses
    #: ``even="drop"``, and a Pipeline (and CropDataset) yields the short last batch whatever ``drop_last``.
    complete_epochs: bool = False

    def __len__(self) -> int:
        raise _incomplete(self, "__len__", "how many samples an epoch has")

    def sample(self, epoch: int, index: int) -> Sample:
        """The ``index``-th sample of ``epoch``'s global order."""
        raise _incomplete(self, "sample", "sample(epoch, index): the index-th Sample of the epoch's order")

    def identity(self) -> Any:
        """What the sample list is made of, as JSON-able data: equal identities must mean equal samples in
        equal orders. The default: ``len(self)``, ``seed`` and the public attributes (see the class)."""
        legacy = getattr(self, "_identity", None)
        if callable(legacy):  # the hook's private name before it was public: such sources keep their fingerprints
            return legacy()
        try:
            fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        except TypeError:  # __slots__ and no __dict__: nothing to read the identity from
            raise _incomplete(self, "identity", "what the samples are made of (its attributes cannot be read)") \
                from None
        return {"len": len(self), "seed": self.seed, "fields": {k: _plain(v, f"{type(self).__name__}.{k}", self)
                                                                  for k, v in fields.items()}}

    @property
    def fingerprint(self) -> str:
        """Identifies the sample list: resuming with another list is refused. Computed once per source."""
        key = (len(self), self.seed, getattr(self, "shuffle", None))
        cached = getattr(self, "_fingerprint_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        blob = json.dumps([type(self).__name__, self.identity()], sort_keys=True, default=str)
        value = hashlib.sha256(blob.encode()).hexdigest()[:16]
        try:
            self._fingerprint_cache = (key, value)
        except AttributeError:  # a subclass with __slots__: computed every time
            pass
        return value

    def for_rank(self, rank: int | None = None, world_size: int | None = None, policy: str = "strided",
                 even: str = "wrap") -> "RankShare":
        """This rank's share. ``rank``/``world_size`` default to the torch.distributed group, else the
        ``RANK``/``WORLD_SIZE`` environment, else a single process."""
        if even == "drop" and self.complete_epochs:
            raise InvalidArgument(
                f"{type(self).__name__}.for_rank(even='drop') would leave the last samples of the epoch out, and "
                "with them parts of the arrays; its epochs are delivered whole: split it with even='wrap' (a short "
                "rank repeats samples from the start, which TileWriter counts once)", knob="even")
        rank, world_size = resolve_rank(rank, world_size)
        return RankShare(self, rank, world_size, policy, even)

    def __iter__(self) -> Iterator[Sample]:
        """Epoch 0 in global order, whole (a single process)."""
        return iter(self.for_rank(0, 1))


def _incomplete(source: SampleSource, method: str, what: str) -> IncompleteSource:
    return IncompleteSource(
        f"{type(source).__name__} does not implement {method}(): a SampleSource of one's own implements "
        f"__len__ and sample(epoch, index), and identity() when its attributes are not plain data; {what}",
        method=method)


def _plain(value: Any, where: str, source: SampleSource) -> Any:
    """``value`` as JSON data for a default identity: numbers, strings, paths, samples, and lists, tuples and
    dicts of them; IncompleteSource naming ``where`` for anything else (its str would differ between runs)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Sample) and value.fields is not None:
        return [{name: _plain(f, where, source) for name, f in value.fields.items()}, value.pad]
    if isinstance(value, Sample):
        plain = [given_uri(value), [list(p) for p in box_of(value)]]
        return plain if value.pad is None else plain + [value.pad]  # unpadded: the identity it always had
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{where}[{k!r}]", source) for k, v in value.items()}
    raise _incomplete(source, "identity", f"{where} is of type {type(value).__name__}, not plain data, so the default "
                      "identity cannot tell two such sources apart; return what the samples are made of")


def _open_shapes(arrays: Sequence[str], storage_options: dict | None, stores) -> list[tuple[int, ...]]:
    """The arrays' shapes (remote URIs with the options of their longest prefix in ``storage_options``,
    as Config.storage_options; credentials are never part of a source's identity), opened in ``stores``."""
    from ..reader.array import open_array
    from ..storage.locate import check_options_by_prefix, options_for

    by_prefix = check_options_by_prefix(storage_options, "storage_options")
    return [open_array(uri, options_for(by_prefix, uri), stores=stores).shape for uri in arrays]


def _entries(arrays: Sequence[Any], who: str) -> list:
    """``arrays`` as a sampler keeps them: each a URI, or a list of URIs (a group read as channels). Every
    entry must be of one kind, and groups of one size (a pipeline's samples all have one shape)."""
    if isinstance(arrays, (str, os.PathLike)):
        raise InvalidArgument(f"{who} takes a list of arrays (or of groups of arrays), got the single {arrays!r}; "
                              "wrap it in a list")
    out = [[os.fspath(u) for u in a] if isinstance(a, (list, tuple)) else os.fspath(a) for a in arrays]
    sizes = {len(a) if isinstance(a, list) else None for a in out}
    if len(sizes) > 1:
        raise InvalidArgument(
            f"{who}: every entry of arrays must be one array, or every entry a group of the same number of arrays "
            f"(the channels of each sample); got groups of sizes {sorted(sizes, key=str)}")
    if 0 in sizes:
        raise InvalidArgument(f"{who}: a group of arrays is empty; each group needs at least one array")
    return out


def _entry_shapes(entries: list, storage_options: dict | None = None) -> list[tuple[int, ...]]:
    """The shape of each entry's arrays: a group's arrays must have one shape (InvalidArgument naming them)."""
    from ..storage.locate import Stores

    shapes = []
    stores = Stores()  # shared by every array: a consolidated group's metadata is read once, not per array
    try:
        for entry in entries:
            group = entry if isinstance(entry, list) else [entry]
            found = _open_shapes(group, storage_options, stores)
            for uri, shape in zip(group, found):
                if shape != found[0]:
                    raise InvalidArgument(
                        f"{uri}: shape {shape} differs from {group[0]}'s {found[0]}; the arrays of a group are "
                        "read at the same boxes and must have one shape", uri=uri)
            shapes.append(found[0])
    finally:
        stores.close()
    return shapes


def _rank_mismatch(uri: str, sample_shape: tuple[int, ...], shape: tuple[int, ...], hint: str = "") -> RankMismatch:
    """A sampler's error for an array of another rank than its ``sample_shape``."""
    return RankMismatch(f"{uri}: sample_shape {sample_shape} has {len(sample_shape)} axes but the array (shape "
                        f"{shape}) has {len(shape)} axes: give one extent per axis{hint}", uri=uri)


class RandomCrops(SampleSource):
    """Uniform random in-bounds crops over arrays, weighted by array volume unless ``weights`` is given.

    ``samples_per_epoch`` defaults to the number of crops that would tile the data once.

    ``pad`` (one of :data:`~stoker.sampling.sample.PAD_MODES`) makes padded samples (see :class:`~stoker.Sample`):
    crops are drawn as without it where the array holds them, and an array shorter than the crop on some axis is
    accepted: there the crop covers the whole axis, the array at a uniform random place inside it, the rest
    filled by ``pad``.

    ``region`` restricts where boxes start (the anchor), per axis of each entry's first array: axis numbers
    take index ranges, dimension names label ranges of their coordinates, both labels included (see
    :mod:`stoker.sampling.region`); weights and the default epoch length then count the anchors (and the
    region's voxels) of each array, and an array the region leaves no anchor in is not drawn from.


    >>> src = stoker.RandomCrops(["/data/a.zarr"], (32, 128, 128), seed=0, samples_per_epoch=10_000)
    >>> spring = stoker.RandomCrops([["era5.zarr/t2m", "era5.zarr/u10"]], (2, 181, 360),
    ...                             region={"time": ("2000-03-01", "2000-05-31")})

    **Fields.** A dict of :class:`~stoker.Field` (one volume), or a list of such dicts (several volumes, with
    the same field names and shapes), makes samples of named fields (``Sample({name: (uris, box)})``): each
    sample draws an anchor uniformly among those that keep every field's box inside its arrays, on multiples
    of every field's scale (see :mod:`stoker.sampling.field`); ``sample_shape`` is not given then.

    >>> fields = {"raw": stoker.Field("/data/raw.ome.zarr/0", (96, 96, 96)),
    ...           "labels": stoker.Field("/data/labels.zarr", (56, 56, 56), offset=(20, 20, 20))}
    >>> src = stoker.RandomCrops(fields, seed=0, mask=stoker.Mask("/data/fg.zarr", 0.25, field="labels", scale=4))

    ``region`` over fields is read on the first field's first array and restricts where that field's box
    starts (in its voxels; anchors ``[i0 * scale - offset, i1 * scale - offset)``), combined exactly with a
    mask. ``pad`` over fields: only the first field bounds the anchors (as a padded crop over arrays); the
    other fields' boxes may reach past their arrays, filled while placing, but each keeps at least one voxel
    inside them (no sample holds a field of nothing but the pad; see :class:`~stoker.sampling.field.Volume`).

    ``pad_axes`` (axis numbers, with ``pad``) names the axes boxes may be padded on; on the others every
    field's box lies inside its arrays, as without ``pad`` (an array shorter than the crop there is refused).
    A forecast pads lat/lon borders, never time: its inputs and targets are always real time steps.

    >>> fc = stoker.RandomCrops({"input": stoker.Field(vars_, (2, 64, 128)),
    ...                          "target": stoker.Field(vars_, (1, 64, 128), offset=(7, 0, 0)),
    ...                          "context": stoker.Field(vars_, (2, 96, 160), offset=(0, -16, -16))},
    ...                         pad="edge", pad_axes=(1, 2))

    >>> train = stoker.RandomCrops({"input": stoker.Field(vars_, (2, 64, 128)),
    ...                             "target": stoker.Field(vars_, (1, 64, 128), offset=(7, 0, 0))},
    ...                            region={"time": ("1990-01-01", "2015-12-31")})

    ``mask`` (a :class:`~stoker.Mask`, or one per volume, ``None`` for none) draws only the anchors whose
    named field's box covers at least ``min_fraction`` of nonzero mask voxels (see
    :mod:`stoker.sampling.mask`). Volumes are weighted by their anchors (those that qualify, with a mask)
    unless ``weights`` is given; ``samples_per_epoch`` defaults to the crops of each volume's first field
    that tile its arrays once, times the fraction of its anchors that qualify.
    """

    def __init__(self, arrays: Any, sample_shape: Sequence[int] | None = None, seed: int = 0,
                 samples_per_epoch: int | None = None, weights: Sequence[float] | None = None,
                 storage_options: dict | None = None, mask: Any = None, pad: str | None = None,
                 region: dict | None = None, pad_axes: Sequence[int] | None = None) -> None:
        self.pad = check_pad(pad, "RandomCrops")
        samples_per_epoch = _epoch_length(samples_per_epoch)  # before any array or mask is read
        seed = _seed(seed, "RandomCrops")
        volumes = _volumes_given(arrays)
        if volumes is not None:
            if sample_shape is not None:
                raise InvalidArgument("RandomCrops over fields takes each field's shape in its Field, not "
                                      "sample_shape; leave sample_shape out", knob="sample_shape")
            self.region: dict | None = None if region is None else dict(region)
            self.pad_axes = _pad_axes(self.pad, pad_axes, len(next(iter(volumes[0].values())).shape))
            self._init_fields(volumes, seed, samples_per_epoch, weights, storage_options, mask)
            return
        if mask is not None:
            raise InvalidArgument("RandomCrops(mask=...) draws where a named field's box covers the mask: give "
                                  "the arrays as fields, {name: stoker.Field(uri, shape)}, and name one in the Mask",
                                  knob="mask")
        if sample_shape is None:
            raise InvalidArgument("RandomCrops over arrays needs sample_shape (the crop's shape)",
                                  knob="sample_shape")
        self.volumes: list[MaskedVolume] | None = None
        self.arrays = _entries(arrays, "RandomCrops")
        if not self.arrays:
            raise InvalidArgument("RandomCrops needs at least one array")
        self.sample_shape = integers("RandomCrops: sample_shape", sample_shape, 1, knob="sample_shape")
        self.pad_axes = _pad_axes(self.pad, pad_axes, len(self.sample_shape))
        self.seed = int(seed)
        self.shapes = _entry_shapes(self.arrays, storage_options)
        padded = range(len(self.sample_shape)) if self.pad_axes is None else self.pad_axes
        for uri, shape in zip(self.arrays, self.shapes):
            if len(shape) != len(self.sample_shape):
                raise _rank_mismatch(uri, self.sample_shape, shape,
                                     " (a list of arrays as channels adds the channel axis itself)")
            short = [d for d, (c, n) in enumerate(zip(self.sample_shape, shape))
                     if c > n and (self.pad is None or d not in padded)]
            if short:
                hint = "pad= lets them reach past it" if self.pad is None else \
                    f"axis {short[0]} is not in pad_axes {self.pad_axes}: add it, or crop no longer than the array"
                raise InvalidArgument(f"{uri}: shape {shape} cannot hold crops of {self.sample_shape} ({hint})",
                                      uri=uri)
        self.region = None if region is None else dict(region)
        # per array and axis the first box start and how many there are (a region may restrict them; a padded
        # crop longer than its axis covers it, the axis anywhere inside it: first start below 0)
        self._lo, self._limits, spans = _anchors(self, region, storage_options)
        raw = np.asarray(spans, dtype=np.float64) if weights is None else _raw_weights(weights, len(self.arrays))
        if raw.shape == (len(self.arrays),):  # a region that leaves an array no box start is what to say first
            _check_drawable(self, raw)
        self.weights = _weights(weights, spans, len(self.arrays))
        if samples_per_epoch is not None:  # (checked at the top)
            count = samples_per_epoch
        else:  # the crops that tile the data once
            count = max(1, sum(spans) // math.prod(self.sample_shape))
            if count > MAX_SAMPLES:
                raise InvalidArgument(
                    f"RandomCrops over {self.arrays}: {count} crops of {self.sample_shape} would tile the data "
                    "once, more than the 2**62 samples an epoch can hold; pass samples_per_epoch (or a larger "
                    "sample_shape)")
        self.samples_per_epoch = count
        self._cdf = np.cumsum(self.weights)
        self._last = int(np.flatnonzero(self.weights > 0)[-1])  # never past it, whatever the cdf's rounding
        self._cache: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None

    def _init_fields(self, volumes: list[dict[str, Field]], seed: int, samples_per_epoch: int | None,
                     weights: Sequence[float] | None, storage_options: dict | None, mask: Any) -> None:
        from ..storage.locate import Stores

        masks = list(mask) if isinstance(mask, (list, tuple)) else [mask] * len(volumes)
        if len(masks) != len(volumes):
            raise InvalidArgument(f"RandomCrops: mask is a list of {len(masks)}, for {len(volumes)} volumes; give one "
                                  "per volume (None for none)", knob="mask")
        self.fields, self.masks, self.seed = volumes, masks, int(seed)
        stores = Stores()  # shared by every array: a consolidated group's metadata is read once, not per array
        try:
            self.volumes = [open_volume(v, m, storage_options, stores, "RandomCrops", region=self.region, pad=self.pad,
                                        pad_axes=self.pad_axes) for v, m in zip(volumes, masks)]
        finally:
            stores.close()
        anchors = [len(mv.qualifying) if mv.qualifying is not None else mv.volume.n_anchors for mv in self.volumes]
        self.weights = _weights(weights, anchors, len(volumes))
        if samples_per_epoch is not None:  # (checked by __init__)
            count = samples_per_epoch
        else:  # the crops of each volume's first field that tile its arrays once (those that qualify)
            count = 0
            for mv, n in zip(self.volumes, anchors):
                vol = mv.volume
                first = vol.names[0]
                span = math.prod(vol.shapes[first])
                if self.region is not None:  # the voxels of the first field's arrays its boxes in the region cover
                    span = math.prod(min(a, (k - 1) * st // s + c) for a, k, st, s, c in
                                     zip(vol.shapes[first], vol.counts, vol.step, vol.scales[first],
                                         vol.fields[first].shape))
                tiles = span // math.prod(vol.fields[first].shape)
                count += tiles * n // vol.n_anchors
            count = min(max(1, count), MAX_SAMPLES)
        self.samples_per_epoch = count
        self._cdf = np.cumsum(self.weights)
        self._last = int(np.flatnonzero(self.weights > 0)[-1])  # never past it, whatever the cdf's rounding
        self._cache = None

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _block(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._cache
        if cached is not None and cached[0] == (epoch, block):
            return cached[1]
        rng = np.random.default_rng([self.seed, epoch, block])
        which = np.minimum(np.searchsorted(self._cdf, rng.random(_BLOCK), side="right"),
                           self._last)
        if self.volumes is None:
            frac = rng.random((_BLOCK, len(self.sample_shape)))
            corners = self._lo[which] + np.floor(frac * self._limits[which]).astype(np.int64)
        else:  # lattice indices of the anchors: uniform per axis, or uniform among those a mask lets through
            frac = rng.random((_BLOCK, len(self.volumes[0].volume.counts)))
            corners = np.zeros(frac.shape, dtype=np.int64)
            for v, mv in enumerate(self.volumes):
                rows = which == v
                if mv.qualifying is None:
                    counts = np.array(mv.volume.counts, dtype=np.float64)
                    corners[rows] = np.minimum(np.floor(frac[rows] * counts), counts - 1).astype(np.int64)
                else:
                    pick = np.minimum(np.floor(frac[rows, 0] * len(mv.qualifying)).astype(np.int64),
                                      len(mv.qualifying) - 1)
                    flat = mv.qualifying[pick].astype(np.int64)
                    corners[rows] = np.stack(np.unravel_index(flat, mv.volume.counts), axis=-1)
        self._cache = ((epoch, block), (which, corners))
        return which, corners

    def sample(self, epoch: int, index: int) -> Sample:
        which, corners = self._block(epoch, index // _BLOCK)
        k = index % _BLOCK
        corner = corners[k]
        if self.volumes is not None:
            volume = self.volumes[int(which[k])].volume
            return volume.sample(volume.anchor(corner))
        return Sample(self.arrays[int(which[k])], [(int(c), int(c) + s) for c, s in zip(corner, self.sample_shape)],
                      pad=self.pad, pad_axes=self.pad_axes)

    def identity(self) -> Any:
        """The arrays, their shapes, the crop shape, weights, epoch length and seed; over fields, the fields,
        their arrays' shapes and scales, the masks and what they let through (and ``pad`` when set)."""
        if self.volumes is not None:
            # a region adds each volume's anchor range (lattice start and counts), pad its mode; without them the
            # identity is what it was
            region = [] if self.region is None else \
                [["region", [[list(mv.volume.first), list(mv.volume.counts)] for mv in self.volumes]]]
            return ["fields", _fields_identity(self.fields, self.volumes), [None if m is None else m.plain()
                                                                             for m in self.masks],
                    [None if mv.qualifying is None else _digest(mv.qualifying) for mv in self.volumes],
                    self.weights.round(12).tolist(), self.samples_per_epoch, self.seed] + region + \
                ([] if self.pad is None else ["pad", self.pad]) + self._pad_axes_id() + \
                (["overlapping"] if any(mv.volume.narrowed for mv in self.volumes) else [])
        region = [["region", self._lo.tolist(), self._limits.tolist()]] if self.region is not None else []
        return [self.arrays, self.shapes, self.sample_shape, self.weights.round(12).tolist(), self.samples_per_epoch,
                self.seed] + region + ([] if self.pad is None else ["pad", self.pad]) + self._pad_axes_id()

    def _pad_axes_id(self) -> list:
        # pad_axes only when given, and a padded volume whose anchors keep every field overlapping its arrays
        # (fewer than the first field allows: other samples than before that rule) marked: sources without
        # either keep their fingerprints
        return [] if self.pad_axes is None else ["pad_axes", list(self.pad_axes)]


def _pad_axes(pad: str | None, pad_axes: Any, ndim: int, who: str = "RandomCrops") -> tuple[int, ...] | None:
    """``pad_axes`` checked: None (every axis may be padded), or axis numbers (negative from the end) in
    ``[-ndim, ndim)``, sorted; InvalidArgument without ``pad`` (it would mean nothing) or for another value."""
    if pad_axes is None:
        return None
    if pad is None:
        raise InvalidArgument(f"{who}: pad_axes names the axes boxes may be padded on, and needs pad= (the "
                              "mode that fills them): pass pad=, or leave pad_axes out", knob="pad_axes")
    if isinstance(pad_axes, (int, np.integer)) and not isinstance(pad_axes, bool):
        pad_axes = (pad_axes,)
    ok = isinstance(pad_axes, (list, tuple)) and all(
        isinstance(a, (int, np.integer)) and not isinstance(a, bool) and -ndim <= a < ndim for a in pad_axes)
    axes = sorted({int(a) % ndim for a in pad_axes}) if ok else []
    if not ok or len(axes) != len(pad_axes):
        raise InvalidArgument(f"{who}: pad_axes must be distinct axis numbers in [-{ndim}, {ndim}) (the "
                              f"samples have {ndim} axes), got {pad_axes!r}", knob="pad_axes")
    return tuple(axes)


def _anchors(src: RandomCrops, region: dict | None, storage_options: dict | None) -> tuple[np.ndarray, np.ndarray, list]:
    """RandomCrops' ``(first box start, box starts)`` per array and axis, and each array's volume for the
    default weights and epoch length: the whole array's, or under a region its anchors' span (the voxels
    of the region its boxes cover)."""
    if region is None:
        limits = np.array([[abs(s - c) + 1 for s, c in zip(shape, src.sample_shape)] for shape in src.shapes])
        first = np.array([[min(0, s - c) for s, c in zip(shape, src.sample_shape)] for shape in src.shapes])
        return first, limits, [math.prod(s) for s in src.shapes]
    if src.pad is not None and any(c > s for shape in src.shapes for s, c in zip(shape, src.sample_shape)):
        raise NotYetSupported(f"RandomCrops: region= with arrays shorter than the crop {src.sample_shape} (pad=) is "
                              "not drawn yet; leave region out, or crop no longer than the arrays", knob="region")
    from .region import anchor_ranges

    lo, limits = anchor_ranges(src.arrays, src.shapes, src.sample_shape, region, storage_options)
    volumes = [math.prod(n + c - 1 for n, c in zip(row, src.sample_shape)) if row.all() else 0 for row in limits]
    return lo, limits, volumes


def _check_drawable(src: RandomCrops, w: np.ndarray) -> None:
    """InvalidArgument when a region leaves an array that may be drawn (weight > 0) no box start."""
    empty = [a for a, row, weight in zip(src.arrays, src._limits, w) if weight > 0 and not row.all()]
    if src.region is not None and (empty or not w.sum() > 0):
        raise InvalidArgument(
            f"RandomCrops: region {src.region!r} leaves no box of {src.sample_shape} a start in "
            f"{empty or src.arrays}; widen the region, or leave such arrays out (or give them weight 0)",
            knob="region")


def _volumes_given(arrays: Any) -> list[dict[str, Field]] | None:
    """The volumes of fields when ``arrays`` is a dict of Fields or a list of them, else None (arrays)."""
    if isinstance(arrays, Mapping):
        given = [arrays]
    elif isinstance(arrays, (list, tuple)) and arrays and all(isinstance(a, Mapping) for a in arrays):
        given = list(arrays)
    else:
        return None
    volumes = [check_fields(v, "RandomCrops/TileGrid") for v in given]
    first = volumes[0]
    for i, v in enumerate(volumes[1:], 1):
        same = list(v) == list(first) and all(
            v[n].shape == first[n].shape and v[n].channels == first[n].channels for n in first)
        if not same:
            raise InvalidArgument(
                f"volume {i}'s fields {{{', '.join(f'{n}: {f.shape}' for n, f in v.items())}}} differ from volume "
                f"0's {{{', '.join(f'{n}: {f.shape}' for n, f in first.items())}}}: a batch stacks every sample's "
                "fields, so every volume needs the same field names, shapes and channels")
    return volumes


def _fields_identity(volumes: list[dict[str, Field]], opened: list[MaskedVolume]) -> list:
    return [[{n: f.plain() for n, f in v.items()}, [list(mv.volume.shapes[n]) for n in mv.volume.names],
             [list(mv.volume.scales[n]) for n in mv.volume.names], list(mv.volume.step)]
            for v, mv in zip(volumes, opened)]


def _digest(index: np.ndarray) -> list:
    """What a mask let through, in short: how many anchors, and a hash of which (a rewritten mask changes it)."""
    return [int(index.size), hashlib.sha256(np.ascontiguousarray(index).data).hexdigest()[:16]]


def _weights(weights: Sequence[float] | None, default: Sequence[float], n: int) -> np.ndarray:
    """The sampling weights of ``n`` volumes, normalised (``default`` unless ``weights`` is given)."""
    w = _raw_weights(default if weights is None else weights, n)
    return w / w.sum()


def _raw_weights(weights: Any, n: int) -> np.ndarray:
    """``weights`` as ``n`` finite non-negative float64 numbers, not all zero (an infinite one would leave the
    others NaN once normalised), else InvalidArgument."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        w = None
    if w is None or w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
        raise InvalidArgument(f"weights must be {n} finite non-negative numbers, not all zero, got {weights!r}",
                              knob="weights")
    return w


def _seed(seed: Any, who: str) -> int:
    """``seed`` checked: an integer >= 0 (numpy's seeding refuses a negative one, at the first draw; a fraction
    would be truncated into another order), as the records Loader checks its seed."""
    return integer(f"{who}: seed", seed, 0, knob="seed")


def _epoch_length(samples_per_epoch: Any) -> int | None:
    """``samples_per_epoch`` checked: an integer in ``[1, 2**62]``, or None for the default. A 0, a fraction or
    a bool is refused: read as "the default", or truncated, it would change the epoch without saying so."""
    count = integer("RandomCrops: samples_per_epoch", samples_per_epoch, 1, optional=True, knob="samples_per_epoch")
    if count is not None and count > MAX_SAMPLES:
        raise InvalidArgument(f"RandomCrops: samples_per_epoch must be in [1, 2**62], got {count}",
                              knob="samples_per_epoch")
    return count


class TileGrid(SampleSource):
    """A regular grid of in-bounds crops that covers every voxel of the arrays (``stride`` defaults to the
    sample shape).

    Along each axis tiles start every ``stride``; when the array's length is not a whole number of strides
    past the first tile, the last tile is shifted back to end at the border, so no voxel is left out (that
    tile overlaps its neighbour by more than the others do; a ``stride`` larger than the tile leaves gaps, on
    purpose). An array smaller than a tile on some axis has
    no tile (without ``pad``; a warning names it). With ``shuffle=True`` the tiles are permuted per ``(seed, epoch)``.

    A grid's epoch is never cut short: a :class:`~stoker.Pipeline` (and :class:`~stoker.CropDataset`) yields
    its last batch at its true size whatever ``Config.drop_last`` says, and :meth:`for_rank` splits it with
    ``even="wrap"`` only (a short rank repeats tiles from the start; :class:`~stoker.TileWriter` counts a repeated tile once): its
    ``complete_epochs`` is True.

    With ``pad`` (one of :data:`~stoker.sampling.sample.PAD_MODES`) the grid is laid out as sliding-window
    inference needs it: the *centre* of each tile (the tile less ``(sample_shape - stride) // 2`` on each side)
    tiles the array exactly, so tiles start every ``stride`` from ``-(sample_shape - stride) // 2``, the last ones
    extend past the far border, and every sample is padded (see :class:`~stoker.Sample`); an axis has
    ``ceil(length / stride)`` tiles, also an axis shorter than a tile. ``stride`` may not exceed the tile then.
    ``TileWriter(crop=(sample_shape - stride) // 2)`` writes exactly the centres. ``pad_axes`` (axis numbers,
    with ``pad``, as for :class:`RandomCrops`) names the axes so laid out; the others are tiled as without
    ``pad`` (inside the arrays, the last tile shifted back).

    >>> grid = stoker.TileGrid(["/data/vol.zarr"], (96, 96, 96), stride=(56, 56, 56))   # shape (128, 256, 256)
    >>> [grid.sample(0, i).aabb[0] for i in (0, len(grid) - 1)]
    [(0, 96), (32, 128)]
    >>> padded = stoker.TileGrid(["/data/vol.zarr"], (96, 96, 96), stride=(56, 56, 56), pad="reflect")
    >>> [padded.sample(0, i).aabb[0] for i in (0, len(padded) - 1)]
    [(-20, 76), (36, 132)]

    **Fields.** A dict of :class:`~stoker.Field` (or a list of them, one per volume) tiles the anchors: along
    each axis, every ``stride`` reference voxels from the first anchor that keeps every field's box inside
    its arrays, the last one shifted back to the last such anchor. ``stride`` (reference voxels, a multiple
    of the fields' scales) defaults to the first field's extent (its shape times its scale) rounded down to
    that step, so its boxes tile the anchor range (refused where the extent is shorter than one step: tiles
    would leave gaps); samples are ``Sample({name: (uris, box)})``. Voxels past the first and last anchors'
    boxes (where a context field, kept inside its arrays, stops the anchors short of the border) are tiled
    only with ``pad``. With ``pad`` the first field's tiles are laid
    out as a padded grid over arrays (their centres tile its arrays, the first box at minus the margin
    ``(shape - stride / scale) // 2``); the anchors, and the other fields, follow them, each sharing at least
    a voxel with its arrays at every tile: a grid whose tiles put another field wholly outside them (a
    forecast target past the last time step, nothing but pad) is an InvalidArgument naming the field and the
    tiles; ``pad_axes=(1, 2)`` leaves time unpadded.

    >>> grid = stoker.TileGrid({"raw": stoker.Field("/data/raw.zarr", (96, 96, 96)),
    ...                         "labels": stoker.Field("/data/labels.zarr", (56, 56, 56), offset=(20, 20, 20))},
    ...                        stride=(56, 56, 56))
    """

    def __init__(self, arrays: Any, sample_shape: Sequence[int] | None = None,
                 stride: Sequence[int] | None = None, shuffle: bool = False, seed: int = 0,
                 storage_options: dict | None = None, pad: Any = None, pad_axes: Sequence[int] | None = None) -> None:
        self.pad = None if pad is False else check_pad(pad, "TileGrid")
        seed = _seed(seed, "TileGrid")
        volumes = _volumes_given(arrays)
        self.volumes: list[MaskedVolume] | None = None
        if volumes is not None:
            if sample_shape is not None:
                raise InvalidArgument("TileGrid over fields takes each field's shape in its Field, not sample_shape; "
                                      "leave sample_shape out", knob="sample_shape")
            self.pad_axes = _pad_axes(self.pad, pad_axes, len(next(iter(volumes[0].values())).shape), "TileGrid")
            self._init_fields(volumes, stride, shuffle, seed, storage_options)
            return
        if sample_shape is None:
            raise InvalidArgument("TileGrid over arrays needs sample_shape (the tile's shape)", knob="sample_shape")
        self.arrays = _entries(arrays, "TileGrid")
        self.sample_shape = integers("TileGrid: sample_shape", sample_shape, 1, knob="sample_shape")
        self.pad_axes = _pad_axes(self.pad, pad_axes, len(self.sample_shape), "TileGrid")
        self.stride = self.sample_shape if stride is None else integers("TileGrid: stride", stride, 1, knob="stride")
        if len(self.stride) != len(self.sample_shape):
            raise InvalidArgument(f"stride must be {len(self.sample_shape)} positive integers, got {self.stride}",
                                  knob="stride")
        padded = self._padded_axes(len(self.stride))
        if any(self.stride[d] > self.sample_shape[d] for d in padded):
            raise InvalidArgument(f"TileGrid(pad={self.pad!r}): stride {self.stride} exceeds the tile "
                                  f"{self.sample_shape} on some padded axis; a padded grid's tile centres (the tile "
                                  "less (sample_shape - stride) // 2 on each side) tile the array: use a stride up "
                                  "to the tile", knob="stride")
        # a padded grid's tiles start this far before each stride (the margin around each tile's centre); an
        # axis not padded (pad_axes) is tiled as without pad: inside the array, the last tile shifted back
        self._margin = tuple((c - st) // 2 if d in padded else 0
                             for d, (c, st) in enumerate(zip(self.sample_shape, self.stride)))
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shapes = _entry_shapes(self.arrays, storage_options)
        self._counts = []
        self._offsets = [0]  # tiles before each array (Python ints: counts of huge grids overflow int64)
        self._shifted = False  # some axis ends with a tile shifted back to the border
        for uri, shape in zip(self.arrays, self.shapes):
            if len(shape) != len(self.sample_shape):
                raise _rank_mismatch(uri, self.sample_shape, shape)
            # padded: the centres tile the axis, ceil(length / stride) of them; else the tiles inside it
            counts = tuple(-(-s // st) if d in padded else 0 if s < c else -(-(s - c) // st) + 1
                           for d, (s, c, st) in enumerate(zip(shape, self.sample_shape, self.stride)))
            self._counts.append(counts)
            if math.prod(counts) and self.pad is None:
                self._shifted |= any((s - c) % st for s, c, st in zip(shape, self.sample_shape, self.stride))
            self._offsets.append(self._offsets[-1] + math.prod(counts))
        if self._offsets[-1] == 0:
            shapes = ", ".join(f"{uri} {shape}" for uri, shape in zip(self.arrays[:4], self.shapes))
            raise InvalidArgument(f"TileGrid: no array can hold a {self.sample_shape} tile ({shapes}"
                                  f"{', ...' if len(self.arrays) > 4 else ''}): use a smaller sample_shape, or "
                                  f"{self._let_past(self.shapes)}", knob="sample_shape")
        left_out = [f"{uri} {shape}" for uri, shape, counts in zip(self.arrays, self.shapes, self._counts)
                    if not math.prod(counts)]
        if left_out:  # a volume of an evaluation or inference set silently missing from its epoch
            warnings.warn(f"TileGrid: {len(left_out)} of {len(self.arrays)} arrays are shorter than the tile "
                          f"{self.sample_shape} on some axis and get no tile, so none of their voxels is in the "
                          f"grid ({', '.join(left_out[:4])}{', ...' if len(left_out) > 4 else ''}): "
                          f"{self._let_past([sh for sh, n in zip(self.shapes, self._counts) if not math.prod(n)])}, "
                          "or use a smaller sample_shape", stacklevel=2)
        if self._offsets[-1] > MAX_SAMPLES:
            raise InvalidArgument(
                f"TileGrid over {self.arrays}: {self._offsets[-1]} tiles of {self.sample_shape} at stride "
                f"{self.stride}, more than the 2**62 samples an epoch can hold; use a larger stride or sample_shape")
        self._perm: Permutation | None = None

    def _init_fields(self, volumes: list[dict[str, Field]], stride: Sequence[int] | None, shuffle: bool, seed: int,
                     storage_options: dict | None) -> None:
        from ..storage.locate import Stores

        self.fields, self.shuffle, self.seed = volumes, bool(shuffle), int(seed)
        stores = Stores()
        try:
            # overlap=False: a padded grid's tiles follow its first field's (their centres tile its arrays), and its
            # border tiles partly outside are by design
            self.volumes = [open_volume(v, None, storage_options, stores, "TileGrid", pad=self.pad,
                                        pad_axes=self.pad_axes, overlap=False) for v in volumes]
        finally:
            stores.close()
        first = self.volumes[0].volume
        ndim = len(first.counts)
        if stride is None:  # the first field's extent in reference voxels, on the anchors' lattice
            name = first.names[0]
            extent = [c * s for c, s in zip(first.fields[name].shape, first.scales[name])]
            stride = [max(st, e // st * st) for st, e in zip(first.step, extent)]
            if any(st > e for st, e in zip(stride, extent)):  # no stride on the lattice tiles without gaps
                raise InvalidArgument(
                    f"TileGrid: field {name!r}'s box {first.fields[name].shape} spans {tuple(extent)} reference "
                    f"voxels, less than the step {first.step} its anchors lie on (the least common multiple of the "
                    "fields' scales) on some axis, so tiles every step would leave voxels between them unread; "
                    "make the first field's box at least one step long on each axis, or pass a stride (one "
                    "larger than the box leaves those gaps on purpose)", knob="stride")
        self.stride = integers("TileGrid: stride", stride, 1, knob="stride")
        if len(self.stride) != ndim:
            raise InvalidArgument(f"TileGrid: stride must be {ndim} positive integers, got {self.stride}", knob="stride")
        self._counts, self._offsets, self._lattice_stride, self._starts = [], [0], [], []
        for i, mv in enumerate(self.volumes):
            step = mv.volume.step
            if any(s % st for s, st in zip(self.stride, step)):
                raise InvalidArgument(
                    f"TileGrid: stride {self.stride} (reference voxels) is not a multiple of the step {step} anchors "
                    f"of volume {i} lie on (the least common multiple of its fields' scales): round it to one",
                    knob="stride")
            lattice = tuple(s // st for s, st in zip(self.stride, step))
            counts = tuple(-(-(n - 1) // q) + 1 for n, q in zip(mv.volume.counts, lattice))
            if self.pad is not None:  # the padded axes laid out from the first field's tiles, the others as above
                padded = self._padded_axes(ndim)
                first_anchor, padded_counts = _padded_layout(mv.volume, self.stride, self.pad, i, padded)
                counts = tuple(padded_counts[d] if d in padded else c for d, c in enumerate(counts))
                self._starts.append((first_anchor, counts))
                _check_overlapping(mv.volume, first_anchor, counts, self.stride, padded, i, self.pad_axes)
            self._lattice_stride.append(lattice)
            self._counts.append(counts)
            self._offsets.append(self._offsets[-1] + math.prod(counts))
        if self._offsets[-1] > MAX_SAMPLES:
            raise InvalidArgument(f"TileGrid: {self._offsets[-1]} tiles at stride {self.stride}, more than the 2**62 "
                                  "samples an epoch can hold; use a larger stride", knob="stride")
        self._shifted = False
        self._perm = None

    complete_epochs = True

    def _padded_axes(self, ndim: int) -> tuple[int, ...]:
        """The axes tiles may reach past the arrays on: every axis with pad, or those of pad_axes; none without."""
        if self.pad is None:
            return ()
        return tuple(range(ndim)) if self.pad_axes is None else self.pad_axes

    def _let_past(self, shapes: Sequence[Sequence[int]]) -> str:
        """How to let tiles reach past the borders of arrays of ``shapes`` too short for the tile: pad=, or (with
        pad= and pad_axes) adding the short axes to pad_axes."""
        if self.pad is None:
            return "pass pad= to let tiles reach past the borders"
        padded = self._padded_axes(len(self.sample_shape))
        short = sorted({d for shape in shapes for d, (n, c) in enumerate(zip(shape, self.sample_shape))
                        if n < c and d not in padded})
        return (f"add axis {', '.join(map(str, short))} to pad_axes {self.pad_axes} (or leave pad_axes out) to let "
                "tiles reach past the borders there")

    def _pad_axes_id(self) -> list:
        # only when given: grids without pad_axes keep their fingerprints
        return [] if self.pad_axes is None else ["pad_axes", list(self.pad_axes)]

    def __len__(self) -> int:
        return self._offsets[-1]

    def sample(self, epoch: int, index: int) -> Sample:
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"tile {index} out of range for a grid of {len(self)}")
        if self.shuffle:
            self._perm = _order(self._perm, len(self), self.seed, epoch)
            index = self._perm[index]
        a = bisect.bisect_right(self._offsets, index) - 1
        rest, tile = index - self._offsets[a], []
        for count in reversed(self._counts[a]):  # C order, as numpy.unravel_index
            rest, t = divmod(rest, count)
            tile.append(t)
        if self.volumes is not None and self.pad is not None:  # tile t's first-field centre starts at t * stride
            volume = self.volumes[a].volume
            first, padded = self._starts[a][0], self._padded_axes(len(self.stride))
            return volume.sample(tuple(f + t * st if d in padded else
                                       (volume.first[d] + min(t * q, n - 1)) * volume.step[d]
                                       for d, (f, t, st, q, n) in enumerate(zip(
                                           first, reversed(tile), self.stride, self._lattice_stride[a],
                                           volume.counts))))
        if self.volumes is not None:  # the last tile of an axis at the last anchor
            volume = self.volumes[a].volume
            k = [min(t * q, n - 1) for t, q, n in zip(reversed(tile), self._lattice_stride[a], volume.counts)]
            return volume.sample(volume.anchor(k))
        if self.pad is not None:  # tile t's centre starts at t * stride (an axis not in pad_axes: as below)
            padded = self._padded_axes(len(self.stride))
            corner = [t * st - m if d in padded else min(t * st, s - c) for d, (t, st, m, s, c) in
                      enumerate(zip(reversed(tile), self.stride, self._margin, self.shapes[a], self.sample_shape))]
        else:  # the last tile of an axis ends at the border (shifted back when the strides do not land there)
            corner = [min(t * st, s - c) for t, st, s, c in
                      zip(reversed(tile), self.stride, self.shapes[a], self.sample_shape)]
        return Sample(self.arrays[a], [(c, c + s) for c, s in zip(corner, self.sample_shape)], pad=self.pad,
                      pad_axes=self.pad_axes)

    def identity(self) -> Any:
        """The arrays, their shapes, the tile shape and stride, and the order's settings."""
        if self.volumes is not None:
            return ["fields", _fields_identity(self.fields, self.volumes), self.stride, self.shuffle, self.seed] + \
                _order_id(self) + ([] if self.pad is None else ["pad", self.pad]) + self._pad_axes_id()
        # grids whose last tiles are shifted to the border hold other tiles than before they were: marked, so a
        # state saved for the grid that left the remainder out is not resumed into this one
        cover = ["cover-border"] if self._shifted else []
        pad = [] if self.pad is None else ["pad", self.pad]
        return [self.arrays, self.shapes, self.sample_shape, self.stride, self.shuffle, self.seed] + \
            _order_id(self) + cover + pad + self._pad_axes_id()


def _padded_layout(volume: Any, stride: tuple[int, ...], pad: str, i: int,
                   padded: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A padded grid over fields: ``(first anchor, tiles per axis)``, of which the axes ``padded`` count. The
    first field's tiles are laid out as a padded grid over arrays: their centres (the box less
    ``(shape - stride) // 2`` on each side, in its own voxels) tile its arrays, so its boxes start every
    stride at ``-(shape - stride) // 2``; the anchor follows (``box start * scale - offset``), and the other
    fields with it."""
    name = volume.names[0]
    f, scale, shape = volume.fields[name], volume.scales[name], volume.shapes[name]
    own = [st // s for st, s in zip(stride, scale)]  # the stride in the first field's voxels
    if any(own[d] > f.shape[d] for d in padded):
        raise InvalidArgument(
            f"TileGrid(pad={pad!r}): stride {stride} (reference voxels; {tuple(own)} of field {name!r}'s voxels) "
            f"exceeds field {name!r}'s box {f.shape} on some axis; a padded grid's tile centres tile the arrays: use "
            "a stride up to the first field's extent", knob="stride")
    first = tuple(-((c - st) // 2) * s - o for c, st, s, o in zip(f.shape, own, scale, f.offset))
    for d, (a, step) in enumerate(zip(first, volume.step)):
        if d in padded and a % step:
            raise InvalidArgument(
                f"TileGrid(pad={pad!r}) over volume {i}: the first tile's anchor on axis {d} is {a} (field {name!r}'s "
                f"box less its margin (shape - stride) // 2, times its scale, less its offset), not a multiple of "
                f"{step}, the fields' scales' least common multiple, so some box would not start on a whole voxel; "
                "choose a stride whose margin is a multiple of it", knob="stride", axis=d)
    counts = tuple(-(-n // st) for n, st in zip(shape, own))
    return first, counts


def _check_overlapping(volume: Any, first: Sequence[int], counts: Sequence[int], stride: Sequence[int],
                       padded: Sequence[int], i: int, pad_axes: Any) -> None:
    """InvalidArgument where a padded grid's tile puts a field other than the first wholly outside its arrays
    on a padded axis (a forecast target past the last time step): it would be nothing but the pad. The first
    field's tiles overlap its arrays by construction; dropping the tile would leave its voxels out of a grid
    that covers them all, so the grid is refused instead."""
    for d in padded:
        for name in volume.names[1:]:
            f, s, a = volume.fields[name], volume.scales[name][d], volume.shapes[name][d]
            lo, hi = s * (1 - f.shape[d]) - f.offset[d], s * (a - 1) - f.offset[d]  # anchors sharing a voxel
            # the tiles t whose anchor first[d] + t * stride[d] lies below lo, and above hi
            below = min(counts[d], max(0, -(-(lo - first[d]) // stride[d])))
            above = max(0, min(counts[d], (hi - first[d]) // stride[d] + 1))
            for t0, t1 in ((0, below), (above, counts[d])):
                if t0 >= t1:
                    continue
                anchor = first[d] + t0 * stride[d]
                (b0, b1) = volume.box(name, [anchor if k == d else 0 for k in range(len(first))])[d]
                tiles = f"tile {t0}" if t1 - t0 == 1 else f"tiles {t0} to {t1 - 1}"
                fix = (f"leave axis {d} out of pad_axes {tuple(pad_axes)}" if pad_axes is not None else
                       f"pass pad_axes without axis {d} (the axes that may be padded; on the others the tiles keep "
                       "every field inside its arrays, as without pad)")
                raise InvalidArgument(
                    f"TileGrid: volume {i}'s {tiles} (of {counts[d]}) along axis {d} put field {name!r}'s box wholly "
                    f"outside its arrays' [0, {a}) on that axis (tile {t0}: [{b0}, {b1})): it would hold nothing but the "
                    f"pad; {fix}, or give {name!r} an offset and shape that keep it overlapping its arrays at "
                    "every tile of the first field", field=name, axis=d, knob="pad_axes")


class SampleList(SampleSource):
    """An explicit list of samples (permuted per ``(seed, epoch)`` with ``shuffle=True``). ``complete=True``:
    its epochs are delivered whole (see :attr:`SampleSource.complete_epochs`), as tiles to infer are."""

    def __init__(self, samples: Sequence[Sample], shuffle: bool = False, seed: int = 0,
                 complete: bool = False) -> None:
        self.complete_epochs = bool(complete)
        seed = _seed(seed, "SampleList")
        self.samples = list(samples)
        if not all(isinstance(s, Sample) for s in self.samples):
            raise InvalidArgument("SampleList takes stoker.Sample objects")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._perm: Permutation | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, epoch: int, index: int) -> Sample:
        if self.shuffle:
            self._perm = _order(self._perm, len(self), self.seed, epoch)
            index = self._perm[index]
        return self.samples[index]

    def identity(self) -> Any:
        """Every sample (its arrays and box; a sample of fields: each field's) and the order's settings."""
        return [_sample_id(s) for s in self.samples] + [self.shuffle, self.seed] + _order_id(self)


def _sample_id(s: Sample) -> list:
    """A sample in a SampleList's identity: ``[uri(s), box]`` as always (``pad`` after it when set); a sample of
    fields: ``{name: that field's}`` and its pad."""
    if s.fields is not None:
        return [{name: _sample_id(f) for name, f in s.fields.items()}, s.pad]
    return [given_uri(s), s.aabb] + ([] if s.pad is None else [s.pad])


def _order(cached: Permutation | None, n: int, seed: int, epoch: int) -> Permutation:
    """The shuffled order of ``epoch``, reusing ``cached`` when it is that epoch's."""
    if cached is not None and cached.key == (n, seed, epoch):
        return cached
    return Permutation(n, seed, epoch)


def _order_id(source: SampleSource) -> list[str]:
    """What a shuffled source adds to its identity: the order's version (a state saved under an earlier
    order must not resume into other samples). Unshuffled sources keep their fingerprints."""
    return [ORDER_VERSION] if getattr(source, "shuffle", False) else []


class RankShare:
    """One rank's share of a source: iterate it, push it into a Pipeline, save and restore its position.

    Iterating yields this rank's remaining samples of the current epoch (and
    advances the position as samples are yielded); :meth:`forever` continues
    into the following epochs. The position is an :class:`~stoker.sampling.cursor.EpochCursor`.
    """

    def __init__(self, source: SampleSource, rank: int, world_size: int, policy: str, even: str) -> None:
        self.cursor = EpochCursor(len(source), rank, world_size, policy, even)
        self.source = source
        self.rank, self.world_size, self.policy, self.even = self.cursor.rank, self.cursor.world_size, policy, even
        # the epoch of a position load_state_dict gave and no iteration has started from yet: set_epoch of that
        # epoch keeps it (the usual epoch loop after a resume), any other starts its epoch from the beginning
        self._loaded: int | None = None

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    @property
    def steps(self) -> int:
        """Samples this rank consumed in the current run of this epoch."""
        return self.cursor.steps

    @property
    def segments(self) -> list:
        """Earlier runs of this epoch: ``(world_size, policy, even, steps)``."""
        return self.cursor.segments

    def __len__(self) -> int:
        """Samples this rank still has in the current epoch."""
        return max(0, len(self.cursor.share()) - self.cursor.steps)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call it on every rank, like DistributedSampler's); an integer
        >= 0 (InvalidArgument otherwise: a negative epoch has no order, a fraction would run another epoch).
        Right after :meth:`load_state_dict` of a position in ``epoch`` (no iteration since), the position is
        kept, so the usual loop resumes exactly::

            mine.load_state_dict(saved)              # epoch 3, 40 samples in
            for epoch in range(3, n_epochs):
                mine.set_epoch(epoch)                # epoch 3 continues at sample 41
                pipeline.push(mine)
        """
        epoch = integer("set_epoch: epoch", epoch, 0, knob="epoch")
        if epoch != self._loaded:
            self._loaded = None
            self.cursor.place(epoch, [], 0)

    def __iter__(self) -> "_Cursor":
        self._loaded = None
        return _Cursor(self, forever=False)

    def forever(self) -> "_Cursor":
        """An endless iterator: this epoch's remaining samples, then the next epochs'. InvalidArgument when an
        epoch gives this rank no sample (fewer samples than ranks with ``even="drop"``, or an empty source):
        the next sample would be looked for epoch after epoch, for ever."""
        self._loaded = None
        each = partition.per_rank(len(self.source), self.world_size, self.even)
        if each == 0:
            fix = "give it samples" if not len(self.source) else \
                "use more samples (samples_per_epoch), fewer ranks, or even='wrap'"
            raise InvalidArgument(
                f"{type(self.source).__name__} of {len(self.source)} samples split over {self.world_size} ranks "
                f"with even={self.even!r} gives each rank no samples an epoch, so an endless iteration would never "
                f"yield one; {fix}", knob="even")
        return _Cursor(self, forever=True)

    # -- state ------------------------------------------------------------------------------

    def _order(self) -> dict:
        return {"seed": self.source.seed, "fingerprint": self.source.fingerprint}

    def state_dict(self) -> dict:
        """Where this rank is: epoch, global position, and what is needed to resume on any world size."""
        return self.cursor.state(self._order()).to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (saved with any world size): nothing repeated or skipped in the epoch. On
        the split it was saved on (world size, policy, even) every rank continues its share exactly as an
        uninterrupted run would, the wrapped tail of a short rank too; on another split what the saved run
        left is split anew."""
        saved = CursorState.from_dict(state)
        if saved.order.get("fingerprint") != self.source.fingerprint:
            shuffled = (f"; a state of a shuffled order other than {ORDER_VERSION} (saved by an earlier stoker) "
                        "cannot resume here: start its epoch again") if _order_id(self.source) else ""
            raise InvalidArgument(
                f"this state was saved for another sample list (fingerprint {saved.order.get('fingerprint')!r}, "
                f"this source is {self.source.fingerprint!r}): the same arrays, sample shape, seed and settings "
                f"are needed{shuffled}"
            )
        self.cursor.load(saved, keep_split=True)
        self._loaded = self.cursor.epoch


class _Cursor:
    """An iterator over a RankShare that knows the share's state after any number of its samples.

    A Pipeline pulls ahead of what the consumer has popped; it asks
    :meth:`state_after` for the state as of the samples really consumed. ``key`` is the ``(epoch, index)`` of
    the sample it yielded last (its index in the epoch's global order: the same on any world size), the key
    the pipeline gives that sample's keyed transforms.
    """

    def __init__(self, src: RankShare, forever: bool) -> None:
        self.src = src
        self.forever = forever
        self.key: tuple[int, int] | None = None
        c = src.cursor
        self.start = c.at(c.epoch, c.segments, c.steps)
        self._gen = self._run()

    def _run(self) -> Iterator[Sample]:
        src = self.src
        c = self.start
        epoch, segments, steps = c.epoch, c.segments, c.steps
        while True:
            positions = c.at(epoch, segments, 0).share()
            for i in range(steps, len(positions)):
                src.cursor.place(epoch, segments, i + 1)
                index = int(positions[i])
                self.key = (epoch, index)
                yield src.source.sample(epoch, index)
            if not self.forever:
                return
            epoch, segments, steps = epoch + 1, [], 0

    def __iter__(self) -> "_Cursor":
        return self

    def __next__(self) -> Sample:
        return next(self._gen)

    @property
    def complete_epochs(self) -> bool:
        """Whether its source's epochs are delivered whole (a grid's tiles): a pipeline then launches the last
        short batch whatever ``Config.drop_last`` says (see :attr:`SampleSource.complete_epochs`)."""
        return bool(getattr(self.src.source, "complete_epochs", False))

    def state_after(self, n: int) -> dict:
        """The share's state once ``n`` samples of this iterator have been consumed."""
        return self.start.after(n, self.forever).state(self.src._order()).to_dict()
