"""TileWriter keeps its ranks in step when a call fails on one of them: a sample box past the array, a
background write that failed, a write that fails in close(). Every rank raises a typed error for that call
(the failing rank its own, the others one naming that rank) at once, instead of waiting in a collective the
failing rank skipped until the process group's timeout. The groups here time out after GROUP_TIMEOUT_S, and
each call must end well before that, so a regression fails fast rather than hanging."""

from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.errors import InvalidArgument, StorageError

pytestmark = pytest.mark.timeout(180)

SHAPE, TILE, CHUNKS = (44, 60, 58), (24, 24, 24), (16, 16, 16)
GROUP_TIMEOUT_S = 20
PROMPT_S = 10  # a call that waited this long waited on the group's timeout, not on the other rank


def _pred(n: int = 1, tile: tuple[int, ...] = TILE) -> np.ndarray:
    return np.ones((n,) + tile, np.float32)


@pytest.fixture
def uri(tmp_path):
    path = str(tmp_path / "in.zarr")
    zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="f4")
    return path


@pytest.mark.parametrize("box", [[(30, 54), (0, 24), (0, 24)], [(0, 24), (0, 24), (40, 64)]])
def test_a_box_past_the_array_is_a_typed_refusal(uri, tmp_path, box):
    """Without pad, a box reaching past the array's end has no region there: refused (InvalidArgument naming
    the sample and pad=), not a bare ValueError from the region indexing; the refusal changes nothing. (A box
    before the array's start is refused by Sample itself.)"""
    out = str(tmp_path / "o.zarr")
    writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", write_threads=0)
    with pytest.raises(InvalidArgument, match="reaches past the array.*pad="):
        writer.write([stoker.Sample(uri, box)], _pred())
    writer.write([stoker.Sample(uri, [(0, 24), (0, 24), (0, 24)])], _pred())
    writer.close()
    assert zarr.open_array(out, mode="r")[0, 0, 0] == 1


def test_a_refused_first_batch_leaves_the_writer_usable(uri, tmp_path):
    """Without grid= the tiles' ndim comes from the first batch taken: a refused first batch (2-d tiles for a
    3-d array) does not fix it, so the good 3-d batches after it are taken."""
    out = str(tmp_path / "o.zarr")
    writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", write_threads=0)
    with pytest.raises(InvalidArgument):
        writer.write([stoker.Sample(uri, [(0, 24), (0, 24)])], _pred(tile=(24, 24)))
    writer.write([stoker.Sample(uri, [(0, 24), (0, 24), (0, 24)])], _pred())
    writer.close()
    assert zarr.open_array(out, mode="r")[0, 0, 0] == 1


def _group(rank: int, world: int, init: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return dist


def _timed(call) -> str:
    t0 = time.monotonic()
    try:
        call()
        what = "ok"
    except Exception as exc:  # noqa: BLE001 - the error's type and text are what the test checks
        what = f"{type(exc).__name__}|{str(exc)[:400]}"
    return f"{time.monotonic() - t0:.1f}|{what}"


def _rank_past(rank, world, init, uri, out, result):
    dist = _group(rank, world, init)
    try:
        writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", write_threads=0, rank=rank,
                                   world_size=world)
        good = stoker.Sample(uri, [(0, 24), (0, 24), (0, 24)])
        bad = stoker.Sample(uri, [(30, 54), (0, 24), (0, 24)])
        log = [_timed(lambda: writer.write([bad] if rank == 0 else [good], _pred()))]
        log.append(_timed(lambda: writer.write([good], _pred())))  # the ranks go on, in step
        log.append(_timed(writer.close))
        with open(f"{result}-{rank}", "w") as f:
            f.write("\n".join(log))
    finally:
        dist.destroy_process_group()


