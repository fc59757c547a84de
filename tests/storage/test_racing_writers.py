"""Racing writers: N processes write each write-once artifact into one shared folder at the same moment.

Real processes (spawned once for the module, then handed one task each per race), released
together after every one of them has its task in hand. For each artifact: exactly one
complete result, every process proceeds and reads back that same result, the build ran
once, and nothing temporary is left (no temporary sibling, no claim). Then the claim
itself: a SIGKILLed writer is taken over, a wait past its bound names the writer, a claim
from another machine is taken over only once its writer stopped refreshing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from stoker.storage import fsutil
from stoker.errors import ClaimTimeout, StorageError

N = 4  # racing processes
BOUND_S = 60.0  # every wait in this file is bounded


# -- the racers -----------------------------------------------------------------------------------


def _serve(conn) -> None:
    """A racer: take a task, say ready, run it on "go", send back its result or its error."""
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args = msg
        conn.send("ready")
        conn.recv()
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            conn.send(("error", {"type": type(exc).__name__, "message": str(exc),
                                 "context": {k: str(v) for k, v in getattr(exc, "context", {}).items()},
                                 "traceback": traceback.format_exc()}))


class Racers:
    """N spawned processes; :meth:`race` hands each its task and releases them together."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(self.n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def race(self, tasks: list) -> list:
        """Run ``tasks[i] = (fn, args)`` on racer i, all at once; their results (errors as dicts) in order."""
        try:
            return self._race(tasks)
        except BaseException:
            for proc in self.procs:  # out of step with their pipes: start afresh for the next test
                proc.kill()
                proc.join(BOUND_S)
            self._start()
            raise

    def _race(self, tasks: list) -> list:
        assert len(tasks) == len(self.conns)
        for conn, task in zip(self.conns, tasks):
            conn.send(task)
        for conn in self.conns:
            assert conn.poll(BOUND_S) and conn.recv() == "ready"
        for conn in self.conns:
            conn.send("go")
        out = []
        for conn in self.conns:
            assert conn.poll(BOUND_S), "a racer did not finish"
            out.append(conn.recv())
        assert all(p.is_alive() for p in self.procs)  # every racer proceeds: none died
        return out

    def everyone(self, fn, *args) -> list:
        """Every racer runs ``fn(i, *args)``; their results, failing the test on any error."""
        results = self.race([(fn, (i, *args)) for i in range(len(self.conns))])
        errors = [r[1]["traceback"] for r in results if r[0] != "ok"]
        assert not errors, "a racer failed:\n" + "\n".join(errors)
        return [r[1] for r in results]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def racers():
    r = Racers(N)
    yield r
    r.close()


# -- helpers the racers run -----------------------------------------------------------------------


@contextlib.contextmanager
def counting(owner, name: str, log: str):
    """Append this process's pid to ``log`` on every call of ``owner.name`` (a build)."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


def builds(log) -> int:
    return len(Path(log).read_text().split()) if Path(log).exists() else 0


def digest(path) -> str:
    """Every file under ``path``: names and bytes."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            h.update(Path(full).read_bytes())
    return h.hexdigest()


