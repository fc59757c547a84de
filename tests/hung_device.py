"""A device that hangs, on the host: the streams stand-in whose events stop being done once told to, and the
one warning a close on it gives (tests/gpu/test_device_waits.py, tests/gpu/test_gpu_streams.py)."""

from __future__ import annotations

import warnings

from stoker.engine.gpu.streams import HostStreams


class Hung(HostStreams):
    """The host stand-in with events: each done once recorded, until :meth:`hang`; from then on none is ever
    done (a hung device). A wait without a limit (``synchronize``) would never return: it fails instead.
    ``recorded``: the events made so far."""

    def __init__(self) -> None:
        self.hung = False
        self.recorded: list[HungEvent] = []

    def hang(self) -> None:
        self.hung = True

    def record(self, stream):
        self.recorded.append(HungEvent(self))
        return self.recorded[-1]


class HungEvent:
    """An event of :class:`Hung`; ``queries``: how often it was asked whether it is done."""

    def __init__(self, owner: Hung) -> None:
        self.owner = owner
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return not self.owner.hung

    def synchronize(self) -> None:
        raise AssertionError("a wait for the device without a limit")


def the_stuck_warning(*closes) -> str:
    """Calls each of ``closes`` in turn, recording every warning; asserts that exactly one is the RuntimeWarning
    of streams that did not finish, and returns its message."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for close in closes:
            close()
    stuck = [w for w in caught if issubclass(w.category, RuntimeWarning) and "did not finish" in str(w.message)]
    assert len(stuck) == 1, [str(w.message) for w in caught]
    return str(stuck[0].message)
