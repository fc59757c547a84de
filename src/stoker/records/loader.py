"""``Loader``: batches of records read by a few threads of the training process itself.

    >>> loader = Loader(ZarrRecords("/data/clouds", fields=["points", "knn16"]), batch_size=8,
    ...                 collate=Concat(increment={"knn16": "points"}), seed=0, device="cuda")
    >>> for epoch in range(start_epoch, n_epochs):
    ...     loader.set_epoch(epoch)            # keeps the position when already in this epoch (after a resume)
    ...     for batch in loader:               # {"points": ..., "points_batch": ..., "knn16": ...}
    ...         step(batch)
    ...         ckpt["loader"] = loader.state_dict()   # as of this batch, whatever is prefetched
    >>> loader.load_state_dict(ckpt["loader"])  # later, on any world size: nothing skipped or repeated

No worker processes: reads release the GIL (``os.pread`` and the decoders), so a
small thread pool keeps up, and nothing goes through ``/dev/shm`` (whose size
limit is what makes DataLoader workers die of SIGBUS in containers). At most
``prefetch`` batches are prepared ahead of the consumer; every wait has a
timeout, so ``close()`` (or dropping the iterator) stops the threads promptly;
an iteration still open when the interpreter exits is closed before it finalises.

**Order.** Epoch ``e`` permutes the records with ``(seed, e)``; ranks take
strided parts of that order with equal sample counts (short ranks wrap around to
the start, or every rank drops the tail with ``drop_last``), so every rank steps
through the same number of batches (see :mod:`stoker.sampling.partition`).

**Position.** The loader is a cursor: iterating continues where the last
iteration stopped (after a ``break``, an error or a resume). ``set_epoch(e)``
jumps to the start of ``e`` unless the loader is in ``e`` already, so the usual
``set_epoch`` loop also resumes correctly. Without ``set_epoch``, iterating an
epoch that is complete moves on to the next one; after ``set_epoch`` or
``load_state_dict`` a complete epoch stays complete (a checkpoint taken after an
epoch's last batch resumes with nothing left of that epoch).
"""

from __future__ import annotations

import functools
import hashlib
import json
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..sampling import partition
from ..sampling.cursor import CursorState, EpochCursor
from ..checks import integer, seconds
from ..config import default_compute_threads
from ..dist.collectives import resolve_rank
from ..errors import InternalError, InvalidArgument, ShutdownError, StokerError, ThreadStartError
from ..runtime.faults import serve
from ..runtime.workers import start_thread
from ..runtime import lifetime
from ..device.resolve import as_device
from ..device.pin import pin_object, to_device
from .collate import CollateArg, resolve
from .dataset import ZarrRecords

_POLL_S = 0.05  # how often a waiting thread looks at the stop flag
_CLOSE_S = 1.0  # close() waits at most this long for the threads (a read in progress cannot be interrupted)


class LoaderTimeout(StokerError, TimeoutError):
    """No batch arrived within ``timeout_s`` (a read is stuck, or far slower than expected)."""


def _identity(fn: Any) -> str | None:
    """A transform's identity in the state: its ``identity()`` when it has one, else its qualified name."""
    if fn is None:
        return None
    ident = getattr(fn, "identity", None)
    if callable(ident):
        return str(ident())
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def _names_id(ds: Any) -> str | None:
    """A digest of the record names when the dataset has them (a wrapper around one may not)."""
    names = getattr(ds, "base_names", None)
    if not callable(names):
        return None
    return hashlib.sha256(json.dumps(list(names())).encode()).hexdigest()[:16]


