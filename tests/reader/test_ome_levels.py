"""OME-Zarr pyramid levels (stoker.reader.ome.level_scale) against ome-zarr-py's own reading of the image.

The images are written with zarr-python and their ``multiscales`` as the OME-NGFF spec has them (0.4 in a v2
group's ``.zattrs``, 0.5 under ``attributes["ome"]`` of a v3 group); ome-zarr-py's ``Reader`` says which array
each dataset ``path`` names and its scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from stoker.reader.ome import level_scale

pytestmark = pytest.mark.timeout(60)


def _image(path: str, paths: list[str], factors: list[int], fmt: int) -> None:
    """An OME-Zarr image at ``path``: level i at ``paths[i]`` (relative to the image group, maybe nested),
    ``factors[i]`` times coarser in y and x, scales in micrometres."""
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    datasets = []
    for p, f in zip(paths, factors):
        a = g.create_array(p, shape=(3, 32 // f, 32 // f), chunks=(3, 8, 8), dtype="uint8")
        a[...] = f
        datasets.append({"path": p, "coordinateTransformations": [
            {"type": "scale", "scale": [1.0, 0.25 * f, 0.25 * f]}]})
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", "unit": "micrometer"},
            {"name": "x", "type": "space", "unit": "micrometer"}]
    multiscale = {"axes": axes, "datasets": datasets, "name": "img"}
    if fmt == 2:
        g.attrs["multiscales"] = [{**multiscale, "version": "0.4"}]
    else:
        g.attrs["ome"] = {"version": "0.5", "multiscales": [multiscale]}


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_nested_dataset_path_is_the_level_it_names(tmp_path, fmt):
    """A dataset ``path`` is relative to the image group and may hold ``/`` (the spec's "path to the array
    for this resolution relative to the current zarr group"): level ``s/1`` lies two folders below the
    group holding the multiscales, not in its parent."""
    image = str(tmp_path / "img.zarr")
    _image(image, ["s/0", "s/1", "s/2"], [1, 2, 4], fmt)

    ome_zarr = pytest.importorskip("ome_zarr.reader")
    from ome_zarr.io import parse_url

    node = next(iter(ome_zarr.Reader(parse_url(image))()))
    scales = [t[0]["scale"] for t in node.metadata["coordinateTransformations"]]
    assert [tuple(d.shape) for d in node.data] == [(3, 32, 32), (3, 16, 16), (3, 8, 8)]
    for level, path in enumerate(["s/1", "s/2"], start=1):
        want = tuple(int(m / b) for m, b in zip(scales[level], scales[0]))
        assert level_scale(f"{image}/{path}") == want  # (1, 2, 2), (1, 4, 4): not None (one voxel per voxel)
    assert level_scale(f"{image}/s/0") is None  # level 0: the reference


def test_a_nested_level_inside_an_image_with_its_own_labels(tmp_path):
    """An image group's own multiscales win: a label image nested under ``labels/`` is its own pyramid."""
    image = str(tmp_path / "img.zarr")
    _image(image, ["0", "1"], [1, 2], 2)
    _image(f"{image}/labels/cells", ["0", "1", "2"], [1, 2, 4], 2)
    assert level_scale(f"{image}/1") == (1, 2, 2)
    assert level_scale(f"{image}/labels/cells/2") == (1, 4, 4)
    assert level_scale(f"{image}/labels/cells/0") is None
    np.testing.assert_array_equal(zarr.open_array(f"{image}/labels/cells/2")[0, 0, :2], [4, 4])


def test_a_nested_level_over_http_is_found_as_locally(tmp_path):
    from range_server import RangeServer

    _image(str(tmp_path / "img.zarr"), ["s/0", "s/1"], [1, 2], 3)
    server = RangeServer(str(tmp_path))
    try:
        assert level_scale(f"{server.url}/img.zarr/s/1") == (1, 2, 2)
        assert level_scale(f"{server.url}/img.zarr/s/0") is None
    finally:
        server.shutdown()