def test_a_box_past_the_array_on_one_rank_is_refused_on_every_rank(uri, tmp_path):
    result = str(tmp_path / "r")
    torch.multiprocessing.spawn(_rank_past, args=(2, str(tmp_path / "init"), uri, str(tmp_path / "two.zarr"),
                                                  result), nprocs=2, join=True)
    for r in range(2):
        first, then, close = (line.split("|") for line in open(f"{result}-{r}").read().splitlines())
        assert first[1] == InvalidArgument.__name__ and float(first[0]) < PROMPT_S, (r, first)
        assert ("reaches past the array" if r == 0 else "rank 0 refused") in first[2], (r, first)
        assert then[1:] == ["ok"] and close[1:] == ["ok"], (r, then, close)
    assert zarr.open_array(str(tmp_path / "two.zarr"), mode="r")[0, 0, 0] == 1


def _settled(writer) -> None:
    deadline = time.monotonic() + PROMPT_S
    while writer._background.in_flight_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


def _rank_background(rank, world, init, uri, out, result):
    dist = _group(rank, world, init)
    try:
        grid = stoker.TileGrid([uri], TILE, stride=TILE)  # with grid=, a region is written once its tiles came
        writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="none", write_threads=1, rank=rank,
                                   world_size=world, grid=grid)
        if rank == 0:  # region (0, 0, 0) is rank 0's: its chunk's path is a folder, so its write fails
            os.makedirs(os.path.join(out, "c", "0", "0", "0"), exist_ok=True)
        dist.barrier()
        log = []
        for i in range(len(grid)):
            _settled(writer)  # the failed write recorded before the next write() checks it
            log.append(_timed(lambda: writer.write([grid.sample(0, i)], _pred())))
            if not log[-1].endswith("|ok"):
                break
        log.append(_timed(writer.close))  # the failure again on rank 0; no collective on either
        with open(f"{result}-{rank}", "w") as f:
            f.write("\n".join(log))
    finally:
        dist.destroy_process_group()


def test_a_failed_background_write_on_one_rank_fails_the_next_write_on_every_rank(uri, tmp_path):
    result = str(tmp_path / "r")
    torch.multiprocessing.spawn(_rank_background, args=(2, str(tmp_path / "init"), uri, str(tmp_path / "two.zarr"),
                                                        result), nprocs=2, join=True)
    logs = [open(f"{result}-{r}").read().splitlines() for r in range(2)]
    assert len(logs[0]) == len(logs[1]) == 3, logs  # the first write goes, the second fails on both ranks
    for r, log in enumerate(logs):
        assert log[0].endswith("|ok"), (r, log)
        took, kind, why = log[1].split("|", 2)
        assert kind == StorageError.__name__ and float(took) < PROMPT_S, (r, log)
        assert ("region (0, 0, 0)" if r == 0 else "rank 0 failed") in why, (r, log)


def _rank_closing(rank, world, init, uri, out, result):
    dist = _group(rank, world, init)
    try:
        writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", write_threads=1, rank=rank,
                                   world_size=world)
        if rank == 0:  # without grid=, regions are written in close(): rank 0's region (0, 0, 0) fails there
            os.makedirs(os.path.join(out, "c", "0", "0", "0"), exist_ok=True)
        dist.barrier()
        log = [_timed(lambda: writer.write([stoker.Sample(uri, [(0, 24), (0, 24), (0, 24)])], _pred()))]
        log.append(_timed(writer.close))
        with open(f"{result}-{rank}", "w") as f:
            f.write("\n".join(log))
    finally:
        dist.destroy_process_group()


def test_a_write_failing_in_close_on_one_rank_fails_close_on_every_rank(uri, tmp_path):
    """close() ended in a barrier the failing rank never reached: the other rank waited there for the
    group's timeout. Now each rank tells the others how its close went, and all raise."""
    result = str(tmp_path / "r")
    torch.multiprocessing.spawn(_rank_closing, args=(2, str(tmp_path / "init"), uri, str(tmp_path / "two.zarr"),
                                                     result), nprocs=2, join=True)
    for r in range(2):
        write, close = open(f"{result}-{r}").read().splitlines()
        assert write.endswith("|ok"), (r, write)
        took, kind, why = close.split("|", 2)
        assert kind == StorageError.__name__ and float(took) < PROMPT_S, (r, close)
        assert ("region (0, 0, 0)" if r == 0 else "rank 0 failed") in why, (r, close)


