"""Flips and transposes of a batch of fields keep the fields over one another, or are refused before a batch.

Each field is flipped (transposed) in its own voxels, about its own centre: right only for boxes that share a
centre (and, for a transpose, voxels of one spacing on the axes swapped). The labels here are the raw data
itself (or its 2x block mean), so a label box still lying over its raw box after the augmentation is checked
voxel for voxel against numpy."""

from __future__ import annotations

import functools
import itertools
import re

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.transforms import Compose, Keyed, RandomFlip, RandomTranspose

RAW = (32, 32, 32)


@pytest.fixture(scope="module")
def vol(tmp_path_factory):
    """A raw volume, the same data as a labels array, and its 2x block mean as an OME-Zarr level 1."""
    root = tmp_path_factory.mktemp("layout")
    data = np.random.default_rng(3).normal(0, 1, RAW).astype(np.float32)
    g = zarr.open_group(str(root / "img.ome.zarr"), mode="w", zarr_format=3)
    g.create_array("0", shape=RAW, chunks=(8, 8, 8), dtype="float32")[...] = data
    coarse = data.reshape(16, 2, 16, 2, 16, 2).mean(axis=(1, 3, 5), dtype=np.float64).astype(np.float32)
    g.create_array("1", shape=coarse.shape, chunks=(8, 8, 8), dtype="float32")[...] = coarse
    axes = [{"name": a, "type": "space"} for a in "zyx"]
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1.0] * 3}]},
        {"path": "1", "coordinateTransformations": [{"type": "scale", "scale": [2.0] * 3},
                                                    {"type": "translation", "translation": [0.5] * 3}]}]}]}
    labels = str(root / "labels.zarr")
    zarr.create_array(labels, shape=RAW, chunks=(8, 8, 8), dtype="float32")[...] = data
    aniso = zarr.open_group(str(root / "aniso.ome.zarr"), mode="w", zarr_format=3)
    aniso.create_array("0", shape=RAW, chunks=(8, 8, 8), dtype="float32")[...] = data
    aniso.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [4.0, 1.0, 1.0]}]}]}]}
    return {"raw": str(root / "img.ome.zarr" / "0"), "coarse": str(root / "img.ome.zarr" / "1"),
            "labels": labels, "aniso": str(root / "aniso.ome.zarr" / "0"), "data": data}


def _cfg(transform, **kw):
    base = dict(batch_size=8, dtype="f32", device="cpu", host_buffer_bytes=16 << 20, pop_timeout_s=30.0,
                n_compute_threads=2, n_io_threads=1, transform=transform)
    return stoker.Config(**{**base, **kw})


def _batches(cfg, source, n):
    """The popped fields as numpy, with the keys."""
    out = []
    with stoker.Pipeline(cfg) as p:
        p.push(source)
        for batch in p.batches(n):
            out.append(({k: torch.from_dlpack(v).numpy().copy() for k, v in batch.items()},
                        batch.sample_keys.copy(), list(batch["raw"].samples)))
    return out


def _crops(vol, labels_offset, labels_shape=(8, 8, 8), samples=64, **extra):
    fields = {"raw": stoker.Field(vol["raw"], (16, 16, 16)),
              "labels": stoker.Field(vol["labels"], labels_shape, offset=labels_offset), **extra}
    return stoker.RandomCrops(fields, seed=5, samples_per_epoch=samples).for_rank(0, 1)


def test_a_centred_label_box_stays_over_its_raw_box_through_every_draw(vol):
    """Flips of every axis and transposes of all three: each of the 8 flip draws and 6 orders occurs, and the
    label box is the centre of the augmented raw box in every sample, as numpy's flip/transpose give it."""
    flip, turn = RandomFlip(axes=(-3, -2, -1), seed=1), RandomTranspose(axes=(-3, -2, -1), seed=2)
    got = _batches(_cfg([flip, turn]), _crops(vol, (4, 4, 4)), 8)
    codes, orders = set(), set()
    for fields, keys, samples in got:
        flips, order = flip.draws(keys), turn.draws(keys)
        codes |= {tuple(f) for f in flips.tolist()}
        orders |= set(order.tolist())
        np.testing.assert_array_equal(fields["labels"], fields["raw"][:, 4:12, 4:12, 4:12])
        for i, s in enumerate(samples):  # the raw field against numpy: the augmentation did happen
            crop = vol["data"][tuple(slice(a, b) for a, b in s.aabb)]
            crop = np.flip(crop, [a for a, f in zip((-3, -2, -1), flips[i]) if f])
            np.testing.assert_array_equal(fields["raw"][i], np.transpose(crop, turn.orders[order[i]]))
    assert codes == set(itertools.product([False, True], repeat=3)) and orders == set(range(6))


