"""The GPU decode's compiled reads and blosc parser (csrc/staging.c through engine/gpu/native_reads.py).

``stage_read``: a table of reads (coalesced runs of a shard's inner chunks, whole chunk files) read into one
buffer on the call's threads, held to Python's reads of the same bytes; missing files, shards changed since
their index was read, files past their bound, FIFOs and reads outside the buffer each end in their status or a
``ValueError`` before any byte is read. ``blosc_streams``: the same Layout and the same refused chunks (with
the numpy parser's words) as ``frames.parse_blosc_batch``, on valid, damaged and random frames.

The fuzz tests write around guard bytes and ``.ci/asan`` runs this file against a build with AddressSanitizer,
where a read or write outside a buffer is a fault. ``STOKER_FUZZ_EXAMPLES=N`` runs N examples each from a
random seed (as tests/engine/test_native_fuzz.py).
"""

from __future__ import annotations

import os
import struct

import numcodecs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.engine.cpu import native
from stoker.engine.gpu import frames, native_reads
from stoker.storage.local import LocalStore, identity

from test_gpu_host import _frame, _mutate, damage, frame_specs

_LONG = os.environ.get("STOKER_FUZZ_EXAMPLES", "").strip()

pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.timeout(600 if _LONG else 120),
    pytest.mark.skipif(not native_reads.available(), reason="stoker._native is not built"),
]
GUARD = 64  # bytes either side of the staging a test hands in, which must stay as they were


def fuzz(examples: int):
    return settings(max_examples=int(_LONG) if _LONG else examples, derandomize=not _LONG, database=None,
                    deadline=None, print_blob=True, suppress_health_check=list(HealthCheck))


def _ident_row(path) -> list[int]:
    dev, ino, size, mtime, ctime = identity(os.stat(path))
    return [1, dev & (2**63 - 1) if dev < 2**63 else dev - 2**64, ino if ino < 2**63 else ino - 2**64, size, mtime,
            ctime]


def _guarded(n: int) -> tuple[np.ndarray, np.ndarray]:
    whole = np.full(n + 2 * GUARD, 0xA5, np.uint8)
    return whole, whole[GUARD:GUARD + n]


def _guards_intact(whole: np.ndarray) -> bool:
    return bool((whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all())


# ---------------------------------------------------------------------------------------------
# stage_read


def _read_counted(buf, paths, files, reads, whole_base, threads, *idents):
    """:func:`native_reads.read`, and the opens and reads the compiled call counted (its own return)."""
    counts = []
    real = native.stage_read

    def counted(*args, **kw):
        counts.append(real(*args, **kw))
        return counts[-1]

    native.stage_read = counted
    try:
        out = native_reads.read(buf, paths, files, reads, whole_base, threads, *idents)
    finally:
        native.stage_read = real
    return (out, *counts[0])

def test_runs_of_a_shard_and_whole_files_land_where_planned(tmp_path):
    shard = tmp_path / "shard"
    shard.write_bytes(bytes(range(256)) * 8)
    (tmp_path / "a").write_bytes(b"A" * 10)
    (tmp_path / "b").write_bytes(b"BB" * 7)
    paths = [str(shard), str(tmp_path / "a"), str(tmp_path / "missing"), str(tmp_path / "b")]
    files = np.array([_ident_row(shard), [0] * 6, [0] * 6, [0] * 6], np.int64)
    # two runs of the shard, then three whole files (one missing) placed end to end from 40
    reads = np.array([[0, 3, 5, 0], [0, 1000, 20, 5], [1, -1, 100, 0], [2, -1, 100, 0], [3, -1, 100, 0]])
    whole, buf = _guarded(80)
    out, opens, preads = _read_counted(buf, paths, files, reads, 40, 3)
    assert out[:, native_reads.STATUS].tolist() == [0, 0, 0, native_reads.ST_MISSING, 0]
    assert out[:, native_reads.AT].tolist()[:3] == [0, 5, 40] and out[4, native_reads.AT] == 50
    assert out[:, native_reads.NREAD].tolist() == [5, 20, 10, 0, 14]
    data = shard.read_bytes()
    assert buf[:5].tobytes() == data[3:8] and buf[5:25].tobytes() == data[1000:1020]
    assert buf[40:50].tobytes() == b"A" * 10 and buf[50:64].tobytes() == b"BB" * 7
    assert (buf[25:40] == 0xA5).all() and (buf[64:] == 0xA5).all() and _guards_intact(whole)
    assert opens == 3 and preads == 4  # one open for the shard's two runs; the missing file is never opened


def test_a_shard_rewritten_since_its_index_was_read_is_changed_on_every_run(tmp_path):
    shard = tmp_path / "shard"
    shard.write_bytes(b"x" * 100)
    row = _ident_row(shard)
    shard.write_bytes(b"y" * 100)  # the same size, a later modification
    os.utime(shard, ns=(row[4] + 10**9, row[4] + 10**9))
    out = native_reads.read(bytearray(100), [str(shard)], np.array([row]), np.array([[0, 0, 10, 0],
                                                                                           [0, 50, 10, 10]]), 0, 2)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_CHANGED] * 2


def test_whole_files_past_their_bound_or_the_staging_are_too_big_and_unread(tmp_path):
    for name, n in (("a", 30), ("b", 10), ("c", 50)):
        (tmp_path / name).write_bytes(bytes([ord(name)]) * n)
    paths = [str(tmp_path / n) for n in "abc"]
    reads = np.array([[0, -1, 20, 0], [1, -1, 20, 0], [2, -1, 64, 0]])  # a: past its bound; c: past the staging
    whole, buf = _guarded(40)
    out = native_reads.read(buf, paths, np.zeros((3, 6), np.int64), reads, 0, 2)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_TOO_BIG, 0, native_reads.ST_TOO_BIG]
    assert out[:, native_reads.DETAIL].tolist() == [30, 10, 50]
    assert buf[:10].tobytes() == b"b" * 10 and (buf[10:] == 0xA5).all() and _guards_intact(whole)


def test_a_fifo_or_directory_is_not_regular_and_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    paths = [str(tmp_path / "fifo"), str(tmp_path / "dir")]
    reads = np.array([[0, -1, 10, 0], [1, -1, 10, 0], [0, 0, 4, 0]])  # and a ranged read of the FIFO
    out = native_reads.read(bytearray(16), paths, np.zeros((2, 6), np.int64), reads, 4, 2)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_NOT_REGULAR] * 3


