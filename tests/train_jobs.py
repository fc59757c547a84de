"""Rank functions for the launch tests (spawned ranks import them by module name, so not a test module)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import stoker.train as st


class Tiny(torch.nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        if unused:
            self.spare = torch.nn.Linear(8, 1)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def mse(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return ((model(batch[:, :4]).squeeze(1) - batch[:, 4]) ** 2).mean()


def global_batches(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(size, 5, generator=g) for _ in range(n)]


def describe(ctx: st.RankContext) -> dict:
    """Every rank's view of itself, gathered to rank 0."""
    mine = {"rank": ctx.rank, "local_rank": ctx.local_rank, "world": ctx.world_size, "device": str(ctx.device),
            "backend": ctx.backend, "env_rank": os.environ.get("RANK"), "threads": torch.get_num_threads(),
            "pg_world": dist.get_world_size()}
    out = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return {"ranks": out}


def rank1_raises(ctx: st.RankContext) -> None:
    """Rank 1 fails; rank 0 is meanwhile blocked in a collective rank 1 will never join."""
    if ctx.rank == 1:
        time.sleep(0.2)
        raise ValueError("boom from rank 1: bad sample 42")
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(60)  # not reached normally; the test fails on time if rank 0 is left running


def unused_parameter(ctx: st.RankContext) -> None:
    model = Tiny(unused=True)
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, device=ctx.device, progress=False)
    trainer.fit(global_batches(4, 4), steps=2, resume=None)


def ddp_accumulate(ctx: st.RankContext, n_steps: int) -> dict:
    """Each rank takes its half of every global batch in 2 micro-batches of 1 row (accumulate=2)."""
    model = Tiny()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, device=ctx.device,
                         accumulate=2, progress=False)
    micro = []
    for gb in global_batches(n_steps, 4):
        mine = gb[ctx.rank * 2: ctx.rank * 2 + 2]
        micro += [mine[0:1], mine[1:2]]
    calls = {"no_sync": 0}
    real_no_sync = trainer.model.no_sync

    def counting_no_sync():
        calls["no_sync"] += 1
        return real_no_sync()

    trainer.model.no_sync = counting_no_sync
    result = trainer.fit(micro, steps=n_steps, resume=None)
    params = [p.detach().clone() for p in trainer.module.parameters()]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, params)
    return {"params": gathered, "no_sync": calls["no_sync"], "samples": result.samples, "step": result.step}


def rank1_killed(ctx: st.RankContext) -> None:
    """Rank 1 vanishes without a Python error (as under the OOM killer); rank 0 waits in a collective."""
    if ctx.rank == 1:
        import signal

        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(60)


def rank0_cannot_write_checkpoint(ctx: st.RankContext, directory: str) -> None:
    """Rank 0's checkpoint directory is a file: every rank must learn it, no rank hangs."""
    model = Tiny()
    ck = st.Checkpoints(directory, every=1)
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, checkpoints=ck, progress=False)
    trainer.fit(global_batches(2, 4), steps=2, resume=None)


def wait_to_be_killed(ctx: st.RankContext, flag: str) -> None:
    """Say the launch is under way, then wait for the test to SIGKILL this process."""
    with open(flag, "w") as f:
        f.write("running")
    time.sleep(60)


def background_writer(ctx: st.RankContext, path: str) -> None:
    """A non-daemon thread still working when fn returns must finish before the rank exits."""
    import threading

    def later():
        time.sleep(0.5)
        with open(f"{path}.{ctx.rank}", "w") as f:
            f.write("done")

    threading.Thread(target=later).start()


class _HangsOnRank1:
    """Batches; on rank 1 the third one never comes (a read stuck on a hung file system)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == 2 and dist.get_rank() == 1:
                time.sleep(600)
            yield batch


def rank1_hangs_in_data(ctx: st.RankContext) -> None:
    """Rank 1 hangs fetching its third batch while rank 0 waits in that step's gradient all-reduce."""
    model = Tiny()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, device=ctx.device, progress=False)
    trainer.fit(_HangsOnRank1(global_batches(6, 4)), steps=6, resume=None)



def nonfinite_on_rank1_and_eval(ctx: st.RankContext) -> dict:
    """Rank 1's loss is NaN at step 2: both ranks skip it. Then an evaluation over unequal shares (rank 0 holds
    two batches, rank 1 one) gives every rank the loss over all of them."""
    model = Tiny()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, device=ctx.device, progress=False)
    mine = [gb[ctx.rank * 2: ctx.rank * 2 + 2].clone() for gb in global_batches(3, 4)]
    if ctx.rank == 1:
        mine[1][0, 0] = float("nan")
    evals = global_batches(5, 3)[3:] if ctx.rank == 0 else [global_batches(6, 3)[5][:1]]
    result = trainer.fit(mine, steps=3, resume=None, eval_data=evals)
    params = [p.detach().clone() for p in trainer.module.parameters()]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"params": params, "skipped": result.skipped_steps,
                                      "eval": result.eval_losses, "losses": result.losses})
    return {"ranks": gathered}


def telemetry_of_two_ranks(ctx: st.RankContext, directory: str) -> dict:
    """Each rank trains on its own half of the global batches (other losses on each rank), logging every
    step: rank 0's telemetry record of a step is written after the ranks' losses are reduced."""
    model = Tiny()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, device=ctx.device, progress=False,
                         telemetry_dir=directory, log_every=1)
    mine = [gb[ctx.rank * 2: ctx.rank * 2 + 2].clone() * (1 + 3 * ctx.rank) for gb in global_batches(3, 4)]
    result = trainer.fit(mine, steps=3, resume=None)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"losses": result.losses, "telemetry": str(result.telemetry or "")})
    return {"ranks": gathered}


if __name__ == "__main__":
    # Under torchrun: launch() runs describe() in this process as one rank; every rank prints what it saw.
    import json

    out = st.launch(describe)
    rank = int(os.environ["RANK"])
    with open(f"rankinfo-{rank}.json", "w") as f:  # in the working directory; stdout lines would interleave
        json.dump(out["ranks"][rank], f)