def test_a_label_box_at_the_raw_corner_is_refused_at_push_with_what_to_change(vol):
    """Labels at offset (0, 0, 0) in a larger raw box (what a previous trial built): every flipped sample would
    pair labels with the wrong raw voxels. Refused at push, naming the centres and the offset that centres it;
    about='own_centre' lets it through, and then the pairs are indeed wrong."""
    with stoker.Pipeline(_cfg([RandomFlip(seed=1)])) as p:
        with pytest.raises(stoker.InvalidArgument) as err:
            p.push(_crops(vol, (0, 0, 0)))
    msg = str(err.value)
    assert "RandomCrops volume 0" in msg and "axes (-3, -2, -1)" in msg
    assert "'raw' (8, 8, 8), 'labels' (4, 4, 4)" in msg
    assert "offset=(4, 4, 4) for 'labels'" in msg and "about='own_centre'" in msg
    assert err.value.knob == "about"
    flip = RandomFlip(seed=1, about="own_centre")
    wrong = 0
    for fields, keys, _ in _batches(_cfg([flip]), _crops(vol, (0, 0, 0)), 2):
        same = [np.array_equal(fields["labels"][i], fields["raw"][i, :8, :8, :8]) for i in range(len(keys))]
        assert same == [not f.any() for f in flip.draws(keys)]  # misaligned exactly where flipped
        wrong += same.count(False)
    assert wrong > 0


def test_only_the_axes_where_the_fields_are_centred_may_be_flipped(vol):
    """Labels centred in y and x but not z: flips of y and x pass and stay aligned; z among them is refused,
    and the message names axes=(-2, -1) as what would pass."""
    with pytest.raises(stoker.InvalidArgument, match=re.escape("box). Flip only the axes where they are centred "
                                                               "(axes=(-2, -1)), where they are to overlap")):
        _batches(_cfg([RandomFlip(axes=(-3, -2, -1))]), _crops(vol, (0, 4, 4)), 1)
    flip = RandomFlip(axes=(-2, -1), seed=4)
    for fields, _, _ in _batches(_cfg([flip]), _crops(vol, (0, 4, 4)), 2):
        np.testing.assert_array_equal(fields["labels"], fields["raw"][:, :8, 4:12, 4:12])
    with pytest.raises(stoker.InvalidArgument, match="other centres on axes \\(-3,\\)"):
        _batches(_cfg([RandomTranspose(axes=(-3, -2, -1))]), _crops(vol, (0, 4, 4)), 1)


def test_a_coarser_field_is_placed_by_its_scale_and_stays_aligned(vol):
    """A context field of the OME level 1 (scale 2 from the metadata), 16 voxels = 32 reference voxels around
    the raw box (offset -8): centred, so flips and transposes keep it over the raw box, its centre 8 voxels
    the 2x block mean of the augmented raw box. 8 such voxels from the anchor cover the raw box (centred); 16
    from it are refused: centres 8 and 16."""
    context = stoker.Field(vol["coarse"], (16, 16, 16), offset=(-8, -8, -8))
    source = stoker.RandomCrops({"raw": stoker.Field(vol["raw"], (16, 16, 16)), "context": context}, seed=1,
                                samples_per_epoch=32).for_rank(0, 1)
    flip, turn = RandomFlip(seed=7), RandomTranspose(axes=(-3, -2, -1), seed=8)
    for fields, _, _ in _batches(_cfg([flip, turn]), source, 4):
        raw = fields["raw"].reshape(-1, 8, 2, 8, 2, 8, 2).mean(axis=(2, 4, 6), dtype=np.float64)
        np.testing.assert_allclose(fields["context"][:, 4:12, 4:12, 4:12], raw, rtol=1e-5, atol=1e-6)
    off = stoker.RandomCrops({"raw": stoker.Field(vol["raw"], (16, 16, 16)),
                              "context": stoker.Field(vol["coarse"], (8, 8, 8))}, seed=1, samples_per_epoch=8)
    for fields, _, _ in _batches(_cfg([flip, turn]), off.for_rank(0, 1), 1):
        raw = fields["raw"].reshape(-1, 8, 2, 8, 2, 8, 2).mean(axis=(2, 4, 6), dtype=np.float64)
        np.testing.assert_allclose(fields["context"], raw, rtol=1e-5, atol=1e-6)
    wide = stoker.RandomCrops({"raw": stoker.Field(vol["raw"], (16, 16, 16)),
                               "context": stoker.Field(vol["coarse"], (16, 16, 16))}, seed=1, samples_per_epoch=8)
    with pytest.raises(stoker.InvalidArgument, match=re.escape("'raw' (8, 8, 8), 'context' (16, 16, 16)")):
        _batches(_cfg([flip]), wide.for_rank(0, 1), 1)


