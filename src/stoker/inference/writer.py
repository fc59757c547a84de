"""``TileWriter``: tile predictions blended and written to a Zarr array, once per region, by one rank.

>>> grid = stoker.TileGrid(["/data/vol.zarr"], (96, 96, 96), stride=(56, 56, 56))
>>> writer = stoker.TileWriter("/out/prob.zarr", (2, 128, 256, 256), (2, 64, 64, 64), "f4", blend="hann",
...                            crop=20, grid=grid)
>>> for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
...     writer.write(samples, model(x[:, None]))          # (B, 2, 96, 96, 96), any device
>>> writer.close()

How the work is split (see docs/inference.md):

- The array is cut into *regions*: its shards when it has them, else its chunks (spatial axes; a region
  holds every channel). Region ``r`` belongs to rank ``ravel(r) % world_size``, and only that rank writes
  it, whole, once: no two ranks ever write one chunk.
- ``write()`` is collective when several ranks take part (every rank calls it once per batch, as the
  equal shares of a grid make them do): each rank cuts its predictions into the parts each region needs,
  and one ``all_gather_object`` hands every rank the parts of the regions it owns.
- A rank keeps what each region it owns has received until the region is finished: the value of the earliest tile
  covering each voxel (``none``: the tile whose output box starts first, ties broken by the tile's box, so the
  result is independent of order;
  rounded to the nearest for an integer output, as the weighted blends round), or the parts themselves
  (``linear``, ``hann``: copies, blended on a write thread when the region is finished: a voxel one part covers
  is that part's value, and only where parts overlap are weights multiplied and summed, in float64; folded into
  float64 sums of the whole region on arrival instead once they would outgrow them, with a count of the parts per
  voxel so a voxel one covers is still its value). With ``grid=`` (the boxes of every region's parts known
  beforehand) the voxels a part alone covers are copied into the region's output as the part comes and only its
  pieces of the overlaps are kept (one copy of each voxel instead of two; the same result bit for bit), where the
  output and those pieces hold no more than float64 sums would. Written regions' buffers serve the next ones, and
  a closed writer's the next writer's (:mod:`.buffers`, at most ``SPARE_BYTES`` kept by the process). With
  ``grid=`` the writer knows how many tiles touch each region and writes a region as soon as all of them arrived;
  memory is then the regions in flight. Without it every region waits for ``close()``.
- A tile seen twice (a short rank of a grid's split repeats tiles from the start) counts once. With
  ``grid=``, a batch holding a tile not the grid's is refused whole (InvalidArgument) before any of it is
  taken, on every rank for that call (the refusing rank sends its reason instead of parts), so the ranks
  stay in step and the writer stays usable.
- After its chunks are written a region is marked in a completion record beside the array (on a local
  disk only once its chunk files are fsynced, a group of regions at a time on a sync thread: see
  :mod:`.durable`); a restarted writer skips marked regions, and :meth:`TileWriter.pending` lists the
  tiles still needed.
- A finished region is blended down and written by ``write_threads`` background threads
  (:mod:`.background`) while reading and the model go on; the regions queued or being written hold at
  most ``write_bytes``, each counted as what it holds when handed over (its values, or its parts or
  float64 sums; one region is always let through, whatever its size; ``write()`` blocks for room). On top
  of that, each write thread takes for the region it writes its output in ``dtype`` and, for a weighted
  region whose parts overlap, float64 sums, products and sums of weights of the overlaps (each at most the
  region's size, from the recycled buffers; and where numpy blends them, not the compiled pass, a part's
  weights, at most the region's size without channels). A part's weights are the outer product of the
  axes' windows over it (:func:`~.blend.weights_over`), made only where numpy blends: no writer holds a
  whole tile's. A failed
  write is raised at the next ``write()`` or at ``close()``, and ``close()`` waits for the writes
  (``write_timeout_s`` bounds every wait). ``write_threads=0`` writes on the caller's thread. Whole chunks
  are encoded on the write threads and stored through zarr-python's store API where the layout allows
  (:mod:`.chunks`), else written by zarr-python.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Sequence, Sized

import numpy as np

from ..checks import integers
from ..dist.collectives import active_group, all_gather_object, group_position, resolve_rank
from ..errors import DtypeMismatch, InvalidArgument, RankFailed, StorageError
from ..sampling.sample import Sample, box_of
from ..sampling.samplers import SampleList, TileGrid
from .background import BackgroundWriter
from .blend import (BLENDS, Box, coverage, holes, intersect, local, output_box, region_box, regions_of, subtract,
                    weights_over, window)
from .buffers import SPARE, BufferPool
from .chunks import ChunkWriter
from .durable import DurableMarks
from .record import CompletionRecord, forget
from .target import array_store, is_remote, writing
from .weighted import mean_into

# region, tile key (its box), part's box, values, the flat index of the tile's output box's first voxel
Part = tuple[tuple[int, ...], Box, Box, np.ndarray, int]


Scratch = Callable[[tuple[int, ...]], np.ndarray]  # a float64 array of a shape, over reused memory
Windows = tuple[np.ndarray, ...]  # a part's window on each spatial axis: its weights are their outer product

# a region's kept parts up to this many are blended piece by piece (box arithmetic: copies where one part
# covers, sums over the overlaps only); more, and the pieces' count grows faster than the parts', so they are
# summed over the whole region and copied where a per-voxel count says one part covers (linear in the parts)
PIECEWISE_PARTS = 16


class _Plan:
    """Where the parts of one region of a grid's lie: ``boxes`` (from the region's first voxel), the output boxes
    of the grid's tiles cut to the region. Each box's pieces that it alone covers, and the overlaps (``several``: pieces
    covered by two or more boxes) it touches, as :func:`~.blend.coverage` finds them."""

    def __init__(self, boxes: list[Box]) -> None:
        once, self.several = coverage(boxes)
        self._pieces: dict[Box, tuple[list[Box], list[int]]] = {
            b: ([], [m for m, piece in enumerate(self.several)
                     if all(max(a, c) < min(x, y) for (a, x), (c, y) in zip(piece, b))]) for b in boxes}
        for i, piece in once:
            self._pieces[boxes[i]][0].append(piece)
        # the voxels of the overlaps' pieces the parts bring, all told: what the region keeps until its finish
        self.kept_voxels = sum(int(np.prod(_extent(intersect(self.several[m], b)))) for b in boxes
                               for m in self._pieces[b][1])

    def pieces(self, box: Box) -> tuple[list[Box], list[int]]:
        """``box``'s pieces it alone covers, and the indices of the overlaps it touches."""
        found = self._pieces.get(box)
        if found is None:
            raise InvalidArgument(f"TileWriter(grid=...): a prediction for the output box {box} (from its region's "
                                  "first voxel), which no tile of the grid has: write the grid's tiles "
                                  "(writer.pending(grid)), or leave grid= out")
        return found


@functools.lru_cache(maxsize=1024)
def _plan_of(boxes: tuple[Box, ...]) -> _Plan:
    """The plan of a region whose parts lie at ``boxes`` (sorted, from the region's first voxel). A regular
    grid's regions repeat a few layouts (the interior ones all alike), so each layout's box arithmetic is done
    once, for every region and every writer of the process that has it; a plan is never changed."""
    return _Plan(list(boxes))


