"""OME-Zarr pyramid levels (stoker.reader.ome.level_scale) against ome-zarr-py's own reading of the image.

The images are written with zarr-python and their ``multiscales`` as the OME-NGFF spec has them (0.4 in a v2
group's ``.zattrs``, 0.5 under ``attributes["ome"]`` of a v3 group); ome-zarr-py's ``Reader`` says which array
each dataset ``path`` names and its scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from stoker.reader.array import open_array
from stoker.reader.ome import level_scale
from stoker.storage.locate import Stores

from ome_images import labelled_image as _labelled_image, write_multiscales

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


def _ome_zarr_ratios(image: str) -> list[tuple[int, ...]]:
    """Per level of the image at ``image``, its scale over level 0's, as ome-zarr-py reads the image."""
    ome_zarr = pytest.importorskip("ome_zarr.reader")
    from ome_zarr.io import parse_url

    node = next(iter(ome_zarr.Reader(parse_url(image))()))
    scales = [t[0]["scale"] for t in node.metadata["coordinateTransformations"]]
    return [tuple(int(round(m / b)) for m, b in zip(s, scales[0])) for s in scales]


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
    """An image group's own multiscales win: a label image nested under ``labels/`` is its own pyramid. The
    outer image's levels have the label image's level names but other ratios (4 and 16 against 2 and 4), so
    a label level resolved against the outer image's multiscales gives another answer than its own."""
    image = str(tmp_path / "img.zarr")
    _image(image, ["0", "1", "2"], [1, 4, 16], 2)
    _image(f"{image}/labels/cells", ["0", "1", "2"], [1, 2, 4], 2)
    zarr.open_group(f"{image}/labels", mode="a", zarr_format=2).attrs["labels"] = ["cells"]  # as the spec has it

    assert _ome_zarr_ratios(image) == [(1, 1, 1), (1, 4, 4), (1, 16, 16)]
    want = _ome_zarr_ratios(f"{image}/labels/cells")
    assert want == [(1, 1, 1), (1, 2, 2), (1, 4, 4)]
    assert level_scale(f"{image}/1") == (1, 4, 4)
    assert level_scale(f"{image}/2") == (1, 16, 16)
    assert level_scale(f"{image}/labels/cells/0") is None
    assert [level_scale(f"{image}/labels/cells/{level}") for level in ("1", "2")] == want[1:]
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


def _asked(server, call):
    """``(what call returned, the paths the server was asked for meanwhile)``."""
    mark = len(server.paths)
    got = call()
    return got, server.paths[mark:]


def _lookups(root, path: str) -> list[tuple]:
    """Serving ``root``: the array at ``path`` opened in a :class:`Stores`, then its level looked up there
    twice and once in fresh stores; each lookup's ``(scale, paths the server was asked for meanwhile)``."""
    from range_server import RangeServer

    server = RangeServer(str(root))
    uri = f"{server.url}/{path}"
    stores, fresh = Stores(), Stores()
    try:
        open_array(uri, stores=stores)
        return [_asked(server, lambda: level_scale(uri, None, where)) for where in (stores, stores, fresh)]
    finally:
        stores.close()
        fresh.close()
        server.shutdown()