class Loader:
    """Batches of ``ds`` for this rank: threads, bounded prefetch, equal batch counts, resumable.

    ``ds`` is any map-style dataset whose ``ds[i]`` is a dict of tensors (a full
    :class:`ZarrRecords`, not a rank's part: the loader splits it). ``collate`` is
    ``"concat"``, ``"pad"`` (see :mod:`stoker.records.collate`) or a function of
    the list of samples; a ``Concat`` is bound to the dataset's field dims
    (:meth:`Concat.bind`). ``transform`` (e.g. ``lambda s: normalize(s, stats)``)
    runs on each sample in the reader threads, before collation; the state holds
    only its identity (its ``identity()``, else its qualified name): resuming with
    another one warns. ``n_threads``
    reader threads (default ``min(4, this rank's share of the node's CPUs)``)
    keep at most ``prefetch`` batches ready. With a CUDA ``device``, batches are
    pinned by the readers and copied with ``non_blocking=True`` when handed out;
    a CPU device (or None) hands out the CPU batches as they are. ``rank`` and
    ``world_size`` default to :func:`stoker.rank_info`. ``timeout_s`` bounds the
    wait for one batch (then :class:`LoaderTimeout`).
    """

    def __init__(self, ds: Any, batch_size: int, collate: CollateArg = "concat", shuffle: bool = True,
                 seed: int = 0, n_threads: int | None = None, prefetch: int = 2,
                 device: torch.device | str | int | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, timeout_s: float = 300.0,
                 transform: Callable[[Any], Any] | None = None) -> None:
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise InvalidArgument(f"ds must be a map-style dataset (len and [i]), got {type(ds).__name__}")
        if isinstance(ds, ZarrRecords) and ds.part != (0, 1):
            raise InvalidArgument(f"ds is part {ds.part} of its dataset; pass the full dataset, the Loader "
                                  "splits it across ranks itself", part=ds.part)
        batch_size = integer("batch_size", batch_size, 1)
        seed = integer("seed", seed, 0)
        n_threads = integer("n_threads", n_threads, 1, optional=True)
        prefetch = integer("prefetch", prefetch, 1)
        timeout_s = seconds("timeout_s", timeout_s)
        rank, world_size = resolve_rank(rank, world_size)
        self.ds = ds
        self.batch_size = batch_size
        if transform is not None and not callable(transform):
            raise InvalidArgument(f"transform must be a function of one sample, got {transform!r}", knob="transform")
        self.collate = resolve(collate, ds)
        self.transform = transform
        self.shuffle = bool(shuffle)
        self.seed = seed
        # This rank's share of the node's CPUs (LOCAL_WORLD_SIZE), as the Pipeline's threads.
        self.n_threads = n_threads or min(4, default_compute_threads())
        self.prefetch = prefetch
        self.device = None if device is None else as_device(device, "Loader(device=...)")
        self.drop_last = bool(drop_last)
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self._even = "drop" if self.drop_last else "wrap"
        self._size = len(ds)
        self._names_id = _names_id(ds)
        # The cursor: epoch, earlier splits of it (other world sizes), samples of the current split
        # consumed before this run; and batches the consumer received in this run.
        self._cursor = EpochCursor(self._size, rank, world_size, "strided", self._even)
        self._received = 0
        self._hold = False  # set_epoch/load_state_dict chose this epoch: do not leave it when complete
        self._loaded = False  # the position is one load_state_dict gave, no iteration started from it yet
        self._work: _Work | None = None
        # the threads of an iteration that ended at an error, not waited for then (the error is reported at
        # once): close() waits for them, as it does for a running iteration's
        self._unjoined: _Work | None = None
        self._closed = False
        self._split_cache: tuple[Any, np.ndarray] | None = None


    # -- the order ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    def _split(self) -> np.ndarray:
        """Dataset indices this rank visits in the current split of the epoch, in order."""
        c = self._cursor
        key = (c.epoch, json.dumps(c.segments))
        if self._split_cache is not None and self._split_cache[0] == key:
            return self._split_cache[1]  # state_dict() runs every step: the permutation is O(n)
        rng_order = (np.random.default_rng([self.seed, c.epoch]).permutation(self._size) if self.shuffle
                     else np.arange(self._size, dtype=np.int64))
        split = rng_order[c.share().to_array()]
        self._split_cache = (key, split)
        return split

    def _batch_count(self, samples: int) -> int:
        """Batches ``samples`` samples make (a short last one only without drop_last)."""
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def _run_batches(self) -> list[np.ndarray]:
        """The batches of this run: the split after the samples already consumed, cut into batches."""
        plan = self._split()[self._cursor.steps:]
        bs = self.batch_size
        return [plan[j * bs: (j + 1) * bs] for j in range(self._batch_count(len(plan)))]

    def _left(self) -> int:
        """Batches of the current epoch this rank has not received (counted, not cut: state_dict runs
        every step)."""
        return self._batch_count(len(self._split()) - self._cursor.steps) - self._received

    def _moves_on(self) -> bool:
        """Whether the next iteration starts the next epoch (this one is complete and was not chosen)."""
        return not self._hold and self._left() == 0

    def __len__(self) -> int:
        """Batches the next iteration yields: a whole epoch, less what this epoch already consumed."""
        if self._moves_on():
            m = partition.per_rank(self._size, self.world_size, self._even)  # a fresh epoch, whatever its order
            return self._batch_count(m)
        return self._left()

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; right after :meth:`load_state_dict` of a position in ``epoch`` (no
        iteration since), keep that position, so the usual loop resumes exactly::

            loader.load_state_dict(saved)            # epoch 3, 5 batches in
            for epoch in range(3, n_epochs):
                loader.set_epoch(epoch)              # epoch 3 continues with its batch 6
                for batch in loader: ...
        """
        epoch = integer("epoch", epoch, 0)
        if epoch != self._cursor.epoch or not self._loaded:
            self._stop_work()
            self._cursor.place(epoch, [], 0)
            self._received = 0
            self._loaded = False
        self._hold = True

    # -- state -------------------------------------------------------------------------------

    def _steps(self) -> int:
        """Samples of the current split this rank consumed (received batches, capped by the split)."""
        split = len(self._split())
        if self._left() == 0:
            return split  # complete: the samples drop_last left out are done with too
        skip = self._cursor.steps
        return skip + min(self._received * self.batch_size, split - skip)

    def _order(self) -> dict:
        """What makes the epoch's order (a state saved with other values would resume into other records), and
        the transform's identity (only its name: a function is not state)."""
        return {"seed": self.seed, "shuffle": self.shuffle, "size": self._size, "names": self._names_id,
                "transform": _identity(self.transform)}

    def state_dict(self) -> dict:
        """The position as of the last batch the consumer received (prefetched ones do not count)."""
        c = self._cursor
        return c.at(c.epoch, c.segments, self._steps()).state(self._order()).to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (any rank's, saved with any world size, batch size or ``drop_last``)."""
        saved = CursorState.from_dict(state)
        if not {"size", "seed", "shuffle"} <= saved.order.keys():
            raise InvalidArgument("this state is not a stoker.records.Loader's (it names no size, seed and shuffle "
                                  "of a record order); pass a Loader.state_dict()")
        for key, mine in self._order().items():
            if key == "names" and (mine is None or saved.order.get(key) is None):
                continue  # one side cannot tell its record names: the size has to do
            if key == "transform":  # not the position: a changed transform is allowed, and said
                if "transform" in saved.order and saved.order["transform"] != mine:
                    warnings.warn(f"the state was saved with transform {saved.order['transform']!r}, this loader "
                                  f"has {mine!r}: the samples from here on are transformed differently",
                                  RuntimeWarning, stacklevel=2)
                continue
            if saved.order.get(key) != mine:
                raise InvalidArgument(
                    f"the state was saved with {key}={saved.order.get(key)!r}, this loader has {mine!r}: the "
                    "epoch's order would differ, so resuming would repeat and skip records", key=key)
        self._stop_work()
        # The same split continues exactly (its wrapped tail included), as if never interrupted.
        self._cursor.load(saved, keep_split=True)
        self._received = 0
        self._hold = True
        self._loaded = True

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise ShutdownError("this Loader is closed")
        self._stop_work()  # one iteration at a time: a new one takes over from the last received batch
        if self._moves_on():
            self._cursor.place(self._cursor.epoch + 1, [], 0)
            self._received = 0
        self._hold = self._loaded = False
        batches = self._run_batches()[self._received:]
        pin = self.device is not None and self.device.type == "cuda"
        self._work = _Work(self.ds, batches, self.collate, pin, self.n_threads, self.prefetch, self.transform)
        return _Iter(self, self._work, self._received)

    def _stop_work(self) -> None:
        if self._work is not None:
            self._work.close()
            self._work = None

    def close(self) -> None:
        """Stop the reader threads (returns within about a second), those of an iteration that ended at an error
        too, and refuse further iteration."""
        self._closed = True
        self._stop_work()
        unjoined, self._unjoined = self._unjoined, None
        if unjoined is not None:
            unjoined.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Loader({self.ds!r}, batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"epoch={self._cursor.epoch})")


class _Iter:
    """One pass over the rest of the current epoch; updates the loader's cursor as batches are handed out."""

    def __init__(self, loader: Loader, work: "_Work", start: int) -> None:
        self._loader = loader
        self._work = work
        self._start = start
        self._next = 0
        self._done = False
        # Dropping the iterator (a `break` out of the loop) stops its threads, without waiting for them.
        weakref.finalize(self, work.close, False)

    def __iter__(self) -> "_Iter":
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if self._done:
            raise StopIteration
        if loader._work is not self._work:
            self._done = True
            raise ShutdownError("this iteration was stopped (the loader was closed, moved to another epoch or "
                                "iterated anew)")
        if self._next >= len(self._work.batches):
            self._finish()
            raise StopIteration
        try:
            batch = self._work.take(self._next, loader.timeout_s)
        except BaseException:
            self._finish(join=False)  # report now; a stuck read ends its thread when it returns
            raise
        self._next += 1
        loader._received = self._start + self._next
        if self._next == len(self._work.batches):
            self._finish()  # the epoch's last batch: no thread outlives it
        if loader.device is not None and loader.device.type != "cpu":
            batch = to_device(batch, loader.device, non_blocking=True)
        return batch

    def _finish(self, join: bool = True) -> None:
        self._done = True
        self._work.close(join)
        if self._loader._work is self._work:
            self._loader._work = None
            if not join:  # (an error: reported now, its threads waited for at the loader's close)
                self._loader._unjoined = self._work


class _Work:
    """The reader threads of one iteration and the batches they prepare; shared with the threads only."""

    def __init__(self, ds: Any, batches: list[np.ndarray], collate: Any, pin: bool, n_threads: int,
                 prefetch: int, transform: Callable[[Any], Any] | None = None) -> None:
        self.ds, self.batches, self.collate, self.pin, self.prefetch = ds, batches, collate, pin, prefetch
        self.transform = transform
        self.tasks: queue.Queue = queue.Queue()
        self.cv = threading.Condition()
        self.parts: dict[int, _Part] = {}
        self.ready: dict[int, tuple[bool, Any]] = {}  # batch -> (ok, batch or exception)
        self.issued = 0
        self.stop = threading.Event()
        # a reader's loop raising past its own handling (a bug): the sample it held is lost, so the next take
        # raises it (and every later one), rather than wait timeout_s and blame the dataset (see failed)
        self.fault: InternalError | None = None
        n = min(n_threads, sum(len(b) for b in batches)) if batches else 0
        self.threads = [threading.Thread(target=serve, args=(functools.partial(_read_loop, self), self.failed, _ITERATION_STOPS),
                                         name=f"stoker-records-{i}", daemon=True) for i in range(n)]
        with self.cv:
            self._issue(taken=0)
        try:
            for t in self.threads:
                start_thread(t, "n_threads", owner="Loader")
        except ThreadStartError:
            self.stop.set()  # the threads that started leave at their next look
            raise
        # an iteration still running at interpreter exit (an iterator kept after a break) is closed first: its
        # threads collate with torch, which a daemon thread must not be inside when the interpreter finalises
        lifetime.track(self, _threads_of)

    def _issue(self, taken: int) -> None:
        """Queue the samples of the batches up to ``prefetch`` ahead of the consumer (lock held)."""
        while self.issued < len(self.batches) and self.issued < taken + self.prefetch:
            j = self.issued
            self.parts[j] = _Part(len(self.batches[j]))
            for slot, index in enumerate(self.batches[j]):
                self.tasks.put((j, slot, int(index)))
            self.issued += 1

    def failed(self, fault: InternalError) -> None:
        """A reader thread's loop raised (a bug, ``fault``; the thread ends): kept for :meth:`take`."""
        with self.cv:
            if self.fault is None:
                self.fault = fault
            self.cv.notify_all()

    def take(self, j: int, timeout_s: float) -> Any:
        """Batch ``j`` once ready; raises what reading or collating it raised, or a reader thread's fault."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while j not in self.ready or self.fault is not None:
                if self.fault is not None:
                    raise self.fault
                if self.stop.is_set():
                    raise ShutdownError("the loader was closed while waiting for a batch")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderTimeout(f"batch {j} of this epoch was not ready after {timeout_s:g} s "
                                        f"({self.ds!r})", timeout_s=timeout_s)
                self.cv.wait(min(_POLL_S, left))
            ok, value = self.ready.pop(j)
            self._issue(taken=j + 1)
        if not ok:
            raise value
        return value

    def deliver(self, j: int, part: "_Part") -> None:
        """Collate a complete batch (outside the lock, on the reader thread) and hand it over."""
        failed = [(slot, exc) for slot, exc in enumerate(part.errors) if exc is not None]
        if failed:
            result: tuple[bool, Any] = (False, failed[0][1])  # the lowest slot's error: the same on every run
        else:
            try:
                batch = self.collate(part.samples)
                result = (True, pin_object(batch) if self.pin else batch)
            except StokerError as exc:  # noqa: BLE001 - delivered to the consumer, naming the record
                result = (False, _name_record(exc, self.ds, self.batches[j]))
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
                result = (False, exc)
        with self.cv:
            if not self.stop.is_set():
                self.ready[j] = result
                self.cv.notify_all()

    def close(self, join: bool = True) -> None:
        """Stop the threads: they notice within ``_POLL_S`` unless a read is in progress.

        With ``join``, wait up to ``_CLOSE_S`` for them to end.
        """
        self.stop.set()
        with self.cv:
            self.ready.clear()
            self.parts.clear()
            self.cv.notify_all()
        while True:
            try:
                self.tasks.get_nowait()
            except queue.Empty:
                break
        for _ in self.threads:
            self.tasks.put(None)  # wakes an idle thread now rather than at its next poll
        if not join:
            return
        deadline = time.monotonic() + _CLOSE_S
        for t in self.threads:
            if t is not threading.current_thread() and t.ident is not None:
                t.join(timeout=max(0.0, deadline - time.monotonic()))


def _threads_of(work: _Work) -> list[threading.Thread]:
    return list(work.threads)


def _name_record(exc: StokerError, ds: Any, indices: np.ndarray) -> StokerError:
    """A collate error about sample ``position`` of a batch, retold naming the record it is."""
    j = exc.context.get("position")
    names = getattr(ds, "base_names", None)
    if not isinstance(j, int) or not 0 <= j < len(indices):
        return exc
    index = int(indices[j])
    name = names()[index] if callable(names) else index
    context = {**exc.context, "sample": name}
    retold = type(exc)(f"record {name!r}: {exc.message}", **context)
    retold.__cause__ = exc
    return retold


class _Part:
    """A batch being read: its samples by slot, errors by slot, and how many slots are still out."""

    __slots__ = ("samples", "errors", "left")

    def __init__(self, n: int) -> None:
        self.samples: list[Any] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self.left = n


#: what follows a reader thread's fault (see _Work.failed)
_ITERATION_STOPS = "This iteration of the Loader can make no more batches: start another"


def _read_loop(work: _Work) -> None:
    """A reader thread: read queued samples until stopped; the one finishing a batch collates it."""
    while not work.stop.is_set():
        try:
            task = work.tasks.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if task is None or work.stop.is_set():
            return
        j, slot, index = task
        sample, error = None, None
        try:
            sample = work.ds[index]
            if work.transform is not None:
                sample = work.transform(sample)
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            if hasattr(exc, "add_note"):
                exc.add_note(f"(while stoker.records.Loader read{'' if work.transform is None else ' and transformed'}"
                             f" record {index})")
            error = exc
        with work.cv:
            part = work.parts.get(j)
            if part is None:  # closed meanwhile
                continue
            part.samples[slot], part.errors[slot] = sample, error
            part.left -= 1
            if part.left:
                continue
            del work.parts[j]
        work.deliver(j, part)


__all__ = ["Loader", "LoaderTimeout"]
