"""k nearest neighbours of a point cloud: exact, with deterministic ties, from a few points to millions.

    >>> nbr = knn_graph(points, k=16)          # LongTensor (N, 16): row i = i's neighbours, nearest first
    >>> edge_index = knn_edge_index(nbr)       # (2, N * 16): [neighbour; centre], PyG's source_to_target
    >>> precompute(ds, "knn16", lambda s: knn_graph(s["positions"][0], 16), params={"k": 16})

The result is an ``(N, k)`` table rather than an edge list: it is dense, half the
size, and what a record stores; :func:`knn_edge_index` turns it into one.

Two methods give the same table. **Brute force** (on a GPU, and for small clouds):
one chunk of rows at a time, ``chunk x N`` distances (never ``N x N``), so
about ``chunk * N * (itemsize + 2)`` bytes and ``N^2`` work. **k-d tree** (CPU clouds
of at least ``TREE_MIN_POINTS`` points in at most ``TREE_MAX_DIMS`` dims, when scipy is
installed: ``pip install stoker[knn]``): scipy's ``cKDTree`` proposes a few more
than ``k`` candidates per point, and the candidates are ranked exactly as the brute
force ranks them (the same distances, computed pair by pair in the same dtype, and
the same tie rule); a row whose candidates might
miss a tied or barely farther point (duplicates, heavy ties) is done by brute force.
Ties (equal distances, duplicate points) go to the smaller index, so the result is
the same on every run, device, chunk size and method.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import integer
from ..errors import DtypeMismatch, InvalidArgument, RankMismatch

#: Below this many points the brute force is as fast as building and querying a tree (docs/records.md).
TREE_MIN_POINTS = 4096
#: k-d trees lose their edge in many dims: beyond this the brute force is used.
TREE_MAX_DIMS = 8
# Candidates asked of the tree beyond k + 1: room for near-ties at the k-th distance.
_EXTRA = 8
# The tree's float64 distances and the ranking's squared distances (float32 at least) differ by a few
# units in the last place of the latter; a candidate set is known complete only past this margin.
_MARGIN = 1e-4
_METHODS = ("auto", "brute", "tree")


def _distance_dtype(points: torch.Tensor) -> torch.dtype:
    if points.is_complex() or points.dtype == torch.bool:
        raise DtypeMismatch(f"knn_graph needs real coordinates, got {points.dtype}")
    if not points.is_floating_point():
        return torch.float64  # exact for any integer coordinate a float32 could not hold
    return torch.float32 if points.dtype in (torch.float16, torch.bfloat16) else points.dtype


def have_tree() -> bool:
    """Whether scipy's k-d tree is installed (``pip install stoker[knn]``)."""
    try:
        import scipy.spatial  # noqa: F401 - optional dependency
    except ImportError:
        return False
    return True


def knn_graph(points: torch.Tensor, k: int, chunk: int = 4096, method: str = "auto") -> torch.Tensor:
    """Indices of the ``k`` nearest other points of every point: LongTensor ``(N, k)``.

    Row ``i`` lists ``i``'s neighbours by increasing Euclidean distance, never ``i``
    itself (a duplicate of ``i`` at distance 0 is a neighbour). Equal distances are
    ordered by index. Distances are computed in the points' float dtype (integers
    in float64, half precision in float32) on the points' device. ``method``:
    ``"brute"`` (chunks of ``chunk`` rows), ``"tree"`` (scipy's k-d tree, CPU only) or
    ``"auto"``: the tree for CPU clouds of at least ``TREE_MIN_POINTS`` points in at
    most ``TREE_MAX_DIMS`` dims when scipy is installed, else the brute force. Every
    method returns the same table.
    """
    if not isinstance(points, torch.Tensor):
        raise InvalidArgument(f"points must be a torch.Tensor (N, D), got {type(points).__name__}")
    if points.ndim != 2:
        raise RankMismatch(f"points must have shape (N, D), got {tuple(points.shape)}", shape=tuple(points.shape))
    k, chunk = integer("k", k, 1), integer("chunk", chunk, 1)
    if method not in _METHODS:
        raise InvalidArgument(f"method must be one of {_METHODS}, got {method!r}", knob="method")
    n = points.shape[0]
    if n and k > n - 1:
        raise InvalidArgument(f"k={k} neighbours asked for but there are only {n} points (k <= N - 1)", k=k, n=n)
    pts = points.detach().to(_distance_dtype(points))
    if not bool(torch.isfinite(pts).all()):
        raise InvalidArgument("points hold NaN or infinite coordinates; their distances have no order")
    if method == "tree":
        if pts.device.type != "cpu":
            raise InvalidArgument("method='tree' runs on the CPU; pass points.cpu(), or method='brute' on "
                                  f"{pts.device}", knob="method")
        if not have_tree():
            raise InvalidArgument("method='tree' needs scipy: pip install stoker[knn] (or scipy)", knob="method")
    use_tree = method == "tree" or (method == "auto" and pts.device.type == "cpu" and n >= TREE_MIN_POINTS
                                    and pts.shape[1] <= TREE_MAX_DIMS and have_tree())
    if use_tree and n:
        return _tree(pts, k, chunk)
    out = torch.empty((n, k), dtype=torch.long, device=pts.device)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(n, start + chunk), device=pts.device)
        out[start:start + len(rows)] = _rows_neighbours(pts, rows, k)
    return out


