"""The per-rank jobs behind ``stoker demo`` and the summary it prints.

Both jobs are ordinary users of the public API: a sample source sharded by rank,
a data stream (``CropBatches`` or the record ``Loader``), and ``stoker.train.Trainer``
with checkpoints and telemetry. ``launch`` runs them on 2 CPU ranks or one rank per GPU.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Config
from ..sampling.samplers import RandomCrops
from ..train import Checkpoints, CropBatches, FitResult, RankContext, Trainer

__all__ = ["DemoSettings", "format_summary", "records_job", "volume_job"]


@dataclass(frozen=True)
class DemoSettings:
    """What the CLI decided; picklable, so spawned ranks receive it."""

    data: str
    run_dir: str
    steps: int | None
    seconds: float | None
    batch_size: int
    accumulate: int
    checkpoint_every: int
    resume: bool
    progress: bool = True
    log_every: int = 5
    seed: int = 0
    fresh: bool = False  # delete what earlier runs wrote into run_dir first (rank 0, while the others wait)


def _amp(ctx: RankContext) -> str | None:
    # bf16 autocast pays off on GPUs; on CPUs without bf16 units it is slower than fp32.
    return "bf16" if ctx.device.type == "cuda" else None


#: What a demo run writes into its run folder: checkpoints, the telemetry (and its TensorBoard scalars) and the
#: picture of it. ``--fresh`` deletes these and nothing else: the folder may be one of the user's own.
RUN_OUTPUTS = ("checkpoints", "telemetry.jsonl", "telemetry.png", "events.out.tfevents.*")


def _fresh_start(ctx: RankContext, s: DemoSettings) -> None:
    """``--fresh``: rank 0 deletes what earlier runs wrote into the run folder (shared by every rank and
    node) before anyone uses it; never the folder's other files (``--run-dir .`` in a project once deleted
    the project)."""
    if s.fresh:
        if ctx.is_main:
            for pattern in RUN_OUTPUTS:
                for path in Path(s.run_dir).glob(pattern):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink(missing_ok=True)
        ctx.barrier()


def _trainer(ctx: RankContext, s: DemoSettings, model: torch.nn.Module, loss_fn, lr: float) -> Trainer:
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed crop shapes: let cuDNN pick the fastest kernels once
    # After the model is built (same weights everywhere): each rank draws its own noise and dropout.
    torch.manual_seed(s.seed + ctx.rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return Trainer(model, optimizer, loss_fn, device=ctx.device, amp=_amp(ctx), accumulate=s.accumulate,
                   checkpoints=Checkpoints(Path(s.run_dir) / "checkpoints", every=s.checkpoint_every, keep=3),
                   telemetry_dir=s.run_dir, log_every=s.log_every, progress=s.progress and ctx.is_main)


def volume_job(ctx: RankContext, s: DemoSettings) -> FitResult:
    """A 3D conv denoiser on random crops of the demo volume, streamed by this rank's Pipeline."""
    from .volume import CROP, Denoiser3D, denoise_loss

    _fresh_start(ctx, s)
    torch.manual_seed(s.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = Denoiser3D()
    source = RandomCrops([s.data], CROP, seed=s.seed).for_rank(ctx.rank, ctx.world_size)
    # compute threads: the default, this rank's share of the usable CPUs (torch's thread count was not
    # divided among GPU ranks, so 8 GPU ranks each took every core)
    cfg = Config(batch_size=s.batch_size, sample_shape=CROP, dtype="f32", n_io_threads=2, host_buffer_bytes=64 << 20)
    data = ctx.manage(CropBatches(source, cfg, device=ctx.device))
    trainer = _trainer(ctx, s, model, denoise_loss, lr=2e-3)
    return trainer.fit(data, steps=s.steps, seconds=s.seconds, resume="auto" if s.resume else None)


def records_job(ctx: RankContext, s: DemoSettings) -> FitResult:
    """A point-cloud denoiser on variable-size records with precomputed k-NN edges (Chamfer loss)."""
    from ..records import Concat, Loader, ZarrRecords
    from .points import PointDenoiser, make_loss_fn

    _fresh_start(ctx, s)
    torch.manual_seed(s.seed)
    model = PointDenoiser()
    ds = ZarrRecords(s.data, fields=["noisy", "clean", "knn16"])
    loader = ctx.manage(Loader(ds, batch_size=s.batch_size, collate=Concat(increment={"knn16": "noisy"}),
                               seed=s.seed, n_threads=2, rank=ctx.rank, world_size=ctx.world_size,
                               device=ctx.device if ctx.device.type == "cuda" else None))
    trainer = _trainer(ctx, s, model, make_loss_fn("knn16"), lr=3e-3)
    return trainer.fit(loader, steps=s.steps, seconds=s.seconds, resume="auto" if s.resume else None)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def format_summary(title: str, r: FitResult, devices: str, picture: Path | None = None,
                   log_every: int | None = None) -> str:
    """The closing report: throughput, where time went, amplification, memory, and where files are
    (``picture``: the telemetry plot written, if any; ``log_every``: the steps between telemetry records, named
    when the run ended before its first one and so wrote no telemetry file)."""
    lines = [f"{title} on {devices}"]
    if r.resumed_from is not None:
        lines.append(f"  resumed      from {r.resumed_from}")
    if r.steps_run == 0:
        lines.append(f"  steps        nothing to do: already at step {r.step} (raise --steps, or --fresh)")
    else:
        losses = [r.losses[k] for k in sorted(r.losses)]
        tail = losses[-min(10, len(losses)):]
        lines.append(f"  steps        {r.start_step} -> {r.step} in {r.elapsed_s:.1f} s")
        lines.append(f"  loss         {losses[0]:.4f} (first step) -> {sum(tail) / len(tail):.4f} "
                     f"(mean of last {len(tail)}, rank 0)")
        lines.append(f"  throughput   {r.samples_per_s:,.1f} samples/s over {r.world_size} rank(s), "
                     f"{r.samples:,} samples")
        lines.append(f"  data wait    {100 * r.data_wait_fraction:.1f}% of step time on the rank that waited most "
                     f"({r.data_wait_s:.2f} s waiting; {r.compute_s:.1f} s computing, the most of any rank)")
        if r.skipped_steps:
            lines.append(f"  skipped      {r.skipped_steps} step(s) whose loss was NaN or infinite")
    p = r.pipeline
    if p is not None and p.totals.samples:
        stages = ", ".join(f"{name} {m.seconds:.2f} s" for name, m in p.totals.stages.items()
                           if m.count and name != "transfer")
        lines.append(f"  pipeline     {stages} (summed over ranks and threads)")
        read_amp = p.read_amplification
        decode_amp = p.decode_amplification
        if math.isfinite(read_amp) and math.isfinite(decode_amp):
            lines.append(f"  amplification read {read_amp:.2f}x, decode {decode_amp:.2f}x (bytes read/decoded per "
                         "byte the crops need)")
        lines.append(f"  host buffers {_mib(p.max_peak_host_bytes)} peak on the largest rank")
    mem = f"  peak memory  host RSS {_mib(r.peak_host_rss_bytes)} (largest rank)"
    if r.peak_cuda_bytes is not None:
        mem += f", CUDA allocated {_mib(r.peak_cuda_bytes)} (largest rank)"
    lines.append(mem)
    if r.checkpoint is not None:
        lines.append(f"  checkpoint   {r.checkpoint} (run again to continue from it)")
    if r.telemetry is not None and not r.telemetry.is_file():
        # the Trainer records every log_every steps only: a shorter run (and no earlier one) wrote nothing, so
        # there is neither a file to name nor a picture to draw
        every = f" (one every {log_every} steps, --log-every {log_every})" if log_every else ""
        lines.append(f"  telemetry    none: the run ended before its first record{every}")
    elif r.telemetry is not None:
        board = f" (tensorboard --logdir {r.telemetry.parent})" if importlib.util.find_spec("tensorboard") else ""
        lines.append(f"  telemetry    {r.telemetry}{board}")
        if picture is not None:
            lines.append(f"  picture      {picture} (loss, samples/s and data wait over steps)")
        else:
            lines.append(f"  picture      none: pip install 'stoker[plot]', then stoker plot {r.telemetry.parent}")
    return "\n".join(lines)
