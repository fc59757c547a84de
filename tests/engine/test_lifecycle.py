"""A pipeline's life at its edges: used in a forked process, interrupted inside ``pop``, left open at exit.

Forks and exits run in scripts in a subprocess (a hang there cannot take pytest down); each wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import stoker
from stoker.engine.cpu import native as engine_native

from batch_oracle import random_crops, zstd_array
from interrupts import pop_through_interrupts

pytestmark = pytest.mark.timeout(300)

SRC = str(Path(__file__).resolve().parents[2] / "src")
CROP = (8, 16, 16)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    data = np.random.default_rng(0).normal(size=(32, 64, 64)).astype("float32")
    return zstd_array(tmp_path_factory.mktemp("life") / "v.zarr", data, (8, 16, 16))


def _run(script: str, *args: str, timeout: float = 120, native: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "STOKER_NATIVE": "1" if native else "0"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# -- fork ------------------------------------------------------------------------------------------------------

FORK_SCRIPT = """
import json, os, random, sys, time
import numpy as np
import stoker

uri, forks, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = stoker.Config(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, n_compute_threads=threads,
                    pop_timeout_s=20, device="cpu")
rng = np.random.default_rng(1)

def crops():
    while True:
        c = [int(rng.integers(0, s - 8 + 1)) for s in (32, 64, 64)]
        yield stoker.Sample(uri, [(a, a + 8) for a in c])

p = stoker.Pipeline(cfg)
p.push(crops())
p.pop().release()
codes = []
for i in range(forks):
    p.pop().release()  # the next batches are being made as the fork happens
    time.sleep(random.random() * 0.003)
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(10, exit=True)  # a hang ends the child with exit code 1
        code = 0
        for call in (p.pop, lambda: p.push([]), p.state_dict, lambda: p.pending, p.stats):
            try:
                call()
                code = 2  # a call that worked in the child
            except stoker.ForkedPipeline as e:
                if "Make a new Pipeline in this process" not in str(e):
                    code = 3
            except BaseException:
                code = 4
        t0 = time.monotonic()
        p.close()
        p.close()
        if time.monotonic() - t0 > 2.0:
            code = 5
        if i % 2:
            os._exit(code)  # as multiprocessing's fork children end
        sys.exit(code)  # through the interpreter's exit: atexit hooks, then finalisation
    deadline = time.monotonic() + 30
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            codes.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            codes.append("hung")
            break
        time.sleep(0.005)
with p.pop() as b:  # the parent's pipeline goes on
    rows = len(b.samples)
