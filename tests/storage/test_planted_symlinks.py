"""Files stoker writes in shared folders (the statistics sidecar, checkpoints, derived arrays, demo
datasets) never write through a symlink someone planted there, at the temporary names older versions
used (``.<name>.tmp-<pid>``), at a name the new scheme draws, or at the final name."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
import uuid

import numpy as np
import pytest
import torch
import zarr

import stoker.train as st
from stoker.storage import fsutil
from stoker.demo.points import write_point_clouds
from stoker.records import ZarrRecords, compute_stats
from stoker.records import sidecar
from stoker.records.precomputed import write_array

PRECIOUS = b"the victim's own bytes\n"
TAG = "00000000"  # the random part of the first name drawn, while `guessable` is on


@pytest.fixture
def victim(tmp_path):
    """A file and a folder outside the shared folder, which the user can write."""
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    folder = tmp_path / "victim-dir"
    folder.mkdir()
    (folder / "keep").write_bytes(PRECIOUS)
    return path, folder


@pytest.fixture
def guessable(monkeypatch):
    """The first name stoker's writers draw ends in ``-00000000`` (as if an attacker had guessed it), the
    next ones are random; the test checks that the writer did draw it."""
    first = iter([uuid.UUID(int=0)])
    monkeypatch.setattr(fsutil, "uuid", types.SimpleNamespace(uuid4=lambda: next(first, None) or uuid.uuid4()))
    yield f"{fsutil.HOST}-{os.getpid()}-{TAG}"
    assert next(first, None) is None, "the planted name was never drawn"


def plant(link, target) -> None:
    os.symlink(target, link, target_is_directory=os.path.isdir(target))


def untouched(path, folder) -> bool:
    return path.read_bytes() == PRECIOUS and sorted(os.listdir(folder)) == ["keep"] and \
        (folder / "keep").read_bytes() == PRECIOUS


def test_the_statistics_sidecar_is_never_written_through_a_planted_symlink(tmp_path, victim, guessable):
    path, folder = victim
    root = tmp_path / "data"
    for i in range(2):
        zarr.open_group(str(root / f"rec{i}.zarr"), mode="w").create_array(
            "x", data=np.arange(12, dtype="f4").reshape(4, 3) + i)
    final = root / sidecar.FILENAME
    plant(root / f".{sidecar.FILENAME}.tmp-{os.getpid()}", path)  # the old name
    plant(root / f".{sidecar.FILENAME}.tmp-{guessable}", path)  # the first new name drawn
    plant(final, path)  # the final name: replaced, not followed
    with pytest.warns(RuntimeWarning, match="ignoring unreadable statistics file"):  # the victim is not JSON
        stats = compute_stats(ZarrRecords(str(root)), ["x"])
    assert untouched(path, folder)
    assert stat.S_ISREG(os.lstat(final).st_mode) and len(json.loads(final.read_text())["entries"]) == 1
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.lstat(final).st_mode) == 0o666 & ~umask  # others can read it, as before
    assert float(stats["x"].mean[0]) == pytest.approx(5.0)
    # The planted links are left as they were; no temporary file is left behind.
    links = sorted(p.name for p in root.iterdir() if p.is_symlink())
    assert links == sorted([f".{sidecar.FILENAME}.tmp-{os.getpid()}", f".{sidecar.FILENAME}.tmp-{guessable}"])
    assert not [p for p in root.iterdir() if fsutil.is_temp_path(p) and not p.is_symlink()]


def test_checkpoints_are_never_written_through_a_planted_symlink(tmp_path, victim, guessable):
    path, folder = victim
    ck = st.Checkpoints(tmp_path / "ck", keep=5)
    ck.directory.mkdir()
    for step in (1, 2):
        plant(ck.directory / f".step-{step:09d}.pt.tmp-{os.getpid()}", path)  # the old names
    plant(ck.directory / f".step-000000001.pt.tmp-{guessable}", path)
    plant(ck.path_for(2), path)  # the final name
    ck.save({"w": torch.ones(3)}, 1)
    ck.save({"w": torch.full((3,), 2.0)}, 2)
    assert untouched(path, folder)
    assert stat.S_ISREG(os.lstat(ck.path_for(2)).st_mode)
    assert torch.equal(ck.load_latest()[1]["w"], torch.full((3,), 2.0))


def test_checkpoint_cleanup_removes_only_dead_writers_temporary_files(tmp_path, victim):
    path, folder = victim
    ck = st.Checkpoints(tmp_path / "ck")
    ck.save({}, 1)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    d = ck.directory
    dead = d / f".step-000000002.pt.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    dead.write_bytes(b"half a checkpoint")
    legacy = d / ".step-000000002.pt.tmp-999"  # named as older versions did
    legacy.write_bytes(b"half a checkpoint")
    alive = fsutil.sibling_path(ck.path_for(3), "tmp")  # this process: a save in progress
    alive.write_bytes(b"being written")
    link_file = d / f".step-000000004.pt.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    link_dir = d / f".step-000000005.pt.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    plant(link_file, path)
    plant(link_dir, folder)
    a_dir = d / f".step-000000006.pt.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    a_dir.mkdir()
    other = d / "notes.txt"
    other.write_bytes(b"mine")
    assert sorted(ck.cleanup()) == sorted([dead, legacy])
    assert untouched(path, folder)
    assert all(os.path.lexists(p) for p in (alive, link_file, link_dir, a_dir, other, ck.path_for(1)))


def test_temporary_directories_are_new_and_never_a_planted_symlink(tmp_path, victim, guessable):
    path, folder = victim
    final = tmp_path / "shared" / "knn16"
    final.parent.mkdir()
    planted = final.with_name(f".knn16.tmp-{guessable}")
    plant(planted, folder)
    made = fsutil.make_sibling_dir(final)
    assert made != planted and made.is_dir() and not made.is_symlink() and os.listdir(made) == []
    assert planted.is_symlink() and untouched(path, folder)


def test_derived_arrays_are_never_written_into_a_planted_symlink(tmp_path, victim, guessable):
    path, folder = victim
    record = tmp_path / "rec.zarr"
    zarr.open_group(str(record), mode="w", zarr_format=3)
    plant(record / f".knn4.tmp-{guessable}", folder)
    write_array(str(record), "knn4", np.arange(6, dtype="i4").reshape(2, 3), {"a": 1})
    np.testing.assert_array_equal(zarr.open_array(str(record / "knn4"))[:], np.arange(6).reshape(2, 3))
    assert untouched(path, folder)


def test_the_demo_dataset_is_never_written_into_a_planted_symlink(tmp_path, victim, guessable):
    path, folder = victim
    root = tmp_path / "points"
    plant(tmp_path / f".points.tmp-{guessable}", folder)  # zarr's mode="w" would empty it
    write_point_clouds(root, n_records=2, min_points=8, max_points=9, progress=False)
    assert (root / "r00000" / "noisy").is_dir()
    assert untouched(path, folder)
