"""``pad=`` over fields with ``pad_axes=`` (a forecaster's time axis never padded, lat/lon padded) and the rule
that, padded, no field's box lies wholly outside its arrays (a target past the last time step was the last step,
edge-padded). Anchors held to a brute-force count; batches read through a Pipeline held to ``numpy.pad`` of a
zarr-python read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.errors import InvalidArgument

from batch_oracle import padded as _reference  # numpy.pad of the whole array, cut to the box

pytestmark = pytest.mark.timeout(180)

T, Y, X = 50, 9, 11  # (time, lat, lon)


@pytest.fixture(scope="module")
def wx(tmp_path_factory):
    root = tmp_path_factory.mktemp("padaxes")
    data = np.random.default_rng(4).normal(280, 5, (T, Y, X)).astype("f4")
    uri = str(root / "t2m.zarr")
    zarr.create_array(uri, shape=data.shape, chunks=(7, 4, 5), dtype="f4", fill_value=-1.0)[:] = data
    return uri, zarr.open_array(uri, mode="r")[...]


def _fields(uri, lead=7, target=3):
    """Two input steps, a target of ``target`` steps ``lead`` after the first, and a wider lat/lon context."""
    return {"x": stoker.Field(uri, (2, 5, 6)),
            "y": stoker.Field(uri, (target, 5, 6), offset=(lead, 0, 0)),
            "ctx": stoker.Field(uri, (2, 9, 10), offset=(0, -2, -2))}


def _anchors(src):
    """The anchors ``src`` may draw (its lattice), after checking that those it drew are among them."""
    vol = src.volumes[0].volume
    lattice = {vol.anchor(k) for k in np.ndindex(*vol.counts)}
    assert {tuple(a for a, _ in s["x"].aabb) for s in (src.sample(0, i) for i in range(len(src)))} <= lattice
    return lattice


def _overlaps(box, shape):
    return all(a < n and b > 0 for (a, b), n in zip(box, shape))


def test_pad_axes_keeps_every_field_inside_on_the_other_axes(wx):
    uri, data = wx
    src = stoker.RandomCrops(_fields(uri), seed=5, samples_per_epoch=400, pad="edge", pad_axes=(1, 2))
    # brute force: x inside its array on every axis (it bounds the padded axes), every field inside on time
    want = {(t, y, x) for t in range(T) for y in range(Y) for x in range(X)
            if t + 2 <= T and t + 7 + 3 <= T and y + 5 <= Y and x + 6 <= X}
    assert _anchors(src) == want
    samples = [src.sample(0, i) for i in range(len(src))]
    for s in samples:
        for name in ("x", "y", "ctx"):
            (t0, t1), *_ = s[name].aabb
            assert 0 <= t0 and t1 <= T, (name, s[name].aabb)  # forecast steps are real steps
    assert any(s["ctx"].aabb[1][0] < 0 for s in samples)  # the context is padded on lat/lon
    # read through a pipeline: numpy.pad (edge) of the zarr-python read
    cfg = stoker.Config(batch_size=8, dtype="native", device="cpu", n_compute_threads=2, pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:
        p.push(samples[:48])
        for batch in p:
            got = {k: torch.from_dlpack(v).clone().numpy() for k, v in batch.items()}
            for r, s in enumerate(batch.samples):
                for name, t in got.items():
                    assert np.array_equal(t[r], _reference(data, s[name].aabb, "edge", None)), (name, s[name].aabb)
    again = stoker.RandomCrops(_fields(uri), seed=5, samples_per_epoch=400, pad="edge", pad_axes=[-2, -1])
    assert again.fingerprint == src.fingerprint and [again.sample(0, i) for i in range(50)] == samples[:50]
    assert stoker.RandomCrops(_fields(uri), seed=5, samples_per_epoch=400, pad="edge").fingerprint != \
        src.fingerprint


def test_padded_fields_never_lie_wholly_outside_their_arrays(wx):
    uri, _ = wx
    fields = _fields(uri)
    src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=300, pad="edge")
    vol = src.volumes[0].volume
    # x bounds the anchors (inside), every other field overlaps its array by at least one voxel on every axis
    want = {(t, y, x) for t in range(T) for y in range(Y) for x in range(X)
            if t + 2 <= T and y + 5 <= Y and x + 6 <= X and t + 7 < T}
    assert _anchors(src) == want and vol.narrowed
    for s in (src.sample(0, i) for i in range(len(src))):
        assert all(_overlaps(s[n].aabb, (T, Y, X)) for n in fields), s
    # the trial's case: a target of one step, 7 after the input; none past the 50 steps
    one = stoker.RandomCrops(_fields(uri, target=1), seed=0, samples_per_epoch=200, pad="edge")
    assert max(one.sample(0, i)["y"].aabb[0][0] for i in range(200)) <= T - 1
    # the rule applies to mask sampling too (drawn among the mask's qualifying anchors)
    m = str(wx[0]) + ".mask.zarr"
    zarr.create_array(m, shape=(T, Y, X), chunks=(10, 9, 11), dtype="u1", overwrite=True)[:] = 1
    masked = stoker.RandomCrops(fields, seed=0, samples_per_epoch=500, pad="zero",
                                mask=stoker.Mask(m, 0.5, field="x", scale=1))
    assert len(masked.volumes[0].qualifying) == len(want)
    assert all(_overlaps(masked.sample(0, i)[n].aabb, (T, Y, X)) for i in range(500) for n in fields)
    # a field that could only lie outside is refused, saying so
    with pytest.raises(InvalidArgument, match="overlapping its arrays.*wholly outside"):
        stoker.RandomCrops(_fields(uri, lead=60), pad="edge")


def test_fingerprints_mark_only_the_sources_whose_anchors_narrowed(wx):
    uri, _ = wx
    # the context only reaches past lat/lon borders: nothing narrowed, the identity as before pad_axes
    near = {"x": stoker.Field(uri, (2, 5, 6)), "ctx": stoker.Field(uri, (2, 9, 10), offset=(0, -2, -2))}
    src = stoker.RandomCrops(near, seed=1, samples_per_epoch=10, pad="zero")
    assert not src.volumes[0].volume.narrowed and "overlapping" not in src.identity()
    far = stoker.RandomCrops(_fields(uri), seed=1, samples_per_epoch=10, pad="zero")
    assert far.identity()[-1] == "overlapping"


def test_pad_axes_arguments(wx, tmp_path):
    uri, data = wx
    with pytest.raises(InvalidArgument, match="needs pad="):
        stoker.RandomCrops(_fields(uri), pad_axes=(1, 2))
    for bad in ((1, 1), (3,), ("lat",), (True,)):
        with pytest.raises(InvalidArgument, match="pad_axes must be distinct axis numbers"):
            stoker.RandomCrops(_fields(uri), pad="zero", pad_axes=bad)
    # an unpadded axis on which no anchor keeps every box inside says to add it to pad_axes
    with pytest.raises(InvalidArgument, match="add axis 1 to pad_axes"):
        stoker.RandomCrops({"x": stoker.Field(uri, (2, 12, 6))}, pad="zero", pad_axes=(2,))
    # arrays: a crop longer than the array only on a padded axis
    crops = stoker.RandomCrops([uri], (4, 12, 6), seed=0, samples_per_epoch=50, pad="reflect", pad_axes=(1,))
    for s in crops:
        (t0, t1), (y0, y1), (x0, x1) = s.aabb
        assert 0 <= t0 and t1 <= T and 0 <= x0 and x1 <= X and -3 <= y0 <= 0 and y1 == y0 + 12
    assert crops.identity()[-2:] == ["pad_axes", [1]]
    with pytest.raises(InvalidArgument, match="axis 1 is not in pad_axes"):
        stoker.RandomCrops([uri], (4, 12, 6), pad="reflect", pad_axes=(2,))


def test_padded_tile_grid_refuses_a_field_wholly_outside_and_takes_pad_axes(wx):
    """A padded TileGrid's tiles follow the first field's (their centres tile its arrays, every voxel of it
    covered); its last tiles put the target 7 steps on wholly past the 50th step, a box of nothing but the
    edge pad (step 49 repeated). Dropping those tiles would leave the first field's last steps untiled, so the
    grid is refused, naming the field, the tiles and pad_axes; with pad_axes=(1, 2) time is tiled as without
    pad (every field inside, the last tile shifted back), lat/lon padded as before."""
    uri, data = wx
    with pytest.raises(InvalidArgument, match=r"tiles 22 to 24 \(of 25\) along axis 0 put field 'y''s box wholly "
                                              r"outside .*\[51, 54\).*pass pad_axes without axis 0"):
        stoker.TileGrid(_fields(uri), stride=(2, 5, 6), pad="edge")
    with pytest.raises(InvalidArgument, match=r"field 'y'.*leave axis 0 out of pad_axes \(0, 1\)"):
        stoker.TileGrid(_fields(uri), stride=(2, 5, 6), pad="edge", pad_axes=(0, 1))
    grid = stoker.TileGrid(_fields(uri), stride=(2, 5, 6), pad="edge", pad_axes=(1, 2))
    starts = sorted({s["x"].aabb[0][0] for s in grid})
    assert starts == list(range(0, 42, 2)) and len(grid) == 21 * 2 * 2  # the last anchor keeps y inside: 40
    assert max(s["y"].aabb[0][1] for s in grid) == T and min(s["ctx"].aabb[1][0] for s in grid) == -2  # ctx padded on lat
    assert {s["x"].aabb[1] for s in grid} == {(0, 5), (5, 10)}  # lat still padded: its centres tile Y = 9
    assert grid.identity()[-2:] == ["pad_axes", [1, 2]]
    assert "pad_axes" not in stoker.TileGrid({"x": _fields(uri)["x"]}, stride=(2, 5, 6), pad="edge").identity()
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1, pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:
        tiles = [grid.sample(0, i) for i in (0, len(grid) - 1)]
        p.push(tiles)
        with p.pop() as b:
            for k, s in enumerate(tiles):
                for name in ("x", "y", "ctx"):
                    want = _reference(data, s[name].aabb, "edge", None)
                    np.testing.assert_array_equal(torch.from_dlpack(b[name])[k].numpy(), want)
    for bad in ((3,), (0, 0), "1"):
        with pytest.raises(InvalidArgument, match="TileGrid: pad_axes must be distinct axis numbers"):
            stoker.TileGrid(_fields(uri), stride=(2, 5, 6), pad="edge", pad_axes=bad)
    with pytest.raises(InvalidArgument, match="TileGrid: pad_axes .* needs pad="):
        stoker.TileGrid(_fields(uri), stride=(2, 5, 6), pad_axes=(1, 2))
    # arrays: time tiled inside (the last tile shifted back to the border), lat padded (centres tile it)
    tiles = stoker.TileGrid([uri], (4, 6, 6), stride=(4, 4, 4), pad="edge", pad_axes=(1, 2))
    assert sorted({s.aabb[0] for s in tiles}) == [(t, t + 4) for t in range(0, 48, 4)] + [(46, 50)]
    assert sorted({s.aabb[1] for s in tiles}) == [(-1, 5), (3, 9), (7, 13)] and len(tiles) == 13 * 3 * 3


def test_no_anchor_in_one_of_several_volumes_names_its_arrays(wx, tmp_path):
    """A source of several volumes whose fields share names: the error said field 'y' and shapes, not which
    volume; it names the arrays' URI now (message and context)."""
    uri, _ = wx
    short = str(tmp_path / "short.zarr")
    zarr.create_array(short, shape=(7, Y, X), chunks=(7, Y, X), dtype="f4")[:] = 1.0
    vols = [_fields(uri), _fields(short)]
    for pad in (None, "edge"):
        with pytest.raises(InvalidArgument, match=rf"field 'y' \(arrays {short} of shape \(7, 9, 11\)") as info:
            stoker.RandomCrops(vols, seed=0, pad=pad)
        assert info.value.context["uri"] == short


