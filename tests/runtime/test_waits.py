"""wait_until: returns once its predicate holds (woken by a notify), raises the caller's error, made only then,
once the deadline passed."""

from __future__ import annotations

import threading
import time

import pytest

from stoker.runtime.waits import wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_notified_wait_returns_once_ready_and_never_makes_the_error():
    cv, items, made = threading.Condition(), [1, 2, 3], []

    def take() -> None:
        while True:
            with cv:
                if not items:
                    return
                items.pop()
                cv.notify_all()

    def timed_out() -> TimeoutError:
        made.append(1)
        return TimeoutError("never")

    worker = threading.Thread(target=take)
    with cv:
        worker.start()
        wait_until(cv, lambda: not items, time.monotonic() + 20.0, timed_out)
        assert items == []
    worker.join(10)
    assert made == []


def test_a_deadline_passed_raises_the_callers_error_read_under_the_lock():
    cv, queued, looked = threading.Condition(), ["a", "b"], []

    def ready() -> bool:
        looked.append(1)
        return not queued

    with cv, pytest.raises(TimeoutError, match="2 still queued"):
        wait_until(cv, ready, time.monotonic() - 1.0, lambda: TimeoutError(f"{len(queued)} still queued"))
    assert looked == [1]  # a deadline already passed: looked once, not waited on
    with cv:
        queued.clear()
        wait_until(cv, ready, time.monotonic() - 1.0, lambda: TimeoutError("ready, so never raised"))


def test_a_wait_without_a_notify_raises_once_its_deadline_passed_and_not_before():
    cv, made = threading.Condition(), []

    def timed_out() -> TimeoutError:
        made.append(time.monotonic())
        return TimeoutError("nothing came")

    start = time.monotonic()
    with cv, pytest.raises(TimeoutError, match="nothing came"):
        wait_until(cv, lambda: False, start + 0.3, timed_out)
    assert len(made) == 1 and made[0] >= start + 0.3  # never before the deadline (no upper bound: a loaded machine)