def test_whole_files_hold_a_descriptor_per_thread_at_most(tmp_path):
    # a wave may name thousands of chunk files: each is opened, read and closed by one task, never held
    # between the two rounds (sizes by stat, then reads)
    import threading

    paths = []
    for k in range(600):
        (tmp_path / f"c{k}").write_bytes(bytes([k % 256]) * (k % 50 + 1))
        paths.append(str(tmp_path / f"c{k}"))
    base, peak, done = len(os.listdir("/proc/self/fd")), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")) - base)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(5):
            buf = bytearray(sum(k % 50 + 1 for k in range(600)))
            reads = np.array([[k, -1, 64, 0] for k in range(600)])
            out, opens, _ = _read_counted(buf, paths, np.zeros((600, 6), np.int64), reads, 0, 4)
            assert (out[:, native_reads.STATUS] == 0).all() and opens == 600
    finally:
        done.set()
        watcher.join(10.0)
    assert peak[0] <= 4 + 1, peak  # (the watcher's own listing takes one)
    assert buf == b"".join(bytes([k % 256]) * (k % 50 + 1) for k in range(600))


def test_a_plan_outside_the_staging_is_refused_before_any_read(tmp_path):
    (tmp_path / "f").write_bytes(b"z" * 100)
    buf = bytearray(16)
    for reads in ([[0, 0, 17, 0]], [[0, 0, 8, 9]], [[0, 0, 4, -1]], [[1, 0, 4, 0]], [[0, -2, 4, 0]],
                  [[0, 2**63 - 2, 4, 0]]):
        with pytest.raises(ValueError):
            native_reads.read(buf, [str(tmp_path / "f")], np.zeros((1, 6), np.int64), np.array(reads), 0, 1)
    with pytest.raises(ValueError):  # whole files placed from past the end
        native_reads.read(buf, [str(tmp_path / "f")], np.zeros((1, 6), np.int64), np.array([[0, -1, 4, 0]]), 17, 1)
    assert buf == bytearray(16)


def test_tables_the_call_writes_into_are_read_as_they_were_checked(tmp_path):
    """``out`` overlapping ``reads`` (a view of the same memory, two values on): the call read the status rows it
    wrote back as reads, file -1 among them (a path and an identity row before the tables' start: out of bounds).
    The call reads its own copies of the tables, as checked, and writes ``out`` once its reads are done."""
    data = bytes(range(40))
    (tmp_path / "f").write_bytes(data)
    whole, buf = _guarded(24)
    backing = np.zeros(16, np.int64)
    reads, out = backing[:12].reshape(3, 4), backing[2:14].reshape(3, 4)
    reads[:] = [[0, 0, 8, 0], [0, 10, 8, 8], [0, 20, 4, 16]]
    native.stage_read(buf, [str(tmp_path / "f")], np.zeros((1, 6), np.int64), reads, out, 24, 1)
    assert out.tolist() == [[0, 0, 0, 8], [0, 0, 8, 8], [0, 0, 16, 4]]  # (status OK, detail, at, bytes read)
    assert buf[:20].tobytes() == data[:8] + data[10:18] + data[20:24] and (buf[20:] == 0xA5).all()
    assert _guards_intact(whole)


def test_an_entry_s_ident_is_read_as_it_was_checked_whatever_the_call_writes(tmp_path):
    """``out`` over ``idents``: the first entry's stat wrote its payload's size (8000) where the second's ident
    length was, past the 4 KiB an ident may take, and the second entry's header and ident were read into a
    stack buffer of that room (4 KiB and 24 bytes) 8024 bytes long: a stack overflow of the file's bytes. The
    idents are the call's own copy, as checked: the first entry is sound, the second is too long for its bound."""
    payload = bytes(range(256)) * 31 + bytes(64)  # 8000 bytes
    head = b"STKC1\n\0\0" + struct.pack("<IIQ", native.crc32c(b"abcd" + payload), 4, len(payload))
    (tmp_path / "e0").write_bytes(head + b"abcd" + payload)
    (tmp_path / "e1").write_bytes(b"\x22" * (24 + 8000 + 10))
    whole, buf = _guarded(8010)
    backing = np.zeros(10, np.int64)
    idents, out = backing[:4].reshape(2, 2), backing[2:10].reshape(2, 4)
    idents[:] = [[0, 4], [4, 4]]
    reads = np.array([[0, -2, 8000, 0], [1, -2, 10, 0]], np.int64)
    native.stage_read(buf, [str(tmp_path / "e0"), str(tmp_path / "e1")], np.zeros((2, 6), np.int64), reads, out,
                      0, 1, b"abcdefgh", idents)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_OK, native_reads.ST_ENTRY]
    assert buf[:8000].tobytes() == payload and (buf[8000:] == 0xA5).all() and _guards_intact(whole)


@fuzz(60)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=4), st.lists(
    st.tuples(st.integers(0, 4), st.integers(-1, 3500), st.integers(0, 600)), min_size=0, max_size=24),
    st.integers(0, 2000), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_fuzz_reads_are_python_s_reads_and_never_leave_the_staging(tmp_path_factory, sizes, specs, room, threads,
                                                                  seed):
    """Random files and reads (past the end, empty, whole files larger than their bound, missing files, files
    named twice): every byte the call says it read is the file's, nothing is written outside the reads'
    places, and no status is left unset."""
    root = tmp_path_factory.mktemp("reads")
    rng = np.random.default_rng(seed)
    paths = []
    for k, n in enumerate(sizes):
        path = root / f"f{k}"
        path.write_bytes(rng.integers(0, 256, n, np.uint8).tobytes())
        paths.append(str(path))
    paths.append(str(root / "missing"))
    files = np.array([_ident_row(p) for p in paths[:-1]] + [[0] * 6], np.int64)
    ranged, whole_reads, at = [], [], 0
    for f, offset, length in specs:
        f = f % len(paths)
        if offset < 0:
            whole_reads.append([f, -1, length, 0])
        elif at + length <= room:
            ranged.append([f, offset, length, at])
            at += length
    reads = np.array(sorted(ranged, key=lambda r: r[0]) + whole_reads, np.int64).reshape(-1, 4)
    whole, buf = _guarded(room)
    pooled = native_reads.Readers(threads) if seed % 2 else None  # the persistent readers, or the call's own
    try:
        out = native_reads.read(buf, paths, files, reads, at, pooled or threads)
    finally:
        assert pooled is None or pooled.close(10.0)
    store = LocalStore()
    written = np.zeros(room, bool)
    for row, (st_, detail, where, got) in zip(reads.tolist(), out.tolist()):
        f, offset, length, _ = row
        data = store.read(paths[f])
        if data is None:
            assert st_ == native_reads.ST_MISSING and got == 0
            continue
        if offset < 0:
            if len(data) > length or st_ == native_reads.ST_TOO_BIG:
                assert st_ == native_reads.ST_TOO_BIG and detail == len(data) and got == 0
                continue
            want = data
        else:
            want = data[offset:offset + length]
        assert st_ in (native_reads.ST_OK, native_reads.ST_SHORT), (row, st_)
        assert got == len(want) and buf[where:where + got].tobytes() == want
        assert (st_ == native_reads.ST_OK) == (got == (length if offset >= 0 else len(data)))
        written[where:where + got] = True
    assert (buf[~written] == 0xA5).all() and _guards_intact(whole)


