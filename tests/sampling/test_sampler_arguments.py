"""Arguments of the sample sources: a value that would change what is drawn without saying so (a fraction
truncated, a 0 read as "the default", a negative seed failing at the first draw) is an InvalidArgument naming
the argument when the source is made."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("args") / "a.zarr")
    zarr.create_array(path, shape=(20, 20), chunks=(8, 8), dtype="u1")
    return path


@pytest.mark.parametrize("count", [0, 2.7, True, "5", -1])
def test_an_epoch_length_that_is_not_a_positive_integer_is_refused(uri, count):
    """0 used to mean the default (25 crops here), 2.7 two samples, True one."""
    with pytest.raises(stoker.InvalidArgument, match="samples_per_epoch"):
        stoker.RandomCrops([uri], (4, 4), samples_per_epoch=count)


def test_an_epoch_length_of_a_numpy_integer_is_taken(uri):
    assert len(stoker.RandomCrops([uri], (4, 4), samples_per_epoch=np.int64(7))) == 7
    assert len(stoker.RandomCrops([uri], (4, 4), samples_per_epoch=None)) == 25  # the default: tiles the data once
