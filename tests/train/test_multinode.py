"""Multi-node jobs on one machine: torchrun agents as nodes, rendezvous on loopback, gloo ranks on the CPU.

Each "node" is a torchrun agent (its own process group of processes). The jobs are stoker's own
(`stoker demo`, examples/train_ddp.py) and tests/multinode_job.py, which logs the samples every step
consumed so that stopping and resuming on other numbers of nodes and ranks can be checked sample by sample.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import multinode_job as job

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "multinode_job.py"
EXAMPLE = REPO / "examples" / "train_ddp.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", STOKER_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])))
    return env


class _Node:
    """One torchrun agent, in a session of its own so that it can be killed with its workers."""

    def __init__(self, torchrun_args: list[str], target: list[str], env: dict[str, str], cwd: Path) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *target]
        self.out = open(cwd / f"agent-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def output(self) -> str:
        self.out.seek(0)
        return self.out.read()[-6000:]


def _static(nnodes: int, node_rank: int, per_node: int, port: int) -> list[str]:
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={per_node}",
            "--master-addr=127.0.0.1", f"--master-port={port}"]


def _run_nodes(target: list[str], nnodes: int, per_node: int, env: dict[str, str], cwd: Path,
               stagger_s: float = 0.0, timeout: float = 240) -> None:
    """Start ``nnodes`` agents (static rendezvous, ``stagger_s`` apart) and check that all exit 0."""
    port = _free_port()
    nodes = []
    for rank in range(nnodes):
        if rank:
            time.sleep(stagger_s)
        nodes.append(_Node(_static(nnodes, rank, per_node, port), target, env, cwd))
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    try:
        for n in nodes:
            try:
                codes.append(n.proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)  # still running at the deadline: a hang, reported with every output
    finally:
        for n in nodes:
            n.kill()
    report = "\n".join(f"--- node {i} (exit {c}) ---\n{n.output()}" for i, (n, c) in enumerate(zip(nodes, codes)))
    assert codes == [0] * nnodes, report


def _run_standalone(target: list[str], ranks: int, env: dict[str, str], cwd: Path, timeout: float = 240) -> None:
    node = _Node(["--standalone", f"--nproc-per-node={ranks}"], target, env, cwd)
    code = node.wait(timeout)
    assert code == 0, node.output()


# -- the sample accounting of a stopped and resumed job ---------------------------------------------


def _crop_ids(volume: str) -> list[int]:
    """Every crop of the job's epoch, named by its first voxel (the volume's values are flat indices)."""
    import stoker

    data = np.asarray(stoker.open_array(volume).read([(0, s) for s in stoker.open_array(volume).shape]))
    grid = stoker.TileGrid([volume], job.CROP, shuffle=True, seed=1)
    return [int(data[tuple(a for a, _ in grid.sample(0, i).aabb)]) for i in range(len(grid))]


def _consumed(logs: Path, upto_step: int | None = None, world: int | None = None) -> list[int]:
    """Sample ids the logged steps consumed (steps after ``upto_step`` were lost to a crash)."""
    ids = []
    for path in sorted(logs.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if (upto_step is None or entry["step"] <= upto_step) and (world is None or entry["world"] == world):
                ids += entry["ids"]
    return ids


def _exactly_once(ids: list[int], epoch: list[int]) -> None:
    counts = Counter(ids)
    repeated = sorted(i for i, c in counts.items() if c > 1)
    lost = sorted(set(epoch) - set(counts))
    assert not repeated and not lost and set(counts) <= set(epoch), f"repeated {repeated}, lost {lost}"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mn-data")
    volume = job.crop_volume(str(root / "volume.zarr"))
    records = job.id_records(str(root / "records"))
    return {"crops": (volume, _crop_ids(volume)), "records": (records, list(range(24)))}


@pytest.mark.parametrize("kind", ["crops", "records"])
def test_a_job_of_two_nodes_resumes_on_one_node_with_every_sample_once(tmp_path, datasets, kind):
    """2 nodes x 1 rank stop after 3 steps; the checkpoint resumes on 1 node x 2 ranks and on 1 node x 1
    rank; each resumed job, with what the first consumed, covers the epoch exactly once, as an
    uninterrupted 2-node job does."""
    data, epoch = datasets[kind]
    env = _env(tmp_path / "cache")
    per_step = 4  # 2 samples per rank and step on 2 ranks

    def target(run: Path, logs: Path, steps: int) -> list[str]:
        return [str(JOB), kind, "--data", data, "--out", str(run), "--ids", str(logs), "--steps", str(steps)]

    first = tmp_path / "first"
    _run_nodes(target(first, tmp_path / "ids-first", 3), nnodes=2, per_node=1, env=env, cwd=tmp_path)
    before = _consumed(tmp_path / "ids-first")
    assert len(before) == 3 * per_step

    import shutil

    for ranks in (2, 1):
        run = tmp_path / f"resumed-on-{ranks}"
        shutil.copytree(first, run)
        steps = 3 + (len(epoch) - len(before)) // (2 * ranks)  # to the end of the epoch
        _run_standalone(target(run, tmp_path / f"ids-{ranks}", steps), ranks, env, tmp_path)
        summary = json.loads((run / "summary-0.json").read_text())
        assert (summary["start_step"], summary["step"], summary["world"]) == (3, steps, ranks)
        _exactly_once(before + _consumed(tmp_path / f"ids-{ranks}"), epoch)

    whole = tmp_path / "whole"
    _run_nodes(target(whole, tmp_path / "ids-whole", len(epoch) // per_step), nnodes=2, per_node=1, env=env,
               cwd=tmp_path)
    _exactly_once(_consumed(tmp_path / "ids-whole"), epoch)


def test_an_elastic_job_goes_on_without_a_node_that_leaves(tmp_path, datasets):
    """torchrun --nnodes=1:2 --max-restarts=1: after step 3, node 1 vanishes (its agent is killed, then its
    worker exits); node 0's worker fails in its next collective, torchrun restarts it alone, and the job
    resumes from its last checkpoint on 1 rank and finishes the epoch with every sample consumed exactly
    once (steps past the checkpoint that the dead job ran are work lost, not samples consumed)."""
    data, epoch = datasets["crops"]
    env = _env(tmp_path / "cache")
    logs, run = tmp_path / "ids", tmp_path / "run"
    port = _free_port()
    elastic = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", "--rdzv-conf=last_call_timeout=10",
               "--monitor-interval=0.5"]
    steps = 3 + (len(epoch) - 12) // 2  # 2 ranks for 3 steps, then 1 rank to the end of the epoch
    target = [str(JOB), "crops", "--data", data, "--out", str(run), "--ids", str(logs), "--steps", str(steps),
              "--leave-after", "3"]
    node0 = _Node(elastic, target, env, tmp_path)
    nodes = [node0]
    try:
        _wait_for_port(port, node0)  # node 0 hosts the rendezvous store: it must outlive node 1
        nodes.append(_Node(elastic, target, env, tmp_path))  # joins the first round (last_call_timeout)
        code = node0.wait(300)
    finally:
        for n in nodes:
            n.kill()
    assert code == 0, node0.output()
    final = json.loads((run / "summary-1.json").read_text())  # written by the restarted worker
    assert (final["restarts"], final["world"], final["step"]) == (1, 1, steps)
    resumed_at = final["start_step"]
    entries = _entries(logs)
    assert any(e["rank"] == 1 and e["world"] == 2 for e in entries)  # node 1 was there at first
    first = [e for e in entries if e["restarts"] == 0 and e["step"] <= resumed_at]
    second = [e for e in entries if e["restarts"] == 1]
    assert resumed_at >= 3 and second and all(e["world"] == 1 for e in second)
    _exactly_once([i for e in first + second for i in e["ids"]], epoch)


def _wait_for_port(port: int, node: _Node, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            assert node.proc.poll() is None and time.monotonic() < deadline, node.output()
            time.sleep(0.1)


def _entries(logs: Path) -> list[dict]:
    out = []
    for path in sorted(logs.glob("*.jsonl")) if logs.exists() else []:
        out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


# -- stoker's own jobs on two nodes, from an empty cache ---------------------------------------------


@pytest.mark.parametrize("per_node, stagger_s", [(1, 0.0), (2, 0.7), (1, 2.0)])
def test_two_nodes_run_the_example_from_an_empty_cache(tmp_path, per_node, stagger_s):
    """Every node's local rank 0 writes the demo volume into the shared cache at once (one wins, the
    other reuses it), then the ranks train; repeated with staggered starts."""
    target = [str(EXAMPLE), "--steps", "3", "--batch-size", "2", "--crop", "8", "32", "32", "--out",
              str(tmp_path / "run")]
    _run_nodes(target, nnodes=2, per_node=per_node, env=_env(tmp_path / "cache"), cwd=tmp_path,
               stagger_s=stagger_s)
    assert (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("per_node, stagger_s", [(1, 0.0), (2, 0.7)])
def test_two_nodes_run_the_demo_from_an_empty_cache(tmp_path, per_node, stagger_s):
    """Every rank of both nodes makes the demo volume at once: one writes, the others reuse it."""
    target = ["-m", "stoker", "demo", "--steps", "3", "--batch-size", "2", "--no-progress", "--checkpoint-every",
              "2", "--run-dir", str(tmp_path / "run")]
    _run_nodes(target, nnodes=2, per_node=per_node, env=_env(tmp_path / "cache"), cwd=tmp_path,
               stagger_s=stagger_s)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt"))
