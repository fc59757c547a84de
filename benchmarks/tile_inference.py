"""Whole-volume inference throughput: stoker (TileGrid -> CropDataset -> model -> TileWriter) against MONAI's
``sliding_window_inference`` over a zarr-python read of the array, followed by a zarr-python write.

    python benchmarks/tile_inference.py --shape 128 256 256 --tile 96 96 96 --crop 20 --repeats 3

Both sides run an identity model (the prediction is the input tile), blend overlapping tiles (stoker
``hann``, MONAI ``gaussian``) and write a float32 array of the volume's shape to a fresh Zarr array with
the given chunks. The time is read + model + write, best of ``--repeats``; the report is voxels per second
and the ratio (the target is stoker >= 1.5x MONAI). MONAI pads the borders and stoker shifts its last
tiles back instead; both cover every voxel with the same tile and overlap, so the work is comparable.
Without MONAI installed the script says so and times stoker alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr

import stoker


def make_volume(path: Path, shape: tuple[int, ...], chunks: tuple[int, ...]) -> str:
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, dtype="float32")
    z[:] = np.random.default_rng(0).random(shape, dtype=np.float32)
    return str(path)


def run_stoker(src: str, out: str, shape, tile, crop, chunks, batch: int, threads: int) -> float:
    t0 = time.perf_counter()
    stride = tuple(t - 2 * crop for t in tile)
    grid = stoker.TileGrid([src], tile, stride=stride)
    writer = stoker.TileWriter(out, shape, chunks, "float32", blend="hann", crop=crop, grid=grid)
    cfg = stoker.Config(batch_size=batch, dtype="f32", sample_shape=tile, device="cpu", n_compute_threads=threads)
    with torch.inference_mode():
        for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
            writer.write(samples, x)  # the identity model
    writer.close()
    return time.perf_counter() - t0


def run_monai(src: str, out: str, shape, tile, crop, chunks, batch: int) -> float:
    from monai.inferers import sliding_window_inference

    t0 = time.perf_counter()
    volume = torch.from_numpy(zarr.open_array(src, mode="r")[:])[None, None]
    overlap = [2 * crop / t for t in tile]  # the same stride as stoker's
    with torch.inference_mode():
        pred = sliding_window_inference(volume, roi_size=tile, sw_batch_size=batch, predictor=lambda x: x,
                                        overlap=overlap, mode="gaussian")
    z = zarr.create_array(out, shape=shape, chunks=chunks, dtype="float32")
    z[:] = pred[0, 0].numpy()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=(128, 256, 256))
    p.add_argument("--tile", type=int, nargs=3, default=(96, 96, 96))
    p.add_argument("--crop", type=int, default=20)
    p.add_argument("--chunks", type=int, nargs=3, default=(64, 64, 64))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the arrays go (default: a temporary folder)")
    a = p.parse_args()
    shape, tile, chunks = tuple(a.shape), tuple(a.tile), tuple(a.chunks)
    root = Path(a.dir or tempfile.mkdtemp(prefix="stoker-tiles-"))
    src = make_volume(root / "in.zarr", shape, chunks)
    voxels = int(np.prod(shape))
    result: dict = {"shape": shape, "tile": tile, "crop": a.crop, "chunks": chunks, "batch_size": a.batch_size}
    times = []
    for i in range(a.repeats):
        out = root / f"stoker-{i}.zarr"
        times.append(run_stoker(src, str(out), shape, tile, a.crop, chunks, a.batch_size, a.threads))
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(str(out) + ".tiles-done", ignore_errors=True)
    result["stoker_s"] = min(times)
    result["stoker_voxels_per_s"] = voxels / min(times)
    try:
        import monai  # noqa: F401
    except ImportError:
        result["monai"] = "not installed (pip install monai): stoker timed alone"
    else:
        times = []
        for i in range(a.repeats):
            out = root / f"monai-{i}.zarr"
            times.append(run_monai(src, str(out), shape, tile, a.crop, chunks, a.batch_size))
            shutil.rmtree(out, ignore_errors=True)
        result["monai_s"] = min(times)
        result["monai_voxels_per_s"] = voxels / min(times)
        result["speedup"] = result["monai_s"] / result["stoker_s"]
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
