"""A closing pipeline's staging round stops between reads (csrc/staging.c's cancel flag, engine/gpu/native_reads.py
``Readers.cancel``, the GPU-decode executor's ``shutdown``), and the staging's threads of a call's own are named.

The compiled reads run without the GIL and call no Python between two reads, so they are held in a C library put
before libc (LD_PRELOAD, a child process): it counts each ``pread`` of a file under an armed folder and holds
those from the n-th on until it is released. The reads held and done are counts, never times: a round cancelled
while a read is held ends after the reads under way, with fewer reads done than it had; without the cancel it
reads every one once released.
"""

from __future__ import annotations

import json
import platform
import sys

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

from stoker.engine.gpu import native_reads

import preload_shim

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not native_reads.available(), reason="stoker._native is not built"),
    pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                       reason="the reads are held by an LD_PRELOAD library (Linux, glibc)"),
]

# gate_arm(prefix, from): the preads of files under ``prefix`` from the ``from``-th on wait (60 s at most) until
# gate_release(); gate_done() counts those finished, gate_waiting() those waiting now.
_GATE = r"""
#include <pthread.h>
#include <stdio.h>
#include <sys/uio.h>
#include <time.h>

static char prefix[4096];
static size_t prefix_len;
static long hold_from = -1, tickets, done, waiting;
static int released;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

void gate_arm(const char *p, long from) {
    pthread_mutex_lock(&mu);
    strncpy(prefix, p, sizeof prefix - 1);
    prefix_len = strlen(prefix);
    hold_from = from, tickets = done = waiting = 0, released = 0;
    pthread_mutex_unlock(&mu);
}
void gate_release(void) {
    pthread_mutex_lock(&mu);
    released = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}
static long get(long *v) {
    pthread_mutex_lock(&mu);
    long x = *v;
    pthread_mutex_unlock(&mu);
    return x;
}
long gate_done(void) { return get(&done); }
long gate_waiting(void) { return get(&waiting); }

static int armed(int fd) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0)
        return 0;
    path[n] = 0;
    pthread_mutex_lock(&mu);
    int in = prefix_len > 0 && strncmp(path, prefix, prefix_len) == 0;
    pthread_mutex_unlock(&mu);
    return in;
}
static int before(int fd) {
    if (!armed(fd))
        return 0;
    pthread_mutex_lock(&mu);
    long t = tickets++;
    if (hold_from >= 0 && t >= hold_from && !released) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 60;
        waiting++;
        while (!released && pthread_cond_timedwait(&cv, &mu, &until) != ETIMEDOUT)
            ;
        waiting--;
    }
    pthread_mutex_unlock(&mu);
    return 1;
}
static void after(int counted) {
    if (counted) {
        pthread_mutex_lock(&mu);
        done++;
        pthread_mutex_unlock(&mu);
    }
}
/* each read call counted, and held from the armed ticket on, around libc's */
#define HELD(name, T, U)                                                                                    \
    ssize_t name(int fd, T a, U b, off_t at) {                                                              \
        REAL(name);                                                                                         \
        int c = before(fd);                                                                                 \
        ssize_t r = real(fd, a, b, at);                                                                     \
        after(c);                                                                                           \
        return r;                                                                                           \
    }
HELD(pread, void *, size_t)
HELD(pread64, void *, size_t)
HELD(preadv, const struct iovec *, int)
HELD(preadv64, const struct iovec *, int)
"""

# the child's common part: the gate (exit 77 where it was not preloaded) and a bounded wait for its counts
_PRELUDE = r"""
import ctypes, json, os, sys, threading, time
import numpy as np
gate = ctypes.CDLL(None)
if not hasattr(gate, "gate_arm"):
    sys.exit(77)  # not preloaded (preload_shim.NOT_PRELOADED)

def until(what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise SystemExit("the reads never reached the gate")
        time.sleep(0.005)
"""

