"""Resources the system refuses are typed errors naming the knob: memory for batch slots and buffers is
``OutOfMemory`` (a ``MemoryError``), a thread is ``ThreadStartError``. Each failure is real: an address-space
limit (``RLIMIT_AS``) in a child process, a thread stack size no system gives, a buffer past the address
space."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import zarr

import stoker
from stoker.engine.cpu import native
from stoker.engine.buffers import TransientBudget
from stoker.runtime.workers import DaemonPool

pytestmark = pytest.mark.timeout(120)

_PRELUDE = r"""
import resource, sys, threading
import stoker

def limit_address_space(margin):
    # the address space the process has now, plus margin: the next larger mapping is refused
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            size = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + margin, size + margin))

def report(exc):
    print(type(exc).__name__, isinstance(exc, MemoryError), getattr(exc, "knob", None), getattr(exc, "nbytes", None))
    print(exc)
"""


def _run(script: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + script, *args], capture_output=True, text=True,
                         timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.fixture(scope="module")
def array(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("limits") / "a.zarr")
    z = zarr.create_array(uri, shape=(64, 64), chunks=(32, 32), dtype="float32")
    z[:] = np.arange(64 * 64, dtype="float32").reshape(64, 64)
    return uri


_SLOTS = r"""
uri = sys.argv[1]
cfg = stoker.Config(batch_size=32768, dtype="f32", device="cpu", n_compute_threads=1, host_buffer_bytes=8 << 30,
                    drop_last=False, pop_timeout_s=20)   # 3 slots of 128 MiB: within the budget
p = stoker.Pipeline(cfg)
limit_address_space(256 << 20)  # the machine has less than the budget: the third slot is refused
p.push([stoker.Sample(uri, [(0, 32), (0, 32)])])
try:
    p.pop()
except stoker.StokerError as exc:
    report(exc)
"""


def test_batch_slots_the_system_refuses_are_out_of_memory(array):
    """Near the memory limit torch's allocator says ``RuntimeError: DefaultCPUAllocator: can't allocate
    memory``; the pipeline raises OutOfMemory (a MemoryError) naming host_buffer_bytes and the bytes."""
    kind, is_memory, knob, nbytes, message = _outcome(_run(_SLOTS, array))
    assert (kind, is_memory, knob, nbytes) == ("OutOfMemory", "True", "host_buffer_bytes", str(128 << 20))
    assert re.search(r"for batch slot [1-3] of 3", message) and "can't allocate memory" in message
    assert "lower host_buffer_bytes, batch_size" in message


def _outcome(lines: list[str]) -> tuple[str, str, str, str, str]:
    kind, is_memory, knob, nbytes = lines[-2].split()
    return kind, is_memory, knob, nbytes, lines[-1]


def test_read_buffers_the_system_refuses_are_out_of_memory():
    """A read or decode buffer past what the system maps: numpy's MemoryError becomes OutOfMemory."""
    budget = TransientBudget(1 << 62)
    with pytest.raises(stoker.OutOfMemory, match="1,125,899,906,842,624 B of host memory") as e:
        budget.take(1 << 50)
    assert isinstance(e.value, MemoryError) and e.value.knob == "host_buffer_bytes"
    assert isinstance(e.value.__cause__, MemoryError)


_COORDINATOR = r"""
uri = sys.argv[1]
p = stoker.Pipeline(stoker.Config(batch_size=1, dtype="f32", device="cpu", n_compute_threads=1,
                                  host_buffer_bytes=16 << 20, pop_timeout_s=20))
threading.stack_size(1 << 40)  # no system maps a 1 TiB stack: Python's "can't start new thread"
try:
    p.push([stoker.Sample(uri, [(0, 2), (0, 2)])])
except stoker.StokerError as exc:
    report(exc)
threading.stack_size(0)
p.push([])  # the system gives threads again: the pipeline starts and makes the batch pushed before
with p.pop() as batch:
    print(torch.from_dlpack(batch).tolist())
"""

_POOL = r"""
threading.stack_size(1 << 40)
pool = DaemonPool(2, "stoker-io", knob="n_io_threads")
try:
    pool.submit(print, "never")
except stoker.StokerError as exc:
    report(exc)
"""


def test_threads_the_system_refuses_name_the_knob(array):
    lines = _run("import torch\n" + _COORDINATOR, array)
    kind, is_memory, knob, _, message = _outcome(lines[:-1])
    assert (kind, is_memory, knob) == ("ThreadStartError", "False", "n_compute_threads")
    assert "stoker-coordinator" in message and "can't start new thread" in message
    assert lines[-1] == "[[[0.0, 1.0], [64.0, 65.0]]]"
    lines = _run("from stoker.runtime.workers import DaemonPool\n" + _POOL)
    kind, _, knob, _, message = _outcome(lines)
    assert (kind, knob) == ("ThreadStartError", "n_io_threads") and "Lower Config.n_io_threads" in message


_ENGINE = r"""
from stoker.engine.cpu.decode_native import NativeDecoder
limit_address_space(1 << 20)  # no room for one thread's stack
try:
    NativeDecoder(4, 1 << 20, None, None)
except stoker.StokerError as exc:
    report(exc)
"""


@pytest.mark.skipif(native.Engine is None, reason="the compiled engine is not built")
def test_the_engine_given_no_thread_names_the_knob():
    """The C engine's ``OSError("the system gives no thread to the engine")`` becomes ThreadStartError."""
    kind, _, knob, _, message = _outcome(_run(_ENGINE))
    assert (kind, knob) == ("ThreadStartError", "n_compute_threads")
    assert "the system gives no thread to the engine" in message and "Lower Config.n_compute_threads" in message


def test_a_pool_keeps_working_when_a_further_thread_is_refused(monkeypatch):
    """With threads running, a refused extra thread is no error: the running ones take the task."""
    import threading

    pool = DaemonPool(4, "stoker-io", knob="n_io_threads")
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(5)
    threading.stack_size(1 << 40)
    try:
        ran = threading.Event()
        gate = threading.Event()
        pool.submit(gate.wait, 5)  # keeps the one thread busy: the next task asks for a second thread
        pool.submit(ran.set)
    finally:
        threading.stack_size(0)
    gate.set()
    assert ran.wait(5) and len(pool.threads) == 1
    pool.shutdown()


_LOADER = r"""
import numpy as np, zarr
from stoker.records import Loader, ZarrRecords
root = sys.argv[1]
for i in range(4):
    zarr.open_group(f"{root}/rec_{i}.zarr", mode="w").create_array("x", data=np.full((2,), i, "f4"))
loader = Loader(ZarrRecords(root, fields=["x"]), batch_size=2, rank=0, world_size=1, n_threads=2)
threading.stack_size(1 << 40)
try:
    next(iter(loader))
except stoker.StokerError as exc:
    report(exc)
threading.stack_size(0)
print(sorted(float(v) for b in loader for v in b["x"].reshape(-1)))  # threads again: the epoch reads
"""


def test_the_records_loader_given_no_thread_names_its_knob(tmp_path):
    lines = _run(_LOADER, str(tmp_path))
    kind, _, knob, _, message = _outcome(lines[:-1])
    assert (kind, knob) == ("ThreadStartError", "n_threads") and "Lower Loader.n_threads" in message
    assert lines[-1] == str([0.0] * 2 + [1.0] * 2 + [2.0] * 2 + [3.0] * 2)
