"""A pipeline's intake: what was pushed, pulled lazily into batches of samples, and what was consumed.

Sized pushes are checked at once and counted as pending; iterables (also infinite generators) are pulled
only when the coordinator has room for a batch, and checked then; resumable sources (``state_after``) have
their position reported as of the samples the consumer popped (:meth:`Intake.state_dict`). Every field is
read and written under the pipeline's condition, which :class:`Intake` shares; the pipeline asks through
methods (:meth:`Intake.more_to_come`, :meth:`Intake.starved_reason`...) and reads no field. What the consumer
received is one record (:class:`Received`), replaced whole at each pop, so a pop interrupted part way can put it
back.

Each pulled sample gets its key ``(epoch, index)`` (what keyed transforms draw from, ``Batch.keys``): a
resumable source's sample its epoch and index in the epoch's global order, as the source's iterator reports
it (``key``), the same on any world size and after a resume; any other sample (and one of a resumable
iterator of one's own without ``key``) ``(0, n)``, ``n`` the samples of such pushes pulled before it (its
place among them in push order).

>>> intake.push(samples); batch, error = intake.pull(closed)   # up to batch_size (sample, source id, key)
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterable, Iterator, Sized
from typing import Any, Callable, NamedTuple

from ...config import Config
from ...errors import InvalidArgument, RankMismatch, StokerError
from ...sampling.sample import Sample, arrays_read
from .geometry import LayoutGuard


#: a pulled sample, its source id and its key (epoch, index)
Staged = tuple[Sample, int, tuple[int, int]]


class Received(NamedTuple):
    """What the consumer has popped: batches, samples, and samples per resumable source's id (a dict never
    changed after it is made: a new record replaces the whole)."""

    batches: int = 0
    samples: int = 0
    per_source: dict = {}


class Intake:
    """The samples between ``push`` and a launched batch, and the positions of resumable sources."""

    def __init__(self, cfg: Config, cond: threading.Condition) -> None:
        self.cfg = cfg
        self.cond = cond
        # (iterator, counted, source id): sized pushes are counted in `pending` at push, generators as pulled
        self.sources: collections.deque[tuple[Iterator[Any], bool, int]] = collections.deque()
        # pulled, not yet in a batch, with their source id and key (epoch, index)
        self.staged: list[tuple[Sample, int, tuple[int, int]]] = []
        self._plain = 0  # samples of plain (not resumable) pushes pulled so far: the index of their keys
        self._source_ids = itertools.count()
        self.pushes = 0  # pushes so far (each a source id): what prefetch's freshness marks count
        self._resumable: dict[int, Any] = {}  # source id -> iterator that can report state_after(n)
        # ids of the sources whose epochs are delivered whole (a TileGrid's): their last short batch is launched
        # whatever drop_last says, as every tile is to be inferred (see _keeps_short)
        self._whole: set[int] = set()
        self.received = Received()  # replaced whole by popped(): see Pipeline._hand_over
        self.flush = False  # launch a short batch of what is staged (drop_last=False, sources drained)
        self.launching = False  # samples taken from the sources but not yet in flight
        self._counted = 0  # samples counted as pushed: sized pushes at push, iterables as they are pulled
        self.shape: Any = cfg.sample_shape  # a dict (field name -> shape) for samples of named fields
        self.first: Sample | None = None  # the first sample checked: its channel count is the pipeline's
        # the coordinator is inside a pushed iterable's next() (user code, outside the lock): what the exit hook
        # does not wait for once the pipeline is closed (see facade._parked)
        self.in_source = False
        # flips and transposes must keep a sample's fields over one another: checked before any batch of them
        self.guard = LayoutGuard(cfg)
        self._laid_out: set[int] = set()  # ids of the sources the guard checked whole at push

    def push(self, samples: Sample | Iterable[Sample]) -> None:
        """Queue samples: one Sample, a sequence (checked now), a sharded source (pulled lazily, its
        position tracked) or any iterable (pulled lazily, checked then)."""
        if isinstance(samples, Sample):
            samples = [samples]
        if not isinstance(samples, Iterable):
            raise InvalidArgument(f"push takes a Sample or an iterable of Samples, got {type(samples).__name__}")
        it = iter(samples)
        if hasattr(it, "state_after"):  # a resumable source (RankShare): pulled lazily, position tracked
            whole = self.guard.pushed(it)
            with self.cond:
                sid = self._new_source()
                if whole:
                    self._laid_out.add(sid)
                self._resumable[sid] = it
                if getattr(it, "complete_epochs", False):
                    self._whole.add(sid)
                self.sources.append((it, False, sid))
                self.cond.notify_all()
        elif isinstance(samples, Sized) and not isinstance(samples, Iterator):
            items = list(it)
            shape0, first0 = shape, first = self.shape, self.first
            for s in items:  # outside the lock: a long list takes a while
                shape = validate(s, shape, first)
                first = first or s
                self.guard.sample(s)
            with self.cond:
                if self.shape is not shape0 or self.first is not first0:
                    # a pull or another push settled the pipeline's shape meanwhile: check against it (pull
                    # stages these samples without a second look)
                    for s in items:
                        validate(s, self.shape, self.first)
                self.shape = self.shape or shape
                self.first = self.first or first
                self.sources.append((iter(items), True, self._new_source()))
                self._counted += len(items)
                self.cond.notify_all()
        else:
            with self.cond:
                self.sources.append((it, False, self._new_source()))
                self.cond.notify_all()

    def _new_source(self) -> int:
        """Under the condition: a new push's source id (``pushes`` then counts it)."""
        sid = next(self._source_ids)
        self.pushes = sid + 1
        return sid

    def has_work(self) -> bool:
        """Under the condition: whether a pull may give a batch."""
        return bool(self.sources) or (self.flush and bool(self.staged))

    def pull(self, closed: Callable[[], bool]) -> tuple[list[Staged], BaseException | None]:
        """Up to batch_size samples (a short batch only when flushing), or an error from the source (with the
        samples staged before it, when they make a batch)."""
        want = self.cfg.batch_size
        while len(self.staged) < want:
            with self.cond:
                if closed() or not self.sources:
                    break
                source, counted, sid = self.sources[0]
                if counted:  # a pushed sequence's own iterator, its samples checked at push: taken in one step
                    got = list(itertools.islice(source, want - len(self.staged)))
                    if got:
                        self.staged += [(sample, sid, (0, self._plain + i)) for i, sample in enumerate(got)]
                        self._plain += len(got)
                    elif self.sources[0][0] is source:
                        self.sources.popleft()
                    continue
            self.in_source = True
            try:
                sample = next(source)  # user code: outside the lock
            except StopIteration:
                with self.cond:
                    if self.sources and self.sources[0][0] is source:
                        self.sources.popleft()
                continue
            except BaseException as exc:  # noqa: BLE001
                return self._take_before_error(), exc if isinstance(exc, StokerError) else _wrap_source_error(exc)
            finally:
                self.in_source = False
            try:
                shape = validate(sample, self.shape, self.first)
                if sid not in self._laid_out:
                    self.guard.sample(sample)
            except StokerError as exc:
                return self._take_before_error(), exc
            key = getattr(source, "key", None) if sid in self._resumable else None
            if key is None:
                key, self._plain = (0, self._plain), self._plain + 1
            with self.cond:
                self.shape = self.shape or shape
                self.first = self.first or sample
                if not counted:
                    self._counted += 1
            self.staged.append((sample, sid, (int(key[0]), int(key[1]))))
        with self.cond:
            if len(self.staged) >= want or (self.flush and not self.sources):
                self.flush = False
                batch = self._take()
                self.launching = bool(batch)
                return batch, None
        return [], None

    def _take_before_error(self) -> list[Staged]:
        """Samples staged before a source error: a short batch only when drop_last is off."""
        with self.cond:
            self.launching = True
            keep = self._keeps_short()
            batch = self._take()
            if not keep and len(batch) < self.cfg.batch_size:
                self._counted -= len(batch)
                return []
            return batch

    def _keeps_short(self) -> bool:
        """Under the condition: whether what is staged goes out as a short batch once the sources are drained:
        with drop_last off, or where a staged sample is of a source whose epochs are delivered whole (a
        :class:`~stoker.TileGrid`'s: its epoch is never cut short, a bare Pipeline's as CropDataset's)."""
        return not self.cfg.drop_last or any(sid in self._whole for _, sid, _ in self.staged)

    def _take(self) -> list[Staged]:
        batch, self.staged = self.staged[: self.cfg.batch_size], self.staged[self.cfg.batch_size:]
        return batch

    def drop_sources(self) -> None:
        """After a source's error: nothing more is pulled."""
        with self.cond:
            self.sources.clear()

    def drained(self) -> bool:
        """Under the condition: whether every push is used up and no batch is being launched (what is staged, if
        anything, is fewer samples than a batch, which drop_last drops)."""
        return not self.sources and not self.launching and not self.flush and not self.in_source

    def drop_used_up(self) -> int:
        """Under the condition, the intake :meth:`drained`: forget the pushes so far, the samples they left
        staged (fewer than a batch) and their positions (:meth:`state_dict` lists only later pushes); returns
        the samples dropped."""
        dropped, self.staged = len(self.staged), []
        self._counted -= dropped  # never to be popped: no longer pending
        self._resumable.clear()
        self._whole.clear()
        self._laid_out.clear()
        r = self.received
        self.received = Received(r.batches, r.samples, {})
        return dropped

    def flush_if_drained(self, in_flight: bool) -> None:
        """Under the condition: with nothing in flight and the sources drained, launch what is staged as a
        short batch (when drop_last is off, or a grid's: :meth:`_keeps_short`)."""
        if not in_flight and not self.sources and self.staged and self._keeps_short():
            self.flush = True
            self.cond.notify_all()

    def launched(self, still_waiting: bool = False) -> None:
        """Under the condition: the batch the last pull took is in flight (or was dropped); ``still_waiting``:
        batches planned ahead still wait for a slot (the prefetch queue, :mod:`.prefetch`), so samples taken
        from the sources are not yet all in flight."""
        self.launching = still_waiting

    def more_to_come(self) -> bool:
        """Under the condition: whether what was pushed can still give a batch: a source to pull, a batch
        being launched, or staged samples (launched now as a short batch when drop_last is off)."""
        if self.sources or self.launching or self.flush:
            return True
        if self.staged and self._keeps_short():
            self.flush = True
            self.cond.notify_all()
            return True
        return False

    def starved_reason(self, in_flight: bool) -> str | None:
        """Under the condition: why no batch came, when the intake is the reason (else None)."""
        if not self.sources and not in_flight:
            staged = len(self.staged)
            extra = (f" {staged} samples wait for a full batch of {self.cfg.batch_size}; push more or set "
                     "Config(drop_last=False).") if staged else ""
            return f"no samples are pending; push more.{extra}"
        if not in_flight and not self.launching:
            return (f"the pushed samples have not filled a batch yet ({len(self.staged)} of {self.cfg.batch_size} "
                    "pulled so far); the pushed iterable yields samples slower than the timeout (make it faster, "
                    "or raise pop_timeout_s)")
        return None

    @property
    def pending(self) -> int:
        """Samples counted as pushed and not yet in a popped batch."""
        return max(0, self._counted - self.received.samples)

    def popped(self, source_ids: list[int], rows: int) -> None:
        """Under the condition: the consumer got a batch of these samples. One store changes what was
        received: an interrupt lands before it (nothing counted) or after it (all of it)."""
        r = self.received
        per_source = r.per_source
        resumable = self._resumable
        # only resumable sources' counts are kept (state_dict reports their positions): a pipeline fed a push
        # per step would otherwise copy a record of every push it ever had at every pop, and keep it
        for sid in source_ids:
            if sid in resumable:
                if per_source is r.per_source:
                    per_source = dict(per_source)
                per_source[sid] = per_source.get(sid, 0) + 1
        self.received = Received(r.batches + 1, r.samples + rows, per_source)

    def received_now(self) -> Received:
        """Under the condition: what the consumer has received, as one record (see :meth:`put_back`)."""
        return self.received

    def put_back(self, received: Received) -> None:
        """Under the condition: undo the pops after ``received`` (from :meth:`received_now`), in one store."""
        self.received = received

    def state_dict(self) -> dict:
        with self.cond:
            r = self.received
            return {
                "sources": [it.state_after(r.per_source.get(sid, 0)) for sid, it in self._resumable.items()],
                "batches": r.batches,
            }


