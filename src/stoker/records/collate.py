"""Collating record samples (dicts of tensors of varying length) into one batch.

    >>> Concat()([{"x": torch.zeros(2, 3)}, {"x": torch.ones(4, 3)}])
    {'x': tensor (6, 3), 'x_batch': tensor([0, 0, 1, 1, 1, 1])}
    >>> Pad()([{"x": torch.zeros(2, 3)}, {"x": torch.ones(4, 3)}])
    {'x': tensor (2, 4, 3), 'x_lengths': tensor([2, 4])}
    >>> Concat(increment={"knn": "points"})     # per-record indices into "points" become batch indices

Meshes and graphs join along *named* dims (the dims a ``ZarrRecords`` field spec
gives), the layout graph libraries use::

    >>> ds = ZarrRecords(root, fields={"mesh_pos": ("T", "N", 3), "thickness": ("N",),
    ...                                "edges": (2, "E"), "params": (4,)})
    >>> collate = Concat(along={"N": ["mesh_pos", "thickness"], "E": ["edges"]}, increment={"edges": "N"})
    >>> batch = collate.bind(ds)(samples)    # the Loader binds its dataset itself
    >>> batch["mesh_pos"].shape, batch["edges"].shape, batch["params"].shape, batch["batch"].shape
    ((T, sum N, 3), (2, sum E), (B, 4), (sum N,))

``Concat`` is PyG's layout (a ``batch`` vector); ``Pad`` the one sequence models
use. Every sample must have the same fields and dtypes. Both return a
:class:`RecordBatch`: a dict that also says how many samples it holds
(``num_samples``), which the Trainer counts. A 0-d field (a per-record scalar) becomes ``(B,)``
in both: ``Concat`` joins it as shape ``(1,)`` (with its ``_batch``), ``Pad`` stacks it, never padded (no
``_lengths``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable, Collection, Mapping, Sequence, Union

import numpy as np
import torch

from ..errors import DtypeMismatch, InvalidArgument, RankMismatch

Batch = dict[str, torch.Tensor]
CollateArg = Union[str, Callable[[list], Any]]
Spec = Union[tuple, None]


class RecordBatch(dict):
    """A collated batch: ``{key: tensor}`` plus ``num_samples``, the number of samples it was made of
    (graphs, meshes, sequences: what samples/s counts), whatever its keys are called.

    >>> b = Concat()([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}]); b.num_samples
    2
    """

    def __init__(self, *args: Any, num_samples: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_samples = num_samples


def _check_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, list[torch.Tensor]]:
    """Per field, the samples' tensors, after checking they are dicts with the same keys and dtypes."""
    if not samples:
        raise InvalidArgument("cannot collate an empty batch")
    for j, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise InvalidArgument(f"sample {j} of the batch is a {type(s).__name__}, expected a dict of tensors; "
                                  "pass collate=<your function> for other samples", position=j)
    keys = list(samples[0])
    for j, s in enumerate(samples):
        if set(s) != set(keys):
            raise InvalidArgument(f"sample {j} of the batch has fields {sorted(s)}, sample 0 has {sorted(keys)}",
                                  position=j)
    out: dict[str, list[torch.Tensor]] = {}
    for key in keys:
        ts: list[torch.Tensor] = []
        for j, s in enumerate(samples):
            t = s[key]
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"field {key!r} of sample {j} is a {type(t).__name__}, not a tensor; pass "
                                      "collate=<your function of the list of samples> to batch other values",
                                      field=key, position=j)
            if ts and t.dtype != ts[0].dtype:
                raise DtypeMismatch(f"field {key!r}: sample {j} is {t.dtype}, sample 0 is {ts[0].dtype}; cast it "
                                    "in the dataset, or pass collate=<your function of the list of samples>",
                                    field=key, position=j)
            ts.append(t)
        out[key] = ts
    return out


def _fields(samples: Sequence[Mapping[str, Any]], suffix: str) -> dict[str, list[torch.Tensor]]:
    """The legacy layout's check: tensors at least 1-d agreeing in every dim but the first."""
    out = _check_samples(samples)
    for key, ts in out.items():
        if f"{key}{suffix}" in out:
            raise InvalidArgument(f"fields {key!r} and {key + suffix!r} collide: the batch adds {key + suffix!r}",
                                  field=key)
        ts = [t.reshape(1) if t.ndim == 0 else t for t in ts]
        _same_but(key, ts, 0, "only the first dim may differ (collate='concat' and 'pad' join along it): pass "
                  "collate=<your function of the list of samples> for other shapes")
        out[key] = ts
    return out


