"""What a pipeline keeps of the batches its consumer received: counts, and per resumable source (a
``RankShare``) the samples taken from it, for ``state_dict``. A training loop that pushes every step's
samples makes a source per push: the record per pop must not grow with them (it was copied whole at every
pop, and kept every push's count for good)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker

pytestmark = pytest.mark.timeout(120)

DATA = np.arange(24 * 40, dtype="u2").reshape(24, 40)


@pytest.fixture
def uri(tmp_path):
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=DATA.shape, chunks=(8, 8), dtype=DATA.dtype, fill_value=0)
    z[:] = DATA
    return str(tmp_path / "a.zarr")


def _cfg() -> stoker.Config:
    return stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, host_buffer_bytes=4 << 20)


def test_a_push_per_step_keeps_no_count_per_push(uri):
    steps = 400
    with stoker.Pipeline(_cfg()) as p:
        for step in range(steps):
            row = step % 20
            p.push([stoker.Sample(uri, [(row, row + 2), (0, 4)]), stoker.Sample(uri, [(row, row + 2), (4, 8)])])
            with p.pop(timeout=30) as batch:
                got = torch.from_dlpack(batch)
                assert got[1].numpy().tolist() == DATA[row:row + 2, 4:8].tolist()
        received = p._intake.received
        assert (received.batches, received.samples) == (steps, 2 * steps)
        assert received.per_source == {}, f"{len(received.per_source)} pushes counted one by one"
        assert p.pending == 0 and p.state_dict() == {"sources": [], "batches": steps}


def test_a_resumable_source_between_plain_pushes_keeps_its_position(uri):
    share = stoker.SampleList([stoker.Sample(uri, [(r, r + 2), (0, 4)]) for r in range(10)]).for_rank(0, 1)
    with stoker.Pipeline(_cfg()) as p:
        for step in range(3):  # plain pushes before it: not counted per push
            p.push([stoker.Sample(uri, [(step, step + 2), (8, 12)])] * 2)
            torch.from_dlpack(p.pop(timeout=30)).clone()
        p.push(share)
        taken = [torch.from_dlpack(p.pop(timeout=30)).clone() for _ in range(3)]
        state = p.state_dict()
        assert list(p._intake.received.per_source.values()) == [6]
    assert state["batches"] == 6 and state["sources"][0]["position"] == 6
    assert taken[2][1].numpy().tolist() == DATA[5:7, 0:4].tolist()
    resumed = stoker.SampleList([stoker.Sample(uri, [(r, r + 2), (0, 4)]) for r in range(10)]).for_rank(0, 1)
    resumed.load_state_dict(state["sources"][0])
    assert [s.aabb[0][0] for s in resumed] == [6, 7, 8, 9]