p.close()
print(json.dumps({"codes": codes, "rows": rows}))
"""


@pytest.mark.parametrize("native,forks,threads", [(True, 30, 8), (False, 10, 2)], ids=["engine", "python"])
def test_a_forked_child_refuses_every_call_and_closes_at_once(volume, native, forks, threads):
    """A child that inherited an open pipeline gets ForkedPipeline from every call and closes it promptly, 30
    times over with 8 engine threads (close hung in pthread_cond_broadcast 1 fork in 10, and pop returned the
    batches made before the fork); the child's exit, through the interpreter or os._exit, is clean."""
    if native and engine_native.Engine is None:
        pytest.skip("the compiled engine is not built")
    proc = _run(FORK_SCRIPT, volume[0], str(forks), str(threads), native=native, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["codes"] == [0] * forks, (out, proc.stderr[-3000:])
    assert out["rows"] == 4


LOADER_SCRIPT = """
import json, os, sys
import numpy as np
import torch
import stoker

uri = sys.argv[1]
cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=64 << 20, n_compute_threads=2, pop_timeout_s=20,
                    device="cpu")
boxes = [[(i, i + 8), (0, 16), (0, 16)] for i in range(8)]


class Crops(torch.utils.data.Dataset):
    # each worker makes its own pipeline (the one inherited from the parent is refused there)
    def __init__(self, inherited):
        self.inherited, self.mine = inherited, {}

    def __len__(self):
        return len(boxes)

    def __getitem__(self, i):
        try:
            self.inherited.pop()
            refused = False
        except stoker.ForkedPipeline:
            refused = True
        p = self.mine.get(os.getpid())
        if p is None:
            p = self.mine[os.getpid()] = stoker.Pipeline(cfg)
        p.push([stoker.Sample(uri, boxes[i]), stoker.Sample(uri, boxes[i])])
        with p.pop() as b:
            return torch.from_dlpack(b)[0].clone(), refused


parent = stoker.Pipeline(cfg)
parent.push([stoker.Sample(uri, boxes[0])] * 40)
parent.pop().release()
loader = torch.utils.data.DataLoader(Crops(parent), batch_size=None, num_workers=2, multiprocessing_context="fork",
                                     timeout=60)
got = [(x.numpy().tolist(), refused) for x, refused in loader]
with parent.pop() as b:
    after = torch.from_dlpack(b)[0].numpy().tolist()
parent.close()
print(json.dumps({"got": got, "after": after}))
"""


def test_dataloader_fork_workers_make_pipelines_of_their_own(volume):
    """DataLoader workers made by fork, while the parent has a pipeline making batches, make and use pipelines
    of their own, and are refused the inherited one; the parent's goes on."""
    uri, data = volume
    proc = _run(LOADER_SCRIPT, uri, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["got"]) == 8
    for i, (x, refused) in enumerate(out["got"]):
        assert refused
        np.testing.assert_array_equal(np.array(x, dtype=np.float32), data[i:i + 8, 0:16, 0:16])
    np.testing.assert_array_equal(np.array(out["after"], dtype=np.float32), data[0:8, 0:16, 0:16])


# -- Ctrl-C inside pop ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", [False, True], ids=["plain", "transform"])
def test_ctrl_c_anywhere_in_pop_loses_no_batch_and_state_counts_only_received(volume, decode_path, transform):
    """A KeyboardInterrupt at every point of a pop in turn: the batch stays for the next pop, every batch comes
    once and in order, and ``state_dict`` counts exactly the batches returned (an epoch lost 3-4 batches of
    288, and a checkpoint counted batches never received)."""
    uri, data = volume
    bs, n_batches = 4, 6
    samples = random_crops(uri, data.shape, CROP, bs * n_batches)
    cfg = stoker.Config(batch_size=bs, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                        pop_timeout_s=5, device="cpu", transform=(lambda x: x.mul_(2)) if transform else None)
    scale = 2 if transform else 1
    with stoker.Pipeline(cfg) as p:
        received, interrupts = pop_through_interrupts(
            p, samples, bs, lambda batch: (list(batch.samples), torch.from_dlpack(batch).clone()))
        assert p.stats().batches_emitted >= n_batches
    assert interrupts > 10 * n_batches  # every pop was cut at many points before one went through
    assert [s for got, _ in received for s in got] == samples
    for got, x in received:
        for row, s in enumerate(got):
            crop = data[tuple(slice(a, b) for a, b in s.aabb)]
            torch.testing.assert_close(x[row], torch.from_numpy(crop) * scale)


@pytest.mark.timeout(60)
def test_a_close_cut_short_by_ctrl_c_is_finished_by_the_next_close(tmp_path, decode_path):
    """Ctrl-C while ``close()`` waits for the coordinator (its source blocked in ``next``): the rest of the close
    still runs, and a later ``close()`` finishes what is left. A second close returned at once, as if the first
    had ended: the executor and the store were never closed, so the pipeline's descriptors of the shards it had
    read stayed open for the life of the process (two a pipeline), and its slots never went back."""
    import signal
    import threading

    import zarr

    data = np.arange(32 * 64 * 64, dtype="float32").reshape(32, 64, 64)
    z = zarr.create_array(str(tmp_path / "s.zarr"), shape=data.shape, chunks=(8, 16, 16), shards=(16, 32, 32),
                          dtype="float32")
    z[:] = data
    uri = str(tmp_path / "s.zarr")

    def fds_under() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(uri):
                out.append(target)
        return out

    gate = threading.Event()

    def blocked():
        yield from random_crops(uri, data.shape, CROP, 8)
        gate.wait(30)  # a source waiting for samples that do not come

    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                        pop_timeout_s=10, device="cpu")
    p = stoker.Pipeline(cfg)
    try:
        p.push(blocked())
        for _ in range(4):
            p.pop().release()
        assert fds_under(), "the test needs a pipeline holding its shards open"
        waits = []
        join = p._coordinator.join

        def join_then_ctrl_c(timeout):  # Ctrl-C lands in close's wait for the coordinator, blocked in the source
            waits.append(timeout)
            if len(waits) == 1:
                signal.raise_signal(signal.SIGINT)
            join(timeout)

        p._coordinator.join = join_then_ctrl_c
        with pytest.raises(KeyboardInterrupt):
            p.close()
        assert fds_under() == []  # the close went on past the interrupt
        p.close()
        assert fds_under() == []
        assert p._executor.host_slots.slots == []  # its slots went back
        with pytest.raises(stoker.ShutdownError):
            p.pop()
    finally:
        gate.set()
        p.close()


