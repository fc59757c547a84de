"""Ctrl-C inside ``Pipeline.pop`` for the tests (tests/engine/test_lifecycle.py, tests/engine/test_fields.py):
:class:`Interrupter`, a profile function raising KeyboardInterrupt at one point of a pop, and
:func:`pop_through_interrupts`, which cuts every pop at each of its points in turn."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any, Callable

import stoker
from stoker.engine.executor import Job
from stoker.engine.pipeline.facade import Pipeline

STOKER = str(Path(stoker.__file__).parent)


def _ours(frame) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(STOKER)


class Interrupter:
    """A profile function that raises KeyboardInterrupt at the ``at``-th point of a ``pop`` on this thread.

    A signal's handler runs in the consumer's thread where CPython checks for one: entering a function, and
    after a call returns to its caller. The profile's events mark those points: "call" (entering stoker's
    code), "c_return" and "return" (back in stoker's code from a call; not from an ``__enter__``, which the
    ``with`` statement calls without a check after it). Each is taken in turn. Points in CPython's own
    threading code are left out (an interrupt inside ``Condition.__enter__`` after it took the lock leaks
    the lock, whoever calls it), and so are those inside :meth:`Job.wait`, whose interrupted settle has its
    own handling (tests/engine/test_native_engine.py)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return"):
            point = _ours(frame)
        elif event == "return":
            point = _ours(frame.f_back) and frame.f_code.co_name != "__enter__"
        else:
            point = False
        if not point:
            return
        f, in_pop = frame, False
        while f is not None:
            if f.f_code is Job.wait.__code__:
                return
            if f.f_code is Pipeline.pop.__code__:
                in_pop = True
                break
            f = f.f_back
        if not in_pop:
            return
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


def pop_through_interrupts(p: Pipeline, samples: list, batch_size: int,
                           keep: Callable[[Any], Any]) -> tuple[list, int]:
    """Push ``samples`` (one rank) into ``p`` and pop their batches, each pop interrupted at its first point,
    then its second, ... until one goes through; after every pop ``state_dict`` counts exactly the batches
    received. ``keep(batch)`` (called inside ``with batch``) says what to keep of each; returns what was
    kept, in order, and how many pops were interrupted."""
    n_batches = len(samples) // batch_size
    expected = [iter(stoker.SampleList(samples).for_rank(0, 1)).state_after(batch_size * k)
                for k in range(n_batches + 1)]
    p.push(stoker.SampleList(samples).for_rank(0, 1))
    gc.collect()  # none of these is finalised inside a pop, where the profile function would interrupt it
    received: list = []
    interrupts, at = 0, 1
    while len(received) < n_batches:
        assert interrupts < 5000, "pop never got through"
        sys.setprofile(Interrupter(at))
        try:
            batch = p.pop()
        except KeyboardInterrupt:
            interrupts += 1
            at += 1
            batch = None
        finally:
            sys.setprofile(None)
        if batch is not None:
            with batch:
                received.append(keep(batch))
            at = 1
        state = p.state_dict()
        assert state["batches"] == len(received)
        assert state["sources"][0] == expected[len(received)]
    return received, interrupts