def leftovers(folder) -> list[str]:
    """Hidden entries in ``folder``: temporary siblings, moved-aside ones, claims."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


# -- each artifact ----------------------------------------------------------------------------------


def _volume(i, folder, log):
    from stoker.demo import volume

    with counting(volume, "_write_volume", log):
        path = volume.ensure_volume(Path(folder) / "volume.zarr", shape=(32, 128, 128), progress=False)
    return digest(path)


def test_the_demo_volume_is_written_once(racers, tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "builds"  # a fresh cache: the folder is not there yet
    results = racers.everyone(_volume, str(cache), str(log))
    assert len(set(results)) == 1 and builds(log) == 1
    assert os.listdir(cache) == ["volume.zarr"]
    assert zarr.open_array(str(cache / "volume.zarr")).shape == (32, 128, 128)


def _points(i, folder, log):
    from stoker.demo import points

    with counting(points, "_write_tree", log):
        root = points.write_point_clouds(Path(folder) / "clouds", n_records=3, min_points=8, max_points=16,
                                         progress=False)
    return digest(root)


def test_the_point_cloud_records_are_written_once(racers, tmp_path):
    log = tmp_path / "builds"
    results = racers.everyone(_points, str(tmp_path / "cache"), str(log))
    assert len(set(results)) == 1 and builds(log) == 1
    assert os.listdir(tmp_path / "cache") == ["clouds"]


def _bench(i, folder, logs):
    from stoker.bench import datasets, records

    spec = datasets.VolumeSpec("race", (32, 64, 64), (16, 32, 32), "uint8", "zstd", count=2)
    with counting(datasets, "_write", logs[0]), counting(records, "_write_records", logs[1]):
        paths = datasets.ensure(Path(folder), spec, progress=False)
        recs = records.ensure_records(Path(folder), 3, progress=False)
    return [digest(Path(paths[0]).parent), digest(recs)]


def test_bench_datasets_are_written_once(racers, tmp_path):
    logs = [str(tmp_path / "volume-builds"), str(tmp_path / "records-builds")]
    results = racers.everyone(_bench, str(tmp_path / "data"), logs)
    assert all(r == results[0] for r in results) and [builds(log) for log in logs] == [1, 1]
    assert sorted(os.listdir(tmp_path / "data")) == ["race", "records-3"]


def _write_records(root, n: int) -> None:
    for i in range(n):
        g = zarr.open_group(os.path.join(root, f"rec_{i:03d}.zarr"), mode="w", zarr_format=3)
        g.create_array("x", data=np.arange(12, dtype="f4").reshape(4, 3) + 10 * i)


def _stats(i, root, log, variants):
    from stoker.records import ZarrRecords, compute_stats
    from stoker.records import sidecar, stats

    per_channel, nonfinite = variants[i % len(variants)]
    with counting(stats, "_compute", log):
        got = compute_stats(ZarrRecords(root), ["x"], per_channel=per_channel, nonfinite=nonfinite)
    fp = sidecar.fingerprint(ZarrRecords(root), ["x"], per_channel, [], nonfinite)
    return fp, {k: v.tolist() for k, v in vars(got["x"]).items() if isinstance(v, torch.Tensor)}


def test_record_statistics_are_computed_once_and_shared(racers, tmp_path):
    from stoker.records import sidecar

    root, log = str(tmp_path / "d"), str(tmp_path / "builds")
    _write_records(root, 3)
    results = racers.everyone(_stats, root, log, [(True, "raise")])
    assert all(r == results[0] for r in results) and builds(log) == 1
    entries = json.loads(Path(sidecar.path_for(root)).read_text())["entries"]
    assert list(entries) == [results[0][0]]
    assert leftovers(root) == [sidecar.FILENAME]


def test_record_statistics_of_other_fingerprints_keep_each_others_entries(racers, tmp_path):
    from stoker.records import sidecar

    root, log = str(tmp_path / "d"), str(tmp_path / "builds")
    _write_records(root, 3)
    variants = [(True, "raise"), (False, "raise"), (True, "skip"), (False, "skip")]
    results = racers.everyone(_stats, root, log, variants)
    entries = json.loads(Path(sidecar.path_for(root)).read_text())["entries"]
    assert sorted(entries) == sorted(fp for fp, _ in results) and len(entries) == N  # none lost
    assert builds(log) == N and leftovers(root) == [sidecar.FILENAME]


class _Slow:
    """``fn`` for precompute: the record's sum, slowly enough for the racers to meet, logged per record."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, sample: dict) -> torch.Tensor:
        with open(self.log, "a") as f:
            f.write(f"{int(sample['x'][0, 0]) // 10}\n")
        time.sleep(0.05)
        return sample["x"].sum(dim=1)


def _precompute(i, root, log):
    from stoker.records import ZarrRecords, precompute

    r = precompute(ZarrRecords(root, fields=["x"]), "rowsum", _Slow(log), params={"v": 1})
    return r.written, r.skipped


def test_precomputed_arrays_are_computed_once_per_record(racers, tmp_path):
    n = 8
    root, log = str(tmp_path / "d"), str(tmp_path / "computed")
    _write_records(root, n)
    results = racers.everyone(_precompute, root, log)
    assert sorted(Path(log).read_text().split(), key=int) == [str(i) for i in range(n)]  # each record once
    assert sum(w for w, _ in results) == n and all(w + s == n for w, s in results)
    for i in range(n):
        rec = os.path.join(root, f"rec_{i:03d}.zarr")
        want = (np.arange(12, dtype="f4").reshape(4, 3) + 10 * i).sum(axis=1)
        np.testing.assert_array_equal(zarr.open_array(os.path.join(rec, "rowsum"))[:], want)
        assert sorted(os.listdir(rec)) == ["rowsum", "x", "zarr.json"]


