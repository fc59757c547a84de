"""The completion record on a local disk: a writer's marks are lines appended to one log (a file made and
renamed per region cost ~150-700 µs of kernel CPU each), read back whole, a line cut short is no mark, and
the per-region files of earlier records still count."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from stoker.errors import InvalidArgument
from stoker.inference.record import LOG_PREFIX, CompletionRecord

pytestmark = pytest.mark.timeout(60)


def test_marks_are_lines_of_one_log_not_a_file_each(tmp_path):
    rec = CompletionRecord(str(tmp_path / "a.zarr"))
    marks = {(i, j, k) for i in range(4) for j in range(4) for k in range(3)}
    threads = [threading.Thread(target=lambda part=part: [rec.mark(m) for m in part])
               for part in (sorted(marks)[::2], sorted(marks)[1::2])]  # two write threads, as a TileWriter's
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert rec.done() == marks  # readable as they are made (a job killed now resumes after them)
    rec.sync()
    names = os.listdir(rec.path)
    assert len(names) == 1 and names[0].startswith(LOG_PREFIX), names
    rec.mark((9, 9, 9))  # after sync: another log
    assert CompletionRecord(str(tmp_path / "a.zarr")).done() == marks | {(9, 9, 9)}


def test_a_mark_cut_short_is_no_mark_and_old_files_count(tmp_path):
    rec = CompletionRecord(str(tmp_path / "a.zarr"))
    rec.mark((1, 2, 3))
    rec.sync()
    (tmp_path / "a.zarr.tiles-done" / f"{LOG_PREFIX}crashed.log").write_bytes(b"4_5_6\n7_8")  # killed mid-line
    (tmp_path / "a.zarr.tiles-done" / "0_0_1.json").write_text('{"region": [0, 0, 1]}')  # an earlier version's mark
    (tmp_path / "a.zarr.tiles-done" / f"{LOG_PREFIX}junk.log").write_bytes(b"x_1\n\n-1_2_3\n1_\xff\n")
    assert CompletionRecord(str(tmp_path / "a.zarr")).done() == {(1, 2, 3), (4, 5, 6), (0, 0, 1)}


def test_sync_fsyncs_only_what_changed_since_the_last_flush(tmp_path, monkeypatch):
    # a TileWriter's close() waits on the disk only for marks its last group commit did not flush
    from stoker.inference import record as record_module

    rec = CompletionRecord(str(tmp_path / "a.zarr"))
    files, folders = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(record_module.os, "fsync", lambda fd: (files.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(record_module, "fsync_dir", lambda path: folders.append(str(path)))
    rec.mark((0, 0, 0))
    rec.flush()  # the new log fsynced, and the folder that took its name
    assert (len(files), folders) == (1, [rec.path])
    rec.sync()  # nothing since: the log closed, no fsync
    assert (len(files), len(folders)) == (1, 1) and rec._log[0] is None
    rec.mark((0, 0, 1))  # a new log: its mark and its name in the folder are fsynced by sync()
    rec.sync()
    assert (len(files), len(folders)) == (2, 2)
    rec.mark((0, 0, 2))
    rec.flush()
    rec.mark((0, 0, 3))  # appended after the flush: sync() fsyncs the log again, not the folder
    rec.sync()
    assert (len(files), len(folders)) == (4, 3)
    assert CompletionRecord(str(tmp_path / "a.zarr")).done() == {(0, 0, i) for i in range(4)}


def test_a_record_dropped_without_sync_closes_its_log(tmp_path):
    rec = CompletionRecord(str(tmp_path / "a.zarr"))
    rec.mark((0, 0, 0))
    fd = rec._log[0]
    assert fd is not None
    del rec
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the finalizer (and only that descriptor: it was the record's own)


_SHORT_WRITE = r"""
import os, resource, signal, sys
from stoker.inference.record import CompletionRecord
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: a short write / EFBIG, not a killed process
rec = CompletionRecord(sys.argv[1])
rec.mark((0, 0, 0))                                       # "0_0_0\n": 6 bytes
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (7, hard))      # room for one more byte: the kernel writes "1"
try:
    rec.mark((1, 0, 2))
    print("no error")
except OSError as e:
    print("cut short:", e)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # space again
