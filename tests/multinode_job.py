"""A training job for the multi-node tests, run by torchrun (not a test module).

Every rank logs which samples each optimizer step consumed, so a test can check that a job stopped and
resumed on another number of nodes or ranks consumed every sample of the epoch exactly once.

    torchrun --nnodes=2 ... tests/multinode_job.py crops --data V --out RUN --ids LOGS --steps 3

``crops``: a shuffled TileGrid over a volume whose voxel values are their flat index, streamed by
CropBatches; a crop is named by its first voxel. ``records``: the records Loader over ZarrRecords whose
"id" field names each record. The model is a single linear unit: the point is the data accounting.
``--leave-after N``: node 1 (its torchrun agent and its ranks) vanishes after N steps (a node that leaves an
elastic job).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

import stoker
import stoker.train as st

CROP = (4, 8, 8)


def crop_volume(path: str, shape=(8, 32, 32)) -> str:
    """A float32 volume whose values are their flat index (exact in float32 below 2**24)."""
    import numpy as np
    import zarr

    z = zarr.create_array(path, shape=shape, chunks=(4, 16, 16), dtype="float32")
    z[:] = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return path


def id_records(root: str, n: int = 24) -> str:
    """``n`` record groups, each with an "id" (its number) and a feature vector "x"."""
    import numpy as np
    import zarr

    for i in range(n):
        g = zarr.open_group(f"{root}/rec_{i:03d}", mode="w")
        g.create_array("id", data=np.array([i], dtype=np.int64))
        g.create_array("x", data=np.full((1, 4), float(i), dtype=np.float32))
    return root


class _Logged:
    """The loss of a one-unit model, and a line per micro-batch naming the samples it consumed."""

    def __init__(self, ctx: st.RankContext, log: Path, kind: str, leave_after: int | None) -> None:
        self.ctx, self.kind, self.leave_after = ctx, kind, leave_after
        self.trainer: st.Trainer | None = None
        log.mkdir(parents=True, exist_ok=True)
        self.out = open(log / f"rank{ctx.rank}-pid{os.getpid()}.jsonl", "a", encoding="utf-8")

    def __call__(self, model: torch.nn.Module, batch) -> torch.Tensor:
        step = self.trainer.step + 1  # the optimizer step this micro-batch belongs to
        if self.leave_after is not None and self.ctx.node_rank == 1 and step > self.leave_after:
            os.kill(os.getppid(), signal.SIGKILL)  # the node goes away mid-run: its torchrun agent,
            os._exit(3)                            # then this worker, without any goodbye
        if self.kind == "crops":
            ids, x = batch[:, 0, 0, 0].long().tolist(), batch.float().mean(dim=(1, 2, 3))[:, None]
        else:
            ids, x = batch["id"].tolist(), batch["x"].mean(dim=1, keepdim=True)
        record = {"step": step, "rank": self.ctx.rank, "world": self.ctx.world_size,
                  "restarts": self.ctx.restarts, "ids": ids}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        return (model(x / 1000.0) ** 2).mean()


def main(ctx: st.RankContext, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    loss = _Logged(ctx, Path(args.ids), args.kind, args.leave_after)
    if args.kind == "crops":
        source = stoker.TileGrid([args.data], CROP, shuffle=True, seed=1).for_rank(ctx.rank, ctx.world_size)
        cfg = stoker.Config(batch_size=2, sample_shape=CROP, dtype="f32", host_buffer_bytes=16 << 20,
                            n_compute_threads=1, n_io_threads=1, device="cpu")
        data = ctx.manage(st.CropBatches(source, cfg))
    else:
        from stoker.records import Loader, ZarrRecords

        data = ctx.manage(Loader(ZarrRecords(args.data, fields=["id", "x"]), batch_size=2, seed=1, n_threads=1,
                                 rank=ctx.rank, world_size=ctx.world_size))
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, device=ctx.device,
                         checkpoints=st.Checkpoints(Path(args.out) / "ckpt", every=args.every), progress=False)
    loss.trainer = trainer
    result = trainer.fit(data, steps=args.steps, resume="auto")
    if ctx.is_main:
        summary = {"start_step": result.start_step, "step": result.step, "world": ctx.world_size,
                   "nnodes": ctx.nnodes, "restarts": ctx.restarts,
                   "resumed_from": str(result.resumed_from) if result.resumed_from else None}
        with open(Path(args.out) / f"summary-{ctx.restarts}.json", "w", encoding="utf-8") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["crops", "records"])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--leave-after", type=int, default=None)
    st.launch(main, parser.parse_args(), use_cuda=False, timeout_s=120, stall_timeout_s=60)
