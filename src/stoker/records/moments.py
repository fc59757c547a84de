"""Streaming moments (count, mean, M2, min, max) with the parallel merge of Chan et al.

Every sample contributes in proportion to its element count, so records of
different sizes weigh what they hold (never a mean of per-record means), and
merging partial results in any grouping gives the same answer up to rounding::

    >>> m = Moments.of(torch.tensor([[1.0, 10.0], [3.0, 30.0]]))   # per channel: reduce all but the last axis
    >>> m = m.merge(Moments.of(torch.tensor([[5.0, 50.0]])))
    >>> m.count, m.mean, m.std
    (3, tensor([ 3., 30.], dtype=torch.float64), tensor([ 1.6330, 16.3299], dtype=torch.float64))

The merge updates the mean by the weighted difference of means and adds the
cross term ``delta**2 * na * nb / n`` to M2, which stays accurate when the mean
is large next to the spread (where ``E[x**2] - E[x]**2`` cancels catastrophically).
The mean travels as two float64 (``mean + mean_lo``, the second its rounding
error): where the spread is within a few thousand float64 steps of the mean
(1e12 + noise of 1e-3), a rounded mean is off by a noticeable part of the
spread, and the differences of many pieces' rounded means made the std a
percent too large; with the pair each difference is exact to float64.

Non-finite elements (NaN, +-inf) are never folded in, since one would turn every
statistic into NaN: each channel counts them in ``skipped`` instead, and its
moments describe its finite elements (``count - skipped`` of them). Whether
skipping is acceptable is the caller's policy (``compute_stats(nonfinite=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass(frozen=True)
class Moments:
    """Moments of ``count`` elements per channel, ``skipped`` of which (per channel) were non-finite and left
    out; tensors are float64 (``skipped`` int64) of shape ``(C,)`` or ``()``."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    skipped: torch.Tensor | None = None  # None: no element was skipped
    #: What ``mean`` (rounded to float64) leaves out of the exact mean: the mean is ``mean + mean_lo``.
    mean_lo: torch.Tensor | None = None  # None: zeros

    def __post_init__(self) -> None:
        if self.skipped is None:
            object.__setattr__(self, "skipped", torch.zeros(self.mean.shape, dtype=torch.int64))
        if self.mean_lo is None:
            object.__setattr__(self, "mean_lo", torch.zeros(self.mean.shape, dtype=F64))

    @staticmethod
    def empty(channels: int | None) -> "Moments":
        """No elements yet: ``channels=None`` for scalar statistics."""
        shape = () if channels is None else (channels,)
        zeros = torch.zeros(shape, dtype=F64)
        return Moments(0, zeros, zeros.clone(), torch.full(shape, torch.inf, dtype=F64),
                       torch.full(shape, -torch.inf, dtype=F64))

    @staticmethod
    def of(x: torch.Tensor, per_channel: bool = True) -> "Moments":
        """Moments of ``x``: per channel over every axis but the last (tensors of 0 or 1 dims, and
        ``per_channel=False``, reduce over everything). Non-finite elements are counted in ``skipped``."""
        x = torch.as_tensor(x).detach().to("cpu", F64)
        if per_channel and x.ndim >= 2:
            x = x.reshape(-1, x.shape[-1])
            channels: int | None = x.shape[-1]
        else:
            x = x.reshape(-1, 1)
            channels = None
        n = x.shape[0]
        if n == 0:
            return Moments.empty(channels)
        finite = torch.isfinite(x)
        # Two-pass within the sample: deviations from its own mean, never raw sums of squares; their mean is
        # what the rounded mean left out (mean_lo), and M2 is taken about the mean with it.
        if bool(finite.all()):
            mean = x.mean(dim=0)
            dev = x - mean
            rest = dev.mean(dim=0)
            m2 = ((dev - rest) ** 2).sum(dim=0)
            lo, hi = x.amin(dim=0), x.amax(dim=0)
            skipped = torch.zeros(x.shape[1], dtype=torch.int64)
        else:
            kept = finite.sum(dim=0)
            mean = torch.where(finite, x, 0.0).sum(dim=0) / kept.clamp(min=1)  # 0 for a channel with none
            dev = torch.where(finite, x - mean, 0.0)
            rest = dev.sum(dim=0) / kept.clamp(min=1)
            m2 = (torch.where(finite, dev - rest, 0.0) ** 2).sum(dim=0)
            lo = torch.where(finite, x, torch.inf).amin(dim=0)
            hi = torch.where(finite, x, -torch.inf).amax(dim=0)
            skipped = n - kept
        return Moments.two_pass(n, channels, mean, m2, lo, hi, skipped, rest)

    @staticmethod
    def two_pass(n: int, channels: int | None, mean: torch.Tensor, m2: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, skipped: torch.Tensor, rest: torch.Tensor) -> "Moments":
        """Moments of ``n`` elements from a two-pass reduction over them, per channel (shape ``(C,)``; a
        single column when ``channels`` is None, for scalar moments): their float64 ``mean``, ``rest`` the
        mean of the deviations from it (what its rounding left out: kept as ``mean_lo`` by TwoSum, 0 where
        not finite, an overflow), ``m2`` taken about the mean with it. The one finish of :meth:`of` and of
        compute_stats' numpy units (:func:`stoker.arraystats.compute._moments`)."""
        mean, mean_lo = two_sum(mean, torch.where(torch.isfinite(rest), rest, 0.0))  # overflow: as before
        if channels is None:
            mean, m2, lo, hi, skipped, mean_lo = mean[0], m2[0], lo[0], hi[0], skipped[0], mean_lo[0]
        return Moments(n, mean, m2, lo, hi, skipped, mean_lo)

    @property
    def channels(self) -> int | None:
        return None if self.mean.ndim == 0 else int(self.mean.shape[0])

    @property
    def finite(self) -> torch.Tensor:
        """Elements per channel the moments describe (``count - skipped``), float64."""
        return (self.count - self.skipped).to(F64)

    @property
    def variance(self) -> torch.Tensor:
        """Population variance (ddof=0), as ``numpy.var``; NaN for a channel with no (finite) elements."""
        n = self.finite
        return torch.where(n > 0, self.m2 / n.clamp(min=1), torch.nan)

    @property
    def std(self) -> torch.Tensor:
        return torch.sqrt(self.variance)

    def merge(self, other: "Moments") -> "Moments":
        """Moments of both sets together (Chan, Golub & LeVeque's pairwise update), channel by channel."""
        if other.mean.shape != self.mean.shape:
            raise ValueError(f"cannot merge moments of shapes {tuple(self.mean.shape)} and {tuple(other.mean.shape)}")
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        na, nb = self.finite, other.finite
        n = (na + nb).clamp(min=1)  # a channel with no finite element on either side keeps mean 0, M2 0
        # Near means subtract exactly (Sterbenz), so with the low parts delta is the exact means' difference.
        delta = (other.mean - self.mean) + (other.mean_lo - self.mean_lo)
        mean, mean_lo = two_sum(self.mean, self.mean_lo + delta * (nb / n))
        # A channel with nothing on this side takes the other's pair whole (not rounded into one float64).
        mean, mean_lo = torch.where(na == 0, other.mean, mean), torch.where(na == 0, other.mean_lo, mean_lo)
        m2 = self.m2 + other.m2 + delta * delta * (na * nb / n)
        return Moments(self.count + other.count, mean, m2, torch.minimum(self.min, other.min),
                       torch.maximum(self.max, other.max), self.skipped + other.skipped, mean_lo)

    # -- a flat float64 layout for collectives: [count, mean, m2, min, max, skipped, mean_lo] -----

    @staticmethod
    def packed_size(channels: int | None) -> int:
        return 1 + 6 * (1 if channels is None else channels)

    def pack(self) -> torch.Tensor:
        parts = [torch.tensor([float(self.count)], dtype=F64)]
        parts += [t.reshape(-1).to(F64) for t in (self.mean, self.m2, self.min, self.max, self.skipped,
                                                   self.mean_lo)]
        return torch.cat(parts)

    @staticmethod
    def unpack(flat: torch.Tensor, channels: int | None) -> "Moments":
        c = 1 if channels is None else channels
        flat = flat.to("cpu", F64)
        count = int(flat[0].item())  # exact: counts travel as float64, exact below 2**53
        parts = [flat[1 + k * c: 1 + (k + 1) * c].clone() for k in range(6)]
        parts[4] = parts[4].to(torch.int64)
        if channels is None:
            parts = [p[0] for p in parts]
        return Moments(count, *parts)


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, e)``: ``s = a + b`` rounded to float64 and ``e`` its exact rounding error (Knuth's TwoSum), 0 where
    ``s`` is not finite (an overflow has no error term worth keeping)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, torch.where(torch.isfinite(e), e, torch.zeros_like(e))
