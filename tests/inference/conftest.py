"""The inference tests' shared input: a random float32 volume of test_writer.SHAPE written by zarr-python."""

import numpy as np
import pytest
import zarr

from .test_writer import SHAPE


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """``(uri, data)``: the volume, chunks (5, 8, 7), and the values written."""
    root = tmp_path_factory.mktemp("vol")
    data = np.random.default_rng(0).random(SHAPE).astype("f4")
    zarr.create_array(str(root / "in.zarr"), shape=SHAPE, chunks=(5, 8, 7), dtype="f4")[:] = data
    return str(root / "in.zarr"), data
