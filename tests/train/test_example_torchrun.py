"""examples/train_ddp.py end to end: a real torchrun launch of two gloo ranks on the CPU.

Each launch starts two fresh interpreters that import torch, so these tests take
several seconds each; the subprocess timeouts make a hang a failure, not a stall.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_ddp.py"

VOLUME_SHAPE = (32, 128, 128)
CROP = (8, 32, 32)
STEPS, BATCH, RANKS = 6, 2, 2


def _write_volume(path: Path) -> Path:
    import zarr

    z = zarr.create_array(str(path), shape=VOLUME_SHAPE, chunks=(16, 32, 32), shards=(32, 64, 64),
                          dtype="uint16")
    zz, yy, xx = np.mgrid[0: VOLUME_SHAPE[0], 0: VOLUME_SHAPE[1], 0: VOLUME_SHAPE[2]].astype(np.float32)
    base = 2000 + 800 * np.sin(xx / 37.0 + zz / 11.0) * np.cos(yy / 23.0)
    noise = np.random.default_rng(0).normal(0, 40, size=VOLUME_SHAPE)
    z[:] = np.clip(base + noise, 0, 65535).astype(np.uint16)
    return path


def _torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # two gloo ranks on the CPU, also on a machine with fewer GPUs than ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
           str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-6000:]}"


@pytest.mark.timeout(240)
def test_train_ddp_two_ranks_trains_reports_once_and_checkpoints(tmp_path):
    data = _write_volume(tmp_path / "volume.zarr")
    out = tmp_path / "run"
    proc = _torchrun("--data", str(data), "--steps", str(STEPS), "--batch-size", str(BATCH),
                     "--crop", *map(str, CROP), "--out", str(out))
    assert proc.returncode == 0, _report(proc)

    # Rank 0 alone prints: one loss line for the last step, one summary, one checkpoint line.
    lines = proc.stdout.splitlines()
    done = [line for line in lines if line.startswith("done:")]
    assert len(done) == 1, _report(proc)
    samples = RANKS * STEPS * BATCH
    assert f"{samples} samples on {RANKS} ranks" in done[0], _report(proc)
    assert "samples/s" in done[0] and "read amplification" in done[0], _report(proc)
    assert sum(line.startswith(f"step {STEPS:>6}") for line in lines) == 1, _report(proc)
    assert sum(line.startswith("checkpoint:") for line in lines) == 1, _report(proc)

    # The checkpoint: atomically renamed into place, nothing temporary left behind.
    path = out / "checkpoint.pt"
    assert path.is_file(), _report(proc)
    assert [p.name for p in out.iterdir()] == ["checkpoint.pt"]
    ckpt = torch.load(path, weights_only=True)
    assert set(ckpt) == {"model", "optimizer", "step", "data"}
    assert ckpt["step"] == STEPS
    assert ckpt["model"] and all(not k.startswith("module.") for k in ckpt["model"])  # unwrapped from DDP
    assert ckpt["optimizer"]["state"]  # AdamW took steps

    # The data state is as of the last popped batch: STEPS batches of BATCH on each of RANKS ranks.
    assert ckpt["data"]["batches"] == STEPS
    (source,) = ckpt["data"]["sources"]
    assert {"epoch", "position", "seed", "world_size", "rank", "fingerprint"} <= set(source)
    assert source["epoch"] == 0  # 64 crops of 8x32x32 per epoch; 24 consumed
    assert source["position"] == samples
    assert source["world_size"] == RANKS and source["rank"] == 0


@pytest.mark.timeout(240)
def test_train_ddp_fails_fast_with_a_clear_error(tmp_path):
    missing = tmp_path / "missing.zarr"
    proc = _torchrun("--data", str(missing), "--steps", "3", "--batch-size", "2", "--crop", "8", "32", "32",
                     "--out", str(tmp_path / "run"), timeout=120)
    assert proc.returncode != 0, _report(proc)
    assert f"stoker.errors.NotFound: no Zarr array at {missing}" in proc.stderr, _report(proc)
    assert not (tmp_path / "run").exists()

    proc = _torchrun("--steps", "0", timeout=120)
    assert proc.returncode != 0, _report(proc)
    assert "--steps must be >= 1, got 0" in proc.stderr, _report(proc)
