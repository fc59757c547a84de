"""The ids of an OME-Zarr label image are never merged by a 16-bit float batch: bfloat16 holds integers exactly
only up to 256 and float16 up to 2048, so 16-bit ids 1000..1063 read as ``"bf16"`` gave 12 distinct values
where 64 were stored. 16-bit images stay allowed into those outputs (rounding an intensity is what they
are for); a label image's levels (``<image>/labels/<name>/<level>``, its group marked ``image-label``) are
refused with a DtypeMismatch naming the fix, unless ``Config(lossy_casts=True)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from ome_images import write_multiscales
from stoker.reader.ome import is_label_level

pytestmark = pytest.mark.timeout(60)


def _image_with_labels(path: str, fmt: int) -> tuple[np.ndarray, np.ndarray]:
    """A uint16 image and its uint16 label image ``labels/cells`` (ids 1000..1063, one per 4^3 block), both at
    one level, OME-Zarr 0.4 (v2) or 0.5 (v3)."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 60000, (16, 16, 16), dtype="uint16")
    labels = (1000 + np.arange(64, dtype="uint16").reshape(4, 4, 4)).repeat(4, 0).repeat(4, 1).repeat(4, 2)
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    g.create_array("0", shape=raw.shape, chunks=(8, 8, 8), dtype="uint16")[...] = raw
    cells = zarr.open_group(f"{path}/labels/cells", mode="w", zarr_format=fmt)
    cells.create_array("0", shape=labels.shape, chunks=(8, 8, 8), dtype="uint16")[...] = labels
    axes = [{"name": a, "type": "space"} for a in "zyx"]
    level = [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1.0] * 3}]}]
    image, label = {"axes": axes, "datasets": level, "name": "img"}, {"axes": axes, "datasets": level, "name": "cells"}
    write_multiscales(g, image, cells, label, fmt)
    return raw, labels


def _read(fields, dtype, **cfg):
    source = stoker.RandomCrops(fields, seed=0, samples_per_epoch=4).for_rank(0, 1)
    with stoker.Pipeline(stoker.Config(batch_size=4, dtype=dtype, **cfg)) as p:
        p.push(source)
        with p.pop() as batch:
            return {k: torch.from_dlpack(v).float().numpy().copy() for k, v in batch.items()}, list(batch.samples)


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_label_image_s_16_bit_ids_are_refused_into_16_bit_floats(tmp_path, fmt):
    image = str(tmp_path / "img.ome.zarr")
    raw, labels = _image_with_labels(image, fmt)
    assert is_label_level(f"{image}/labels/cells/0") and not is_label_level(f"{image}/0")
    fields = {"raw": stoker.Field(f"{image}/0", (8, 8, 8)), "labels": stoker.Field(f"{image}/labels/cells/0", (8, 8, 8))}
    for half in ("bf16", "f16"):
        with pytest.raises(stoker.DtypeMismatch, match="label image.*would merge.*lossy_casts"):
            _read(fields, half)
        with pytest.raises(stoker.DtypeMismatch, match="label image"):  # one box of the labels alone too
            _read({"labels": fields["labels"]}, {"labels": half})
    # the image into bf16 and its labels exact: what the message advises
    got, samples = _read(fields, {"raw": "bf16", "labels": "f32"})
    for i, sample in enumerate(samples):
        box = tuple(slice(lo, hi) for lo, hi in sample["labels"].aabb)
        np.testing.assert_array_equal(got["labels"][i], labels[box].astype("f4"))
        assert len(np.unique(got["labels"][i])) == len(np.unique(labels[box]))
    # asked for: rounded, as the Config says
    got, _ = _read(fields, "bf16", lossy_casts=True)
    assert got["labels"].dtype == np.float32 and len(np.unique(got["labels"])) < 64