def test_transposes_of_axes_of_other_spacings_are_refused(vol):
    """An OME-Zarr level 0 of scale [4, 1, 1]: a cubic crop passes the size check, but z is 4x y's spacing.
    Transposing z is refused (at the first batch for a source of plain crops), y and x alone pass; a field of
    scale (1, 2, 2) over an isotropic raw is uneven too."""
    source = stoker.RandomCrops([vol["aniso"]], sample_shape=(8, 8, 8), seed=0, samples_per_epoch=8)
    with pytest.raises(stoker.InvalidArgument, match=r"spacings \['4', '1', '1'\] on axes \(-3, -2, -1\)") as err:
        with stoker.Pipeline(_cfg([RandomTranspose(axes=(-3, -2, -1))])) as p:
            p.push(source.for_rank(0, 1))
            p.pop()
    assert "axes=(-2, -1)" in str(err.value)
    turn = RandomTranspose(axes=(-2, -1), seed=3)
    with stoker.Pipeline(_cfg([turn])) as p:
        p.push(source.for_rank(0, 1))
        with p.pop() as batch:
            x = torch.from_dlpack(batch).numpy()
            for i, s in enumerate(batch.samples):
                crop = vol["data"][tuple(slice(a, b) for a, b in s.aabb)]
                want = crop if turn.draws(batch.keys)[i] == 0 else crop.transpose(0, 2, 1)
                np.testing.assert_array_equal(x[i], want)
    fields = {"raw": stoker.Field(vol["raw"], (16, 16, 16)),
              "half": stoker.Field(vol["labels"], (16, 8, 8), offset=(0, 0, 0), scale=(1, 2, 2))}
    with pytest.raises(stoker.InvalidArgument, match=r"field 'half''s voxels have spacings \['1', '2'\]"):
        _batches(_cfg([RandomTranspose(axes=(-3, -2))]),
                 stoker.RandomCrops(fields, seed=0, samples_per_epoch=8).for_rank(0, 1), 1)


def _plain(vol, start):
    """Samples of fields pushed as a list: labels' box from ``start`` in each 16-box of raw."""
    return [stoker.Sample({"raw": (vol["raw"], [(a, a + 16)] * 3),
                           "labels": (vol["labels"], [(a + start, a + start + 8)] * 3)}) for a in (0, 4, 8, 16)]


