"""Whole-volume inference throughput: stoker against MONAI and torchio, side by side on one volume.

    python benchmarks/tile_inference.py --shape 128 256 256 --tile 96 96 96 --crop 20 --rounds 5
    python benchmarks/tile_inference.py --extra-path /tmp/torchio_site   # torchio installed with --target
    python benchmarks/tile_inference.py --threads 1 --components          # and CPU by part: read, encode, store, blend
    python benchmarks/tile_inference.py --codec none                       # outputs without a compressor

Each peer reads a uint16 Zarr array, runs an identity model over tiles of ``--tile`` whose valid centres are
the tile less ``--crop`` on each side (stride ``tile - 2 * crop``), blends the overlaps and writes a float32
Zarr array of the volume's shape (``--chunks``) with zarr-python:

- ``stoker``: ``TileGrid`` -> ``CropDataset(with_samples=True)`` -> model -> ``TileWriter`` (``crop``,
  ``blend`` "none" or "hann"), reading and writing chunk by chunk, the writes on ``--write-threads``
  background threads;
- ``stoker_sync`` (only when named in ``--peers``): the same with ``write_threads=0``, every region written
  on the consumer's thread (the writer before its background writes);
- ``monai``: a zarr-python read of the whole array, ``sliding_window_inference`` (the same tile and stride;
  ``mode`` "constant" for "none", "gaussian" for "hann"; MONAI blends whole tiles, it has no crop), a
  zarr-python write;
- ``torchio``: a zarr-python read, ``GridSampler`` (``patch_overlap = 2 * crop``) through a DataLoader,
  ``GridAggregator`` (``overlap_mode`` "crop" for "none", "hann" for "hann"), a zarr-python write.

The output is zarr-python's default for a v3 float32 array (``bytes`` + ``zstd`` level 0, what
``zarr.create_array`` makes when a user names no codec, and what ``TileWriter`` makes); its encoding is
most of every peer's CPU. The input (``--data``) is uniform 12-bit noise by default, the worst case for
the compressor; ``--data smooth`` is a labelled row of a seeded microscopy-like volume (blobs on a smooth
background, with shot noise), whose output compresses as real predictions do, far better than noise.
``--codec none`` is a second, labelled row: every peer's output without a
compressor (stoker's array made first, then opened by the writer), which leaves the tiling, the blend and
the storing.

Rounds are interleaved (every round runs every peer and blend, the peers' order rotating), so a machine
shared with other work slows all peers alike; the report is each peer's median and best time and the
ratios ``peer / stoker`` of the medians (the targets: >= 1.5 against MONAI, >= 2 against torchio), and the
same for CPU time (``time.process_time``: every thread of the process; on a machine shared with other work
the steadier of the two). Every output is checked against the input outside the timings (an identity model's blend is the input). A peer
that does not import is reported as missing and left out. Threads: ``--threads`` for stoker's decoding and
for torch (``torch.set_num_threads``).

The peers' CPU time counts torch's OpenMP workers spinning between operations: libgomp's default wait policy
spins for a while after each parallel operation before it sleeps, and MONAI's and torchio's many small torch
operations keep those workers spinning through most of their tiling (torchio's ``none`` row at load 6-12: the
main thread and the OpenMP worker 0.43-0.70 s of CPU a volume by default, 0.12 s with
``OMP_WAIT_POLICY=PASSIVE``; see docs/inference.md). That is CPU a peer takes from the machine, not work, so
the CPU ratios of a default run overstate how much less stoker computes; ``--omp-passive`` runs the whole
benchmark again with ``OMP_WAIT_POLICY=PASSIVE`` (the workers sleep at once; stoker uses no OpenMP), and the
result names the policy it ran with (``omp_wait_policy``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import zarr

import stoker

BLENDS = ("none", "hann")


DATA = ("noise", "smooth")


def volume_data(kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The input volume, seeded: ``noise``, uniform 12-bit noise (the first rows' data: the worst case for
    a compressor); ``smooth``, microscopy-like, what a real prediction's smoothness is closer to: bright
    blobs (sparse seeds blurred, sigma 3 voxels) on a slowly varying background (coarse noise blurred and
    interpolated 8x), with shot noise on top (normal, half the square root of the signal), 12-bit."""
    rng = np.random.default_rng(0)
    if kind == "noise":
        return rng.integers(0, 4096, shape, dtype=np.uint16)
    from scipy.ndimage import gaussian_filter, zoom

    blobs = gaussian_filter((rng.random(shape) < 2e-4).astype(np.float32), sigma=3, truncate=3)
    coarse = gaussian_filter(rng.random(tuple(-(-n // 8) + 1 for n in shape), dtype=np.float32), sigma=2)
    background = zoom(coarse, 8, order=1)[tuple(slice(0, n) for n in shape)]  # smooth over ~16 voxels
    background -= background.min()
    signal = 100 + 400 * background / max(float(background.max()), 1e-12) + 3000 * blobs / max(float(blobs.max()), 1e-12)
    noisy = signal + rng.normal(0, 1, shape).astype(np.float32) * np.sqrt(signal) / 2  # 4 photons a grey level
    return np.clip(np.rint(noisy), 0, 4095).astype(np.uint16)


def make_volume(path: Path, shape: tuple[int, ...], chunks: tuple[int, ...], kind: str = "noise") -> str:
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, dtype="uint16")
    z[:] = volume_data(kind, shape)
    return str(path)


def _create(out: str, a: argparse.Namespace) -> zarr.Array:
    """The output array: zarr-python's defaults (``--codec zstd``: bytes + zstd level 0 for a v3 float32
    array), or no compressor (``--codec none``)."""
    kw: dict = {} if a.codec == "zstd" else {"compressors": None}
    return zarr.create_array(out, shape=tuple(a.shape), chunks=tuple(a.chunks), dtype="float32", **kw)


def run_stoker(src: str, out: str, a: argparse.Namespace, blend: str, write_threads: int | None = None) -> None:
    tile = tuple(a.tile)
    if a.codec != "zstd":
        _create(out, a)  # a codec of the user's choosing: the array made first, the writer opens it
    grid = stoker.TileGrid([src], tile, stride=tuple(t - 2 * a.crop for t in tile))
    writer = stoker.TileWriter(out, tuple(a.shape), tuple(a.chunks), "float32", blend=blend, crop=a.crop, grid=grid,
                               write_threads=a.write_threads if write_threads is None else write_threads)
    cfg = stoker.Config(batch_size=a.batch_size, dtype="f32", sample_shape=tile, device="cpu",
                        n_compute_threads=a.threads)
    with torch.inference_mode():
        for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
            writer.write(samples, x)  # the identity model
    writer.close()


def _read(src: str) -> torch.Tensor:
    return torch.from_numpy(zarr.open_array(src, mode="r")[:].astype(np.float32))


def _write(out: str, a: argparse.Namespace, values: torch.Tensor) -> None:
    _create(out, a)[:] = values.numpy()


def run_monai(src: str, out: str, a: argparse.Namespace, blend: str) -> None:
    from monai.inferers import sliding_window_inference

    # MONAI's stride is int(tile * (1 - overlap)): half a voxel less overlap keeps float rounding off it
    overlap = [(2 * a.crop - 0.5) / t for t in a.tile]
    with torch.inference_mode():
        pred = sliding_window_inference(_read(src)[None, None], roi_size=tuple(a.tile), sw_batch_size=a.batch_size,
                                        predictor=lambda x: x, overlap=overlap,
                                        mode="constant" if blend == "none" else "gaussian")
    _write(out, a, pred[0, 0])


def run_torchio(src: str, out: str, a: argparse.Namespace, blend: str) -> None:
    import torchio as tio

    subject = tio.Subject(img=tio.ScalarImage(tensor=_read(src)[None]))
    sampler = tio.inference.GridSampler(subject, tuple(a.tile), patch_overlap=2 * a.crop)
    aggregator = tio.inference.GridAggregator(sampler, overlap_mode="crop" if blend == "none" else "hann")
    loader = torch.utils.data.DataLoader(sampler, batch_size=a.batch_size)
    with torch.inference_mode():
        for batch in loader:
            aggregator.add_batch(batch["img"][tio.DATA], batch[tio.LOCATION])  # the identity model
    _write(out, a, aggregator.get_output_tensor()[0])


def run_stoker_sync(src: str, out: str, a: argparse.Namespace, blend: str) -> None:
    run_stoker(src, out, a, blend, write_threads=0)


PEERS: dict[str, Callable[[str, str, argparse.Namespace, str], None]] = {
    "stoker": run_stoker, "monai": run_monai, "torchio": run_torchio, "stoker_sync": run_stoker_sync}


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The peers that import, and why each other one does not."""
    ok, missing = [], {}
    for name in names:
        if name.startswith("stoker"):
            ok.append(name)
            continue
        try:
            __import__(name)
            ok.append(name)
        except Exception as exc:  # ImportError, or a package that breaks on import
            missing[name] = f"{type(exc).__name__}: {exc}"
    return ok, missing


def check(src: str, out: str, peer: str, blend: str) -> None:
    """An identity model's blend is its input, wherever a peer puts its weights."""
    want = zarr.open_array(src, mode="r")[:].astype(np.float32)
    got = zarr.open_array(out, mode="r")[:]
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-3):
        bad = np.argwhere(~np.isclose(got, want, rtol=1e-5, atol=1e-3)) if got.shape == want.shape else None
        raise SystemExit(f"{peer} blend={blend}: the output is not the input (identity model): shape {got.shape}, "
                         f"{0 if bad is None else len(bad)} voxels differ, the first at "
                         f"{None if bad is None or not len(bad) else tuple(int(i) for i in bad[0])}")


def _remove(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".tiles-done", ignore_errors=True)


def components(src: str, root: Path, a: argparse.Namespace) -> dict[str, float]:
    """CPU seconds (``time.process_time``, the least of ``--rounds`` runs) of each peer's parts, run apart: the
    read, zstd's encoding of the output chunks, the two ways of storing them, and each peer's tiling and blend
    of the identity model in memory (``--components``; see docs/inference.md)."""
    import numcodecs

    from stoker.inference.chunks import ChunkWriter

    def least(fn: Callable[[], object]) -> float:
        spent = []
        for _ in range(a.rounds):
            c0 = time.process_time()
            fn()
            spent.append(time.process_time() - c0)
        return round(min(spent), 3)

    vol = zarr.open_array(src, mode="r")[:].astype(np.float32)
    step = tuple(a.chunks)
    boxes = [tuple(slice(i * c, min(i * c + c, n)) for i, c, n in zip(corner, step, a.shape))
             for corner in np.ndindex(*(-(-n // c) for n, c in zip(a.shape, step)))]
    chunks = [np.ascontiguousarray(vol[b]) for b in boxes]
    zstd = numcodecs.Zstd(level=0)  # zarr-python's default for a v3 float array
    out = str(root / "components.zarr")

    def zarr_write() -> None:
        _remove(out)
        _create(out, a)[:] = vol

    def direct_write() -> None:
        _remove(out)
        cw = ChunkWriter(_create(out, a))
        for b, c in zip(boxes, chunks):
            cw.write(b, c)

    from stoker.inference import zstdframes

    frames = zstdframes.ZstdFrames(level=0, checksum=False) if zstdframes.available() else None
    into = np.empty(frames.bound(max(c.nbytes for c in chunks)) if frames is not None else 1, dtype=np.uint8)
    got = {"read: zarr-python whole + astype": least(lambda: zarr.open_array(src, mode="r")[:].astype(np.float32)),
           "encode: zstd of the output chunks" if a.codec == "zstd" else "encode: none (--codec none)":
               least(lambda: [zstd.encode(c) for c in chunks] if a.codec == "zstd" else None)}
    if a.codec == "zstd" and frames is not None:  # what TileWriter's write threads encode with: the same frames
        got["encode: the same frames, one reused context (ZstdFrames)"] = least(
            lambda: [frames.encode(c, into) for c in chunks])
    got |= {
           "store: zarr-python write (create + write)": least(zarr_write),
           "store: ChunkWriter (create + write)": least(direct_write)}
    tile = tuple(a.tile)
    grid = stoker.TileGrid([src], tile, stride=tuple(t - 2 * a.crop for t in tile))
    cfg = stoker.Config(batch_size=a.batch_size, dtype="f32", sample_shape=tile, device="cpu",
                        n_compute_threads=a.threads)
    got["read: stoker tiles (TileGrid + CropDataset)"] = least(
        lambda: [None for _ in stoker.CropDataset(grid, cfg, with_samples=True)])
    batches = [(s, x.clone()) for s, x in stoker.CropDataset(grid, cfg, with_samples=True)]
    x = torch.from_numpy(vol)
    for blend in a.blends:
        def stoker_blend() -> None:
            _remove(out)
            if a.codec != "zstd":
                _create(out, a)
            w = stoker.TileWriter(out, tuple(a.shape), step, "float32", blend=blend, crop=a.crop, grid=grid,
                                  write_threads=0)
            for s, xb in batches:
                w.write(s, xb)
            w.close()
        # the writer fed batches held in memory, on one thread: its blend, then the same encode and store
        got[f"blend {blend}: stoker TileWriter (+ encode + store)"] = least(stoker_blend)
        if a.codec == "zstd":
            def stoker_blend_raw() -> None:
                _remove(out)
                zarr.create_array(out, shape=tuple(a.shape), chunks=step, dtype="float32", compressors=None)
                w = stoker.TileWriter(out, tuple(a.shape), step, "float32", blend=blend, crop=a.crop, grid=grid,
                                      write_threads=0)
                for s, xb in batches:
                    w.write(s, xb)
                w.close()
            # the same without a compressor: the blend and the store, no encode
            got[f"blend {blend}: stoker TileWriter, no codec (+ store)"] = least(stoker_blend_raw)
        if _imports("monai"):
            from monai.inferers import sliding_window_inference

            overlap = [(2 * a.crop - 0.5) / t for t in a.tile]
            got[f"blend {blend}: monai sliding_window_inference"] = least(lambda: sliding_window_inference(
                x[None, None], roi_size=tile, sw_batch_size=a.batch_size, predictor=lambda t: t, overlap=overlap,
                mode="constant" if blend == "none" else "gaussian"))
        if _imports("torchio"):
            import torchio as tio

            def tio_blend() -> None:
                subject = tio.Subject(img=tio.ScalarImage(tensor=x[None]))
                sampler = tio.inference.GridSampler(subject, tile, patch_overlap=2 * a.crop)
                agg = tio.inference.GridAggregator(sampler, overlap_mode="crop" if blend == "none" else "hann")
                for b in torch.utils.data.DataLoader(sampler, batch_size=a.batch_size):
                    agg.add_batch(b["img"][tio.DATA], b[tio.LOCATION])
                agg.get_output_tensor()
            got[f"blend {blend}: torchio GridSampler + GridAggregator"] = least(tio_blend)
    _remove(out)
    for k, v in got.items():
        print(f"  {k:58s} {v:.3f} s CPU")
    return got


def _imports(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=(128, 256, 256))
    p.add_argument("--tile", type=int, nargs=3, default=(96, 96, 96))
    p.add_argument("--crop", type=int, default=20, help="margin of each tile outside its valid centre")
    p.add_argument("--chunks", type=int, nargs=3, default=(64, 64, 64))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-threads", type=int, default=2, help="TileWriter(write_threads=) of stoker")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--codec", choices=("zstd", "none"), default="zstd",
                   help="the output's compressor, the same for every peer: zstd (zarr-python's default for a v3 "
                        "float32 array: bytes + zstd level 0) or none (no compressor: what is left is the tiling, "
                        "blending and storing)")
    p.add_argument("--data", choices=DATA, default="noise",
                   help="the input volume, the same for every peer: noise (uniform 12-bit) or smooth "
                        "(microscopy-like blobs and background with shot noise; see volume_data)")
    p.add_argument("--blends", nargs="+", choices=BLENDS, default=list(BLENDS))
    p.add_argument("--peers", nargs="+", choices=list(PEERS), default=["stoker", "monai", "torchio"])
    p.add_argument("--extra-path", action="append", default=[],
                   help="a folder appended to sys.path (a package installed with pip --target), after the "
                        "environment's own, so it shadows nothing")
    p.add_argument("--dir", default=None, help="where the arrays go (default: a temporary folder)")
    p.add_argument("--components", action="store_true",
                   help="also the CPU seconds of each peer's parts, run apart (read, encode, store, blend)")
    p.add_argument("--omp-passive", action="store_true",
                   help="run with OMP_WAIT_POLICY=PASSIVE (the script starts itself again with it): torch's OpenMP "
                        "workers sleep between operations instead of spinning, so the peers' CPU time is their work")
    a = p.parse_args(argv)
    if a.omp_passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # libgomp reads the policy once, when torch loads it: only a fresh process takes it
        args = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *args],
                  {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    sys.path.extend(a.extra_path)
    torch.set_num_threads(a.threads)
    peers, missing = available(a.peers)
    root = Path(a.dir or tempfile.mkdtemp(prefix="stoker-tiles-"))
    src = make_volume(root / "in.zarr", tuple(a.shape), tuple(a.chunks), a.data)
    times: dict[str, dict[str, list[float]]] = {b: {peer: [] for peer in peers} for b in a.blends}
    cpu: dict[str, dict[str, list[float]]] = {b: {peer: [] for peer in peers} for b in a.blends}
    load = [os.getloadavg()[0]]
    parts = None
    try:
        if a.components:
            print(f"CPU by component, the least of {a.rounds} runs (torch threads: {a.threads}):")
            parts = components(src, root, a)
        for r in range(a.rounds):
            for blend in a.blends:
                for peer in peers[r % len(peers):] + peers[:r % len(peers)]:  # the order rotates per round
                    out = str(root / f"{peer}-{blend}.zarr")
                    _remove(out)
                    t0, c0 = time.perf_counter(), time.process_time()
                    PEERS[peer](src, out, a, blend)
                    times[blend][peer].append(time.perf_counter() - t0)
                    cpu[blend][peer].append(time.process_time() - c0)  # every thread of the process
                    if r == 0:
                        check(src, out, peer, blend)
                    _remove(out)
            load.append(os.getloadavg()[0])
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    voxels = int(np.prod(a.shape))
    result: dict = {"shape": a.shape, "tile": a.tile, "crop": a.crop, "chunks": a.chunks, "dtype": "uint16",
                    "data": a.data, "codec": a.codec,
                    "batch_size": a.batch_size, "threads": a.threads, "write_threads": a.write_threads, "rounds": a.rounds, "cpus": os.cpu_count(),
                    "load_1min": [round(x, 2) for x in load], "missing": missing, "blends": {},
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
                    "components_cpu_s": parts}
    for blend, by_peer in times.items():
        med = {peer: statistics.median(t) for peer, t in by_peer.items()}
        med_cpu = {peer: statistics.median(t) for peer, t in cpu[blend].items()}
        result["blends"][blend] = {
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "best_s": {peer: round(min(t), 3) for peer, t in by_peer.items()},
            "cpu_median_s": {k: round(v, 3) for k, v in med_cpu.items()},
            "stoker_mvoxels_per_s": round(voxels / med["stoker"] / 1e6, 1) if "stoker" in med else None,
            "speedup": {f"stoker_vs_{peer}": round(v / med["stoker"], 2) for peer, v in med.items()
                        if peer != "stoker" and "stoker" in med},
            "cpu_ratio": {f"stoker_vs_{peer}": round(v / med_cpu["stoker"], 2) for peer, v in med_cpu.items()
                          if peer != "stoker" and "stoker" in med_cpu}}
    print(f"{a.shape} uint16 {a.data}, tiles {a.tile}, crop {a.crop}, chunks {a.chunks}, codec {a.codec}, "
          f"{a.rounds} interleaved rounds, "
          f"{os.cpu_count()} CPUs, 1-min load {result['load_1min']}, OMP_WAIT_POLICY {result['omp_wait_policy']}"
          + (f"; missing: {missing}" if missing else ""))
    for blend, r in result["blends"].items():
        print(f"blend={blend}: median s {r['median_s']}, best s {r['best_s']}; stoker / peer: {r['speedup']}; "
              f"CPU s (process_time, median) {r['cpu_median_s']}, peer / stoker: {r['cpu_ratio']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
