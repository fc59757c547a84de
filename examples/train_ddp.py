"""train_ddp.py: one DDP training job fed by stoker, one Pipeline per rank, every line in view.

Launch one process per GPU with torchrun:

    torchrun --standalone --nproc_per_node=8 examples/train_ddp.py --data /data/volume.zarr

On a CPU-only machine (gloo instead of NCCL; each rank gets its share of the usable CPUs as threads):

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 20

Options:

    --data STORE        a 3D Zarr array (v2 or v3, sharded or not). Default: stoker's synthetic
                        demo volume, written once to ~/.cache/stoker (or $STOKER_CACHE).
    --steps N           training steps (default 100); each rank pops one batch per step.
    --batch-size B      samples per batch, per rank (default 4).
    --crop Z Y X        crop shape (default 16 64 64).
    --seed S            seed of the crop order and of the model (default 0).
    --out DIR           where rank 0 writes checkpoint.pt (default ./runs/train_ddp).

This is the explicit version of what ``stoker.train`` packages up; nothing here is hidden
in a helper, so every line can be copied and changed.
"""

import argparse
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stoker
from stoker.demo.volume import CROP, Denoiser3D, default_volume_path, denoise_loss, ensure_volume


def crops_for_rank(uri: str, crop: tuple[int, ...], rank: int, world_size: int,
                   seed: int) -> Iterator[stoker.Sample]:
    """Yield an indefinite stream of `stoker.Sample` for this rank.

    RandomCrops fixes one global order of crops per (seed, epoch), the same on every
    rank. for_rank() gives this rank its slice of it: disjoint from the other ranks'
    slices, the same number of samples on every rank (so no rank waits in a DDP
    all-reduce for a batch that never comes), deterministic per (seed, epoch).
    "strided" hands rank r the samples r, r+W, r+2W...; use policy="contiguous" when
    the order is a curriculum you do not want to interleave.

    forever() returns a cursor that runs through this epoch, then the next ones. Unlike
    a plain generator, the Pipeline can ask the cursor where the source stood after the
    batches really popped, which is what makes pipeline.state_dict() resumable.
    """
    source = stoker.RandomCrops([uri], crop, seed=seed)
    mine = source.for_rank(rank, world_size, policy="strided")
    return mine.forever()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None, help="Zarr array to crop (default: the demo volume)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--crop", type=int, nargs=3, default=list(CROP), metavar=("Z", "Y", "X"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="./runs/train_ddp")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def main() -> None:
    args = parse_args()
    crop = tuple(args.crop)

    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

        # The CPUs this process may run on (its affinity mask: taskset, cpusets), shared by the node's ranks.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        share = max(1, cpus // local_world_size)
        if torch.cuda.is_available():
            # Tells PyTorch where new CUDA tensors land. Without it every rank's model and
            # batches go to GPU 0: the job runs at about 1/N of its speed, or runs out of memory.
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            # The ranks of a node share its cores: give each its share, not all of them.
            torch.set_num_threads(share)
            device = torch.device("cpu")

        # Different noise per rank (denoise_loss draws it from torch's global RNG); DDP
        # broadcasts rank 0's initial weights, so the model starts identical anyway.
        torch.manual_seed(args.seed + rank)

        data = args.data
        if data is None:
            # Local rank 0 of every node makes sure the volume is there: on node-local disks each
            # writes its own; on a shared file system one writes and the others wait for it and
            # reuse it (ensure_volume is write-once). Everyone else waits at the barrier.
            if local_rank == 0:
                ensure_volume(default_volume_path())
            dist.barrier()
            data = str(default_volume_path())

        model = Denoiser3D().to(device)
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        # device=local_rank binds the pipeline to this rank's GPU (the same index as set_device
        # above, checked at Pipeline(cfg)): batches are assembled in pinned memory, copied on a
        # side stream and cast on the GPU. Every knob is per rank.
        cfg = stoker.Config(
            batch_size=args.batch_size,
            sample_shape=crop,
            dtype="f32",
            host_buffer_bytes=256 << 20,        # per rank: batch slots + read/decode buffers
            n_io_threads=4,                      # per rank: tune to your storage
            n_compute_threads=share,           # this rank's share of the CPUs
            device=local_rank if device.type == "cuda" else "cpu",
        )

        with stoker.Pipeline(cfg) as p:
            # Hand the generator off once; the pipeline pulls lazily as pops free space,
            # so memory stays bounded even though crops_for_rank is unbounded.
            p.push(crops_for_rank(data, crop, rank, world_size, args.seed))

            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                with p.pop() as batch:
                    # Zero-copy view of the batch slot, (B, Z, Y, X) float32 on `device`. On a
                    # GPU this stream waits for the batch's copy; the slot is refilled only
                    # after the work queued here on it (also after the with block) is done.
                    x = torch.from_dlpack(batch)
                    loss = denoise_loss(model, x)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()             # DDP all-reduces the gradients here
                    optimizer.step()
                if rank == 0 and (step % 10 == 0 or step == args.steps):
                    print(f"step {step:>6}  loss {loss.item():.4f}", flush=True)
            elapsed = time.perf_counter() - t0

            # A collective: every rank calls it, with its own stats and wall time.
            summary = stoker.reduce_stats(p.stats(), elapsed_s=elapsed)
            # As of the last popped batch, not the ones prepared ahead: resume with step + 1.
            data_state = p.state_dict()

        if rank == 0:
            totals = summary.totals
            print(
                f"done: {args.steps} steps, {totals.samples} samples on {summary.world_size} ranks in "
                f"{elapsed:.1f} s: {totals.samples / elapsed:.1f} samples/s "
                f"(slowest rank {summary.min_samples_per_s:.1f}/s), "
                f"read amplification {summary.read_amplification:.2f}x, "
                f"max pop wait {summary.max_pop_wait_s:.2f} s",
                flush=True,
            )
            # Every rank took the same number of steps, so rank 0's data state resumes any
            # rank (even on another world size): RankShare.load_state_dict(state["data"]["sources"][0]).
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            path = out / "checkpoint.pt"
            tmp = out / f".checkpoint.pt.tmp-{os.getpid()}"
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": args.steps,
                    "data": data_state,
                },
                tmp,
            )
            os.replace(tmp, path)  # atomic: a crash mid-save never leaves a half-written checkpoint.pt
            print(f"checkpoint: {path}", flush=True)

        # Leave together, and free the DDP model (its reducer holds gloo work with tensors in it) while
        # the interpreter is whole: freed during interpreter shutdown instead, it can abort the process
        # ("terminate called without an active exception"), and torchrun then reports the rank as failed.
        dist.barrier()
        del model, optimizer
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