# ---------------------------------------------------------------------------------------------
# disk-cache entries (offset ENTRY): payloads read into the staging, checked as csrc/entries.c checks them


def _cache_entries(root, payloads: list[bytes]):
    """Entries written by the disk cache itself (storage/diskcache.py): their (path, ident) as entry_file gives."""
    from stoker.storage.diskcache import DiskCache

    cache = DiskCache(str(root / "cache"), 64 << 20)
    made = []
    for k, data in enumerate(payloads):
        ident = f"s3://bucket/a.zarr\nc/{k}/0\n{len(data)}"
        assert cache.write(ident, data)
        made.append(cache.entry_file(ident))
    return made


def _read_entries(buf, made, bounds, whole_base, threads, ident_of=None):
    """The entries ``made`` read with one row each (offset ENTRY, their payload's bound)."""
    idents = [ident_of(k, e[1]) if ident_of else e[1] for k, e in enumerate(made)]
    lens = np.array([len(i) for i in idents], np.int64)
    table = np.array([[k, native_reads.ENTRY, b, 0] for k, b in enumerate(bounds)], np.int64).reshape(-1, 4)
    return native_reads.read(buf, b"".join(e[0] + b"\0" for e in made), np.zeros((len(made), 6), np.int64), table,
                             whole_base, threads, (b"".join(idents), np.stack([np.cumsum(lens) - lens, lens], 1)))


def test_entries_payloads_land_end_to_end_checked_and_touched(tmp_path):
    rng = np.random.default_rng(5)
    payloads = [rng.integers(0, 256, n, np.uint8).tobytes() for n in (1000, 0, 70000, 333)]
    made = _cache_entries(tmp_path, payloads)
    for path, _ in made:
        os.utime(path, ns=(10**18, 10**18))  # (2001): the read's touch moves it to now
    whole, buf = _guarded(100 + sum(map(len, payloads)))
    out = _read_entries(buf, made, [len(p) for p in payloads], 100, 3)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_OK] * 4
    assert out[:, native_reads.DETAIL].tolist() == out[:, native_reads.NREAD].tolist() == list(map(len, payloads))
    at = out[:, native_reads.AT].tolist()
    assert at == (100 + np.cumsum([0] + list(map(len, payloads)))[:-1]).tolist()
    assert all(buf[a:a + len(p)].tobytes() == p for a, p in zip(at, payloads))
    assert (buf[:100] == 0xA5).all() and _guards_intact(whole)
    assert all(os.stat(path).st_mtime_ns > 10**18 for path, _ in made)


def test_an_entry_used_within_the_minute_is_not_touched_again(tmp_path):
    """The LRU clock as the CPU engine keeps it (csrc/entries.c's entry_read, which both paths call): a hit on
    an entry last used or written less than a minute ago writes nothing (relatime), one used a minute ago or
    more is touched. The staging touched every hit: a futimens per entry of every wave."""
    import time

    made = _cache_entries(tmp_path, [b"r" * 100, b"s" * 100])
    recent, old = time.time_ns() - 30 * 10**9, time.time_ns() - 61 * 10**9
    for (path, _), when in zip(made, (recent, old)):
        os.utime(path, ns=(when, when))
    out = _read_entries(bytearray(200), made, [100, 100], 0, 1)
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_OK] * 2
    assert os.stat(made[0][0]).st_mtime_ns == recent  # used within the minute: as it was
    assert os.stat(made[1][0]).st_mtime_ns > old + 60 * 10**9  # a minute or more: now


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow", "other-ident", "unlink", "symlink", "fifo",
                                    "past-bound"])
def test_an_unsound_entry_is_st_entry_and_never_written_past_its_room(tmp_path, damage):
    """Each damage ends in ST_ENTRY with its detail; the sound entries beside it are read; nothing lands outside
    the rooms placed (one placed and then found unsound keeps its room, its bytes not the payload's)."""
    from stoker.engine.cpu import interface as names

    payloads = [b"a" * 500, b"b" * 800, b"c" * 300]
    made = _cache_entries(tmp_path, payloads)
    victim = made[1][0]
    bounds = [1000] * 3
    ident_of = None
    if damage in ("flip", "truncate", "grow"):
        with open(victim, "r+b") as f:
            if damage == "flip":
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            elif damage == "truncate":
                f.truncate(os.path.getsize(victim) - 3)
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"more")
    elif damage == "other-ident":
        ident_of = lambda k, i: i + b"x" if k == 1 else i  # noqa: E731 - one byte longer: the header's differs
    elif damage == "unlink":
        os.unlink(victim)
    elif damage == "symlink":
        os.rename(victim, victim + b".real")
        os.symlink(victim + b".real", victim)
    elif damage == "fifo":
        os.unlink(victim)
        os.mkfifo(victim)
    elif damage == "past-bound":
        bounds[1] = 799
    whole, buf = _guarded(sum(bounds) + 64)
    out = _read_entries(buf, made, bounds, 0, 2, ident_of)
    status, detail = out[:, native_reads.STATUS].tolist(), out[:, native_reads.DETAIL].tolist()
    want = {"flip": names.ENTRY_CHECKSUM, "truncate": names.ENTRY_LAYOUT, "grow": names.ENTRY_LAYOUT,
            "other-ident": names.ENTRY_LAYOUT, "unlink": names.ENTRY_GONE, "symlink": names.ENTRY_UNREADABLE,
            "fifo": names.ENTRY_UNREADABLE, "past-bound": names.ENTRY_SIZE}[damage]
    assert status[1] == native_reads.ST_ENTRY and detail[1] == want, (status, detail)
    assert status[0] == status[2] == native_reads.ST_OK
    at = out[:, native_reads.AT]
    assert buf[at[0]:at[0] + 500].tobytes() == payloads[0] and buf[at[2]:at[2] + 300].tobytes() == payloads[2]
    end = int(max(a + n for a, n in zip(at.tolist(), [500, 800, 300]) if a >= 0))
    assert (buf[end:] == 0xA5).all() and _guards_intact(whole)