def test_tile_grid_over_arrays_marks_pad_axes_in_its_identity(wx):
    """A padded TileGrid over arrays with pad_axes lays out other tiles than one padded on every axis (time
    tiled inside, the last tile shifted back): its identity says so, and a state saved with one is refused by
    the other instead of resuming into tiles that all differ."""
    uri, _ = wx
    every = stoker.TileGrid([uri], (6, 6, 6), stride=(4, 4, 4), pad="reflect")
    some = stoker.TileGrid([uri], (6, 6, 6), stride=(4, 4, 4), pad="reflect", pad_axes=(1, 2))
    assert [every.sample(0, i).aabb for i in range(3)] != [some.sample(0, i).aabb for i in range(3)]
    assert every.identity() != some.identity() and some.identity()[-2:] == ["pad_axes", [1, 2]]
    assert every.fingerprint != some.fingerprint
    state = every.for_rank(0, 1).state_dict()
    with pytest.raises(InvalidArgument, match="saved for another sample list"):
        some.for_rank(0, 1).load_state_dict(state)
    every.for_rank(0, 1).load_state_dict(state)  # its own state resumes


def test_a_tile_grid_short_on_an_axis_left_out_of_pad_axes_says_to_add_it(wx, tmp_path):
    """With pad= given, an array too short for the tile on an axis not in pad_axes was refused (or, beside one
    that holds a tile, left out with a warning) saying "use pad=", which was given: the way out is adding the
    axis to pad_axes (or leaving pad_axes out)."""
    import warnings

    uri, _ = wx
    short = str(tmp_path / "short.zarr")
    zarr.create_array(short, shape=(5, Y, X), chunks=(5, 4, 5), dtype="f4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InvalidArgument, match=r"no array can hold .*add axis 0 to pad_axes \(1, 2\) \(or leave "
                                                  r"pad_axes out\)") as err:
            stoker.TileGrid([short], (6, 4, 4), stride=(4, 2, 2), pad="edge", pad_axes=(1, 2))
    assert "pass pad=" not in str(err.value)
    with pytest.warns(UserWarning, match=r"short\.zarr \(5, 9, 11\)\): add axis 0 to pad_axes \(1, 2\) \(or leave "
                                         r"pad_axes out\)") as caught:
        grid = stoker.TileGrid([uri, short], (6, 4, 4), stride=(4, 2, 2), pad="edge", pad_axes=(1, 2))
    assert "pass pad=" not in str(caught[0].message) and {s.uri for s in grid} == {uri}
    assert {s.uri for s in stoker.TileGrid([uri, short], (6, 4, 4), stride=(4, 2, 2), pad="edge")} == {uri, short}


@pytest.mark.parametrize("bad", [(5,), (-7,), (True,), 1, "01", (1.0,)])
def test_sample_pad_axes_are_checked_axis_numbers(bad):
    """A Sample's pad_axes out of the box's range, or not integers, were kept as given (a writer then cropped
    the axis as not padded); a bare integer raised a TypeError."""
    with pytest.raises(InvalidArgument, match="pad_axes"):
        stoker.Sample("/x.zarr", [(0, 4), (0, 4), (0, 4)], pad="edge", pad_axes=bad)
    assert stoker.Sample("/x.zarr", [(0, 4), (0, 4), (0, 4)], pad="edge", pad_axes=(0, 0, -2)).pad_axes == (0, 1)
