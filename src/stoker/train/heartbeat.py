"""Name the rank that holds a job up, long before the collectives time out.

A rank that hangs (a hung file system, a deadlock, an endless loop) leaves its peers waiting inside a
collective until the process group's timeout (10 minutes by default), and the error then comes from a
rank that was only waiting. Here every rank publishes, from a daemon thread, where it is: its step and
phase (marked by the Trainer, or by ``ctx.mark`` in a loop of one's own) and how long it has been there.
A rank that has waited in a collective for ``stall_s`` reads its peers and names the one(s) behind it,
or the one that stopped answering (its beats stopped: a frozen or dead process)::

    beat = Heartbeat(store, rank=0, world_size=2, stall_s=60, on_stall=report)
    beat.start()
    beat.mark(step=3, phase="data")      # cheap: two attribute writes, read by the thread
    beat.close()

Positions compare by ``(step, phase)``, with ``step`` the optimizer steps completed and the phases in
the order a step meets them after that count moved: ``idle`` (outside the Trainer), ``checkpoint``,
``eval`` (the Trainer's evaluation and its reduction: a rank waiting there for one still evaluating a
larger share is not waiting in the heartbeat's sense, so evaluation is never blamed; ``timeout_s`` bounds it),
``sync`` (stoker's collectives, and the host sync on the loss), then ``data``, ``forward``, ``backward``
(the synchronising micro-step's; the others, under ``no_sync``, count as ``forward``), ``optimizer``. A
rank may wait for its peers in ``forward``, ``backward``, ``optimizer`` and ``sync`` (see ``WAITING``);
one behind a waiting rank is what it waits for. Nothing is decided while no rank waits: ranks busy with
their own work for a long time (an evaluation, a long first step) are never named.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

PHASES = ("idle", "checkpoint", "eval", "sync", "data", "forward", "backward", "optimizer")
# Phases in which a rank may block on its peers: DDP broadcasts buffers at the start of forward and
# all-reduces gradients in backward; under NCCL those are asynchronous and a rank blocks later, at a host
# sync (the fp16 scaler's step, reading the loss); stoker's collectives are "sync". A rank that has been in
# one of these for stall_s looks for the rank behind it.
WAITING = frozenset({"forward", "backward", "optimizer", "sync"})
# Phases that are a collective and nothing else: every rank stuck in the same one means the collective
# hangs. (Forward and optimizer are also compute, which may be slow on every rank at once.)
COLLECTIVE = frozenset({"sync", "backward"})
_ORDER = {name: i for i, name in enumerate(PHASES)}
_KEY = "stoker/heartbeat/{}"


@dataclass(frozen=True)
class Beat:
    """What a rank published: where it is, for how long, and a counter that moves while it answers."""

    rank: int
    step: int
    phase: str
    in_phase_s: float
    seq: int

    @property
    def position(self) -> tuple[int, int]:
        return self.step, _ORDER[self.phase]

    def where(self) -> str:
        return f"{self.phase} of step {self.step} for {self.in_phase_s:.0f} s"


@dataclass(frozen=True)
class Stall:
    """A verdict: ``ranks`` hold the job up (``silent``: they stopped answering); ``message`` says so."""

    ranks: tuple[int, ...]
    silent: bool
    message: str


def diagnose(me: Beat, first: dict[int, Beat], second: dict[int, Beat], stall_s: float) -> Stall | None:
    """The ranks that hold ``me`` up, from two reads of every rank's beat taken a few intervals apart,
    or None when nothing can be blamed yet. ``me`` has waited in a collective for at least ``stall_s``."""
    silent = sorted(r for r, b in second.items() if r in first and first[r].seq == b.seq and r != me.rank)
    missing = sorted(set(first) - set(second))
    if silent or missing:
        gone = silent + missing
        seen = ", ".join(f"rank {r} last seen in {first[r].where()}" for r in gone if r in first)
        return Stall(tuple(gone), True,
                     f"rank(s) {_names(gone)} stopped answering (no heartbeat for several intervals: frozen, "
                     f"swapping or killed){': ' + seen if seen else ''}; rank {me.rank} waits in {me.where()}")
    lowest = min(b.position for b in second.values())
    behind = sorted(r for r, b in second.items() if b.position == lowest)
    if len(behind) == len(second):
        if me.phase not in COLLECTIVE:
            return None
        return Stall(tuple(behind), False,
                     f"every rank has waited in {me.where()}: the collective itself hangs (network, or a "
                     "rank that called a different collective)")
    if me.rank in behind:
        return None  # the waiting rank is itself behind another: that one decides
    details = "; ".join(f"rank {r} in {second[r].where()}" for r in behind)
    waiting = sorted(r for r, b in second.items() if b.phase in WAITING and b.in_phase_s >= stall_s)
    if not waiting:
        return None
    return Stall(tuple(behind), False,
                 f"rank(s) {_names(behind)} made no progress for {stall_s:g} s while rank(s) {_names(waiting)} "
                 f"wait for them in a collective: {details}. If that rank is only slow, raise "
                 "launch(stall_timeout_s=...)")


def _names(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))


class Heartbeat:
    """Publishes this rank's position every ``interval_s`` and calls ``on_stall(stall)`` once when it has
    waited in a collective for ``stall_s`` and a peer can be blamed. ``store`` is a c10d store shared by
    the ranks (the process group's)."""

    def __init__(self, store: Any, rank: int, world_size: int, stall_s: float,
                 on_stall: Callable[[Stall], None], interval_s: float | None = None) -> None:
        self.store, self.rank, self.world_size, self.stall_s = store, rank, world_size, float(stall_s)
        self.on_stall = on_stall
        self.interval_s = interval_s if interval_s is not None else max(0.2, min(5.0, self.stall_s / 10))
        self._step, self._phase, self._since = 0, "idle", time.monotonic()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stoker-heartbeat-{rank}", daemon=True)

    def mark(self, step: int, phase: str) -> None:
        """This rank is now in ``phase`` with ``step`` optimizer steps done (called from the training loop)."""
        if phase != self._phase or step != self._step:
            self._since = time.monotonic()
            self._step, self._phase = step, phase

    def start(self) -> "Heartbeat":
        self._publish()  # before any peer can look for it
        self._thread.start()
        activate(self)
        return self

    def close(self) -> None:
        if _active is self:
            activate(None)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def beat(self) -> Beat:
        return Beat(self.rank, self._step, self._phase, time.monotonic() - self._since, self._seq)

    def _publish(self) -> None:
        self._seq += 1
        b = self.beat()
        self.store.set(_KEY.format(self.rank), json.dumps([b.step, b.phase, b.in_phase_s, b.seq]))

    def _read(self) -> dict[int, Beat]:
        beats = {}
        for r in range(self.world_size):
            key = _KEY.format(r)
            if not self.store.check([key]):  # get() would block until the key appears
                continue
            step, phase, in_phase_s, seq = json.loads(self.store.get(key))
            beats[r] = Beat(r, int(step), str(phase), float(in_phase_s), int(seq))
        return beats

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._publish()
                me = self.beat()
                if me.phase not in WAITING or me.in_phase_s < self.stall_s:
                    continue
                first = self._read()
                if self._stop.wait(3 * self.interval_s):  # long enough for every live peer to beat again
                    return
                self._publish()
                stall = diagnose(self.beat(), first, self._read(), self.stall_s)
                if stall is not None:
                    self.on_stall(stall)
                    return
        except Exception:  # noqa: BLE001 - the store went away (the group is being torn down): stop beating
            return


_active: Heartbeat | None = None  # this process's heartbeat, started by launch for its rank


def activate(beat: Heartbeat | None) -> None:
    """Make ``beat`` the one :func:`mark` reports to (None: none)."""
    global _active
    _active = beat


def mark(step: int, phase: str) -> None:
    """Report this rank's position to its heartbeat, if launch started one (else nothing happens).

    >>> heartbeat.mark(step=12, phase="data")   # the Trainer does this; a loop of one's own may too
    """
    beat = _active
    if beat is not None:
        beat.mark(step, phase)