def test_an_entry_of_the_right_size_but_another_ident_is_refused(tmp_path):
    made = _cache_entries(tmp_path, [b"q" * 64, b"r" * 64])
    swapped = [made[0], (made[1][0], made[0][1][:-1] + b"9")]  # same length, another ident
    out = _read_entries(bytearray(128), swapped, [64, 64], 0, 1)
    from stoker.engine.cpu import interface as names

    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_OK, native_reads.ST_ENTRY]
    assert out[1, native_reads.DETAIL] == names.ENTRY_OTHER_IDENT


def test_entry_reads_without_their_idents_are_refused_before_any_read(tmp_path):
    made = _cache_entries(tmp_path, [b"z" * 10])
    buf = bytearray(16)
    table = np.array([[0, native_reads.ENTRY, 10, 0]], np.int64)
    with pytest.raises(ValueError):
        native_reads.read(buf, [os.fsdecode(made[0][0])], np.zeros((1, 6), np.int64), table, 0, 1)
    for rows in ([[0, 999]], [[-1, 5]], [[3, 8]], [[0, 5000]]):
        with pytest.raises(ValueError):
            native_reads.read(buf, [os.fsdecode(made[0][0])], np.zeros((1, 6), np.int64), table, 0, 1,
                              (b"abcdefgh", np.array(rows, np.int64)))
    with pytest.raises(ValueError):  # an offset below ENTRY
        native_reads.read(buf, [os.fsdecode(made[0][0])], np.zeros((1, 6), np.int64),
                          np.array([[0, -3, 10, 0]], np.int64), 0, 1)
    assert buf == bytearray(16)


@fuzz(40)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(["ok", "flip", "cut", "pad", "gone", "bound"])),
                min_size=1, max_size=12), st.integers(0, 30000), st.integers(1, 4), st.booleans())
def test_fuzz_entries_read_only_sound_payloads_within_their_rooms(tmp_path_factory, specs, room, threads, pooled):
    """Random entries, sound or damaged, bounds and staging sizes: an OK row's bytes are its payload, every
    damaged one read is ST_ENTRY (ST_TOO_BIG past the staging: unread), nothing lands outside the rooms placed."""
    root = tmp_path_factory.mktemp("entries")
    rng = np.random.default_rng(len(specs) * 7919 + room)
    payloads = [rng.integers(0, 256, n, np.uint8).tobytes() for n, _ in specs]
    made = _cache_entries(root, payloads)
    bounds = []
    for (path, _), (n, how), data in zip(made, specs, payloads):
        bounds.append(max(0, n - 1) if how == "bound" else n + 16)
        if how == "gone":
            os.unlink(path)
        elif how in ("flip", "cut", "pad") and (n or how != "flip"):
            with open(path, "r+b") as f:
                if how == "flip":
                    f.seek(-1 - int(rng.integers(0, n)), os.SEEK_END)
                    b = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([b[0] ^ 0x80]))
                elif how == "cut":
                    f.truncate(max(0, os.path.getsize(path) - 1 - int(rng.integers(0, n + 30))))
                else:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\0" * int(rng.integers(1, 20)))
    whole, buf = _guarded(room)
    readers = native_reads.Readers(threads) if pooled else None
    try:
        out = _read_entries(buf, made, bounds, 0, readers or threads)
    finally:
        assert readers is None or readers.close(10.0)
    written = np.zeros(room, bool)
    for (n, how), data, (status, detail, at, got), bound in zip(specs, payloads, out.tolist(), bounds):
        sound = how == "ok" or (how == "flip" and n == 0) or (how == "bound" and n == 0)
        if status == native_reads.ST_OK:
            assert sound and got == n and buf[at:at + n].tobytes() == data
            written[at:at + n] = True
        elif status == native_reads.ST_TOO_BIG:  # past the staging: unread (sound or not, unknown)
            assert at == -1 and got == 0
        else:
            assert status == native_reads.ST_ENTRY and got == 0, (how, status, detail)
            if at >= 0:  # placed, then found unsound: only its room (at most its bound) may hold bytes
                written[at:at + bound] = True
    assert (buf[~written] == 0xA5).all() and _guards_intact(whole)


# ---------------------------------------------------------------------------------------------
# persistent readers (native_reads.Readers: csrc/staging.c's stage_pool)


def _files(root, n: int, size=lambda k: 3000 + 17 * k) -> tuple[list[str], np.ndarray, list[bytes]]:
    rng = np.random.default_rng(n)
    paths, datas = [], []
    for k in range(n):
        datas.append(rng.integers(0, 256, size(k), np.uint8).tobytes())
        (root / f"f{k}").write_bytes(datas[-1])
        paths.append(str(root / f"f{k}"))
    return paths, np.array([_ident_row(p) for p in paths], np.int64), datas