def test_plain_samples_are_checked_at_push_or_at_the_first_pop(vol):
    """Pushed as a list: checked at push; as a generator: at the pop of the first batch with it; centred ones
    stay aligned; a coarse OME level's box is placed by its scale from the metadata."""
    flip = RandomFlip(seed=2)
    with stoker.Pipeline(_cfg([flip], batch_size=4)) as p:
        with pytest.raises(stoker.InvalidArgument, match=r"sample Sample\(\{'raw'.*'raw' \(8, 8, 8\), 'labels' "
                                                         r"\(4, 4, 4\)"):
            p.push(_plain(vol, 0))
        p.push(iter(_plain(vol, 0)))
        with pytest.raises(stoker.InvalidArgument, match="other centres"):
            p.pop()
    with stoker.Pipeline(_cfg([flip], batch_size=4)) as p:
        p.push(_plain(vol, 4))
        with p.pop() as batch:
            np.testing.assert_array_equal(torch.from_dlpack(batch["labels"]).numpy(),
                                          torch.from_dlpack(batch["raw"]).numpy()[:, 4:12, 4:12, 4:12])
    coarse = [stoker.Sample({"raw": (vol["raw"], [(8, 24)] * 3), "context": (vol["coarse"], [(0, 16)] * 3)})]
    with stoker.Pipeline(_cfg([flip], batch_size=1)) as p:
        p.push(coarse)  # raw centred at 16, context at 2 * 8 = 16: scale 2 from the OME metadata
        with pytest.raises(stoker.InvalidArgument, match=re.escape("'raw' (16, 16, 16), 'context' (24, 24, 24)")):
            p.push([stoker.Sample({"raw": (vol["raw"], [(8, 24)] * 3), "context": (vol["coarse"], [(4, 20)] * 3)})])


class _Mine(Keyed):
    """A user's own wrapper that runs a built-in flip on a part of the samples."""

    def __init__(self):
        self.inner = {"flip": RandomFlip(seed=9)}

    def __call__(self, batch, keys):
        return self.inner["flip"](batch, keys)


@pytest.mark.parametrize("transform", [
    RandomFlip(seed=1), [RandomTranspose(axes=(-2, -1)), RandomFlip(seed=1)], Compose([Compose([RandomFlip()])]),
    _Mine(), functools.partial(RandomFlip(), keys=None), (lambda f: (lambda b: f(b, None)))(RandomFlip())],
    ids=["flip", "list", "nested-compose", "wrapper", "partial", "closure"])
def test_every_way_a_flip_is_given_is_checked(vol, transform):
    with stoker.Pipeline(_cfg(transform)) as p:
        with pytest.raises(stoker.InvalidArgument, match="other centres"):
            p.push(_crops(vol, (0, 0, 0)))


def test_crop_dataset_refuses_before_its_first_batch(vol):
    ds = stoker.CropDataset(_crops(vol, (0, 0, 0)), _cfg([RandomFlip()]))
    with pytest.raises(stoker.InvalidArgument, match="other centres"):
        next(iter(ds))


def test_checks_cost_nothing_per_sample_of_a_field_source(vol, monkeypatch):
    """A source of Field volumes is checked at push, once: its samples are not looked at one by one; plain
    samples alike are checked once (one metadata read per array), then remembered."""
    from stoker.engine.pipeline import geometry

    looked, reads = [], []
    real_sample, real_scale = geometry.LayoutGuard.sample, geometry.level_scale
    monkeypatch.setattr(geometry.LayoutGuard, "sample", lambda self, s: looked.append(s) or real_sample(self, s))
    monkeypatch.setattr(geometry, "level_scale", lambda uri, *a: reads.append(uri) or real_scale(uri, *a))
    _batches(_cfg([RandomFlip()]), _crops(vol, (4, 4, 4)), 4)
    assert looked == [] and reads == []
    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=4)) as p:
        p.push(_plain(vol, 4) * 8)
        p.pop()
    assert len(looked) == 32 and sorted(reads) == sorted([vol["raw"], vol["labels"]])


def test_a_tile_grid_and_a_sample_list_are_checked_too(vol):
    """A TileGrid of fields at push (its volumes); a SampleList's samples as pulled (the error at pop)."""
    fields = {"raw": stoker.Field(vol["raw"], (16, 16, 16)), "labels": stoker.Field(vol["labels"], (8, 8, 8))}
    with stoker.Pipeline(_cfg([RandomFlip()])) as p:
        with pytest.raises(stoker.InvalidArgument, match="TileGrid volume 0: the fields' boxes have other centres"):
            p.push(stoker.TileGrid(fields).for_rank(0, 1))
    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=2)) as p:
        p.push(stoker.SampleList(_plain(vol, 0)).for_rank(0, 1))
        with pytest.raises(stoker.InvalidArgument, match="other centres"):
            p.pop()
    with stoker.Pipeline(_cfg([RandomFlip(seed=3)], batch_size=2)) as p:
        p.push(stoker.SampleList(_plain(vol, 4)).for_rank(0, 1))
        with p.pop() as batch:
            np.testing.assert_array_equal(torch.from_dlpack(batch["labels"]).numpy(),
                                          torch.from_dlpack(batch["raw"]).numpy()[:, 4:12, 4:12, 4:12])


