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
        spare.give([buf])
    assert spare.held_bytes == 3 << 20 and spare.take(2 << 20) is None
    d = torch.empty(2 << 20, dtype=torch.uint8)
    held = [d]
    spare.give(held)  # a and b make room; the caller's list is emptied (the pool owns the buffer)
    assert held == []
    assert spare.held_bytes == 3 << 20
    assert spare.take(1 << 20) is c and spare.take(1 << 20) is None and spare.take(2 << 20) is d
    spare.give([torch.empty(4 << 20, dtype=torch.uint8)])
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


def test_a_slot_viewed_as_its_ring_closes_is_taken_once_its_view_is_gone(monkeypatch):
    """The batch a loop still holds as its pipeline closes (a volume after another in inference): its slot is
    adopted by the spare pool, given to no ring while the batch is viewed, and taken by the next ring once the
    consumer lets it go (before, its memory went back to the system and the next ring faulted in new pages)."""
    import torch

    from stoker.engine import buffers

    spare = buffers.SpareSlots(64 << 20)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    ring = buffers.SlotRing(1, (4, 1000), torch.float32)
    ptr = ring.slots[0].tensor.data_ptr()
    slot = ring.acquire(lambda: False)
    held = slot.batch(4)
    held.fill_(3)
    ring.release(slot)
    ring.close()
    assert spare.held_bytes == 0  # viewed: not free
    while_held = buffers.SlotRing(1, (4, 1000), torch.float32)
    assert while_held.slots[0].tensor.data_ptr() != ptr and spare.taken == 0
    while_held.slots[0].tensor.fill_(9)
    assert bool((held == 3).all())  # never another ring's
    del held
    after = buffers.SlotRing(1, (4, 1000), torch.float32)
    assert after.slots[0].tensor.data_ptr() == ptr and spare.taken == 1
    _kept_view_is_not_overwritten(after)  # a fresh slot's baseline: a view of it still counts


def test_adopted_slots_wait_within_the_pools_bound(monkeypatch):
    import torch

    from stoker.engine import buffers

    spare = buffers.SpareSlots(3 * 16_000)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    views = []
    for _ in range(5):  # five closed rings, each with its batch still held
        ring = buffers.SlotRing(1, (4, 1000), torch.float32)
        slot = ring.acquire(lambda: False)
        views.append(slot.batch(4))
        ring.release(slot)
        ring.close()
    assert len(spare._waiting) == 3 and spare._waiting_bytes == 48_000  # the oldest two let go
    del views
    assert spare.take(16_000) is not None and spare.held_bytes == 32_000 and spare._waiting == []


def _kept_view_is_not_overwritten(ring) -> None:
    """A consumer keeps a view of a released batch: its slot must not be acquired (and overwritten) again."""
    slot = ring.acquire(lambda: False, timeout=1)
    assert slot is not None
    view = slot.batch(slot.rows)
    view.fill_(7)
    ring.release(slot)
    again = ring.acquire(lambda: False, timeout=0)
    if again is not None:
        again.tensor.fill_(1)  # the next batch written into the slot
    assert again is None, "slot handed out while a view of it is alive"
    assert bool((view == 7).all()), "the kept batch was overwritten"
    assert ring.held() == 1  # counted as the consumer's
    del view
    assert ring.held() == 0 and ring.acquire(lambda: False, timeout=1) is slot, "a slot no view holds is never free"
    ring.release(slot)


def test_a_ring_made_while_another_closes_counts_its_slots_views(monkeypatch):
    """Deterministic: the closing thread stops right after SPARE_SLOTS.give (a GIL switch point there) while
    a ring is made on this thread from the slot it gave: the new ring's slot must not count the closer's
    leftover reference as its own (a baseline of 2, where one live view of a batch then reads as none)."""
    import threading

    import torch

    from stoker.engine import buffers

    go, made = threading.Event(), threading.Event()

    class Preempted(buffers.SpareSlots):
        def give(self, held):
            super().give(held)
            go.set()
            made.wait(5)  # the other thread runs here

    monkeypatch.setattr(buffers, "SPARE_SLOTS", Preempted(64 << 20))
    first = buffers.SlotRing(1, (4, 4096), torch.float32)
    closer = threading.Thread(target=first.close)
    closer.start()
    assert go.wait(5)
    ring = buffers.SlotRing(1, (4, 4096), torch.float32)
    assert buffers.SPARE_SLOTS.taken == 1  # the ring's slot is the closed one's memory
    _kept_view_is_not_overwritten(ring)  # while the closer is still inside the hand-over
    made.set()
    closer.join(5)
    _kept_view_is_not_overwritten(ring)  # and after it


def test_rings_made_and_closed_on_two_threads_keep_a_fresh_slots_baseline(monkeypatch):
    """Not forced: one thread closes rings while another makes them (two pipelines: a CropDataset per rank
    thread, an inference pipeline closing while a training one starts); every slot made has a fresh slot's
    baseline, and a kept batch is never overwritten."""
    import threading
    import time

    import torch

    from stoker.engine import buffers

    monkeypatch.setattr(buffers, "SPARE_SLOTS", buffers.SpareSlots(64 << 20))
    stop = time.monotonic() + 3
    bad: list = []

    def closer():
        while time.monotonic() < stop and not bad:
            buffers.SlotRing(4, (4, 4096), torch.float32).close()

    t = threading.Thread(target=closer)
    t.start()
    made = 0
    try:
        while time.monotonic() < stop and not bad:
            r = buffers.SlotRing(1, (4, 4096), torch.float32)
            made += 1
            slot = r.acquire(lambda: False, timeout=1)
            view = slot.batch(slot.rows)  # a batch the consumer keeps past its release
            r.release(slot)
            if r.acquire(lambda: False, timeout=0) is not None:  # handed out again: it would be overwritten
                bad.append("reused while viewed")
            del view
            if r.acquire(lambda: False, timeout=1) is not slot:  # its view gone: free again
                bad.append("never free again")
            else:
                r.release(slot)
            r.close()
    finally:
        t.join(30)
    assert not bad, bad[:3]
    assert buffers.SPARE_SLOTS.taken > 0 and made > 0  # the rings did hand slots over
    _kept_view_is_not_overwritten(buffers.SlotRing(1, (4, 4096), torch.float32))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_pool_is_locked_can_make_a_ring():
    """A process forked while another thread is inside SPARE_SLOTS (a pipeline closing or preparing on its
    coordinator thread) must not inherit the pool's lock held: its first SlotRing would wait for ever."""
    import torch

    from stoker.engine import buffers

    from forking import fork_child, held_by_another_thread, verdict

    buffers.SPARE_SLOTS.give([torch.empty(4 * 1024 * 4, dtype=torch.uint8)])  # something for the child to take

    def child() -> bool:  # a pipeline made here asks the pool for its slots
        taken = buffers.SPARE_SLOTS.taken  # counted in the parent before the fork (earlier pipelines)
        buffers.SlotRing(2, (4, 1024), torch.float32)
        return buffers.SPARE_SLOTS.taken == taken  # the parent's buffers are not the child's

    with held_by_another_thread(buffers.SPARE_SLOTS._lock):  # a thread inside SpareSlots.give/take at the fork
        pid = fork_child(child)
    # "hung": the child waited on SPARE_SLOTS._lock, inherited held, making its SlotRing
    assert verdict(pid) == "exit 0"
    buffers.SPARE_SLOTS.clear()