def _wave(paths, files, datas, threads):
    """Each file's second half as a ranged read, then each file whole: the bytes staged, the out table."""
    halves = [len(d) // 2 for d in datas]
    at = np.cumsum([0] + [len(d) - h for d, h in zip(datas, halves)])
    reads = [[k, h, len(d) - h, int(at[k])] for k, (d, h) in enumerate(zip(datas, halves))]
    reads += [[k, -1, len(d), 0] for k, d in enumerate(datas)]
    buf = bytearray(int(at[-1]) + sum(map(len, datas)))
    out = native_reads.read(buf, paths, files, np.array(reads, np.int64), int(at[-1]), threads)
    return bytes(buf), out


def test_persistent_readers_start_their_threads_once_for_many_calls(tmp_path):
    """A wave read on :class:`Readers` starts no thread per call: 3 helpers for 40 calls (the threads of the
    call's own: one round of 3 per round, 80 rounds), and every call stages the bytes Python reads, bit for bit."""
    paths, files, datas = _files(tmp_path, 12)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    before = native_reads.threads_started()
    for _ in range(40):
        got, out = _wave(paths, files, datas, 4)
        assert got == want and (out[:, native_reads.STATUS] == native_reads.ST_OK).all()
    per_call = native_reads.threads_started() - before
    readers = native_reads.Readers(4)
    try:
        before = native_reads.threads_started()
        assert readers.info() == (3, 0, 0, False)  # none before the first read
        for _ in range(40):
            got, out = _wave(paths, files, datas, readers)
            assert got == want and (out[:, native_reads.STATUS] == native_reads.ST_OK).all()
        assert native_reads.threads_started() - before == 3 and readers.info() == (3, 3, 3, False)
    finally:
        assert readers.close(5.0)
    assert per_call == 40 * 2 * 3  # (each call: the stat round and the read round, 3 threads each)
    assert readers.info() == (3, 3, 0, True)


@pytest.mark.parametrize("threads", ["readers", 3])
def test_readers_cancelled_read_nothing_and_say_so(tmp_path, threads):
    """A round on cancelled readers (their pipeline closing) reads no byte: every read, ranged, whole or a
    disk-cache entry's, is ST_CANCELLED (not run: at -1, nothing read), the staging and its guards untouched,
    no file opened. A set flag handed to a call on threads of its own does the same. (A round cancelled
    while it reads: tests/gpu/test_gpu_cancel.py.)"""
    paths, files, datas = _files(tmp_path, 6)
    reads = np.array([[0, 10, 100, 0], [0, 500, 100, 100], [1, -1, len(datas[1]), 0], [2, -1, len(datas[2]), 0],
                      [3, native_reads.ENTRY, 4000, 0]], np.int64)
    whole, buf = _guarded(40000)
    idents = (b"x", np.array([[0, 1]] * len(reads), np.int64))
    if threads == "readers":
        readers = native_reads.Readers(4)
        readers.cancel()
        try:
            out, *counted = _read_counted(buf, paths, files, reads, 300, readers, idents)
        finally:
            assert readers.close(5.0)
    else:
        flag = native.stage_cancel_flag()
        native.stage_cancel(flag)
        out = np.zeros((len(reads), 4), np.int64)
        counted = list(native.stage_read(buf, paths, files, reads, out, 300, threads, *idents, cancel=flag))
    assert out[:, native_reads.STATUS].tolist() == [native_reads.ST_CANCELLED] * len(reads)
    assert (out[:, native_reads.AT] == -1).all() and (out[:, native_reads.NREAD] == 0).all()
    assert native_reads.cancelled(out) and counted == [0, 0]  # (opens, preads)
    assert (whole == 0xA5).all()


def test_a_wave_of_one_task_wakes_no_helper(tmp_path):
    paths, files, datas = _files(tmp_path, 1)
    readers = native_reads.Readers(4)
    try:
        out = native_reads.read(bytearray(len(datas[0])), paths, files, np.array([[0, 0, len(datas[0]), 0]]), 0,
                                readers)
        assert out[0, native_reads.STATUS] == native_reads.ST_OK and readers.info()[1] == 0
    finally:
        assert readers.close(5.0)


def test_close_stops_the_helpers_promptly_even_beside_a_reading_thread(tmp_path):
    """close() while another thread reads on the same readers: the helpers end within the timeout (each after
    the file it holds), every read still stages the right bytes (the caller takes what they leave), and reads
    after close run on the caller's thread, starting no thread."""
    import threading
    import time

    paths, files, datas = _files(tmp_path, 64, lambda k: 20000 + k)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(4)
    _wave(paths, files, datas, readers)
    bad, stop = [], threading.Event()

    def reading():
        while not stop.is_set():
            got, out = _wave(paths, files, datas, readers)
            if got != want or (out[:, native_reads.STATUS] != native_reads.ST_OK).any():
                bad.append(out)

    thread = threading.Thread(target=reading)
    thread.start()
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert readers.close(5.0)
        took = time.monotonic() - t0
        assert readers.info()[2] == 0
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30.0)
    assert not thread.is_alive() and not bad and took < 2.0, took
    before = native_reads.threads_started()
    assert _wave(paths, files, datas, readers)[0] == want and native_reads.threads_started() == before


