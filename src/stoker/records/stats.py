"""Normalisation statistics of record fields: one streaming pass, merged across ranks, cached on disk.

    >>> stats = compute_stats(ds, ["positions", "velocity"], derived_input="normalized",
    ...                       derived={"edge": lambda s: s["positions"][:, 1:] - s["positions"][:, :-1]})
    >>> stats["positions"].mean, stats["edge"].std          # per channel: shape (3,)
    >>> batch = normalize(ds[0], stats)                      # what the model trains on

The records are cut into at most :data:`MAX_BLOCKS` blocks of consecutive records, of a size that depends
on the number of records alone; each rank reads the blocks ``rank::world_size`` once and keeps Chan-style
moments (count, mean, M2, min, max) per channel and block, merged record by record in record order. The
blocks' moments travel in one ``all_gather`` of a few numbers per channel and block and every rank merges
them in block order: every rank returns bit-identical statistics, and so does every world size (the same
merges in the same order), so a fingerprint of them (``precompute(normalized_with=...)``) is the same too.
Records weigh by their element count: a record with twice the nodes counts
twice, and no record is counted more than once.

Derived quantities need a second pass, and only they do: they are computed on
samples *normalised with the plain fields' statistics* (pass one), exactly as
training computes them, e.g. edge vectors from normalised positions
(``derived_input="normalized"``), or on the stored values (``"raw"``); a derived
function that reads a normalised field without either said is an error.
``reuse=`` takes pass one's result from an earlier call.

One NaN or infinity would make a field's statistics NaN, and normalising with
them would turn every sample into NaN. By default (``nonfinite="raise"``) a
record holding one is a :class:`~stoker.errors.NonFiniteData` naming the record,
the field and the count, raised on every rank (the ranks agree through the same
collective that carries their moments) and nothing is written.
``nonfinite="skip"`` leaves non-finite values out and counts them per channel in
``FieldStats.skipped`` (and the sidecar).

The result is written once, by rank 0, to ``root/.stoker-stats.json`` (see
:mod:`stoker.records.sidecar`; for a dataset in a store, which stoker does not write
to, the same file in the dataset's folder of the local cache, see
:mod:`stoker.storage.artifacts`) and reused while the fingerprint matches: rank 0
reads the entry and shares it with every rank, or computes it with them under a
claim, so another job computing the same statistics at the same moment waits for
this one's entry instead of computing it again; the other ranks wait on a barrier
until the file is in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..dist.collectives import (STATUS_FOUND, all_gather, barrier, broadcast_object, group_position, rank_info,
                                status_header)
from ..errors import ClaimTimeout, InvalidArgument, NonFiniteData, StokerError
from ..storage.artifacts import dataset_dir, dataset_identity
from ..storage.locate import locate
from . import sidecar
from .dataset import Sample, ZarrRecords, base_subset, rank_part
from .moments import F64, Moments

Derived = Callable[[Sample], torch.Tensor]

_UNKNOWN = -1  # channel code of a derived quantity this rank never computed
_SCALAR = 0
_NONFINITE = ("raise", "skip")
_DERIVED_INPUT = (None, "normalized", "raw")
#: What a rank found under nonfinite="raise": (record's index in the full dataset, name's index, count).
_Found = tuple[int, int, int]

#: The most blocks of records compute_stats' moments are merged from (see the module docstring): what each
#: rank sends is ``ceil(blocks / world_size)`` blocks' moments per field, a few numbers per channel each.
MAX_BLOCKS = 1024  # as the array statistics (stoker.arraystats.compute)
_Acc = dict[str, dict[int, Moments]]  # field -> this rank's block (its slot) -> its moments


def _blocks_part(ds: ZarrRecords, rank: int, world: int) -> tuple[ZarrRecords, np.ndarray, int]:
    """``(view, slots, blocks)``: the records of the full dataset ``rank`` reads (the blocks
    ``rank::world``, each of consecutive records, their size a function of the number of records alone),
    each record's slot (its block's place among this rank's) and the number of blocks."""
    n = ds.base_size
    size = max(1, -(-n // MAX_BLOCKS))
    blocks = -(-n // size)
    mine = range(rank, blocks, world)
    ranges = [np.arange(b * size, min(n, (b + 1) * size)) for b in mine]
    indices = np.concatenate(ranges) if ranges else np.zeros(0, dtype=np.int64)
    slots = np.repeat(np.arange(len(ranges)), [len(r) for r in ranges]) if ranges else np.zeros(0, dtype=np.int64)
    return base_subset(ds, indices), slots, blocks


def _add(acc: _Acc, name: str, slot: int, m: Moments) -> None:
    """``m`` merged into ``name``'s moments of block ``slot`` (records in order)."""
    held = acc.setdefault(name, {})
    held[slot] = held[slot].merge(m) if slot in held else m


@dataclass(frozen=True)
class FieldStats:
    """Statistics of one field: ``count`` elements per channel were read (int64), ``skipped`` of them (per
    channel, int64) were non-finite and left out (only with ``nonfinite="skip"``; zeros otherwise); float64
    ``mean``, population ``std`` (ddof=0), ``min`` and ``max`` of the rest. Each of shape ``(C,)`` per
    channel or ``()``, ``count`` a scalar.

    ``channel_axis``: the axis of the data the channels lie on, counted from the end (-1: the last), so it
    names the same axis of an array and of a batch of its crops: the records' per-channel statistics (-1),
    or an array's with ``stoker.compute_stats(..., channel_axis=k)``. None where the channels are no axis of
    the data: scalar statistics, or one channel per array of a list (the batch's axis 1).
    ``ndim``: the axes of the array that ``channel_axis`` counts in, also given for an array's scalar
    statistics (None for records, whose shapes vary, and for a list of arrays' channels): ``Normalize.from_stats``
    checks a batch against it, as a batch of several arrays holds one more axis."""

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    skipped: torch.Tensor | None = None  # None: zeros
    channel_axis: int | None = None
    ndim: int | None = None

    def __post_init__(self) -> None:
        if self.skipped is None:
            object.__setattr__(self, "skipped", torch.zeros(self.mean.shape, dtype=torch.int64))
        if self.channel_axis is not None and not (self.channel_axis < 0 and self.mean.dim() == 1):
            # counted from the end: a non-negative axis would mean another batch axis for (B, *box) and (C, ...)
            raise ValueError(f"FieldStats.channel_axis counts from the end (< 0) and needs per-channel statistics, "
                             f"got {self.channel_axis} for statistics of shape {tuple(self.mean.shape)}")

    @staticmethod
    def from_moments(m: Moments) -> "FieldStats":
        # the mean rounded once from its pair (Moments.mean_lo: what the float64 mean leaves out)
        return FieldStats(torch.tensor(m.count, dtype=torch.int64), m.mean + m.mean_lo, m.std, m.min, m.max,
                          m.skipped.clone())

    def to_json(self) -> dict[str, Any]:
        doc = {"count": int(self.count), **{k: getattr(self, k).tolist() for k in ("mean", "std", "min", "max")},
               "skipped": self.skipped.tolist()}
        # only when set: a document without them reads as before (and stats_fingerprint leaves them out)
        doc.update({k: getattr(self, k) for k in ("channel_axis", "ndim") if getattr(self, k) is not None})
        return doc

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> "FieldStats":
        """The statistics of ``to_json``'s document; an older one, which never says its axis, reads as None:
        the caches that hold such documents set the axis from what they were asked (``with_axis``)."""
        tensors = {k: torch.tensor(doc[k], dtype=F64) for k in ("mean", "std", "min", "max")}
        tensors["skipped"] = torch.tensor(doc["skipped"], dtype=torch.int64)
        shapes = {tuple(t.shape) for t in tensors.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) > 1:
            raise ValueError(f"inconsistent shapes {shapes}")
        axes = {k: doc.get(k) for k in ("channel_axis", "ndim")}
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in axes.values()):
            raise ValueError(f"channel_axis and ndim must be ints or absent, got {axes}")
        return FieldStats(torch.tensor(int(doc["count"]), dtype=torch.int64), **tensors, **axes)

    def with_axis(self, channel_axis: int | None, ndim: int | None = None) -> "FieldStats":
        """These statistics, saying the axis their channels lie on (see the class); themselves when they say
        it already (``compute_stats(reuse=)`` hands back the very objects it was given)."""
        if (self.channel_axis, self.ndim) == (channel_axis, ndim):
            return self
        return dataclasses.replace(self, channel_axis=channel_axis, ndim=ndim)


# -- normalisation -----------------------------------------------------------------------------


def _scale(st: FieldStats, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = st.mean.to(device=device, dtype=dtype)
    std = st.std.to(device=device, dtype=dtype)
    # A constant channel has std 0 (or one below the dtype's range): leave it centred, unscaled.
    return mean, torch.where(std > 0, std, torch.ones_like(std))


def normalize(sample: Mapping[str, torch.Tensor], stats: Mapping[str, FieldStats]) -> Sample:
    """``(x - mean) / std`` for every field of ``sample`` that ``stats`` covers; a new dict.

    Per-channel statistics broadcast over the last axis. Floating fields keep their
    dtype (16-bit ones computed in float32 and rounded once), others become float32
    (computed in float64 from their exact values).
    Fields without statistics pass through as they are; channels whose std is 0 are
    only centred.
    """
    return _affine(sample, stats, lambda x, mean, std: (x - mean) / std)


def _affine(sample: Mapping[str, torch.Tensor], stats: Mapping[str, FieldStats], fn) -> Sample:
    """Apply ``fn(x, mean, std)`` to every field ``stats`` covers (non-float fields become float32)."""
    out = dict(sample)
    for name, x in sample.items():
        st = stats.get(name)
        if st is None:
            continue
        if st.channel_axis not in (None, -1):  # per channel on another axis: the last would be silently wrong
            raise InvalidArgument(
                f"the statistics of {name!r} are per channel along axis {st.channel_axis} (counted from the end), "
                "but normalize broadcasts them over the last axis; compute them with channel_axis=-1, or use "
                "stoker.transforms.Normalize.from_stats on the batch", field=name)
        if x.dtype in (torch.float16, torch.bfloat16):  # in float32, rounded once: in its own dtype the mean
            # itself was rounded first (283.7 to 284 in bfloat16), every value shifted alike, a bias not noise
            mean, std = _scale(st, torch.float32, x.device)
            out[name] = fn(x.float(), mean, std).to(x.dtype)
        elif x.is_floating_point():
            mean, std = _scale(st, x.dtype, x.device)
            out[name] = fn(x, mean, std)
        else:  # from the exact values: float32 rounds integers beyond 2**24 (a timestamp in steps of 128)
            # in float64 where the device has it (Apple's MPS has none: there on the CPU, then back)
            at = torch.device("cpu") if x.device.type == "mps" else x.device
            mean, std = _scale(st, torch.float64, at)
            out[name] = fn(x.to(at, torch.float64), mean, std).to(x.device, torch.float32)
    return out


def denormalize(sample: Mapping[str, torch.Tensor], stats: Mapping[str, FieldStats]) -> Sample:
    """The inverse of :func:`normalize`: ``x * std + mean`` for the fields ``stats`` covers."""
    return _affine(sample, stats, lambda x, mean, std: x * std + mean)


# -- collectives -------------------------------------------------------------------------------


def _nonfinite_error(ds: ZarrRecords, kind: str, names: Sequence[str], found: _Found) -> NonFiniteData:
    record, name, count = ds.base_names()[found[0]], names[found[1]], found[2]
    return NonFiniteData(
        f"{kind} {name!r} of record {record!r} holds {count} non-finite value(s) (NaN or infinite): its "
        "statistics would be NaN, and so would every sample normalised with them. Fix the record, or pass "
        "nonfinite='skip' to leave such values out (they are counted in FieldStats.skipped)",
        sample=record, field=name, count=count)


def _merge_ranks(
    local: _Acc,
    names: Sequence[str],
    channels: Mapping[str, int],
    error: BaseException | None,
    found: _Found | None,
    group: Any,
    ds: ZarrRecords,
    kind: str,
    blocks: int,
) -> dict[str, Moments]:
    """Moments over all ranks: the ``blocks`` blocks' (``local``: this rank's, the blocks ``rank::world_size``),
    merged in block order, so every rank and every world size gets the same bits.

    A header collective goes first: every rank learns whether any rank failed or
    found non-finite values (then all raise instead of one hanging in the next
    collective; non-finite values as the same NonFiniteData on every rank, the
    lowest such rank's first find) and the channel count of quantities only some
    ranks computed.
    """
    headers = status_header(error, found is not None, [*(found or (-1, -1, 0))] + [channels[n] for n in names],
                            group, lambda failed: StokerError(f"computing statistics failed on rank(s) {failed}; the "
                                                              "cause is raised there", ranks=failed))
    finds = [h for h in headers if int(h[0]) == STATUS_FOUND]
    if finds:
        raise _nonfinite_error(ds, kind, names, (int(finds[0][1]), int(finds[0][2]), int(finds[0][3])))
    agreed: dict[str, int | None] = {}
    for j, name in enumerate(names):
        codes = {int(h[4 + j]) for h in headers} - {_UNKNOWN}
        if len(codes) > 1:
            raise InvalidArgument(f"{name!r} has different channel counts on different ranks: "
                                  f"{sorted(c for c in codes)}", field=name)
        code = codes.pop() if codes else _SCALAR
        agreed[name] = None if code == _SCALAR else code
    world = group_position(group)[1]
    slots = -(-blocks // world)  # every rank sends as many (the last ones empty where it has fewer blocks)
    sizes = [Moments.packed_size(agreed[n]) for n in names]
    per_slot = sum(sizes)
    mine = [local.get(n, {}).get(s) or Moments.empty(agreed[n]) for s in range(slots) for n in names]
    payload = torch.cat([m.pack() for m in mine]) if mine else torch.zeros(0, dtype=F64)
    flats = all_gather(payload, group)
    out: dict[str, Moments] = {n: Moments.empty(agreed[n]) for n in names}
    for b in range(blocks):  # block order, whichever rank read it
        flat, offset = flats[b % world], (b // world) * per_slot
        for name, size in zip(names, sizes):
            m = Moments.unpack(flat[offset: offset + size], agreed[name])
            offset += size
            out[name] = m if b == 0 else out[name].merge(m)
    return out


# -- the passes --------------------------------------------------------------------------------


def _channel_code(m: Moments | None) -> int:
    if m is None:
        return _UNKNOWN
    return _SCALAR if m.channels is None else m.channels


def _entry_wise(ds: ZarrRecords, name: str, per_channel: bool) -> bool:
    """Whether a 1-d field gets statistics per entry: its spec gives its one dim a fixed size (``params (4,)``),
    so entry k means the same thing in every record."""
    spec = ds.dims.get(name)
    return (per_channel and spec is not None and len(spec) == 1 and isinstance(spec[0], int)
            and not isinstance(spec[0], bool))


def _plain_channels(ds: ZarrRecords, name: str, per_channel: bool) -> int:
    """Channel code of a stored field, from metadata: its last dim when per channel (a 1-d field's too when
    the spec fixes its size)."""
    dtypes = {d for d in ds.base_dtypes(name)}
    if any(d.kind == "c" for d in dtypes):
        raise InvalidArgument(f"field {name!r} is complex; statistics need real numbers", field=name)
    shapes = ds.base_shapes(name)
    if _entry_wise(ds, name, per_channel):
        size = int(ds.dims[name][0])  # type: ignore[index]
        if size == 0:
            raise InvalidArgument(f"field {name!r} has 0 entries (dims (0,))", field=name)
        return size
    if not per_channel or shapes.shape[1] < 2:
        return _SCALAR
    last = shapes[:, -1]
    odd = np.flatnonzero(last != last[0])
    if odd.size:
        i = int(odd[0])
        raise InvalidArgument(
            f"field {name!r} has {int(last[i])} channels (last dim) in record {ds.base_names()[i]!r} but "
            f"{int(last[0])} in {ds.base_names()[0]!r}; pass per_channel=False or fix the data",
            field=name, sample=ds.base_names()[i],
        )
    if last[0] == 0:
        raise InvalidArgument(f"field {name!r} has 0 channels (last dim 0)", field=name)
    return int(last[0])


def _first_nonfinite(local: ZarrRecords, i: int, j: int, m: Moments) -> _Found:
    return local.base_names().index(local.names[i]), j, int(m.skipped.sum())


def _plain_pass(local: ZarrRecords, slots: np.ndarray, fields: Sequence[str], per_channel: bool, skip: bool
                ) -> tuple[_Acc, BaseException | None, _Found | None]:
    """This rank's moments; or the error it met (reported to every rank by _merge_ranks, raised here); or,
    unless ``skip``, the first record holding non-finite values (no need to read further)."""
    acc: _Acc = {}
    entry_wise = {name for name in fields if _entry_wise(local, name, per_channel)}
    try:
        for i in range(len(local)):
            sample = local.read(i, fields)  # only the fields asked for: no bytes read for the others
            for j, name in enumerate(fields):
                x = sample[name].reshape(1, -1) if name in entry_wise else sample[name]
                m = Moments.of(x, per_channel)
                if not skip and bool(m.skipped.any()):
                    return acc, None, _first_nonfinite(local, i, j, m)
                _add(acc, name, int(slots[i]), m)
    except Exception as exc:
        return acc, exc, None
    return acc, None, None


class _Watched(dict):
    """A normalised sample that notices a derived function reading a normalised field without having said it
    wants normalised values (``derived_input=None``): that is an error, never a silent surprise."""

    def __init__(self, sample: Mapping[str, torch.Tensor], normalised: set[str], fn_name: str) -> None:
        super().__init__(sample)
        self._normalised, self._fn_name = normalised, fn_name

    def _check(self, key: Any) -> None:
        if key in self._normalised:
            raise InvalidArgument(
                f"derived {self._fn_name!r} reads field {key!r}, which compute_stats normalises with the fields' "
                "statistics before derived functions see it; pass derived_input='normalized' (what the model "
                "sees after normalize) or derived_input='raw' (the stored values)", field=key, knob="derived_input")

    def __getitem__(self, key: Any) -> torch.Tensor:
        self._check(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)

    def values(self):  # type: ignore[override]
        for key in self._normalised & set(self):
            self._check(key)
        return super().values()

    def items(self):  # type: ignore[override]
        for key in self._normalised & set(self):
            self._check(key)
        return super().items()

    # dict's own copies (dict(s), {**s}, s.copy(), s | {}) and removals read values past __getitem__: a copy
    # is read through it (an __iter__ of its own turns CPython's fast copy off), the others check first.
    def __iter__(self):
        return super().__iter__()

    def copy(self) -> dict:  # type: ignore[override]
        return dict(self.items())

    def __or__(self, other: Any) -> dict:  # type: ignore[override]
        return {**self, **other}

    def pop(self, key: Any, *default: Any) -> Any:  # type: ignore[override]
        self._check(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:  # type: ignore[override]
        self._check(key)
        return super().setdefault(key, default)

    def popitem(self) -> tuple:  # type: ignore[override]
        if self:
            self._check(next(reversed(self)))
        return super().popitem()


def _derived_pass(local: ZarrRecords, slots: np.ndarray, plain: Mapping[str, FieldStats],
                  derived: Mapping[str, Derived], per_channel: bool, skip: bool,
                  derived_input: str | None = "normalized") -> tuple[_Acc, BaseException | None, _Found | None]:
    acc: _Acc = {}
    try:
        for i in range(len(local)):
            raw = local[i]
            sample = raw if derived_input == "raw" else normalize(raw, plain)  # normalised: what training sees
            for j, (name, fn) in enumerate(derived.items()):
                try:
                    value = fn(_Watched(sample, set(plain), name) if derived_input is None else sample)
                except Exception as exc:
                    if hasattr(exc, "add_note"):  # Python 3.11+: say which record, as the message of fn cannot
                        exc.add_note(f"(while compute_stats computed derived {name!r} of record {local.names[i]!r})")
                    raise
                if not isinstance(value, torch.Tensor):
                    value = torch.as_tensor(np.asarray(value))
                if value.is_complex():
                    raise InvalidArgument(f"derived {name!r} returned a complex tensor", field=name)
                if per_channel and value.ndim >= 2 and value.shape[-1] == 0:
                    raise InvalidArgument(f"derived {name!r} returned a tensor with 0 channels", field=name)
                m = Moments.of(value, per_channel)
                if not skip and bool(m.skipped.any()):
                    return acc, None, _first_nonfinite(local, i, j, m)
                before = _some(acc, name)
                if before is not None and before.channels != m.channels:
                    raise InvalidArgument(
                        f"derived {name!r} has {m.channels} channels for record {local.names[i]!r} but "
                        f"{before.channels} before; return (..., C) with the same C for every record",
                        field=name, sample=local.names[i],
                    )
                _add(acc, name, int(slots[i]), m)
    except Exception as exc:
        return acc, exc, None
    return acc, None, None


def _some(acc: _Acc, name: str) -> Moments | None:
    """One of ``name``'s block moments on this rank (they all have its channels), or None."""
    held = acc.get(name)
    return next(iter(held.values())) if held else None


def _check_some_finite(merged: Mapping[str, Moments], kind: str) -> None:
    """NonFiniteData for a channel whose every value was skipped, InvalidArgument for a field with no value at
    all: no statistics describe either. Every rank holds the same merged moments, so every rank raises alike."""
    for name, m in merged.items():
        if int(m.count) == 0 and not bool((m.skipped > 0).any()):  # mean 0, std NaN: normalize would pass it as is
            raise InvalidArgument(f"{kind} {name!r} holds no value in any record (each is empty): there is nothing to "
                                  "compute statistics of, and statistics of nothing would leave the values of a later "
                                  "dataset unnormalised; leave it out of the fields", field=name)
        empty = ((m.finite == 0) & (m.skipped > 0)).reshape(-1)
        if bool(empty.any()):
            where = "" if m.channels is None else f" in channel(s) {torch.nonzero(empty).reshape(-1).tolist()}"
            count = int(m.skipped.reshape(-1)[empty].sum())  # the empty channels' own, not every channel's
            raise NonFiniteData(f"{kind} {name!r} holds no finite value{where}, only {count} "
                                "non-finite ones: there is nothing to compute statistics of", field=name, count=count)


# -- the entry point ---------------------------------------------------------------------------


def _check_args(ds: Any, fields: Any, derived: Any) -> tuple[list[str], dict[str, Derived]]:
    if not isinstance(ds, ZarrRecords):
        raise InvalidArgument(f"ds must be a ZarrRecords (or one of its rank parts), got {type(ds).__name__}")
    if not isinstance(fields, (str, Iterable)):  # None, a number: a bare TypeError of list() before
        raise InvalidArgument(f"fields must be a field name or a list of them, got {fields!r}; name the fields to "
                              f"compute statistics of, from {list(ds.fields)}", knob="fields")
    names = [fields] if isinstance(fields, str) else list(fields)
    if not names:
        raise InvalidArgument("fields is empty; name the fields to compute statistics of")
    for name in names:
        if name not in ds.fields:
            raise InvalidArgument(f"unknown field {name!r}; the dataset has {list(ds.fields)}", field=name)
    if len(set(names)) != len(names):
        raise InvalidArgument(f"fields lists a name twice: {names}")
    derived = dict(derived or {})
    for name, fn in derived.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"derived names must be non-empty strings, got {name!r}")
        if name in ds.fields:
            raise InvalidArgument(f"derived name {name!r} is also a field of the dataset; rename it", field=name)
        if not callable(fn):
            raise InvalidArgument(f"derived {name!r} must be a function of the normalised sample", field=name)
    return names, derived


def _from_entry(entry: dict, expect: Mapping[str, int], derived: Sequence[str]) -> dict[str, FieldStats] | None:
    """Statistics of a sidecar entry, or None when it does not hold what was asked for, or holds what no
    computation now returns: a non-finite mean (written before non-finite values were refused) or a count of
    0 or a non-finite std (an empty field, written before empty fields were refused: mean 0, std NaN, which
    normalize would pass through unscaled). None recomputes, and the computation raises what it now raises."""
    try:
        stats = {name: FieldStats.from_json(entry["stats"][name]) for name in [*expect, *derived]}
    except (KeyError, TypeError, ValueError):
        return None
    for name, code in expect.items():
        want = () if code == _SCALAR else (code,)
        if tuple(stats[name].mean.shape) != want:
            return None
    for st in stats.values():
        if not (bool(torch.isfinite(st.mean).all()) and bool(torch.isfinite(st.std).all())
                and bool((st.count > 0).all())):
            return None
    return stats


def compute_stats(
    ds: ZarrRecords,
    fields: Sequence[str] | str,
    per_channel: bool = True,
    group: Any = None,
    derived: Mapping[str, Derived] | None = None,
    cache: bool = True,
    nonfinite: str = "raise",
    derived_input: str | None = None,
    reuse: Mapping[str, FieldStats] | None = None,
) -> dict[str, FieldStats]:
    """Statistics of ``fields`` (and of ``derived`` quantities) over the whole dataset.

    Collective: call it on every rank of ``group`` with the same arguments. ``ds`` is
    the full dataset (each rank then reads ``ds.for_rank(rank, world_size)``) or this
    rank's part. ``per_channel`` reduces over every axis but the last (tensors of 0
    or 1 dims give one scalar). ``derived`` maps a name to ``fn(normalised sample) ->
    tensor (..., C)``; it costs a second pass. With ``cache``, a matching entry of
    ``root/.stoker-stats.json`` (for a dataset in a store: in its folder of the local
    cache, ``$STOKER_CACHE``) is returned without reading any record, and a fresh
    result is written there by rank 0 (a failed write only warns). ``nonfinite``: what
    a NaN or infinite value does: ``"raise"`` a :class:`~stoker.errors.NonFiniteData`
    (on every rank, naming the record, the field and the count; nothing is written),
    or ``"skip"`` it (counted per channel in ``FieldStats.skipped``). A 1-d field whose
    spec fixes its size (``params (4,)``) gets statistics per entry, shape ``(4,)``.

    ``derived_input``: what a derived function reads for the plain ``fields``:
    ``"normalized"`` (normalised with their statistics: what the model sees) or
    ``"raw"`` (the stored values); None (the default) makes reading one an
    ``InvalidArgument``, so nobody gets normalised values without having asked.
    ``reuse``: statistics of ``fields`` computed before (a ``compute_stats`` result):
    they are returned as they are, and only the derived quantities are computed,
    without a pass over the plain fields; their fingerprint joins the cache key.
    """
    names, derived = _check_args(ds, fields, derived)
    if derived_input not in _DERIVED_INPUT:
        raise InvalidArgument(f"derived_input must be one of {_DERIVED_INPUT}, got {derived_input!r}",
                              knob="derived_input")
    if nonfinite not in _NONFINITE:
        raise InvalidArgument(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}", knob="nonfinite")
    skip = nonfinite == "skip"
    per_channel = bool(per_channel)
    expect = {name: _plain_channels(ds, name, per_channel) for name in names}

    rank, world = group_position(group)
    rank_part(ds, rank, world)  # InvalidArgument for a part of ds not this rank's
    local, slots, blocks = _blocks_part(ds, rank, world)
    fp = sidecar.fingerprint(ds, names, per_channel, list(derived), nonfinite)
    if derived_input is not None:
        fp = _join(fp, f"derived_input={derived_input}")
    if reuse is not None:
        reuse = _check_reuse(reuse, names, expect)
        fp = _join(fp, stats_fingerprint(reuse))

    lead = rank_info(group).rank == 0  # writes the file: rank 0 of the group, or RANK 0 without one
    # Ranks seeing other data must fail here, together, before any of them waits for a claim.
    headers = all_gather(torch.tensor([int(fp[:14], 16)], dtype=torch.int64), group)
    if len({int(h[0]) for h in headers}) > 1:
        raise InvalidArgument(f"ranks see different datasets under {ds.root} (their fingerprints differ)")
    folder = _folder(ds) if cache else None
    # What the covered fields' files are now (this node's copy; taken before reading, so a write during the
    # computation shows as a change next time): an entry of other files is not used.
    files = ds.dataset_digest(list(ds.fields) if derived else names) if cache and (lead or world == 1) else None
    held, entry = cached_entry(folder, fp, lead, world, group, files) if cache else (None, None)
    try:
        loaded = _from_entry(entry, expect, list(derived)) if entry is not None else None
        if loaded is not None:  # every rank holds rank 0's entry: all return here, or none
            return _channels_last(loaded)
        return _channels_last(_compute(ds, (local, slots, blocks), names, derived, per_channel, skip, expect, group,
                                       world, fp, nonfinite, folder, lead, derived_input, reuse, files))
    finally:
        if held is not None:
            held.release()


def _channels_last(stats: dict[str, FieldStats]) -> dict[str, FieldStats]:
    """The records' per-channel statistics say their channels are the last axis (what ``normalize`` and a
    collated batch, ``(B, N, C)`` or ``(sum N, C)``, hold there), so ``Normalize.from_stats`` normalises that
    axis: set here, not read from the sidecar, whose entries written before this never said it."""
    return {name: st.with_axis(-1 if st.mean.dim() == 1 else None) for name, st in stats.items()}


def stats_fingerprint(stats: Mapping[str, FieldStats]) -> str:
    """Hex digest of statistics (names and every number): what a result computed from samples normalised
    with them depends on. ``precompute(normalized_with=)`` and ``compute_stats(reuse=)`` key on it.

    >>> stats_fingerprint(compute_stats(ds, ["points"]))[:8]    # doctest: +SKIP
    '3f1c9a02'
    """
    if not isinstance(stats, Mapping) or not all(isinstance(v, FieldStats) for v in stats.values()):
        raise InvalidArgument("statistics must be a dict of name -> FieldStats (a compute_stats result)")
    # the numbers alone (not channel_axis, ndim): what normalising a record depends on, as keyed before them
    doc = {str(name): {k: v for k, v in st.to_json().items() if k not in ("channel_axis", "ndim")}
           for name, st in stats.items()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _join(fp: str, extra: str) -> str:
    return hashlib.sha256(f"{fp}\0{extra}".encode()).hexdigest()


def _check_reuse(reuse: Any, names: Sequence[str], expect: Mapping[str, int]) -> dict[str, FieldStats]:
    """``reuse`` must hold statistics of every field asked for, of the shape this call would compute."""
    if not isinstance(reuse, Mapping):
        raise InvalidArgument(f"reuse must be a compute_stats result, got {type(reuse).__name__}", knob="reuse")
    for name in names:
        st = reuse.get(name)
        if not isinstance(st, FieldStats):
            raise InvalidArgument(f"reuse holds no statistics of field {name!r}; it has {sorted(reuse)}",
                                  field=name, knob="reuse")
        want = () if expect[name] == _SCALAR else (expect[name],)
        if tuple(st.mean.shape) != want:
            raise InvalidArgument(f"reuse's statistics of {name!r} have shape {tuple(st.mean.shape)}, this call "
                                  f"computes {want} (another per_channel or dims spec?)", field=name, knob="reuse")
    return dict(reuse)


def _folder(ds: ZarrRecords) -> str:
    """Where the statistics file of ``ds`` lives: its root when local; for a dataset in a store (read-only
    to stoker), the dataset's folder in the local cache (:mod:`stoker.storage.artifacts`)."""
    if locate(ds.root).is_local:
        return ds.root
    return str(dataset_dir(ds.root, ds.storage_options))


def cached_entry(root: str, fp: str, lead: bool, world: int, group: Any, files: str | None = None
                 ) -> tuple[Any, dict | None]:
    """``(claim, entry)``: the sidecar's entry ``fp`` as the lead process finds it, shared with every rank; with
    ``files`` (:func:`stoker.records.identity.dataset_digest`), only an entry computed from those files.

    When the entry is missing, the lead claims computing it: another job computing the same statistics
    holds the claim until its entry is written, and this job then reuses that entry instead of computing
    it again. Where the folder cannot be written there is no claim, and the statistics are computed.
    """
    held, entry, error = None, None, None
    if lead:
        try:
            entry = sidecar.load(root, fp, files)
            if entry is None:
                os.makedirs(root, exist_ok=True)  # a cache folder is made on first use
                held = sidecar.claim_computation(root, fp, files)
                if held is None:
                    entry = sidecar.load(root, fp, files)
        except ClaimTimeout as exc:
            error = exc
        except OSError:
            pass  # read-only data is common: compute without a claim (the write then warns)
        except Exception as exc:  # noqa: BLE001 - shared below, so no rank waits for an answer never sent
            error = exc
    elif world == 1:
        return None, sidecar.load(root, fp, files)
    if world > 1:
        entry, message = broadcast_object((entry, None if error is None else f"{type(error).__name__}: {error}"),
                                           group)
        if message is not None and error is None:
            raise StokerError(f"rank 0 could not read the statistics of {root}: {message}", elsewhere=True)
    if error is not None:
        raise error
    return held, entry


def _compute(ds: ZarrRecords, part: tuple[ZarrRecords, np.ndarray, int], names: list[str], derived: Mapping[str, Derived],
             per_channel: bool, skip: bool, expect: dict, group: Any, world: int, fp: str, nonfinite: str,
             folder: str | None, lead: bool, derived_input: str | None = "normalized",
             reuse: Mapping[str, FieldStats] | None = None, files: str | None = None) -> dict[str, FieldStats]:
    """Both passes; with a ``folder`` (the cache), the ``lead`` process writes the sidecar entry there and the
    ranks meet at a barrier once it is in place. ``part``: what this rank reads (:func:`_blocks_part`)."""
    local, slots, blocks = part
    # Pass 1: the stored fields (unless their statistics are given).
    if reuse is not None:
        result = {name: reuse[name] for name in names}
    else:
        acc, error, found = _plain_pass(local, slots, names, per_channel, skip)
        plain_m = _merge_ranks(acc, names, expect, error, found, group, ds, "field", blocks)
        _check_some_finite(plain_m, "field")
        result = {name: FieldStats.from_moments(plain_m[name]) for name in names}

    # Pass 2 (derived quantities only): on samples normalised with pass 1's statistics.
    if derived:
        acc, error, found = _derived_pass(local, slots, result, derived, per_channel, skip, derived_input)
        codes = {name: _channel_code(_some(acc, name)) for name in derived}
        derived_m = _merge_ranks(acc, list(derived), codes, error, found, group, ds, "derived", blocks)
        _check_some_finite(derived_m, "derived")
        result.update({name: FieldStats.from_moments(derived_m[name]) for name in derived})

    if folder is not None:
        if lead:
            entry = {
                "fields": names,
                "derived": sorted(derived),
                "per_channel": per_channel,
                "nonfinite": nonfinite,
                "records": ds.base_size,
                "world_size": world,
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "stats": {name: st.to_json() for name, st in result.items()},
            }
            if folder != ds.root:  # a cache folder says which dataset it holds (nothing secret: see artifacts)
                entry["dataset"] = dataset_identity(ds.root, ds.storage_options)
            try:
                sidecar.write(folder, fp, entry)
            except OSError as exc:  # read-only data is common: the statistics are still right
                warnings.warn(f"could not write {sidecar.path_for(folder)}: {exc}", RuntimeWarning, stacklevel=3)
        barrier(group)  # the file is in place (or known unwritable) before anyone goes on
    return result


__all__ = ["FieldStats", "compute_stats", "normalize", "denormalize", "stats_fingerprint"]