@functools.lru_cache(maxsize=4096)
def _axis_cut(a: int, b: int, t0: int, unit: int, n: int) -> tuple[tuple[int, tuple[int, int], slice], ...]:
    """One axis of a tile's cut (:meth:`TileWriter._cut_of`): for each region an output box ``[a, b)`` touches
    along an axis of ``n`` voxels cut into regions of ``unit``, the region's index, the part's extent (the box
    cut to the region) and the part as a slice of the tile starting at ``t0``: :func:`~.blend.regions_of`,
    :func:`~.blend.region_box`, :func:`~.blend.intersect` and :func:`~.blend.local` on one axis."""
    cut = []
    for i in range(a // unit, (b - 1) // unit + 1):
        lo, hi = max(a, i * unit), min(b, min((i + 1) * unit, n))
        cut.append((i, (lo, hi), slice(lo - t0, hi - t0)))
    return tuple(cut)


def _shift(box: Box, origin: Box) -> Box:
    """``box`` from ``origin``'s first voxel."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


Copy = tuple[tuple[Any, ...], tuple[Any, ...]]  # where in the region, where in the part (Ellipsis first)


@functools.lru_cache(maxsize=4096)
def _copies(box: Box, lost: tuple[Box, ...]) -> tuple[Copy, ...]:
    """How a part of ``blend="none"`` at ``box`` (from its region's first voxel) is copied into the region when
    it loses the voxels of the boxes ``lost``: the pieces left, each as slices of the region and of the part.
    A grid's regions repeat a few layouts and its parts come in the same order every volume, so this box
    arithmetic is done once per layout for the process, not per part (it was most of the consumer's Python)."""
    return tuple(((Ellipsis,) + _slices(piece), (Ellipsis,) + local(piece, box))
                 for piece in (subtract(box, list(lost)) if lost else [box]))


@functools.lru_cache(maxsize=1024)
def _left(shape: tuple[int, ...], boxes: tuple[Box, ...]) -> tuple[tuple[Any, ...], ...]:
    """The voxels of a region of ``shape`` that none of ``boxes`` (from its first voxel) covers, as slices
    (Ellipsis first): where a region of ``blend="none"`` keeps the fill value."""
    return tuple((Ellipsis,) + _slices(piece) for piece in subtract(tuple((0, n) for n in shape), list(boxes)))


def sums_bytes(lanes: int, shape: tuple[int, ...]) -> int:
    """What folding a region of ``shape`` (``lanes`` channels) holds: the float64 sums of every lane and the
    sums of weights, and the uint8 count of parts per voxel."""
    voxels = int(np.prod(shape))
    return (lanes * voxels + voxels) * 8 + voxels

class _Region:
    """What one owned region has received so far.

    ``none``: the values placed, in the output's dtype. ``linear``/``hann``: the weighted parts themselves
    (copies, into recycled buffers handed back once blended: the batch goes back to the pipeline), blended
    only when the region is finished, on a write thread (:meth:`blend_parts`: copied where one part covers,
    weighted float64 sums where parts overlap); a region's parts are folded into float64 sums of its own
    as soon as they would hold more memory than the sums (tiles overlapping many times), and later parts
    are added to the sums as they come. So the caller's thread copies each part once, and the float64
    buffers are recycled memory (a fresh region-sized array faults in page by page: see :mod:`.buffers`)."""

    def __init__(self, box: Box, channels: tuple[int, ...], blend: str, dtype: np.dtype, pool: BufferPool,
                 plan: "_Plan | None" = None) -> None:
        self.box = box
        self.shape = tuple(b - a for a, b in box)
        self.full = channels + self.shape
        self.seen: set[Box] = set()
        self.values: np.ndarray | None = None
        self.wsum: np.ndarray | None = None
        # once folded: how many parts cover each voxel (0, 1, or 2 for more) and the parts' dtype, so a voxel one
        # part covers is that part's value (the float64 quotient rounded back to it), not w * v / w
        self.count: np.ndarray | None = None
        self.vdtype: np.dtype | None = None
        if blend == "none":
            # not zeroed: every voxel is written, by a part or (no part reached it) at the region's finish
            self.values = pool.take(self.full, dtype, zero=False)
            # the boxes placed so far (from the region's first voxel) and their tiles' (start, box): which tile
            # wins a voxel is decided from these (box arithmetic where boxes overlap), not from a per-voxel array
            self.placed: list[tuple[Box, tuple[int, Box]]] = []
        # the weighted parts not yet summed: where in the region, their values, and the windows whose outer
        # product their weights are (made from them where numpy blends: weights_over)
        self.parts: list[tuple[tuple[slice, ...], np.ndarray, Windows]] = []
        # each part's tile (its output box in the array): the order parts and overlaps are summed in, so the
        # float64 sums do not depend on the order they came (batches, ranks, a restart)
        self.part_tiles: list[Box] = []
        self.overlap_tiles: list[Box] = []
        self.parts_bytes = 0
        # what folding takes: the float64 sums and sums of weights, and the uint8 count of parts per voxel
        self.sums_bytes = sums_bytes(int(np.prod(channels)), self.shape)
        # a weighted region of a grid's (its parts' boxes known, at most PIECEWISE_PARTS): each part's voxels that
        # it alone covers are copied into the output as they come, and only its pieces of the overlaps kept
        # (see add_planned); the voxels its parts covered so far, for the fill at the finish
        self.plan = plan
        self.arrived: list[Box] = []
        # (piece, box, windows, values)
        self.overlaps: list[tuple[int, Box, Windows, np.ndarray]] = []
        if plan is not None:
            self.values = pool.take(self.full, dtype, zero=False)  # the output: every voxel set by the finish

    @property
    def nbytes(self) -> int:
        """The memory the region holds until it is written."""
        return sum(a.nbytes for a in (self.values, self.wsum, self.count) if a is not None) + self.parts_bytes

    def add_weighted(self, where: tuple[slice, ...], values: np.ndarray, pool: BufferPool, scratch: Scratch,
                     win: Windows, tile: Box) -> None:
        """Take one weighted part: kept for later, or added to the sums once the region has them."""
        if self.wsum is None and self.parts_bytes + values.nbytes <= self.sums_bytes:
            # a view of the caller's batch is copied (the pipeline reuses it), into a recycled buffer; a
            # part from another rank arrives as an array of its own
            if values.base is not None:
                kept = pool.take(values.shape, values.dtype, zero=False)
                np.copyto(kept, values)
                values = kept
            self.parts.append((where, values, win))
            self.part_tiles.append(tile)
            self.parts_bytes += values.nbytes
            return
        if self.wsum is None:
            self.fold(pool, scratch)
        self._accumulate(where, win, values, scratch)

    def add_planned(self, box: Box, values: np.ndarray, pool: BufferPool, win: Windows, tile: Box) -> None:
        """Take one weighted part of a planned region (``box``: where it lies, in the array; ``values``,
        ``win``: over it): the voxels it alone covers copied into the output (cast as astype, rounded to the nearest for
        an integer output), its pieces of the overlaps kept (copies: the batch goes back to the pipeline)."""
        assert self.plan is not None and self.values is not None
        box = _shift(box, self.box)  # the plan's boxes are the region's own (see _plan_of)
        once, touched = self.plan.pieces(box)
        for piece in once:
            _place(self.values[(Ellipsis,) + _slices(piece)], values[(Ellipsis,) + local(piece, box)])
        for m in touched:
            x = intersect(self.plan.several[m], box)
            at = local(x, box)
            kept = pool.take(values[(Ellipsis,) + at].shape, values.dtype, zero=False)
            np.copyto(kept, values[(Ellipsis,) + at])
            self.overlaps.append((m, x, tuple(v[a] for v, a in zip(win, at)), kept))
            self.overlap_tiles.append(tile)
            self.parts_bytes += kept.nbytes
        self.arrived.append(box)

    def finish_planned(self, fill: np.ndarray, pool: BufferPool) -> list[np.ndarray]:
        """The overlaps of a planned region blended into its output, as :meth:`blend_parts` blends them (each
        overlap's parts in the order of their boxes, weighted and summed in float64, the quotient rounded once);
        ``fill`` where no part arrived. Returns the buffers taken from ``pool`` (the output last)."""
        assert self.plan is not None and self.values is not None
        out = self.values
        spent: list[np.ndarray] = []
        if self.overlaps:
            lead = self.full[:len(self.full) - len(self.shape)]
            rint = np.issubdtype(out.dtype, np.integer)
            by_piece: dict[int, list[tuple[Box, Windows, np.ndarray]]] = {}
            # summed in the order of their tiles' boxes, not of arrival (batches, ranks)
            for i in sorted(range(len(self.overlaps)), key=lambda i: self.overlap_tiles[i]):
                m, x, win, values = self.overlaps[i]
                by_piece.setdefault(m, []).append((x, win, values))
            for m, kept in by_piece.items():
                box = self.plan.several[m]
                target = out[(Ellipsis,) + _slices(box)]
                if mean_into(target, [(values, [a - o for (a, _), (o, _) in zip(x, box)], win)
                                      for x, win, values in kept], len(lead)):
                    continue  # one compiled pass: the same sums and quotient, a lone part's voxels its value
                if not spent:  # numpy's sums, products, sums of weights and weights, over buffers of the region's size
                    spent = [pool.take(self.full, np.float64, zero=False), pool.take(self.full, np.float64, zero=False),
                             pool.take(self.shape, np.float64, zero=False), pool.take(self.shape, np.float64, zero=False)]
                sums, prods, wsums, ws = spent
                acc, wsum = _carve(sums, lead + _extent(box)), _carve(wsums, _extent(box))
                acc.fill(0)
                wsum.fill(0)
                for x, win, values in kept:
                    dst = local(x, box)
                    w = weights_over(win, out=_carve(ws, _extent(x)))
                    acc[(Ellipsis,) + dst] += np.multiply(w, values, out=_carve(prods, lead + _extent(x)),
                                                          dtype=np.float64)
                    wsum[dst] += w
                with np.errstate(invalid="ignore", divide="ignore"):  # voxels of parts that never came: filled below
                    if rint:
                        np.rint(np.divide(acc, wsum, out=acc), out=acc)
                        np.copyto(target, acc, casting="unsafe")  # as astype
                    else:  # the float64 quotient rounded once to dtype, as astype would
                        np.divide(acc, wsum, out=target, casting="same_kind")
                # a region closed without all its tiles: the voxels of the overlap that one part that came covers
                # alone are that part's value (cast as astype), as blend_parts' pieces over the parts that came
                # give them, not (w * v) / w (an ulp off in float64, and an integer's .5 rounded the other way)
                for i, (x, _, values) in enumerate(kept):
                    for piece in subtract(x, [o for j, (o, _, _) in enumerate(kept) if j != i]):
                        _place(out[(Ellipsis,) + _slices(piece)], values[(Ellipsis,) + local(piece, x)])
            for _, _, _, values in self.overlaps:
                pool.give(values)
        # voxels no part reached (a region finished at close())
        for piece in subtract(tuple((0, n) for n in self.shape), self.arrived):
            out[(Ellipsis,) + _slices(piece)] = fill
        self.overlaps, self.overlap_tiles, self.parts_bytes = [], [], 0
        return spent + [out]

    def fold(self, pool: BufferPool, scratch: Scratch) -> None:
        """Sum the parts kept into float64 sums (made here, from ``pool``)."""
        self.values, self.wsum = pool.take(self.full, np.float64), pool.take(self.shape, np.float64)
        self.count = pool.take(self.shape, np.uint8)
        # the parts kept in the order of their boxes (as blend_parts sums them); those that come after are added
        # as they come: a folded region's sums (one whose parts outgrew its float64 sums) depend on the order
        # parts arrive, within float64 rounding, and are not bit-identical between rank splits. Not fixable within
        # the memory bound: a fold in box order keeps each part that comes before an earlier one of its region,
        # and arrival orders (pending()'s, a rank split's, a restart's, the caller's) put the earliest box last as
        # readily as first, keeping every other part: the bytes whose size made the region fold. Exact, order-free
        # sums would take a wide accumulator per voxel (float64 products span float64's exponents). See
        # docs/inference.md, Restarting
        self._sort_parts()
        for where, values, win in self.parts:
            self._accumulate(where, win, values, scratch)
            pool.give(values)  # summed: the next parts' copies
        self.parts, self.part_tiles, self.parts_bytes = [], [], 0

    def _sort_parts(self) -> None:
        """The parts kept in the order of their tiles' boxes (ties: as they came, the same tile's repeat)."""
        order = sorted(range(len(self.parts)), key=lambda i: self.part_tiles[i])
        self.parts = [self.parts[i] for i in order]
        self.part_tiles = [self.part_tiles[i] for i in order]

    def blend_parts(self, out: np.ndarray, fill: np.ndarray, pool: BufferPool) -> list[np.ndarray]:
        """Blend the parts kept into ``out`` (the region in the output's dtype) and hand the parts back to
        ``pool``; return the float64 buffers taken from ``pool`` (the caller gives them back).

        The weighted mean of one prediction is that prediction: a voxel that one part covers only is that
        part's value, cast as astype (rounded to the nearest for an integer output), as float64 sums would give
        it within float32 rounding; weights are multiplied and summed, in float64, only where parts overlap
        (a crop's tiles overlap at the far borders only). Voxels no part covers get ``fill``. Past
        ``PIECEWISE_PARTS`` parts (whose pieces grow faster than they do): :meth:`_blend_summed`, same result.
        A float output of float parts: all of it in one compiled pass (:func:`~.weighted.mean_into`), same result.

        The parts are summed in the order of their boxes, not the order they came, so the rounding of the float64
        sums does not depend on how tiles were batched or split between ranks (one rank, two ranks and a restart
        give the same bits)."""
        self._sort_parts()
        boxes = [tuple((s.start, s.stop) for s in where) for where, _, _ in self.parts]
        if mean_into(out, [(values, [s.start for s in where], win) for where, values, win in self.parts],
                     len(self.full) - len(self.shape)):
            if len(self.parts) <= PIECEWISE_PARTS:
                for piece in subtract(tuple((0, n) for n in self.shape), boxes):  # voxels no tile reached
                    out[(Ellipsis,) + _slices(piece)] = fill
            else:  # many boxes: their pieces grow faster than they do, a mask does not
                reached = np.zeros(self.shape, bool)
                for where, _, _ in self.parts:
                    reached[where] = True
                out[(Ellipsis,) + (~reached,)] = fill
            for _, values, _ in self.parts:
                pool.give(values)  # blended: the next parts' copies
            self.parts, self.part_tiles, self.parts_bytes = [], [], 0
            return []
        if len(self.parts) > PIECEWISE_PARTS:
            return self._blend_summed(out, fill, pool)
        once, several = coverage(boxes)
        rint = np.issubdtype(out.dtype, np.integer)
        for i, piece in once:
            src = self.parts[i][1][(Ellipsis,) + local(piece, boxes[i])]
            if rint and np.issubdtype(src.dtype, np.floating):
                np.rint(src, out=src)  # in place: the part is the region's own copy, and these voxels only its
            np.copyto(out[(Ellipsis,) + _slices(piece)], src, casting="unsafe")
        spent: list[np.ndarray] = []
        if several:
            # the sums, the products, the sums of weights and the weights of each overlap, over buffers of the
            # region's size
            sums, prods, wsums, ws = (pool.take(self.full, np.float64, zero=False),
                                      pool.take(self.full, np.float64, zero=False),
                                      pool.take(self.shape, np.float64, zero=False),
                                      pool.take(self.shape, np.float64, zero=False))
            spent = [sums, prods, wsums, ws]
            lead = self.full[:len(self.full) - len(self.shape)]
            for m in several:
                acc, wsum = _carve(sums, lead + _extent(m)), _carve(wsums, _extent(m))
                acc.fill(0)
                wsum.fill(0)
                for (_, values, win), b in zip(self.parts, boxes):  # in the order of their boxes
                    x = intersect(m, b)
                    if any(hi <= lo for lo, hi in x):
                        continue
                    at, dst = local(x, b), local(x, m)
                    w = weights_over([v[a] for v, a in zip(win, at)], out=_carve(ws, _extent(x)))
                    acc[(Ellipsis,) + dst] += np.multiply(w, values[(Ellipsis,) + at],
                                                          out=_carve(prods, lead + _extent(x)), dtype=np.float64)
                    wsum[dst] += w
                target = out[(Ellipsis,) + _slices(m)]
                if rint:
                    np.rint(np.divide(acc, wsum, out=acc), out=acc)
                    np.copyto(target, acc, casting="unsafe")  # as astype
                else:  # the float64 quotient rounded once to dtype, as astype would
                    np.divide(acc, wsum, out=target, casting="same_kind")
        for piece in subtract(tuple((0, n) for n in self.shape), boxes):  # voxels no tile reached
            out[(Ellipsis,) + _slices(piece)] = fill
        for _, values, _ in self.parts:
            pool.give(values)  # blended: the next parts' copies
        self.parts, self.part_tiles, self.parts_bytes = [], [], 0
        return spent

    def _blend_summed(self, out: np.ndarray, fill: np.ndarray, pool: BufferPool) -> list[np.ndarray]:
        """:meth:`blend_parts` for many parts, in time linear in them: every part summed over the whole region
        in float64 (in the order of their boxes, so overlaps get the sums the pieces would), the quotient taken, then
        each part copied (rounded as astype) where the count says it alone covers."""
        count = pool.take(self.shape, np.uint8)
        sums, wsums = pool.take(self.full, np.float64), pool.take(self.shape, np.float64)
        prods, ws = pool.take(self.full, np.float64, zero=False), pool.take(self.shape, np.float64, zero=False)
        for where, values, win in self.parts:  # in the order of their boxes (blend_parts sorted them)
            _cover(count, where)
            w = weights_over(win, out=_carve(ws, tuple(s.stop - s.start for s in where)))
            _add(sums, wsums, where, w, values, lambda shape: _carve(prods, shape))
        _quotient(out, sums, wsums, count, fill)
        rint = np.issubdtype(out.dtype, np.integer)
        for where, values, _ in self.parts:
            if rint and np.issubdtype(values.dtype, np.floating):
                np.rint(values, out=values)  # in place: the part is the region's own copy, summed already
            np.copyto(out[(Ellipsis,) + where], values, casting="unsafe", where=count[where] == 1)
            pool.give(values)  # blended: the next parts' copies
        self.parts, self.part_tiles, self.parts_bytes = [], [], 0
        return [count, sums, wsums, prods, ws]

    def finish_folded(self, out: np.ndarray, fill: np.ndarray) -> None:
        """The float64 sums (folded) blended into ``out``: the weighted mean, rounded as astype; a voxel one
        part covers is the quotient rounded back to the parts' dtype first (that part's value exactly for
        float32 or narrower and integer parts; float64 parts within an ulp). Uses up the sums."""
        assert self.values is not None and self.wsum is not None and self.count is not None
        once = self.count == 1
        alone = None
        # parts of the output's dtype: the quotient rounded to it (below) is already that part's value
        if self.vdtype != out.dtype and once.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                q = np.divide(self.values[(Ellipsis, once)], self.wsum[once])
            if self.vdtype is not None and not np.issubdtype(self.vdtype, np.floating):
                np.rint(q, out=q)  # integer parts: w * v / w is v within an ulp
            alone = q.astype(self.vdtype or np.float64)
            if np.issubdtype(out.dtype, np.integer) and np.issubdtype(alone.dtype, np.floating):
                np.rint(alone, out=alone)
        _quotient(out, self.values, self.wsum, self.count, fill)
        if alone is not None:
            out[(Ellipsis, once)] = alone  # cast as astype

    def _accumulate(self, where: tuple[slice, ...], win: Windows, values: np.ndarray, scratch: Scratch) -> None:
        """One part added to the sums: its weights (from ``win``) and their products with ``values``, both over
        ``scratch`` (one call for the two: each call hands out the start of the same memory)."""
        assert self.values is not None and self.wsum is not None and self.count is not None
        self.vdtype = values.dtype if self.vdtype is None else np.result_type(self.vdtype, values.dtype)
        _cover(self.count, where)
        extent = tuple(s.stop - s.start for s in where)
        n = int(np.prod(extent))
        memory = scratch((n + values.size,))
        w = weights_over(win, out=memory[:n].reshape(extent))
        _add(self.values, self.wsum, where, w, values, lambda shape: memory[n:n + int(np.prod(shape))].reshape(shape))


def _cover(count: np.ndarray, where: tuple[slice, ...]) -> None:
    """One more part over ``where``: the count saturates at 2 (covered once or more is all that is asked)."""
    c = count[where]
    np.add(c, c < 2, out=c)


def _add(sums: np.ndarray, wsum: np.ndarray, where: tuple[slice, ...], w: np.ndarray, values: np.ndarray,
         scratch: Scratch) -> None:
    """``w * values`` added to the sums at ``where``, in float64, and ``w`` to the sums of weights."""
    acc = sums[(Ellipsis,) + where]
    acc += np.multiply(w, values, out=scratch(values.shape), dtype=np.float64)
    wsum[where] += w


def _quotient(out: np.ndarray, sums: np.ndarray, wsum: np.ndarray, count: np.ndarray, fill: np.ndarray) -> None:
    """``sums / wsum`` into ``out`` (rounded half to even for an integer output, then cast as astype; for a
    float output the float64 quotient rounded once), ``fill`` where no part reached. Uses up ``sums``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        if np.issubdtype(out.dtype, np.integer):
            mean = np.divide(sums, wsum, out=sums)  # in place: the region is done
            np.rint(mean, out=mean)
            np.copyto(out, mean, casting="unsafe")  # as astype
        else:  # the float64 quotient rounded once to dtype, as astype would
            np.divide(sums, wsum, out=out, casting="same_kind")
    reached = count > 0
    if not reached.all():  # voxels no tile reached keep the fill value
        np.copyto(out, fill, where=~reached, casting="unsafe")


class TileWriter:
    """Blends tile predictions into the Zarr array at ``uri`` (see the module docstring).

    ``shape``, ``chunks``, ``dtype`` (and ``shards``, ``zarr_format``, ``fill_value``) make the array when it
    does not exist; an existing one must have that shape, dtype and chunks (and those shards, where ``shards``
    is given), or is refused (InvalidArgument naming its own). ``shape`` is the volume's
    (``(Z, Y, X)``) or with channels first (``(C, Z, Y, X)``, for ``(B, C, *tile)`` predictions).
    ``crop``: the margin dropped from every side of a prediction that is not on the array's border (an
    int, or one per spatial axis); from every side of a padded tile (``TileGrid(pad=...)``), what is left
    clipped to the array. ``grid``: the TileGrid the samples come from, to write regions as soon
    as they are complete (a ``crop`` that would leave voxels its tiles cover unwritten is refused); a grid's
    ``pad_axes`` are cropped as padded, its other axes as without pad (without ``grid=`` too: its samples
    carry their ``pad_axes``; a padded sample without them is cropped as padded on every axis).
    ``rank``/``world_size``: from ``torch.distributed`` (``group``'s) when not given, and refused when they
    are not this process's place in it; ``group``: the process group of the collectives. ``write_threads``,
    ``write_bytes``, ``write_timeout_s``: the background writes (the module docstring). An integer ``dtype``
    takes float predictions rounded to the nearest, with every blend; a batch holding a value it cannot hold
    (NaN, infinity, out of its range) is refused whole (:class:`~stoker.errors.DtypeMismatch`), never written wrapped.
    """

    def __init__(self, uri: str, shape: Sequence[int], chunks: Sequence[int], dtype: Any, blend: str = "none",
                 crop: int | Sequence[int] | None = None, rank: int | None = None,
                 world_size: int | None = None, *, grid: TileGrid | None = None,
                 shards: Sequence[int] | None = None, zarr_format: int = 3, fill_value: Any = 0,
                 storage_options: dict | None = None, group: Any = None, write_threads: int = 2,
                 write_bytes: int = 256 << 20, write_timeout_s: float = 600.0) -> None:
        import zarr

        if blend not in BLENDS:
            raise InvalidArgument(f"TileWriter(blend={blend!r}): one of {BLENDS}", knob="blend")
        if int(write_threads) < 0 or int(write_bytes) < 0 or not float(write_timeout_s) > 0:
            raise InvalidArgument(f"TileWriter(write_threads={write_threads}, write_bytes={write_bytes}, "
                                  f"write_timeout_s={write_timeout_s}): threads and bytes >= 0, a timeout > 0",
                                  knob="write_threads")
        if crop is not None:  # checked now, before anything is made; its length once the tiles' rank is known
            many = isinstance(crop, Sized) and not isinstance(crop, (str, bytes))
            checked = _crops(crop, len(crop) if isinstance(crop, Sized) and many else 1)
            crop = checked if many else checked[0]  # whole floats (2.0) as the ints they hold
        if shards is not None and zarr_format == 2:
            raise InvalidArgument(f"TileWriter(shards={tuple(shards)}, zarr_format=2): Zarr v2 has no shards; use "
                                  "zarr_format=3 for a sharded output, or leave shards out", knob="shards")
        _check_layout(str(uri), tuple(shape), tuple(chunks), None if shards is None else tuple(shards))
        self.uri, self.blend, self.group = str(uri), blend, group
        position = group_position(group)  # (0, 1) without a process group of several ranks
        if position[1] > 1:  # those not given: the group's (a subgroup's, not the default group's)
            rank = position[0] if rank is None else rank
            world_size = position[1] if world_size is None else world_size
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if self.world_size > 1 and (self.rank, self.world_size) != position:
            # the parts of a region reach its owner only through the group's all_gather: without it, each rank
            # would write its regions with its own tiles alone
            raise InvalidArgument(f"TileWriter(rank={self.rank}, world_size={self.world_size}): this process is "
                                  f"rank {position[0]} of {position[1]} in the process group (1 without one), "
                                  "which hands each region's parts to its owner: initialise torch.distributed "
                                  "with these ranks (or give group=), and leave rank and world_size out to take "
                                  "them from it", knob="world_size")
        self.shape = tuple(int(s) for s in shape)
        if grid is not None and getattr(grid, "volumes", None) is not None:
            raise InvalidArgument("TileWriter(grid=...) takes a TileGrid over arrays, whose tiles are the predictions' "
                                  "boxes; this one is over fields (a box each): leave grid= out and write the samples "
                                  "of the field predicted ([s[name] for s in samples])", knob="grid")
        if grid is not None and len(grid.arrays) != 1:
            raise InvalidArgument(f"TileWriter(grid=...) takes a grid over one array (or one group of channels); "
                                  f"this one has {len(grid.arrays)}: make a grid and a writer per array",
                                  knob="grid")
        self.grid = grid
        self._ndim = len(grid.sample_shape) if grid is not None else None
        # a padded tile's axes cropped as padded: all, or a grid's pad_axes (the others tiled as without pad)
        self._padded_on = _padded_on(grid)
        self._crop_arg = crop
        self._tiles: set[Box] | None = None  # with grid=: the boxes of its tiles
        if grid is not None:  # refused before anything is made (the record keeps the crop, the store the shape)
            _check_rank(self.uri, self.shape, len(grid.sample_shape))
            tiled = tuple(int(n) for n in grid.shapes[0])
            if self.shape[len(self.shape) - len(tiled):] != tiled:
                # regions past the tiled array would keep the fill value (or tiles reach past the output)
                raise InvalidArgument(f"TileWriter(shape={self.shape}): the grid tiles {grid.arrays[0]} of shape "
                                      f"{tiled}, so the output's shape is {tiled} (or with a channel axis first): "
                                      "pass the shape of the array the grid tiles", uri=self.uri, knob="shape")
            self._tiles = {box_of(grid.sample(0, i)) for i in range(len(grid))}
            _refuse_holes(grid, self._tiles, _crops(crop, len(grid.sample_shape)), self.shape)
        store = array_store(self.uri, storage_options)  # a path, or zarr's ObjectStore over obstore
        failed: BaseException | None = None
        if self.rank == 0:
            try:
                try:
                    arr = _open_output(store, self.uri)
                except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):  # type: ignore[attr-defined]
                    fmt: Any = zarr_format  # zarr's stubs want Literal[2, 3]; zarr checks the value
                    # a record left beside a removed array vouches for none of the new one's regions
                    forget(self.uri, storage_options)
                    with writing(self.uri, "the array's metadata"):
                        arr = zarr.create_array(store, shape=self.shape, chunks=tuple(chunks),
                                                shards=None if shards is None else tuple(shards), dtype=dtype,
                                                zarr_format=fmt, fill_value=fill_value)
            except Exception as e:
                failed = e
        self._in_step(failed)  # the array exists before the other ranks open it
        # every rank's opening and checks fail in step: a rank that cannot open the array (an output on a
        # disk only rank 0 sees) sends its failure to the others' next step rather than leave them waiting in it
        try:
            if self.rank != 0:
                try:
                    arr = _open_output(store, self.uri)
                except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError) as e:  # type: ignore[attr-defined]
                    raise StorageError(f"TileWriter({self.uri}): rank {self.rank} cannot open the array rank 0 made "
                                       f"({type(e).__name__}: {e}): put the output where every rank sees it (a shared "
                                       "file system, or an object store)", uri=self.uri, key=None) from e
            _check_existing(self.uri, arr, self.shape, np.dtype(dtype), tuple(int(c) for c in chunks),
                            None if shards is None else tuple(int(s) for s in shards))
            self.array = arr
            self.dtype = arr.dtype
            # voxels no tile reached keep the fill value (zero without one)
            self._fill = np.asarray(arr.fill_value if arr.fill_value is not None else 0, dtype=self.dtype)
            self.unit_full = tuple(arr.shards or arr.chunks)  # the write unit: one shard, or one chunk
            # the buffers of written regions, for the next ones: those of one region per write thread, and one
            # more (its float64 sums, a float64 scratch, its output and its encoded chunks; see .buffers), and
            # from a closed writer's (buffers.SPARE)
            unit_voxels = int(np.prod(self.unit_full))
            self._pool = BufferPool((int(write_threads) + 1) * unit_voxels * (3 * 8 + 2 * self.dtype.itemsize),
                                    spare=SPARE)
            # whole chunks encoded on the write threads where the layout allows, into recycled buffers
            # a local record's marks wait for fsynced chunk files: a store whose files cannot be fsynced is refused
            self._chunks = ChunkWriter(arr, self._pool, durable=not is_remote(self.uri), uri=self.uri)
            self.record = CompletionRecord(self.uri, storage_options)
            if self.rank == 0:
                settings = {"shape": list(self.shape), "unit": list(self.unit_full), "dtype": str(self.dtype),
                            "blend": blend, "crop": _plain(crop)}
                if grid is not None:  # another grid puts other tiles, so other values, in the regions it marked
                    settings["grid"] = {"sample_shape": list(grid.sample_shape), "stride": list(grid.stride),
                                        "pad": grid.pad}
                    axes = getattr(grid, "pad_axes", None)
                    if axes is not None:  # only when set: the records of grids without it still match
                        settings["grid"]["pad_axes"] = list(axes)
                # a restart without grid= is not refused: its marks, like the grid's, are of whole regions
                # not fsynced here: with the array's metadata before the first mark (below), not before the first tile
                self.record.check_settings(settings, optional=("grid",), durable=False)
        except Exception as e:
            failed = e
        self._in_step(failed)
        # the regions written and marked (the record's, then each after its mark): what pending() skips
        self.done = self.record.done()
        self._handed = set(self.done)  # those, and the regions handed to be written: no part opens them again
        self._open: dict[tuple[int, ...], _Region] = {}
        self._expected: dict[tuple[int, ...], int] | None = None
        self._boxes: dict[tuple[int, ...], list[Box]] = {}  # with grid=: each owned region's parts' boxes
        # with grid=: each tile's cut (see _setup, which needs the same boxes), so write() looks a grid tile's parts
        # up instead of redoing the box arithmetic per tile and region on the caller's thread
        self._cuts: dict[tuple[Box, bool | tuple[bool, ...]], tuple[int, list[tuple[tuple[int, ...], Box, tuple[Any, ...]]]]] = {}
        self._windows: dict[int, np.ndarray] = {}  # a tile axis's length -> its window (blend.window)
        self._scratch = np.empty(0, dtype=np.float64)  # the blend's products, reused (the caller's thread only)
        self.written = 0  # regions this rank wrote
        self._count_lock = threading.Lock()
        self._closed = False
        self._timeout_s = float(write_timeout_s)
        self._background = None if int(write_threads) == 0 else \
            BackgroundWriter(self.uri, int(write_threads), int(write_bytes), float(write_timeout_s))
        if self._background is not None:  # a writer dropped without close(): its threads end with it
            weakref.finalize(self, self._background.stop)
        # a written region is marked once its chunk files are on the disk (local disks), a group of regions at a
        # time on a sync thread of its own (none without write threads)
        self._marks = DurableMarks(self.record, self._chunks.folder, self._marked, self._background is not None,
                                   float(write_timeout_s), metadata=self._chunks.metadata_files() + (
                                       [] if self.record.settings_file is None else [self.record.settings_file]))
        weakref.finalize(self, self._marks.stop)
        if self._ndim is not None:
            self._setup(self._ndim)

    # -- geometry ----------------------------------------------------------------------------

    def _setup(self, ndim: int) -> None:
        self._ndim = ndim
        _check_rank(self.uri, self.shape, ndim)
        self.spatial = self.shape[-ndim:]
        self.channels = self.shape[:-ndim]
        self.unit = self.unit_full[-ndim:]
        self.regions_shape = tuple(-(-s // u) for s, u in zip(self.spatial, self.unit))
        self.crop = _crops(self._crop_arg, ndim)
        if self.grid is not None:
            self._expected = {}
            # the grid's tiles (a prediction for another box is refused before it changes anything: write())
            assert self._tiles is not None
            padded = self._padded_on if self.grid.pad is not None else False
            for tile in self._tiles:
                cut = self._cuts[(tile, padded)] = self._cut_of(tile, padded)
                for r, box, _ in cut[1]:
                    if self._owner(r) == self.rank:
                        self._expected[r] = self._expected.get(r, 0) + 1
                        self._boxes.setdefault(r, []).append(box)

    def _cut_of(self, aabb: Box, padded: bool | tuple[bool, ...]) -> tuple[int, list[tuple[tuple[int, ...], Box,
                                                                                          tuple[Any, ...]]]]:
        """Where a tile at ``aabb`` (``padded``: the axes it is padded on, :meth:`_pad_of`) goes: the flat index of its output box's
        first voxel (which tile wins a voxel of ``blend="none"``), and for each region its output box touches, in
        C order: the region, the part's box in the array, and the part as slices of the prediction (Ellipsis
        first). Pure: a grid's tiles are cut once (:meth:`_cut` skips a box cropped away whole, and refuses one
        past the array, before it looks the cut up)."""
        out = self._out(aabb, padded)
        inside = all(0 <= a < n for (a, _), n in zip(out, self.spatial))  # else never placed: see above
        start = -1
        if inside:  # np.ravel_multi_index of the box's first voxel, without a numpy call per tile
            start = 0
            for (a, _), n in zip(out, self.spatial):
                start = start * n + a
        # the product of each axis's cut (regions_of's C order): the tiles of a grid share a few positions per
        # axis, whose cuts are made once (a tile's box arithmetic region by region was most of _setup)
        axes = [_axis_cut(a, b, t0, u, n) for (a, b), (t0, _), u, n in zip(out, aabb, self.unit, self.spatial)]
        parts = []
        for combo in itertools.product(*axes):
            r, box, at = zip(*combo)
            parts.append((r, box, (Ellipsis,) + at))
        return start, parts

    def _plan(self, r: tuple[int, ...], parts: np.dtype) -> _Plan | None:
        """Where region ``r``'s parts (of dtype ``parts``) lie, for a weighted blend over a grid (see
        :class:`_Region`); None without a grid, past PIECEWISE_PARTS parts, or where the output and the overlaps'
        pieces would hold more than float64 sums (tiles overlapping many times: summed or folded instead)."""
        boxes = self._boxes.get(r)
        if self.blend == "none" or boxes is None or len(boxes) > PIECEWISE_PARTS:
            return None
        origin = region_box(r, self.unit, self.spatial)
        plan = _plan_of(tuple(sorted(_shift(b, origin) for b in boxes)))
        shape = tuple(b - a for a, b in origin)
        lanes = int(np.prod(self.channels))
        sums = sums_bytes(lanes, shape)
        held = lanes * (int(np.prod(shape)) * self.dtype.itemsize + plan.kept_voxels * np.dtype(parts).itemsize)
        return plan if held <= sums else None

    def _out(self, aabb: Sequence[Sequence[int]], padded: bool | tuple[bool, ...]) -> Box:
        return output_box(aabb, self.crop, self.spatial, padded)

    def _pad_of(self, s: Sample) -> bool | tuple[bool, ...]:
        """The axes ``s`` is cropped as padded on: none without ``pad``; with ``grid=``, the grid's (what the
        tiles were cut and checked for holes by: a sample saying otherwise would leave gaps); else its
        ``pad_axes`` when its sampler set them (a ``TileGrid(pad_axes=...)`` tile), or every axis."""
        if s.pad is None:
            return False
        if self.grid is not None or s.pad_axes is None:
            return self._padded_on
        return _padded_flags(s.pad_axes, len(self.spatial))  # (a Sample keeps its pad_axes non-negative)

    def _owner(self, region: tuple[int, ...]) -> int:
        if self.world_size == 1:
            return 0
        flat = 0
        for i, n in zip(region, self.regions_shape):  # ravel_multi_index, without numpy's call per region
            if not 0 <= i < n:
                raise ValueError(f"region {region} is outside the regions {self.regions_shape}")
            flat = flat * n + i
        return flat % self.world_size

    def owned_regions(self) -> list[tuple[int, ...]]:
        """The regions this rank writes."""
        return [r for r in np.ndindex(*self.regions_shape) if self._owner(r) == self.rank]

    def pending(self, grid: TileGrid) -> SampleList:
        """The tiles of ``grid`` that touch a region not yet written (all of them on a fresh array): what a
        restarted job still has to predict. Call it on every rank (same answer).

        They come in the order of the regions (C order) that need them, each tile with the first region
        it touches, and within a region in the grid's order: so regions are finished, and written behind,
        from the first batches on, not only once the last row of tiles along the first axis arrives (with
        the grid's order every region of a 2-tile-deep volume waited for the second half of the tiles)."""
        self._setup(len(grid.sample_shape)) if self._ndim is None else None
        first: dict[tuple[int, ...], list[Sample]] = {}  # a region -> the tiles that touch it first
        for i in range(len(grid)):
            s = grid.sample(0, i)
            todo = [r for r in regions_of(self._out(box_of(s), self._pad_of(s)), self.unit) if r not in self.done]
            if todo:
                first.setdefault(min(todo), []).append(s)
        keep = [s for r in sorted(first) for s in first[r]]
        if not keep:  # a finished array: one tile, so an epoch still has a sample; its regions are skipped
            keep.append(grid.sample(0, 0))
        return SampleList(keep, complete=True)

    # -- writing -----------------------------------------------------------------------------

    def write(self, samples: Sequence[Sample], predictions: Any) -> None:
        """Blend one batch: ``predictions[i]`` (``(B, *tile)`` or ``(B, C, *tile)``, numpy or torch, any device)
        is the prediction of ``samples[i]``. Collective over the ranks when several take part."""
        if self._closed:
            raise InvalidArgument(f"TileWriter({self.uri}) is closed")
        parts: list[list[Part]] = [[] for _ in range(self.world_size)]
        fresh = self._ndim is None  # the tiles' ndim is learnt from this batch: forgotten again if it is refused
        try:  # the whole batch is checked before any of it is taken: a refused batch changes nothing
            if self._background is not None:
                self._background.check()  # a background write failed: say so before more work
            self._marks.check()  # so did flushing written regions to the disk, or their marks
            self._cut(samples, _numpy(predictions), parts)
        except Exception as e:
            if fresh:
                self._ndim = None
            # every rank raises for this batch, whatever this rank raised: none waits on a collective the
            # others skip (this rank raises its own error; the others say which rank failed, and why)
            self._exchange(parts, e)
            raise
        self._receive(self._exchange(parts, None))

    def _cut(self, samples: Sequence[Sample], p: np.ndarray, parts: list[list[Part]]) -> None:
        """Cut each prediction into the parts each region needs, into ``parts`` (by the owner's rank)."""
        if len(samples) != len(p):
            raise InvalidArgument(f"TileWriter.write: {len(samples)} samples but {len(p)} predictions")
        _check_fits(p, self.dtype, self.uri, self.blend)
        for s, pred in zip(samples, p):
            aabb = box_of(s)
            if self._ndim is None:
                self._setup(len(aabb))
            tile = tuple(b - a for a, b in aabb)
            if pred.shape != self.channels + tile:
                raise InvalidArgument(
                    f"TileWriter.write: a prediction of shape {pred.shape} for a tile of {tile}; expected "
                    f"{self.channels + tile} (the array {self.uri} has shape {self.shape})", uri=self.uri)
            key = tuple(aabb)
            if self._tiles is not None and key not in self._tiles:
                # counted, it would finish a region before its last tile (then dropped as written already)
                raise InvalidArgument(f"TileWriter(grid=...): a prediction for the tile {key}, which is no tile of "
                                      "the grid: write its tiles (writer.pending(grid)), or leave grid= out",
                                      uri=self.uri)
            padded = self._pad_of(s)
            out = self._out(aabb, padded)
            if any(a < 0 or b > n for (a, b), n in zip(out, self.spatial)):
                # only a padded sample's box is clipped to the array: past it, there is no region to write
                raise InvalidArgument(f"TileWriter.write: the sample {s!r} reaches past the array {self.uri} "
                                      f"(spatial shape {self.spatial}; its kept box is {out}): give it pad= "
                                      "(as TileGrid(pad=...) does), or keep its box inside the array", uri=self.uri)
            if any(b <= a for a, b in out):
                # nothing of it would be written, and the voxels only it covers would keep the fill value
                raise InvalidArgument(_cropped_away(self.uri, self._crop_arg, s, aabb, self.crop, self.spatial, padded),
                                      uri=self.uri, knob="crop")
            cut = self._cuts.get((key, padded))
            start, pieces = cut if cut is not None else self._cut_of(key, padded)
            for r, box, at in pieces:
                if r in self._handed:
                    continue
                parts[self._owner(r)].append((r, key, box, pred[at], start))

    def _in_step(self, failed: BaseException | None) -> None:
        """A barrier of the ranks that also hands each rank's failure (``failed``: this rank's, or None) to the
        others: a rank that failed raises its own, every other rank an error naming the first rank that failed
        (:func:`_raise_for_others`), at once, rather than wait in a later collective the failed rank never
        reaches (the group's timeout, or for ever while it lives on)."""
        if active_group(self.group) is not None and self.world_size > 1:
            everyone = all_gather_object(_reason(failed) if failed is not None else None, self.group)
            if failed is None:
                _raise_for_others(self.uri, "__init__", everyone)
        if failed is not None:
            raise failed

    def _exchange(self, parts: list[list[Part]], failed: BaseException | None) -> list[Part]:
        """The parts of this rank's regions, from every rank; ``failed``: this rank's batch failed (refused, or
        a background write failed: it sends the reason instead of parts, and the caller raises). A batch
        another rank failed fails here too (nothing of it taken), so the ranks stay in step."""
        dist = active_group(self.group)
        if dist is None or self.world_size == 1:
            return [] if failed is not None else parts[0] if self.world_size == 1 else parts[self.rank]
        everyone = all_gather_object(_reason(failed) if failed is not None else parts, self.group)
        if failed is None:
            _raise_for_others(self.uri, "write", everyone)
        return [] if failed is not None else [part for sent in everyone for part in sent[self.rank]]

    def _receive(self, parts: list[Part]) -> None:
        for r, key, box, values, start in sorted(parts, key=lambda p: (p[0], p[1])):
            if r in self._handed:
                continue  # written already: this is a repeat of one of its tiles (a short rank's wrap-around)
            region = self._open.get(r)
            if region is None:
                region = self._open[r] = _Region(region_box(r, self.unit, self.spatial), self.channels, self.blend,
                                                 self.dtype, self._pool, self._plan(r, values.dtype))
            if key in region.seen:
                continue  # a repeated tile (a short rank's wrap-around) counts once
            region.seen.add(key)
            if self.blend == "none":
                # the tile whose output box starts first wins, whatever the order: this part loses the
                # voxels of the boxes placed before it that start earlier, and is copied as the boxes
                # that remain (plain strided copies; a mask made the copy element by element). Padded tiles'
                # boxes clipped to the array may start at one voxel: the earlier tile (its box) wins the tie
                box = _shift(box, region.box)  # from the region's first voxel, as the boxes placed
                first = (start, key)
                lost = tuple(other for other, other_first in region.placed if other_first < first)
                region.placed.append((box, first))
                assert region.values is not None
                # rounded as the weighted blends round a voxel one tile covers (astype alone truncates)
                for into, at in _copies(box, lost):
                    _place(region.values[into], values[at])
            elif region.plan is not None:
                region.add_planned(box, values, self._pool, self._windows_of(key, box), key)
            else:
                region.add_weighted(local(box, region.box), values, self._pool, self._scratch_of,
                                    self._windows_of(key, box), key)
            if self._expected is not None and len(region.seen) >= self._expected.get(r, 0):
                self._flush(r)

    def _windows_of(self, aabb: Box, box: Box) -> Windows:
        """The window of each axis of the tile ``aabb`` over ``box`` (in it): the outer product of these
        (:func:`~.blend.weights_over`) is ``weights(blend, tile)[local(box, aabb)]``."""
        found = []
        for (a, b), (t0, t1) in zip(box, aabb):
            win = self._windows.get(t1 - t0)
            if win is None:
                win = self._windows[t1 - t0] = window(self.blend, t1 - t0)
            found.append(win[a - t0:b - t0])
        return tuple(found)

    def _scratch_of(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float64 array of ``shape`` over the caller's thread's scratch memory (a fresh temporary per
        part faults its pages in anew: see :mod:`.buffers`)."""
        n = int(np.prod(shape))
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.float64)
        return self._scratch[:n].reshape(shape)

    def _flush(self, r: tuple[int, ...]) -> None:
        region = self._open.pop(r)
        self._handed.add(r)  # no later part opens it again; `done` and the record take it once it is written
        # with grid=, a region closed before all its tiles came (close() after an interrupted loop) is written as
        # it is but not marked: a restart writes it again with every tile, rather than skip it
        whole = self._expected is None or len(region.seen) >= self._expected.get(r, 0)
        if self._background is None:
            self._finish(r, region, whole)
        else:  # the blend's last step and the write run on the background threads
            self._background.submit(f"region {r}", region.nbytes, lambda: self._finish(r, region, whole))

    def _finish(self, r: tuple[int, ...], region: _Region, whole: bool = True) -> None:
        fill = self._fill
        if self.blend == "none":
            assert region.values is not None
            out = region.values
            # voxels no tile reached keep the fill value: the region less the boxes placed
            for piece in _left(region.shape, tuple(box for box, _ in region.placed)):
                out[piece] = fill
            spent = [out]
        elif region.plan is not None:  # a grid's: the voxels one part covers are in place, the overlaps kept
            spent = region.finish_planned(fill, self._pool)
            out = spent[-1]
        elif region.wsum is None:  # its parts kept: blended now, on this thread
            out = self._pool.take(region.full, self.dtype, zero=False)
            spent = region.blend_parts(out, fill, self._pool) + [out]
        else:  # folded into float64 sums as the parts came (tiles overlapping many times)
            assert region.values is not None and region.wsum is not None and region.count is not None
            out = self._pool.take(region.full, self.dtype, zero=False)
            region.finish_folded(out, fill)
            spent = [region.values, region.wsum, region.count, out]
        where = (slice(None),) * len(self.channels) + tuple(slice(a, b) for a, b in region.box)
        with writing(self.uri, f"region {r} (voxels {region.box})"):
            self._chunks.write(where, out)
        for buf in spent:  # zarr-python is done with them: the next regions' accumulators
            self._pool.give(buf)
        if whole:
            self._marks.add(r, self._chunks.files(where))  # marked once its files are on the disk

    def _marked(self, r: tuple[int, ...]) -> None:
        """Region ``r`` is written and marked, its chunks and its mark on the disk (the sync thread)."""
        with self._count_lock:
            self.written += 1
            self.done.add(r)

    def close(self) -> None:
        """Write the regions still open (those without all their tiles, or all without ``grid=``); on every
        rank (it waits for the others). With ``grid=``, a region written without all its tiles (a loop cut
        short) is not marked done: a restarted writer writes it again."""
        if self._closed:
            return
        self._closed = True
        failed: BaseException | None = None
        try:
            try:
                for r in sorted(self._open):
                    self._flush(r)
            finally:
                # one write_timeout_s for both waits: the writes queued, then the marks of what they wrote
                deadline = time.monotonic() + self._timeout_s
                try:
                    if self._background is not None:
                        self._background.close(deadline)  # waits for the queued writes, raises the first failure
                finally:
                    try:
                        self._marks.drain(deadline)  # the regions written are on the disk, and marked
                    finally:
                        self._marks.stop()
            self.record.sync()
        except Exception as e:
            failed = e
        self._pool.release()  # for the next writer of this process (buffers.SPARE)
        if active_group(self.group) is not None and self.world_size > 1:
            # in place of a barrier: a rank whose writes failed tells the others (which raise too) rather than
            # leaving them in the barrier until the group's timeout
            everyone = all_gather_object(_reason(failed) if failed is not None else None, self.group)
            if failed is None:
                _raise_for_others(self.uri, "close", everyone)
        if failed is not None:
            raise failed

    def __enter__(self) -> "TileWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # the regions already queued are written and marked; the error is the caller's
            self._closed = True
            deadline = time.monotonic() + self._timeout_s
            try:
                if self._background is not None:
                    self._background.close(deadline)
            except Exception:
                pass  # the caller's exception is the one raised
            try:
                self._marks.drain(deadline)
            except Exception:
                pass
            finally:
                self._marks.stop()


def _check_rank(uri: str, shape: tuple[int, ...], ndim: int) -> None:
    """InvalidArgument unless ``shape`` is the ``ndim``-d volume of the tiles, or it with a channel axis first."""
    if len(shape) not in (ndim, ndim + 1):
        raise InvalidArgument(f"{uri}: shape {shape} is neither the {ndim}-d volume of the tiles nor it with a "
                              "channel axis first", uri=uri)


def _check_layout(uri: str, shape: tuple, chunks: tuple, shards: tuple | None) -> None:
    """InvalidArgument unless ``chunks`` (and ``shards``) have one positive integer per axis of ``shape``, each
    shard a whole number of chunks: checked on every rank before anything is made (zarr-python's own refusal
    was a ValueError on rank 0 only, at the array's creation)."""
    for knob, sizes in (("chunks", chunks), ("shards", shards)):
        if sizes is not None and (len(sizes) != len(shape) or not all(
                isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in sizes)):
            raise InvalidArgument(f"TileWriter({knob}={sizes}): one integer >= 1 per axis of the shape {shape}",
                                  uri=uri, knob=knob)
    if shards is not None and any(s % c for s, c in zip(shards, chunks)):
        raise InvalidArgument(f"TileWriter(shards={shards}): each shard must hold a whole number of chunks "
                              f"{chunks} on every axis; use shards that are multiples of the chunks", uri=uri,
                              knob="shards")


def _check_existing(uri: str, arr: Any, shape: tuple[int, ...], dtype: np.dtype, chunks: tuple[int, ...],
                    shards: tuple[int, ...] | None) -> None:
    """InvalidArgument naming each setting where the array at ``uri`` (existing, or just made) is not what the
    caller asked for: its shape and dtype, its chunks, and its shards where ``shards`` is given (None asks for
    none in particular). An existing array is never remade, so a writer that took its chunks silently would
    write other regions (other write units, other completion marks) than the caller chose."""
    have = {"shape": tuple(arr.shape), "dtype": arr.dtype, "chunks": tuple(arr.chunks)}
    want: dict[str, Any] = {"shape": shape, "dtype": dtype, "chunks": chunks}
    if shards is not None:
        have["shards"], want["shards"] = (None if arr.shards is None else tuple(arr.shards)), shards
    wrong = [k for k in want if have[k] != want[k]]
    if wrong:
        has = ", ".join(f"{k} {have[k]}, not {want[k]}" for k in wrong)
        own = ", ".join(f"{k}={have[k]!r}" if k != "dtype" else f"dtype={str(have[k])!r}" for k in wrong)
        raise InvalidArgument(f"{uri}: the array there has {has}; an existing array is written as it is: pass its "
                              f"own ({own}) to write into it, or write to another URI or remove it", uri=uri)


def _open_output(store: Any, uri: str) -> Any:
    """The array at ``store`` opened for writing; InvalidArgument where a group is there (an OME-Zarr image's
    root given for one of its arrays), which zarr-python refuses with an error of its own."""
    import zarr  # as in TileWriter.__init__: not at import time

    try:
        return zarr.open_array(store, mode="r+")
    except zarr.errors.NodeTypeValidationError:  # type: ignore[attr-defined]
        raise InvalidArgument(f"{uri} is a Zarr group, not an array: give the URI of an array to write (one "
                              "inside it, such as its labels' level, or a new path)", uri=uri) from None
    except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):  # type: ignore[attr-defined]
        raise  # no array there: the caller makes it
    except Exception as exc:  # the store failed (an endpoint down, denied): obstore's own error or an OSError
        if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] != "obstore":
            raise
        text = str(exc).split("\n")[0][:300]
        raise StorageError(f"{uri}: reading the array's metadata through zarr-python failed ({type(exc).__name__}: "
                           f"{text}); check the URI, the bucket, credentials and endpoint (storage_options or the "
                           "environment)", uri=uri, key=None, status=None, attempts=None) from exc


def _crops(crop: Any, ndim: int) -> tuple[int, ...]:
    """``TileWriter(crop=...)`` as a margin per spatial axis."""
    if crop is None:
        crops: tuple[int, ...] = (0,) * ndim
    else:  # a fraction (1.5, or (1.7, 2)) refused, never truncated into another margin
        scalar = not isinstance(crop, (str, bytes)) and not hasattr(crop, "__iter__")
        if scalar:
            try:
                crops = integers("crop", (crop,), 0) * ndim
            except InvalidArgument:  # said of the scalar given, not of a sequence the user never wrote
                raise InvalidArgument(
                    f"TileWriter(crop={crop!r}): crop must be an integer >= 0 (not a bool), or a sequence of them, "
                    f"one per spatial axis; got the {type(crop).__name__} {crop!r}", knob="crop") from None
        else:
            crops = integers(f"TileWriter(crop={crop!r}): crop", crop, 0, knob="crop")
    if len(crops) != ndim or min(crops) < 0:
        raise InvalidArgument(f"TileWriter(crop={crop!r}): one non-negative margin, or one per spatial axis",
                              knob="crop")
    return crops


def _padded_on(grid: Any) -> bool | tuple[bool, ...]:
    """Which axes of a padded tile are cropped as padded: every one (True), or those of a grid's pad_axes."""
    axes = getattr(grid, "pad_axes", None)  # (no grid: every axis)
    return True if axes is None else _padded_flags(axes, len(grid.sample_shape))


def _padded_flags(axes: Sequence[int] | None, ndim: int) -> bool | tuple[bool, ...]:
    """``axes`` (non-negative axis numbers, or None: every axis) as the per-axis flags a crop takes."""
    return True if axes is None else tuple(d in axes for d in range(ndim))


def _refuse_holes(grid: TileGrid, tiles: set[Box], crop: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """InvalidArgument where ``crop`` leaves voxels that the grid's ``tiles`` cover but none of their kept boxes
    does: written as the fill value without a word (a centre of ``tile - 2 * crop`` shorter than the stride). A
    grid's tiles are the product of each axis's, so the axes are checked apart; voxels no tile covers (a stride
    past the tile leaves gaps on purpose) are not the crop's doing, and are said in a warning: they too keep the
    fill value."""
    ndim = len(crop)
    spatial = shape[-ndim:]  # (its rank checked first: _check_rank)
    padded, warned = _padded_on(grid) if grid.pad is not None else False, False
    for k, n in enumerate(spatial):
        along = {tile[k] for tile in tiles}
        gaps = holes([(0, n)], list(along), n)
        if gaps and not warned:
            warned = True
            a, b = gaps[0]
            warnings.warn(f"TileWriter(grid=...): the grid's stride {tuple(grid.stride)} is longer than its tile "
                          f"{tuple(grid.sample_shape)}, so voxels {a}..{b - 1} of axis {k} (and "
                          f"{sum(y - x for x, y in gaps) - (b - a)} more on it) are in no tile: they keep the fill "
                          "value. For a whole volume use a stride of at most the tile", UserWarning, stacklevel=3)
        kept = [output_box((t,), (crop[k],), (n,), padded if isinstance(padded, bool) else padded[k])[0]
                for t in along]
        found = holes(list(along), kept, n)
        if found:
            a, b = found[0]
            sample = getattr(grid, "sample_shape", None)
            most = "" if sample is None else \
                f" = {tuple(max((c - s) // 2, 0) for c, s in zip(sample, grid.stride))}"
            raise InvalidArgument(
                f"TileWriter(crop={crop}): the grid's tiles cropped by it leave voxels {a}..{b - 1} of axis {k} "
                f"(and {sum(y - x for x, y in found) - (b - a)} more on it) unwritten, which the tiles cover: they "
                f"would keep the fill value. Use a crop of at most (sample_shape - stride) // 2{most} on each axis",
                knob="crop")


def _place(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` cast as astype, a float ``src`` rounded to the nearest first where ``dst`` is an
    integer array (astype alone would truncate: 2.9999998 -> 2, -0.7 -> 0)."""
    if dst.dtype.kind in "iu" and src.dtype.kind == "f":
        src = np.rint(src)
    np.copyto(dst, src, casting="unsafe")


#: The integer predictions a weighted blend into an integer output keeps exactly where tiles overlap: its
#: float64 mean of n equal values is within about (2 n + ndim + 3) * 2**-53 of the value relative to it, under
#: half a unit (so rounded back to it) up to 2**32 for fewer than 2**19 overlapping parts; past it (2**50 with
#: a few dozen `hann` parts) a label id came back one to three off.
WEIGHTED_EXACT = 2 ** 32


def _check_fits(p: np.ndarray, dtype: np.dtype, uri: str, blend: str = "none") -> None:
    """DtypeMismatch when predictions ``p`` hold a value an integer output of ``dtype`` cannot take once
    rounded (NaN, infinity, or outside its range): cast as astype, it would be written wrapped (300.0 into
    uint8 is 44). A blend's weighted mean of values that fit fits too, so the predictions are what is checked.
    Integer predictions into a float output are refused where they pass the integers it holds exactly (2**24 in
    float32): label ids would be written rounded, two ids merged, as the pipeline refuses such a cast; so are
    integer predictions past :data:`WEIGHTED_EXACT` into an integer output with a weighted blend.
    Finite float predictions that a narrower float output rounds to infinity (70000.0 into float16) are refused,
    as the pipeline refuses such a cast on reading; NaN and infinities stay themselves."""
    if p.size == 0 or p.dtype.kind not in "fiub":
        return
    floating = np.issubdtype(dtype, np.floating)
    if p.dtype.kind in "iu":
        if floating:
            bits = np.finfo(dtype).nmant + 1
            _check_exact(p, 2 ** bits, f"{uri}'s dtype {np.dtype(dtype)}",
                         "write an integer dtype ('int64', 'uint64', ...) or map the ids into range", uri)
        if blend != "none" and not floating:  # a float output is the weighted mean itself, never rounded back
            _check_exact(p, WEIGHTED_EXACT, f"the {blend!r} blend (a float64 weighted mean where tiles overlap)",
                         "write label ids with blend='none', or map them into range", uri)
        if floating:
            return
    elif floating and p.dtype.kind == "f":
        _check_finite_fits(p, np.dtype(dtype), uri)
        return
    if not np.issubdtype(dtype, np.integer):
        return
    lo, hi = p.min(), p.max()  # NaN propagates
    rounded = p.dtype.kind == "f"
    if rounded:
        lo, hi = np.rint(lo), np.rint(hi)
    room = np.iinfo(dtype)
    if not (room.min <= lo and hi < room.max + 1):  # False for NaN too; + 1: float(2**63 - 1) is 2**63
        raise DtypeMismatch(f"TileWriter.write: predictions from {lo} to {hi}{' (rounded)' if rounded else ''} do "
                            f"not fit {uri}'s dtype "
                            f"{np.dtype(dtype)} ({room.min} to {room.max}); cast as astype they would be written "
                            "wrapped: clip or map them into range (or write a float array)", uri=uri)


def _check_exact(p: np.ndarray, exact: int, what: str, fix: str, uri: str) -> None:
    """DtypeMismatch when integer predictions ``p`` pass ``exact`` (the integers ``what`` holds exactly);
    nothing scanned where ``p``'s dtype cannot (uint8 or int16 into float32)."""
    info = np.iinfo(p.dtype)
    if -exact <= info.min and info.max <= exact:
        return
    lo, hi = int(p.min()), int(p.max())
    if lo < -exact or hi > exact:
        raise DtypeMismatch(f"TileWriter.write: integer predictions from {lo} to {hi} do not fit {what} exactly "
                            f"(it holds integers only up to 2**{exact.bit_length() - 1}): label ids would merge; "
                            f"{fix}", uri=uri)


def _check_finite_fits(p: np.ndarray, dtype: np.dtype, uri: str) -> None:
    """DtypeMismatch when finite float predictions ``p`` round to infinity in the narrower float ``dtype``: from
    the midpoint between its largest finite value and the next power of two up (65520 for float16), as
    round-to-nearest-even casts them."""
    have, room = np.finfo(p.dtype), np.finfo(dtype)
    if have.max <= room.max:
        return
    at = float(np.ldexp(2.0 - 2.0 ** -(room.nmant + 1), room.maxexp - 1))
    if max(abs(float(p.min())), abs(float(p.max()))) < at:  # False with a NaN: scanned below
        return
    a = np.abs(p)
    big = a[np.isfinite(a) & (a >= at)]
    if big.size:
        raise DtypeMismatch(f"TileWriter.write: finite predictions of magnitude {float(big.min()):g} to "
                            f"{float(big.max()):g} would be written as infinity in {uri}'s dtype {dtype} (its "
                            f"largest value is {float(room.max):g}): scale or clip them, or write a wider float "
                            "array", uri=uri)


def _cropped_away(uri: str, crop_arg: Any, s: Sample, aabb: Box, crop: Sequence[int],
                  spatial: Sequence[int], padded_on: bool | tuple[bool, ...]) -> str:
    """Why ``write`` refuses the sample ``s`` whose kept box is empty: on which axis, with the numbers, and
    the largest crop that keeps something of it there (a padded tile's kept box is also clipped to the array,
    so half the tile is not the bound for it)."""
    k = next(k for k, (a, b) in enumerate(output_box(aabb, crop, spatial, padded_on)) if b <= a)
    padded = padded_on if isinstance(padded_on, bool) else padded_on[k]
    (a, b), c, n = aabb[k], crop[k], spatial[k]
    kept = (a + c, b - c) if padded else output_box(((a, b),), (c,), (n,))[0]
    fits = [c2 for c2 in range(c) if (o := output_box(((a, b),), (c2,), (n,), padded)[0])[0] < o[1]]
    advice = f"use a crop of at most {max(fits)} on axis {k}" if fits else \
        "the tile lies wholly outside the array: leave it out"
    return (f"TileWriter(crop={crop_arg}): the crop leaves nothing of the sample {s!r} inside the array {uri}: "
            f"on axis {k} its box {(a, b)} less the crop {c} is {kept}, and the array spans (0, {n}) there "
            f"(the voxels only it covers would keep the fill value): {advice}")


def _reason(failed: BaseException) -> tuple[str, str]:
    """What a rank sends the others in place of its parts when its call failed: the kind, and the error."""
    kind = "refused" if isinstance(failed, InvalidArgument) else \
        "failed" if isinstance(failed, StorageError) else "raised"
    return (kind, f"{type(failed).__name__}: {failed}")


def _raise_for_others(uri: str, call: str, everyone: list[Any]) -> None:
    """Raise, on a rank whose own call went well, the first failure another rank sent (see :func:`_reason`):
    a refusal as InvalidArgument, a failed write as StorageError, anything else as RankFailed."""
    for rank, sent in enumerate(everyone):
        if isinstance(sent, tuple):
            kind, why = sent
            what = f"TileWriter({uri}).{call}: rank {rank} {kind} ({why}), so this call fails on every rank"
            if call == "write":
                what += " (nothing of the batch taken)"
            if kind == "refused":
                raise InvalidArgument(what, uri=uri)
            if kind == "failed":
                raise StorageError(what, uri=uri, key=None)
            raise RankFailed(what, rank=rank, traceback=why)


def _extent(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _carve(buf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous array of ``shape`` over the start of ``buf``'s memory (at least as large)."""
    return buf.reshape(-1)[:int(np.prod(shape))].reshape(shape)


def _numpy(x: Any) -> np.ndarray:
    """A batch of predictions as a numpy array on the host; a float type numpy lacks (bfloat16, float8: a model
    run in bfloat16 predicts it) as the float32 values it holds."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach().to("cpu")
        if x.is_floating_point() and x.element_size() < 4 and x.dtype != torch.float16:
            x = x.float()  # exact: float32 holds every bfloat16 and float8 value
        return x.numpy()
    return np.asarray(x)


def _plain(crop: Any) -> Any:
    if crop is None or isinstance(crop, (int, np.integer)):
        return None if crop is None else int(crop)
    return [int(c) for c in crop]


__all__ = ["TileWriter"]