def validate(s: Any, shape: Any, first: Sample | None = None) -> Any:
    """The batch shape after ``s``: typed errors for a non-Sample, another number of arrays than ``first``
    (the pipeline's first sample), another rank or another shape. For samples of named fields the shape is
    a dict of each field's (see :func:`validate_fields`)."""
    if not isinstance(s, Sample):
        raise InvalidArgument(f"expected stoker.Sample, got {type(s).__name__}: {s!r}")
    if s.fields is not None or (first is not None and first.fields is not None):
        return validate_fields(s, shape, first)
    if first is not None and s.channels != first.channels:
        raise InvalidArgument(f"{s} reads {arrays_read(s)}, this pipeline's first sample {first} reads "
                              f"{arrays_read(first)}; "
                              "every sample of a pipeline must read the same number of arrays", uri=s.uri)
    if shape is None:
        return s.shape
    if len(s.shape) != len(shape):
        raise RankMismatch(f"{s} has {len(s.shape)} axes, the batch's samples have {len(shape)} {shape}",
                           uri=s.uri)
    if s.shape != shape:
        raise InvalidArgument(f"{s} has shape {s.shape}; every sample of this pipeline must be {shape} "
                              "(set Config.sample_shape, or make all boxes the same size; a sample of several arrays is "
                              "(channels, *box))", uri=s.uri)
    return shape


