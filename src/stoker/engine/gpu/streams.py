"""The GPU-decode executor's three streams and the events that order its waves on them.

Each wave is copied, decoded and placed on its own stream, so while the device decodes wave k it copies wave
k + 1 and places wave k - 1:

- **copy**: the wave's pinned staging into its device copy (``data[k % depth]``);
- **decode**: nvCOMP (the stream decoder's stream) from that copy into the decoded scratch
  (``scratch[k % depth]``);
- **place**: the fused gather / cast / scatter into the batch slots, then fills, padding, CF decoding, the
  transform and each batch's event (the executor's :attr:`~.executor.GpuDecodeExecutor.stream`: the one the
  pipeline sees); before a hybrid batch's chunks, its host part copied into the batch (:meth:`WaveStreams.land`:
  the chunks then land over it, in the stream's order, and the host buffer is written again after its event).

:class:`WaveStreams` holds the order, by events only (no host wait): copy k waits for the decode that last read
its device copy (wave k - depth); decode k waits for copy k and for the placement that last read its scratch
(wave k - depth); place k waits for decode k. Each step returns its event and the next takes it. The staging
of wave k is given back with copy k's event (the reader writes it again once the copy has read it,
:class:`~stoker.engine.buffers.SlotRing` polls the event; with a stream decoder that reads the staging
itself, no copy is made and it is given back with decode k's);
the device buffers are marked used by the streams that read them (``record_stream``), so torch's caching
allocator frees them only after those streams' work.

Closing waits for the streams a bounded time (:meth:`WaveStreams.synchronize`: an event recorded on each,
polled until a deadline), never for ever: a stream still busy past it (a hung kernel or copy, or work that
waits for the consumer's busy stream) is named, and its owner keeps the buffers it may still write
referenced (:func:`keep`) until that work is done rather than free them. A pipeline
closes all its executors against one :class:`CloseWait`: one deadline, :data:`CLOSE_WAIT_S` after the first
of them began waiting for its streams (a hung device holds the close that long once, not once per field),
and one warning naming every stream still busy.

Every wait of the engine for the device has a limit. The closes go through :func:`poll` (an event polled
until a deadline): these, and the CUDA transfer's (:class:`~stoker.engine.cuda.transfer.CudaTransfer`,
against the same :class:`CloseWait`); a look that raises (a device fault) is a DeviceError naming the work.
The nvCOMP decode's checks wait on an :class:`EventWaiter` (one thread per decoder synchronizes its events
in order: one wake per wait, not a look every millisecond) with their own limit
(:data:`~stoker.engine.gpu.nvcomp.CHECK_WAIT_S`). The buffers a stream not done by then may still use are
kept (:func:`keep`) until an event after that work is done.

The streams and events come from a backend: :class:`CudaStreams` (torch's), :class:`HostStreams` (CPU tensors:
no streams, each step runs when called, the executor's host stand-in). The tests pass a recorder of the
waits and records, and hold the graph it gives to every buffer's accesses (``access``: which step reads and
writes what).

>>> lanes = WaveStreams(CudaStreams(torch.device("cuda", 0)))   # doctest: +SKIP
>>> lanes.buffers(data, scratch); k = lanes.next()               # doctest: +SKIP
>>> copied = lanes.copy(k, staging, nbytes)                      # doctest: +SKIP
>>> decoded = lanes.decode(k, copied, run_decode)                # doctest: +SKIP
>>> placed = lanes.place(k, decoded, run_place)                  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import warnings
from typing import Any, Callable, Sequence, TypeVar

import torch

from ...errors import DeviceError, InternalError
from ...runtime import gil
from ...runtime.faults import serve

__all__ = ["CLOSE_WAIT_S", "THREADS_WAIT_S", "CloseWait", "CudaStreams", "EventWaiter", "HostStreams", "Watch",
           "WaveStreams", "device_failed", "keep", "kept", "poll"]

#: the longest :meth:`WaveStreams.synchronize` waits at a close for the streams' work (a wave's copy, decode
#: and placement take milliseconds: past this the device is hung, and the host stops waiting)
CLOSE_WAIT_S = 2.0
#: the longest a close waits for the threads of all of a pipeline's GPU executors (together), which end at
#: their next step
THREADS_WAIT_S = 1.0

T = TypeVar("T")

_kept: list[list[Any]] = []  # [until, buffers]: buffers a stream may still write, freed once ``until`` is done
_kept_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
_reaper: threading.Thread | None = None  # drops the kept buffers whose work is done (while any wait for it)
#: how often the reaper looks at the work the kept buffers wait for
REAP_PAUSE_S = 0.5


def keep(things: Sequence[Any], until: Any = None) -> None:
    """Hold ``things`` (tensors, slot rings, a stream decoder) referenced until ``until`` (an event, or what has
    its ``query()``) is done; None, or a ``query()`` that raises (a device fault): for the rest of the process.
    Memory a stream that did not finish by a close may still write is leaked rather than freed while that work
    may run (torch would hand it to the next allocation, under the work). A daemon thread (``stoker-gpu-kept``,
    started while some kept buffers wait for an event) looks every :data:`REAP_PAUSE_S` and drops the done
    ones: a close that only waited on a busy consumer stream leaks nothing for long, a hung device for ever.

    >>> keep([slots, staging], until=event)   # doctest: +SKIP
    """
    global _reaper
    with _kept_lock:
        _kept.append([until, list(things)])
        # (is_alive: none yet, the last one ended, or this is a forked child, where the parent's does not run)
        if until is not None and (_reaper is None or not _reaper.is_alive()):
            _reaper = threading.Thread(target=_reap, name="stoker-gpu-kept", daemon=True)
            _reaper.start()


def kept() -> list[Any]:
    """What :func:`keep` holds now (a new list).

    >>> any(x is slots for x in kept())   # doctest: +SKIP
    True
    """
    with _kept_lock:
        return [x for _, things in _kept for x in things]


def _reap() -> None:
    """The reaper's loop: ends once no kept buffers wait for an event (each look is a query: no wait)."""
    global _reaper
    pause = threading.Event()  # (never set: a sleep, apart from this module's time.sleep that tests count)
    while True:
        pause.wait(REAP_PAUSE_S)
        with _kept_lock:
            waiting = [entry for entry in _kept if entry[0] is not None]
            if not waiting:
                if _reaper is threading.current_thread():
                    _reaper = None
                return
        done = []
        for entry in waiting:
            try:
                if entry[0].query():
                    done.append(entry)
            except Exception:  # noqa: BLE001 - a device fault: nothing tells when the work ends, kept for ever
                entry[0] = None
        with _kept_lock:
            _kept[:] = [entry for entry in _kept if not any(entry is d for d in done)]
        del done, waiting


