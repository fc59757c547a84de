"""`stoker bench --thread-cpu`: each stoker peer's CPU per batch by thread (stoker.bench.threadcpu), counted
from the OS's clock of each thread, so the serial work per batch (coordinator, consumer, finisher) shows
beside the compiled engine's threads."""

import json
import re
import threading
import time

import pytest

from stoker.bench.threadcpu import ROLES, ThreadCPU, role
from stoker.cli import main
from stoker.engine.cpu.executor import engine_available
from stoker.runtime.schedstat import run_times

pytestmark = pytest.mark.skipif(run_times(threading.get_native_id()) is None,
                                reason="no per-thread schedstat (Linux only)")


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_threads_cpu_goes_to_its_role_per_batch():
    started, go, done, end = threading.Barrier(3), threading.Event(), threading.Barrier(3), threading.Event()

    def worker(seconds: float) -> None:
        started.wait(10)
        go.wait(10)
        _burn(seconds)
        done.wait(30)
        end.wait(30)  # alive until the window's last mark

    threads = [threading.Thread(target=worker, args=(0.2,), name="stoker-coordinator", daemon=True),
               threading.Thread(target=worker, args=(0.1,), name="stoker-io_0", daemon=True)]
    for t in threads:
        t.start()
    started.wait(10)  # both running (their start-up outside the window)
    clock = ThreadCPU()
    clock.mark()
    go.set()
    _burn(0.05)  # the consumer: the thread that marks
    done.wait(30)
    clock.mark()
    end.set()
    for t in threads:
        t.join(10)
    # only this test's threads: those earlier tests left in this process (under xdist) are named as stoker's too
    # (a pool's, a coordinator's) and may work in the window (a run of the suite once counted 36 ms in a half
    # second with no pipeline running)
    ours = {t.native_id for t in threads} | {threading.get_native_id()}
    for marked, *_ in clock.marks:
        for tid in set(marked) - ours:
            del marked[tid]
    got = clock.per_batch(batches=2, engine_s=0.3, consumer_extra_s=0.01)
    assert set(got) == {*ROLES, "process"}
    # ms per batch: 200 ms over 2 batches on the coordinator, 100 on a pool thread, 50 - 10 on the consumer
    assert 95 <= got["coordinator"] <= 130, got
    assert 45 <= got["pools"] <= 75, got
    assert 18 <= got["consumer"] <= 40, got
    assert got["finisher"] == 0 and got["engine"] == 150
    assert got["process"] >= got["coordinator"] + got["pools"] + got["consumer"] - 1, got
    assert got["other"] >= 0


def test_a_thread_started_in_the_window_counts_whole_and_unknown_names_are_other():
    assert (role("stoker-coordinator"), role("stoker-engine-finisher"), role("stoker-open_3"), role("Thread-7")) == \
        ("coordinator", "finisher", "pools", None)
    clock = ThreadCPU()
    clock.mark()
    gate = threading.Event()

    def late() -> None:
        _burn(0.08)
        gate.wait(10)

    t = threading.Thread(target=late, name="stoker-engine-finisher", daemon=True)
    t.start()
    while t.is_alive() and run_times(t.native_id)[0] < 0.08:
        time.sleep(0.01)
    clock.mark()
    gate.set()
    t.join(10)
    got = clock.per_batch(batches=1, engine_s=None)
    assert got["finisher"] >= 75, got  # all of it: the thread was not there at the first mark
    assert got["engine"] is None and got["other"] is None  # the engine's count unknown: so is the rest


