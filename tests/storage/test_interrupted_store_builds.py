"""A store's build cut short by Ctrl-C (KeyboardInterrupt) anywhere in ``Stores._build``: the build in flight
it put up is always settled, so the next open of that store builds at once rather than waiting
``BUILD_WAIT_S`` for a build that will never end."""

from __future__ import annotations

import sys
import threading
import zipfile
from pathlib import Path

import pytest

import stoker
from stoker.storage import locate as locate_module
from stoker.storage.locate import Stores, locate

STOKER = str(Path(stoker.__file__).parent)
#: BUILD_WAIT_S here: what a next open waits for a build left unsettled, longer than the test waits for it (an
#: open that waited is seen not done, not timed: a loaded machine may take seconds for one that did not)
WAIT_S = 600.0


class InterruptBuild:
    """A profile function raising KeyboardInterrupt at the ``at``-th point of ``Stores._build`` (and of the
    stoker code it calls: the store's factory included) on this thread: the points where CPython runs a
    signal's handler, entering a function and back from a call (not from a ``with`` statement's
    ``__enter__``, which it calls without a check after it), as tests/interrupts.py's Interrupter."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return"):
            here = frame
        elif event == "return" and frame.f_code.co_name != "__enter__":
            here = frame.f_back
        else:
            return
        if here is None or not here.f_code.co_filename.startswith(STOKER):
            return
        f = here
        while f is not None and f.f_code is not Stores._build.__code__:
            f = f.f_back
        if f is None:
            return
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


def _archive(tmp_path) -> str:
    path = tmp_path / "d.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("g.zarr/zarr.json", '{"zarr_format": 3, "node_type": "group"}')
    return str(path / "g.zarr")


@pytest.mark.timeout(120)
def test_a_build_interrupted_anywhere_leaves_the_next_build_waiting_for_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(locate_module, "BUILD_WAIT_S", WAIT_S)
    loc = locate(_archive(tmp_path))
    interrupted = 0
    for at in range(1, 2000):
        stores = Stores()
        try:
            sys.setprofile(InterruptBuild(at))
            try:
                stores.get(loc)
                through = True
            except KeyboardInterrupt:
                through = False
            finally:
                sys.setprofile(None)
            if through:
                break
            interrupted += 1
            # the next open, on another thread, as a pipeline's opener threads do: built at once
            got: list = []
            opener = threading.Thread(target=lambda: got.append(stores.get(loc)[0]), daemon=True)
            opener.start()
            opener.join(30)
            assert not opener.is_alive(), f"interrupted at point {at}: the next build waits for BUILD_WAIT_S"
            assert got and got[0].path == loc.root
            assert stores.get(loc)[0] is got[0]  # kept: one store of the archive
        finally:
            stores.close()
    else:
        pytest.fail("no build got through")
    assert interrupted > 10  # the sweep went through the build (the factory's points among them)
