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

from descriptors import open_under

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
    # (the message names the first few regions of those not marked, in no fixed order: (0, 0, 0) is checked
    # in the record below)
    with pytest.raises(stoker.StorageError, match=r"flushing the chunks of region\(s\) \("):
        writer.close()
    assert (0, 0, 0) not in writer.record.done() and (0, 0, 0) not in writer.done
    monkeypatch.undo()
    again = stoker.TileWriter(str(out), data.shape, (8, 8, 8), "f4")
    assert (0, 0, 0) not in again.done
    again.close()


def _one_region_a_write(writer, grid, data) -> list[BaseException]:
    """Each tile of ``grid`` written alone (one region a pass); the errors raised."""
    errors = []
    for i in range(len(grid)):
        s = grid.sample(0, i)
        try:
            writer.write([s], data[tuple(slice(a, b) for a, b in s.aabb)][None])
        except stoker.StorageError as e:
            errors.append(e)
    return errors


def test_a_folder_made_after_a_fill_value_region_is_fsynced_in_its_parent_before_the_mark(tmp_path, monkeypatch):
    """Region (0, 1, 0) holds only the fill value: zarr stores no chunk and makes no folder c/0/1. Region
    (0, 1, 1), written after it, makes c/0/1: its entry in c/0 is fsynced before (0, 1, 1)'s mark (a folder
    that was not there is not taken as durable)."""
    calls = Calls(monkeypatch)
    shape = (8, 16, 16)
    data = np.random.default_rng(1).random(shape).astype("f4") + 1
    data[0:8, 8:16, 0:8] = 0
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    out = tmp_path / "out.zarr"
    writer = stoker.TileWriter(str(out), shape, (8, 8, 8), "f4", grid=grid, write_threads=0)
    assert _one_region_a_write(writer, grid, data) == []  # (0,0,0), (0,0,1), (0,1,0), (0,1,1) in turn
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)
    root = str(out.resolve())
    assert os.path.exists(root + "/c/0/1/1") and not os.path.exists(root + "/c/0/1/0")
    at = next(i for i, (k, p, d) in enumerate(calls.events) if k == "write"
              and os.path.basename(p).startswith(LOG_PREFIX) and d.strip() == b"0_1_1")
    made = calls.last("replace", root + "/c/0/1/1")  # c/0/1 was made just before
    assert any(k == "fsync" and p == root + "/c/0" for k, p, _ in calls.events[made:at])


def test_nothing_is_marked_after_a_failed_flush_without_write_threads(tmp_path, monkeypatch):
    """write_threads=0: the fsync of c/0/0 fails once (EIO; the next fsync of it would succeed with the
    data lost). The error is raised by that write, by every later write and by close(), and no region is
    marked, not even those written after it into the same folder."""
    real = os.fsync
    failed = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("/out.zarr/c/0/0") and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    shape = (8, 8, 32)
    data = np.random.default_rng(2).random(shape).astype("f4") + 1
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    writer = stoker.TileWriter(str(tmp_path / "out.zarr"), shape, (8, 8, 8), "f4", grid=grid, write_threads=0)
    errors = _one_region_a_write(writer, grid, data)
    assert failed and len(errors) == len(grid) == 4
    assert all("flushing the chunks of region(s) (0, 0, 0)" in str(e) for e in errors)
    with pytest.raises(stoker.StorageError, match=r"flushing the chunks of region\(s\) \(0, 0, 0\)"):
        writer.close()
    assert writer.record.done() == set() and writer.done == set()


def test_a_file_uri_is_written_as_local_files_fsynced_before_their_marks(tmp_path, monkeypatch):
    """``file://`` names the local path: zarr-python writes it through a LocalStore (not fsspec), whose chunk
    files are fsynced before the marks, as for the plain path."""
    shape = (16, 16, 16)
    data = np.random.default_rng(0).random(shape).astype("f4") + 1
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    calls = Calls(monkeypatch)
    out = tmp_path / "out.zarr"
    writer = stoker.TileWriter(f"file://{out}", shape, (8, 8, 8), "f4", grid=grid, write_threads=2)
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    writer.write(tiles, np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in tiles]))
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)
    assert writer.record.path == f"{out}.tiles-done" and len(writer.record.done()) == 8
    marks = [i for i, (k, p, _) in enumerate(calls.events) if k == "write" and os.path.basename(p).startswith(LOG_PREFIX)]
    chunks = [str(f.resolve()) for f in writer._chunks.files((slice(None),) * 3)]
    assert len(marks) == 8 and len(chunks) == 8
    assert all(calls.last("fsync", f) < max(marks) for f in chunks)