def _checkpoint(i, folder, log):
    from stoker.train import Checkpoints
    from stoker.train import checkpoint

    ck = Checkpoints(folder)
    with counting(checkpoint, "_dump", log):
        path = ck.save({"who": i, "w": torch.full((3,), float(i))}, step=7)
    return str(path), ck.load(path)["who"]


def test_a_checkpoint_of_one_step_is_written_once(racers, tmp_path):
    folder, log = tmp_path / "checkpoints", str(tmp_path / "builds")
    results = racers.everyone(_checkpoint, str(folder), log)
    assert len(set(map(tuple, results))) == 1 and builds(log) == 1  # everyone reads the one written
    assert os.listdir(folder) == ["step-000000007.pt"]


def _telemetry(i, folder, steps):
    import warnings

    from stoker.dist.telemetry import TelemetryWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "another process is logging to ..."
        with TelemetryWriter(folder, tensorboard=False) as tw:
            for step in range(steps):
                # Lines of several KiB: larger than a buffered file's one write.
                tw.log(step, {"writer": i, **{f"metric_{k:04d}": 0.5 * k for k in range(400 * (i + 1))}})
    return str(tw.path)


def test_telemetry_writers_never_interleave_in_one_file(racers, tmp_path):
    folder, steps = tmp_path / "run", 40
    racers.everyone(_telemetry, str(folder), steps)
    seen = {}
    for path in folder.iterdir():
        assert path.suffix == ".jsonl", path  # no claim left
        records = [json.loads(line) for line in path.read_text().splitlines()]  # whole lines only
        runs = [w for w, _ in itertools.groupby(r["writer"] for r in records)]
        assert len(runs) == len(set(runs)), f"{path.name}: writers interleave: {runs}"
        for r in records:
            seen.setdefault(r["writer"], []).append(r["step"])
    assert seen == {i: list(range(steps)) for i in range(N)}
    assert (folder / "telemetry.jsonl").exists()


def test_telemetry_takes_over_the_file_of_a_writer_gone(tmp_path):
    import subprocess
    import sys

    from stoker.dist.telemetry import TelemetryWriter

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = [(fsutil.HOST, dead.pid, 0.0, "telemetry.jsonl"),  # this machine, its process gone
             ("elsewhere", 4242, fsutil.CLAIM_STALE_S + 60, "telemetry.jsonl"),  # unrefreshed for long
             ("elsewhere", 4242, 1.0, f"telemetry-{fsutil.HOST}-{os.getpid()}.jsonl")]  # alive, it seems
    for n, (host, pid, age, expect) in enumerate(cases):
        folder = tmp_path / str(n)
        folder.mkdir()
        claim = fsutil.claim_path(folder / "telemetry.jsonl")
        claim.write_text(json.dumps({"host": host, "pid": pid, "token": "t"}))
        os.utime(claim, (time.time() - age,) * 2)
        with contextlib.ExitStack() as stack:
            if expect != "telemetry.jsonl":
                stack.enter_context(pytest.warns(RuntimeWarning, match="another process is logging to"))
            with TelemetryWriter(folder, tensorboard=False) as tw:
                tw.log(0, {"x": 1.0})
        assert tw.path.name == expect and json.loads(tw.path.read_text())["x"] == 1.0
        assert claim.exists() == (expect != "telemetry.jsonl"), n  # a taken-over claim is released after


def _launch_folder(i, folder, ready):
    from stoker.train.launch import _workdir  # the module: stoker.train.launch is also the function

    tempfile.tempdir = folder
    try:
        with _workdir() as work:
            (Path(work) / "mine").write_text(str(os.getpid()))
            Path(ready, str(i)).touch()
            deadline = time.monotonic() + BOUND_S
            while len(os.listdir(ready)) < N and time.monotonic() < deadline:
                time.sleep(0.01)
            return work, (Path(work) / "mine").read_text() == str(os.getpid())
    finally:
        tempfile.tempdir = None


def test_launch_folders_never_collide(racers, tmp_path):
    import subprocess
    import sys

    folder, ready = tmp_path / "tmp", tmp_path / "ready"
    folder.mkdir()
    ready.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / f"stoker-launch-{fsutil.HOST}-{dead.pid}-0123abcd").mkdir()  # a dead launcher's folder
    results = racers.everyone(_launch_folder, str(folder), str(ready))
    assert len({w for w, _ in results}) == N and all(ok for _, ok in results)
    assert os.listdir(folder) == []  # each removed its own, and the dead one's went


