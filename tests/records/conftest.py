"""Checks every records test gets: it leaves no Loader's reader thread running."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(autouse=True)
def _loaders_closed():
    """A Loader's reader threads (``stoker-records-*``) started in a test end with it: a test that drops an
    iteration half read (``next(iter(Loader(...)))``) leaves them to end in the background, while the next test
    on the same xdist worker counts its own threads; close the Loader (``with Loader(...) as loader:``)."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate()
            if t not in before and t.name.startswith("stoker-records-") and t.is_alive()]
    assert not left, f"Loader reader threads still running after the test: {left}; close its Loader"
