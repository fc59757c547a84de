"""The heartbeat names the rank that holds a job up: one left behind, or one that stopped answering."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import stoker.train as st
from stoker.errors import InvalidArgument, RankFailed
from stoker.train.heartbeat import Beat, Heartbeat, diagnose

import train_jobs as jobs

pytestmark = pytest.mark.timeout(120)


def _beats(*rows):
    return {r: Beat(r, step, phase, t, seq) for r, step, phase, t, seq in rows}


def test_a_rank_behind_a_waiting_rank_is_named():
    first = _beats((0, 2, "backward", 9, 1), (1, 2, "data", 9, 1), (2, 2, "backward", 9, 1))
    second = _beats((0, 2, "backward", 12, 4), (1, 2, "data", 12, 4), (2, 2, "backward", 12, 4))
    stall = diagnose(second[0], first, second, stall_s=5)
    assert stall.ranks == (1,) and not stall.silent
    assert "rank 1 in data of step 2" in stall.message and "rank(s) 0, 2 wait" in stall.message


def test_a_rank_that_stops_beating_is_named_silent():
    first = _beats((0, 2, "sync", 9, 1), (1, 3, "data", 1, 7))
    second = _beats((0, 2, "sync", 12, 4), (1, 3, "data", 1, 7))  # rank 1's counter did not move
    stall = diagnose(second[0], first, second, stall_s=5)
    assert stall.ranks == (1,) and stall.silent and "stopped answering" in stall.message


def test_nothing_is_decided_when_the_waiting_rank_is_itself_behind_or_nobody_waits():
    first = _beats((0, 2, "sync", 9, 1), (1, 2, "data", 9, 1))
    second = _beats((0, 2, "sync", 12, 4), (1, 2, "data", 12, 4))
    assert diagnose(second[0], first, second, stall_s=5) is None  # rank 1 is ahead: rank 0 holds it up
    idle = _beats((0, 5, "idle", 900, 1), (1, 5, "idle", 900, 1))
    assert diagnose(idle[0], idle, _beats((0, 5, "idle", 903, 2), (1, 5, "idle", 903, 2)), 5) is None


def test_every_rank_stuck_in_one_collective_is_reported():
    first = _beats((0, 4, "sync", 9, 1), (1, 4, "sync", 9, 1))
    second = _beats((0, 4, "sync", 12, 4), (1, 4, "sync", 12, 4))
    stall = diagnose(second[0], first, second, stall_s=5)
    assert stall.ranks == (0, 1) and "collective itself hangs" in stall.message


def test_heartbeats_over_a_real_store_name_a_frozen_peer(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    verdicts = []
    got = threading.Event()
    waiting = Heartbeat(store, 0, 2, stall_s=0.5, on_stall=lambda s: (verdicts.append(s), got.set()),
                        interval_s=0.1)
    frozen = Heartbeat(store, 1, 2, stall_s=0.5, on_stall=verdicts.append, interval_s=0.1)
    frozen.mark(3, "data")
    frozen.start()
    waiting.start()
    waiting.mark(3, "backward")
    time.sleep(0.3)
    frozen.close()  # its beats stop, as a process stopped by SIGSTOP or swapping out would
    assert got.wait(10)
    waiting.close()
    assert verdicts[0].ranks == (1,) and verdicts[0].silent
    assert "last seen in data of step 3" in verdicts[0].message


def test_a_hung_rank_is_named_in_time_and_not_the_rank_waiting_for_it():
    """Rank 1 hangs fetching a batch; rank 0 waits in the gradient all-reduce. Without the heartbeat the
    job would sit for timeout_s (600 s) and then report rank 0's collective timeout."""
    with pytest.raises(RankFailed) as info:
        st.launch(jobs.rank1_hangs_in_data, nprocs=2, use_cuda=False, stall_timeout_s=3)
    assert info.value.rank == 1 and info.value.stalled == [1]
    assert "data of step 2" in str(info.value) and "rank(s) 0 wait" in str(info.value)


def test_stall_timeout_is_checked_against_the_collective_timeout():
    with pytest.raises(InvalidArgument, match="below timeout_s"):
        st.launch(jobs.describe, nprocs=2, use_cuda=False, timeout_s=60, stall_timeout_s=60)
    with pytest.raises(InvalidArgument, match="stall_timeout_s"):
        st.launch(jobs.describe, nprocs=2, use_cuda=False, stall_timeout_s=-1)


def test_a_rank_hung_in_a_local_micro_step_is_named_not_the_collective():
    """With accumulation, the backward of a no_sync micro-step is local compute (marked forward): a rank
    stuck there is behind a rank waiting in the last micro-step's all-reduce (it was 'every rank waits')."""
    first = _beats((0, 7, "forward", 300, 1), (1, 7, "backward", 300, 1))
    second = _beats((0, 7, "forward", 303, 4), (1, 7, "backward", 303, 4))
    stall = diagnose(second[1], first, second, stall_s=5)
    assert stall.ranks == (0,) and "rank 0 in forward of step 7" in stall.message


def test_under_nccl_a_rank_waiting_at_a_host_sync_names_the_rank_behind():
    """NCCL's collectives return at once; the waiting rank blocks at the next host sync (the loss, marked
    sync; the fp16 scaler's step, in optimizer). Both are waiting phases."""
    first = _beats((0, 3, "data", 300, 1), (1, 4, "sync", 300, 1))
    second = _beats((0, 3, "data", 303, 4), (1, 4, "sync", 303, 4))
    assert diagnose(second[1], first, second, stall_s=5).ranks == (0,)
    first = _beats((0, 3, "data", 300, 1), (1, 3, "optimizer", 300, 1))
    second = _beats((0, 3, "data", 303, 4), (1, 3, "optimizer", 303, 4))
    assert diagnose(second[1], first, second, stall_s=5).ranks == (0,)


def test_every_rank_slow_in_forward_is_not_a_hang():
    both = _beats((0, 3, "forward", 900, 1), (1, 3, "forward", 900, 1))
    assert diagnose(both[0], both, _beats((0, 3, "forward", 903, 2), (1, 3, "forward", 903, 2)), 5) is None
