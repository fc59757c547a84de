"""Batch buffers: pinned memory as torch rounds it."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.timeout(60)


def test_pinned_footprint_is_torchs_power_of_two_rounding():
    from stoker.engine.buffers import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    assert pinned_footprint(40 << 20) == 64 << 20 and pinned_footprint(64 << 20) == 64 << 20



def test_spare_slots_hand_back_by_size_within_their_bound():
    """The pool of closed rings' host slots: a buffer of the size asked, the newest first; never more than
    max_bytes held (the oldest dropped to make room, one larger than the bound not kept)."""
    import torch

    from stoker.engine.buffers import SpareSlots

    spare = SpareSlots(max_bytes=3 << 20)
    a, b, c = (torch.empty(1 << 20, dtype=torch.uint8) for _ in range(3))
    for buf in (a, b, c):
        spare.give(buf)
    assert spare.held_bytes == 3 << 20 and spare.take(2 << 20) is None
    d = torch.empty(2 << 20, dtype=torch.uint8)
    spare.give(d)  # a and b make room
    assert spare.held_bytes == 3 << 20
    assert spare.take(1 << 20) is c and spare.take(1 << 20) is None and spare.take(2 << 20) is d
    spare.give(torch.empty(4 << 20, dtype=torch.uint8))
    assert spare.held_bytes == 0 and spare.taken == 2


def test_a_closed_ring_hands_its_free_slots_to_the_next(monkeypatch):
    """SlotRing.close gives the slots no tensor views to the spare pool, and the next ring of that size takes
    them (the same memory, as a tensor of its own, not a view: a view of it still keeps it from reuse); a slot
    still viewed or taken stays out; a ring not in plain host memory keeps its slots."""
    import torch

    from stoker.engine import buffers

    spare = buffers.SpareSlots(64 << 20)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    ring = buffers.SlotRing(3, (4, 1000), torch.float32)
    ptrs = [s.tensor.data_ptr() for s in ring.slots]
    viewed = ring.slots[0].batch(4)
    viewed.fill_(5)
    assert ring.acquire(lambda: False) is ring.slots[1]  # taken: its batch is being made
    ring.close()
    assert ring.slots == [] and ring.nbytes == 48_000 and spare.held_bytes == 16_000
    again = buffers.SlotRing(3, (8, 500), torch.int32)  # the same bytes, another shape and dtype
    assert [s.tensor.data_ptr() for s in again.slots].count(ptrs[2]) == 1 and spare.taken == 1
    reused = next(s for s in again.slots if s.tensor.data_ptr() == ptrs[2])
    assert reused.tensor.shape == (8, 500) and reused.tensor.dtype == torch.int32 and reused.tensor._base is None
    view = reused.batch(8)  # a consumer's batch of it, released but held
    got = [again.acquire(lambda: False, timeout=0) for _ in range(3)]
    assert reused not in got and got[2] is None
    del view
    assert again.acquire(lambda: False, timeout=0) is reused
    assert bool((viewed == 5).all())  # the viewed slot of the closed ring went to no one
    meta = buffers.SlotRing(1, (4, 1000), torch.float32, device="meta")
    meta.close()
    assert len(meta.slots) == 1 and spare.held_bytes == 0
