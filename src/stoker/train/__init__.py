"""Training with stoker: launch ranks, run a DDP loop with checkpoints, feed it crop batches.

>>> import stoker.train as st
>>> def main(ctx: st.RankContext) -> None:
...     source = stoker.RandomCrops(["/data/vol.zarr"], (32, 64, 64), seed=0).for_rank(ctx.rank, ctx.world_size)
...     data = ctx.manage(st.CropBatches(source, stoker.Config(batch_size=8, sample_shape=(32, 64, 64))))
...     trainer = st.Trainer(model, optimizer, loss_fn, device=ctx.device, amp="bf16",
...                          checkpoints=st.Checkpoints("runs/a/ckpt", every=100))
...     trainer.fit(data, steps=10_000, resume="auto")
>>> st.launch(main)          # one rank per GPU, or 2 CPU ranks; under torchrun, this process's rank

Modules: :mod:`~stoker.train.launch` (ranks and teardown), :mod:`~stoker.train.trainer`
(the loop), :mod:`~stoker.train.checkpoint` (atomic rotating files),
:mod:`~stoker.train.data` (``CropBatches``).
"""

from ..errors import CheckpointError, NonFiniteLoss, RankFailed, UnusedParameters
from .checkpoint import Checkpoints
from .data import CropBatches
from .launch import RankContext, launch, under_torchrun
from .trainer import FitResult, Trainer

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "CropBatches",
    "FitResult",
    "NonFiniteLoss",
    "RankContext",
    "RankFailed",
    "Trainer",
    "UnusedParameters",
    "launch",
    "under_torchrun",
]