class Watch:
    """One event as :class:`EventWaiter` reports it: :meth:`wait` returns once the event is done (or its wait
    failed: :attr:`error`, the device's fault)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        """Done without a fault (what :func:`keep` asks)."""
        return self._done.is_set() and self.error is None

    def wait(self, timeout: float) -> bool:
        """Until the event is done (True) or ``timeout`` seconds passed (False): one wake, the GIL released."""
        return bool(gil.released(self._done.wait, timeout))


class EventWaiter:
    """A daemon thread (``name``) that waits for events in the order they are given (each recorded on one
    stream after the last: they complete in that order), with ``event.synchronize()``: a blocking event's
    wait sleeps in the driver with the GIL released and wakes once, where polling its ``query()`` woke every
    millisecond and took the GIL each time. The caller waits on the :class:`Watch` with its own limit. The
    thread ends after a second with nothing to wait for; on a hung device it stays blocked in the driver
    (a daemon: it never holds the interpreter's exit, nothing joins it, and a forked child starts its own).

    >>> waiter = EventWaiter("stoker-nvcomp-check")
    >>> watch = waiter.watch(event)            # doctest: +SKIP
    >>> watch.wait(60.0)                       # doctest: +SKIP
    True
    """

    IDLE_S = 1.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._queue: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._watching: Watch | None = None  # the watch the thread is waiting for (failed by _failed)

    def watch(self, event: Any) -> Watch:
        """A :class:`Watch` of ``event``, waited for after every event given before it."""
        watch = Watch()
        with self._cond:
            self._queue.append((event, watch))
            if self._thread is None or not self._thread.is_alive():
                # a bug escaping its loop fails the watches it would report (_failed), not a wait without limit
                self._thread = threading.Thread(target=serve, args=(self._loop, self._failed), name=self.name,
                                                daemon=True)
                self._thread.start()
            else:
                self._cond.notify()
        return watch

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait(self.IDLE_S)
                if not self._queue:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                event, watch = self._queue.popleft()
                self._watching = watch
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - the device's fault, for the waiting check to report
                watch.error = exc
            watch._done.set()
            self._watching = None
            del event, watch

    def _failed(self, fault: InternalError) -> None:
        """The loop raised past its own handling (a bug, ``fault``; the thread ends): the watch it was waiting
        for and every one queued report ``fault`` (their checks raise it) rather than leave a wait with no
        limit of its own (a decode's start) waiting until the close; a later watch starts a new thread."""
        with self._cond:
            left = [w for _, w in self._queue]
            self._queue.clear()
            if self._watching is not None:
                left.insert(0, self._watching)
            self._watching = None
            if self._thread is threading.current_thread():
                self._thread = None
        for watch in left:
            if not watch._done.is_set():
                watch.error = fault
                watch._done.set()


def device_failed(what: str, exc: BaseException) -> DeviceError:
    """The DeviceError for a device fault (``exc``: what torch raised looking at an event: an illegal address,
    a launch failure) found while waiting for ``what``."""
    return DeviceError(f"{what} failed on the device: {exc} (a device fault is sticky: this process's CUDA "
                       "context is unusable, restart it; check the device: nvidia-smi, dmesg for Xid errors)")


def poll(pending: Sequence[T], done: Callable[[T], bool], deadline: float, max_pause: float = 0.01,
         what: str = "the stream's work") -> list[T]:
    """Wait until ``done(x)`` for every ``x`` of ``pending`` (each an event, or what holds one), or until
    ``deadline`` (``time.monotonic()``), whichever comes first; returns those not done by then (none: all
    done). The closes' waits for the device go through here: CUDA's own waits (``Event.synchronize``,
    ``Stream.synchronize``) take no limit, so a hung kernel or copy would hold their caller for ever. The
    pauses between looks (the GIL released) start at half a millisecond and double up to ``max_pause``, so
    the caller goes on at most that long after the work is done. A look that raises (a device fault) raises
    DeviceError naming ``what``.

    >>> poll([event], lambda e: e.query(), time.monotonic() + 2.0)   # doctest: +SKIP
    []
    """
    left = list(pending)
    pause = min(0.0005, max_pause)
    while True:
        try:
            left = [x for x in left if not done(x)]
        except DeviceError:
            raise
        except RuntimeError as exc:  # (torch.AcceleratorError is one) any status but "not ready"
            raise device_failed(what, exc) from exc
        wait = deadline - time.monotonic()
        if not left or wait <= 0:
            return left
        time.sleep(min(pause, wait))
        pause = min(2 * pause, max_pause)


class CloseWait:
    """One bounded wait at a close for the threads and device streams of all of a pipeline's executors (they
    close one after another against the same deadlines, not a wait each), and the streams still busy by then,
    warned of once (:meth:`warn`).

    The threads are waited for :data:`THREADS_WAIT_S` from when it is made; the streams until
    :data:`CLOSE_WAIT_S` after the first executor began waiting for its own (:attr:`deadline`: it starts
    after the threads, which queue the streams' work, have ended). ``names``: an executor's ``id`` to what it
    makes (``"field 'raw'"``), for the warning.

    >>> wait = CloseWait()
    >>> for executor in executors:
    ...     executor.close(wait)          # doctest: +SKIP
    >>> wait.warn()                       # one RuntimeWarning if a stream did not finish
    """

    def __init__(self, names: dict[int, str] | None = None) -> None:
        self.threads_deadline = time.monotonic() + THREADS_WAIT_S
        self.timeout = CLOSE_WAIT_S  # (read now: the tests set it smaller)
        self._deadline: float | None = None
        self._names = names or {}
        self._stuck: list[str] = []  # each executor's streams not done: "copy, decode of <what>"
        self._device = self._pinned = 0  # bytes kept for them
        self._warned = False

    def threads_left(self) -> float:
        """Seconds left to wait for the threads (0 once past)."""
        return max(0.0, self.threads_deadline - time.monotonic())

    @property
    def deadline(self) -> float:
        """When the wait for the streams ends (``time.monotonic()``): fixed at the first executor's use."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.timeout
        return self._deadline

    def stuck(self, executor: Any, roles: Sequence[str], device_bytes: int, pinned_bytes: int) -> None:
        """``executor``'s streams ``roles`` were not done by the deadline; its buffers (``device_bytes`` on the
        device, ``pinned_bytes`` pinned) are kept."""
        what = f"{type(executor).__name__} on {getattr(executor, 'device', '?')}"
        name = self._names.get(id(executor))
        self._stuck.append(f"the {', '.join(roles)} stream(s) of {what}" + (f" ({name})" if name else ""))
        self._device += device_bytes
        self._pinned += pinned_bytes

    def warn(self, stacklevel: int = 2) -> None:
        """One RuntimeWarning naming every stream not done by the deadline and what is kept for them (none if
        every stream finished; once)."""
        if not self._stuck or self._warned:
            return
        self._warned = True
        warnings.warn(
            f"close(): {'; '.join(self._stuck)} did not finish their work within {self.timeout} s (a hung "
            f"kernel or copy, or the consumer's stream still has work queued that they wait for: a long step, a "
            f"collective waiting for another rank). Their buffers are kept referenced until that work is done "
            f"rather than freed under work that may still write them: {self._device:,} B of device memory (batch "
            f"slots, device copies, decode scratches) and {self._pinned:,} B of pinned staging; on a hung device "
            "that is for the rest of the process (restart the process to free them; check the device: "
            "nvidia-smi, dmesg for Xid errors).",
            RuntimeWarning, stacklevel=stacklevel + 1)


class HostStreams:
    """No streams: CPU tensors, every step done when it is called (so nothing to wait for)."""

    def stream(self, role: str) -> Any:
        return None

    def on(self, stream: Any):
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def used_by(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def access(self, stream: Any, reads: Sequence = (), writes: Sequence = ()) -> None:
        pass

    def done(self, event: Any) -> bool:
        """Whether the work before ``event`` is done, without waiting (None: nothing to wait for)."""
        return event is None or bool(event.query())


class CudaStreams(HostStreams):
    """torch's CUDA streams and events on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self, role: str) -> Any:
        return torch.cuda.Stream(self.device)

    def on(self, stream: Any):
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def used_by(self, tensor: torch.Tensor, stream: Any) -> None:
        # the caching allocator reuses a block once its own stream is past it: a stream that also reads it
        # must be past it too
        tensor.record_stream(stream)


class WaveStreams:
    """The copy, decode and place streams of one executor and the order of its waves on them (see the module
    docstring). Waves go through :meth:`copy`, :meth:`decode` and :meth:`place` in that order, one wave at a
    time, from one thread (the executor's submitter)."""

    def __init__(self, backend: HostStreams) -> None:
        self.backend = backend
        self.copy_stream = backend.stream("copy")
        self.decode_stream = backend.stream("decode")
        self.place_stream = backend.stream("place")
        self.data: list[torch.Tensor] = []
        self.scratch: list[torch.Tensor] = []
        self._decoded: list[Any] = []  # per device copy: the event of the last decode that read it
        self._placed: list[Any] = []  # per scratch: the event of the last placement that read it
        self._n = 0
        self.closed: Any = None  # after synchronize(): when the work it waited for is done (Every), for keep

    @property
    def depth(self) -> int:
        """Waves that may be on the device at once (device copies and scratches: one each per wave)."""
        return len(self.data)

    def buffers(self, data: list[torch.Tensor], scratch: list[torch.Tensor]) -> None:
        """The device copies (written by the copy stream) and scratches (written by the decode stream), as many
        of each; marked used by the stream that reads them."""
        if len(data) != len(scratch) or not data:
            raise ValueError(f"WaveStreams.buffers: as many device copies as scratches, got {len(data)} and "
                             f"{len(scratch)}")
        self.data, self.scratch = list(data), list(scratch)
        self._decoded, self._placed = [None] * len(data), [None] * len(data)
        for tensor in data:
            self.backend.used_by(tensor, self.decode_stream)
        for tensor in scratch:
            self.backend.used_by(tensor, self.place_stream)

    def next(self) -> int:
        """The next wave's buffers (an index into :attr:`data` and :attr:`scratch`)."""
        k, self._n = self._n % self.depth, self._n + 1
        return k

    def copy(self, k: int, staging: torch.Tensor, nbytes: int, staging_id: Any = None) -> Any:
        """Queue the copy of ``staging[:nbytes]`` into ``data[k]`` once the decode that last read it is done;
        returns the copy's event (after which ``staging`` may be written again)."""
        b, s = self.backend, self.copy_stream
        with b.on(s):
            b.wait(s, self._decoded[k])
            b.access(s, reads=[("staging", staging_id)], writes=[("data", k)])
            self.data[k][:nbytes].copy_(staging[:nbytes], non_blocking=True)
            return b.record(s)

    def decode(self, k: int, copied: Any, run: Callable[[torch.Tensor, torch.Tensor], Any],
               staging_id: Any = None) -> Any:
        """``run(data[k], scratch[k])`` on the decode stream, once the copy (its event ``copied``) is done and
        the placement that last read ``scratch[k]`` is; returns the decode's event, which is recorded even when
        ``run`` raises (it may have queued work that reads the copy). With ``staging_id`` and no copy, ``run``
        reads staging buffer ``staging_id`` itself (a decoder that copies it into ``data[k]``): the buffer is
        written again only after the decode's event."""
        b, s = self.backend, self.decode_stream
        with b.on(s):
            b.wait(s, copied)
            b.wait(s, self._placed[k])
            if staging_id is None:
                b.access(s, reads=[("data", k)], writes=[("scratch", k)])
            else:
                b.access(s, reads=[("staging", staging_id)], writes=[("data", k), ("scratch", k)])
            try:
                run(self.data[k], self.scratch[k])
            finally:
                self._decoded[k] = b.record(s)
        return self._decoded[k]

    def decoded(self, k: int) -> Any:
        """The event of the last decode that read ``data[k]`` (recorded even when it raised)."""
        return self._decoded[k]

    def place(self, k: int, decoded: Any, run: Callable[[torch.Tensor], Any]) -> Any:
        """``run(scratch[k])`` on the place stream once the decode (its event ``decoded``) is done; returns the
        placement's event, which the next decode into ``scratch[k]`` waits for (recorded even when ``run``
        raises)."""
        b, s = self.backend, self.place_stream
        with b.on(s):
            b.wait(s, decoded)
            b.access(s, reads=[("scratch", k)])
            try:
                run(self.scratch[k])
            finally:
                self._placed[k] = b.record(s)
        return self._placed[k]

    def land(self, batch: torch.Tensor, host: torch.Tensor, host_id: Any, writes: Sequence) -> Any:
        """Queue the copy of the host buffer ``host`` (named ``host_id``: the hybrid's host part) into ``batch``
        (the buffers ``writes``) on the place stream, before the batch's chunks are placed there (they land over
        it, in the stream's order); returns the copy's event, after which ``host`` may be written again."""
        b, s = self.backend, self.place_stream
        with b.on(s):
            b.access(s, reads=[("host", host_id)], writes=writes)
            batch.copy_(host, non_blocking=True)
            return b.record(s)

    def staged(self, staging_id: Any) -> None:
        """The reader (the host) writes staging buffer ``staging_id``: for the backend's record of accesses (it
        acquired the buffer once the copy that last read it was done)."""
        self.backend.access(None, writes=[("staging", staging_id)])

    def synchronize(self, deadline: float | None = None) -> list[str]:
        """Wait for the work queued so far on all three streams (closing: no buffer is freed under it), until
        ``deadline`` (``time.monotonic()``; None: :data:`CLOSE_WAIT_S` from now) at most: an event recorded on
        each, polled (no wait without a limit: a hung device never holds the close). Returns the roles of the
        streams not done by then (``"copy"``, ``"decode"``, ``"place"``), whose buffers their work may still
        write (all three after a device fault). :attr:`closed` then tells when that work is done (its
        ``query()``; None after a fault: never known)."""
        b = self.backend
        marks = [(role, b.record(s)) for role, s in
                 (("copy", self.copy_stream), ("decode", self.decode_stream), ("place", self.place_stream))]
        self.closed: Any = Every([event for _, event in marks], b.done)
        if deadline is None:
            deadline = time.monotonic() + CLOSE_WAIT_S
        try:
            return [role for role, _ in poll(marks, lambda mark: b.done(mark[1]), deadline,
                                             what="the copy, decode and place streams")]
        except DeviceError:  # a fault: the work's end is never known, its buffers kept for ever
            self.closed = None
            return [role for role, _ in marks]


class Every:
    """Done once every event of ``events`` is (``done``: the backend's look at one), for :func:`keep`."""

    def __init__(self, events: Sequence[Any], done: Callable[[Any], bool]) -> None:
        self.events, self._done = list(events), done

    def query(self) -> bool:
        return all(self._done(event) for event in self.events)
