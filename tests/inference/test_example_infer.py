"""examples/infer_tiles.py end to end: a tiny model over an OME-Zarr level, one process and two torchrun
gloo ranks on the CPU, giving the same arrays with every voxel written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "infer_tiles.py"
SHAPE = (40, 70, 50)  # not a whole number of tiles on any axis

pytestmark = pytest.mark.timeout(300)


def _image(root: Path) -> str:
    image = root / "img.ome.zarr"
    g = zarr.open_group(str(image), mode="w")
    rng = np.random.default_rng(1)
    level0 = g.create_array("0", shape=SHAPE, chunks=(16, 32, 32), dtype="uint16")
    level0[:] = rng.integers(0, 4000, SHAPE, dtype=np.uint16)
    level1 = g.create_array("1", shape=tuple(s // 2 for s in SHAPE), chunks=(16, 32, 32), dtype="uint16")
    level1[:] = level0[::2, ::2, ::2]
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": [{"name": a, "type": "space"} for a in "zyx"],
                                                         "datasets": [{"path": "0"}, {"path": "1"}]}]}
    return str(image)


def _run(ranks: int, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={ranks}"]
    proc = subprocess.run(launch + [str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("output", ["labels", "probabilities"])
def test_two_ranks_write_the_one_rank_array(tmp_path, output):
    image = _image(tmp_path)
    one = _run(1, "--image", image, "--out", str(tmp_path / "one.zarr"), "--output", output)
    two = _run(2, "--image", image, "--out", str(tmp_path / "two.zarr"), "--output", output)
    assert len(one) == 1 and len(two) == 2 and {r["rank"] for r in two} == {0, 1}
    a = zarr.open_array(str(tmp_path / "one.zarr"), mode="r")[:]
    b = zarr.open_array(str(tmp_path / "two.zarr"), mode="r")[:]
    assert sum(r["regions_written"] for r in two) == one[0]["regions_written"] == 2 * 3 * 2
    if output == "labels":
        assert a.shape == SHAPE and a.dtype == np.uint8 and (a != 255).all()  # every voxel written
        np.testing.assert_array_equal(a, b)
    else:
        assert a.shape == (3, *SHAPE)
        np.testing.assert_allclose(a.sum(0), 1, rtol=1e-5)  # blended probabilities, everywhere
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_padded_tiles_write_every_voxel_on_two_ranks_as_on_one(tmp_path):
    """--pad reflect: tiles reach past the borders, the engine fills what lies outside, and the writer crops
    every tile to its centre."""
    image = _image(tmp_path)
    args = ("--image", image, "--output", "labels", "--pad", "reflect")
    one = _run(1, *args, "--out", str(tmp_path / "one.zarr"))
    two = _run(2, *args, "--out", str(tmp_path / "two.zarr"))
    assert sum(r["regions_written"] for r in two) == one[0]["regions_written"] == 2 * 3 * 2
    assert one[0]["tiles"] == 3 * 5 * 4  # ceil(40 / 16) x ceil(70 / 16) x ceil(50 / 16) centres of 16^3
    a = zarr.open_array(str(tmp_path / "one.zarr"), mode="r")[:]
    assert a.shape == SHAPE and (a != 255).all()  # every voxel written
    np.testing.assert_array_equal(a, zarr.open_array(str(tmp_path / "two.zarr"), mode="r")[:])