def test_a_flip_beside_large_attributes_is_found_and_own_centre_is_left_out():
    """The walk is breadth first and bounded: a wrapper's own flip is found behind attributes of thousands of
    objects; a flip given about='own_centre' is not checked."""
    from stoker.transforms.layout import find_geometric

    class Wrapper:
        def __init__(self, flip):
            self.junk = [[[object() for _ in range(16)] for _ in range(64)] for _ in range(64)]
            self.flip = flip

    flip = RandomFlip()
    assert find_geometric(Wrapper(flip)) == [flip]
    assert find_geometric(Wrapper(RandomFlip(about="own_centre"))) == []
    assert find_geometric([RandomTranspose(about="own_centre"), flip]) == [flip]
    with pytest.raises(stoker.InvalidArgument, match="about must be one of"):
        RandomFlip(about="centre")


class _Cases(stoker.SampleSource):
    """A user's own source whose plain data is an attribute named ``volumes`` (as RandomCrops' is)."""

    def __init__(self, volumes, start, n=8):
        self.volumes, self.start, self.n = volumes, start, n

    def __len__(self):
        return self.n

    def sample(self, epoch, index):
        raw, labels = self.volumes[0] if self.volumes else self.fallback
        a = index % 8
        b = a + self.start
        return stoker.Sample({"raw": (raw, [(a, a + 16)] * 3), "labels": (labels, [(b, b + 8)] * 3)})


class _Offset(stoker.RandomCrops):
    """A RandomCrops whose samples are its own: its labels boxes moved to the raw box's corner."""

    def sample(self, epoch, index):
        s = super().sample(epoch, index)
        raw = s.fields["raw"].aabb
        return stoker.Sample({"raw": (s.fields["raw"].uri, raw),
                              "labels": (s.fields["labels"].uri, [(a, a + 8) for a, _ in raw])})


def test_only_stokers_own_field_sources_are_checked_whole_at_push(vol):
    """A source of one's own with a ``volumes`` attribute is checked sample by sample: centred ones pass (no
    AttributeError at push), an empty list checks nothing whole (corner labels refused); a RandomCrops subclass
    making samples of its own is checked sample by sample too."""
    pair = [[vol["raw"], vol["labels"]]]
    for fields, _, _ in _batches(_cfg([RandomFlip(seed=1)]), _Cases(pair, 4).for_rank(0, 1), 1):
        np.testing.assert_array_equal(fields["labels"], fields["raw"][:, 4:12, 4:12, 4:12])
    empty = _Cases([], 0)
    empty.fallback = pair[0]
    with pytest.raises(stoker.InvalidArgument, match="other centres"):
        _batches(_cfg([RandomFlip(seed=1)]), empty.for_rank(0, 1), 1)
    fields = {"raw": stoker.Field(vol["raw"], (16, 16, 16)),
              "labels": stoker.Field(vol["labels"], (8, 8, 8), offset=(4, 4, 4))}
    with pytest.raises(stoker.InvalidArgument, match="other centres"):
        _batches(_cfg([RandomFlip(seed=1)]), _Offset(fields, seed=0, samples_per_epoch=8).for_rank(0, 1), 1)


class _AttrDict(dict):
    """A common config idiom: every attribute is a key (KeyError for any other)."""

    __getattr__ = dict.__getitem__


class _Jitter(Keyed):
    def __init__(self, params):
        self.params = params

    def __call__(self, batch, keys):
        return batch


class _Raising:
    """An object that raises on every attribute."""

    def __getattribute__(self, name):
        raise RuntimeError(name)


class _Slots:
    __slots__ = ("flip", "unset")

    def __init__(self, flip):
        self.flip = flip


def test_the_finder_runs_no_attribute_hooks_and_never_raises(vol):
    """A transform holding an AttrDict (whose __getattr__ raises KeyError) makes a pipeline as before; objects
    raising on any attribute are stepped over, a flip in a slot beside them is still found."""
    from stoker.transforms.layout import find_geometric

    stoker.Pipeline(_cfg([_Jitter(_AttrDict(sigma=0.1))])).close()
    flip = RandomFlip()
    assert find_geometric([_Jitter(_AttrDict(sigma=0.1)), _Raising(), _Slots(flip)]) == [flip]


