"""``stoker doctor``: what this machine and environment give stoker, for bug reports and first runs.

Versions of stoker and what it builds on, whether the compiled reader loaded (and which codecs it
decodes), the GPUs torch sees, the CPUs this process may run on, and the limits that bite training jobs:
locked memory (RDMA), open files, and ``/dev/shm`` (which stoker does not use, but DataLoader worker
processes do).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

# below these a training job's data loading is known to struggle (numbers say when; the lines say why)
_FEW_OPEN_FILES = 4096
_SMALL_SHM = 1 << 30


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "unlimited"
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _limit(name: str) -> tuple[int | None, int | None] | None:
    """A resource limit's (soft, hard), None meaning unlimited; None where the platform has none."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    which = getattr(resource, name, None)
    if which is None:
        return None
    soft, hard = resource.getrlimit(which)
    return (None if soft == resource.RLIM_INFINITY else soft, None if hard == resource.RLIM_INFINITY else hard)


def report() -> list[tuple[str, str, str | None]]:
    """``(what, value, advice or None)`` rows, in the order printed."""
    import torch

    from .. import __version__
    from ..engine.cpu import native
    from ..config import default_compute_threads, usable_cpus

    rows: list[tuple[str, str, str | None]] = [
        ("stoker", __version__, None),
        ("python", f"{platform.python_version()} ({sys.executable})", None),
        ("platform", platform.platform(), None),
        ("torch", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})", None),
    ]
    # tensorstore: a bench peer; tensorboard and matplotlib: optional extras for telemetry and pictures
    rows += [(p, _version(p), None)
             for p in ("numpy", "numcodecs", "zarr", "tensorstore", "tensorboard", "matplotlib")]
    if native.Engine is None:
        why, fix = native.why_off() or ("unknown", "please report it")
        rows.append(("compiled reader", f"off: {why}", "every chunk takes the Python path, about 2x slower (1.9-2.6x "
                                                        f"on stoker bench scenarios 1, 6 and 8: README); {fix}"))
    else:
        # each codec the engine was handed (gzip and zlib both through zlib's inflate); the rest take numcodecs
        codecs = ", ".join(n for n, on in (("zstd", native.zstd), ("blosc", native.blosc), ("lz4", native.lz4_ready),
                                           ("gzip", native.zlib_ready), ("zlib", native.zlib_ready)) if on)
        rows.append(("compiled reader", f"loaded; decodes {codecs}", None))
    if torch.cuda.is_available():
        gpus = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        rows.append(("GPUs", f"{len(gpus)} ({'; '.join(gpus)})", None))
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        rows.append(("GPUs", f"none visible to torch{hint}", None))
    cpus, machine = usable_cpus(), os.cpu_count() or 0
    rows.append(("CPUs", f"{cpus} usable of {machine} (affinity mask); default compute threads per pipeline "
                         f"{default_compute_threads()}", None))
    memlock = _limit("RLIMIT_MEMLOCK")
    if memlock is not None:
        soft = memlock[0]
        advice = ("NCCL over InfiniBand (RDMA) registers memory under this limit and wants it unlimited "
                  "(ulimit -l unlimited, memlock in limits.conf or the container's ulimits)"
                  if soft is not None and soft < 64 << 20 else None)
        rows.append(("locked memory", _size(soft), advice))
    nofile = _limit("RLIMIT_NOFILE")
    if nofile is not None:
        soft, hard = nofile
        advice = (f"below {_FEW_OPEN_FILES}: many arrays, shards and DataLoader workers exhaust it; raise it "
                  "(ulimit -n)" if soft is not None and soft < _FEW_OPEN_FILES else None)
        rows.append(("open files", f"{soft if soft is not None else 'unlimited'} (hard "
                                   f"{hard if hard is not None else 'unlimited'})", advice))
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
        advice = ("small: DataLoader worker processes pass batches through it (stoker's Pipeline does not)"
                  if shm < _SMALL_SHM else None)
        rows.append(("/dev/shm", _size(shm), advice))
    except OSError:
        rows.append(("/dev/shm", "absent", None))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = report()
    width = max(len(what) for what, _, _ in rows)
    for what, value, advice in rows:
        print(f"{what:<{width}}  {value}")
        if advice:
            print(f"{'':<{width}}  -> {advice}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="versions, the compiled reader, GPUs, CPUs and the limits that matter",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