def _same_but(key: str, ts: Sequence[torch.Tensor], axis: int | None, fix: str) -> None:
    """RankMismatch naming the field and the sample unless every tensor has sample 0's shape but on ``axis``."""
    first = ts[0]

    def rest(t: torch.Tensor) -> tuple:
        shape = tuple(t.shape)
        return (len(shape), shape) if axis is None else (len(shape), shape[:axis] + shape[axis + 1:])

    for j, t in enumerate(ts):
        if rest(t) != rest(first):
            raise RankMismatch(f"field {key!r}: sample {j} has shape {tuple(t.shape)}, sample 0 "
                               f"{tuple(first.shape)}; {fix}", field=key, shape=tuple(t.shape), position=j)


def _varying(ds: Any, name: str, spec: tuple) -> tuple[str, ...]:
    """The named dims of field ``name`` whose size differs between the dataset's records."""
    shapes = ds.base_shapes(name)
    out = []
    for axis, d in enumerate(spec):
        if isinstance(d, str) and shapes.shape[0] and bool((shapes[:, axis] != shapes[0, axis]).any()):
            out.append(d)
    return tuple(out)


class Concat:
    """Join samples into one batch, the layout graph libraries use.

    Without dims (``Concat()`` on fields given by name only): every field joins along
    dim 0 and ``{field}_batch`` says which sample each row came from;
    ``increment={"knn": "points"}`` shifts an index field by the rows of the field it
    indexes in the samples before it.

    With named dims (``along={"N": ["mesh_pos", "thickness"], "E": ["edges"]}``, or a
    dataset whose fields have a dims spec: :meth:`bind` takes the specs, and
    ``Concat()`` alone joins each field along its one named dim that varies between
    records, or that ``increment`` points into): a field joins along the axis of its dim, other dims stay
    (``mesh_pos (T, N, 3)`` becomes ``(T, sum N, 3)``); a field with no joined dim is
    stacked (``params (4,)`` becomes ``(B, 4)``). ``increment`` maps an index field to a
    dim (or a field): its values are offset by that dim's running size. One batch
    vector per joined dim: the *node* dim's (the dim that ``increment`` points into,
    or the only joined one) is ``batch_key`` (PyG's ``"batch"`` by default), every
    other ``{dim}_batch``. ``dims`` maps fields to specs, as ``ds.dims`` gives them.

    Each sample's values of an ``increment`` field must index its own rows (``0 <= i < rows``): a ``-1`` for
    "none", or an index past the record, would point at another sample's rows once offset (InvalidArgument).
    ``ends`` names those of them that hold exclusive end bounds (a CSR ``indptr``, segment stops), which may
    also equal the rows (``Concat(increment={"indptr": "edges"}, ends={"indptr"})``).
    """

    def __init__(self, increment: Mapping[str, str] | None = None,
                 along: Mapping[str, Sequence[str]] | None = None, batch_key: str | None = None,
                 dims: Mapping[str, Spec] | None = None, ends: Collection[str] = ()) -> None:
        self.increment = dict(increment or {})
        for key, target in self.increment.items():
            if not isinstance(key, str) or not isinstance(target, str):
                raise InvalidArgument(f"increment maps field names to field or dim names, got {key!r}: {target!r}")
        names = [ends] if isinstance(ends, str) else list(ends) if isinstance(ends, Iterable) else None
        if names is None or not all(isinstance(n, str) for n in names):  # a number: a bare TypeError before
            raise InvalidArgument(f"ends must be a field name or a collection of them (increment fields holding "
                                  f"exclusive end bounds), got {ends!r}", knob="ends")
        self.ends = frozenset(names)
        if not self.ends <= set(self.increment):
            raise InvalidArgument(f"ends {sorted(self.ends - set(self.increment))} are not increment fields "
                                  f"({sorted(self.increment)}): ends names index fields holding exclusive end bounds",
                                  knob="ends")
        self.along: dict[str, list[str]] | None = None
        if along is not None:
            if not isinstance(along, Mapping):
                raise InvalidArgument(f"along maps dim names to lists of fields, got {along!r}", knob="along")
            self.along = {}
            seen: dict[str, str] = {}
            for dim, names in along.items():
                names = [names] if isinstance(names, str) else list(names)
                if not isinstance(dim, str) or not all(isinstance(n, str) for n in names):
                    raise InvalidArgument(f"along maps dim names to lists of fields, got {dim!r}: {names!r}",
                                          knob="along")
                for n in names:
                    if n in seen:
                        raise InvalidArgument(f"along lists field {n!r} under dims {seen[n]!r} and {dim!r}; a "
                                              "field joins along one dim", field=n, knob="along")
                    seen[n] = dim
                self.along[dim] = names
        if batch_key is not None and (not isinstance(batch_key, str) or not batch_key):
            raise InvalidArgument(f"batch_key must be a non-empty string, got {batch_key!r}", knob="batch_key")
        self.batch_key = batch_key
        self.dims: dict[str, Spec] | None = None if dims is None else {k: _spec(k, v) for k, v in dims.items()}
        self._varying: dict[str, tuple[str, ...]] | None = None  # set by bind: dims that vary between records

    def bind(self, ds: Any) -> "Concat":
        """This collate with ``ds``'s field specs (``ds.dims``) and the dims that vary between its records;
        ``self`` when the dataset has no specs or dims were given already. The Loader calls it."""
        specs = getattr(ds, "dims", None)
        if self.dims is not None or not isinstance(specs, Mapping) or not any(v is not None for v in specs.values()):
            return self
        bound = Concat(self.increment, self.along, self.batch_key, specs, self.ends)
        if callable(getattr(ds, "base_shapes", None)):
            bound._varying = {name: _varying(ds, name, tuple(spec)) for name, spec in specs.items() if spec}
        bound._plan_auto()  # a field with two varying dims fails here, before any batch
        return bound

    # -- which field joins along what --------------------------------------------------------

    def _named(self) -> bool:
        return self.along is not None or (self.dims is not None and any(v is not None for v in self.dims.values()))

    def _plan_auto(self) -> dict[str, str | None]:
        """Field -> the dim it joins along (None: stacked) for the fields with a spec, when ``along`` is not
        given: its one named dim that varies between records (every named dim when that is not known)."""
        plan: dict[str, str | None] = {}
        if self.along is not None or self.dims is None:
            return plan
        targets = set(self.increment.values())  # a dim index fields point into is joined even where it does not vary
        for name, spec in self.dims.items():
            if spec is None:
                continue
            named = [d for d in spec if isinstance(d, str)]
            if self._varying is not None and name in self._varying:
                cands = [d for d in named if d in self._varying[name] or d in targets]
            else:
                cands = named
            if len(cands) > 1:
                raise InvalidArgument(
                    f"field {name!r} (dims {spec}) varies along {cands}: Concat joins along one dim; pass "
                    f"along={{dim: [fields]}} naming it, or collate='pad'", field=name, knob="along")
            plan[name] = cands[0] if cands else None
        return plan

    def _axis(self, name: str, dim: str) -> int:
        spec = (self.dims or {}).get(name)
        if spec is None:
            return 0  # a field without a spec joins along its first dim
        if dim not in spec:
            raise InvalidArgument(f"along lists field {name!r} under dim {dim!r}, but its dims are {spec}",
                                  field=name, knob="along")
        return spec.index(dim)

    # -- collating ---------------------------------------------------------------------------

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> RecordBatch:
        if not self._named():
            return self._legacy(samples)
        fields = _check_samples(samples)
        if self.along is not None:
            plan: dict[str, str | None] = {n: None for n in fields}
            for dim, names in self.along.items():
                for n in names:
                    if n not in fields:
                        raise InvalidArgument(f"along {dim!r} lists field {n!r}; the samples have {sorted(fields)}",
                                              field=n, knob="along")
                    plan[n] = dim
            legacy: list[str] = []
        else:
            auto = self._plan_auto()
            plan = {n: auto[n] for n in fields if n in auto}
            legacy = [n for n in fields if n not in auto]  # no spec: joined along dim 0, as without dims
        out = RecordBatch(num_samples=len(samples))
        # Sizes of each joined dim per sample, from the first field joined along it; the others must agree.
        sizes: dict[str, list[int]] = {}
        owner: dict[str, str] = {}
        axes: dict[str, int] = {}
        for name, joined in plan.items():
            if joined is None:
                continue
            dim = joined
            axis = self._axis(name, dim)
            ts = fields[name]
            spec = (self.dims or {}).get(name)
            for j, t in enumerate(ts):
                if spec is not None and t.ndim != len(spec):  # its axes are not the spec's: axis means another dim
                    raise RankMismatch(f"field {name!r}: sample {j} has shape {tuple(t.shape)}, but its dims are "
                                       f"{spec}, so dim {dim!r} is not axis {axis} of it (a transform changed "
                                       "it?); pass Concat(dims={field: dims}) with the dims the samples have",
                                       field=name, shape=tuple(t.shape), position=j)
                if t.ndim <= axis:
                    raise RankMismatch(f"field {name!r}: sample {j} has shape {tuple(t.shape)}, with no axis "
                                       f"{axis} for dim {dim!r}", field=name, shape=tuple(t.shape), position=j)
            _same_but(name, ts, axis, f"only dim {dim!r} (axis {axis}) may differ: give the field its other "
                      "varying dims in along=, or collate='pad'")
            got = [int(t.shape[axis]) for t in ts]
            if dim in sizes and got != sizes[dim]:
                j = next(k for k, (a, b) in enumerate(zip(got, sizes[dim])) if a != b)
                raise RankMismatch(f"field {name!r}: sample {j} has {got[j]} along dim {dim!r} but field "
                                   f"{owner[dim]!r} has {sizes[dim][j]}", field=name, position=j)
            sizes.setdefault(dim, got)
            owner.setdefault(dim, name)
            axes[name] = axis
        offsets = self._offsets(fields, plan, sizes, axes, legacy)
        for name, ts in fields.items():
            if name in offsets:
                ts = _shift(name, ts, *offsets[name], end=name in self.ends)
            if name in legacy:
                ts = [t.reshape(1) if t.ndim == 0 else t for t in ts]
                _same_but(name, ts, 0, "only the first dim may differ: give the field dims in the dataset's "
                          "fields= spec, or pass along=")
                out[name] = torch.cat(ts, dim=0)
                self._put(out, f"{name}_batch", torch.repeat_interleave(
                    torch.arange(len(ts)), torch.tensor([t.shape[0] for t in ts], dtype=torch.long)), fields)
            elif plan.get(name) is None:
                _same_but(name, ts, None, "a field with no joined dim is stacked, so its shape must not vary: "
                          "name the dim it varies along in along=")
                out[name] = torch.stack(ts)
            else:
                out[name] = torch.cat(ts, dim=axes[name])
        for dim, key in self._batch_keys(sizes, plan).items():
            self._put(out, key, torch.repeat_interleave(torch.arange(len(samples)),
                                                        torch.tensor(sizes[dim], dtype=torch.long)), fields)
        return out

    def _offsets(self, fields: dict, plan: dict, sizes: dict, axes: dict,
                 legacy: list) -> dict[str, tuple[list[int], list[int]]]:
        """Per incremented field, each sample's offset (the running size of the dim, or field, it indexes) and
        that dim's size in the sample (its indices' bound)."""
        out: dict[str, tuple[list[int], list[int]]] = {}
        for key, target in self.increment.items():
            if key not in fields:
                raise InvalidArgument(f"increment {key!r} -> {target!r}: the samples have fields {sorted(fields)}",
                                      field=key)
            if fields[key][0].is_floating_point() or fields[key][0].dtype == torch.bool:
                raise DtypeMismatch(f"increment {key!r}: index fields must be integers, got {fields[key][0].dtype}",
                                    field=key)
            if target in sizes:
                rows = sizes[target]
            elif target in fields and target in legacy:
                rows = [int(t.shape[0]) if t.ndim else 1 for t in fields[target]]
            elif target in fields and plan.get(target) is not None:
                rows = sizes[plan[target]]
            else:
                raise InvalidArgument(f"increment {key!r} -> {target!r}: that is neither a joined dim "
                                      f"{sorted(sizes)} nor a joined field", field=key)
            out[key] = (np.cumsum([0] + rows[:-1]).tolist(), rows)
        return out

    def _batch_keys(self, sizes: dict[str, list[int]], plan: dict[str, str | None]) -> dict[str, str]:
        """Joined dim -> the key of its batch vector."""
        targets = {plan.get(t, t) for t in self.increment.values()}
        nodes = [d for d in sizes if d in targets] or list(sizes)
        if len(nodes) > 1 and self.batch_key is not None:
            raise InvalidArgument(f"batch_key={self.batch_key!r} but there are several node dims {nodes}; "
                                  "say which with increment= (the dim index fields point into)", knob="batch_key")
        keys = {d: f"{d}_batch" for d in sizes}
        if len(nodes) == 1:
            keys[nodes[0]] = self.batch_key or "batch"
        return keys

    @staticmethod
    def _put(out: dict, key: str, value: torch.Tensor, fields: Mapping) -> None:
        if key in fields or key in out:
            raise InvalidArgument(f"the batch adds {key!r}, which is also a field (or another batch vector); "
                                  "rename the field or pass batch_key=", field=key)
        out[key] = value

    def _legacy(self, samples: Sequence[Mapping[str, Any]]) -> RecordBatch:
        fields = _fields(samples, "_batch")
        for key, target in self.increment.items():
            if key not in fields or target not in fields:
                raise InvalidArgument(f"increment {key!r} -> {target!r}: the samples have fields {sorted(fields)}",
                                      field=key)
            if fields[key][0].is_floating_point() or fields[key][0].dtype == torch.bool:
                raise DtypeMismatch(f"increment {key!r}: index fields must be integers, got {fields[key][0].dtype}",
                                    field=key)
        out = RecordBatch(num_samples=len(samples))
        for key, ts in fields.items():
            if key in self.increment:
                rows = [t.shape[0] for t in fields[self.increment[key]]]
                ts = _shift(key, ts, np.cumsum([0] + rows[:-1]).tolist(), rows, end=key in self.ends)
            out[key] = torch.cat(ts, dim=0)
            sizes = torch.tensor([t.shape[0] for t in ts], dtype=torch.long)
            out[f"{key}_batch"] = torch.repeat_interleave(torch.arange(len(ts)), sizes)
        return out

    def __repr__(self) -> str:
        args = [f"increment={self.increment}"] if self.increment else []
        if self.ends:
            args.append(f"ends={set(sorted(self.ends))}")
        if self.along is not None:
            args.append(f"along={self.along}")
        if self.batch_key is not None:
            args.append(f"batch_key={self.batch_key!r}")
        return f"Concat({', '.join(args)})"