def _rank_opening(rank, world, init, out, result):
    dist = _group(rank, world, init)
    try:
        log = _timed(lambda: stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="none", write_threads=0))
        with open(f"{result}-{rank}", "w") as f:
            f.write(log)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["store", "settings"])
def test_a_writer_rank_0_cannot_open_fails_on_every_rank_at_once(uri, tmp_path, case):
    """Rank 0 makes the array (and checks the record's settings) before a barrier: failing there, it raised and
    the other ranks waited in the barrier for the group's timeout (for ever while rank 0 lived on). Now rank 0
    tells them how it went, and all raise its error."""
    if case == "store":  # the output's folder is a file: making the array's metadata fails
        open(tmp_path / "file", "w").close()
        out, kind, own = str(tmp_path / "file" / "two.zarr"), StorageError, "writing the array's metadata"
    else:  # a record of a writer with another blend: refused
        out, kind, own = str(tmp_path / "two.zarr"), InvalidArgument, "blend"
        with stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", write_threads=0) as w:
            w.write([stoker.Sample(uri, [(0, 24), (0, 24), (0, 24)])], _pred())
    result = str(tmp_path / "r")
    torch.multiprocessing.spawn(_rank_opening, args=(2, str(tmp_path / "init"), out, result), nprocs=2, join=True)
    for r in range(2):
        took, name, why = open(f"{result}-{r}").read().split("|", 2)
        assert name == kind.__name__ and float(took) < PROMPT_S, (r, took, name, why)
        assert (own if r == 0 else f"rank 0 {'failed' if kind is StorageError else 'refused'}") in why, (r, why)


def _rank_not_opening(rank, world, init, out, result, case):
    import stoker.inference.writer as writer_module

    dist = _group(rank, world, init)
    try:
        dtype = "f4"
        if rank == 1 and case == "missing":  # rank 1's node does not see the output (no shared file system)
            def missing(store, uri):
                raise FileNotFoundError(f"{uri}: not on this node")
            writer_module._open_output = missing
        elif rank == 1:  # rank 1 asks for another dtype than the array rank 0 made: refused there
            dtype = "f8"
        log = _timed(lambda: stoker.TileWriter(out, SHAPE, CHUNKS, dtype, blend="none", write_threads=0))
        with open(f"{result}-{rank}", "w") as f:
            f.write(log)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["missing", "dtype"])
def test_a_writer_rank_1_cannot_open_fails_on_every_rank_at_once(tmp_path, case):
    """Rank 1 opens and checks the array rank 0 made outside any collective: failing there, it raised while
    rank 0 waited in the next collective for the group's timeout, then got an untyped gloo error. Now every
    rank's opening is gathered in the step after it: rank 1 raises its own typed error, rank 0 one naming
    rank 1, both at once."""
    out, result = str(tmp_path / "two.zarr"), str(tmp_path / "r")
    kind, own = (StorageError, "cannot open the array rank 0 made") if case == "missing" else \
        (InvalidArgument, "dtype")
    torch.multiprocessing.spawn(_rank_not_opening, args=(2, str(tmp_path / "init"), out, result, case), nprocs=2,
                                join=True)
    for r in range(2):
        took, name, why = open(f"{result}-{r}").read().split("|", 2)
        assert name == kind.__name__ and float(took) < PROMPT_S, (r, took, name, why)
        assert (own if r == 1 else f"rank 1 {'failed' if kind is StorageError else 'refused'}") in why, (r, why)