def _dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distances of the rows of ``a`` (..., m, D) to those of ``b`` (..., n, D), pair by pair.

    No matrix-product shortcut: ``|a|^2 + |b|^2 - 2ab`` rounds differently per output
    tile, which would break ties between identical points arbitrarily. Direct
    differences round the same way for every pair, in any chunk and in both methods
    (batched or not), so equal inputs give equal distances.
    """
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def _rows_neighbours(pts: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Neighbours of ``rows``: the k smallest ``(distance, index)`` pairs per row, in order."""
    c = rows.shape[0]
    d = _dist(pts[rows], pts)
    seq = torch.arange(c, device=d.device)
    d[seq, rows] = float("inf")  # never strictly closer than the k-th: self is out of `closer`

    # topk's choice among equal values is unspecified, so only its k-th value is used: everything
    # strictly closer is in, and the lowest-index points at exactly that distance fill the rest.
    kth = torch.topk(d, k, dim=1, largest=False, sorted=True).values[:, k - 1:k]
    closer = d < kth
    at_kth = d == kth
    at_kth[seq, rows] = False  # matters only when distances overflow to inf
    need = k - closer.sum(dim=1)
    extra = at_kth.sum(dim=1) > need
    if bool(extra.any()):  # rows with more ties than places: keep the first `need` by index
        sub = at_kth[extra]
        at_kth[extra] = sub & (sub.cumsum(dim=1) <= need[extra].unsqueeze(1))
    chosen = closer | at_kth
    idx = chosen.nonzero()[:, 1].view(c, k)  # row-major: ascending index within each row
    dist = d.gather(1, idx)
    order = torch.sort(dist, dim=1, stable=True).indices  # stable: equal distances stay index-ordered
    return idx.gather(1, order)


def _tree(pts: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """The k-d tree method: candidates from scipy, ranked exactly as :func:`_rows_neighbours` ranks them."""
    from scipy.spatial import cKDTree  # optional dependency: checked by the caller

    n = pts.shape[0]
    x64 = pts.numpy().astype(np.float64)  # exact: pts is float32 or float64
    kq = min(n, k + 1 + _EXTRA)
    dd, ii = cKDTree(x64).query(x64, k=kq, workers=-1)
    dd, ii = dd.reshape(n, kq), ii.reshape(n, kq)
    # Among the first k + 1 returned at least k are not the point itself, so dd[:, k] bounds the k-th
    # neighbour's distance; the candidates are complete when the farthest one lies beyond that bound.
    bound = dd[:, k] * (1 + _MARGIN)
    complete = (dd[:, -1] > bound) if kq < n else np.ones(n, dtype=bool)
    out = torch.empty((n, k), dtype=torch.long)
    good = torch.from_numpy(np.flatnonzero(complete))
    block = max(chunk, 1 << 16)  # rows ranked at once: (block, kq, D) candidate coordinates
    for start in range(0, good.shape[0], block):
        rows = good[start:start + block]
        cand = torch.from_numpy(ii[rows.numpy()].astype(np.int64))
        d = _dist(pts[rows][:, None, :], pts[cand])[:, 0, :]
        d[cand == rows[:, None]] = float("inf")  # never the point itself
        # The same order as the brute force: by distance, then by index.
        by_index = torch.sort(cand, dim=1, stable=True)
        cand, d = by_index.values, d.gather(1, by_index.indices)
        order = torch.sort(d, dim=1, stable=True).indices[:, :k]
        out[rows] = cand.gather(1, order)
    bad = torch.from_numpy(np.flatnonzero(~complete))
    for start in range(0, bad.shape[0], chunk):  # heavy ties or duplicates: exact by brute force
        rows = bad[start:start + chunk]
        out[rows] = _rows_neighbours(pts, rows, k)
    return out


def knn_edge_index(neighbours: torch.Tensor) -> torch.Tensor:
    """The ``(N, k)`` table of :func:`knn_graph` as an edge list ``(2, N * k)``.

    Row 0 holds the neighbour (source), row 1 the centre (target), edges grouped
    by centre: the layout of PyG's ``knn_graph(flow="source_to_target")``.
    """
    if not isinstance(neighbours, torch.Tensor) or neighbours.ndim != 2:
        raise InvalidArgument("neighbours must be the (N, k) tensor knn_graph returns")
    n, k = neighbours.shape
    centre = torch.arange(n, device=neighbours.device).repeat_interleave(k)
    return torch.stack([neighbours.reshape(-1).long(), centre])


__all__ = ["TREE_MAX_DIMS", "TREE_MIN_POINTS", "have_tree", "knn_edge_index", "knn_graph"]
