"""What the local stores do beyond the shared conformance class: FileStore's reads go through the
shared descriptor cache, merged; ZipStore merges ranges of several members into one read and refuses
archives that are hostile or corrupt (names leaving the root, members past the central directory, bad
CRCs, encrypted members) with typed errors rather than wrong bytes."""

from __future__ import annotations

import os
import struct
import time
import warnings
import zipfile

import numpy as np
import pytest

from stoker.errors import DecodeError, InvalidArgument, NotFound, StorageError, UnsupportedFormat
from stoker.storage import ByteRange, FileStore, LocalStore, ZipStore, open_store

A, B, C = b"a" * 1000, bytes(range(200)) * 10, b"c" * 500


def write(path, members, compress=zipfile.ZIP_STORED):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names, on purpose
        with zipfile.ZipFile(path, "w", compression=compress) as zf:
            for name, data in members:
                zf.writestr(name, data)
    return str(path)


def patch_central(path, field_offset, fmt, value, entry=0):
    """Overwrite a field of the ``entry``-th central directory record."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        at = -1
        for _ in range(entry + 1):
            at = data.index(b"PK\x01\x02", at + 1)
        struct.pack_into(fmt, data, at + field_offset, value)
        f.seek(0)
        f.write(data)


def test_file_store_reads_through_the_shared_descriptor_cache(tmp_path):
    (tmp_path / "shard").write_bytes(B)
    files = LocalStore()
    store = FileStore(tmp_path, files=files)
    for _ in range(5):
        got = store.get_ranges([ByteRange("shard", 0, 10), ByteRange("shard", 20, 10), ByteRange.suffix("shard", 4)])
        assert [bytes(g) for g in got] == [B[:10], B[20:30], B[-4:]]
    assert files.counters.files_opened == 1  # one descriptor, cached, for every ranged read
    assert files.counters.reads == 10  # the two near ranges merged into one read per call, plus the suffix


def test_file_store_refuses_special_files(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    store = FileStore(tmp_path)
    with pytest.raises(StorageError):
        store.get("fifo")  # never blocks on a FIFO
    assert not store.exists("fifo") and store.list() == []


def test_zip_ranges_of_several_members_are_one_read(tmp_path):
    files = LocalStore()
    store = ZipStore(write(tmp_path / "a.zip", [("c/0", A), ("c/1", B), ("c/2", C)]), files=files)
    requests = [ByteRange("c/0", 990, 10), ByteRange("c/1", 0, 100), ByteRange.suffix("c/2", 50)]
    want = [A[990:], B[:100], C[-50:]]
    assert [bytes(g) for g in store.get_ranges(requests)] == want  # reads each member's local header once
    before = files.counters.reads
    assert [bytes(g) for g in store.get_ranges(requests)] == want
    assert files.counters.reads - before == 1


def test_zip_deflated_members_are_inflated(tmp_path):
    store = ZipStore(write(tmp_path / "d.zip", [("c/0", A), ("c/1", B)], zipfile.ZIP_DEFLATED))
    assert bytes(store.get("c/1")) == B
    assert bytes(store.get_ranges([ByteRange("c/1", 5, 7)])[0]) == B[5:12]
    assert store.size("c/1") == len(B)


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "a\\..\\evil", "a//b"])
def test_zip_names_leaving_the_root_are_refused(tmp_path, name):
    with pytest.raises(DecodeError) as info:
        ZipStore(write(tmp_path / "t.zip", [("ok", A), (name, B)]))
    assert info.value.key == name


def test_zip_duplicate_names_are_refused(tmp_path):
    with pytest.raises(DecodeError, match="twice"):
        ZipStore(write(tmp_path / "t.zip", [("c/0", A), ("c/0", B)]))


def test_a_zarr_zipstore_with_members_written_twice_is_refused_saying_what_to_do(tmp_path):
    """zarr-python's ZipStore appends a metadata member again when it is rewritten (as xarray's to_zarr does):
    the refusal says how to make an archive of one member per name, and that archive reads as zarr-python does."""
    import shutil

    import zarr

    import stoker

    path = str(tmp_path / "a.zip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        store = zarr.storage.ZipStore(path, mode="w")
        z = zarr.create_array(store, shape=(4, 6), chunks=(2, 3), dtype="i2", zarr_format=2)
        z[:] = np.arange(24, dtype="i2").reshape(4, 6)
        z.attrs["units"] = "m"  # .zattrs written again
        z.attrs["long_name"] = "depth"
        store.close()
    with pytest.raises(DecodeError, match=r"twice.*Write the store to a directory.*zip -0 -r"):
        stoker.open_array(path)
    want = zarr.open_array(zarr.storage.ZipStore(path, mode="r"), mode="r")[:]
    with zipfile.ZipFile(path) as zf:  # what the message says: a directory, archived with each name once
        for name in {i.filename for i in zf.infolist()}:
            (tmp_path / "d.zarr" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "d.zarr" / name).write_bytes(zf.read(name))  # zipfile (as zarr-python) reads the last
    shutil.make_archive(str(tmp_path / "once"), "zip", tmp_path / "d.zarr")
    assert np.array_equal(stoker.open_array(str(tmp_path / "once.zip")).read([(0, 4), (0, 6)]), want)


@pytest.mark.parametrize("entry, size", [(0, len(A) + 100), (1, len(B) + 100)])
def test_zip_member_past_the_next_one_or_the_central_directory_is_refused(tmp_path, entry, size):
    """Sizes that would read the next member's bytes (or the central directory) as this member's."""
    path = write(tmp_path / "t.zip", [("c/0", A), ("c/1", B)])
    patch_central(path, 20, "<L", size, entry=entry)  # compressed size
    patch_central(path, 24, "<L", size, entry=entry)  # uncompressed size
    with pytest.raises(DecodeError, match="central directory") as info:
        ZipStore(path)
    assert info.value.key == f"c/{entry}"


def test_zip_stored_member_larger_than_its_stored_bytes_is_refused(tmp_path):
    """A stored member whose size exceeds its stored bytes: range reads would return the next member's."""
    path = write(tmp_path / "t.zip", [("c/0", A), ("c/1", B)])
    patch_central(path, 24, "<L", len(A) + 16, entry=0)  # uncompressed size only
    with pytest.raises(DecodeError, match="stored member 'c/0'") as info:
        ZipStore(path)
    assert info.value.key == "c/0" and str(path) in str(info.value)