# What one lookup asks once the array was opened in the same stores (which read its parent groups' zarr.json
# and .zmetadata looking for consolidated metadata), and in fresh stores; the second lookup asks nothing.
# Under www/ (a folder with no document, stepped over as the walk goes up).
_PLAIN = {
    3: (["/zarr.json"],  # every other ancestor's zarr.json was read by the open: a, data.zarr, www's absence
        ["/www/data.zarr/a/zarr.json", "/www/data.zarr/zarr.json", "/www/zarr.json", "/zarr.json"]),
    # www and the root have no document: stepped over (as a level's folder s of s/1), up to MAX_PATH_DEPTH
    2: (["/www/data.zarr/a/.zattrs", "/www/data.zarr/.zattrs", "/www/.zattrs", "/www/.zgroup", "/.zattrs",
         "/.zgroup"],
        ["/www/data.zarr/a/zarr.json", "/www/data.zarr/a/.zattrs", "/www/data.zarr/.zattrs", "/www/.zattrs",
         "/www/.zgroup", "/.zattrs", "/.zgroup"]),
}


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_plain_nested_array_over_http_asks_each_group_once(tmp_path, fmt):
    """An array that is no OME level (``data.zarr/a/b``): the lookup asks each group above it once for its
    attributes, through the metadata its open already read, steps over folders with no document up to
    MAX_PATH_DEPTH folders, and asks nothing when asked again."""
    root = tmp_path / "www" / "data.zarr"
    zarr.open_group(str(root), mode="w", zarr_format=fmt).create_array("a/b", shape=(4,), chunks=(2,), dtype="u1")
    ome_zarr = pytest.importorskip("ome_zarr.reader")
    from ome_zarr.io import parse_url

    for group in (root, root / "a"):  # no image: ome-zarr-py finds no multiscales at either
        assert not [n for n in ome_zarr.Reader(parse_url(str(group)))()
                    if any(isinstance(spec, ome_zarr.Multiscales) for spec in n.specs)]
    after_open, alone = _PLAIN[fmt]
    assert _lookups(tmp_path, "www/data.zarr/a/b") == [(None, after_open), (None, []), (None, alone)]


# As _PLAIN, for level s/1 of an image at www/img.zarr (nested dataset paths: the group s between them).
_LEVEL = {
    3: ([],  # 0.5: the open read s's and img.zarr's zarr.json, the multiscales with it
        ["/www/img.zarr/s/zarr.json", "/www/img.zarr/zarr.json"]),
    2: (["/www/img.zarr/s/.zattrs", "/www/img.zarr/.zattrs"],  # 0.4: the open read s's zarr.json, .zmetadata
        ["/www/img.zarr/s/zarr.json", "/www/img.zarr/s/.zattrs", "/www/img.zarr/.zattrs"]),
}


@pytest.mark.parametrize("fmt", [2, 3])
def test_an_ome_level_over_http_asks_only_the_groups_up_to_its_image(tmp_path, fmt):
    """A level of an OME-Zarr image (0.4 and 0.5) is found with its image group's multiscales read once,
    and the groups between, nothing above; its scale is ome-zarr-py's."""
    image = tmp_path / "www" / "img.zarr"
    _image(str(image), ["s/0", "s/1"], [1, 2], fmt)
    want = _ome_zarr_ratios(str(image))[1]
    after_open, alone = _LEVEL[fmt]
    assert _lookups(tmp_path, "www/img.zarr/s/1") == [(want, after_open), (want, []), (want, alone)]


def test_a_v2_group_without_attributes_is_still_a_group_on_the_way_up(tmp_path):
    """A v2 group written with no ``.zattrs`` (zarr-python 2 writes none for a group without attributes):
    its ``.zgroup`` says it is a group, so a nested level below it still finds its image above."""
    import os

    image = tmp_path / "img.zarr"
    _image(str(image), ["s/0", "s/1"], [1, 4], 2)
    os.remove(image / "s" / ".zattrs")
    assert level_scale(f"{image}/s/1") == tuple(_ome_zarr_ratios(str(image))[1]) == (1, 4, 4)
    from range_server import RangeServer

    server = RangeServer(str(tmp_path))
    try:
        got, asked = _asked(server, lambda: level_scale(f"{server.url}/img.zarr/s/1"))
        assert got == (1, 4, 4)
        assert asked == ["/img.zarr/s/zarr.json", "/img.zarr/s/.zattrs", "/img.zarr/s/.zgroup", "/img.zarr/.zattrs"]
    finally:
        server.shutdown()


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_level_below_a_folder_with_no_document_finds_its_image(tmp_path, fmt):
    """zarr-python writes no document for the folders between a group and an array it creates at a nested
    path (``create_array("s/1")`` leaves ``s`` bare) and reads the level through the image group all the same;
    so does ome-zarr-py. The lookup steps over such a folder (locally, over HTTP, and in the stores that
    opened the array), rather than ending there with scale 1 (a level's context read from the wrong place)."""
    import os

    from range_server import RangeServer

    image = tmp_path / "img.zarr"
    _image(str(image), ["s/0", "s/1"], [1, 4], fmt)
    for doc in ("zarr.json", ".zgroup", ".zattrs"):
        if (image / "s" / doc).exists():
            os.remove(image / "s" / doc)
    assert sorted(os.listdir(image / "s")) == ["0", "1"]  # a bare folder
    want = _ome_zarr_ratios(str(image))
    assert want == [(1, 1, 1), (1, 4, 4)]
    assert level_scale(str(image / "s" / "1")) == want[1]
    server = RangeServer(str(tmp_path))
    stores = Stores()
    try:
        uri = f"{server.url}/img.zarr/s/1"
        np.testing.assert_array_equal(open_array(uri, stores=stores).read((slice(0, 1), slice(0, 2), slice(0, 2))),
                                      zarr.open_array(str(image / "s" / "1"))[:1, :2, :2])
        assert level_scale(uri, None, stores) == want[1]
        assert level_scale(uri) == want[1]
        assert level_scale(f"{server.url}/img.zarr/s/0", None, stores) is None
    finally:
        stores.close()
        server.shutdown()