def test_host_tags_of_long_host_names_stay_apart():
    a = "gpu-node-0001.rack-07.hall-b.datacenter-frankfurt.example.org"
    b = "gpu-node-0001.rack-07.hall-b.datacenter-frankfurt.example.net"
    tags = {fsutil._host_tag(a), fsutil._host_tag(b)}
    assert len(tags) == 2 and all(len(t) <= 40 and t.replace("_", "").isalnum() for t in tags)
    assert fsutil._host_tag("node-1.local") == "node_1_local"


# -- the claim ------------------------------------------------------------------------------------


def _done(path) -> bool:
    try:
        return (Path(path) / "DONE").read_text() == "complete"
    except OSError:
        return False


def _build(tmp, log, seconds=0.0):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    (Path(tmp) / "data").write_text(f"written by {os.getpid()}")
    time.sleep(seconds)
    (Path(tmp) / "DONE").write_text("complete")


def _write_once(i, final, log, seconds=0.0):
    fsutil.write_once(final, lambda tmp: _build(tmp, log, seconds), is_complete=_done)
    return (Path(final) / "data").read_text()


def _write_and_hang(final, started):
    def build(tmp):
        (Path(tmp) / "data").write_text("half")
        Path(started).touch()
        time.sleep(BOUND_S)

    fsutil.write_once(final, build, is_complete=_done)


def test_a_killed_writer_is_taken_over(racers, tmp_path):
    final, started, log = tmp_path / "shared" / "artifact", tmp_path / "started", str(tmp_path / "builds")
    proc = multiprocessing.get_context("spawn").Process(target=_write_and_hang, args=(str(final), str(started)))
    proc.start()
    deadline = time.monotonic() + BOUND_S
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started.exists(), "the writer never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(BOUND_S)
    assert sorted(n.split("-")[0] for n in leftovers(final.parent)) == [".artifact.claim", ".artifact.tmp"]
    results = racers.everyone(_write_once, str(final), log)
    assert len(set(results)) == 1 and builds(log) == 1
    assert os.listdir(final.parent) == ["artifact"]  # the dead writer's claim and half result are gone


def _hold(i, final, gave_up, waiters):
    with fsutil.claim(final):
        deadline = time.monotonic() + BOUND_S
        while len(os.listdir(gave_up)) < waiters and time.monotonic() < deadline:
            time.sleep(0.01)
    return os.getpid()


def _give_up(i, final, gave_up, log):
    deadline = time.monotonic() + BOUND_S
    while not fsutil.claim_path(final).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the holder claims first
    try:
        fsutil.write_once(final, lambda tmp: _build(tmp, log), is_complete=_done, wait_s=0.5)
    finally:
        Path(gave_up, str(i)).touch()


def test_a_wait_past_its_bound_names_the_writer(racers, tmp_path):
    final, gave_up, log = tmp_path / "shared" / "artifact", tmp_path / "gave-up", str(tmp_path / "builds")
    final.parent.mkdir()
    gave_up.mkdir()
    tasks = [(_hold, (0, str(final), str(gave_up), N - 1))]
    tasks += [(_give_up, (i, str(final), str(gave_up), log)) for i in range(1, N)]
    holder, *waiters = racers.race(tasks)
    assert holder[0] == "ok"
    for kind, err in waiters:
        assert kind == "error" and err["type"] == "ClaimTimeout", err
        assert err["context"]["claimant"] == f"{fsutil.HOST}:{holder[1]}"
        assert err["context"]["path"] == str(final) and str(final) in err["message"]
        assert f"{fsutil.HOST}:{holder[1]}" in err["message"]
    assert builds(log) == 0 and os.listdir(final.parent) == []  # the holder released its claim


def _slow_writer_elsewhere(i, final, log, stale_s, seconds):
    """Racer 0 writes as another machine would (its pid means nothing here): only its refreshes keep the
    claim; the others come once it holds the claim, and take over a claim unrefreshed for ``stale_s``."""
    host, stale = fsutil.HOST, fsutil.CLAIM_STALE_S
    fsutil.CLAIM_STALE_S = stale_s
    try:
        if i == 0:
            fsutil.HOST = "elsewhere"
        else:
            deadline = time.monotonic() + BOUND_S
            while not fsutil.claim_path(final).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return _write_once(i, final, log, seconds if i == 0 else 0.0)
    finally:
        fsutil.HOST, fsutil.CLAIM_STALE_S = host, stale


