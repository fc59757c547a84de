"""A plain Pipeline pushed again after one of its local arrays was rewritten with another layout (zarr-python's
overwrite, same path): the next push reads it by its new metadata, never the new files by the old layout."""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch
import zarr

import stoker

pytestmark = pytest.mark.timeout(120)


def _write(uri, seed, chunks, zarr_format=3):
    z = zarr.create_array(uri, shape=(32, 32), chunks=chunks, dtype="int16", overwrite=True, zarr_format=zarr_format)
    z[:] = np.random.default_rng(seed).integers(-3000, 3000, z.shape, dtype=np.int16)
    return z[:]


def _samples(uri, n=8):
    return [stoker.Sample(uri, ((i, i + 8), (2 * i, 2 * i + 8))) for i in range(n)]


def _cfg():
    return stoker.Config(batch_size=4, dtype="f32", device="cpu", sample_shape=(8, 8), n_compute_threads=1,
                         lookahead_batches=1, pop_timeout_s=20)


def _pop(p):
    with p.pop() as b:
        return torch.from_dlpack(b).numpy().copy()


def _want(data, samples):
    return np.stack([data[tuple(slice(*ax) for ax in s.aabb)] for s in samples]).astype("f4")


@contextlib.contextmanager
def _first_batch_popped(tmp_path, zarr_format=3):
    """A pipeline that was pushed the 8 samples of a new array ``a.zarr`` and popped the first batch of 4
    (checked against the array; the second still in flight): ``(pipeline, uri, data, samples)``."""
    uri = str(tmp_path / "a.zarr")
    data = _write(uri, 0, (8, 8), zarr_format)
    samples = _samples(uri)
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        assert np.array_equal(_pop(p), _want(data, samples[:4]))
        yield p, uri, data, samples


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_push_after_a_rewrite_reads_the_new_layout(tmp_path, zarr_format):
    uri = str(tmp_path / "a.zarr")
    data = _write(uri, 0, (8, 8), zarr_format)
    samples = _samples(uri)
    with stoker.Pipeline(_cfg()) as p:
        for seed, chunks in [(1, (16, 4)), (2, (4, 32)), (3, (8, 8))]:
            p.push(samples)
            got = np.concatenate([_pop(p) for _ in range(2)])
            assert np.array_equal(got, _want(data, samples))
            data = _write(uri, seed, chunks, zarr_format)  # no drop_used_up: the next push must still see it


def test_a_push_after_a_rewrite_with_batches_of_the_old_layout_in_flight_is_refused(tmp_path):
    with _first_batch_popped(tmp_path) as (p, uri, _, samples):
        new = _write(uri, 1, (16, 4))
        with pytest.raises(stoker.errors.InvalidArgument, match="rewritten.*Pop every batch"):
            p.push(samples)
        p.pop()  # the earlier push's last batch (by whichever layout: the rewrite raced it)
        p.push(samples)  # nothing in flight now: the array is opened anew
        got = np.concatenate([_pop(p) for _ in range(2)])
        assert np.array_equal(got, _want(new, samples))


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("how", ["attrs", "touch"])
def test_a_push_after_an_attribute_update_or_a_touch_goes_on_with_batches_in_flight(tmp_path, zarr_format, how):
    """Regression: any change of a metadata file's identity (an attribute written, ``attrs["epoch"] = 1``, or
    a file touched) made the next push an InvalidArgument while batches were in flight. The layout and the
    decoding attributes unchanged, the push goes on, the array read on as it was."""
    import os

    with _first_batch_popped(tmp_path, zarr_format) as (p, uri, data, samples):
        if how == "attrs":
            zarr.open_array(uri, mode="r+").attrs["epoch"] = 1
        else:
            os.utime(os.path.join(uri, "zarr.json" if zarr_format == 3 else ".zarray"), (1, 1))
        p.push(samples)  # the earlier push's last batch still in flight
        got = np.concatenate([_pop(p) for _ in range(3)])
        assert np.array_equal(got, _want(data, samples[4:] + samples))
        zarr.open_array(uri, mode="r+").attrs["epoch"] = 2  # the new identities were recorded: again alike
        p.push(samples)
        assert np.array_equal(np.concatenate([_pop(p) for _ in range(2)]), _want(data, samples))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_decoding_attribute_changed_with_batches_in_flight_is_still_refused(tmp_path, zarr_format):
    """A CF attribute stoker decodes by (``scale_factor``) written while batches are in flight: a rewrite."""
    with _first_batch_popped(tmp_path, zarr_format) as (p, uri, _, samples):
        zarr.open_array(uri, mode="r+").attrs["scale_factor"] = 2.0
        with pytest.raises(stoker.errors.InvalidArgument, match="rewritten.*Pop every batch"):
            p.push(samples)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_attribute_update_of_a_nan_filled_array_goes_on_with_batches_in_flight(tmp_path, zarr_format):
    """A float array whose fill value is NaN (xarray's) compared unequal to itself, so an attribute written
    while batches were in flight was refused as a rewrite. A v2 array's attributes are in ``.zattrs``: its
    ``.zarray`` untouched, or written again with the same bytes, is not parsed again (the kept parse, the very
    same object, is compared), so it is written again here laid out otherwise (as a tool rewriting every
    metadata file may), for the fill values to be compared."""
    uri = str(tmp_path / "nan.zarr")
    z = zarr.create_array(uri, shape=(32, 32), chunks=(8, 8), dtype="float32", fill_value=float("nan"),
                          zarr_format=zarr_format)
    data = np.random.default_rng(0).normal(0, 1, z.shape).astype("f4")
    data[:8, :8] = np.nan  # a chunk left unwritten: the fill value
    z[8:, :] = data[8:, :]
    z[:8, 8:] = data[:8, 8:]
    samples = _samples(uri)
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        np.testing.assert_array_equal(_pop(p), _want(data, samples[:4]))
        zarr.open_array(uri, mode="r+").attrs["epoch"] = 1
        if zarr_format == 2:
            _write_again(os.path.join(uri, ".zarray"))
        p.push(samples)  # the earlier push's last batch still in flight
        got = np.concatenate([_pop(p) for _ in range(3)])
        np.testing.assert_array_equal(got, _want(data, samples[4:] + samples))


def _write_again(path):
    """The same JSON document laid out otherwise (other indent, keys sorted) renamed over ``path``."""
    with open(path) as f:
        doc = json.load(f)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


@pytest.mark.parametrize("attr", ["missing_value", "_FillValue"])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_attribute_update_beside_a_nan_decoding_attribute_goes_on(tmp_path, zarr_format, attr):
    """A decoding attribute holding NaN (``missing_value: NaN``, as xarray writes it) compared unequal to
    itself, so an unrelated attribute written while batches were in flight was refused as a rewrite."""
    uri = str(tmp_path / "nan.zarr")
    z = zarr.create_array(uri, shape=(32, 32), chunks=(8, 8), dtype="float32", fill_value=float("nan"),
                          zarr_format=zarr_format)
    data = np.random.default_rng(0).normal(0, 1, z.shape).astype("f4")
    z[:] = data
    z.attrs[attr] = float("nan")
    samples = _samples(uri)
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        np.testing.assert_array_equal(_pop(p), _want(data, samples[:4]))
        zarr.open_array(uri, mode="r+").attrs["epoch"] = 1
        p.push(samples)  # the earlier push's last batch still in flight
        got = np.concatenate([_pop(p) for _ in range(3)])
        np.testing.assert_array_equal(got, _want(data, samples[4:] + samples))
