"""OME-Zarr images written with zarr-python for the tests of levels (reader/test_ome_levels.py, stoker inspect)."""

from __future__ import annotations

import numpy as np
import zarr


def write_multiscales(image_group, image: dict, label_group, label: dict, fmt: int) -> None:
    """The ``multiscales`` of an image group and of its label image's group (marked ``image-label``), as
    OME-Zarr 0.4 (v2: at the top of the attributes) or 0.5 (v3: under ``ome``) has them."""
    if fmt == 2:
        image_group.attrs["multiscales"] = [{**image, "version": "0.4"}]
        label_group.attrs.update({"multiscales": [{**label, "version": "0.4"}], "image-label": {"version": "0.4"}})
    else:
        image_group.attrs["ome"] = {"version": "0.5", "multiscales": [image]}
        label_group.attrs["ome"] = {"version": "0.5", "multiscales": [label], "image-label": {"version": "0.5"}}


def labelled_image(path: str, fmt: int) -> tuple[np.ndarray, np.ndarray]:
    """An image (``s0`` full resolution, ``s1`` 2x coarser) with a label image ``labels/cells`` written at half
    its resolution (the label's ``s0`` of physical scale 2, ``s1`` 4x the image's, shifted half a voxel of its
    ``s0`` as ome-zarr-py's block downsampling records it) and a multiscale-level transform on the image;
    OME-Zarr 0.4 (v2, ``image-label`` at the top) or 0.5 (v3, under ``ome``). Returns the image and the
    labels: each label voxel holds the image voxel at its corner, so a label box read at the wrong place
    shows."""
    z, y, x = np.meshgrid(*[np.arange(32)] * 3, indexing="ij")
    raw = (z * 10_000 + y * 100 + x).astype("uint32")
    labels = raw[::2, ::2, ::2]
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    g.create_array("s0", shape=raw.shape, chunks=(8, 8, 8), dtype="uint32")[...] = raw
    g.create_array("s1", shape=(16, 16, 16), chunks=(8, 8, 8), dtype="uint32")[...] = raw[::2, ::2, ::2]
    cells = zarr.open_group(f"{path}/labels/cells", mode="w", zarr_format=fmt)
    cells.create_array("s0", shape=labels.shape, chunks=(8, 8, 8), dtype="uint32")[...] = labels
    cells.create_array("s1", shape=(8, 8, 8), chunks=(8, 8, 8), dtype="uint32")[...] = labels[::2, ::2, ::2]
    axes = [{"name": a, "type": "space", "unit": "micrometer"} for a in "zyx"]

    def level(scale: float, shift: float) -> dict:
        return {"coordinateTransformations": [{"type": "scale", "scale": [scale] * 3},
                                              {"type": "translation", "translation": [shift] * 3}]}

    image = {"axes": axes, "name": "img", "datasets": [{"path": "s0", **level(1.0, 0.0)}, {"path": "s1", **level(2.0, 0.5)}],
             "coordinateTransformations": [{"type": "scale", "scale": [0.5] * 3}]}
    label = {"axes": axes, "name": "cells", "datasets": [{"path": "s0", **level(1.0, 0.0)}, {"path": "s1", **level(2.0, 0.5)}],
             "coordinateTransformations": [{"type": "scale", "scale": [1.0] * 3}]}  # its level 0: 1 um, the image's 0.5
    write_multiscales(g, image, cells, label, fmt)
    zarr.open_group(f"{path}/labels", mode="a", zarr_format=fmt).attrs.update(
        {"labels": ["cells"]} if fmt == 2 else {"ome": {"version": "0.5", "labels": ["cells"]}})
    return raw, labels
