"""Statistics of Zarr arrays: one pass chunk by chunk, shared over ranks, merged alike whatever the world size.

    >>> stats = compute_array_stats({"raw": ["/d/ch0.zarr", "/d/ch1.zarr"]}, region={0: (0, 300)})
    >>> stats["raw"].mean, stats["raw"].std           # float64, shape (2,): one per channel
    >>> norm = stoker.transforms.Normalize.from_stats(stats["raw"])

The units of work are the array's read chunks (a sharded array's inner chunks) inside the region, in C
order (with ``channel_axis``, a unit spans every channel of the region on that axis), each read with the
array's own reader (``ArrayReader.read``) on a few threads and summarised in float64 (in numpy: see
:func:`_moments`) as :class:`~stoker.records.moments.Moments` (count, mean, M2, min, max, non-finite
count), merged with its Chan update. The units are cut into at most :data:`MAX_BLOCKS` consecutive
blocks, a function of the unit count alone; rank ``r`` of ``w`` reads blocks ``r, r + w, ...``, merges each block's units in order,
and one ``all_gather`` brings every block's moments to every rank, merged in block order. So every rank
returns the same bits, and so does any world size (the same blocks are merged in the same order).

Before any other collective, the ranks compare the arrays' fingerprints and whether each could open the
array (a rank seeing other data, or failing to open it, fails them all); a rank that fails while reading
tells the others in a header collective, so all raise instead of one waiting for ever. The result of
each array is cached as the record statistics are
(:mod:`stoker.records.sidecar`, ``.stoker-stats.json`` in the array's folder, or its folder of
``$STOKER_CACHE`` for an array in a store), keyed by :func:`stoker.arraystats.identity.fingerprint`.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import numbers
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ..checks import integer, seconds
from ..dist.collectives import STATUS_FOUND, all_gather, barrier, group_position, rank_info, status_header
from ..errors import InvalidArgument, NonFiniteData, StokerError
from ..reader.array import ArrayReader, open_array
from ..reader.coords import coding
from ..records import sidecar
from ..records.moments import F64, Moments
from ..records.stats import FieldStats, cached_entry
from ..storage.artifacts import dataset_identity
from ..storage.local import LocalStore
from ..storage.locate import check_options_by_prefix, locate, options_for
from . import identity
from .inputs import Box, parse_entries, parse_region
from .ordered import ordered_map

if TYPE_CHECKING:
    from ..zarr.cf import CFCoding

#: Most blocks an array's units are cut into: what one all_gather carries (6 numbers per channel each).
MAX_BLOCKS = 1024
#: Longest wait for one unit's read (a read stuck on a hung mount is an error, not a hang).
READ_TIMEOUT_S = 600.0
_NONFINITE = ("skip", "raise")


# -- the units: read chunks inside the region ---------------------------------------------------------


class Units:
    """The read chunks of one array that ``box`` touches, each clipped to ``box``, in C order (never listed:
    unit ``i``'s box is computed from ``i``)."""

    def __init__(self, box: Box, chunks: Sequence[int]) -> None:
        self.box, self.chunks = box, tuple(chunks)
        self.first = [start // c for (start, _), c in zip(box, chunks)]
        self.counts = [(-(-stop // c)) - f for (_, stop), c, f in zip(box, chunks, self.first)]

    def __len__(self) -> int:
        return math.prod(self.counts)

    def __getitem__(self, i: int) -> Box:
        out = []
        for axis in range(len(self.counts) - 1, -1, -1):
            i, k = divmod(i, self.counts[axis])
            c, (start, stop) = self.chunks[axis], self.box[axis]
            index = self.first[axis] + k
            out.append((max(start, index * c), min(stop, (index + 1) * c)))
        return tuple(reversed(out))


class _Chained(Sequence[int]):
    """The unit indices of consecutive ``ranges`` (a rank's blocks) one after the other, never listed."""

    def __init__(self, ranges: Sequence[range]) -> None:
        self.ranges = list(ranges)
        self.starts = list(itertools.accumulate((len(r) for r in self.ranges), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> int:  # type: ignore[override]  # ints only: what ordered_map asks
        if not 0 <= i < len(self):
            raise IndexError(i)
        b = bisect.bisect_right(self.starts, i) - 1
        return self.ranges[b][i - self.starts[b]]


def blocks(n_units: int) -> list[range]:
    """The consecutive blocks ``n_units`` units are cut into: a function of ``n_units`` alone."""
    n = min(n_units, MAX_BLOCKS)
    return [range(b * n_units // n, (b + 1) * n_units // n) for b in range(n)]


# -- one array ----------------------------------------------------------------------------------------


def _moments(x: np.ndarray, channel_axis: int | None) -> Moments:
    """The :class:`Moments` of one unit, computed in numpy on the calling thread.

    Not ``Moments.of``: torch's reductions split over its intra-op threads, so their bits depend on
    ``torch.get_num_threads()`` (torchrun sets ``OMP_NUM_THREADS=1`` for several ranks per node, a single
    process uses every core: 1 and 2 ranks would differ), and on a loaded host those threads made each
    chunk's moments 20 times slower than numpy's single-threaded pairwise sums. Same definitions: a
    two-pass M2 within the unit, about the mean with what its float64 rounding left out (``mean_lo``, which
    the merges need where the spread is near the mean's resolution), non-finite values left out and counted."""
    x = np.asarray(x, dtype=np.float64)  # exact for every integer below 2**53
    if channel_axis is None:
        x = x.reshape(-1, 1)  # one column: numpy sums it pairwise
        channels = None
    else:
        channels = x.shape[channel_axis]
        x = np.moveaxis(x, channel_axis, -1).reshape(-1, channels)
    n = x.shape[0]
    if n == 0:
        return Moments.empty(channels)
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):  # an overflowing sum: a non-finite mean, as before
        if finite.all():
            mean = x.mean(axis=0)
            dev = x - mean
            rest = dev.mean(axis=0)
            dev -= rest
            m2 = np.square(dev, out=dev).sum(axis=0)
            lo, hi = x.min(axis=0), x.max(axis=0)
            skipped = np.zeros(x.shape[1], dtype=np.int64)
        else:
            kept = finite.sum(axis=0)
            mean = np.where(finite, x, 0.0).sum(axis=0) / np.maximum(kept, 1)  # 0 for a channel with none
            dev = np.where(finite, x - mean, 0.0)
            rest = dev.sum(axis=0) / np.maximum(kept, 1)
            m2 = np.square(np.where(finite, dev - rest, 0.0)).sum(axis=0)
            lo = np.where(finite, x, np.inf).min(axis=0)
            hi = np.where(finite, x, -np.inf).max(axis=0)
            skipped = (n - kept).astype(np.int64)
    return Moments.two_pass(n, channels, *(torch.from_numpy(np.ascontiguousarray(a))
                                           for a in (mean, m2, lo, hi, skipped, rest)))


def _check_array(reader: ArrayReader, channel_axis: int | None) -> None:
    """An InvalidArgument naming the array when its statistics cannot be computed as asked."""
    if reader.dtype.kind not in "biuf":
        raise InvalidArgument(f"{reader.uri}: statistics need real numbers; its dtype is {reader.dtype}",
                              uri=reader.uri)
    if channel_axis is not None and not -reader.ndim <= channel_axis < reader.ndim:
        raise InvalidArgument(f"compute_stats: channel_axis={channel_axis} does not exist in {reader.uri} "
                              f"({reader.ndim} axes)", knob="channel_axis", uri=reader.uri)


def _channels(box: Box, channel_axis: int | None) -> int | None:
    if channel_axis is None:
        return None
    start, stop = box[channel_axis]
    return stop - start


class _Progress:
    """The lead rank's bar over its own units (shown after a second only: short work prints nothing)."""

    def __init__(self, total: int, what: str, show: bool) -> None:
        self.bar = None
        if show and total > 1:
            from tqdm import tqdm  # imported when shown: a dependency, but a heavy import

            self.bar = tqdm(total=total, desc=f"statistics of {what}", unit="chunk", delay=1.0, dynamic_ncols=True)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _local_pass(reader: ArrayReader, units: Units, mine: list[range], channel_axis: int | None, skip: bool,
                threads: int, timeout_s: float, show: bool,
                code: CFCoding | None = None) -> tuple[list[Moments], tuple[int, int] | None]:
    """This rank's blocks' moments (each block merged in unit order), or, unless ``skip``, the first unit
    holding non-finite values (``(unit, count)``: no need to read further). ``code``: the CF decoding applied
    to what is read (in float64, as the pipeline decodes before its one rounding), or None."""
    order = _Chained(mine)  # never listed: a list of every unit index grows with the array (36 bytes a chunk)
    bar = _Progress(len(order), reader.uri, show)

    def one(u: int) -> Moments:
        values = reader.read(units[u])
        return _moments(values if code is None else code.decode(values, np.float64), channel_axis)

    out: list[Moments] = []
    try:
        with contextlib.closing(ordered_map(one, order, threads, timeout_s, reader.uri)) as results:
            it = iter(results)
            for block in mine:
                acc: Moments | None = None
                for u in block:
                    m = next(it)
                    bar.step()
                    if not skip and bool(m.skipped.any()):
                        return out, (u, int(m.skipped.sum()))
                    acc = m if acc is None else acc.merge(m)
                assert acc is not None  # a block holds at least one unit
                out.append(acc)
    finally:
        bar.close()
    return out, None


def _nonfinite(reader: ArrayReader, units: Units, unit: int, count: int) -> NonFiniteData:
    box = units[unit]
    return NonFiniteData(
        f"{reader.uri}: the box {list(box)} holds {count} non-finite value(s) (NaN or infinite); with "
        "nonfinite='raise' that is an error. Pass nonfinite='skip' (the default) to leave them out (counted in "
        "FieldStats.skipped), or fix the data", uri=reader.uri, box=box, count=count)


def _merge_ranks(reader: ArrayReader, units: Units, local: list[Moments], error: BaseException | None,
                 found: tuple[int, int] | None, channels: int | None, n_blocks: int, group: Any) -> Moments:
    """Every block's moments on every rank (one header collective, then one all_gather), merged in block
    order: the same bits on every rank and for every world size."""
    _, world = group_position(group)
    headers = status_header(error, found is not None, found or (-1, 0), group, lambda failed: StokerError(
        f"computing the statistics of {reader.uri} failed on rank(s) {failed}; the cause is raised there",
        ranks=failed, uri=reader.uri))
    finds = sorted((int(h[1]), int(h[2])) for h in headers if int(h[0]) == STATUS_FOUND)
    if finds:  # the first unit of the array holding any, whichever rank found it
        raise _nonfinite(reader, units, *finds[0])
    rows = -(-n_blocks // world)
    size = Moments.packed_size(channels)
    payload = torch.zeros((rows, size), dtype=F64)
    for j, m in enumerate(local):
        payload[j] = m.pack()
    gathered = all_gather(payload, group)
    merged: Moments | None = None
    for b in range(n_blocks):
        m = Moments.unpack(gathered[b % world][b // world], channels)
        merged = m if merged is None else merged.merge(m)
    assert merged is not None
    return merged


def _compute(reader: ArrayReader, box: Box, channel_axis: int | None, skip: bool, group: Any, threads: int,
             timeout_s: float, show: bool, code: CFCoding | None = None) -> FieldStats:
    rank, world = group_position(group)
    axis = None if channel_axis is None else channel_axis % reader.ndim
    chunks = list(reader.chunks)
    if axis is not None:  # a unit holds every channel: the moments of a chunk of channels merge with no other
        chunks[axis] = box[axis][1]
    units = Units(box, chunks)
    cut = blocks(len(units))
    channels = _channels(box, axis)
    error: BaseException | None = None
    local: list[Moments] = []
    found = None
    try:
        local, found = _local_pass(reader, units, cut[rank::world], axis, skip, threads, timeout_s, show, code)
    except Exception as exc:  # noqa: BLE001 - told to every rank by _merge_ranks, raised here
        error = exc
    merged = _merge_ranks(reader, units, local, error, found, channels, len(cut), group)
    skipped = merged.skipped
    assert skipped is not None  # Moments fills it in
    empty = ((merged.finite == 0) & (skipped > 0)).reshape(-1)
    if bool(empty.any()):
        where = "" if channels is None else f" in channel(s) {torch.nonzero(empty).reshape(-1).tolist()}"
        count = int(skipped.reshape(-1)[empty].sum())  # the empty channels' own, not every channel's
        raise NonFiniteData(f"{reader.uri}: the region holds no finite value{where}, only {count} non-finite "
                            "ones: there is nothing to compute statistics of; choose another region", uri=reader.uri,
                            count=count)
    return FieldStats.from_moments(merged)


def _from_entry(entry: dict | None, channels: int | None) -> FieldStats | None:
    if entry is None:
        return None
    try:
        st = FieldStats.from_json(entry["stats"]["array"])
    except (KeyError, TypeError, ValueError):
        return None
    want = () if channels is None else (channels,)
    if tuple(st.mean.shape) != want or not bool(torch.isfinite(st.mean).all()):
        return None
    return st


def _warn_if_rounded(reader: ArrayReader, cf: bool, options: dict | None, st: FieldStats) -> None:
    """A RuntimeWarning where ``st`` describes 64-bit integers at or past 2**53 (unless CF scaling makes them
    floats anyway): float64 rounds them, so ``min``/``max`` may be no stored value (uint64's 2**64 - 1 reads
    2**64) and ids compared with them would silently differ; the statistics are still right for ``Normalize``.
    The array's CF coding is asked (its attributes read) only for such a dtype."""
    if reader.dtype.kind not in "iu" or reader.dtype.itemsize < 8:
        return
    code = coding(reader, options=options) if cf else None
    if code is not None and (code.scale is not None or code.offset is not None):
        return
    if float(torch.maximum(st.min.abs(), st.max.abs()).max()) >= 2.0**53:
        warnings.warn(f"{reader.uri}: its {reader.dtype} values reach {float(st.min.min()):.17g} .. "
                      f"{float(st.max.max()):.17g}, at or past 2**53, where float64 rounds integers: the float64 min, "
                      "max and mean are rounded (the max may be no stored value). For exact extremes of ids, read "
                      "them with numpy in their own dtype", RuntimeWarning, stacklevel=5)


def _open(uri: str, region: Any, channel_axis: int | None, nonfinite: str, cache: bool,
          storage_options: dict | None, store: LocalStore | None, cf: bool) -> tuple:
    """``(reader, box, axis, fingerprint or None)`` of one array on this rank: what may fail on one rank alone
    (a path its node lacks, a store it cannot list), before any collective."""
    reader = open_array(uri, storage_options, store=store)
    _check_array(reader, channel_axis)
    box = parse_region(region, reader.shape, uri, reader, storage_options)
    if any(stop == start for start, stop in box):  # only a shape with a 0 (a region is never empty)
        raise InvalidArgument(f"compute_stats: {uri} holds no elements (shape {tuple(reader.shape)}): there is "
                              "nothing to compute statistics of", uri=uri)
    axis = None if channel_axis is None else channel_axis % reader.ndim
    fp = identity.fingerprint(reader, box, axis, nonfinite, cf) if cache else None
    return reader, box, axis, fp


def _options_of(storage_options: Any) -> Callable[[str], Any]:
    """``uri -> its storage options``: one URI's options (``open_array``'s form) for every array, or, given as
    ``{URI prefix: options}`` (``Config.storage_options`` and the samplers' form, every key a remote URI
    prefix), those of each array's longest prefix (none for a local array). obstore's keys hold no ``://``, so
    the two forms cannot be taken for each other (a mix is an InvalidArgument naming the key that is no prefix)."""
    if isinstance(storage_options, dict) and storage_options and \
            any(isinstance(k, str) and "://" in k for k in storage_options):
        by_prefix = check_options_by_prefix(storage_options, "compute_stats: storage_options")
        return lambda uri: options_for(by_prefix, uri)
    return lambda uri: storage_options


def _one_array(uri: str, region: Any, channel_axis: int | None, nonfinite: str, group: Any, cache: bool,
               threads: int, timeout_s: float, progress: bool, storage_options: dict | None,
               store: LocalStore | None, cf: bool = True) -> tuple[FieldStats, Box]:
    """The statistics of one array (from its cache entry, or computed by every rank and then cached)."""
    lead = rank_info(group).rank == 0
    _, world = group_position(group)
    opened: tuple | None = None
    error: BaseException | None = None
    try:
        opened = _open(uri, region, channel_axis, nonfinite, cache, storage_options, store, cf)
    except Exception as exc:  # noqa: BLE001 - told to every rank below, raised here
        error = exc
    # Every rank says whether it could open the array, and what it sees, before any of them waits for a claim
    # or a read: a rank that failed (a path its node lacks) or sees other data fails them all, none waits.
    mine = int(opened[3][:14], 16) if opened is not None and opened[3] else 0
    headers = status_header(error, False, [mine], group, lambda failed: StokerError(
        f"compute_stats: rank(s) {failed} could not open or identify {uri}; the cause is raised there",
        ranks=failed, uri=uri))
    assert opened is not None
    reader, box, axis, fp = opened
    if len({int(h[1]) for h in headers}) > 1:
        raise InvalidArgument(f"ranks see different data at {uri} (its fingerprints differ: another file "
                              "system, or the array changed while they looked)", uri=uri)
    channels = _channels(box, axis)
    folder = identity.folder_of(uri, storage_options) if fp else None
    held, entry = cached_entry(folder, fp, lead, world, group) if folder and fp else (None, None)
    try:
        # the statistics say the axis their channels lie on, from this call (a cached entry written before
        # FieldStats knew it does not say), counted from the end: it names the same axis of a batch of crops
        # (scalar statistics say the array's axes too: Normalize.from_stats refuses a batch of another rank,
        # several arrays' channels that one array's numbers would shift alike)
        where = (None, reader.ndim) if axis is None else (axis - reader.ndim, reader.ndim)
        st = _from_entry(entry, channels)
        if st is not None:  # every rank holds rank 0's entry: all return here, or none
            _warn_if_rounded(reader, cf, storage_options, st)
            return st.with_axis(*where), box
        # the values a batch holds: with cf (as Config(cf=True), the default) packed values unpacked, fills NaN
        # (read only now: a cached entry needs no attributes of a v2 array read)
        code = coding(reader, options=storage_options) if cf else None
        st = _compute(reader, box, axis, nonfinite == "skip", group, threads, timeout_s, progress and lead, code)
        if folder is not None and fp is not None:
            if lead:
                doc = {"kind": "array", "uri": uri if locate(uri).is_local else None, "region": [list(b) for b in box],
                       "channel_axis": axis, "nonfinite": nonfinite, "world_size": world,
                       "cf": None if code is None else code.describe(),
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stats": {"array": st.to_json()}}
                if not locate(uri).is_local:  # a cache folder says which array it holds (nothing secret)
                    doc["dataset"] = dataset_identity(uri, storage_options)
                try:
                    sidecar.write(folder, fp, doc)
                except OSError as exc:  # read-only data is common: the statistics are still right
                    warnings.warn(f"could not write {sidecar.path_for(folder)}: {exc}", RuntimeWarning, stacklevel=4)
            barrier(group)  # the file is in place (or known unwritable) before anyone goes on
        _warn_if_rounded(reader, cf, storage_options, st)
        return st.with_axis(*where), box
    finally:
        if held is not None:
            held.release()


def _stack(key: Any, uris: Sequence[str], got: dict[str, tuple[FieldStats, Box]]) -> FieldStats:
    """Channel statistics of a list of arrays: one scalar each, stacked (their regions must hold as many
    elements, as the arrays of one sample must have one shape)."""
    shapes = {tuple(b - a for a, b in got[u][1]) for u in uris}
    if len(shapes) > 1:
        raise InvalidArgument(f"compute_stats: the arrays of {key!r} (channels) have different shapes in the "
                              f"region: {[tuple(b - a for a, b in got[u][1]) for u in uris]} for {list(uris)}; "
                              "channels of one sample share one shape", field=key)
    parts = [got[u][0] for u in uris]
    mean, std, lo, hi, skipped = (torch.stack([getattr(p, k) for p in parts])
                                  for k in ("mean", "std", "min", "max", "skipped"))
    return FieldStats(parts[0].count.clone(), mean, std, lo, hi, skipped)  # channels: no axis of an array


def compute_array_stats(arrays_or_fields: Any, region: Any = None, *, channel_axis: int | None = None,
                        nonfinite: str = "skip", group: Any = None, cache: bool = True, threads: int | None = None,
                        progress: bool = True, storage_options: dict | None = None, store: LocalStore | None = None,
                        timeout_s: float = READ_TIMEOUT_S, cf: bool = True) -> Any:
    """Statistics (count, mean, std, min, max, non-finite count) of Zarr arrays, per array and channel.

    ``arrays_or_fields``: one array URI (a :class:`~stoker.records.FieldStats` back), a list whose items are
    URIs (scalar statistics each) or lists of URIs (channels: statistics of shape ``(C,)``, channel ``c`` from
    array ``c``; a list of results back), or a dict name -> URI, list of URIs or field (anything with an
    ``arrays`` attribute, such as ``stoker.Field``; a dict of results back). ``region``: dict axis ->
    ``(start, stop)`` index range (other axes whole), the same for every array, or dimension name ->
    ``(first, last)`` labels of its coordinates, both included (``{"time": ("2000-01-01", "2009-12-31")}``,
    see :func:`~stoker.arraystats.inputs.parse_region`). ``channel_axis``: statistics
    per index of that axis of each array (shape ``(C,)``) instead of one scalar (not with lists of arrays);
    the result says it in ``FieldStats.channel_axis`` (counted from the end: ``channel_axis=3`` of a 4-d array
    reads -1), so ``Normalize.from_stats`` normalises that axis of a ``(B, *box)`` batch of its crops.

    ``nonfinite``: NaN and infinities are left out and counted per channel in ``FieldStats.skipped``
    (``"skip"``, the default: arrays often hold NaN for missing values), or a
    :class:`~stoker.errors.NonFiniteData` naming the array and the box (``"raise"``). A region without a finite
    value is a NonFiniteData either way. Integers are exact in float64 up to 2**53: 64-bit integers at or
    past it (ids) give a RuntimeWarning, as their float64 min and max are rounded.

    ``cf``: the statistics of the values a batch holds with ``Config(cf=True)`` (the default): CF attributes
    (``scale_factor``, ``add_offset``, ``_FillValue``/``missing_value``, as xarray writes a packed variable)
    applied as xarray applies them, fills NaN (so ``nonfinite`` counts them); ``cf=False`` for the stored
    values, as ``Config(cf=False)`` reads them.

    Collective: call it on every rank of ``group`` (the default process group when torch.distributed is
    initialised) with the same arguments; each rank reads its share of the chunks once and every rank
    returns the same bits (for any world size). ``threads`` (default ``min(8, cpus)``) read at once, each
    read waited for at most ``timeout_s``; ``progress`` shows a bar on rank 0 when the work takes over a
    second. With ``cache``, each array's result is kept in ``.stoker-stats.json`` in its folder (an array in
    a store: its folder of ``$STOKER_CACHE``), keyed by its metadata, the region, ``channel_axis``,
    ``nonfinite`` and the identity of every stored file (size and time; objects: ETag), so a rewritten chunk
    recomputes it; a cache hit reads no chunk. ``store``: the :class:`~stoker.storage.LocalStore` local
    arrays are read through (its counters count the reads). ``storage_options``: the options of the arrays'
    store (as ``open_array`` takes them), or ``{URI prefix: options}`` as ``Config`` and the samplers take
    them (each array gets those of its longest prefix: arrays in several stores, or local ones beside them).

    >>> st = stoker.compute_stats("/data/t2m.zarr", region={0: (0, 8760)})      # one year of hours
    >>> st.mean, st.std, st.skipped                                            # float64 scalars, NaN count
    >>> raw = stoker.compute_stats({"raw": stoker.Field(["/d/c0.zarr", "/d/c1.zarr"], (64, 64, 64))})["raw"]
    >>> norm = stoker.transforms.Normalize.from_stats(raw)                      # per channel: the batch's axis 1
    >>> rgb = stoker.compute_stats("/d/rgb.zarr", channel_axis=-1)              # (Y, X, 3): channels last
    >>> norm = stoker.transforms.Normalize.from_stats(rgb)                      # the batch's axis -1
    """
    if nonfinite not in _NONFINITE:
        raise InvalidArgument(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}", knob="nonfinite")
    # numpy integers too (what numpy's lookups return), as region bounds take them; plain ints from here on
    if channel_axis is not None and (isinstance(channel_axis, bool) or not isinstance(channel_axis, numbers.Integral)):
        raise InvalidArgument(f"channel_axis must be an int or None, got {channel_axis!r}", knob="channel_axis")
    channel_axis = None if channel_axis is None else int(channel_axis)
    threads = min(8, os.cpu_count() or 1) if threads is None else threads
    threads = integer("threads", threads, 1, knob="threads")
    timeout_s = seconds("compute_stats: timeout_s", timeout_s, knob="timeout_s")
    if not isinstance(cf, (bool, np.bool_)):  # as Config.cf: a truthy "False" would decode what was asked raw
        raise InvalidArgument(f"compute_stats: cf must be True (the values a Config(cf=True) batch holds) or False "
                              f"(the stored values), got {cf!r}", knob="cf")
    kind, entries = parse_entries(arrays_or_fields)
    if channel_axis is not None:
        for e in entries:
            if e.channels:
                raise InvalidArgument(f"compute_stats: {e.key!r} is a list of arrays (one channel each) and "
                                      f"channel_axis={channel_axis} asks for channels along an axis too; give "
                                      "one or the other", knob="channel_axis")
    got: dict[str, tuple[FieldStats, Box]] = {}
    options_of = _options_of(storage_options)
    for e in entries:  # each array once, in the order given (every rank alike)
        for uri in e.uris:
            if uri not in got:
                got[uri] = _one_array(uri, region, channel_axis, nonfinite, group, cache, threads, float(timeout_s),
                                      progress, options_of(uri), store, bool(cf))
    results = [_stack(e.key, e.uris, got) if e.channels else got[e.uris[0]][0] for e in entries]
    if kind == "one":
        return results[0]
    if kind == "list":
        return results
    return {e.key: r for e, r in zip(entries, results)}


__all__ = ["MAX_BLOCKS", "READ_TIMEOUT_S", "Units", "blocks", "compute_array_stats"]