def test_an_output_whose_files_cannot_be_fsynced_is_refused_while_the_record_is_local(tmp_path):
    """A store other than a LocalStore (here fsspec's, as zarr-python opens ``memory://``) behind a local
    completion record: its marks would vouch for chunks nothing made durable, so the writer is refused."""
    from stoker.inference.chunks import ChunkWriter

    arr = zarr.create_array(zarr.storage.MemoryStore(), shape=(8, 8), chunks=(4, 4), dtype="f4")
    with pytest.raises(stoker.InvalidArgument, match="cannot fsync.*local path"):
        ChunkWriter(arr, durable=True, uri="memory-out")
    assert ChunkWriter(arr).folder is None  # not for a TileWriter's record: as before
    pytest.importorskip("fsspec")
    with pytest.raises(stoker.InvalidArgument, match="FsspecStore, whose files stoker cannot fsync"):
        stoker.TileWriter("memory://stoker-durable/out.zarr", (8, 8, 8), (8, 8, 8), "f4")


def test_close_waits_one_write_timeout_for_the_writes_and_the_marks_together(tmp_path, monkeypatch):
    """close() waits for the queued writes and then for the marks of what they wrote, both within one
    write_timeout_s: when the writes used it all, the marks' drain does not wait again."""
    release = threading.Event()
    real = os.fsync

    def fsync(fd):  # the sync thread's first pass hangs on the disk
        if threading.current_thread().name.startswith("stoker-tilewriter-sync"):
            release.wait(60)
        real(fd)

    shape = (8, 8, 16)
    data = np.random.default_rng(3).random(shape).astype("f4") + 1
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    writer = stoker.TileWriter(str(tmp_path / "out.zarr"), shape, (8, 8, 8), "f4", grid=grid, write_threads=1,
                               write_timeout_s=0.5)
    monkeypatch.setattr(os, "fsync", fsync)
    waits = []

    closer = threading.current_thread()

    class Counted(type(writer._marks._cv)):  # type: ignore[misc]
        def wait(self, timeout=None):
            if threading.current_thread() is closer:  # close()'s waits (the sync thread waits for groups)
                waits.append(timeout)
            return super().wait(timeout)

    writer._marks._cv = Counted(threading.Lock())
    real_write = writer._chunks.write
    started = threading.Event()

    def write(box, values):  # the second region's write hangs (in the write thread) until released
        if box[-1].start == 8:
            started.set()
            release.wait(60)
        real_write(box, values)

    monkeypatch.setattr(writer._chunks, "write", write)
    try:
        assert _one_region_a_write(writer, grid, data) == []
        assert started.wait(30)
        with pytest.raises(stoker.StorageError, match="write_timeout_s=0.5"):
            writer.close()
        assert waits == []  # the deadline had passed: the marks' drain raised without waiting
    finally:
        release.set()


def test_a_pass_waits_for_a_group_and_a_drain_starts_it_at_once(tmp_path, monkeypatch):
    """Regions handed over one after another are marked in one pass of GROUP_REGIONS (each pass fsyncs the
    folders and the log once); a drain does not wait for a group (with a group wait far past the test's
    timeout, a drain that did would hang it)."""
    from stoker.inference import durable
    from stoker.inference.record import CompletionRecord

    monkeypatch.setattr(durable, "GROUP_WAIT_S", 3600.0)
    root = tmp_path / "out.zarr"
    files = []
    for i in range(durable.GROUP_REGIONS + 1):
        f = root / "c" / str(i)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x")
        files.append(f)
    marked = []
    marks = durable.DurableMarks(CompletionRecord(str(root)), root, lambda r: marked.append(r), threaded=True,
                                 timeout_s=60)
    try:
        for i in range(durable.GROUP_REGIONS):
            marks.add((i,), [files[i]])
        assert marks.threads  # a sync thread took the first region and waits for the group
        for t in marks.threads:
            t.join(0.05)  # (it waits for the group, not for time: GROUP_WAIT_S is an hour)
        marks.add((durable.GROUP_REGIONS,), [files[-1]])  # after a group's pass, or with it
        marks.drain()
        assert sorted(marked) == [(i,) for i in range(durable.GROUP_REGIONS + 1)]
        assert marks.passes <= 2  # one group of GROUP_REGIONS, and the last region (or all in one)
    finally:
        marks.stop()
    assert CompletionRecord(str(root)).done() == set(marked)


