"""Which executor makes a pipeline's batches: the choice, kept apart from the contract (:mod:`.executor`)
that every executor implements, so the contract imports none of them.

>>> make_executor(stoker.Config(batch_size=8), torch.device("cpu"), stats, store)
<stoker.engine.cpu.executor.CpuExecutor ...>
>>> decode_on("auto", torch.device("cpu"), lambda: True)
'cpu'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..errors import InvalidArgument
from .executor import Executor

if TYPE_CHECKING:
    from ..config import Config
    from ..storage import LocalStore
    from .stats import StatsRecorder


#: "auto" decodes on the GPU alone up to this many compute threads: on an H200 the GPU decode (1.5-1.9 cores
#: busy) gave 0.87-2.37x the CPU decode on 2 threads but 0.22-0.34x on 16 (scenarios 1, 3, 7, 8;
#: docs/performance.md). The hybrid decode is asked for by name until its device side has been measured on a
#: GPU (issue 48 wants "auto" to pick it once it is never slower than the better of CPU and hybrid).
AUTO_GPU_MAX_THREADS = 2


def decode_on(requested: str, device: torch.device, nvcomp_available: Callable[[], bool],
              compute_threads: int = AUTO_GPU_MAX_THREADS + 1) -> str:
    """Where a pipeline on ``device`` decodes its chunks for ``Config.decode_on=requested``: "cpu", "gpu" or
    "hybrid".

    "auto" is the GPU decode on a CUDA device with nvCOMP installed and at most
    :data:`AUTO_GPU_MAX_THREADS` ``compute_threads``, else the CPU's; "hybrid" (both, :mod:`.hybrid`) is
    asked for by name. "gpu" and "hybrid" need a CUDA device and NVIDIA nvCOMP (InvalidArgument saying which
    is missing)."""
    if requested == "auto":
        pays = device.type == "cuda" and compute_threads <= AUTO_GPU_MAX_THREADS and nvcomp_available()
        return "gpu" if pays else "cpu"
    if requested not in ("gpu", "hybrid"):
        return "cpu"
    if device.type != "cuda":
        raise InvalidArgument(f"Config.decode_on={requested!r} decodes chunks on a CUDA device, but this pipeline "
                              f"runs on {device}: set Config.device to a GPU (device=local_rank after "
                              "torch.cuda.set_device(local_rank)), or use decode_on='cpu'", knob="decode_on")
    if not nvcomp_available():
        raise InvalidArgument(f"Config.decode_on={requested!r} needs NVIDIA nvCOMP's library package, which is not "
                              "installed or does not load: "
                              "pip install 'stoker[gpu]' (nvCOMP for CUDA 12; 'stoker[gpu-cu13]' for a CUDA 13 "
                              "torch), or use decode_on='cpu'", knob="decode_on")
    return requested


def make_executor(cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore) -> Executor:
    """The executor for batches on ``device``: the hybrid one (``decode_on="hybrid"``: chunks shared between
    the CPU engine and the GPU decode), the GPU-decode one (``decode_on="gpu"``: chunks decoded on the
    device), CUDA's (pinned staging, copy and cast on the GPU) or the CPU's."""
    from .gpu import nvcomp

    where = decode_on(cfg.decode_on, device, nvcomp.available, cfg.compute_threads)
    if where == "hybrid":
        from .hybrid.executor import HybridExecutor

        return HybridExecutor(cfg, device, stats, store)
    if where == "gpu":
        from .gpu.executor import GpuDecodeExecutor

        return GpuDecodeExecutor(cfg, device, stats, store)
    if device.type == "cuda":
        from .cuda.transfer import CudaExecutor

        return CudaExecutor(cfg, device, stats, store)
    from .cpu.executor import CpuExecutor

    return CpuExecutor(cfg, stats, store)
