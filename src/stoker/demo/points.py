"""The point-cloud task behind ``stoker demo --records``: denoise noisy surface samples.

A record dataset of point clouds is written once (seeded, crash-safe), a k-NN
graph of every record's noisy points is precomputed into the records, and a small
pure-torch graph network learns to move the noisy points back onto the surface
under a Chamfer loss::

    >>> from stoker.records import Concat, Loader, ZarrRecords
    >>> root = write_point_clouds("/tmp/clouds", n_records=256)   # reused when complete
    >>> knn = ensure_knn(root, k=16)                                 # "knn16"; collective under torch.distributed
    >>> ds = ZarrRecords(root, fields=["noisy", "clean", knn])
    >>> model, loss_fn = PointDenoiser(), make_loss_fn(knn)
    >>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    >>> with Loader(ds, batch_size=8, collate=Concat(increment={knn: "noisy"})) as loader:
    ...     for batch in loader:
    ...         opt.zero_grad(); loss = loss_fn(model, batch); loss.backward(); opt.step()

Each record is a Zarr group ``rNNNNN`` holding float32 arrays ``clean`` (N, 3),
points on the surface of a random solid (sphere, torus, box or cylinder, randomly
scaled, rotated and moved), and ``noisy`` (N, 3) = ``clean`` + gaussian noise;
N varies per record. Nothing here needs torch_geometric, pytorch3d or scipy.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..checks import integer
from ..errors import InvalidArgument, RankMismatch
from ..records import ZarrRecords, knn_edge_index, knn_graph, precompute
from ..storage.fsutil import write_once

MARKER = ".complete"
"""File inside a finished dataset: JSON of the parameters it was written with."""

FORMAT = "stoker-demo-points"
VERSION = 1
SHAPES = ("sphere", "torus", "box", "cylinder")



# -- argument checks -----------------------------------------------------------------------------


def _check_params(n_records: Any, seed: Any, min_points: Any, max_points: Any, noise: Any) -> dict:
    params = {
        "n_records": integer("n_records", n_records, 1, argument="n_records"),
        "seed": integer("seed", seed, 0, argument="seed"),  # numpy's SeedSequence takes non-negative integers only
        "min_points": integer("min_points", min_points, 1, argument="min_points"),
        "max_points": integer("max_points", max_points, 1, argument="max_points"),
    }
    if params["max_points"] < params["min_points"]:
        raise InvalidArgument(f"max_points ({max_points}) must be >= min_points ({min_points})",
                              argument="max_points")
    if isinstance(noise, bool) or not isinstance(noise, (int, float, np.floating)) or not math.isfinite(noise) \
            or noise < 0:
        raise InvalidArgument(f"noise must be a finite number >= 0, got {noise!r}", argument="noise")
    params["noise"] = float(noise)
    return params


# -- the shapes ----------------------------------------------------------------------------------


def _sphere(rng: np.random.Generator, n: int) -> np.ndarray:
    p = rng.normal(size=(n, 3))
    return p / np.linalg.norm(p, axis=1, keepdims=True)  # a normalised gaussian is uniform on the sphere


def _torus(rng: np.random.Generator, n: int) -> np.ndarray:
    big, small = 1.0, rng.uniform(0.2, 0.5)
    out = np.empty((0, 2))
    # The area element is proportional to (R + r cos v): rejection keeps the density uniform on the
    # surface instead of crowding the inner rim.
    while len(out) < n:
        uv = rng.uniform(0.0, 2 * np.pi, size=(2 * n, 2))
        keep = rng.uniform(0.0, big + small, size=2 * n) < big + small * np.cos(uv[:, 1])
        out = np.concatenate([out, uv[keep]])
    u, v = out[:n, 0], out[:n, 1]
    ring = big + small * np.cos(v)
    return np.stack([ring * np.cos(u), ring * np.sin(u), small * np.sin(v)], axis=1) / (big + small)


def _box(rng: np.random.Generator, n: int) -> np.ndarray:
    half = rng.uniform(0.3, 1.0, size=3)
    # Faces chosen in proportion to their area: uniform over the whole surface.
    areas = np.array([half[1] * half[2], half[0] * half[2], half[0] * half[1]])
    axis = rng.choice(3, size=n, p=areas / areas.sum())
    p = rng.uniform(-1.0, 1.0, size=(n, 3)) * half
    side = rng.choice([-1.0, 1.0], size=n)
    p[np.arange(n), axis] = side * half[axis]
    return p / np.linalg.norm(half)


def _cylinder(rng: np.random.Generator, n: int) -> np.ndarray:
    radius, half_h = 1.0, rng.uniform(0.3, 1.2)
    side_area, cap_area = 2 * np.pi * radius * 2 * half_h, np.pi * radius ** 2
    on_side = rng.uniform(size=n) < side_area / (side_area + 2 * cap_area)
    theta = rng.uniform(0.0, 2 * np.pi, size=n)
    # sqrt of a uniform variable: uniform over the cap's disc area, not crowded at its centre.
    r = np.where(on_side, radius, radius * np.sqrt(rng.uniform(size=n)))
    z = np.where(on_side, rng.uniform(-half_h, half_h, size=n), rng.choice([-half_h, half_h], size=n))
    return np.stack([r * np.cos(theta), r * np.sin(theta), z], axis=1) / math.hypot(radius, half_h)


_MAKERS = {"sphere": _sphere, "torus": _torus, "box": _box, "cylinder": _cylinder}


def _rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))  # sign fix: a uniform (Haar) orthogonal matrix
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]  # a proper rotation, not a reflection
    return q


def make_cloud(seed: int, index: int, min_points: int, max_points: int, noise: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(clean, noisy)`` float32 ``(N, 3)`` of record ``index``: a function of its arguments only."""
    # Seeding by (seed, index) rather than one stream: any record can be regenerated on its own.
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(min_points, max_points + 1))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    p = _MAKERS[shape](rng, n)
    p = p * rng.uniform(0.6, 1.4, size=3)  # anisotropic: ellipsoids, elliptic tori...
    p = p @ _rotation(rng).T + rng.uniform(-0.5, 0.5, size=3)
    clean = p.astype(np.float32)
    noisy = (p + noise * rng.normal(size=p.shape)).astype(np.float32)
    return clean, noisy


