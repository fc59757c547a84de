"""A local v3 array's attributes come from the ``zarr.json`` its open read: a pipeline asks for them at each
open (CF decoding, ``Config.cf``), and reading the document a second time cost more than the open itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.reader import coords, metacache
from stoker.storage import LocalStore

pytestmark = pytest.mark.timeout(60)

ATTRS = {"scale_factor": 0.5, "add_offset": 10.0, "units": "K"}
DATA = (np.arange(12 * 16, dtype="i2").reshape(12, 16) * 7) % 251


def _write(path) -> None:
    z = zarr.create_array(str(path), shape=DATA.shape, chunks=(4, 8), dtype=DATA.dtype,
                          compressors=ZstdCodec(level=1), fill_value=0, attributes=ATTRS,
                          dimension_names=("y", "x"))
    z[:] = DATA


def _files_opened(store: LocalStore, fn):
    before = store.counters.files_opened
    out = fn()
    return out, store.counters.files_opened - before


@pytest.mark.parametrize("settled", [False, True])
def test_attributes_and_cf_coding_of_a_v3_array_read_no_file_after_its_open(tmp_path, monkeypatch, settled):
    if settled:  # documents kept between opens (metacache): the second array's open reads nothing at all
        monkeypatch.setattr(metacache, "SETTLE_NS", -(1 << 62))
    metacache.clear()
    _write(tmp_path / "a.zarr")
    _write(tmp_path / "b.zarr")  # the same document's bytes: its parse is a copy of a's (metacache.parse_of)
    store = LocalStore()
    for k, name in enumerate(("a.zarr", "b.zarr", "a.zarr")):
        reader, opened = _files_opened(store, lambda: stoker.open_array(tmp_path / name, store=store))
        assert opened == (0 if settled and k == 2 else 1)  # zarr.json, unless kept since a's first open
        (attrs, coding, dims), read = _files_opened(store, lambda: (coords.attributes(reader), coords.coding(reader),
                                                                    coords.dimension_names(reader)))
        assert read == 0, f"{name}: its attributes read zarr.json again"
        assert attrs == ATTRS and dims == ("y", "x")
        assert coding is not None and coding.scale == 0.5 and coding.offset == 10.0
    store.close()


def test_a_pipeline_reads_each_v3_document_once_with_cf_on(tmp_path):
    metacache.clear()
    _write(tmp_path / "a.zarr")
    with stoker.Pipeline(stoker.Config(batch_size=2, dtype="f32", cf=True, sample_shape=(4, 8))) as p:
        p.push([stoker.Sample(str(tmp_path / "a.zarr"), [(0, 4), (0, 8)]),
                stoker.Sample(str(tmp_path / "a.zarr"), [(4, 8), (8, 16)])])
        with p.pop(timeout=30) as batch:
            got = torch.from_dlpack(batch).numpy().copy()
        docs = p._store.counters.files_opened
    np.testing.assert_allclose(got[0], DATA[0:4, 0:8] * 0.5 + 10.0)
    np.testing.assert_allclose(got[1], DATA[4:8, 8:16] * 0.5 + 10.0)
    assert docs == 1, f"zarr.json opened {docs} times"
