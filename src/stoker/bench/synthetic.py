"""Seeded synthetic contents for the bench: microscopy-like uint16 volumes and weather-like float32 fields.

Real microscopy and weather data compress 2-5x, so their chunks cross a bus and a decoder in a few
times fewer bytes than they decode to; these generators give the bench data that does too. Each one
makes any box of its array on its own: the smooth structure comes from a small field drawn once from
the seed, the noise from a generator seeded by the seed and the box's corner. A dataset is written box
by box in bounded memory, and one seed gives the same bytes in whatever order the boxes are made.

>>> block("microscopy", seed=1, shape=(64, 256, 256), box=((0, 32), (0, 64), (0, 64))).dtype
dtype('uint16')
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["CONTENTS", "VERSION", "block"]

Box = tuple[tuple[int, int], ...]

CONTENTS = ("microscopy", "weather")
VERSION = 2  # of what the generators make: raise it with any change to their bytes (datasets' markers hold it)

# Microscopy: cells whose membranes are the zero set of a smooth random field, nuclei where a coarser
# field is high, over a dark background; photons with shot noise (variance = mean) and a camera's read
# noise, offset and gain. Tuned so that zstd (level 3) on 32x64x64 chunks stores them about 2.8x
# smaller (2.5-4 asked): most of a real volume is dark background, whose few counts of noise are what
# compression keeps; the membranes' width moves the ratio most (0.03, with the cytoplasm level at
# 0.3, gave 2.55x).
_CELL_SPACING = 12  # voxels between the knots of the membranes' field: cells about 20-40 voxels across
_NUCLEUS_SPACING = 24
_MEMBRANE_WIDTH = 0.02  # of the cell field (std about 0.33): membranes 1-2 voxels thick
_BACKGROUND, _CYTOPLASM, _MEMBRANE, _NUCLEUS = 0.3, 10.0, 1000.0, 200.0  # mean photons per voxel
_CYTOPLASM_LEVEL, _NUCLEUS_LEVEL = 0.4, 0.8
_READ_NOISE = 1.0  # photons (rms)
_OFFSET, _GAIN = 100.0, 1.0  # counts: a camera's dark level, counts per photon


def block(content: str, seed: int, shape: tuple[int, ...], box: Box) -> np.ndarray:
    """The ``box`` (``((start, stop), ...)`` per axis) of the array of ``shape`` that ``content`` and
    ``seed`` describe: uint16 for ``"microscopy"`` (3-D), float32 for ``"weather"`` (time, lat, lon)."""
    rng = np.random.default_rng([seed, *(a for a, _ in box)])  # the noise: this box's own stream
    if content == "microscopy":
        return _microscopy(seed, tuple(shape), box, rng)
    if content == "weather":
        return _weather(seed, tuple(shape), box, rng)
    raise ValueError(f"unknown synthetic content {content!r}; choose among {', '.join(CONTENTS)}")


@lru_cache(maxsize=4)
def _knots(seed: int, shape: tuple[int, ...], spacing: int, which: int) -> np.ndarray:
    """A random field's knots (standard normal) every ``spacing`` voxels over ``shape``; a cubic B-spline
    reads up to 3 knots past the last voxel's."""
    rng = np.random.default_rng([seed, 1 << 20, which])
    return rng.standard_normal([s // spacing + 4 for s in shape], dtype=np.float32)


def _bspline(start: int, stop: int, spacing: int) -> tuple[np.ndarray, slice]:
    """Cubic B-spline weights for voxels ``start:stop`` and the knots they read: row i blends the 4 knots
    around (start + i) / spacing."""
    t = np.arange(start, stop, dtype=np.float64) / spacing
    j = np.floor(t).astype(np.intp)
    u = t - j
    first = int(j[0])
    w = np.zeros((stop - start, int(j[-1]) + 4 - first), np.float32)
    rows, cols = np.arange(stop - start), j - first
    for k, b in enumerate(((1 - u) ** 3 / 6, (3 * u**3 - 6 * u**2 + 4) / 6, (-3 * u**3 + 3 * u**2 + 3 * u + 1) / 6,
                           u**3 / 6)):
        w[rows, cols + k] = b
    return w, slice(first, first + w.shape[1])


def _smooth(knots: np.ndarray, spacing: int, box: Box) -> np.ndarray:
    """The B-spline field of ``knots`` over ``box``: three small matrix products, no per-voxel loop."""
    (wz, sz), (wy, sy), (wx, sx) = (_bspline(a, b, spacing) for a, b in box)
    a = np.tensordot(wz, knots[sz, sy, sx], (1, 0)) @ wx.T  # (dz, knots in y, dx)
    return np.einsum("yj,zjx->zyx", wy, a, optimize=True)


def _microscopy(seed: int, shape: tuple[int, ...], box: Box, rng: np.random.Generator) -> np.ndarray:
    cells = _smooth(_knots(seed, shape, _CELL_SPACING, 0), _CELL_SPACING, box)
    nuclei = _smooth(_knots(seed, shape, _NUCLEUS_SPACING, 1), _NUCLEUS_SPACING, box)
    lam = (cells > _CYTOPLASM_LEVEL).astype(np.float32) * np.float32(_CYTOPLASM) + np.float32(_BACKGROUND)
    lam += (nuclei > _NUCLEUS_LEVEL) * np.float32(_NUCLEUS)
    np.divide(cells, _MEMBRANE_WIDTH, out=cells)
    np.square(cells, out=cells)
    np.negative(cells, out=cells)
    np.exp(cells, out=cells)
    lam += cells * np.float32(_MEMBRANE)
    # Shot noise (variance = mean, Poisson's) plus read noise, drawn from the normal approximation:
    # numpy's Poisson sampler took 8x as long as the whole rest of a block.
    noise = rng.standard_normal(lam.shape, dtype=np.float32)
    noise *= np.sqrt(lam + _READ_NOISE**2)
    lam += noise
    lam *= _GAIN
    lam += _OFFSET
    np.rint(lam, out=lam)
    np.clip(lam, 0, 65535, out=lam)
    return lam.astype(np.uint16)


# Weather: a temperature-like field in kelvin over (time in 6-hour steps, latitude from -90 to 90,
# longitude from 0): a climatology by latitude, a seasonal and a daily cycle, travelling planetary waves
# (a few low zonal and meridional harmonics) and a little noise, stored on a grid of 2^-8 K as the
# 16-bit packing of GRIB, in which reanalyses such as ERA5 are distributed, leaves the values: blosc zstd
# with bitshuffle then stores it about 3x smaller (1.7x with every mantissa bit kept).
_WAVES = 12
_NOISE_K = 0.05
_STEP_K = 2.0**-8
_STEPS_PER_DAY, _STEPS_PER_YEAR = 4, 1461


@lru_cache(maxsize=4)
def _waves(seed: int) -> np.ndarray:
    """(zonal k, meridional m, amplitude K, radians per step, phase) of each travelling wave."""
    rng = np.random.default_rng([seed, 2 << 20])
    k = rng.integers(1, 9, _WAVES)
    return np.stack([k, rng.integers(1, 7, _WAVES), 6.0 / np.sqrt(k) * rng.uniform(0.5, 1.0, _WAVES),
                     rng.uniform(-0.3, 0.3, _WAVES), rng.uniform(0, 2 * np.pi, _WAVES)], axis=1)


def _weather(seed: int, shape: tuple[int, ...], box: Box, rng: np.random.Generator) -> np.ndarray:
    (t0, t1), (y0, y1), (x0, x1) = box
    n_lat, n_lon = shape[1], shape[2]
    t = np.arange(t0, t1, dtype=np.float64)[:, None]  # (dt, 1)
    lat = np.radians(np.linspace(-90.0, 90.0, n_lat)[y0:y1])[None, :]  # (1, dy)
    lon = np.radians(np.arange(x0, x1) * 360.0 / n_lon)  # (dx,)
    # The field as a sum of products a_r(t, lat) * b_r(lon), one matrix product for the whole box.
    year = 2 * np.pi * t / _STEPS_PER_YEAR
    day = 2 * np.pi * t / _STEPS_PER_DAY
    terms_a = [288.0 - 45.0 * np.sin(lat) ** 2 + 12.0 * np.sin(lat) * np.cos(year) + 0 * t]
    terms_b = [np.ones_like(lon)]
    # the daily cycle follows the sun westward: cos(lon + day) = cos lon cos day - sin lon sin day
    terms_a += [3.0 * np.cos(lat) * np.cos(day), -3.0 * np.cos(lat) * np.sin(day)]
    terms_b += [np.cos(lon), np.sin(lon)]
    for k, m, amp, speed, phase in _waves(seed):
        envelope = amp * np.sin(m * (lat + np.pi / 2))
        arg = speed * t + phase  # cos(k lon - arg) = cos(k lon) cos(arg) + sin(k lon) sin(arg)
        terms_a += [envelope * np.cos(arg), envelope * np.sin(arg)]
        terms_b += [np.cos(k * lon), np.sin(k * lon)]
    a = np.stack(terms_a, axis=-1).astype(np.float32)  # (dt, dy, r)
    b = np.stack(terms_b, axis=0).astype(np.float32)  # (r, dx)
    out = a @ b
    out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(_NOISE_K)
    out *= np.float32(1 / _STEP_K)  # powers of two: exact in float32, so the values land on the grid
    np.rint(out, out=out)
    out *= np.float32(_STEP_K)
    return out