def test_a_sample_is_not_passed_for_an_earlier_one_of_fewer_axes_first(vol, tmp_path):
    """The memo of checked layouts keys every axis of every field: a 2-D field listed first, then raw and
    labels centred (passes), then the labels off-centre on z only (a key cut to the first field's two axes
    would be the same): refused, as on a fresh pipeline."""
    plane = str(tmp_path / "plane.zarr")
    zarr.create_array(plane, shape=(32, 32), chunks=(8, 8), dtype="float32")[...] = vol["data"][0]

    def sample(z):
        return stoker.Sample({"slice": (plane, [(4, 12)] * 2), "raw": (vol["raw"], [(0, 16)] * 3),
                              "labels": (vol["labels"], [(z, z + 8), (4, 12), (4, 12)])})

    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=1)) as p:
        p.push([sample(4)])
        with pytest.raises(stoker.InvalidArgument, match=re.escape("other centres on axes (-3,)")):
            p.push([sample(0)])


def test_an_os_error_of_the_metadata_reads_is_a_storage_error(vol, monkeypatch):
    """A store's OSError while the check reads an array's OME-Zarr metadata reaches pop as a StorageError
    naming the array, as the reading path's own errors do."""
    from stoker.engine.pipeline import geometry

    real = geometry.level_scale

    def flaky(uri, *args):
        if uri == vol["labels"]:
            raise OSError(5, "simulated I/O error")
        return real(uri, *args)

    monkeypatch.setattr(geometry, "level_scale", flaky)
    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=4)) as p:
        p.push(iter(_plain(vol, 4)))
        with pytest.raises(stoker.StorageError, match="labels.zarr: reading the OME-Zarr metadata"):
            p.pop()


def test_a_level_the_metadata_cannot_place_is_read_and_refused_only_beside_other_fields(vol, tmp_path):
    """An OME-Zarr level 1 translated 3 voxels (stoker places none such): a sample of it alone reads as
    without a transform (a transpose of it too); beside a labels field the check cannot place it, an
    InvalidArgument for the sample (not the MetadataError of the Field's rule); about='own_centre' reads it."""
    g = zarr.open_group(str(tmp_path / "odd.ome.zarr"), mode="w", zarr_format=3)
    g.create_array("0", shape=RAW, chunks=(8, 8, 8), dtype="float32")[...] = vol["data"]
    g.create_array("1", shape=(16, 16, 16), chunks=(8, 8, 8), dtype="float32")[...] = vol["data"][::2, ::2, ::2]
    axes = [{"name": a, "type": "space"} for a in "zyx"]
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1.0] * 3}]},
        {"path": "1", "coordinateTransformations": [{"type": "scale", "scale": [2.0] * 3},
                                                    {"type": "translation", "translation": [3.0] * 3}]}]}]}
    level = str(tmp_path / "odd.ome.zarr" / "1")
    alone = [stoker.Sample({"raw": (level, [(0, 8)] * 3)})] * 2
    for transform in (RandomFlip(), RandomTranspose(axes=(-3, -2, -1))):
        with stoker.Pipeline(_cfg([transform], batch_size=2)) as p:
            p.push(alone)
            p.pop().release()
    pair = [stoker.Sample({"raw": (level, [(0, 8)] * 3), "labels": (vol["labels"], [(4, 12)] * 3)})] * 2
    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=2)) as p:
        with pytest.raises(stoker.InvalidArgument, match="field 'raw''s array is a level of an OME-Zarr image "
                                                         "that stoker cannot place") as err:
            p.push(pair)
    assert "translated 3 level-0 voxels" in str(err.value) and "Field(..., scale=...)" in str(err.value)
    assert err.value.knob == "about"
    with stoker.Pipeline(_cfg([RandomFlip(about="own_centre")], batch_size=2)) as p:
        p.push(pair)
        p.pop().release()


_GLOBAL_FLIP = RandomFlip(seed=1)