def _shift(key: str, ts: Sequence[torch.Tensor], offsets: Sequence[int], rows: Sequence[int],
           end: bool = False) -> list[torch.Tensor]:
    """Index tensors ``ts`` plus their samples' ``offsets``, in their own dtype. Each sample's indices must lie in
    ``[0, rows[j])``, the size of what they index in that sample: offset into the batch, a -1 sentinel or an index
    past its own sample would point at another sample's rows (InvalidArgument); ``end``: they are exclusive end
    bounds, which may also equal ``rows[j]`` (the next sample's start once offset). A DtypeMismatch where a shifted
    index would not fit the dtype (torch would wrap it around silently: uint8 255 + 1 is 0)."""
    out = []
    for j, (t, off, n) in enumerate(zip(ts, offsets, rows)):
        # torch has neither max nor addition for uint16/32/64: both in int64 (checked to fit), then cast back
        wide = t.dtype in _NO_ADD
        v = t.to(torch.int64) if wide else t
        if t.numel():
            low, high = int(v.min()), int(v.max())
            if t.dtype != torch.int64:  # int64 indices of a batch never reach 2**63
                most = min(torch.iinfo(t.dtype).max, torch.iinfo(torch.int64).max)
                # a uint64 index beyond int64's range wrapped to a negative one in v
                top = most + 1 if wide and low < 0 else high + int(off)
                if top > most:
                    raise DtypeMismatch(
                        f"increment {key!r}: sample {j}'s indices reach {top} in the batch, beyond what {t.dtype} "
                        f"holds ({most}); store the field as int64 (or int32), or cast it in the Loader's "
                        "transform=", field=key, position=j)
            if low < 0 or high > n - (not end):
                bad = low if low < 0 else high
                hint = "" if end or high != n else (
                    f"; if {key!r} holds exclusive end bounds (a CSR indptr, segment stops), which may equal the "
                    f"rows, say so: Concat(..., ends={{{key!r}}})")
                raise InvalidArgument(
                    f"increment {key!r}: sample {j} holds index {bad}, outside the {n} rows it indexes (0 to "
                    f"{n - (not end)}); offset by {off} into the batch it would point at another sample's rows. Fix "
                    "the record, or map such values (a -1 for 'none') in the Loader's transform= or a collate of "
                    f"your own{hint}", field=key, position=j, index=bad)
        out.append((v + off).to(t.dtype))
    return out


