"""Scenarios 11 and 12: samples of named fields against tensorstore and a DataLoader, in one process run.

- 11, segmentation: raw uint16 microscopy-like (shards of zstd 32x64x64 inner chunks), uint64 instance
  labels and a 4x coarser mask with about 5% foreground; raw 96^3 float32 with labels 56^3 int64 centred,
  drawn where the mask covers at least a quarter of the labels' box; batch 8.
- 12, forecasting: 4 float32 variables (time, 181, 360) written by xarray (a step a chunk); input 2 steps,
  target 1 step 6 after the last input; batch 8.

Peers read the same boxes (stoker's sampler draws them): ``tensorstore`` every field of a batch's samples
as futures in flight together in a thread pool, the next batch's issued before the current one is
assembled (scenario 11: each sample's mask box read and its coverage computed too, as rejection sampling
would); ``dataloader`` a ``torch.utils.data.DataLoader`` of 2 workers over zarr-python (scenario 12:
over ``xarray.open_zarr``). Scenario 11 also runs ``stoker (no mask)``: the same boxes as a plain list,
so the difference is what drawing by the mask costs.

>>> print(run_fields_scenario(11, Path("/tmp/bench"), rounds=3)[2])   # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import Config
from ..engine.batch import to_tensors
from ..engine.pipeline.facade import Pipeline
from ..sampling.field import Field
from ..sampling.mask import Mask
from ..sampling.sample import Sample
from ..sampling.samplers import RandomCrops, SampleList, SampleSource
from .datasets import VolumeSpec, ensure, warm_page_cache, write_dataset
from .runner import Result, RssSampler, cpu_breakdown, interleaved, split_batches

LOOKAHEAD = 3
WORKERS = 2  # the DataLoader peers' workers, as the issue asks
TARGET_LEAD = 6  # scenario 12's target: this many steps after the input's last
MASKED = "labels"  # scenario 11's field the mask is tested on


@dataclass(frozen=True)
class FieldsScenario:
    number: int
    title: str
    shape: tuple[int, ...]  # the reference volume (scenario 11) or (time, lat, lon) (scenario 12)
    crops: dict[str, tuple[int, ...]]  # field -> its crop
    timed_batches: int
    batch_size: int = 8


def fields_scenarios(tiny: bool = False) -> list[FieldsScenario]:
    if tiny:
        return [FieldsScenario(11, "tiny segmentation", (64, 256, 256), {"raw": (48, 48, 48), "labels": (32, 32, 32)}, 3, 4),
                FieldsScenario(12, "tiny forecasting", (40, 46, 90), {"input": (2, 46, 90), "target": (1, 46, 90)}, 3, 4)]
    return [FieldsScenario(11, "segmentation: raw u16 96^3 -> f32, labels u64 56^3 -> i64 centred, 4x coarser mask "
                           "(5% foreground), min_fraction 0.25", (128, 512, 512),
                           {"raw": (96, 96, 96), "labels": (56, 56, 56)}, 60),
            FieldsScenario(12, "forecasting: 4 f32 variables (time, 181, 360) by xarray, 2 steps in, 1 step 6 later",
                           (365, 181, 360), {"input": (2, 181, 360), "target": (1, 181, 360)}, 30)]


# -- datasets ---------------------------------------------------------------------------------------------------

#: the scenarios of samples of named fields (``stoker bench --scenarios 11,12``)
FIELDS_SCENARIOS = (11, 12)
MASK_SCALE = 4
BLOB = 8  # mask voxels a side of a blob of foreground
LABEL_ID_BASE = 1 << 40  # ids past float32's exact integers: a lossy cast would show


def segmentation_data(root: Path, sc: FieldsScenario) -> dict[str, str]:
    """Raw (microscopy-like), labels and mask arrays of scenario 11, written once; their paths."""
    raw = ensure(root, VolumeSpec(f"s{sc.number}-raw-{'x'.join(map(str, sc.shape))}", sc.shape, (32, 64, 64),
                                  "uint16", "zstd", shards=(64, 128, 128) if sc.shape[0] <= 64 else (128, 256, 256),
                                  content="microscopy"))[0]
    base = Path(root) / f"s{sc.number}-labels-v2-{'x'.join(map(str, sc.shape))}"
    write_dataset(base, lambda tmp: _write_labels(tmp, sc.shape), is_complete=lambda p: (p / ".complete").exists())
    return {"raw": raw, "labels": str(base / "labels.zarr"), "mask": str(base / "mask.zarr")}


def _write_labels(tmp: Path, shape: tuple[int, ...]) -> None:
    """A coarse mask of blobs (about 5% of its voxels) and uint64 instance labels inside them: ids of 16^3
    blocks, from :data:`LABEL_ID_BASE` up (past float32's exact integers: a lossy cast would show)."""
    import zarr

    rng = np.random.default_rng(zlib.crc32(b"s11-mask"))
    coarse = tuple(s // MASK_SCALE for s in shape)
    # blobs of 8 mask voxels (32 voxels) a side: a labels box (14 mask voxels) fits in one and can be covered
    knots = rng.standard_normal([-(-c // BLOB) for c in coarse])
    field = np.kron(knots, np.ones((BLOB,) * 3))[tuple(slice(0, c) for c in coarse)]
    mask = (field > np.quantile(field, 0.95)).astype(np.uint8)
    zarr.create_array(str(tmp / "mask.zarr"), shape=coarse, chunks=coarse, dtype="uint8", fill_value=0)[...] = mask
    labels = zarr.create_array(str(tmp / "labels.zarr"), shape=shape, chunks=(32, 64, 64), dtype="uint64",
                               fill_value=0)
    for z0 in range(0, shape[0], 32):
        z = np.arange(z0, min(shape[0], z0 + 32))[:, None, None] // 16
        y = np.arange(shape[1])[None, :, None] // 16
        x = np.arange(shape[2])[None, None, :] // 16
        ids = (LABEL_ID_BASE + (z * (shape[1] // 16 + 1) + y) * (shape[2] // 16 + 1) + x).astype(np.uint64)
        inside = np.repeat(np.repeat(np.repeat(mask[z0 // MASK_SCALE:(z0 + 32) // MASK_SCALE], MASK_SCALE, 0),
                                     MASK_SCALE, 1), MASK_SCALE, 2)[: len(z)]
        labels[z0:z0 + len(z)] = np.where(inside.astype(bool), ids, np.uint64(0))
    (tmp / ".complete").write_text("")


VARIABLES = ("t2m", "u10", "v10", "msl")


def forecasting_data(root: Path, sc: FieldsScenario) -> str:
    """Scenario 12's dataset, written once by xarray (chunks of one time step); the store's path."""
    base = Path(root) / f"s{sc.number}-weather-{'x'.join(map(str, sc.shape))}"
    write_dataset(base, lambda tmp: _write_weather(tmp, sc.shape), is_complete=lambda p: (p / ".complete").exists())
    return str(base / "weather.zarr")


def _write_weather(tmp: Path, shape: tuple[int, ...]) -> None:
    import pandas as pd
    import xarray as xr

    from .synthetic import block

    n_t = shape[0]
    coords = {"time": pd.date_range("2000-01-01", periods=n_t, freq="D"),
              "lat": np.linspace(-90, 90, shape[1]), "lon": np.arange(shape[2]) * 360.0 / shape[2]}
    data = {v: (("time", "lat", "lon"), block("weather", zlib.crc32(v.encode()), shape, ((0, n_t), (0, shape[1]),
                                                                                          (0, shape[2]))))
            for v in VARIABLES}
    ds = xr.Dataset(data, coords=coords).chunk({"time": 1, "lat": shape[1], "lon": shape[2]})
    ds.to_zarr(str(tmp / "weather.zarr"), mode="w")
    (tmp / ".complete").write_text("")


# -- the samples each peer reads --------------------------------------------------------------------------------

def segmentation_source(paths: dict[str, str], sc: FieldsScenario, n: int, mask: bool = True) -> RandomCrops:
    """Scenario 11's sampler: raw and its centred labels, ``n`` samples an epoch, drawn by the mask."""
    raw, labels = sc.crops["raw"], sc.crops["labels"]
    fields = {"raw": Field(paths["raw"], raw),
              "labels": Field(paths["labels"], labels, offset=tuple((r - lab) // 2 for r, lab in zip(raw, labels)))}
    return RandomCrops(fields, seed=sc.number, samples_per_epoch=n,
                       mask=Mask(paths["mask"], min_fraction=0.25, field="labels", scale=MASK_SCALE) if mask else None)


def forecasting_source(store: str, sc: FieldsScenario, n: int) -> RandomCrops:
    """Scenario 12's sampler: every variable's input steps, and the target step 6 after the input's last."""
    uris = [f"{store}/{v}" for v in VARIABLES]
    fields = {"input": Field(uris, sc.crops["input"]),
              "target": Field(uris, sc.crops["target"], offset=(sc.crops["input"][0] + TARGET_LEAD - 1, 0, 0))}
    return RandomCrops(fields, seed=sc.number, samples_per_epoch=n)


def draw(source: SampleSource, n: int) -> list[Sample]:
    """The first ``n`` samples of the source's epoch 0 (one process)."""
    it = iter(source.for_rank(0, 1))
    return [next(it) for _ in range(n)]


def _box(sample: Sample) -> tuple[slice, ...]:
    return tuple(slice(a, c) for a, c in sample.aabb or ())


def _mask_box(sample: Sample) -> tuple[slice, ...]:
    """The mask voxels under a labels box (aligned: its ends are multiples of the mask's scale)."""
    return tuple(slice(a // MASK_SCALE, -(-c // MASK_SCALE)) for a, c in sample.aabb or ())


def _dtype(number: int) -> Any:
    return {"raw": "f32", "labels": "i64"} if number == 11 else "f32"


_NUMPY = {"f32": np.float32, "i64": np.int64}


# -- peers ------------------------------------------------------------------------------------------------------

def stoker_config(sc: FieldsScenario) -> Config:
    """The bench's pipeline (as the crop scenarios': 2 I/O threads, lookahead 3), its batch slots for every
    field and 256 MiB more."""
    channels = len(VARIABLES) if sc.number == 12 else 1
    per_batch = sum(sc.batch_size * math.prod(c) * 8 * channels for c in sc.crops.values())
    return Config(batch_size=sc.batch_size, dtype=_dtype(sc.number), lookahead_batches=LOOKAHEAD, n_io_threads=2,
                  host_buffer_bytes=(LOOKAHEAD + 1) * per_batch + (256 << 20))


def run_stoker(sc: FieldsScenario, source: SampleSource, samples: list[Sample], n_batches: int,
               name: str = "stoker") -> Result:
    """``n_batches`` batches of ``source`` through a Pipeline. Warm-up as the crop scenarios' (the first
    batch, then every slot written once, from ``samples``); the source is pushed as the clock starts, so
    its drawing (by the mask) is timed and no batch is read before."""
    b = sc.batch_size
    marks: list[float] = []
    with RssSampler() as rss, Pipeline(stoker_config(sc)) as p:
        p.push(samples[:b] * (1 + LOOKAHEAD))
        for _ in range(1 + LOOKAHEAD):
            with p.pop() as batch:
                to_tensors(batch)
        p.stats_reset()
        t0 = time.perf_counter()
        marks.append(time.process_time())
        p.push(source.for_rank(0, 1))
        nbytes = 0
        for _ in range(n_batches):
            with p.pop() as batch:
                nbytes += sum(t.nbytes for t in _tensors(batch).values())
        seconds = time.perf_counter() - t0
        marks.append(time.process_time())
        stats = p.stats()
    return Result(name, seconds, n_batches * b, nbytes, rss.peak,
                  {"stats": stats, "batches": n_batches, "cpu_s": marks[1] - marks[0]})


def _tensors(batch: Any) -> dict[str, torch.Tensor]:
    out = to_tensors(batch)
    assert isinstance(out, dict)
    return out


class TensorstoreFields:
    """The tensorstore peer's reads: :meth:`issue` a batch's futures (every field's arrays of every sample,
    and with ``mask_uri`` each sample's mask box under its labels), :meth:`assemble` them into a batch of
    each field (the output dtypes: ``{name: numpy dtype}``), the coverage a rejection test needs computed."""

    def __init__(self, dtypes: dict[str, Any], mask_uri: str | None = None) -> None:
        self.dtypes, self.mask_uri = dtypes, mask_uri
        self._arrays: dict[str, Any] = {}

    def _array(self, uri: str) -> Any:
        import tensorstore as ts

        if uri not in self._arrays:
            driver = "zarr3" if os.path.exists(os.path.join(uri, "zarr.json")) else "zarr"
            self._arrays[uri] = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": uri}}).result()
        return self._arrays[uri]

    def issue(self, batch: list[Sample]) -> list[dict[str, list]]:
        reads = []
        for s in batch:
            r = {n: [self._array(u)[_box(s[n])].read() for u in s[n].uris] for n in s.names or ()}
            if self.mask_uri is not None:
                r["_mask"] = [self._array(self.mask_uri)[_mask_box(s[MASKED])].read()]
            reads.append(r)
        return reads

    def assemble(self, reads: list[dict[str, list]], batch: list[Sample]) -> dict[str, np.ndarray]:
        out = {}
        for n in batch[0].names or ():
            one = batch[0][n]
            buf = np.empty((len(batch), *one.shape), dtype=self.dtypes[n])
            for i, r in enumerate(reads):
                for c, f in enumerate(r[n]):
                    buf[(i, c) if one.channels else i] = f.result()
            out[n] = buf
        if self.mask_uri is not None:
            coverage = [np.count_nonzero(m := r["_mask"][0].result()) / m.size for r in reads]
            out["coverage"] = np.asarray(coverage)
        return out


def run_tensorstore(sc: FieldsScenario, samples: list[Sample], n_batches: int, mask_uri: str | None = None) -> Result:
    """The first ``n_batches`` batches of ``samples`` read as tensorstore futures, the next batch's issued
    before the current one is assembled (after a warm-up batch that opens the arrays)."""
    dtypes = {n: _NUMPY[d] for n, d in _dtypes(sc).items()}
    peer = TensorstoreFields(dtypes, mask_uri)
    batches = split_batches(samples, sc.batch_size)[:n_batches]
    with RssSampler() as rss:
        peer.assemble(peer.issue(batches[0]), batches[0])
        t0 = time.perf_counter()
        pending = peer.issue(batches[0])
        nbytes = 0
        for i in range(len(batches)):
            nxt = peer.issue(batches[i + 1]) if i + 1 < len(batches) else None
            nbytes += sum(a.nbytes for k, a in peer.assemble(pending, batches[i]).items() if k != "coverage")
            pending = nxt
        seconds = time.perf_counter() - t0
    return Result("tensorstore", seconds, len(batches) * sc.batch_size, nbytes, rss.peak)


def _dtypes(sc: FieldsScenario) -> dict[str, str]:
    d = _dtype(sc.number)
    return dict(d) if isinstance(d, dict) else {n: d for n in sc.crops}


class FieldCrops(torch.utils.data.Dataset):
    """The DataLoader peer's dataset: each sample's fields through zarr-python (scenario 11, with its mask
    box's coverage computed, as rejection sampling would) or ``xarray.open_zarr`` (scenario 12), opened
    lazily in each worker."""

    def __init__(self, samples: list[Sample], mask_uri: str | None = None, xarray_store: str | None = None) -> None:
        self.samples, self.mask_uri, self.xarray_store = samples, mask_uri, xarray_store
        self._open: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _array(self, uri: str) -> Any:
        import zarr

        if uri not in self._open:
            self._open[uri] = zarr.open_array(uri, mode="r")
        return self._open[uri]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.samples[i]
        if self.xarray_store is not None:
            import xarray as xr

            if "ds" not in self._open:
                self._open["ds"] = xr.open_zarr(self.xarray_store)[list(VARIABLES)]
            ds = self._open["ds"]
            out = {}
            for n in s.names or ():
                (t0, t1), (y0, y1), (x0, x1) = s[n].aabb or ()
                window = ds.isel(time=slice(t0, t1), lat=slice(y0, y1), lon=slice(x0, x1))
                out[n] = torch.from_numpy(window.to_array().values.astype(np.float32, copy=False))
            return out
        out = {"raw": torch.from_numpy(self._array(s["raw"].uri)[_box(s["raw"])].astype(np.float32)),
               "labels": torch.from_numpy(self._array(s["labels"].uri)[_box(s["labels"])].astype(np.int64))}
        if self.mask_uri is not None:
            m = self._array(self.mask_uri)[_mask_box(s[MASKED])]
            out["coverage"] = torch.tensor(np.count_nonzero(m) / m.size)
        return out


def run_dataloader(sc: FieldsScenario, samples: list[Sample], n_batches: int, mask_uri: str | None = None,
                   xarray_store: str | None = None) -> Result:
    """A DataLoader of :data:`WORKERS` workers over :class:`FieldCrops`; ``n_batches`` timed once its
    prefetch has filled (the batches made before the first is asked for are not timed). Workers are
    spawned: forked from this process, which has run zarr-python's event-loop thread (writing the data),
    their first zarr read hangs."""
    b = sc.batch_size
    skip = 2 * WORKERS  # its prefetch (prefetch_factor 2 per worker)
    loader = torch.utils.data.DataLoader(FieldCrops(samples[:(skip + n_batches) * b], mask_uri, xarray_store),
                                         batch_size=b, num_workers=WORKERS, prefetch_factor=2,
                                         multiprocessing_context="spawn")
    with RssSampler() as rss:
        it = iter(loader)
        for _ in range(skip):
            next(it)
        t0 = time.perf_counter()
        n, nbytes = 0, 0
        for batch in it:
            nbytes += sum(t.nbytes for k, t in batch.items() if k != "coverage")
            n += 1
        seconds = time.perf_counter() - t0
    return Result("xarray+DataLoader" if xarray_store else "zarr+DataLoader", seconds, n * b, nbytes, rss.peak)


# -- the run ----------------------------------------------------------------------------------------------------

def prepare(number: int, root: Path, tiny: bool = False, n_batches: int | None = None
            ) -> tuple[FieldsScenario, dict[str, Any]]:
    """Scenario ``number``'s data (written once under ``root``), page cache warmed, and what its peers
    read: ``{"paths", "source", "samples", "n_batches", "slow_batches", "scan_s"}``."""
    sc = next(s for s in fields_scenarios(tiny) if s.number == number)
    n = n_batches or sc.timed_batches
    slow = max(2, n // 3)  # the DataLoader peer's timed batches: it is the slow one
    n_samples = max(n, slow + 2 * WORKERS) * sc.batch_size
    if number == 11:
        paths = segmentation_data(root, sc)
        warm_page_cache(list(paths.values()))
        t0 = time.perf_counter()
        source = segmentation_source(paths, sc, n_samples)
        scan = time.perf_counter() - t0
    else:
        paths = {"store": forecasting_data(root, sc)}
        warm_page_cache([paths["store"]])
        t0 = time.perf_counter()
        source = forecasting_source(paths["store"], sc, n_samples)
        scan = time.perf_counter() - t0
    return sc, {"paths": paths, "source": source, "samples": draw(source, n_samples), "n_batches": n,
                "slow_batches": slow, "scan_s": scan}


def run_fields_scenario(number: int, root: Path, rounds: int = 3, tiny: bool = False, n_batches: int | None = None,
                        peers: Callable[[str], bool] = lambda name: True) -> tuple[FieldsScenario, list[Result], str]:
    """Scenario ``number`` (11 or 12): every peer on the same boxes, in ``rounds`` interleaved rounds;
    ``(scenario, median results, the table)``. ``peers(name)`` picks peers by name."""
    sc, run = prepare(number, root, tiny, n_batches)
    paths, source, samples, n, slow = run["paths"], run["source"], run["samples"], run["n_batches"], run["slow_batches"]
    runs: dict[str, Callable[[], Result]] = {"stoker": lambda: run_stoker(sc, source, samples, n)}
    if number == 11:
        runs["stoker (no mask)"] = lambda: run_stoker(sc, SampleList(samples), samples, n, "stoker (no mask)")
        runs["tensorstore"] = lambda: run_tensorstore(sc, samples, n, paths["mask"])
        runs["zarr+DataLoader"] = lambda: run_dataloader(sc, samples, slow, paths["mask"])
    else:
        runs["tensorstore"] = lambda: run_tensorstore(sc, samples, n)
        runs["xarray+DataLoader"] = lambda: run_dataloader(sc, samples, slow, xarray_store=paths["store"])
    medians = interleaved({k: v for k, v in runs.items() if peers(k)}, rounds)
    results = list(medians.values())
    return sc, results, format_fields(sc, results, n, slow, run["scan_s"])


def format_fields(sc: FieldsScenario, results: list[Result], n_batches: int, slow_batches: int, scan_s: float) -> str:
    """The scenario's table (samples/s, MB/s of the delivered batches, stoker's ratio to each peer, peak
    RSS), each peer's range over the rounds, the mask's cost and stoker's CPU time per batch by stage."""
    by = {r.peer: r for r in results}
    st = by.get("stoker")
    lines = [f"\nScenario {sc.number}: {sc.title} (batch {sc.batch_size}, {n_batches} timed batches per fast peer, "
             f"{slow_batches} for the DataLoader; MB/s of the delivered batches)",
             f"{'peer':<20}{'samples/s':>11}{'MB/s':>9}{'stoker x':>10}{'peak RSS MB':>13}"]
    for r in results:
        ratio = f"{st.samples_per_s / r.samples_per_s:>9.2f}x" if st and r is not st and r.samples_per_s else f"{'':>10}"
        lines.append(f"{r.peer:<20}{r.samples_per_s:>11.1f}{r.mb_per_s:>9.1f}{ratio}{r.peak_rss / 1e6:>13.0f}")
    if st and len(st.extra.get("rounds", ())) > 1:
        lines.append("rounds: " + ", ".join(f"{r.peer} {min(r.extra['rounds']):.0f}-{max(r.extra['rounds']):.0f}"
                                            for r in results) + " samples/s (median shown)")
    nomask = by.get("stoker (no mask)")
    if st and nomask:
        lines.append(f"mask sampling: stoker with the mask at {st.samples_per_s / nomask.samples_per_s:.2f}x the same "
                     f"boxes as a plain list (the sampler's scan of the mask, once when it is made: {scan_s * 1e3:.0f} ms)")
    if st and st.extra.get("batches"):
        lines.append(cpu_breakdown(st.extra["stats"], st.extra["cpu_s"], st.extra["batches"], st.seconds))
    return "\n".join(lines)