def _global_wrapper(batch, keys):
    """A module-level function running a module-level flip (found through the globals its code names)."""
    return _GLOBAL_FLIP(batch, keys)


_global_wrapper.takes_keys = True  # type: ignore[attr-defined]


class _ClassAttr(Keyed):
    flip = RandomFlip(seed=1)

    def __call__(self, batch, keys):
        return self.flip(batch, keys)


class _ViaMethod(Keyed):
    def __call__(self, batch, keys):
        return _GLOBAL_FLIP(batch, keys)


class _Lazy(Keyed):
    def __init__(self):
        self.ops = None

    def __call__(self, batch, keys):
        self.ops = self.ops or [RandomFlip(seed=1)]
        return self.ops[0](batch, keys)


@pytest.mark.parametrize("transform", [_global_wrapper, _ClassAttr(), _ViaMethod(), [_ViaMethod().__call__]],
                         ids=["global-function", "class-attribute", "method-global", "bound-method"])
def test_flips_in_globals_and_class_attributes_are_found(vol, transform):
    """A flip a module-level function names as a global, one a class holds, one its method names: refused at
    push for corner labels; an unrelated global the code does not name is not found, nor a lazily made flip."""
    from stoker.transforms.layout import find_geometric

    with stoker.Pipeline(_cfg(transform)) as p:
        with pytest.raises(stoker.InvalidArgument, match="other centres"):
            p.push(_crops(vol, (0, 0, 0)))
    assert find_geometric(_Jitter(None)) == [] and find_geometric(_Lazy()) == []


def test_an_offset_is_suggested_only_where_a_whole_multiple_of_the_scale_centres(vol):
    """Labels of 7 in raw of 16: the centring offset would be 4.5, not suggested (the extents must differ by an
    even number); a context of scale 2 whose centring offset is 1 (no multiple of 2): none either; one of 0
    where -4 centres it: suggested. A time-offset target centred on y, x: the axes hint first."""
    with pytest.raises(stoker.InvalidArgument) as err:
        _batches(_cfg([RandomFlip()]), _crops(vol, (4, 4, 4), labels_shape=(7, 7, 7)), 1)
    msg = str(err.value)
    assert "offset=" not in msg and "no offset centres 'labels', that gives a half voxel" in msg
    assert "differing by an even multiple of its scale" in msg
    odd = stoker.RandomCrops({"raw": stoker.Field(vol["raw"], (18, 18, 18)),
                              "context": stoker.Field(vol["coarse"], (8, 8, 8))}, seed=1, samples_per_epoch=8)
    with pytest.raises(stoker.InvalidArgument, match="no offset centres 'context'") as err:
        _batches(_cfg([RandomFlip()]), odd.for_rank(0, 1), 1)
    assert "offset=" not in str(err.value)
    ok = stoker.RandomCrops({"raw": stoker.Field(vol["raw"], (16, 16, 16)),
                             "context": stoker.Field(vol["coarse"], (16, 16, 16))}, seed=1, samples_per_epoch=8)
    with pytest.raises(stoker.InvalidArgument, match=re.escape("here offset=(-8, -8, -8) for 'context'")):
        _batches(_cfg([RandomFlip()]), ok.for_rank(0, 1), 1)
    with pytest.raises(stoker.InvalidArgument) as err:
        _batches(_cfg([RandomFlip()]), _crops(vol, (7, 4, 4), labels_shape=(1, 8, 8)), 1)
    tail = str(err.value).split("beside its raw box). ")[1]
    assert tail.startswith("Flip only the axes where they are centred (axes=(-2, -1)), where they are to overlap")
    assert "offset=" not in tail


def test_a_sample_of_a_plain_array_is_placed_at_scale_1_and_the_message_says_so(vol):
    """A RandomCrops over a plain array given Field(scale=2) passes pushed itself; its samples pushed as a list
    carry no scale (the plain array counts as 1): refused, the message saying why and what to push instead.
    A hand-made sample's message gives no Field offset rule."""
    fields = {"raw": stoker.Field(vol["raw"], (16, 16, 16)), "context": stoker.Field(vol["labels"], (8, 8, 8), scale=2)}
    source = stoker.RandomCrops(fields, seed=0, samples_per_epoch=8)
    _batches(_cfg([RandomFlip()]), source.for_rank(0, 1), 1)
    with pytest.raises(stoker.InvalidArgument) as err:
        _batches(_cfg([RandomFlip()]), [source.sample(0, i) for i in range(8)], 1)
    msg = str(err.value)
    assert "A Sample carries no scale" in msg and "at scale 1 where none lists it ('raw', 'context' here)" in msg
    assert "source itself is pushed (source.for_rank(...))" in msg and err.value.knob == "about"
    assert "a Field's offset" not in msg and "each box's start + end, times its array's scale" in msg


