"""``stoker demo``: train a small model with DDP on data stoker streams, then say where the time went.

With no arguments it works on any machine: it writes a synthetic dataset once
(into ``$STOKER_CACHE`` or ``~/.cache/stoker``), then trains for about a minute on
one rank per GPU, or on 2 CPU processes, checkpointing as it goes. Run it again
and it continues from the last checkpoint. ``--records`` trains a point-cloud
model on a record dataset with precomputed k-NN edges instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..errors import InvalidArgument
from .args import at_least_one, unwritable

DEFAULT_SECONDS = 45.0


def run(args: argparse.Namespace) -> int:
    from ..demo.run import DemoSettings, format_summary, records_job, volume_job
    from ..demo.volume import cache_dir
    from ..train import launch
    from ..train import under_torchrun

    use_cuda = torch.cuda.is_available() and not args.cpu
    nprocs = args.nprocs or (torch.cuda.device_count() if use_cuda else 2)
    # Under torchrun (one or many nodes) this process is one rank of the job: rank 0 alone speaks.
    torchrun = under_torchrun()
    speaks = not torchrun or os.environ.get("RANK") == "0"
    seconds = args.seconds if args.seconds is not None else (None if args.steps is not None else DEFAULT_SECONDS)
    kind = "records" if args.records else "volume"
    run_dir = Path(args.run_dir) if args.run_dir else cache_dir() / "runs" / f"demo-{kind}"
    why = unwritable(run_dir / "telemetry.jsonl")  # now, not after every rank trained a step
    if why is not None:
        raise InvalidArgument(f"--run-dir {run_dir}: cannot write the run there: {why}; give a folder (made if "
                              "missing)")

    # Data is made here, before any rank starts (under torchrun: by every rank, into a cache that may be
    # shared by several nodes; the writers are write-once: one writes, the others reuse its result).
    if args.records:
        from ..demo.points import ensure_knn, write_point_clouds

        data = write_point_clouds(cache_dir() / "demo-points.zarr")
        ensure_knn(data, k=16)
        title, job = "point-cloud denoiser (EdgeConv on k-NN edges, Chamfer loss)", records_job
        batch_size = args.batch_size or 8
    else:
        from ..demo.volume import default_volume_path, ensure_volume

        data = ensure_volume(default_volume_path())
        title, job = "3D conv denoiser on random crops", volume_job
        batch_size = args.batch_size or 4
    settings = DemoSettings(
        data=os.fspath(data), run_dir=os.fspath(run_dir), steps=args.steps, seconds=seconds,
        batch_size=batch_size, accumulate=args.accumulate, checkpoint_every=args.checkpoint_every,
        resume=not args.fresh, progress=not args.no_progress, log_every=args.log_every, fresh=args.fresh,
    )
    budget = f"{seconds:.0f} s" if seconds is not None else "no time limit"
    target = f"up to step {args.steps}" if args.steps is not None else "no step limit"
    if torchrun:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
        devices = (f"{os.environ['WORLD_SIZE']} {'GPU' if use_cuda else 'CPU'} rank(s) on {nodes} node(s) "
                   f"({'nccl' if use_cuda else 'gloo'}, torchrun)")
    else:
        devices = f"{nprocs} GPU rank(s) (nccl)" if use_cuda else f"{nprocs} CPU rank(s) (gloo)"
    if speaks:
        print(f"stoker demo: {title}; data {data}; {devices}; {budget}, {target}; {_start(run_dir, args.fresh)}",
              flush=True)
    result = launch(job, settings, nprocs=nprocs, use_cuda=use_cuda)
    if speaks:
        picture = None
        from . import plots

        if result.telemetry is not None and result.telemetry.is_file() and plots.available():
            picture = plots.plot_telemetry(result.telemetry, run_dir / "telemetry.png")
        print(format_summary(title, result, devices, picture, log_every=args.log_every))
    return 0


def _start(run_dir: Path, fresh: bool) -> str:
    """Where the run starts, for the header: from the newest checkpoint's step, or from step 0. (The ranks
    then load the newest one that reads back; a damaged one is set aside and the summary says which.)"""
    if fresh:
        return "starting at step 0 (--fresh)"
    from ..train import Checkpoints

    found = Checkpoints(run_dir / "checkpoints").list()
    return f"resuming from step {found[-1][0]} ({found[-1][1]})" if found else "starting at step 0"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train a small model with DDP on data stoker streams (about a minute)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", action="store_true", help="point clouds on a record dataset instead of volume crops")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="train until this optimizer step (counting resumed steps); no time limit unless --seconds")
    p.add_argument("--seconds", type=_seconds, default=None,
                   help=f"train for this long in this run (default {DEFAULT_SECONDS:.0f} when --steps is not given)")
    p.add_argument("--nprocs", type=_positive_int, default=None, help="ranks (default: GPUs, or 2 CPU processes)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are present")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="samples per micro-batch and rank")
    p.add_argument("--accumulate", type=_positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--checkpoint-every", type=_positive_int, default=25, help="steps between checkpoints")
    p.add_argument("--log-every", type=_positive_int, default=5, help="steps between telemetry records")
    p.add_argument("--run-dir", default=None, help="checkpoints and telemetry (default: in the stoker cache)")
    p.add_argument("--fresh", action="store_true",
                   help="delete the checkpoints and telemetry earlier runs wrote into the run directory (nothing "
                        "else in it) and start from step 0")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


_positive_int = at_least_one("a whole number")


def _seconds(text: str) -> float:
    """``--seconds``: a number above 0 (``inf``: no time limit, the progress bar then counts steps)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"takes seconds (a number above 0), got {text!r}")
    return value