# a wave of ranged reads of one file (one task: the caller's thread) and one of whole files (every reader)
# cancelled while a read is held; then a round of whole files on threads of the call's own, held, their names
_READS = _PRELUDE + r"""
from stoker.engine.gpu import native_reads
root = sys.argv[1]
paths = [os.path.join(root, "files", f) for f in sorted(os.listdir(os.path.join(root, "files")))]
sizes = [os.path.getsize(p) for p in paths]
files = np.zeros((len(paths), 6), np.int64)
result = {}

def cancelled_while_held(reads, hold_from):
    readers = native_reads.Readers(4)
    buf = bytearray(sum(sizes) * 2)
    gate.gate_arm(os.fsencode(os.path.join(root, "files")), hold_from)
    out = []
    thread = threading.Thread(target=lambda: out.append(native_reads.read(buf, paths, files, reads, 0, readers)))
    thread.start()
    until(lambda: gate.gate_waiting() >= 1)
    readers.cancel()
    gate.gate_release()
    thread.join(60.0)
    closed = readers.close(5.0)
    status = out[0][:, native_reads.STATUS]
    ok = status == native_reads.ST_OK
    right = True
    for i in np.flatnonzero(ok).tolist():  # each read done staged its file's bytes where it says
        f, o = int(reads[i, 0]), int(reads[i, 1])
        a, n = int(out[0][i, native_reads.AT]), int(out[0][i, native_reads.NREAD])
        content = open(paths[f], "rb").read()
        right = right and bytes(buf[a:a + n]) == (content[o:o + n] if o >= 0 else content)
    cancelled = status == native_reads.ST_CANCELLED
    return {"ok": int(ok.sum()), "cancelled": int(cancelled.sum()), "reads": len(reads),
            "done": int(gate.gate_done()), "alive": thread.is_alive(), "closed": bool(closed),
            "right": bool(right), "unplaced": bool((out[0][cancelled, native_reads.AT] == -1).all()
                                                   and (out[0][cancelled, native_reads.NREAD] == 0).all())}

one = [[0, 64 * k, 32, 32 * k] for k in range(40)]  # runs of one file: one task, read by the caller
result["runs"] = cancelled_while_held(np.array(one, np.int64), 3)
whole = [[k, -1, sizes[k], 0] for k in range(len(paths))]
result["whole"] = cancelled_while_held(np.array(whole, np.int64), 6)

# threads of the call's own (a count, not Readers): named as the pool's helpers, seen while their reads are held
gate.gate_arm(os.fsencode(os.path.join(root, "files")), 0)
buf = bytearray(sum(sizes))
thread = threading.Thread(target=lambda: native_reads.read(buf, paths, files, np.array(whole, np.int64), 0, 4))
thread.start()
until(lambda: gate.gate_waiting() >= 4)
names = []
for tid in os.listdir("/proc/self/task"):
    try:
        names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
    except OSError:
        pass
gate.gate_release()
thread.join(60.0)
result["named"] = names.count("stoker-stage")
print(json.dumps(result))
"""