def test_a_v2_image_consolidated_before_its_multiscales_were_written_reads_them(tmp_path):
    """A v2 group consolidated (``.zmetadata``) and given its ``multiscales`` after: zarr-python reads the
    group's own ``.zattrs`` (``open_consolidated(...).attrs`` holds them), and so does the lookup, also in the
    stores that opened the array through the consolidated metadata (it never takes the group's attributes
    from ``.zmetadata``, which would say scale 1)."""
    from range_server import RangeServer

    image = tmp_path / "img.zarr"
    _image(str(image), ["0", "1"], [1, 2], 2)
    g = zarr.open_group(str(image), mode="r+", zarr_format=2)
    multiscales = g.attrs["multiscales"]
    del g.attrs["multiscales"]
    zarr.consolidate_metadata(str(image), zarr_format=2)
    zarr.open_group(str(image), mode="r+", zarr_format=2, use_consolidated=False).attrs["multiscales"] = multiscales
    assert "multiscales" in zarr.open_consolidated(str(image), zarr_format=2).attrs
    want = _ome_zarr_ratios(str(image))[1]
    assert want == (1, 2, 2)
    server = RangeServer(str(tmp_path))
    stores = Stores()
    try:
        uri = f"{server.url}/img.zarr/1"
        open_array(uri, stores=stores)
        assert level_scale(uri, None, stores) == want
        assert level_scale(uri) == want
    finally:
        stores.close()
        server.shutdown()


def test_a_group_attributes_reply_cut_short_is_read_again(tmp_path):
    """A v2 image's ``.zattrs`` reply cut short, with headers that agree (a faulty server or proxy), read as a
    group with no attributes, kept for the stores' life: the level was no level (None) for every lookup after.
    The document is read once more: a second reply that differs is the document."""
    from range_server import RangeServer

    _image(str(tmp_path / "img.zarr"), ["0", "1"], [1, 2], 2)
    server = RangeServer(str(tmp_path))
    stores = Stores()
    uri = f"{server.url}/img.zarr/1"
    try:
        open_array(uri, stores=stores)
        server.shorten(1)  # the lookup's first request: the image's .zattrs
        got, asked = _asked(server, lambda: level_scale(uri, None, stores))
        assert asked[:2] == ["/img.zarr/.zattrs", "/img.zarr/.zattrs"], asked
        assert got == (1, 2, 2) == tuple(_ome_zarr_ratios(str(tmp_path / "img.zarr"))[1])
        assert level_scale(uri, None, stores) == (1, 2, 2)
    finally:
        stores.close()
        server.shutdown()


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_label_image_coarser_than_its_image_is_placed_over_the_image(tmp_path, fmt):
    """A label image at half its image's resolution (its level 0 of physical scale 2) was taken as a reference
    of its own: its level 0 read as scale 1, so a Field over it read the labels of other voxels than the raw
    crop's, without a word. Its levels are now placed over the image's level 0 (2 and 4, as their
    physical scales say), and every label crop holds the labels of the raw crop's voxels."""
    import stoker

    image = str(tmp_path / "img.ome.zarr")
    raw, labels = _labelled_image(image, fmt)
    assert level_scale(f"{image}/s1") == (2, 2, 2)
    assert level_scale(f"{image}/labels/cells/s0") == (2, 2, 2)
    assert level_scale(f"{image}/labels/cells/s1") == (4, 4, 4)
    fields = {"raw": stoker.Field(f"{image}/s0", (8, 8, 8)),
              "labels": stoker.Field(f"{image}/labels/cells/s0", (2, 2, 2), offset=(2, 2, 2)),
              "coarse": stoker.Field(f"{image}/labels/cells/s1", (2, 2, 2), offset=(0, 0, 0))}

    def check(got, i, sample, a):
        np.testing.assert_array_equal(got["raw"][i], raw[tuple(slice(s, s + 8) for s in a)])
        # the raw voxels at the labels' corners, two apart from 2 voxels in; four apart from 0
        np.testing.assert_array_equal(got["labels"][i], raw[tuple(slice(s + 2, s + 6, 2) for s in a)])
        np.testing.assert_array_equal(got["coarse"][i], raw[tuple(slice(s, s + 8, 4) for s in a)])

    _each_crop(fields, check)
    assert labels.shape == (16, 16, 16)


