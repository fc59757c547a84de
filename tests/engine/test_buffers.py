"""Batch buffers: pinned memory as torch rounds it."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.timeout(60)


def test_pinned_footprint_is_torchs_power_of_two_rounding():
    from stoker.engine.buffers import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    assert pinned_footprint(40 << 20) == 64 << 20 and pinned_footprint(64 << 20) == 64 << 20


def test_a_slot_held_by_garbage_alone_is_collected_and_reused():
    # a view kept by a reference cycle (an exception kept with its traceback, say) is freed only by Python's
    # collector, which a process that only waits does not run: acquire runs it after a while
    import gc

    import torch

    from stoker.engine.buffers import SlotRing

    ring = SlotRing(1, (4, 8), torch.float32)
    slot = ring.acquire(lambda: False, timeout=1.0)

    class Holder:
        pass

    held = Holder()
    held.me, held.view = held, slot.tensor[:2]  # a cycle holding a view of the slot
    del held
    ring.release(slot)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        assert ring.acquire(lambda: False, timeout=0.05) is None  # viewed: not free, and no collection yet
        assert ring.acquire(lambda: False, timeout=10.0) is slot  # collected within the wait
    finally:
        if was_enabled:
            gc.enable()


def test_a_slot_a_consumer_really_holds_stays_held():
    import torch

    from stoker.engine.buffers import SlotRing

    ring = SlotRing(1, (4, 8), torch.float32)
    slot = ring.acquire(lambda: False, timeout=1.0)
    kept = slot.tensor[:1]
    ring.release(slot)
    assert ring.acquire(lambda: False, timeout=0.6) is None  # collections (0.25 s on) do not free a live view
    del kept
    assert ring.acquire(lambda: False, timeout=1.0) is slot
