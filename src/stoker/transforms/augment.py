"""The built-in keyed augmentations: RandomFlip and RandomTranspose, in place on the batch's device.

Each sample's draw is a function of ``(seed, key)`` alone (:func:`~stoker.transforms.keys.uniform`), made on
the host from the batch's keys; the samples are then grouped by draw and each group flipped (or permuted)
with one indexing, one ``torch.flip`` (or ``permute``) and one write back per tensor: no Python per sample,
no global random state. A batch is a tensor ``(B, *sample_shape)`` or a mapping ``{name: (B, ...)}`` of
fields: every field of a sample gets that sample's draw, on its own trailing axes, each field about its own
centre. That keeps the fields over one another only when their boxes share a centre (and, for a transpose, when
each field's voxels have one spacing on the axes it swaps): the pipeline checks each source's fields against
:meth:`RandomFlip.check_layout` before the first batch (:mod:`.layout`), an InvalidArgument saying what to change
otherwise; ``about="own_centre"`` turns each field about its own centre unchecked.

>>> flip = RandomFlip(axes=(-3, -2, -1), seed=0)
>>> flip(batch, keys)                      # the pipeline calls it so: Config(transform=flip)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..checks import int64
from ..errors import InvalidArgument
from .compose import Keyed
from .keys import check_keys, uniform
from .layout import Layout, apart_error, centres_apart, uneven

_FLIP_SALT = 0x466C6970  # "Flip": the built-ins' draws differ from each other's and from uniform(salt=0)
_TRANSPOSE_SALT = 0x5472616E  # "Tran"


def _axes(who: str, axes: Any, least: int) -> tuple[int, ...]:
    """``axes`` as distinct negative ints (trailing axes, counted from the end of every field)."""
    try:
        out = tuple(int(a) for a in (axes if isinstance(axes, (list, tuple)) else (axes,)))
    except (TypeError, ValueError):
        raise InvalidArgument(f"{who}: axes must be integers, got {axes!r}", knob="axes") from None
    if len(out) < least or any(a >= 0 for a in out) or len(set(out)) != len(out):
        raise InvalidArgument(
            f"{who}: axes must be {least} or more distinct negative integers (trailing axes of each sample, "
            f"counted from the end, so they name the same axes in fields with and without a channel axis), got "
            f"{axes!r}", knob="axes")
    return out


#: what ``about=`` may say: the fields' shared centre (checked by the pipeline), or each field's own (unchecked)
ABOUT = ("shared_centre", "own_centre")


def _about(who: str, about: Any) -> str:
    if about not in ABOUT:
        raise InvalidArgument(f"{who}: about must be one of {list(ABOUT)}, got {about!r}", knob="about")
    return str(about)


def _seed(who: str, seed: Any) -> int:
    return int64(f"{who}: seed", seed, knob="seed")


def _tensors(who: str, batch: Any, axes: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    """The batch's tensors with their names (``""`` for a plain tensor batch), all of one batch size, each with
    the trailing ``axes`` after its axis 0."""
    if isinstance(batch, torch.Tensor):
        items = [("", batch)]
    elif isinstance(batch, Mapping) and all(isinstance(v, torch.Tensor) for v in batch.values()) and batch:
        items = [(str(k), v) for k, v in batch.items()]
    else:
        raise InvalidArgument(f"{who} takes a batch tensor or a dict of field tensors, got "
                              f"{type(batch).__name__}", knob="transform")
    sizes = {t.shape[0] if t.dim() else None for _, t in items}
    if len(sizes) != 1 or None in sizes:
        raise InvalidArgument(f"{who}: every field must have the batch's axis 0, got shapes "
                              f"{ {n: tuple(t.shape) for n, t in items} }", knob="transform")
    for name, t in items:
        if t.dim() < 1 + max(-a for a in axes):
            raise InvalidArgument(f"{who}(axes={axes}): {_where(name)} of shape {tuple(t.shape)} has too few axes "
                                  "(axis 0 is the batch's)", knob="axes")
    return items


def _where(name: str) -> str:
    return f"field {name!r}" if name else "the batch"


def _groups(codes: np.ndarray) -> Iterator[tuple[int, Any]]:
    """``(code, rows)`` per distinct nonzero code: ``rows`` a slice for a contiguous run, else an index array."""
    for code in np.unique(codes):
        if code == 0:
            continue
        rows = np.flatnonzero(codes == code)
        if rows[-1] - rows[0] + 1 == len(rows):
            yield int(code), slice(int(rows[0]), int(rows[-1]) + 1)
        else:
            yield int(code), rows


def _changed(x: torch.Tensor, flip: list[int] | None, permute: list[int] | None) -> torch.Tensor:
    """``x`` flipped along ``flip`` or permuted by ``permute``, as a new tensor (never a view of ``x``)."""
    if flip is not None:
        return x.flip(flip)
    assert permute is not None
    return x.permute(permute).clone()  # a view of the same memory: copied before it is written over its source


#: torch's unsigned dtypes wider than a byte have no flip along the last axis nor index_copy_ (label ids are often
#: uint32 or uint64): they are moved as the signed integers of their size, the same bits
_SIGNED = {getattr(torch, f"uint{n}"): getattr(torch, f"int{n}") for n in (16, 32, 64) if hasattr(torch, f"uint{n}")}


def _rewrite(t: torch.Tensor, rows: Any, flip: list[int] | None = None, permute: list[int] | None = None) -> None:
    """``t[rows]`` flipped along ``flip`` or permuted by ``permute``, in place (values moved, never changed)."""
    if t.dtype in _SIGNED:
        t = t.view(_SIGNED[t.dtype])  # a view of the same memory: the writes land in the batch
    if isinstance(rows, slice):
        view = t[rows]
        view.copy_(_changed(view, flip, permute))
        return
    # a small host-to-device copy of the row numbers; from pageable memory it is staged at once, and the
    # index kernels run on the current (the pipeline's side) stream after it
    index = torch.from_numpy(rows).to(t.device, non_blocking=True)
    t.index_copy_(0, index, _changed(t.index_select(0, index), flip, permute))


class RandomFlip(Keyed):
    """Flip each sample along each of ``axes`` with probability ``p``, drawn per sample from
    ``(seed, epoch, index)``: a resumed run, a slower consumer and another device flip alike.

    ``axes`` are trailing axes (negative), the same for every field of a dict batch; a sample's draw applies to
    all its fields, each flipped about its own centre. The pipeline refuses fields whose boxes do not share a
    centre on ``axes`` (they would no longer lie over one another) unless ``about="own_centre"``. In place, on
    the batch's device.

    >>> cfg = stoker.Config(batch_size=8, dtype="f32", transform=[RandomFlip(axes=(-3, -2, -1), seed=0)])
    """

    def __init__(self, axes: Sequence[int] = (-3, -2, -1), seed: int = 0, p: float = 0.5,
                 about: str = "shared_centre") -> None:
        self.axes = _axes("RandomFlip", axes, 1)
        self.seed = _seed("RandomFlip", seed)
        self.about = _about("RandomFlip", about)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise InvalidArgument(f"RandomFlip: p must be a probability in [0, 1], got {p!r}", knob="p")
        self.p = float(p)

    def draws(self, keys: Any) -> np.ndarray:
        """``(B, len(axes))`` bool: whether each sample is flipped along each axis."""
        return uniform(keys, self.seed, len(self.axes), _FLIP_SALT) < self.p

    def __call__(self, batch: Any, keys: Any = None) -> Any:
        items = _tensors("RandomFlip", batch, self.axes)
        flips = self.draws(check_keys(keys, items[0][1].shape[0], "RandomFlip"))
        codes = flips.astype(np.int64) @ (1 << np.arange(len(self.axes), dtype=np.int64))
        for code, rows in _groups(codes):
            dims = [a for j, a in enumerate(self.axes) if code >> j & 1]
            for _, t in items:
                _rewrite(t, rows, flip=dims)
        return batch

    def check_layout(self, layout: Layout, where: str) -> None:
        """InvalidArgument where the fields of ``layout`` (name -> :class:`~.layout.FieldBox`) have other centres on
        a flipped axis; ``where`` names the samples."""
        apart = centres_apart(layout, self.axes)
        if apart:
            raise apart_error(repr(self), layout, self.axes, apart, where, "flip", "flipped")

    def __repr__(self) -> str:
        about = "" if self.about == "shared_centre" else f", about={self.about!r}"
        return f"RandomFlip(axes={self.axes}, seed={self.seed}, p={self.p}{about})"


class RandomTranspose(Keyed):
    """Permute ``axes`` of each sample by one of their ``len(axes)!`` orders (the identity among them),
    drawn uniformly per sample from ``(seed, epoch, index)``.

    The permuted axes must have one size in every field (InvalidArgument naming the field otherwise); a
    sample's draw applies to all its fields. The pipeline refuses arrays whose voxels have other spacings on
    ``axes`` (OME-Zarr ``scale`` ``[4, 1, 1]`` and z among them) and fields whose boxes do not share a centre on
    them, unless ``about="own_centre"``. In place, on the batch's device.

    >>> cfg = stoker.Config(batch_size=8, dtype="f32", transform=[RandomTranspose(axes=(-2, -1), seed=1)])
    """

    def __init__(self, axes: Sequence[int] = (-2, -1), seed: int = 0, about: str = "shared_centre") -> None:
        self.axes = _axes("RandomTranspose", axes, 2)
        self.seed = _seed("RandomTranspose", seed)
        self.about = _about("RandomTranspose", about)
        self.orders = list(itertools.permutations(range(len(self.axes))))  # orders[0] is the identity

    def draws(self, keys: Any) -> np.ndarray:
        """``(B,)`` int: each sample's order, an index into ``self.orders`` (0: unchanged)."""
        u = uniform(keys, self.seed, 1, _TRANSPOSE_SALT)[:, 0]
        return np.minimum((u * math.factorial(len(self.axes))).astype(np.int64), len(self.orders) - 1)

    def __call__(self, batch: Any, keys: Any = None) -> Any:
        items = _tensors("RandomTranspose", batch, self.axes)
        codes = self.draws(check_keys(keys, items[0][1].shape[0], "RandomTranspose"))
        for name, t in items:
            sizes = {t.shape[a] for a in self.axes}
            if len(sizes) > 1:
                raise InvalidArgument(
                    f"RandomTranspose(axes={self.axes}): {_where(name)} of shape {tuple(t.shape)} has sizes "
                    f"{[t.shape[a] for a in self.axes]} on those axes; transposed axes need one size. Transpose "
                    "only axes of equal size (e.g. axes=(-2, -1) of a (Z, Y, Y) box), or make the crops cubic",
                    knob="axes")
        for code, rows in _groups(codes):
            order = self.orders[code]
            for _, t in items:
                dims = list(range(t.dim()))
                pos = [t.dim() + a for a in self.axes]
                for i, p in enumerate(pos):
                    dims[p] = pos[order[i]]
                _rewrite(t, rows, permute=dims)
        return batch

    def check_layout(self, layout: Layout, where: str) -> None:
        """InvalidArgument where a field of ``layout`` has voxels of other spacings on the permuted axes (a
        transpose would put z's voxels on y), or the fields have other centres on them; ``where`` names the
        samples."""
        for name, box in layout.items():
            if uneven(box, self.axes):
                what = f"field {name!r}" if name else "the batch"
                spacing = [box.spacing[a] for a in self.axes if len(box.spacing) >= -a]
                raise InvalidArgument(
                    f"{self!r}: {where}: {what}'s voxels have spacings {[f'{v:g}' for v in spacing]} on axes "
                    f"{self.axes} (from its OME-Zarr scale, or its field's scale); a transpose would put the voxels "
                    "of one axis on another of other spacing (z on y), a distorted sample. Transpose only axes of "
                    "one spacing (e.g. axes=(-2, -1) for a scale of [4, 1, 1]), or pass about='own_centre' to "
                    "transpose the voxels anyway", knob="axes")
        apart = centres_apart(layout, self.axes)
        if apart:
            raise apart_error(repr(self), layout, self.axes, apart, where, "transpose", "transposed", least=2)

    def __repr__(self) -> str:
        about = "" if self.about == "shared_centre" else f", about={self.about!r}"
        return f"RandomTranspose(axes={self.axes}, seed={self.seed}{about})"
