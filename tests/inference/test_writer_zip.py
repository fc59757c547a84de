"""TileWriter and zip archives: stoker reads them but writes none. A URI through one is refused with a typed
error saying what to do (write a folder or an object store, zip it afterwards), before anything is made."""
from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
import zarr

import stoker
from stoker.errors import InvalidArgument, UnsupportedFormat

ARGS = dict(shape=(16, 16), chunks=(8, 8), dtype="f4")


def _archive(tmp_path):
    path = tmp_path / "x.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("other.txt", "kept")
    return path


def test_a_path_through_an_existing_archive_is_refused_as_read_only(tmp_path):
    path = _archive(tmp_path)
    before = path.read_bytes()
    with pytest.raises(UnsupportedFormat, match="read-only for TileWriter.*folder.*zip"):
        stoker.TileWriter(str(path / "pred.zarr"), **ARGS)
    assert path.read_bytes() == before


@pytest.mark.parametrize("inner", ["!/pred.zarr", "/pred.zarr", ""])
def test_a_zip_uri_is_refused_as_read_only(tmp_path, inner):
    path = _archive(tmp_path)
    with pytest.raises(UnsupportedFormat, match="read-only for TileWriter"):
        stoker.TileWriter(f"zip://{path}{inner}", **ARGS)


@pytest.mark.parametrize("name", ["x.zip/pred.zarr", "x.ZIP", "deep/x.zip/g/pred.zarr"])
def test_a_path_through_a_missing_zip_makes_no_folder_of_that_name(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="not a zip archive.*read-only for TileWriter"):
        stoker.TileWriter(name, **ARGS)
    assert os.listdir(tmp_path) == []


def test_a_folder_named_zip_made_before_is_written_as_a_folder(tmp_path):
    (tmp_path / "x.zip").mkdir()
    uri = str(tmp_path / "x.zip" / "pred.zarr")
    with stoker.TileWriter(uri, **ARGS) as w:
        assert w.array.shape == (16, 16)
    assert np.array_equal(zarr.open_array(uri)[:], np.zeros((16, 16), "f4"))