def validate_fields(s: Sample, shape: Any, first: Sample | None) -> dict[str, tuple[int, ...]]:
    """The shapes (field name -> shape) after ``s``, a sample of named fields: typed errors naming the field
    for another set of field names than ``first``'s, another number of arrays in a field, another rank or
    shape; for a pipeline that mixes them with samples of one box, or sets ``Config.sample_shape``."""
    if first is not None and (first.fields is None) != (s.fields is None):
        one, other = (s, first) if s.fields is None else (first, s)
        raise InvalidArgument(f"{other} is a sample of named fields and {one} is not: a pipeline reads samples of "
                              "one kind (push them to two pipelines)", uri=s.uri)
    assert s.fields is not None
    if shape is not None and not isinstance(shape, dict):
        raise InvalidArgument(f"Config.sample_shape={shape} is for samples of one box; {s} has named fields, "
                              "whose shapes the first sample sets: leave sample_shape None", knob="sample_shape")
    if first is not None and first.fields is not None and set(s.fields) != set(first.fields):
        missing = [n for n in first.fields if n not in s.fields]
        extra = [n for n in s.fields if n not in first.fields]
        raise InvalidArgument(f"{s} has fields {list(s.fields)}, the pipeline's first sample {list(first.fields)} "
                              f"(missing: {missing}, not in the first: {extra}); every sample of a pipeline must "
                              "have the same field names", uri=s.uri)
    for name, f in s.fields.items():
        f0 = first.fields[name] if first is not None and first.fields is not None else None
        if f0 is not None and f.channels != f0.channels:
            raise InvalidArgument(f"field {name!r} of {s} reads {arrays_read(f)}, the pipeline's first sample's "
                                  f"reads {arrays_read(f0)}; each field must read the same number of arrays in "
                                  "every sample", uri=f.uri)
        want = shape[name] if shape is not None else None
        if want is not None and len(f.shape) != len(want):
            raise RankMismatch(f"field {name!r} of {s} has {len(f.shape)} axes, the batch's has {len(want)} {want}",
                               uri=f.uri)
        if want is not None and f.shape != want:
            raise InvalidArgument(f"field {name!r} of {s} has shape {f.shape}; it must be {want} in every sample "
                                  "(a field of several arrays is (channels, *box))", uri=f.uri)
    return shape if shape is not None else dict(s.shape)


def _wrap_source_error(exc: BaseException) -> StokerError:
    err = InvalidArgument(f"the pushed sample iterable raised {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
