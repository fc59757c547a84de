"""`stoker demo` end to end: 2 CPU ranks over gloo, checkpoints, kill and resume, and the CLI from a bare env."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STOKER = str(Path(sys.executable).with_name("stoker"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One demo cache for the module: the volume is written by the first run and reused by the rest."""
    return tmp_path_factory.mktemp("stoker-cache")


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, STOKER_CACHE=str(cache), OMP_NUM_THREADS="1", **extra)
    env.pop("RANK", None)  # never look like a torchrun child
    return env


def _demo(cache: Path, run_dir: Path, *args: str, timeout: float = 200, progress: bool = False) -> str:
    cmd = [STOKER, "demo", "--cpu", "--batch-size", "1", "--run-dir", str(run_dir), *args]
    cmd += [] if progress else ["--no-progress"]
    proc = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr  # a clean exit
    return proc.stdout


def _losses(run_dir: Path) -> dict[int, float]:
    """Loss by step from telemetry; a step logged twice (a killed run, then its resumption) keeps the last."""
    out = {}
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


@pytest.mark.timeout(300)
def test_demo_trains_checkpoints_and_resumes_when_run_again(cache, tmp_path):
    run = tmp_path / "run"
    out = _demo(cache, run, "--steps", "4", "--checkpoint-every", "2", "--log-every", "1", progress=True)
    assert "2 CPU rank(s) (gloo)" in out and "; starting at step 0" in out.splitlines()[0]
    assert re.search(r"steps\s+0 -> 4 in", out) and "samples/s over 2 rank(s), 8 samples" in out
    assert re.search(r"data wait\s+\d+\.\d% of step time", out)
    assert re.search(r"amplification read \d+\.\d\dx, decode \d+\.\d\dx", out)
    assert re.search(r"peak memory\s+host RSS [\d,]+ MiB", out)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000002.pt", "step-000000004.pt"]
    assert sorted(_losses(run)) == [1, 2, 3, 4]
    assert (cache / "demo-volume-v2.zarr" / ".stoker-complete").exists()
    from stoker.cli import plots

    if plots.available():  # the picture it wrote is named; without matplotlib, how to get one
        assert f"picture      {run / 'telemetry.png'}" in out and (run / "telemetry.png").stat().st_size > 10_000
    else:
        assert "pip install 'stoker[plot]', then stoker plot" in out
    import importlib.util

    assert ("tensorboard --logdir" in out) == (importlib.util.find_spec("tensorboard") is not None)

    again = _demo(cache, run, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1")
    assert f"resuming from step 4 ({run / 'checkpoints' / 'step-000000004.pt'})" in again.splitlines()[0]
    assert f"resumed      from {run / 'checkpoints' / 'step-000000004.pt'}" in again
    assert re.search(r"steps\s+4 -> 6 in", again)
    done = _demo(cache, run, "--steps", "6")
    assert "nothing to do: already at step 6" in done


@pytest.mark.timeout(300)
def test_summary_of_a_run_shorter_than_log_every_names_no_missing_files(cache, tmp_path):
    """A run that ends before its first telemetry record (2 steps, one record every 5) writes no telemetry file:
    the summary says so, rather than naming a telemetry.jsonl that is not there and telling to install
    matplotlib for its picture (it once did both, with matplotlib installed)."""
    run = tmp_path / "short"
    out = _demo(cache, run, "--steps", "2", "--log-every", "5")
    assert not (run / "telemetry.jsonl").exists()
    assert str(run / "telemetry.jsonl") not in out and "pip install 'stoker[plot]'" not in out
    assert re.search(r"telemetry\s+none: .*--log-every 5", out), out


@pytest.mark.timeout(400)
def test_killed_run_resumes_with_the_losses_of_an_uninterrupted_run(cache, tmp_path):
    total = 10
    straight = tmp_path / "straight"
    _demo(cache, straight, "--steps", str(total), "--checkpoint-every", "2", "--log-every", "1")

    killed = tmp_path / "killed"
    cmd = [STOKER, "demo", "--cpu", "--no-progress", "--batch-size", "1", "--run-dir", str(killed), "--steps", "1000",
           "--checkpoint-every", "2", "--log-every", "1"]
    proc = subprocess.Popen(cmd, env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not list((killed / "checkpoints").glob("step-*.pt")):
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-step, as a node failure would
        proc.wait(timeout=30)

    out = _demo(cache, killed, "--steps", str(total), "--checkpoint-every", "2", "--log-every", "1")
    resumed = int(re.search(r"resumed\s+from .*step-(\d+)\.pt", out).group(1))
    assert 2 <= resumed < total
    expected, got = _losses(straight), _losses(killed)
    after = list(range(resumed + 1, total + 1))
    assert [got[s] for s in after] == [expected[s] for s in after]  # exactly: same batches, RNG and weights
    assert not list((killed / "checkpoints").glob(".*tmp*"))  # a temp file of the killed writer is cleaned


@pytest.mark.timeout(300)
def test_records_demo_trains_a_point_cloud_model(cache, tmp_path):
    run = tmp_path / "points"
    out = _demo(cache, run, "--records", "--steps", "3", "--log-every", "1", timeout=250)
    assert "point-cloud denoiser" in out and re.search(r"steps\s+0 -> 3 in", out)
    assert "samples/s over 2 rank(s), 6 samples" in out
    assert (run / "checkpoints" / "step-000000003.pt").exists()
    assert sorted(_losses(run)) == [1, 2, 3]


@pytest.mark.timeout(120)
def test_cli_runs_from_a_bare_environment(cache, tmp_path):
    """Only PATH and HOME, another working directory: the installed console script stands on its own."""
    env = {"PATH": f"{Path(STOKER).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "STOKER_CACHE": str(cache)}
    version = subprocess.run([STOKER, "--version"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("stoker ")
    helped = subprocess.run([STOKER, "demo", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "--records" in helped.stdout and "--steps" in helped.stdout
    volume = cache / "demo-volume-v2.zarr"
    if not volume.exists():
        from stoker.demo.volume import ensure_volume

        ensure_volume(volume, progress=False)
    inspected = subprocess.run([STOKER, "inspect", str(volume), "--sample-shape", "16", "64", "64"], env=env,
                               cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert inspected.returncode == 0, inspected.stderr
    assert "(128, 512, 512)" in inspected.stdout and "amplification" in inspected.stdout
    bad = subprocess.run([STOKER, "demo", "--steps", "0"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--steps: takes a whole number of at least 1" in bad.stderr