# a GPU-decode pipeline on the host stand-in, closed while its reader's round of 256 chunk files is held
_PIPELINE = _PRELUDE + r"""
import torch, stoker
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.gpu.reference import HostDecoder
from stoker.engine.pipeline import facade as pipelines
from stoker.errors import ShutdownError
uri = sys.argv[1]
made = []

class Released(GpuDecodeExecutor):
    def shutdown(self):  # the reads held go on once the pipeline is closing (after the cancel, if any)
        super().shutdown()
        gate.gate_release()

def factory(cfg, device, stats, store):
    made.append(Released(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: HostDecoder()))
    return made[-1]

pipelines.make_executor = factory
cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", n_compute_threads=4, n_io_threads=1,
                    lookahead_batches=2, host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20, pop_timeout_s=60.0)
gate.gate_arm(os.fsencode(os.path.join(uri, "c")), 8)
p = stoker.Pipeline(cfg)
p.push([stoker.Sample(uri, [(0, 64), (0, 64), (0, 64)]) for _ in range(3)])
errors, got = [], []

def consume():
    try:
        for batch in p:
            got.append(1)
    except BaseException as exc:
        errors.append(f"{type(exc).__name__}: {exc}")

consumer = threading.Thread(target=consume)
consumer.start()
until(lambda: gate.gate_waiting() >= 1)
p.close()
ex = made[0]
alive = [t.name for t in ex.threads() if t.is_alive()]  # (close joins them, a second at most)
consumer.join(60.0)
for t in ex.threads():
    t.join(60.0)
print(json.dumps({"done": int(gate.gate_done()), "alive_after_close": alive,
                  "alive": [t.name for t in ex.threads() if t.is_alive()] + (["consumer"] if consumer.is_alive() else []),
                  "errors": errors, "batches": len(got), "staging_busy": sum(s.busy for s in ex.host_slots.slots),
                  "helpers": ex._stager.pool.readers().info()[2]}))
"""


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return preload_shim.build(tmp_path_factory, _GATE, pthread=True)


def _child(gate, script: str, *args: str) -> dict:
    out = preload_shim.run(gate, script, *args, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cancelled_round_stops_between_reads_and_per_call_threads_are_named(gate, tmp_path):
    (tmp_path / "files").mkdir()
    rng = np.random.default_rng(0)
    for k in range(48):
        (tmp_path / "files" / f"f{k:02d}").write_bytes(rng.integers(0, 256, 3000 + 7 * k, np.uint8).tobytes())
    got = _child(gate, _READS, str(tmp_path))
    runs, whole = got["runs"], got["whole"]
    # the runs of one file: reads 0-2 done, read 3 held when the cancel came (it ends), the 36 after it not run
    assert runs == {"ok": 4, "cancelled": 36, "reads": 40, "done": 4, "alive": False, "closed": True,
                    "right": True, "unplaced": True}, runs
    # whole files on the caller and 3 helpers: 6 done, the reads under way end (4 at most), the rest not run
    assert whole["ok"] == whole["done"] and 6 < whole["done"] <= 10 and whole["ok"] + whole["cancelled"] == 48, whole
    assert not whole["alive"] and whole["closed"] and whole["right"] and whole["unplaced"], whole
    assert got["named"] == 3, got  # the call's own 3 threads (the caller is the test's)


@pytest.fixture(scope="module")
def chunk_files(tmp_path_factory):
    """A 64^3 uint16 array of 256 chunk files (4 x 16 x 16, zstd): one crop of it stages all 256 in one
    compiled round."""
    uri = str(tmp_path_factory.mktemp("cancel") / "a.zarr")
    z = zarr.create_array(uri, shape=(64, 64, 64), chunks=(4, 16, 16), dtype="uint16", fill_value=0,
                          compressors=ZstdCodec(level=1))
    z[:] = np.random.default_rng(1).integers(0, 4000, size=(64, 64, 64), dtype="uint16")
    return uri


def test_closing_a_gpu_decode_pipeline_ends_its_staging_round_between_reads(gate, chunk_files):
    """close() while the reader's round of 256 chunk files is held after 8 reads: the round stops at its next
    read (the reads under way end, 4 at most), the batch fails with the pipeline-closed error and nothing is
    placed; close() joins the reader and submitter, the read helpers are gone and the staging is given back.
    Without the cancel the reads held go on once released and the round reads all 256."""
    got = _child(gate, _PIPELINE, chunk_files)
    assert 8 <= got["done"] <= 12, got  # (256 without the cancel)
    assert got["alive_after_close"] == [] and got["alive"] == [], got
    assert got["batches"] == 0 and got["staging_busy"] == 0 and got["helpers"] == 0, got
    assert all(e.startswith("ShutdownError") for e in got["errors"]), got
