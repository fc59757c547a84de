import os

import numpy as np
import pytest
import torch

# Triton (the GPU decode's fused kernels, tests/gpu/test_gpu_fused.py) runs CPU tensors in its interpreter:
# the variable is read when a kernel is made, so it is set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Pool threads of a test process leave after an hour idle, not 30 s: dozens of earlier tests' idle threads
    (disk caches' readers live for the process) leaving together in a later test's window showed up as CPU and
    RSS the window's own work did not make (tests/bench/test_rss_peak.py, tests/cli/test_bench_thread_cpu.py).
    tests/runtime/test_workers.py sets it back to test the leaving itself."""
    from stoker.runtime import workers

    workers.IDLE_RETIRE_S = 3600.0


@pytest.fixture(params=["python", "engine"])
def decode_path(request, monkeypatch):
    """Each test that takes it runs on the Python path and on the compiled engine (where it is built)."""
    from stoker.engine.cpu import native

    if request.param == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif native.Engine is None:
        pytest.skip("the compiled engine is not built")
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need an NVIDIA GPU: skip them cleanly where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
