"""Sample of named fields and padded boxes: the data type (what the pipeline reads of them is tested with it)."""

import pickle

import pytest

import stoker
from stoker.errors import InvalidArgument

BOX = [(0, 8), (0, 8)]


def test_fields_keep_order_shapes_and_boxes():
    s = stoker.Sample({"raw": (["/a.zarr", "/b.zarr"], BOX), "labels": ("/l.zarr", [(2, 6), (2, 6)])})
    assert s.names == ("raw", "labels")
    assert s.shape == {"raw": (2, 8, 8), "labels": (4, 4)}
    assert s["labels"] == stoker.Sample("/l.zarr", [(2, 6), (2, 6)])
    assert s.uris == ("/a.zarr", "/b.zarr", "/l.zarr")
    assert s.aabb is None and s.channels is None and s.crop_shape is None


def test_fields_equality_hash_and_pickle():
    a = stoker.Sample({"x": ("/a.zarr", BOX), "y": ("/b.zarr", BOX)})
    b = stoker.Sample({"x": stoker.Sample("/a.zarr", BOX), "y": ("/b.zarr", BOX)})
    swapped = stoker.Sample({"y": ("/b.zarr", BOX), "x": ("/a.zarr", BOX)})
    assert a == b and hash(a) == hash(b)
    assert a != swapped  # the order of fields is the order of the batch's mapping
    assert a != stoker.Sample("/a.zarr", BOX)
    assert pickle.loads(pickle.dumps(a)) == a
    assert eval(repr(a), {"Sample": stoker.Sample}) == a


@pytest.mark.parametrize("bad", [{}, {"": ("/a.zarr", BOX)}, {"x": "/a.zarr"}, {"x": ("/a.zarr", [(0, 0)])},
                                 {"x": stoker.Sample({"y": ("/a.zarr", BOX)})}])
def test_bad_fields_are_refused(bad):
    with pytest.raises(InvalidArgument):
        stoker.Sample(bad)


def test_fields_take_no_box_of_their_own_and_plain_samples_need_one():
    with pytest.raises(InvalidArgument, match="not a box of its own"):
        stoker.Sample({"x": ("/a.zarr", BOX)}, BOX)
    with pytest.raises(InvalidArgument, match="a box is one"):
        stoker.Sample("/a.zarr")
    with pytest.raises(KeyError):
        stoker.Sample("/a.zarr", BOX)["x"]


def test_pad_allows_boxes_past_the_array_and_is_part_of_identity():
    with pytest.raises(InvalidArgument, match="pad="):
        stoker.Sample("/a.zarr", [(-2, 6)])
    p = stoker.Sample("/a.zarr", [(-2, 6)], pad="edge")
    assert p.aabb == ((-2, 6),) and p.pad == "edge"
    assert p != stoker.Sample("/a.zarr", [(-2, 6)], pad="zero")
    assert pickle.loads(pickle.dumps(p)) == p
    f = stoker.Sample({"x": ("/a.zarr", [(-2, 6)])}, pad="reflect")
    assert f["x"].pad == "reflect"
    with pytest.raises(InvalidArgument, match="pad must be"):
        stoker.Sample("/a.zarr", BOX, pad="wrap")


def test_the_pipeline_reads_fields_and_padded_fields(tmp_path):
    import numpy as np
    import torch
    import zarr

    uri = str(tmp_path / "a.zarr")
    data = np.arange(64, dtype="u1").reshape(8, 8)
    zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="u1")[:] = data
    with stoker.Pipeline(stoker.Config(batch_size=1, device="cpu", dtype="native")) as p:
        p.push(stoker.Sample({"x": (uri, BOX)}))  # samples of named fields are read (tests/engine/test_fields.py)
        with p.pop() as batch:
            assert isinstance(batch, stoker.FieldBatch) and list(batch) == ["x"]
            assert (torch.from_dlpack(batch["x"])[0].numpy() == data).all()
        # a padded field: every field's box filled as numpy.pad fills it (tests/engine/test_padding.py)
        p.push(stoker.Sample({"x": (uri, [(-2, 6), (0, 8)])}, pad="edge"))
        with p.pop() as batch:
            want = np.pad(data, ((2, 0), (0, 0)), mode="edge")[:8]
            assert (torch.from_dlpack(batch["x"])[0].numpy() == want).all()


def test_sample_lists_of_fields_differ_by_every_field():
    """A SampleList's fingerprint covers each field's arrays and box: a state is not resumed into another list
    of samples of fields."""
    a = stoker.SampleList([stoker.Sample({"x": ("/a.zarr", BOX), "y": ("/b.zarr", BOX)})])
    b = stoker.SampleList([stoker.Sample({"x": ("/a.zarr", BOX), "y": ("/b.zarr", [(0, 8), (1, 9)])})])
    c = stoker.SampleList([stoker.Sample({"x": ("/a.zarr", BOX), "y": ("/c.zarr", BOX)})])
    same = stoker.SampleList([stoker.Sample({"x": ("/a.zarr", BOX), "y": ("/b.zarr", BOX)})])
    assert a.fingerprint == same.fingerprint
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