@pytest.mark.timeout(300)
def test_bench_thread_cpu_prints_each_peers_cpu_per_batch_by_thread(tmp_path, capsys):
    doc = tmp_path / "run.json"
    assert main(["bench", "--tiny", "--scenarios", "6", "--batches", "4", "--peers", "stoker", "--threads", "1",
                 "--rounds", "1", "--thread-cpu", "--data", str(tmp_path / "bench"), "--json", str(doc)]) == 0
    out = capsys.readouterr().out
    assert "CPU per batch by thread" in out, out
    number = r"\s+([\d.]+|-)"
    rows = {m[0]: m[1:] for m in re.findall(r"^(stoker(?: t=1)?)" + number * 8 + r"\s+([\d,]+|-)\s+([\d.]+|-)$",
                                            out, re.M)}
    assert set(rows) == {"stoker", "stoker t=1"}, out
    for peer, cells in rows.items():
        coordinator, finisher, consumer, pools, engine, other, process, serial = (float(c) for c in cells[:8])
        assert coordinator > 0 and consumer > 0, (peer, out)
        assert serial == pytest.approx(coordinator + finisher + consumer, abs=0.002), (peer, out)
        assert process >= coordinator + consumer + pools, (peer, out)
        if engine_available():
            assert engine > 0, (peer, out)  # the compiled engine's threads decoded every chunk
    # --json keeps them per peer, in ms per batch
    kept = {p["peer"]: p["thread_cpu"] for p in json.loads(doc.read_text())["scenarios"][0]["peers"]}
    assert set(kept) == {"stoker", "stoker t=1"} and set(kept["stoker"]) == {*ROLES, "process"}
    assert kept["stoker"]["coordinator"] == pytest.approx(float(rows["stoker"][0]), abs=0.001)
    # a CUDA run measures other threads: refused, in one line
    assert main(["bench", "--tiny", "--device", "cuda", "--thread-cpu", "--data", str(tmp_path / "bench")]) == 2


def test_the_benchs_cache_sampler_is_not_a_pipeline_pool(tmp_path):
    """CachePeak's thread is the bench's: its CPU, left out of cpu_s, is not counted as stoker's pools."""
    from stoker.bench.epochs import CachePeak
    from stoker.storage.diskcache import disk_cache

    with CachePeak(disk_cache(str(tmp_path / "c"), 1 << 30), every_s=0.0) as peak:
        time.sleep(0.05)
        clock = ThreadCPU()  # no pipeline runs: only the bench's sampler works
        clock.mark()
        time.sleep(0.5)
        clock.mark()
        assert role(peak._thread.name) is None, peak._thread.name  # not a stoker- thread: never a pool
    sampler = peak._thread.native_id
    (start, *_), (end, *_) = clock.marks[0], clock.marks[-1]
    assert end[sampler][1] - start[sampler][1] > 0.02  # the sampler spun (every_s=0) in the window
    pools = clock.per_batch(batches=1)["pools"]
    # the same window with the sampler's clock taken out of both marks: counted as a pool, it would drop the
    # pools by all of its CPU; threads earlier tests left (under xdist) count the same in both, whatever they did
    for threads, *_ in clock.marks:
        del threads[sampler]
    assert clock.per_batch(batches=1)["pools"] == pools, "CachePeak counted as a pool"


def test_the_cache_samplers_cpu_s_is_all_of_its_threads_cpu(tmp_path):
    """cpu_s (what the bench subtracts from its cpu_s) is the sampler thread's whole time on a core, its
    waits between samples included, as the OS counts it."""
    from stoker.bench.epochs import CachePeak
    from stoker.storage.diskcache import disk_cache

    with CachePeak(disk_cache(str(tmp_path / "c"), 1 << 30), every_s=0.0) as peak:
        tid = None
        for _ in range(100):  # the sampler's thread, by its name
            tid = next((t.native_id for t in threading.enumerate() if t.name.endswith("cachepeak")), None)
            if tid is not None:
                break
            time.sleep(0.01)
        assert tid is not None
        time.sleep(0.05)
        before, cpu0 = run_times(tid), peak.cpu_s
        time.sleep(0.5)
        after, cpu1 = run_times(tid), peak.cpu_s
    assert before is not None and after is not None
    os_s = after[0] - before[0]
    assert os_s > 0.05
    assert cpu1 - cpu0 >= 0.85 * os_s - 0.01, f"cpu_s grew {cpu1 - cpu0:.3f} s, the thread ran {os_s:.3f} s"