def _threads_and_descriptors() -> tuple[int, int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_pipelines_ended_every_way_leave_no_thread_or_descriptor(tmp_path, decode_path):
    """Pipelines over a sharded array ended every way (iterated out, closed after one batch, a loop broken
    out of then closed, dropped unclosed, a source that raised, a close cut short by Ctrl-C then closed again):
    the process's Python threads, its native threads (/proc/self/task) and its open descriptors come back to
    what they were before."""
    import gc
    import itertools
    import signal

    import zarr

    data = np.arange(32 * 64 * 64, dtype="float32").reshape(32, 64, 64)
    z = zarr.create_array(str(tmp_path / "s.zarr"), shape=data.shape, chunks=(8, 16, 16), shards=(16, 32, 32),
                          dtype="float32")
    z[:] = data
    uri = str(tmp_path / "s.zarr")
    crops = random_crops(uri, data.shape, CROP, 8)
    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                        pop_timeout_s=20, device="cpu")

    def raising():
        yield from crops[:3]
        raise ValueError("a source that fails")

    def interrupted(p):
        join = p._coordinator.join

        def join_then_ctrl_c(timeout):
            signal.raise_signal(signal.SIGINT)
            join(timeout)

        p._coordinator.join = join_then_ctrl_c
        try:
            p.close()
        except KeyboardInterrupt:
            pass
        p.close()

    def once(way: str) -> None:
        p = stoker.Pipeline(cfg)
        p.push(crops if way == "out" else raising() if way == "raising" else itertools.cycle(crops))
        if way == "out":
            assert sum(1 for _ in p) == 4
        elif way == "raising":
            with pytest.raises(stoker.InvalidArgument):
                for _ in p:
                    pass
        else:
            for _ in p:
                break
        if way == "interrupted":
            interrupted(p)
        elif way != "dropped":
            p.close()
        del p

    ways = ["out", "one", "dropped", "raising", "interrupted"]
    for way in ways:  # the process's own threads (a thread pool, a runtime) started once, before counting
        once(way)
    gc.collect()
    deadline = time.monotonic() + 10
    while True:  # the threads of the pipelines just closed leave at their next step
        before = _threads_and_descriptors()
        time.sleep(0.3)
        if _threads_and_descriptors() == before or time.monotonic() > deadline:
            break
    for _ in range(4):
        for way in ways:
            once(way)
    gc.collect()
    deadline = time.monotonic() + 10
    while True:
        now = _threads_and_descriptors()
        if all(a <= b for a, b in zip(now, before)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(a <= b for a, b in zip(now, before)), (now, before, [t.name for t in threading.enumerate()])


# -- exit with a pipeline open ---------------------------------------------------------------------------------

EXIT_SCRIPT = """
import sys
import torch
import stoker

uri, what = sys.argv[1], sys.argv[2]

def slow(x):  # a transform that keeps a pipeline thread inside torch most of the time
    for _ in range(100):
        x.mul_(1.0001)
    return x

cfg = stoker.Config(batch_size=16, dtype="bf16", host_buffer_bytes=256 << 20, n_compute_threads=2, pop_timeout_s=60,
                    device="cpu", transform=slow)
source = stoker.RandomCrops([uri], sample_shape=(8, 64, 64), seed=0, samples_per_epoch=100000).for_rank(0, 1)
if what == "pipeline":
    p = stoker.Pipeline(cfg)
    p.push(source)
    with p.pop() as b:
        torch.from_dlpack(b).sum()
else:  # a CropDataset iterator kept after a break, as StatefulDataLoader keeps it
    it = iter(stoker.CropDataset(source, cfg))
    for x in it:
        break
print("left open", flush=True)
"""


@pytest.mark.parametrize("what", ["pipeline", "dataset"])
def test_a_script_that_ends_with_a_pipeline_open_exits_cleanly(volume, what):
    """A script ending without close(), a transform running on a pipeline thread: exit code 0 every time, in
    bounded time, 6 runs of 6 (it aborted with "terminate called without an active exception", exit code 134, as the
    interpreter finalised with a daemon thread inside torch)."""
    for _ in range(6):
        proc = _run(EXIT_SCRIPT, volume[0], what, timeout=120)
        assert (proc.returncode, proc.stdout.strip()) == (0, "left open"), proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr


BLOCKED_SOURCE_EXIT_SCRIPT = """
import atexit, sys, threading, time
import stoker

uri = sys.argv[1]
marks = {}
# registered before stoker's exit hook, so run after it: how long the exit took from the script's end
atexit.register(lambda: print(f"exit hooks took {time.monotonic() - marks['end']:.2f} s", flush=True))
never = threading.Event()

def samples():  # a source waiting for samples that never come (a queue whose producer died)
    for y in (0, 16, 32, 48):
        yield stoker.Sample(uri, [(0, 8), (y, y + 16), (0, 16)])
    never.wait()

cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=64 << 20, pop_timeout_s=60, device="cpu")
p = stoker.Pipeline(cfg)
p.push(samples())
for _ in range(2):
    p.pop().release()
time.sleep(0.2)  # the coordinator is inside the source's next() now
print("left open", flush=True)
marks["end"] = time.monotonic()
"""


def test_a_script_that_ends_with_its_source_blocked_exits_without_waiting_for_it(volume):
    """A pipeline left open at exit whose sample source blocks for ever in ``next()`` (as at a Ctrl-C while the
    consumer waits for it): the exit hook closes it and does not wait for the coordinator thread parked in the
    user's source (it runs none of stoker's code, and would never end). The hook waited EXIT_WAIT_S (10 s) for
    it, on top of the close's second: 11 s to exit."""
    proc = _run(BLOCKED_SOURCE_EXIT_SCRIPT, volume[0], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[0] == "left open", proc.stdout
    took = float(lines[1].split()[3])
    assert took < 4.0, proc.stdout


RECORDS_EXIT_SCRIPT = """
import stoker.records

def slow(items):  # a collate that keeps the reader threads inside torch most of the time
    import torch
    x = torch.ones(1 << 20)
    for _ in range(100):
        x.mul_(1.0001)
    return len(items)

loader = stoker.records.Loader(list(range(64)), batch_size=2, collate=slow, seed=0, prefetch=4, n_threads=2)
it = iter(loader)
next(it)
print("left open", flush=True)
"""


def test_a_script_that_ends_with_a_records_loader_open_exits_cleanly():
    """A records Loader iterator kept open at exit, its threads collating with torch: exit code 0 every time."""
    for _ in range(6):
        proc = _run(RECORDS_EXIT_SCRIPT, timeout=120)
        assert (proc.returncode, proc.stdout.strip()) == (0, "left open"), proc.stderr[-3000:]


# -- idle ------------------------------------------------------------------------------------------------------

def _switches_and_cpu(tid: int) -> tuple[int, float]:
    """Thread ``tid``'s voluntary context switches (each time it went to sleep) and its CPU seconds so far."""
    from stoker.runtime.schedstat import run_times

    with open(f"/proc/self/task/{tid}/status") as f:
        switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    times = run_times(tid)
    assert times is not None
    return switches, times[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the thread's /proc counters")
@pytest.mark.parametrize("kind", ["cpu", "cuda-host", "gpu-host"])
@pytest.mark.parametrize("idle", ["held", "not popped", "used up"])
def test_an_idle_pipeline_s_coordinator_sleeps_until_the_consumer_or_the_close(volume, monkeypatch, kind, idle):
    """Every slot full and the consumer away (holding a batch, or not popping), or every sample pushed made: the
    coordinator waits for a slot's release or a pop or a push, which notify it, and for the close, which wakes
    it. It woke every 50 ms or 0.1 s to look (10 to 30 times and 1.5 to 2 ms of CPU a second, for ever, in
    every idle pipeline of a process); now it sleeps through (at most a wake-up a second), and close() still
    ends it at once."""
    from stoker.engine.cuda.transfer import CudaExecutor
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.gpu.streams import HostStreams
    from stoker.engine.pipeline import facade as pipelines

    makers = {"cuda-host": lambda cfg, stats, store: CudaExecutor(cfg, torch.device("cpu"), stats, store,
                                                                   streams=HostStreams()),
              "gpu-host": lambda cfg, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store)}
    if kind in makers:
        monkeypatch.setattr(pipelines, "make_executor",
                            lambda cfg, device, stats, store: makers[kind](cfg, stats, store))
    uri, _ = volume
    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20,
                        lookahead_batches=2, n_io_threads=1, n_compute_threads=1, pop_timeout_s=20, device="cpu",
                        decode_on="cpu")

    def crops():
        while True:
            yield stoker.Sample(uri, ((0, 8), (0, 16), (0, 16)))

    p = stoker.Pipeline(cfg)
    try:
        if idle == "used up":
            p.push([stoker.Sample(uri, ((0, 8), (0, 16), (0, 16)))] * 2)
            p.pop().release()
        else:
            p.push(crops())
            batch = p.pop()
            if idle == "not popped":
                batch.release()
                del batch
        coordinator = p._coordinator.thread
        assert coordinator is not None
        # idle once it stops making batches: every slot full (its CPU clock then moves only at its wake-ups)
        deadline, last = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = _switches_and_cpu(coordinator.native_id)[1]
            if last is not None and now - last < 0.002:
                break
            last = now
        s0, c0 = _switches_and_cpu(coordinator.native_id)
        time.sleep(2.0)
        s1, c1 = _switches_and_cpu(coordinator.native_id)
        assert s1 - s0 <= 8 and c1 - c0 < 0.0015, (s1 - s0, c1 - c0)
        t0 = time.monotonic()
        p.close()
        assert time.monotonic() - t0 < 0.5 and not coordinator.is_alive()
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_exporting_a_batch_kept_from_iteration_is_a_typed_error_that_says_iteration_released_it(volume):
    """``kept = list(pipeline)`` (or appending each Batch in a for loop) keeps batches that iteration released
    when the next was asked for; exporting one later must be a stoker error (typed, a RuntimeError as before)
    that says so and what to do, never data of a slot reused since."""
    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, pop_timeout_s=30)
    with stoker.Pipeline(cfg) as p:
        p.push(stoker.RandomCrops([volume[0]], CROP, seed=0, samples_per_epoch=8))
        kept = list(p)
    assert len(kept) == 4
    for export in (torch.from_dlpack, np.from_dlpack):
        with pytest.raises(stoker.BatchReleased, match=r"released.*iterat.*\.clone\(\)") as info:
            export(kept[0])
        assert isinstance(info.value, stoker.StokerError) and isinstance(info.value, RuntimeError)