class Writebacks:
    """The files whose writeback was started (``durable.start_writeback``), with ``os.fsync`` and ``os.replace``,
    in the order they happened (paths, every thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from stoker.inference import durable

        self.events: list[tuple[str, str]] = []
        lock = threading.Lock()
        real_fsync, real_replace = os.fsync, os.replace

        def add(kind: str, path: str) -> None:
            with lock:
                self.events.append((kind, path))

        def started(fd, offset, nbytes, flags):
            assert (offset, nbytes, flags) == (0, 0, 2)  # the whole file, SYNC_FILE_RANGE_WRITE only: no wait
            add("start", os.readlink(f"/proc/self/fd/{fd}"))
            return 0

        def fsync(fd):
            real_fsync(fd)
            add("fsync", os.readlink(f"/proc/self/fd/{fd}"))

        def replace(src, dst, **kw):
            real_replace(src, dst, **kw)
            add("replace", f"{os.path.realpath(dst)} {os.path.realpath(src)}")

        monkeypatch.setattr(durable, "_SYNC_FILE_RANGE", started)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("threads", [0, 2])
def test_each_chunk_s_writeback_starts_when_it_is_written_and_again_before_its_fsync(tmp_path, monkeypatch, threads):
    """A chunk file's writeback is started as it is written (the temporary file, before its rename), and every
    file a mark vouches for has its writeback started before it is fsynced: once per file written, once per file
    a pass fsyncs, nothing else."""
    wb = Writebacks(monkeypatch)
    writer, out, data = _write_volume(tmp_path, threads)
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)
    chunks = {str(f.resolve()) for f in writer._chunks.files((slice(None),) * 3)}
    assert writer._chunks.direct_chunks == len(chunks) == 12
    renamed = {dst: src for kind, p in wb.events if kind == "replace" for dst, src in [p.split(" ")]}
    for f in chunks:
        at_put = [i for i, (k, p) in enumerate(wb.events) if k == "start" and p == renamed[f]]
        assert len(at_put) == 1 and at_put[0] < wb.events.index(("replace", f"{f} {renamed[f]}"))
        fsyncs = [i for i, (k, p) in enumerate(wb.events) if k == "fsync" and p == f]
        before = [i for i, (k, p) in enumerate(wb.events) if k == "start" and p == f]
        assert len(fsyncs) == len(before) == 1 and before[0] < fsyncs[0]
    # and the array's zarr.json and the record's settings (writer.json), with the first pass
    assert sum(k == "start" for k, _ in wb.events) == 2 * len(chunks) + 2


def test_a_pass_starts_every_file_s_writeback_before_the_first_fsync(tmp_path, monkeypatch):
    """A pass's files are written to the disk together: each one's writeback started before any is fsynced; a
    file that is not there (a chunk holding only the fill value) is skipped; a failed fsync is raised with every
    descriptor closed."""
    from stoker.inference import durable

    wb = Writebacks(monkeypatch)
    files = [tmp_path / f"c{i}" for i in range(5)]
    for f in files:
        f.write_bytes(b"x" * 4096)
    durable._fsync_together(files[:2] + [tmp_path / "gone"] + files[2:])
    kinds = [k for k, _ in wb.events]
    assert kinds == ["start"] * 5 + ["fsync"] * 5
    assert [p for _, p in wb.events] == [str(f) for f in files] * 2
    open_before = open_under(tmp_path)  # not every descriptor: others close meanwhile in a long run
    real = os.fsync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("c3"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="injected"):
        durable._fsync_together(files)
    assert open_under(tmp_path) == open_before


def test_a_chunk_writer_without_a_record_starts_no_writeback(tmp_path, monkeypatch):
    """Only a TileWriter's durable chunks ask for early writeback; a ChunkWriter of its own leaves the page cache
    to the kernel."""
    from stoker.inference.chunks import ChunkWriter

    wb = Writebacks(monkeypatch)
    arr = zarr.create_array(str(tmp_path / "o.zarr"), shape=(8, 16), chunks=(8, 8), dtype="f4")
    cw = ChunkWriter(arr)
    cw.write((slice(0, 8), slice(0, 16)), np.arange(128, dtype="f4").reshape(8, 16) + 1)
    assert cw.direct_chunks == 2 and not any(k == "start" for k, _ in wb.events)
    np.testing.assert_array_equal(arr[:], np.arange(128, dtype="f4").reshape(8, 16) + 1)


@pytest.mark.parametrize("threads", [0, 2])
def test_the_settings_reach_the_disk_before_the_first_mark_not_before_the_writer_starts(tmp_path, monkeypatch,
                                                                                       threads):
    # the record's settings (writer.json) vouch for every mark: they are on the disk, their name too, before the
    # first mark is appended; but TileWriter() does not wait on the disk for them (it did: two fsyncs, file and
    # folder, before the first tile could be read), they go with the first group of marks as the array's metadata
    calls = Calls(monkeypatch)
    shape = (16, 16, 24)
    data = np.random.default_rng(5).random(shape).astype("f4") + 1
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (8, 8, 8), stride=(8, 8, 8))
    out = tmp_path / "out.zarr"
    writer = stoker.TileWriter(str(out), shape, (8, 8, 8), "f4", grid=grid, write_threads=threads)
    settings = str((tmp_path / "out.zarr.tiles-done" / "writer.json").resolve())
    assert os.path.exists(settings)
    assert not [p for k, p, _ in calls.events if k == "fsync"]  # nothing waited on the disk yet
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    for i in range(0, len(tiles), 3):
        batch = tiles[i:i + 3]
        writer.write(batch, np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in batch]))
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)
    first = min(i for i, (k, p, _) in enumerate(calls.events) if k == "write" and
                os.path.basename(p).startswith(LOG_PREFIX))
    record = os.path.dirname(settings)
    assert calls.first("fsync", settings) < first
    assert calls.last("replace", settings) < calls.first("fsync", record) < first  # its name in the folder
    assert calls.first("fsync", str(tmp_path.resolve())) < first  # and the record folder's in its parent
