"""A pipeline's coordinator thread: pulls samples when there is room, plans and launches one batch at a time.

There is room when at most ``lookahead_batches + 1`` batches (one per slot) are in flight and the intake has
samples (the batch planned then waits for a free slot, see :meth:`Coordinator._cycle`); a launch opens the batch's arrays
(cached per pipeline), settles its dtype and the executor's buffers from their metadata (so a crop too large
for ``host_buffer_bytes`` is refused before its plan is built), plans it, waits for a slot and submits it. Batches are in flight in push order; a batch that could not be planned,
or a source's error, rides in its place as an error for ``pop`` to raise.

The thread holds the coordinator, never the pipeline, so a pipeline nobody closed can still be collected
(its ``__del__`` closes it).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import torch

from ...runtime import gil
from ...runtime.workers import start_thread
from ...reader.array import DEFAULT_INDEX_CACHE_BYTES, ArrayReader, index_size, open_array
from ...storage.cache import SizedLRU
from ...config import Config
from ...errors import BudgetExceeded, DtypeMismatch
from ...sampling.sample import Sample, parts
from ...storage import LocalStore
from ...storage.locate import Stores, options_for
from ...storage.uri import REMOTE_SCHEMES
from ...zarr.box import check_in_bounds
from ..cast import batch_dtype
from ..executor import Executor, Job, Target
from .intake import Intake
from ..stats import StatsRecorder

_MAX_OPEN_ARRAYS = 16384
_OPEN_AT_ONCE = 16  # remote arrays of one batch opened together (threads waiting on their metadata)


class Entry:
    """A batch in flight: a running job, or an error to deliver in its place."""

    __slots__ = ("job", "target", "error", "batch_id", "rows", "source_ids")

    def __init__(self, batch_id: int, rows: int, job: Job | None = None, target: Target | None = None,
                 error: BaseException | None = None) -> None:
        self.batch_id, self.rows, self.job, self.target, self.error = batch_id, rows, job, target, error
        self.source_ids: list[int] = []

    def ready(self, timeout: float) -> bool:
        return self.job is None or self.job.wait(timeout)


class Coordinator:
    """The batches in flight (``inflight``, in push order) and the thread that launches them."""

    def __init__(self, cfg: Config, intake: Intake, executor: Executor, stats: StatsRecorder,
                 store: LocalStore) -> None:
        self.cfg = cfg
        self.intake = intake
        self.cond = intake.cond
        self.executor = executor
        self.stats = stats
        self.store = store
        self.inflight: collections.deque[Entry] = collections.deque()
        self.closed = False
        self.thread: threading.Thread | None = None
        self._batch_ids = itertools.count()
        self._index_cache = SizedLRU(DEFAULT_INDEX_CACHE_BYTES, index_size)
        self._readers: SizedLRU = SizedLRU(_MAX_OPEN_ARRAYS, lambda _: 1)
        self._dtypes: dict = {}  # the batch dtype of each source dtype (numpy's), as batch_dtype settles it
        # remote stores of this pipeline's arrays, closed with it; their requests capped together
        self.stores = Stores(cfg.requests_in_flight, cache=cfg.cache)

    def open(self, uri: str) -> ArrayReader:
        """The array at ``uri``, opened once per pipeline (metadata and shard indexes cached)."""
        return self._readers.get_or_load(uri, lambda: open_array(
            uri, options_for(self.cfg.storage_options, uri), store=self.store, index_cache=self._index_cache,
            stores=self.stores))

    def _open_all(self, uris: list[str]) -> list[ArrayReader]:
        """The arrays at ``uris``. Those in remote stores not open yet are opened at once, each on a thread
        of its own (at most ``_OPEN_AT_ONCE``): their metadata requests overlap instead of adding up, one
        round trip each, as a batch of arrays seen for the first time would. A failed open is not tried
        again (that would wait out its retries twice): the first failure, in ``uris`` order, is raised."""
        missing = [u for u in uris if "://" in u and u.split("://", 1)[0].lower() in REMOTE_SCHEMES
                   and u not in self._readers]
        errors: dict[str, BaseException] = {}
        for i in range(0, len(missing) if len(missing) > 1 else 0, _OPEN_AT_ONCE):
            threads = [threading.Thread(target=self._try_open, args=(u, errors), name="stoker-open", daemon=True)
                       for u in missing[i:i + _OPEN_AT_ONCE]]
            try:
                for t in threads:
                    start_thread(t, "n_io_threads")
            finally:
                for t in threads:
                    if t.ident is not None:  # started: joined before an error goes on
                        t.join()  # bounded: every store request has its own time limit
        out = []
        for u in uris:
            if u in errors:
                raise errors[u]
            out.append(self.open(u))
        return out

    def _try_open(self, uri: str, errors: dict[str, BaseException]) -> None:
        try:
            self.open(uri)
        except BaseException as exc:  # noqa: BLE001 - raised, in order, by _open_all
            errors[uri] = exc

    def start(self) -> None:
        with self.cond:
            if self.thread is None and not self.closed:
                thread = threading.Thread(target=self._run, name="stoker-coordinator", daemon=True)
                start_thread(thread, "n_compute_threads")  # none given: a later push tries again
                self.thread = thread

    def close(self) -> None:
        """Stop launching (under the condition); the thread ends at its next check."""
        self.closed = True
        self.cond.notify_all()
        self.stores.close()  # cancels requests in flight: their batches fail with ShutdownError

    def join(self, timeout: float) -> None:
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout)  # a user generator blocked in next() cannot be interrupted

    def _run(self) -> None:
        gil.enroll()  # its GIL time is the pipeline's (charged at each batch's "plan" report)
        try:
            while self._cycle():
                pass
        except BaseException as exc:  # noqa: BLE001 - a bug here must reach the consumer, not vanish
            with self.cond:
                if not self.closed:
                    self.inflight.append(Entry(-1, 0, error=exc))
                self.cond.notify_all()

    def _cycle(self) -> bool:
        """One round: wait (at most 0.1 s) for room, then launch one batch. False once closed.

        There is room while at most ``lookahead_batches + 1`` batches, one per slot, are in flight: the next
        one is planned while they are, and its launch then waits in ``acquire`` for the slot the consumer
        gives back. So a slot is written again as soon as it is released, planning (the coordinator's
        Python, under the GIL) overlaps the batches being made instead of sitting between a release and the
        next launch, and the coordinator wakes once per batch (at that release), not also at each pop. At
        most one batch is planned beyond the slots, and a batch that failed to plan rides in flight in its
        place, so a source of bad samples is not drained ahead of the consumer."""
        with self.cond:
            if not self.closed and (len(self.inflight) > self.cfg.lookahead_batches + 1
                                    or not self.intake.has_work()):
                gil.wait(self.cond, 0.1)
                return not self.closed
            if self.closed:
                return False
        staged, error = self.intake.pull(lambda: self.closed)
        if staged:
            self._launch(staged)
        if error is not None:
            with self.cond:
                self.inflight.append(Entry(next(self._batch_ids), 0, error=error))
            self.intake.drop_sources()
        with self.cond:
            self.intake.launching = False
            self.cond.notify_all()
        return True

    def _launch(self, staged: list[tuple[Sample, int]]) -> None:
        samples = [s for s, _ in staged]
        source_ids = [sid for _, sid in staged]
        batch_id = next(self._batch_ids)
        t0 = time.perf_counter()
        if self.closed:
            return
        try:
            # The arrays' metadata settles the dtype and the budget before planning: a crop too large for
            # host_buffer_bytes is refused before its plan (chunk lists of its whole volume) is built.
            uris = list({uri: None for s in samples for uri in s.uris})
            readers = self._open_all(uris)
            dtype = self._batch_dtype(readers)
            try:
                self.executor.prepare(samples[0].shape, readers, dtype)
            except BudgetExceeded:  # a box past its array (a huge one, say) is what to say first
                shapes = {uri: r.shape for uri, r in zip(uris, readers)}
                for uri, aabb in parts(samples):
                    check_in_bounds(aabb, shapes[uri], uri)
                raise
            known = dict(zip(uris, readers))  # the planner asks for each again: no second cache look-up
            plan = self.executor.plan(batch_id, samples, lambda u: known[u] if u in known else self.open(u))
        except BaseException as exc:  # noqa: BLE001 - delivered at pop, in order
            with self.cond:
                self.inflight.append(Entry(batch_id, len(samples), error=exc))
                self.cond.notify_all()
            return
        self.stats.stage("plan", time.perf_counter() - t0)
        entry = Entry(batch_id, plan.rows)
        entry.source_ids = source_ids
        entry.target = self.executor.acquire(plan, lambda: self.closed)
        entry.job = self.executor.submit(plan, entry.target)
        with self.cond:
            self.inflight.append(entry)
            self.cond.notify_all()
        # a frame can outlive its call (the callers' frames of an exception's traceback kept in a cycle):
        # this one must not keep the batch's target, a view of its slot, alive once the batch is popped
        del entry

    def _batch_dtype(self, readers: list[ArrayReader]) -> torch.dtype:
        dtypes = set()
        for r in readers:
            got = self._dtypes.get(r.dtype)
            if got is None:  # once per source dtype; a refused one raises every time
                got = self._dtypes[r.dtype] = batch_dtype(self.cfg.output_dtype, r.dtype, r.uri,
                                                          self.cfg.lossy_casts)
            dtypes.add(got)
        if self.executor.dtype is not None:
            dtypes.add(self.executor.dtype)
        if len(dtypes) > 1:
            raise DtypeMismatch(
                f"dtype='native' needs one source dtype per pipeline, found {sorted(map(str, dtypes))} "
                f"(arrays {[r.uri for r in readers]}); to mix sources pick an output all of them fit: 'i64' (or "
                "'i32') for integer ids, which keeps them exact, 'f32' for floats and 8- or 16-bit integers"
            )
        return dtypes.pop()