def test_a_live_slow_writer_on_another_machine_is_never_taken_over(racers, tmp_path):
    final, log = tmp_path / "shared" / "artifact", str(tmp_path / "builds")
    final.parent.mkdir()
    # The build lasts twice the staleness bound: without its refreshes, the claim would be taken over.
    results = racers.everyone(_slow_writer_elsewhere, str(final), log, 1.5, 3.0)
    assert len(set(results)) == 1 and builds(log) == 1
    assert os.listdir(final.parent) == ["artifact"]


def _foreign_claim(final: Path, age_s: float) -> Path:
    path = fsutil.claim_path(final)
    path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": time.time() - age_s, "token": "t"}))
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def test_a_claim_from_another_machine_is_taken_over_once_seen_unrefreshed(tmp_path, monkeypatch, capfd):
    final, log = tmp_path / "artifact", str(tmp_path.parent / f"{tmp_path.name}-builds")
    monkeypatch.setattr(fsutil, "CLAIM_STALE_S", 0.3)  # by this waiter's own clock, whatever the mtime says
    _foreign_claim(final, -3600.0)  # a clock an hour ahead of ours
    assert fsutil.write_once(final, lambda tmp: _build(tmp, log), is_complete=_done) is True
    assert os.listdir(tmp_path) == ["artifact"] and builds(log) == 1
    err = capfd.readouterr().err
    assert "waiting for elsewhere:4242" in err and "taking over elsewhere:4242's claim" in err


def test_a_claim_abandoned_long_ago_is_taken_over_at_once(tmp_path):
    final, log = tmp_path / "artifact", str(tmp_path.parent / f"{tmp_path.name}-builds")
    _foreign_claim(final, fsutil.STALE_AFTER_S + 60)
    assert fsutil.write_once(final, lambda tmp: _build(tmp, log), is_complete=_done, wait_s=0.1) is True
    assert os.listdir(tmp_path) == ["artifact"] and builds(log) == 1


def test_a_refreshed_claim_from_another_machine_is_waited_for(tmp_path, monkeypatch):
    final = tmp_path / "artifact"
    monkeypatch.setattr(fsutil, "CLAIM_STALE_S", 0.2)
    claim = _foreign_claim(final, 3600.0)  # an old mtime (or a clock behind ours) is no reason to take over

    def refresh(stop):
        while not stop.wait(0.02):
            os.utime(claim)

    stop = threading.Event()
    refresher = threading.Thread(target=refresh, args=(stop,))
    refresher.start()
    try:
        with pytest.raises(ClaimTimeout, match="elsewhere:4242") as info:
            fsutil.write_once(final, lambda tmp: pytest.fail("built under another's claim"), is_complete=_done,
                              wait_s=1.0)
    finally:
        stop.set()
        refresher.join()
    assert (info.value.claimant, info.value.path, info.value.claim) == ("elsewhere:4242", str(final), str(claim))
    assert os.listdir(tmp_path) == [claim.name]  # not taken over


def test_a_failed_build_leaves_nothing_and_the_next_writer_succeeds(tmp_path):
    final, log = tmp_path / "artifact", str(tmp_path.parent / f"{tmp_path.name}-builds")

    def broken(tmp):
        (tmp / "data").write_text("half")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        fsutil.write_once(final, broken, is_complete=_done)
    assert os.listdir(tmp_path) == []
    with pytest.raises(StorageError, match="does not check as complete"):  # a build without its marker
        fsutil.write_once(final, lambda tmp: (tmp / "data").write_text("no marker"), is_complete=_done)
    assert os.listdir(tmp_path) == []
    assert fsutil.write_once(final, lambda tmp: _build(tmp, log), is_complete=_done) is True
    assert fsutil.write_once(final, lambda tmp: pytest.fail("written twice"), is_complete=_done) is False
    assert os.listdir(tmp_path) == ["artifact"]


def test_a_rename_onto_a_complete_result_keeps_it(tmp_path, monkeypatch):
    """The original failure: a writer that did not see the claim (an older stoker) renamed its result in
    between our look and our rename; ours is dropped, theirs kept, and it is no error."""
    final, log = tmp_path / "artifact", str(tmp_path.parent / f"{tmp_path.name}-builds")
    theirs, ours = tmp_path / ".theirs", tmp_path / ".ours"
    for d in (theirs, ours):
        d.mkdir()
        _build(d, log)
        (d / "data").write_text(d.name)
    os.replace(theirs, final)
    monkeypatch.setattr(fsutil.os.path, "lexists", lambda p: False)  # we looked before they renamed
    assert fsutil.place_dir(ours, final, _done) is False
    monkeypatch.undo()
    assert (final / "data").read_text() == ".theirs" and ours.exists()  # the caller removes its own
