"""A region's mark never reaches the disk before its data: on a local disk every chunk (or shard) file a mark
vouches for, and the folders that took their names, are fsynced before the mark is appended to the record's
log, and the log is fsynced after it. The order is seen by recording the real calls (``os.replace`` of a
chunk, ``os.fsync`` of a descriptor, ``os.write`` of a mark) as they happen, on every thread."""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr

import stoker
from stoker.inference.record import LOG_PREFIX

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="descriptors' paths from /proc")]


class Calls:
    """``os.replace``, ``os.fsync`` and ``os.write`` of the process, in the order they happened (paths)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> None:
        self.events: list[tuple[str, str, bytes]] = []
        self._lock = threading.Lock()
        real_fsync, real_write, real_replace = os.fsync, os.write, os.replace

        def path_of(fd: int) -> str:
            return os.readlink(f"/proc/self/fd/{fd}")

        def fsync(fd):
            path = path_of(fd)
            if fail is not None and path.endswith(fail):
                raise OSError(errno.EIO, "Input/output error (injected)", path)
            real_fsync(fd)
            self._add("fsync", path)

        def write(fd, data):
            n = real_write(fd, data)
            self._add("write", path_of(fd), bytes(data))
            return n

        def replace(src, dst, **kw):
            real_replace(src, dst, **kw)
            self._add("replace", os.path.realpath(dst))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "replace", replace)

    def _add(self, kind: str, path: str, data: bytes = b"") -> None:
        with self._lock:
            self.events.append((kind, path, data))

    def first(self, kind: str, path: str) -> int:
        return next(i for i, (k, p, _) in enumerate(self.events) if k == kind and p == path)

    def last(self, kind: str, path: str) -> int:
        return max(i for i, (k, p, _) in enumerate(self.events) if k == kind and p == path)


def _write_volume(tmp_path: Path, threads: int, **layout):
    shape = (16, 16, 24)
    data = np.random.default_rng(5).random(shape).astype("f4") + 1  # no chunk holds only the fill value
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    out = tmp_path / "out.zarr"
    writer = stoker.TileWriter(str(out), shape, (8, 8, 8), "f4", grid=grid, write_threads=threads, **layout)
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    for i in range(0, len(tiles), 3):
        batch = tiles[i:i + 3]
        writer.write(batch, np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in batch]))
    return writer, out, data


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("layout", [{}, dict(zarr_format=2), dict(shards=(8, 16, 24))])
def test_a_mark_is_written_after_its_chunks_are_fsynced_and_the_log_after_it(tmp_path, monkeypatch, threads, layout):
    calls = Calls(monkeypatch)
    writer, out, data = _write_volume(tmp_path, threads, **layout)
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)
    marks = [(i, p, d) for i, (k, p, d) in enumerate(calls.events) if k == "write" and
             os.path.basename(p).startswith(LOG_PREFIX)]
    regions = writer.owned_regions()
    assert sorted(tuple(int(x) for x in d.decode().split("_")) for _, _, d in marks) == sorted(regions)
    root = out.resolve()
    for at, log, line in marks:
        region = tuple(int(x) for x in line.decode().split("_"))
        unit = writer.unit
        where = tuple(slice(r * u, (r + 1) * u) for r, u in zip(region, unit))
        files = [str(f.resolve()) for f in writer._chunks.files(where)]
        assert files and all(os.path.exists(f) for f in files)
        for f in files:
            # the chunk (or shard) was stored, then fsynced, and so was its folder, before the mark: a power
            # loss cannot leave a mark whose data is not on the disk
            assert calls.last("replace", f) < calls.last("fsync", f) < at, (f, region)
            folder = os.path.dirname(f)
            assert calls.last("replace", f) < max(i for i, (k, p, _) in enumerate(calls.events[:at])
                                                   if k == "fsync" and p == folder), (folder, region)
            # every folder between the chunk and the array's parent took its name durably before the mark
            d = Path(folder)
            while d != root.parent:
                assert calls.first("fsync", str(d.parent)) < at, (d, region)
                d = d.parent
        assert calls.first("fsync", str(root / ("zarr.json" if layout.get("zarr_format", 3) == 3 else ".zarray"))) < at
        assert any(k == "fsync" and p == log for k, p, _ in calls.events[at + 1:])  # the mark made durable after
    # batched: one fsync of the log per group of marks, never more than one per mark
    assert sum(k == "fsync" and os.path.basename(p).startswith(LOG_PREFIX) for k, p, _ in calls.events) <= len(marks) + 1


def test_a_chunk_that_cannot_be_flushed_leaves_its_region_unmarked(tmp_path, monkeypatch):
    """An fsync failing (EIO: the data may not be on the disk) is a StorageError at close(), naming the
    regions; they stay unmarked, so a restarted job writes them again."""
    Calls(monkeypatch, fail="/c/0/0/0")
    writer, out, data = _write_volume(tmp_path, 2)
    with pytest.raises(stoker.StorageError, match=r"flushing the chunks of region\(s\) .*\(0, 0, 0\)"):
        writer.close()
    assert (0, 0, 0) not in writer.record.done() and (0, 0, 0) not in writer.done
    monkeypatch.undo()
    again = stoker.TileWriter(str(out), data.shape, (8, 8, 8), "f4")
    assert (0, 0, 0) not in again.done
    again.close()