def test_the_check_reads_each_folder_once_and_a_sources_spacings_once(vol, tmp_path, monkeypatch):
    """Samples of many cases under one folder: each folder's documents read once per pipeline (3 per case
    folder, 3 per folder above it), not once per array; a RandomCrops of Field volumes under a transpose reads
    its arrays' spacings at its first pipeline's push only (a CropDataset's pipeline of each epoch: none)."""
    import stoker.reader.ome as ome

    data = vol["data"][:16, :16, :16]
    cases = []
    for i in range(6):
        for name in ("raw", "lab"):
            zarr.create_array(str(tmp_path / "a" / "b" / f"case{i}" / f"{name}.zarr"), shape=data.shape,
                              chunks=(8, 8, 8), dtype="float32")[...] = data
        cases.append([str(tmp_path / "a" / "b" / f"case{i}" / f"{n}.zarr") for n in ("raw", "lab")])
    reads = []
    real = ome.read_regular
    monkeypatch.setattr(ome, "read_regular", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    samples = [stoker.Sample({"raw": (r, [(0, 16)] * 3), "labels": (lab, [(4, 12)] * 3)}) for r, lab in cases]
    with stoker.Pipeline(_cfg([RandomFlip()], batch_size=2)) as p:
        p.push(samples)
    assert len(reads) == len(set(reads)) <= 3 * 6 + 3 * 4  # case folders, then b, a and up to the depth bound
    volumes = [{"raw": stoker.Field(r, (8, 8, 8)), "labels": stoker.Field(lab, (4, 4, 4), offset=(2, 2, 2))}
               for r, lab in cases]
    source = stoker.RandomCrops(volumes, seed=0, samples_per_epoch=8)
    turn = RandomTranspose(axes=(-3, -2, -1))
    reads.clear()
    with stoker.Pipeline(_cfg([turn], batch_size=2)) as p:
        p.push(source.for_rank(0, 1))
    assert 0 < len(reads) == len(set(reads))
    reads.clear()
    with stoker.Pipeline(_cfg([turn], batch_size=2)) as p:
        p.push(source.for_rank(0, 1))
    next(iter(stoker.CropDataset(source.for_rank(0, 1), _cfg([turn], batch_size=2))))
    assert reads == []


def test_crop_batches_refused_at_push_can_be_iterated_again(vol):
    """CropBatches whose push a flip refused is not used up: iterating again refuses again (not 'iterated
    once'), and it can still be closed."""
    from stoker.train import CropBatches

    with CropBatches(_crops(vol, (0, 0, 0)), _cfg([RandomFlip()])) as data:
        for _ in range(2):
            with pytest.raises(stoker.InvalidArgument, match="other centres"):
                iter(data)


flip = RandomFlip(axes=(-1,))  # a module's flip (another pipeline's) that the transform below does not use


def _tensor_flip_only(batch, keys):
    batch["x"] = batch["x"].flip(-1)  # torch's flip: an attribute named like the global above, not it
    return batch


def test_a_method_named_like_a_global_flip_is_not_taken_for_it():
    from stoker.transforms.layout import find_geometric
    assert find_geometric(_tensor_flip_only) == []
    assert find_geometric(lambda b, k: flip(b, k)) == [flip]


def test_a_slotted_flip_of_ones_own_that_opts_out_is_left_out():
    import dataclasses

    from stoker.transforms.layout import find_geometric

    @dataclasses.dataclass(slots=True)
    class MyFlip:
        about: str = "own_centre"

        def check_layout(self, layout, where):
            raise AssertionError("not to be asked")

    assert find_geometric(MyFlip()) == []
    checked = MyFlip(about="centre")
    assert find_geometric(checked) == [checked]
