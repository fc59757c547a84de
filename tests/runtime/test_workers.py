"""DaemonPool at shutdown: queued tasks dropped, or drained (run) when the owner asks, and never new ones."""

from __future__ import annotations

import threading

import pytest

from stoker.errors import ShutdownError
from stoker.runtime.workers import DaemonPool

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("drain", [False, True])
def test_queued_tasks_are_dropped_or_drained_at_shutdown(drain):
    # A decoder's queued task may be the only one to account for a batch's chunks (a fetch handed over just
    # before close): drained, it runs and ends them; dropped, the batch was never finished.
    pool = DaemonPool(1, "t")
    started, release = threading.Event(), threading.Event()
    ran, done = [], threading.Event()
    pool.submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(5)
    for i in range(3):
        pool.submit(lambda i=i: (ran.append(i), i == 2 and done.set()))
    pool.shutdown(drain=drain)
    with pytest.raises(ShutdownError):
        pool.submit(print)
    release.set()
    if drain:
        assert done.wait(5) and ran == [0, 1, 2]
    else:
        pool.threads[0].join(5)
        assert ran == []
    pool.threads[0].join(5)
    assert not pool.threads[0].is_alive()  # the thread leaves once nothing is left
