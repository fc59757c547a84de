"""ArrayReader.locate: the file and byte range of every kind of chunk."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

import stoker

pytestmark = pytest.mark.timeout(60)


def test_locate_names_the_file_and_range_of_every_chunk_kind(tmp_path):
    """ArrayReader.locate: a plain chunk is a whole file (present or not); an inner chunk of a shard is
    the byte range its shard's index gives, whose bytes decode to zarr's chunk; an empty inner chunk and
    a missing shard have no file."""
    plain = zarr.create_array(str(tmp_path / "plain.zarr"), shape=(4, 4), chunks=(2, 2), dtype="uint16", fill_value=0)
    plain[:2, :2] = 7
    arr = stoker.open_array(tmp_path / "plain.zarr")
    loc = arr.locate((0, 0))
    assert (loc.key, loc.offset, loc.length) == ("c/0/0", None, None)
    assert loc.path == os.path.join(str(tmp_path / "plain.zarr"), "c", "0", "0") and os.path.exists(loc.path)
    assert arr.locate((1, 1)).path is not None and not os.path.exists(arr.locate((1, 1)).path)  # found when read

    sharded = zarr.create_array(str(tmp_path / "sharded.zarr"), shape=(8, 8), chunks=(2, 2), shards=(4, 4),
                                dtype="uint16", fill_value=0)
    data = np.arange(16, dtype="uint16").reshape(4, 4) + 1
    sharded[:4, :2] = data[:, :2]  # shard (0, 0): inner chunks (0, 0) and (1, 0) stored, the others empty
    arr = stoker.open_array(tmp_path / "sharded.zarr")
    loc = arr.locate((1, 0))
    assert loc.key == "c/0/0[2]" and loc.path == os.path.join(str(tmp_path / "sharded.zarr"), "c", "0", "0")
    raw = open(loc.path, "rb").read()[loc.offset:loc.offset + loc.length]
    np.testing.assert_array_equal(arr.metadata.codec.decode(raw, loc.key), sharded[2:4, 0:2])
    st = os.stat(loc.path)  # the identity of the shard file the index was read from
    assert loc.ident == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert arr.locate((0, 1)) == ("c/0/0[1]", None, None, None, None)  # empty inner chunk
    assert arr.locate((3, 3)) == ("c/1/1[3]", None, None, None, None)  # missing shard