# -- writing the dataset -------------------------------------------------------------------------


def _read_marker(root: Path) -> dict | None:
    try:
        doc = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def _is_ours(root: Path) -> bool:
    """Whether ``root`` is safe to delete: an empty directory or a group this module wrote."""
    if not root.is_dir() or root.is_symlink():
        return False
    if not any(root.iterdir()):
        return True
    try:
        doc = json.loads((root / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return isinstance(attrs, dict) and isinstance(attrs.get(FORMAT), dict)






def _write_tree(tmp: Path, params: dict, progress: bool) -> None:
    import zarr  # only writers pay for importing zarr-python
    from tqdm import tqdm

    n = params["n_records"]
    width = max(5, len(str(n - 1)))  # fixed width: sorted names are index order
    group = zarr.open_group(str(tmp), mode="w", zarr_format=3,
                            attributes={FORMAT: {"version": VERSION, "params": params}})
    for i in tqdm(range(n), desc="writing point clouds", unit="rec", disable=not progress):
        clean, noisy = make_cloud(params["seed"], i, params["min_points"], params["max_points"], params["noise"])
        rec = group.create_group(f"r{i:0{width}d}")
        # One chunk per array: a record is always read whole.
        rec.create_array("clean", data=clean, chunks=clean.shape)
        rec.create_array("noisy", data=noisy, chunks=noisy.shape)
    # The marker goes in before the rename: a dataset at `root` is complete by construction.
    (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": VERSION, "params": params}, sort_keys=True))


def write_point_clouds(root: str | os.PathLike, n_records: int = 256, seed: int = 0, min_points: int = 384,
                       max_points: int = 768, noise: float = 0.02, progress: bool = True,
                       wait_s: float | None = None) -> Path:
    """Write the point-cloud record dataset at ``root`` unless a complete one with these parameters is there.

    ``n_records`` groups ``r00000``, ``r00001``... each hold ``clean`` and ``noisy``
    float32 ``(N, 3)`` with N in ``[min_points, max_points]``; record ``i`` depends
    only on ``(seed, i)`` and the other arguments. The dataset is written to a
    hidden sibling of ``root``, flushed and renamed into place, so a crash never
    leaves a half dataset at ``root``. A dataset written with other parameters, or an
    unfinished one this module started, is replaced; anything else at ``root`` is
    refused (:class:`~stoker.errors.InvalidArgument`), never deleted. Safe to call from
    many processes at once, on any node sharing the folder: one writes, the others wait
    for it (at most ``wait_s``, see :func:`~stoker.storage.fsutil.claim`) and reuse its dataset.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise InvalidArgument(f"root must be a path, got {type(root).__name__}", argument="root")
    params = _check_params(n_records, seed, min_points, max_points, noise)
    root = Path(os.path.abspath(os.fspath(root)))

    def is_complete(path: Path) -> bool:
        done = _read_marker(path)
        return done is not None and done.get("version") == VERSION and done.get("params") == params

    if not is_complete(root) and root.exists() and not _is_ours(root):
        raise InvalidArgument(f"{root} exists and is not a point-cloud dataset written by stoker; pick another "
                              "root (nothing there was changed)", argument="root", uri=str(root))
    write_once(root, lambda tmp: _write_tree(tmp, params, progress), is_complete=is_complete, wait_s=wait_s)
    return root


def ensure_knn(root: str | os.PathLike, k: int = 16) -> str:
    """Store the ``k`` nearest neighbours of every record's ``noisy`` points as field ``knn{k}``.

    An ``(N, k)`` int64 table (row ``i``: ``i``'s neighbours, nearest first; see
    :func:`~stoker.records.knn_graph`). Records that already hold it are skipped.
    Collective under ``torch.distributed`` (:func:`~stoker.records.precompute` is).
    Returns the field name.
    """
    k = integer("k", k, 1, argument="k")
    name = f"knn{k}"
    precompute(ZarrRecords(root, fields=["noisy"]), name, lambda s: knn_graph(s["noisy"], k),
               params={"k": k, "of": "noisy"})
    return name


# -- the loss ------------------------------------------------------------------------------------


def _split_by_sample(x: Tensor, batch: Tensor, n_samples: int, what: str) -> list[Tensor]:
    if batch.ndim != 1 or batch.shape[0] != x.shape[0]:
        raise RankMismatch(f"{what}_batch must have shape ({x.shape[0]},), got {tuple(batch.shape)}",
                           argument=f"{what}_batch")
    if batch.is_floating_point() or batch.dtype == torch.bool or batch.is_complex():
        raise InvalidArgument(f"{what}_batch must hold integer sample ids, got {batch.dtype}",
                              argument=f"{what}_batch")
    if batch.numel() and (int(batch.min()) < 0 or int(batch.max()) >= n_samples):
        raise InvalidArgument(f"{what}_batch holds sample ids outside [0, {n_samples})", argument=f"{what}_batch")
    counts = torch.bincount(batch, minlength=n_samples).tolist()
    if 0 in counts:
        raise InvalidArgument(f"sample {counts.index(0)} has no {what} points: its Chamfer distance is undefined",
                              argument=f"{what}_batch")
    # A stable sort makes the rows of each sample contiguous (Concat's already are; any order is accepted).
    order = torch.argsort(batch, stable=True)
    return list(x[order].split(counts))


def _nearest(a: Tensor, b: Tensor, budget: int = 1 << 22) -> Tensor:
    """Index into ``b`` of each row of ``a``'s nearest point, found ``budget`` distances at a time."""
    rows = max(1, budget // max(1, b.shape[0]))
    out = []
    for start in range(0, a.shape[0], rows):
        # Direct differences, not |a|^2 + |b|^2 - 2ab: the expansion's rounding can rank another point
        # above an identical one, so identical clouds would not score exactly 0.
        d = torch.cdist(a[start:start + rows], b, compute_mode="donot_use_mm_for_euclid_dist")
        out.append(d.argmin(dim=1))
    return torch.cat(out)


def chamfer_distance(pred: Tensor, target: Tensor, pred_batch: Tensor, target_batch: Tensor,
                     n_samples: int | None = None) -> Tensor:
    """Symmetric Chamfer distance, mean over the samples of a concatenated batch (a 0-d tensor).

    Per sample: the mean squared distance from each ``pred`` point to its nearest
    ``target`` point plus the same from ``target`` to ``pred``. Row ``i`` of ``pred``
    belongs to sample ``pred_batch[i]`` (likewise ``target``); ``n_samples`` defaults to
    the largest id + 1 and every sample needs points on both sides. Differentiable
    with respect to both clouds. Memory: about 4 MiB-element distance tiles, never a
    full ``P x T`` matrix with a graph attached.
    """
    for name, t in (("pred", pred), ("target", target)):
        if not isinstance(t, Tensor) or t.ndim != 2:
            raise RankMismatch(f"{name} must be a (P, D) tensor, got "
                               f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}", argument=name)
    if pred.shape[1] != target.shape[1]:
        raise RankMismatch(f"pred has {pred.shape[1]} coordinates per point, target {target.shape[1]}",
                           argument="target")
    if n_samples is None:
        ids = [int(b.max()) for b in (pred_batch, target_batch) if b.numel()]
        n_samples = max(ids) + 1 if ids else 0
    n_samples = integer("n_samples", n_samples, 1, argument="n_samples")
    preds = _split_by_sample(pred, pred_batch, n_samples, "pred")
    targets = _split_by_sample(target, target_batch, n_samples, "target")
    losses = []
    for p, t in zip(preds, targets):
        # The nearest neighbours are found without a graph; the loss is then the exact squared distance
        # to them, whose gradient is the gradient of the min (the min picks that pair).
        with torch.no_grad():
            p_to_t, t_to_p = _nearest(p, t), _nearest(t, p)
        forward = (p - t[p_to_t]).pow(2).sum(dim=1).mean()
        backward = (t - p[t_to_p]).pow(2).sum(dim=1).mean()
        losses.append(forward + backward)
    return torch.stack(losses).mean()


# -- the model -----------------------------------------------------------------------------------


def _mean_at(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Mean of ``values`` rows grouped by ``index`` into ``n`` rows (0 where a row gets none)."""
    total = values.new_zeros((n, values.shape[1])).index_add_(0, index, values)
    count = torch.bincount(index, minlength=n).clamp_(min=1).to(values.dtype)
    return total / count.unsqueeze(1)


class _EdgeConv(nn.Module):
    """``h_i + mean_j MLP([h_i, h_j - h_i, p_j - p_i])`` over the edges ``j -> i``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * hidden + 3, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: Tensor, rel: Tensor, src: Tensor, dst: Tensor) -> Tensor:
        hn = self.norm(h)  # pre-norm: the residual stream keeps its scale, the MLP sees O(1) inputs
        msg = self.mlp(torch.cat([hn[dst], hn[src] - hn[dst], rel], dim=1))
        return h + _mean_at(msg, dst, h.shape[0])  # residual: deep stacks start close to the identity


class PointDenoiser(nn.Module):
    """EdgeConv-style graph network predicting a displacement per point: ``points + delta``.

    ``edge_index`` is ``(2, E)`` long in the layout of :func:`~stoker.records.knn_edge_index`:
    row 0 the source (neighbour ``j``), row 1 the target (centre ``i``); messages flow
    ``j -> i`` and are averaged at ``i``. Features are built from relative positions
    only, so the output moves with a translation of the input (translation equivariant).
    """

    def __init__(self, hidden: int = 64, layers: int = 3) -> None:
        super().__init__()
        integer("hidden", hidden, 1, argument="hidden")
        integer("layers", layers, 1, argument="layers")
        self.embed = nn.Sequential(nn.Linear(3, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.layers = nn.ModuleList(_EdgeConv(hidden) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3))
        with torch.no_grad():
            # Start near the identity map (output ~ input) yet with non-zero gradients everywhere.
            self.head[-1].weight.mul_(0.01)
            self.head[-1].bias.zero_()

    def forward(self, points: Tensor, edge_index: Tensor) -> Tensor:
        if points.ndim != 2 or points.shape[1] != 3:
            raise RankMismatch(f"points must have shape (P, 3), got {tuple(points.shape)}", argument="points")
        if edge_index.ndim != 2 or edge_index.shape[0] != 2:
            raise RankMismatch(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}",
                               argument="edge_index")
        src, dst = edge_index[0], edge_index[1]
        n = points.shape[0]
        rel = points[src] - points[dst]
        # Offsets in units of each centre's mean neighbour distance: the network sees O(1) inputs whatever
        # the clouds' scale or density, and its displacement is scaled back the same way.
        scale = _mean_at(rel.norm(dim=1, keepdim=True), dst, n).clamp_(min=torch.finfo(points.dtype).tiny)
        rel = rel / scale[dst]
        # First features: the mean embedded offset to the neighbours (the local shape around i).
        h = _mean_at(self.embed(rel), dst, n)
        for layer in self.layers:
            h = layer(h, rel, src, dst)
        return points + scale * self.head(h)


# -- the training step ---------------------------------------------------------------------------


class PointsLoss:
    """``loss(model, batch)``: Chamfer distance between ``model(noisy)`` and ``clean``.

    ``batch`` comes from ``Loader(..., collate=Concat(increment={knn_field: "noisy"}))``.
    A class rather than a closure so that it pickles (spawned processes).
    """

    def __init__(self, knn_field: str = "knn16") -> None:
        if not isinstance(knn_field, str) or not knn_field:
            raise InvalidArgument(f"knn_field must be a field name, got {knn_field!r}", argument="knn_field")
        self.knn_field = knn_field

    def __call__(self, model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        missing = [f for f in ("noisy", "noisy_batch", "clean", "clean_batch", self.knn_field) if f not in batch]
        if missing:
            raise InvalidArgument(f"the batch lacks {missing}; it has {sorted(batch)} (collate with "
                                  f"Concat(increment={{{self.knn_field!r}: 'noisy'}}))", argument="batch")
        edge_index = knn_edge_index(batch[self.knn_field])
        pred = model(batch["noisy"], edge_index)
        return chamfer_distance(pred, batch["clean"], batch["noisy_batch"], batch["clean_batch"])

    def __repr__(self) -> str:
        return f"PointsLoss(knn_field={self.knn_field!r})"


def make_loss_fn(knn_field: str = "knn16") -> PointsLoss:
    """The loss for batches whose k-NN table is the field ``knn_field``."""
    return PointsLoss(knn_field)


loss_fn = make_loss_fn()

__all__ = [
    "PointDenoiser",
    "PointsLoss",
    "chamfer_distance",
    "ensure_knn",
    "loss_fn",
    "make_cloud",
    "make_loss_fn",
    "write_point_clouds",
]