#: integer dtypes torch has no addition for
_NO_ADD = (torch.uint16, torch.uint32, torch.uint64)


def _spec(name: str, spec: Any) -> Spec:
    if spec is None:
        return None
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise InvalidArgument(f"dims of field {name!r} must be a tuple like ('T', 'N', 3), got {spec!r}",
                              field=name, knob="dims")
    return tuple(spec)


class Pad:
    """Pad each field along dim 0 to the batch's longest (with ``value``, or the field's own in ``values``,
    which its dtype must hold as it is) and stack: ``(B, L, ...)``, plus ``{field}_lengths`` (LongTensor
    ``(B,)``). A 0-d field (a per-record scalar) is never padded: it is stacked ``(B,)``, with no lengths.

    >>> Pad(0, values={"labels": -100})   # an ignore index for the labels, zeros for the rest
    Pad(value=0, values={'labels': -100})
    """

    def __init__(self, value: float | int | bool = 0, values: Mapping[str, float | int] | None = None) -> None:
        for v in [value, *(values or {}).values()]:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidArgument(f"pad value must be a number, got {v!r}")
        self.value = value
        self.values = dict(values or {})

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> RecordBatch:
        out = RecordBatch(num_samples=len(samples))
        scalars = {key for key, ts in _check_samples(samples).items() if all(t.ndim == 0 for t in ts)}
        for key, ts in _fields(samples, "_lengths").items():
            if key in scalars:  # a 0-d field has no length to pad: stacked (B,), as Concat gives it
                out[key] = torch.cat(ts)
                continue
            lengths = [t.shape[0] for t in ts]
            first = ts[0]
            value = self.values.get(key, self.value)
            _check_fill(key, value, first.dtype)
            stacked = torch.full((len(ts), max(lengths), *first.shape[1:]), value, dtype=first.dtype,
                                 device=first.device)
            for j, t in enumerate(ts):
                stacked[j, : t.shape[0]] = t
            out[key] = stacked
            out[f"{key}_lengths"] = torch.tensor(lengths, dtype=torch.long)
        return out

    def __repr__(self) -> str:
        return f"Pad(value={self.value!r}" + (f", values={self.values!r})" if self.values else ")")