def test_zip_local_header_missing_is_refused(tmp_path):
    path = write(tmp_path / "t.zip", [("c/0", A), ("c/1", B)])
    with zipfile.ZipFile(path) as zf:
        offset = zf.getinfo("c/1").header_offset
    patch_central(path, 42, "<L", offset + 2, entry=1)  # header offset of c/1: no header there
    store = ZipStore(path)
    assert bytes(store.get("c/0")) == A
    with pytest.raises(DecodeError, match="local header"):
        store.get_ranges([ByteRange("c/1", 0, 10)])


def test_zip_corrupt_stored_member_fails_its_crc(tmp_path):
    path = write(tmp_path / "t.zip", [("c/0", A)])
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(data.index(A) + 10)
        f.write(b"X")
    with pytest.raises(DecodeError, match="CRC"):
        ZipStore(path).get("c/0")


def test_zip_corrupt_deflated_member_is_a_decode_error(tmp_path):
    path = write(tmp_path / "t.zip", [("c/0", B * 5)], zipfile.ZIP_DEFLATED)
    with open(path, "r+b") as f:
        f.seek(45)
        f.write(b"\xff" * 20)
    with pytest.raises(DecodeError):
        ZipStore(path).get("c/0")


def test_zip_encrypted_member_is_unsupported(tmp_path):
    path = write(tmp_path / "t.zip", [("c/0", A)])
    patch_central(path, 8, "<H", 0x1)  # general purpose flags: encrypted
    with pytest.raises(UnsupportedFormat, match="encrypted"):
        ZipStore(path).get("c/0")


def test_zip_not_an_archive_or_missing(tmp_path):
    (tmp_path / "x.zip").write_bytes(b"not a zip at all")
    with pytest.raises(DecodeError):
        open_store(str(tmp_path / "x.zip"))
    with pytest.raises(NotFound):
        ZipStore(tmp_path / "missing.zip")


def test_byte_range_checks():
    with pytest.raises(InvalidArgument):
        ByteRange("k", 0, -1)
    with pytest.raises(InvalidArgument):
        ByteRange("k", -3, 5)  # negative start means a suffix: -length only
    with pytest.raises(InvalidArgument):
        ByteRange("../k", 0, 1)
    assert ByteRange.suffix("k", 5) == ByteRange("k", -5, 5) and ByteRange.suffix("k", 5).is_suffix


def test_errors_get_each_returns_in_place_of_bytes_carry_no_traceback(tmp_path):
    # a traceback would tie the error to the frames it passed through, and so to the caller's locals (a
    # batch's buffers among them), in a cycle that only a garbage collection frees
    from stoker.storage.store import get_each

    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("here", b"0123456789")
    store = ZipStore(str(path))
    for asked in ([ByteRange("gone", 0, 4)], [ByteRange("here", 0, 4), ByteRange("gone", 0, 4)]):
        got = get_each(store, asked)
        assert isinstance(got[-1], NotFound) and got[-1].__traceback__ is None
        assert got[-1].__context__ is None or got[-1].__context__.__traceback__ is None
    assert bytes(got[0]) == b"0123"


def test_batches_of_a_zipped_sharded_array_without_shards_free_their_slots_at_once(tmp_path):
    # every shard missing: each batch's shard-index reads end in NotFound, kept as values; with the garbage
    # collector off, a released batch's slot must still be free (no cycle holds it), batch after batch
    import gc

    import torch
    import zarr

    import stoker

    src = tmp_path / "a.zarr"
    zarr.create_array(str(src), shape=(8,), chunks=(1,), shards=(1,), dtype="uint8", fill_value=5, compressors=None)
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(src / "zarr.json", "zarr.json")
    cfg = stoker.Config(batch_size=1, dtype="native", device="cpu", host_buffer_bytes=64 << 20, pop_timeout_s=20)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(str(path), [(s, s + 2)]) for s in (1, 0, 2, 3, 4, 5)])
            for _ in range(6):
                with p.pop() as b:
                    assert torch.from_dlpack(b).tolist() == [[5, 5]]
            del b
            slots = p._executor.slots.slots
            # no garbage holds a released slot: with the collector off, only live frames may, and the thread
            # that finished the last batch lets go of its frame within moments (polled: a loaded host is slow)
            deadline = time.monotonic() + 5
            while not all((s.refs() or 0) <= s.baseline for s in slots) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all((s.refs() or 0) <= s.baseline for s in slots)
    finally:
        if was_enabled:
            gc.enable()


def test_an_error_kept_as_a_value_leaves_the_error_being_handled_alone():
    from stoker.errors import as_value

    def lookup():
        try:
            {}["k"]
        except KeyError as exc:
            raise NotFound("no value at k") from exc

    try:
        raise RuntimeError("handled by a caller")
    except RuntimeError as outer:
        try:
            lookup()
        except NotFound as exc:
            kept = as_value(exc)
        assert outer.__traceback__ is not None  # (still the caller's, to re-raise whole)
    assert kept.__traceback__ is None and kept.__context__ is None
    assert isinstance(kept.__cause__, KeyError) and kept.__cause__.__traceback__ is None