def test_two_threads_on_one_pool_each_read_their_own_wave(tmp_path):
    """A pool serves one round at a time: a second caller reads alone meanwhile; both right, bit for bit."""
    import threading

    paths, files, datas = _files(tmp_path, 24)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(3)
    bad = []

    def reading():
        for _ in range(30):
            if _wave(paths, files, datas, readers)[0] != want:
                bad.append(1)

    threads = [threading.Thread(target=reading) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    try:
        assert not any(t.is_alive() for t in threads) and not bad
        assert readers.info()[:3] == (2, 2, 2)
    finally:
        assert readers.close(5.0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names and signal masks from /proc")
def test_reader_threads_block_signals(tmp_path):
    """A signal for the process (Ctrl-C, a launcher's SIGTERM) is never delivered to a pooled reader thread,
    where it would cut a read short: they block every signal, started by csrc/threads.c's thread_start as the
    engine's workers are; the caller's mask is as it was."""
    import time

    from thread_signals import assert_block_process_signals

    def named(tid):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:  # a thread that ended meanwhile
            return ""

    def helpers():  # by the name staging.c gives them: other libraries start threads of their own meanwhile
        return {tid for tid in os.listdir("/proc/self/task") if named(tid) == "stoker-stage"}

    paths, files, datas = _files(tmp_path, 12)
    before = helpers()
    readers = native_reads.Readers(4)
    try:
        _wave(paths, files, datas, readers)
        deadline = time.monotonic() + 10
        while len(new := helpers() - before) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # each names itself as it starts: one may not have run yet
        assert readers.info()[:3] == (3, 3, 3) and len(new) == 3, (readers.info(), new)
        assert_block_process_signals(new)
    finally:
        assert readers.close(5.0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_on_threads_of_its_own(tmp_path):
    """The parent's helpers do not exist in a forked child: there the readers start helpers of their own at the
    first read (and the child's bytes are right); the parent's pool goes on reading, its threads untouched."""
    import time

    paths, files, datas = _files(tmp_path, 12)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(4)
    try:
        assert _wave(paths, files, datas, readers)[0] == want and readers.info() == (3, 3, 3, False)
        pid = os.fork()
        if pid == 0:  # (the child: nothing raised out of here, its verdict is its exit status)
            code = 1
            try:
                fresh = readers.info() == (3, 0, 0, False)  # the parent's threads are not here
                before = native_reads.threads_started()
                right = all(_wave(paths, files, datas, readers)[0] == want for _ in range(5))
                started = native_reads.threads_started() - before == 3 and readers.info() == (3, 3, 3, False)
                code = 0 if fresh and right and started and readers.close(5.0) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, done
        assert _wave(paths, files, datas, readers)[0] == want and readers.info() == (3, 3, 3, False)
    finally:
        assert readers.close(5.0)


def _child_verdicts(forks: int, child, wait_s: float = 20.0) -> list[str]:
    """``forks`` children forked one after another, each running ``child()`` (True: sound) and exiting with its
    verdict; the parent waits ``wait_s`` at most for each (then kills it: "hung"). The verdicts, first bad on."""
    from forking import fork_child, verdict

    verdicts: list[str] = []
    for _ in range(forks):
        verdicts.append(verdict(fork_child(child), wait_s))
        if verdicts[-1] != "exit 0":
            break
    return verdicts


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_readers_lock_is_not_stuck(tmp_path):
    """A thread of the parent inside :meth:`Readers.handle` (its lock held) at the fork: the child's readers
    still hand out a pool of their own, read the right bytes, report and close at once (the lock is made anew
    in the child: the held one never comes free there; the atexit hook's close is the same call)."""
    import sys
    import threading

    paths, files, datas = _files(tmp_path, 12)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(4)
    stop = threading.Event()

    def spin():  # the lock held most of the time, the GIL switched as often as it can be
        while not stop.is_set():
            readers.handle()

    def child() -> bool:
        fresh = readers.info() == (3, 0, 0, False)
        right = _wave(paths, files, datas, readers)[0] == want and readers.info()[:3] == (3, 3, 3)
        return fresh and right and readers.close(5.0)

    switch = sys.getswitchinterval()
    thread = threading.Thread(target=spin, daemon=True)
    try:
        readers.handle()
        sys.setswitchinterval(1e-6)
        thread.start()
        verdicts = _child_verdicts(20, child, wait_s=5.0)  # (a stuck child waits LOCK_WAIT_S > 5 s, or for ever)
    finally:
        stop.set()
        sys.setswitchinterval(switch)
        thread.join(10.0)
        assert readers.close(5.0)
    assert verdicts == ["exit 0"] * 20, verdicts


def test_a_readers_lock_that_never_comes_free_is_waited_for_a_bounded_time(tmp_path, monkeypatch):
    """A lock held for ever (as a ``fork()`` of a C library, which runs no Python fork handler, leaves one held
    by a thread of the parent): each call waits :data:`LOCK_WAIT_S` at most, then reads on the caller's thread
    alone (the right bytes), reports and closes without it."""
    import threading
    import time

    monkeypatch.setattr(native_reads, "LOCK_WAIT_S", 0.2)
    paths, files, datas = _files(tmp_path, 12)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(4)
    assert _wave(paths, files, datas, readers)[0] == want and readers.info() == (3, 3, 3, False)
    held, release = threading.Event(), threading.Event()

    def holder():
        with readers._lock:
            held.set()
            release.wait(30.0)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10.0)
        t0 = time.monotonic()
        assert readers.handle() == 1 and _wave(paths, files, datas, readers)[0] == want
        assert readers.info() == (3, 3, 3, False) and readers.close(5.0) and readers.info()[2:] == (0, True)
        took = time.monotonic() - t0
    finally:
        release.set()
        thread.join(10.0)
    assert 0.2 * 5 <= took < 5.0, took  # five waits of LOCK_WAIT_S: handle twice, info twice, close


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_reading_on_the_parent_s_pool_reads_alone_and_never_waits_for_its_threads(tmp_path):
    """The parent's pool itself used in a forked child (``csrc/staging.c``'s ``pool_foreign``, by the fork
    generation its ``pthread_atfork`` handler bumps) while a thread of the parent reads on it: its helpers and
    its lock's holder are not in the child, so there the caller reads alone (never publishing a round no helper
    takes, nor taking the lock), info says no helper is alive and close returns at once."""
    import threading
    import time

    paths, files, datas = _files(tmp_path, 32, lambda k: 20000 + k)
    want = b"".join(d[len(d) // 2:] for d in datas) + b"".join(datas)
    readers = native_reads.Readers(4)
    assert _wave(paths, files, datas, readers)[0] == want
    parent_pool = readers.handle()
    stop, bad = threading.Event(), []

    def reading():  # the parent's pool in a round (its lock taken, its helpers busy) most of the time
        while not stop.is_set():
            if _wave(paths, files, datas, readers)[0] != want:
                bad.append(1)

    def child() -> bool:
        before = native_reads.threads_started()
        halves = [len(d) // 2 for d in datas]
        at = np.cumsum([0] + [len(d) - h for d, h in zip(datas, halves)])
        reads = [[k, h, len(d) - h, int(at[k])] for k, (d, h) in enumerate(zip(datas, halves))]
        reads = np.array(reads + [[k, -1, len(d), 0] for k, d in enumerate(datas)], np.int64)
        buf, out = bytearray(int(at[-1]) + sum(map(len, datas))), np.zeros((len(reads), 4), np.int64)
        native.stage_read(buf, paths, files, reads, out, int(at[-1]), parent_pool)
        right = bytes(buf) == want and (out[:, native_reads.STATUS] == native_reads.ST_OK).all()
        alone = native_reads.threads_started() == before  # (no helper started for the parent's pool here)
        t0 = time.monotonic()
        info = native.stage_pool_info(parent_pool)
        closed = native.stage_pool_close(parent_pool, 5.0)
        return bool(right and alone and tuple(info)[2:] == (0, 1) and closed and time.monotonic() - t0 < 0.5)

    thread = threading.Thread(target=reading)
    thread.start()
    try:
        time.sleep(0.1)
        verdicts = _child_verdicts(10, child, wait_s=10.0)
    finally:
        stop.set()
        thread.join(30.0)
    try:
        assert not thread.is_alive() and not bad and verdicts == ["exit 0"] * 10, verdicts
        assert _wave(paths, files, datas, readers)[0] == want and readers.info() == (3, 3, 3, False)
    finally:
        assert readers.close(5.0)


def test_readers_left_open_end_with_the_interpreter(tmp_path):
    """Readers never closed (helpers waiting for work) are closed by an atexit hook at interpreter exit, their
    helpers ended within it, promptly."""
    import subprocess
    import sys

    paths, _, _ = _files(tmp_path, 6)
    code = (
        "import atexit, time, numpy as np, sys\n"
        "mark = []\n"  # (hooks run last registered first: this one after the readers' hook, the next before)
        "atexit.register(lambda: print('alive', r.info()[2], 'took', time.monotonic() - mark[0], flush=True))\n"
        "from stoker.engine.gpu import native_reads as nr\n"
        "atexit.register(lambda: mark.append(time.monotonic()))\n"
        "paths = sys.argv[1:]\n"
        "r = nr.Readers(4)\n"
        "out = nr.read(bytearray(1 << 16), paths, np.zeros((len(paths), 6), np.int64),\n"
        "              np.array([[k, -1, 8192, 0] for k in range(len(paths))]), 0, r)\n"
        "assert (out[:, 0] == 0).all() and r.info()[2] == 3, (out, r.info())\n"
    )
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["alive", "0"] and float(words[3]) < 2.0, done.stdout


# ---------------------------------------------------------------------------------------------
# blosc_streams: the numpy parser's Layout, from C

def _same_layout(a: frames.Layout, b: frames.Layout) -> None:
    for name in frames.Layout.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype.kind == y.dtype.kind and np.array_equal(x, y), name
        else:
            assert x == y, name


@fuzz(80)
@given(st.lists(st.tuples(frame_specs, damage), min_size=1, max_size=6), st.integers(0, 2**16), st.booleans())
def test_fuzz_the_compiled_parser_gives_the_numpy_parser_s_layout(chunks, seed, scattered):
    """Valid and damaged frames (bit flips, header and table edits, truncation, extension) staged with gaps:
    the same streams, blocks and refused chunks with the same words; the guard bytes around the staging hold."""
    made = []
    for spec, (edits, how, cut) in chunks:
        spec = {**spec, "size": "tiny" if spec["size"] == "tiny" else "small"}
        frame, nbytes = _frame(spec)
        made.append((_mutate(frame, edits, how, cut), nbytes))
    rng = np.random.default_rng(seed)
    sizes = np.array([len(f) for f, _ in made])
    ins = np.cumsum(sizes + rng.integers(0, 9, len(made))) - sizes
    whole, buf = _guarded(int(ins[-1] + sizes[-1]))
    for (frame, _), at in zip(made, ins):
        buf[at:at + len(frame)] = np.frombuffer(frame, np.uint8)
    nbytes = np.array([n for _, n in made])
    outs = None
    if scattered:  # outputs in another order, with gaps
        order = rng.permutation(len(made))
        outs = np.zeros(len(made), np.int64)
        outs[order] = np.cumsum(nbytes[order] + 64) - nbytes[order]
    want, want_why = frames.parse_blosc_batch(buf, ins, sizes, nbytes, outs)
    got, got_why = native_reads.parse_blosc_batch(buf, ins, sizes, nbytes, outs)
    _same_layout(got, want)
    assert got_why == want_why
    assert _guards_intact(whole)


@fuzz(300)
@given(st.binary(min_size=0, max_size=400), st.integers(0, 1 << 20), st.integers(0, 2**32 - 1))
def test_fuzz_random_bytes_and_hostile_headers(data, nbytes, seed):
    """Random bytes, and a valid header over random bytes (a block table and stream sizes pointing anywhere):
    refused or parsed as numpy parses them, never a read past the frame."""
    rng = np.random.default_rng(seed)
    head = np.array([2, 1, rng.integers(0, 256), rng.integers(1, 20)], np.uint8).tobytes()
    blocksize = int(rng.integers(1, max(2, nbytes + 1)))
    forged = head + np.array([nbytes, blocksize, 16 + len(data)], "<i4").tobytes() + data
    for frame in (data, forged):
        whole, buf = _guarded(len(frame))
        buf[:] = np.frombuffer(frame, np.uint8)
        want, want_why = frames.parse_blosc_batch(buf, [0], [len(frame)], [nbytes])
        got, got_why = native_reads.parse_blosc_batch(buf, [0], [len(frame)], [nbytes])
        _same_layout(got, want)
        assert got_why == want_why and _guards_intact(whole)
        # the frame alone in an allocation of its size: under .ci/asan a read past its end is a fault
        exact = np.frombuffer(frame, np.uint8).copy()
        got, got_why = native_reads.parse_blosc_batch(exact, [0], [len(frame)], [nbytes])
        _same_layout(got, want)


@pytest.mark.parametrize("tail", [0, 1, 2, 3])
def test_a_stream_size_field_cut_by_the_frame_s_end_is_refused_unread(tail):
    """A split block (2 streams) whose second stream's size field would start ``tail`` bytes before the end:
    refused without reading past the frame, which sits alone in an allocation of its size (under
    .ci/asan, a read of the missing bytes is a fault)."""
    header = bytes([2, 1, 0x21, 2]) + np.array([256, 256, 0], "<i4").tobytes()  # lz4, byte shuffle, typesize 2
    body = np.array([20, 10], "<i4").tobytes() + bytes(range(10)) + bytes(tail)  # block 0 at 20; stream 0: 10 B
    frame = bytearray(header + body)
    frame[12:16] = np.array([len(frame)], "<i4").tobytes()
    exact = np.frombuffer(bytes(frame), np.uint8).copy()
    want, want_why = frames.parse_blosc_batch(exact, [0], [len(frame)], [256])
    got, got_why = native_reads.parse_blosc_batch(exact, [0], [len(frame)], [256])
    assert list(got_why) == [0] and got_why == want_why and "stream 1's size field" in got_why[0]
    _same_layout(got, want)


def test_a_chunk_outside_the_input_is_a_value_error():
    buf = np.zeros(32, np.uint8)
    for ins, sizes in (([0], [33]), ([-1], [4]), ([30], [4])):
        with pytest.raises(ValueError):
            native_reads.parse_blosc_batch(buf, ins, sizes, [16])


def test_a_chunk_whose_output_ends_past_int64_is_a_value_error():
    """A chunk's output at 2**63 - 1: each block's destination (out + block * blocksize) overflowed int64 (UBSan:
    signed integer overflow) and came back negative. Refused before any frame is parsed; one that ends at
    2**63 - 1 exactly is parsed."""
    data = (np.arange(1 << 17, dtype=np.int32) % 7).tobytes()  # several blocks
    frame = np.frombuffer(numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1).encode(data), np.uint8).copy()
    fault = np.zeros(1, np.int64)
    for out in (2**63 - 1, 2**63 - len(data)):
        with pytest.raises(ValueError, match="output"):
            native.blosc_streams(frame, np.array([[0, len(frame), len(data), out]], np.int64), fault)
    streams, _ = native.blosc_streams(frame, np.array([[0, len(frame), len(data), 2**63 - 1 - len(data)]],
                                                      np.int64), fault)
    dst = np.frombuffer(streams, np.int64).reshape(-1, 6)[:, 2]
    assert fault[0] == 0 and len(dst) > 1 and (dst >= 2**63 - 1 - len(data)).all()


BF_CHANGED = 17  # csrc/staging.h: a frame whose bytes changed between the count of its rows and their writing


def test_the_writing_pass_never_writes_past_the_rows_counted():
    """blosc_streams counts each frame's rows, then parses the same unlocked bytes again to write them: a frame
    rewritten in between may need more rows than were counted. The writing pass (blosc_rows, here alone with
    rooms of exactly the given rows: under .ci/asan a row past them is a fault) stops at the room, faults that
    chunk BF_CHANGED and takes its rows back; the chunks before it keep theirs."""
    import numcodecs
    from native_testing import module

    if module is None:
        pytest.skip("stoker._testing is not built")
    codec = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=1024)
    parts = [codec.encode(np.arange(i, i + 4096, dtype=np.int32)) for i in (0, 7)]
    data = np.frombuffer(b"".join(parts), np.uint8).copy()
    ins = [0, len(parts[0])]
    chunks = [(ins[c], len(parts[c]), 4 * 4096, 4 * 4096 * c) for c in (0, 1)]
    fault = np.zeros(2, np.int64)
    streams, blocks = native_reads.native.blosc_streams(data, np.array(chunks, np.int64), fault)
    ns, nb = len(streams) // 48, len(blocks) // 32
    assert fault.tolist() == [0, 0] and ns >= 2 and nb >= 2  # each chunk: several streams and shuffled blocks
    assert module.blosc_rows(data, chunks, ns, nb) == ((0, 0), streams, blocks)
    first_s = np.frombuffer(streams, np.int64).reshape(-1, 6)[:, 5] == 0
    first_b = np.frombuffer(blocks, np.int64).reshape(-1, 4)[:, 0] < 4 * 4096
    first = (streams[:48 * int(first_s.sum())], blocks[:32 * int(first_b.sum())])
    assert module.blosc_rows(data, chunks, ns - 1, nb) == ((0, BF_CHANGED), *first)
    assert module.blosc_rows(data, chunks, ns, nb - 1) == ((0, BF_CHANGED), *first)
    assert module.blosc_rows(data, chunks, 0, 0) == ((BF_CHANGED, BF_CHANGED), b"", b"")


def test_frames_rewritten_while_parsed_never_overflow_the_rows():
    """A thread flips every frame's flags between memcpyed (one stream) and compressed (256 streams, each valid)
    while blosc_streams parses them, its GIL released: each chunk comes back with the rows of one of the two
    readings, or faulted; never rows past those counted (under .ci/asan, a heap overflow)."""
    import struct
    import threading
    import time

    n, bs, cs = 4096, 16, 8
    starts = 16 + 4 * (n // bs) + np.arange(n // bs) * (4 + cs)
    frame = struct.pack("<BBBBiii", 2, 1, 0x02, 1, n, bs, n + 16) + starts.astype("<i4").tobytes()
    frame += (struct.pack("<I", cs) + bytes(cs)) * (n // bs)
    assert len(frame) == n + 16
    k = 200
    data = np.frombuffer(frame * k, np.uint8).copy()
    flags = np.arange(k) * len(frame) + 2
    chunks = np.stack([np.arange(k) * len(frame), np.full(k, len(frame)), np.full(k, n), np.arange(k) * n],
                      1).astype(np.int64)
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            data[flags] = 0x00
            data[flags] = 0x02

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            fault = np.zeros(k, np.int64)
            streams, _ = native_reads.native.blosc_streams(data, chunks, fault)
            per = np.bincount(np.frombuffer(streams, np.int64).reshape(-1, 6)[:, 5], minlength=k)
            assert len(per) == k
            assert set(per[fault == 0].tolist()) <= {1, n // bs} and not per[fault != 0].any()
            assert set(fault.tolist()) <= {0, BF_CHANGED}
    finally:
        stop.set()
        flipper.join(10)


# ---------------------------------------------------------------------------------------------
# chunk_paths


def test_chunk_paths_are_the_readers_paths_bit_for_bit(tmp_path):
    """The paths the compiled reads build for a plan's files (chunk files and shards) are the ones the reader
    names, for every key encoding zarr-python writes, coordinates of several digits and a folder name outside
    ASCII; a plan of zero-dimensional arrays keeps Python's (its one key has no coordinate)."""
    import zarr
    from zarr.codecs import ZstdCodec

    import stoker
    from stoker.engine.gpu.staging import path_prefixes
    from stoker.engine.planning.tables import F_COORDS, F_SOURCE, plan_tables

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    root = tmp_path / "dätä"
    shape, chunks = (24, 130, 5), (2, 10, 5)  # coordinates up to 12
    specs = {
        "v3.zarr": dict(zarr_format=3),
        "v3-dots.zarr": dict(zarr_format=3, chunk_key_encoding={"name": "v2", "separator": "."}),
        "v3-sharded.zarr": dict(zarr_format=3, shards=(4, 20, 5)),
        "v2.zarr": dict(zarr_format=2),
        "v2-nested.zarr": dict(zarr_format=2, chunk_key_encoding={"name": "v2", "separator": "/"}),
    }
    uris = []
    for name, kw in specs.items():
        z = zarr.create_array(str(root / name), shape=shape, chunks=chunks, dtype="uint16", compressors=ZstdCodec(level=1)
                              if kw["zarr_format"] == 3 else None, **kw)
        z[:] = 1
        uris.append(str(root / name))
    readers = {u: stoker.open_array(u) for u in uris}
    box = [(0, 24), (0, 130), (0, 5)]
    plan = plan_tables(0, [stoker.Sample(u, box) for u in uris], readers.__getitem__)
    names = plan.files[:, [F_SOURCE, *range(F_COORDS, plan.files.shape[1])]]
    got = native_reads.chunk_paths(*path_prefixes(plan), names).split(b"\0")
    assert got[-1] == b"" and len(got) == len(plan.files) + 1
    assert got[:-1] == [os.fsencode(plan.file_path(f)) for f in range(len(plan.files))]
    assert len({os.path.dirname(p) for p in got[:-1]}) > len(uris)  # nested keys among them
    zero = zarr.create_array(str(root / "zero.zarr"), shape=(), dtype="uint16", compressors=ZstdCodec(level=1))
    zero[()] = 5
    plan0 = plan_tables(0, [stoker.Sample(str(root / "zero.zarr"), [])], lambda u: stoker.open_array(u))
    assert path_prefixes(plan0) is None


def test_chunk_paths_refuse_rows_outside_their_tables():
    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    blob, prefixes = b"/a/", np.array([[0, 3, ord("/")]])
    assert native_reads.chunk_paths(blob, prefixes, np.zeros((0, 2), np.int64)) == b""
    for bad_prefixes, names in (([[0, 4, 47]], [[0, 1]]), ([[-1, 1, 47]], [[0, 1]]), ([[0, 3, 300]], [[0, 1]]),
                                ([[0, 3, 47]], [[1, 1]]), ([[0, 3, 47]], [[0, -1]])):
        with pytest.raises(ValueError, match="chunk_paths"):
            native_reads.chunk_paths(blob, np.array(bad_prefixes), np.array(names))
    with pytest.raises(ValueError, match="NUL-terminated"):  # fewer paths than files rows
        native_reads.read(bytearray(4), b"/a\0", np.zeros((2, 6), np.int64), np.array([[0, -1, 4, 0]]), 0, 1)
