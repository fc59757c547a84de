"""The engine checks a disk-cache entry's payload (crc32c) once a process: a later read of the same file,
unchanged (device, inode, size, mtime, ctime, the header's crc), skips it (csrc/entries.c), as a cached epoch
reads each entry many times. Against moto's S3 server and the loopback HTTP server: once the memo is used,
an entry damaged in place (a flipped payload bit, a cut tail) is still never served, but fetched again, and
every read equals zarr-python's; STOKER_CHECK_EVERY_READ=1 checks every read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import stoker
from stoker.engine.cpu import native

import preload_shim
from cached_arrays import ARRAYS, cache_folder, damage_entries, remote_fixture
from cached_arrays import check_batch as _batch, write as _write
from store_fixtures import empty_s3_fixture, range_server_fixture, written_tree_fixture

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(native.Engine is None or not native.zstd, reason="no compiled engine")]

s3 = empty_s3_fixture()
data = written_tree_fixture(_write)
http = range_server_fixture()
remote = remote_fixture("checked")

def _skipped() -> int:
    """The engine's entry reads in this process that skipped the payload check (stoker._native's count)."""
    from stoker import _native

    return _native.entry_checks_skipped()


#: How long the entries' ctimes may take to settle (0.1 s; 3 s where the file system keeps whole seconds)
SETTLE_DEADLINE_S = 10.0

#: entry_read's "the payload is not what its header's crc says" (csrc/entries.c ENTRY_CHECKSUM)
ENTRY_CHECKSUM = 6


def _config(options: dict, folder) -> stoker.Config:
    return stoker.Config(storage_options=options, cache_dir=str(folder), cache_bytes=64 << 20, batch_size=5,
                         dtype="native", n_compute_threads=2, pop_timeout_s=60, prefetch_bytes=0)


def _until_skipped(p, uri: str, data: str, path: str) -> int:
    """Read the batch again (each time equal to zarr-python's) until the engine skipped a payload check: the
    entries' ctimes settled and checked once. Returns the skips so far."""
    deadline = time.monotonic() + SETTLE_DEADLINE_S
    before = _skipped()
    while _skipped() == before:
        assert time.monotonic() < deadline, "no entry read was taken as checked before"
        time.sleep(0.15)
        _batch(p, uri, data, path)
    return _skipped()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("path", list(ARRAYS))
def test_an_entry_checked_before_and_damaged_since_is_never_served(remote, data, tmp_path, damage, path):
    uri, options, server = remote
    folder, cache = cache_folder(tmp_path)
    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert cache.flush(30)
        _until_skipped(p, uri, data, path)
        skipped = _until_skipped(p, uri, data, path)  # and again: the memo holds across batches
        assert _skipped() == skipped
        damage_entries(folder, damage)  # in place: the same inodes, their ctimes moved on
        corrupt, misses = cache.corrupt, cache.misses
        asked = server.requests if server else None
        _batch(p, uri, data, path)  # equal to zarr-python's: no damaged byte served
        assert _skipped() == skipped, "a damaged entry was taken as checked before"
        assert cache.misses > misses and cache.corrupt > corrupt  # found unsound, fetched and written anew
        if server is not None:
            assert server.requests > asked


def test_check_every_read_keeps_every_payload_check(tmp_path):
    # the knob is read at import: a process of its own each, which reads one entry five times as the engine
    # reads one (stoker._testing.entry_read: csrc/entries.c's entry_read), once it is settled on any file system
    script = textwrap.dedent(f"""
        import os, time
        from stoker import _testing
        from stoker.storage.diskcache import disk_cache
        cache = disk_cache({str(tmp_path / "cache")!r}, 64 << 20)
        ident = "s3://b/a/c/0\\ngen"
        cache.put(ident, os.urandom(100000))
        assert cache.flush(30)
        time.sleep(3.2)
        path, name = cache.entry_file(ident)
        print([_testing.entry_read(path, name, 1 << 20) for _ in range(5)], _testing.entry_checks_skipped())
    """)
    sound = "[(0, 100000), (0, 100000), (0, 100000), (0, 100000), (0, 100000)]"
    for env, skipped in (({"STOKER_CHECK_EVERY_READ": "1"}, "0"), ({"STOKER_CHECK_EVERY_READ": "0"}, "4")):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{sound} {skipped}"


#: a pread that, once armed for a file (its inode), first writes one byte of it in place from a descriptor of
#: its own (another process's write, landing between the engine's stat of an entry and its read)
_RACING_WRITE = r"""
#include <sys/stat.h>
static ino_t armed; static char armed_path[4096]; static off_t armed_at; static int fired;
void arm(const char *path, long at) {
    struct stat st; stat(path, &st); armed = st.st_ino; strncpy(armed_path, path, sizeof armed_path - 1);
    armed_at = at; fired = 0;
}
int has_fired(void) { return fired; }
static ssize_t read_at(int fd, void *buf, size_t n, off_t at) {
    REAL(pread);
    struct stat st;
    if (armed && fstat(fd, &st) == 0 && st.st_ino == armed) {
        armed = 0;
        int w = open(armed_path, O_RDWR);
        unsigned char b;
        if (w >= 0 && real(w, &b, 1, armed_at) == 1) { b ^= 0xFF; fired = pwrite(w, &b, 1, armed_at) == 1; }
        if (w >= 0) close(w);
    }
    return real(fd, buf, n, at);
}
ssize_t pread(int fd, void *buf, size_t n, off_t at) { return read_at(fd, buf, n, at); }
ssize_t pread64(int fd, void *buf, size_t n, off_t at) { return read_at(fd, buf, n, at); }
"""

_RACED_READ = textwrap.dedent("""
    import ctypes, json, os, sys, time
    from stoker import _testing
    from stoker.storage.diskcache import disk_cache
    shim = ctypes.CDLL(None)
    if not hasattr(shim, "arm"):
        sys.exit(77)
    cache = disk_cache(sys.argv[1], 64 << 20)
    ident = "s3://b/a/c/0\\ngen"
    cache.put(ident, os.urandom(100000))
    assert cache.flush(30)
    time.sleep(3.2)  # settled on any file system
    path, name = cache.entry_file(ident)
    first = _testing.entry_read(path, name, 1 << 20)  # checked, remembered
    again = _testing.entry_read(path, name, 1 << 20)  # taken as checked before
    skipped = _testing.entry_checks_skipped()
    shim.arm(os.fsencode(path), ctypes.c_long(os.path.getsize(path) - 10))  # a payload byte
    raced = _testing.entry_read(path, name, 1 << 20)
    print(json.dumps([first, again, skipped, shim.has_fired(), raced, _testing.entry_checks_skipped()]))
""")


def test_an_entry_written_in_place_while_it_is_read_is_checked(tmp_path_factory, tmp_path):
    # the engine stat'ed the entry, found it remembered as checked, and another process wrote a byte of it
    # before the read: the bytes read are not the ones checked, and the stat after the read says so
    shim = preload_shim.build(tmp_path_factory, _RACING_WRITE)
    out = preload_shim.run(shim, _RACED_READ, str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    first, again, skipped, fired, raced, skipped_after = json.loads(out.stdout)
    assert first == again == [0, 100000] and skipped == 1  # the memo was in use
    assert fired == 1  # the write landed between the stat and the read
    assert raced == [ENTRY_CHECKSUM, 0] and skipped_after == skipped  # checked, found unsound