rec.mark((5, 6, 7))                                       # the next region's mark
rec.sync()
"""


def test_a_mark_cut_short_by_the_kernel_leaves_no_torn_line_for_the_next(tmp_path):
    # a real short write (RLIMIT_FSIZE, as a full disk at a block boundary): the torn "1" must not become the
    # first byte of the next mark ("15_6_7"), which a restart would skip unwritten
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(tmp_path / "a.zarr")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "cut short" in out.stdout, out.stdout
    assert CompletionRecord(str(tmp_path / "a.zarr")).done() == {(0, 0, 0), (5, 6, 7)}
    logs = [(tmp_path / "a.zarr.tiles-done" / n).read_bytes() for n in os.listdir(tmp_path / "a.zarr.tiles-done")]
    assert sorted(logs) == [b"0_0_0\n", b"5_6_7\n"]  # the torn byte cut off, the next mark in a new log


def test_done_takes_only_indices_of_the_region_grid(tmp_path):
    rec = CompletionRecord(str(tmp_path / "a.zarr"))
    rec.check_settings({"shape": [2, 10, 20, 30], "unit": [2, 5, 10, 10], "dtype": "float32", "blend": "none",
                        "crop": None})  # regions: 2 x 2 x 3 (with the channel axis: 1 x 2 x 2 x 3)
    for m in [(1, 1, 2), (0, 0, 0, 0), (2, 0, 0), (0, 2, 0), (1, 1, 3), (1, 1), (0, 0, 0, 0, 0), (15, 1, 2)]:
        rec.mark(m)
    assert rec.done() == {(1, 1, 2), (0, 0, 0, 0)}


def test_settings_cut_short_by_a_crash_before_any_mark_are_started_again(tmp_path):
    # writer.json goes to the disk with the first group of marks: a crash before it may leave the file empty (its
    # name durable, its bytes not); no mark can be there then, so a restart starts the record again, where it
    # raised JSONDecodeError
    import zarr

    import stoker

    src = str(tmp_path / "in.zarr")
    data = np.arange(8 * 8 * 8, dtype="f4").reshape(8, 8, 8)
    zarr.create_array(src, shape=(8, 8, 8), chunks=(4, 4, 4), dtype="f4")[:] = data
    grid = stoker.TileGrid([src], (4, 4, 4), stride=(4, 4, 4))
    out = str(tmp_path / "out.zarr")
    stoker.TileWriter(out, (8, 8, 8), (4, 4, 4), "f4", grid=grid, write_threads=0).close()  # made, nothing marked
    settings = tmp_path / "out.zarr.tiles-done" / "writer.json"
    settings.write_bytes(b"")
    writer = stoker.TileWriter(out, (8, 8, 8), (4, 4, 4), "f4", grid=grid, write_threads=0)
    assert len(writer.pending(grid)) == len(grid)
    for s in writer.pending(grid):
        writer.write([s], data[tuple(slice(a, b) for a, b in s.aabb)][None])
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], data)
    assert json.loads(settings.read_bytes())["shape"] == [8, 8, 8]


def test_settings_cut_short_beside_marks_are_refused(tmp_path):
    # marks are appended only once the settings are on the disk: torn settings beside marks are not a crash's
    # doing, and the marks cannot be trusted: refused, naming the file, rather than started again over them
    rec = CompletionRecord(str(tmp_path / "out.zarr"))
    rec.check_settings({"shape": [8, 8], "unit": [4, 4], "dtype": "float32", "blend": "none", "crop": None})
    rec.mark((0, 1))
    rec.sync()
    (tmp_path / "out.zarr.tiles-done" / "writer.json").write_bytes(b'{"shape": [8')
    with pytest.raises(InvalidArgument, match="writer.json"):
        CompletionRecord(str(tmp_path / "out.zarr")).check_settings(
            {"shape": [8, 8], "unit": [4, 4], "dtype": "float32", "blend": "none", "crop": None})


def test_done_of_a_record_whose_settings_are_torn_is_a_typed_error(tmp_path):
    # a record read on its own (not through TileWriter, which checks the settings first): done() parsed
    # writer.json directly and raised a bare JSONDecodeError for torn settings; an InvalidArgument naming the file
    rec = CompletionRecord(str(tmp_path / "out.zarr"))
    rec.check_settings({"shape": [8, 8], "unit": [4, 4], "dtype": "float32", "blend": "none", "crop": None})
    rec.mark((0, 1))
    rec.sync()
    assert rec.done() == {(0, 1)}
    (tmp_path / "out.zarr.tiles-done" / "writer.json").write_bytes(b'{"shape": [8')
    with pytest.raises(InvalidArgument, match="writer.json"):
        CompletionRecord(str(tmp_path / "out.zarr")).done()


@pytest.mark.parametrize("beside, refused", [("summary.json", False), ("0_1.json", True)])
def test_torn_settings_are_refused_beside_a_mark_as_done_reads_one(tmp_path, beside, refused):
    # a .json that is no region's name (a tool's summary beside the marks) is no mark for done(), and was one
    # for the torn-settings check, which refused a record that has none
    folder = tmp_path / "out.zarr.tiles-done"
    folder.mkdir()
    (folder / "writer.json").write_bytes(b'{"shape": [8')
    (folder / beside).write_bytes(b'{"region": [0, 1]}')
    settings = {"shape": [8, 8], "unit": [4, 4], "dtype": "float32", "blend": "none", "crop": None}
    rec = CompletionRecord(str(tmp_path / "out.zarr"))
    if refused:
        with pytest.raises(InvalidArgument, match="writer.json"):
            rec.check_settings(settings)
        return
    rec.check_settings(settings)
    assert rec.done() == set()
    assert json.loads((folder / "writer.json").read_bytes()) == settings
