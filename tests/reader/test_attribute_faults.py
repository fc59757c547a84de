"""A remote array's attributes read through a faulty server: a ``.zattrs`` reply cut short with headers that agree
(a misbehaving server or proxy; tests/range_server.py ``shorten``) is a transport fault, read again, never a
malformed document kept for the reader's life; a document that is malformed stays a ``MetadataError``."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker
from stoker.reader import coords

from range_server import RangeServer

pytestmark = pytest.mark.timeout(60)

ATTRS = {"_ARRAY_DIMENSIONS": ["y", "x"], "units": "K", "long_name": "air temperature at two metres"}


@pytest.fixture
def served(tmp_path):
    for name, attrs in (("a.zarr", ATTRS), ("bad.zarr", {"_ARRAY_DIMENSIONS": ["y"]})):
        zarr.create_array(str(tmp_path / name), shape=(8, 8), chunks=(4, 4), dtype="f4", zarr_format=2,
                          attributes=attrs)[:] = np.ones((8, 8), "f4")
    server = RangeServer(str(tmp_path))
    yield server
    server.stop()


def test_an_attributes_reply_cut_short_once_is_read_again(served):
    reader = stoker.open_array(f"{served.url}/a.zarr")
    served.shorten(1)  # the .zattrs reply: half the document, with a Content-Length that says so
    assert coords.dimension_names(reader) == ("y", "x")
    assert coords.attributes(reader) == ATTRS
    assert served.paths.count("/a.zarr/.zattrs") == 2  # the short reply and the one read again


def test_attributes_cut_short_every_try_are_read_again_once_the_error_is_old(served, monkeypatch):
    """A fault that outlasts the second read is a MetadataError, kept a while (not a request per asker), and
    read again after :data:`coords.KEEP_ERROR_S`: once the server answers whole, the reader sees the attributes."""
    reader = stoker.open_array(f"{served.url}/a.zarr")
    served.shorten(2)
    with pytest.raises(stoker.MetadataError, match="not valid JSON"):
        coords.dimension_names(reader)
    with pytest.raises(stoker.MetadataError, match="not valid JSON"):  # kept: no request
        coords.dimension_names(reader)
    assert served.paths.count("/a.zarr/.zattrs") == 2
    monkeypatch.setattr(coords, "KEEP_ERROR_S", 0.0)
    assert coords.dimension_names(reader) == ("y", "x")
    assert coords.attributes(reader) == ATTRS
    assert served.paths.count("/a.zarr/.zattrs") == 3


def test_a_malformed_attribute_stays_a_metadata_error_requested_once_a_while(served, monkeypatch):
    reader = stoker.open_array(f"{served.url}/bad.zarr")
    for _ in range(3):
        with pytest.raises(stoker.MetadataError, match=r"dimension names \['y'\] are not 2 names"):
            coords.dimension_names(reader)
    assert served.paths.count("/bad.zarr/.zattrs") == 1
    monkeypatch.setattr(coords, "KEEP_ERROR_S", 0.0)
    with pytest.raises(stoker.MetadataError, match=r"dimension names \['y'\] are not 2 names"):
        coords.dimension_names(reader)
    assert served.paths.count("/bad.zarr/.zattrs") == 2


def test_attributes_cut_short_then_gone_stay_a_metadata_error():
    """A first reply cut short and the document gone at the second read (deleted, or refused, between two GETs)
    is the first reply's MetadataError, not "no attributes": a scale_factor would be dropped without a word."""
    from types import SimpleNamespace

    from stoker.errors import NotFound

    class Store:
        gets = 0

        def get(self, key):
            self.gets += 1
            if self.gets == 1:
                return b'{"scale_factor": 0.01, "add_off'
            raise NotFound("gone", uri="memory://x/a", key=key)

    reader = SimpleNamespace(path="a", kv=Store(), uri="memory://x/a")
    with pytest.raises(stoker.MetadataError, match="not valid JSON"):
        coords._read(reader, ".zattrs")
    assert reader.kv.gets == 2