def _check_fill(key: str, value: float | int, dtype: torch.dtype) -> None:
    """DtypeMismatch unless ``dtype`` holds ``value`` as it is (torch would store -1 in uint8 as 255, 0.5 in an
    integer field as 0, and refuse 1e6 in float16 without naming the field)."""
    if dtype.is_floating_point:
        fits = math.isnan(value) or math.isinf(value) or abs(value) <= torch.finfo(dtype).max
    elif dtype == torch.bool:
        fits = value in (0, 1)
    elif dtype.is_complex:
        fits = True
    else:
        info = torch.iinfo(dtype)
        fits = float(value).is_integer() and info.min <= value <= info.max
    if not fits:
        raise DtypeMismatch(f"Pad value {value!r} cannot be stored in field {key!r} ({dtype}); pad it with a value "
                            f"its dtype holds (Pad(..., values={{{key!r}: ...}}) gives a field its own), or cast "
                            "the field in the Loader's transform=", field=key)


def resolve(collate: CollateArg, ds: Any = None) -> Callable[[list], Any]:
    """``"concat"``, ``"pad"`` or a callable taking the list of samples; a ``Concat`` is bound to ``ds``'s
    field specs (:meth:`Concat.bind`)."""
    if isinstance(collate, str) and collate == "concat":
        collate = Concat()
    elif isinstance(collate, str) and collate == "pad":
        return Pad()
    if isinstance(collate, Concat):
        return collate.bind(ds) if ds is not None else collate
    if callable(collate):
        return collate
    raise InvalidArgument(f"collate must be 'concat', 'pad' or a function of the list of samples, got {collate!r}")


__all__ = ["Concat", "Pad", "RecordBatch", "resolve"]
