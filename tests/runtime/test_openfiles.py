"""requests_that_fit: a pipeline's remote requests within the open-file limit. Each case runs in a process of
its own, whose limits it lowers (a hard limit, once lowered, cannot be raised again by that process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform == "win32", reason="POSIX limits")]

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(body: str) -> str:
    script = textwrap.dedent("""
        import resource, sys, warnings
        sys.path.insert(0, {tests!r})
        from stoker.runtime.openfiles import requests_that_fit
        """).format(tests=_TESTS) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_low_soft_limit_is_raised_toward_what_the_requests_need():
    # One pipeline's 512 requests want 2 * 512 + 256 descriptors; a second one's, as many more: the soft limit
    # follows both (train and validation loaders in one process), no further; what is released is not counted.
    out = _run("""
        from stoker.runtime.openfiles import release
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 4096))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            print(requests_that_fit(512), resource.getrlimit(resource.RLIMIT_NOFILE))
            print(requests_that_fit(512), resource.getrlimit(resource.RLIMIT_NOFILE))
            release(512)
            release(512)
            print(requests_that_fit(512), resource.getrlimit(resource.RLIMIT_NOFILE), len(seen))
        """)
    assert out.split("\n")[:3] == ["512 (1280, 4096)", "512 (2304, 4096)", "512 (2304, 4096) 0"]


def test_a_hard_limit_too_low_caps_the_requests_with_one_warning():
    out = _run("""
        from stoker.runtime.openfiles import release
        resource.setrlimit(resource.RLIMIT_NOFILE, (600, 600))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first, second = requests_that_fit(512), requests_that_fit(512)
            release(first)
            release(second)
            print(first, second, requests_that_fit(100), len(seen))
            print(seen[0].category.__name__, seen[0].message)
        """)
    first, second = out.split("\n")[:2]
    # (600 - 256) // 2 = 172 for the first; the second gets the least (16) beside it; 100 fit once released;
    # warned once
    assert first == "172 16 100 1"
    assert second.startswith("RuntimeWarning") and "ulimit -n 1280" in second and "600" in second


def test_a_pipeline_under_a_low_hard_limit_reads_right_with_its_requests_capped(tmp_path):
    # A pipeline of remote arrays under a hard limit of 600: its requests and its prefetch's share capped to
    # fit, one warning, every batch equal to the array's crops; a pipeline of local arrays never warns.
    out = _run(f"""
        import numpy as np, torch, zarr
        import stoker
        from range_server import RangeServer
        root = {str(tmp_path)!r}
        arr = zarr.create_array(root + "/a", shape=(32, 64), chunks=(8, 8), dtype="uint16", fill_value=0)
        want = np.arange(32 * 64, dtype="uint16").reshape(32, 64)
        arr[...] = want
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 600))  # raisable: a local pipeline leaves it as it is
        boxes = [[(8 * (k % 3), 8 * (k % 3) + 12), (4 * k, 4 * k + 20)] for k in range(8)]
        cfg = stoker.Config(batch_size=4, dtype="native", n_compute_threads=2, pop_timeout_s=60,
                            host_buffer_bytes=16 << 20)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with stoker.Pipeline(cfg) as p:
                p.push([stoker.Sample(root + "/a", box) for box in boxes[:4]])
                with p.pop() as b:
                    torch.from_dlpack(b)
            print("local", len(seen), resource.getrlimit(resource.RLIMIT_NOFILE))
            resource.setrlimit(resource.RLIMIT_NOFILE, (600, 600))
            server = RangeServer(root)
            try:
                opts = {{server.url + "/": {{"allow_http": True, "timeout_s": 10.0}}}}
                with stoker.Pipeline(stoker.Config(**{{**cfg.__dict__, "storage_options": opts}})) as p:
                    p.push([stoker.Sample(server.url + "/a", box) for box in boxes])
                    ok = True
                    for k in range(2):
                        with p.pop() as b:
                            got = torch.from_dlpack(b).numpy()
                            for row, ((a, c), (d, e)) in zip(got, boxes[4 * k:4 * k + 4]):
                                ok = ok and np.array_equal(row, want[a:c, d:e])
                    print("remote", ok, p._coordinator.ahead.buffer.max_requests, len(seen))
            finally:
                server.stop()
        """)
    lines = out.split("\n")
    assert lines[0] == "local 0 (300, 600)"
    assert lines[1] == f"remote True {172 * 3 // 4} 1"