def torch_numpy(batch) -> np.ndarray:
    import torch

    return torch.from_dlpack(batch).numpy().copy()


def _each_crop(fields: dict, check) -> None:
    """RandomCrops over ``fields`` (seed 0), 3 batches of 4 int64 samples: ``check(got, i, sample, a)`` on
    every sample, ``got`` its batch's fields as numpy, ``i`` its row, ``a`` where its ``raw`` box starts."""
    import stoker

    source = stoker.RandomCrops(fields, seed=0, samples_per_epoch=12).for_rank(0, 1)
    checked = 0
    with stoker.Pipeline(stoker.Config(batch_size=4, dtype="i64")) as p:
        p.push(source)
        for _ in range(3):
            with p.pop() as batch:
                got = {k: torch_numpy(v) for k, v in batch.items()}
                for i, sample in enumerate(batch.samples):
                    check(got, i, sample, [lo for lo, _ in sample["raw"].aabb])
                    checked += 1
    assert checked == 12


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_label_image_without_the_channel_axis_is_placed_by_axis_names(tmp_path, fmt):
    """A ``yx`` label image of a ``cyx`` image (the channel axis left out) is placed over the image's level 0 on
    the axes they share by name: at twice the image's voxel size it has scale 2, its next level 4."""
    image = str(tmp_path / "img.zarr")
    _image(image, ["0", "1"], [1, 2], fmt)  # c, y, x: 1.0, 0.25, 0.25 micrometres at level 0
    cells = zarr.open_group(f"{image}/labels/cells", mode="w", zarr_format=fmt)
    datasets = []
    for level, size in (("0", 0.5), ("1", 1.0)):
        cells.create_array(level, shape=(16 // (2 ** int(level)),) * 2, chunks=(8, 8), dtype="uint32")
        datasets.append({"path": level, "coordinateTransformations": [{"type": "scale", "scale": [size, size]}]})
    multiscale = {"axes": [{"name": "y", "type": "space"}, {"name": "x", "type": "space"}], "datasets": datasets}
    if fmt == 2:
        cells.attrs.update({"multiscales": [{**multiscale, "version": "0.4"}], "image-label": {"version": "0.4"}})
    else:
        cells.attrs["ome"] = {"version": "0.5", "multiscales": [multiscale], "image-label": {"version": "0.5"}}
    assert level_scale(f"{image}/labels/cells/0") == (2, 2)
    assert level_scale(f"{image}/labels/cells/1") == (4, 4)
    assert level_scale(f"{image}/1") == (1, 2, 2)


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("pixel", [(1.0, 0.5, 0.5), (2.0, 0.325, 0.325)])
def test_a_label_image_written_with_default_transforms_lies_on_its_image_voxels(tmp_path, fmt, pixel):
    """ome-zarr-py's ``write_labels`` given no transforms writes the label image's level 0 at scale 1 on every
    axis, over an image whose level 0 has a physical pixel size: the same shape, so the same voxels. It was
    placed by physical scale: at (1, 2, 2) for a 0.5 pixel (crops read other voxels' labels), and a 0.325
    pixel was a MetadataError. The shapes now decide: scale 1, and every label crop is its raw crop."""
    import stoker

    writer = pytest.importorskip("ome_zarr.writer")
    from ome_zarr.format import FormatV04, FormatV05

    image = str(tmp_path / "img.ome.zarr")
    z, y, x = np.meshgrid(np.arange(4), np.arange(32), np.arange(32), indexing="ij")
    raw = (z * 10_000 + y * 100 + x).astype("uint32")
    group = zarr.open_group(image, mode="w", zarr_format=fmt)
    ome = FormatV04() if fmt == 2 else FormatV05()
    writer.write_image(raw, group, axes="zyx", fmt=ome, scale_factors=(2,), scale=dict(zip("zyx", pixel)))
    writer.write_labels(raw, group, name="cells", axes="zyx", fmt=ome, scale_factors=(2,))
    assert level_scale(f"{image}/labels/cells/s0") is None
    assert level_scale(f"{image}/labels/cells/s1") == (1, 2, 2)
    coarse = zarr.open_array(f"{image}/labels/cells/s1")[...]
    fields = {"raw": stoker.Field(f"{image}/s0", (2, 8, 8)),
              "labels": stoker.Field(f"{image}/labels/cells/s0", (2, 8, 8)),
              "coarse": stoker.Field(f"{image}/labels/cells/s1", (2, 4, 4))}

    def check(got, i, sample, a):
        want = raw[a[0]:a[0] + 2, a[1]:a[1] + 8, a[2]:a[2] + 8]
        np.testing.assert_array_equal(got["raw"][i], want)
        np.testing.assert_array_equal(got["labels"][i], want)  # voxel for voxel
        c = [lo for lo, _ in sample["coarse"].aabb]
        assert c == [a[0], a[1] // 2, a[2] // 2]
        np.testing.assert_array_equal(got["coarse"][i], coarse[c[0]:c[0] + 2, c[1]:c[1] + 4, c[2]:c[2] + 4])

    _each_crop(fields, check)


def _label_pair(path: str, fmt: int, label_shape: tuple, label_scale: list, label_shift: list | None = None) -> str:
    """An image (level 0 of shape (8, 16, 16), pixel (1, 0.5, 0.5), translated (0, 10, 10)) with a one-level
    label image ``labels/cells`` of the given shape, scale and translation; the label level's URI."""
    axes = [{"name": a, "type": "space"} for a in "zyx"]
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    g.create_array("0", shape=(8, 16, 16), chunks=(8, 8, 8), dtype="uint8")
    cells = zarr.open_group(f"{path}/labels/cells", mode="w", zarr_format=fmt)
    cells.create_array("0", shape=label_shape, chunks=(8, 8, 8), dtype="uint32")
    image = {"axes": axes, "datasets": [{"path": "0", "coordinateTransformations": [
        {"type": "scale", "scale": [1.0, 0.5, 0.5]}, {"type": "translation", "translation": [0.0, 10.0, 10.0]}]}]}
    transforms = [{"type": "scale", "scale": label_scale}]
    if label_shift is not None:
        transforms.append({"type": "translation", "translation": label_shift})
    label = {"axes": axes, "datasets": [{"path": "0", "coordinateTransformations": transforms}]}
    write_multiscales(g, image, cells, label, fmt)
    return f"{path}/labels/cells/0"


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_label_image_of_another_shape_is_placed_by_physical_scale_the_shapes_check(tmp_path, fmt):
    """The same shape: scale 1 (the label has no translation). Another shape: the
    physical ratio, which must make the label's shape from the image's (rounded down or up), with translations
    that agree; else a MetadataError naming both shapes and scales and ``scale=``."""
    from stoker.errors import MetadataError

    assert level_scale(_label_pair(str(tmp_path / "same"), fmt, (8, 16, 16), [1.0, 1.0, 1.0])) is None
    half = _label_pair(str(tmp_path / "half"), fmt, (8, 8, 8), [1.0, 1.0, 1.0], [0.0, 10.0, 10.0])
    assert level_scale(half) == (1, 2, 2)
    with pytest.raises(MetadataError) as bad_shape:
        level_scale(_label_pair(str(tmp_path / "bad"), fmt, (8, 5, 5), [1.0, 1.0, 1.0], [0.0, 10.0, 10.0]))
    message = str(bad_shape.value)
    assert "(8, 5, 5)" in message and "(8, 16, 16)" in message and "[1.0, 0.5, 0.5]" in message
    assert "Field(..., scale=...)" in message
    with pytest.raises(MetadataError, match="0.5 level-0|not a whole number"):
        level_scale(_label_pair(str(tmp_path / "finer"), fmt, (8, 32, 20), [1.0, 0.25, 0.25]))
    with pytest.raises(MetadataError) as moved:  # a ratio of 1 on z: only 0 allowed there, said so
        level_scale(_label_pair(str(tmp_path / "moved"), fmt, (8, 8, 8), [1.0, 1.0, 1.0], [2.0, 10.0, 10.0]))
    message = str(moved.value)
    assert "axis 0" in message and "the level 0 of the image whose labels/ holds it" in message
    assert "a translation of 0)" in message and "0 or 0)" not in message


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_remote_label_image_is_placed_by_the_shapes_too(tmp_path, fmt):
    """Over http (the level-0 shapes read through the store's metadata): the same shape is scale 1, half the
    shape the physical ratio, and a shape no ratio gives the error, as for a local image."""
    from range_server import RangeServer

    from stoker.errors import MetadataError

    _label_pair(str(tmp_path / "same"), fmt, (8, 16, 16), [1.0, 1.0, 1.0])
    _label_pair(str(tmp_path / "half"), fmt, (8, 8, 8), [1.0, 1.0, 1.0], [0.0, 10.0, 10.0])
    _label_pair(str(tmp_path / "bad"), fmt, (8, 5, 5), [1.0, 1.0, 1.0], [0.0, 10.0, 10.0])
    server = RangeServer(str(tmp_path))
    stores = Stores()
    try:
        assert level_scale(f"{server.url}/same/labels/cells/0", None, stores) is None
        assert level_scale(f"{server.url}/half/labels/cells/0", None, stores) == (1, 2, 2)
        with pytest.raises(MetadataError, match=r"\(8, 5, 5\).*\(8, 16, 16\)"):
            level_scale(f"{server.url}/bad/labels/cells/0", None, stores)
    finally:
        stores.close()
        server.shutdown()


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_label_image_of_its_image_shape_translated_elsewhere_is_refused(tmp_path, fmt):
    """A label image's level 0 of its image's shape, with a physical translation of its own that is not the
    image's: it lies elsewhere (here 5 label voxels), so reading it voxel for voxel is silently off. It was taken
    at scale 1 whatever its translation; now a MetadataError naming both translations and ``offset=``. No
    translation (ome-zarr-py's default) or the image's own: voxel for voxel, as before."""
    from stoker.errors import MetadataError

    with pytest.raises(MetadataError) as moved:
        level_scale(_label_pair(str(tmp_path / "moved"), fmt, (8, 16, 16), [1.0, 0.5, 0.5], [0.0, 12.5, 10.0]))
    message = str(moved.value)
    assert "[0.0, 12.5, 10.0]" in message and "[0.0, 10.0, 10.0]" in message
    assert "Field(..., scale=..., offset=...)" in message
    assert level_scale(_label_pair(str(tmp_path / "same"), fmt, (8, 16, 16), [1.0, 0.5, 0.5], [0.0, 10.0, 10.0])) is None
    assert level_scale(_label_pair(str(tmp_path / "none"), fmt, (8, 16, 16), [1.0, 1.0, 1.0])) is None
