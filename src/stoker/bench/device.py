"""GPU benchmarks: ``stoker bench --device cuda`` and ``stoker bench-h2d``.

``--device cuda`` runs the crop scenarios with ``dtype="bf16"``, in one process run on the same crops:

- ``stoker cpu``: the pipeline on the CPU (the batch stays in host memory);
- ``stoker cuda``: the pipeline bound to the GPU, consumed through ``torch.from_dlpack``, chunks decoded
  on the CPU into pinned staging in the source dtype, then copied and cast on a side stream;
- ``stoker gpu-decode`` (with ``--decode-on gpu`` or ``hybrid``): the same, but chunks cross encoded and
  nvCOMP decodes them on the device (``Config.decode_on="gpu"``);
- ``stoker hybrid`` (with ``--decode-on hybrid``): each batch's chunks shared between the CPU threads and the
  GPU decode (``Config.decode_on="hybrid"``); its bytes over PCIe are reported per engine (the host part,
  decoded; the device part, encoded);
- ``tensorstore``: every crop of a batch read with futures, stacked in the source dtype, then
  ``.pin_memory().to(device, non_blocking=True)`` and cast to bf16 on the device.

Targets: delivering on the GPU costs at most 10% of the CPU path's throughput; decoding on the GPU gives at
least twice the CPU-decode path's throughput with at most one CPU core busy (the ``cores`` column: the
process's CPU seconds per second in the timed window).

``bench-h2d`` measures host-to-device GB/s from pageable and from pinned memory for 1, 16 and 256 MiB,
the same for a custom nested batch pinned with :func:`stoker.pin_object`, and the pinned RAM a CUDA
pipeline holds for scenario 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..engine.pipeline.facade import Pipeline, host_slot_bytes
from ..errors import InvalidArgument
from ..device.pin import pin_object, to_device
from ..sampling.sample import Sample
from .datasets import ensure, warm_page_cache
from .runner import (Result, Scenario, split_batches, interleaved, make_samples, ratio_note, stoker_config,
                     time_pipeline, time_tensorstore)


def cuda_or_exit() -> torch.device:
    """The current CUDA device; InvalidArgument (one line and status 2 from the CLI) when there is none."""
    if not torch.cuda.is_available():
        raise InvalidArgument("torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, torch's CUDA build "
                              f"{torch.version.cuda or 'none'}): the GPU benchmarks (--device cuda, bench-h2d) need one")
    return torch.device("cuda", torch.cuda.current_device())


def run_stoker_on(samples: list[Sample], batch_size: int, itemsize: int, host_buffer_bytes: int,
                  device: torch.device | str, decode_on: str = "cpu", threads: int | None = None) -> Result:
    on_gpu = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    cfg = replace(stoker_config(batch_size, host_buffer_bytes, "bf16", str(device), threads=threads),
                  decode_on=decode_on if on_gpu else "cpu")
    clock: dict = {}
    with Pipeline(cfg) as p:
        # On the GPU a consumer kernel on every batch puts the stream fence in the timed path (microseconds).
        # On the CPU nothing consumes: a bf16 sum there cost more than the pipeline (H100 host, scenario 1:
        # 360 samples/s with it, 950-1600 f32 without), which made GPU delivery look free.
        consume = (lambda x: x.sum()) if on_gpu else (lambda x: None)
        n, seconds, _ = time_pipeline(p, samples, batch_size, consume=consume, sync=sync, clock=clock)
        stats = p.stats()
        pinned = host_slot_bytes(p) if on_gpu else 0
    crop = int(np.prod(samples[0].shape))
    name = ({"gpu": "stoker gpu-decode", "hybrid": "stoker hybrid"}.get(cfg.decode_on, "stoker cuda") if on_gpu
            else "stoker cpu")
    name += f" {threads}t" if threads else ""
    return Result(name, seconds, n * batch_size, n * batch_size * crop * itemsize, 0,
                  {"stats": stats, "pinned_bytes": pinned, "decode_on": cfg.decode_on,
                   "cores": clock["cpu"] / seconds if seconds else 0.0})


def run_tensorstore_to(samples: list[Sample], batch_size: int, itemsize: int, device: torch.device) -> Result:
    def deliver(futures):
        host = torch.from_numpy(np.stack([f.result() for f in futures]))
        x = host.pin_memory().to(device, non_blocking=True).to(torch.bfloat16)
        x.sum()
        return x

    seconds = time_tensorstore(samples, batch_size, deliver, sync=torch.cuda.synchronize)
    n = len(split_batches(samples, batch_size)) - 1
    return Result("tensorstore+pin", seconds, n * batch_size, n * batch_size * int(np.prod(samples[0].shape)) * itemsize, 0)


def run_device_scenario(sc: Scenario, root: Path, n_batches: int, batch_size: int, host_buffer_bytes: int,
                        rounds: int = 3, decode_on: str = "cpu") -> list[Result]:
    device = cuda_or_exit()
    paths = ensure(root, sc.volume)
    warm_page_cache(paths)
    samples = make_samples(paths, sc.volume.shape, sc.crop, (n_batches + 1) * batch_size, sc.grid, seed=sc.number)
    itemsize = np.dtype(sc.volume.dtype).itemsize
    peers = {
        "stoker cpu": lambda: run_stoker_on(samples, batch_size, itemsize, host_buffer_bytes, "cpu"),
        "stoker cuda": lambda: run_stoker_on(samples, batch_size, itemsize, host_buffer_bytes, device),
        "tensorstore+pin": lambda: run_tensorstore_to(samples, batch_size, itemsize, device),
    }
    if decode_on in ("gpu", "hybrid"):
        peers["stoker gpu-decode"] = lambda: run_stoker_on(samples, batch_size, itemsize, host_buffer_bytes,
                                                           device, "gpu")
        # the CPU-decode path held to about the cores the GPU decode keeps busy: what "auto" weighs
        peers["stoker cuda 2t"] = lambda: run_stoker_on(samples, batch_size, itemsize, host_buffer_bytes,
                                                        device, threads=2)
    if decode_on == "hybrid":
        peers["stoker hybrid"] = lambda: run_stoker_on(samples, batch_size, itemsize, host_buffer_bytes, device,
                                                       "hybrid")
    return list(interleaved(peers, rounds).values())


def format_device_results(sc: Scenario, results: list[Result], timed_batches: int,
                          compression: float | None = None) -> str:
    by = {r.peer: r for r in results}
    cuda, cpu = by["stoker cuda"], by["stoker cpu"]
    decoder = by.get("stoker gpu-decode")
    lines = [f"\nScenario {sc.number} on {torch.cuda.get_device_name()}: {sc.title}, bf16 out "
             f"({timed_batches} timed batches per peer{ratio_note(compression)})",
             f"{'peer':<19}{'samples/s':>11}{'MB/s':>9}{'cores':>7}{'cuda x':>9}"
             + (f"{'gpu-decode x':>14}" if decoder else "")]
    for r in results:
        cores = f"{r.extra['cores']:>7.2f}" if "cores" in r.extra else f"{'':>7}"
        row = f"{r.peer:<19}{r.samples_per_s:>11.1f}{r.mb_per_s:>9.1f}{cores}"
        row += f"{cuda.samples_per_s / r.samples_per_s:>8.2f}x" if r is not cuda and r.samples_per_s else f"{'':>9}"
        if decoder:
            row += f"{decoder.samples_per_s / r.samples_per_s:>13.2f}x" if r is not decoder and r.samples_per_s else ""
        lines.append(row)
    # the cast runs on the GPU there, so delivering to it can be faster than the CPU path: say which way it went
    speed = cuda.samples_per_s / cpu.samples_per_s if cpu.samples_per_s else None
    if speed is None:
        verdict = "GPU delivery: no CPU baseline (the CPU path delivered nothing)"
    elif speed < 1:
        verdict = f"GPU delivery costs {1 - speed:.1%} of the CPU path's throughput"
    else:
        verdict = f"GPU delivery runs at {speed:.2f}x the CPU path's throughput"
    lines.append(f"{verdict} (target: costs <= 10%); pinned staging held: {cuda.extra['pinned_bytes'] / 2**20:.0f} MiB")
    hybrid = by.get("stoker hybrid")
    for r in (cuda, decoder, hybrid):
        if r is None:
            continue
        lines.append(pcie_line(r.peer, r.extra["stats"]))
    if hybrid and cpu.samples_per_s:
        lines.append(f"hybrid decode: {hybrid.samples_per_s / cpu.samples_per_s:.2f}x the CPU path, "
                     f"{hybrid.samples_per_s / cuda.samples_per_s if cuda.samples_per_s else 0:.2f}x the CPU-decode "
                     f"CUDA path, with {hybrid.extra['cores']:.2f} CPU cores busy")
    if decoder and cuda.samples_per_s:
        lines.append(f"GPU decode: {decoder.samples_per_s / cuda.samples_per_s:.2f}x the CPU-decode path with "
                     f"{decoder.extra['cores']:.2f} CPU cores busy (target: >= 2x with <= 1 core)")
        two = by.get("stoker cuda 2t")
        if two is not None and two.samples_per_s:
            lines.append(f"GPU decode: {decoder.samples_per_s / two.samples_per_s:.2f}x the CPU-decode path on 2 "
                         f"compute threads ({two.extra['cores']:.2f} cores busy)")
    spread = [f"{r.peer} {min(r.extra['rounds']):.0f}-{max(r.extra['rounds']):.0f}" for r in results
              if len(r.extra.get("rounds", ())) > 1]
    if spread:
        lines.append(f"rounds: {len(cuda.extra['rounds'])} interleaved, median shown; range: " + ", ".join(spread))
    return "\n".join(lines)


def pcie_line(peer: str, stats) -> str:
    """``peer``'s bytes over PCIe per batch; per engine where both crossed (decode_on="hybrid": the host part,
    decoded by the CPU engine, and the device part, encoded for the GPU decode).

    >>> pcie_line("stoker hybrid", stats)
    'stoker hybrid: bytes over PCIe per batch 9,000,000 (host part 6,000,000, device part 3,000,000; ...)'
    """
    n = max(1, stats.batches_emitted)
    host = getattr(stats, "bytes_to_device_host", 0)
    split = (f"host part {host / n:,.0f}, device part {(stats.bytes_to_device - host) / n:,.0f}; "
             if host else "")
    return (f"{peer}: bytes over PCIe per batch {stats.bytes_to_device / n:,.0f} ({split}encoded bytes read per "
            f"batch {stats.bytes_read / n:,.0f})")


# -- host to device ---------------------------------------------------------------------------------


@dataclass
class _Frame:
    """A custom nested batch: what DataLoader(pin_memory=True) would silently leave pageable."""

    points: np.ndarray
    features: torch.Tensor
    meta: dict = field(default_factory=dict)


def _gbps(fn, nbytes: int, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return nbytes * repeat / (time.perf_counter() - t0) / 1e9


def run_h2d(sizes_mib: tuple[int, ...] = (1, 16, 256)) -> str:
    device = cuda_or_exit()
    lines = [f"host-to-device on {torch.cuda.get_device_name()} ({device})",
             f"{'size':>8}{'pageable GB/s':>15}{'pinned GB/s':>13}{'pin_object batch GB/s':>23}"]
    for mib in sizes_mib:
        nbytes = mib << 20
        repeat = max(3, min(200, (2 << 30) // nbytes))
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pageable.fill_(1)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
        # a nested batch of the same size: half in a numpy array, half in a tensor, inside a dataclass list
        half = nbytes // 2
        batch = {"frames": [_Frame(points=np.ones(half // 4, np.float32), features=torch.ones(half // 4),
                                   meta={"id": 0})]}
        pinned_batch = pin_object(batch)
        assert pinned_batch["frames"][0].features.is_pinned() and pinned_batch["frames"][0].points.is_pinned()
        lines.append(
            f"{mib:>6}Mi"
            f"{_gbps(lambda: pageable.to(device, non_blocking=True), nbytes, repeat):>15.1f}"
            f"{_gbps(lambda: pinned.to(device, non_blocking=True), nbytes, repeat):>13.1f}"
            f"{_gbps(lambda: to_device(pinned_batch, device), nbytes, repeat):>23.1f}"
        )
    return "\n".join(lines)


def pipeline_pinned_bytes(sc: Scenario, root: Path, batch_size: int, host_buffer_bytes: int) -> int:
    """Pinned host memory a CUDA pipeline holds for scenario ``sc`` (its staging slots)."""
    device = cuda_or_exit()
    paths = ensure(root, sc.volume)
    samples = make_samples(paths, sc.volume.shape, sc.crop, 2 * batch_size, sc.grid, seed=sc.number)
    with Pipeline(stoker_config(batch_size, host_buffer_bytes, "bf16", str(device))) as p:
        p.push(samples)
        with p.pop():
            pass
        return host_slot_bytes(p)
