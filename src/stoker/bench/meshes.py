"""``stoker bench records --mesh``: crash-simulation records batched as graphs, and k-NN at scale.

Datasets: seeded mesh records, ``mesh_pos (T, N, 3)`` float32 trajectories, ``thickness (N,)``,
``edges (2, E)`` int64 indexing the nodes and ``params (4,)``, N varying, written once with
zarr-python. Peers: the record ``Loader`` with ``Concat`` along the named dims, against a
``DataLoader`` (2 worker processes) over zarr-python with the hand collate users write (nodes joined
along N with a batch vector, edges along E offset by the nodes before them). ``knn_times`` times
``knn_graph``'s two methods (brute force: CPU and, when there is one, a CUDA device; k-d tree: CPU).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from .datasets import write_dataset
from .records import steady_rate, zarr_python_peer

SPEC = {"mesh_pos": ("T", "N", 3), "thickness": ("N",), "edges": (2, "E"), "params": (4,)}
_FORMAT = "stoker-bench-meshes"
_DL_WORKERS = 2


def ensure_meshes(root: Path, n: int, nodes: tuple[int, int], steps: int, progress: bool = True) -> Path:
    """A directory of ``n`` mesh records (reused when complete; one writer among processes racing for it)."""
    base = root / f"meshes-{n}-{nodes[0]}-{nodes[1]}-{steps}"
    marker = {"format": _FORMAT, "n": n, "nodes": list(nodes), "steps": steps}

    def complete(p: Path) -> bool:
        try:
            return json.loads((p / ".complete").read_text()) == marker
        except (OSError, ValueError):
            return False

    def write(tmp: Path) -> None:
        import zarr
        from tqdm import tqdm

        rng = np.random.default_rng(0)
        for i in tqdm(range(n), desc=f"writing {n} meshes", unit="rec", disable=not progress):
            nn = int(rng.integers(nodes[0], nodes[1] + 1))
            g = zarr.open_group(str(tmp / f"run_{i:05d}.zarr"), mode="w")
            g.create_array("mesh_pos", data=rng.normal(size=(steps, nn, 3)).astype(np.float32),
                           chunks=(steps, min(nn, 8192), 3))
            g.create_array("thickness", data=rng.random(nn).astype(np.float32))
            g.create_array("edges", data=rng.integers(0, nn, size=(2, 3 * nn)).astype(np.int64))
            g.create_array("params", data=rng.random(4).astype(np.float32))
        (tmp / ".complete").write_text(json.dumps(marker))  # last

    write_dataset(base, write, is_complete=complete)
    return base


def hand_collate(samples: list[dict]) -> dict:
    """What a user writes without ``Concat(along=...)``: nodes along N, edges along E shifted by the nodes of
    the samples before, parameters stacked, PyG's batch vector."""
    offsets, total = [], 0
    for s in samples:
        offsets.append(total)
        total += s["mesh_pos"].shape[1]
    return {
        "mesh_pos": torch.cat([s["mesh_pos"] for s in samples], dim=1),
        "thickness": torch.cat([s["thickness"] for s in samples]),
        "edges": torch.cat([s["edges"] + off for s, off in zip(samples, offsets)], dim=1),
        "params": torch.stack([s["params"] for s in samples]),
        "batch": torch.cat([torch.full((s["mesh_pos"].shape[1],), j) for j, s in enumerate(samples)]),
    }


def run_meshes(root: Path, n: int, batch_size: int, n_batches: int, nodes: tuple[int, int], steps: int) -> str:
    """The table: samples/s of both peers in steady state, on the same records."""
    from ..records import Concat, Loader, ZarrRecords

    base = ensure_meshes(root, n, nodes, steps)
    in_flight = 2 * _DL_WORKERS  # the DataLoader's prefetch (the Loader's is 2): warm-up for both
    n_batches = min(n_batches, n // batch_size - 1 - in_flight)
    if n_batches < 1:
        raise ValueError(f"{n} records are too few to time batches of {batch_size} in steady state")
    ds = ZarrRecords(base, fields=SPEC)
    threads = os.cpu_count() or 1
    samples = [ds[0], ds[1]]
    got, want = Concat(increment={"edges": "N"}).bind(ds)(samples), hand_collate(samples)
    if any(not torch.equal(got[k], want[k]) for k in want):  # both peers must make the same batch
        raise AssertionError("Concat(along) and the hand collate disagree")
    with Loader(ds, batch_size, collate=Concat(increment={"edges": "N"}), seed=0, n_threads=threads) as loader:
        stoker_rate = steady_rate(loader, n_batches, batch_size, in_flight)
    dl = zarr_python_peer(base, "run_*.zarr", tuple(SPEC), batch_size, _DL_WORKERS, hand_collate)
    dl_rate = steady_rate(dl, n_batches, batch_size, in_flight)
    return "\n".join([
        f"records --mesh: {n} meshes (T={steps}, N {nodes[0]:,}-{nodes[1]:,}, E = 3N), batch {batch_size}, "
        f"{n_batches} timed batches in steady state",
        f"{'peer':<46}{'samples/s':>11}{'stoker x':>10}",
        f"{f'stoker Loader ({threads} threads) + Concat(along)':<46}{stoker_rate:>11.1f}",
        f"{f'DataLoader({_DL_WORKERS} workers) + zarr + hand collate':<46}{dl_rate:>11.1f}"
        f"{stoker_rate / dl_rate:>9.2f}x",
    ])


def knn_times(sizes: tuple[int, ...], k: int = 16, brute_max: int = 200_000) -> str:
    """Seconds of ``knn_graph`` per method and cloud size (uniform points in the unit cube; the brute force
    on the CPU only up to ``brute_max`` points: N^2 work), checking the methods agree where both ran."""
    from ..records import knn_graph
    from ..records.knn import have_tree

    cuda = torch.cuda.is_available()
    lines = [f"knn_graph, k={k}: seconds", f"{'points':>10}{'brute cpu':>12}{'tree cpu':>12}"
             + (f"{'brute cuda':>12}" if cuda else "")]
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        pts = torch.rand(n, 3, generator=gen)
        cells, results = [], []
        for method, device, allowed in (("brute", "cpu", n <= brute_max), ("tree", "cpu", have_tree()),
                                        ("brute", "cuda", cuda)):
            if device == "cuda" and not cuda:
                continue
            if not allowed:
                cells.append(f"{'-':>12}")
                continue
            x = pts.to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = knn_graph(x, k, method=method)
            if device == "cuda":
                torch.cuda.synchronize()
            cells.append(f"{time.perf_counter() - t0:>12.3f}")
            results.append(got.cpu())
        same = all(torch.equal(results[0], r) for r in results[1:])
        lines.append(f"{n:>10,}" + "".join(cells) + ("" if same else "  METHODS DISAGREE"))
    return "\n".join(lines)


__all__ = ["SPEC", "ensure_meshes", "hand_collate", "knn_times", "run_meshes"]
