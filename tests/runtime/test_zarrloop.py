"""Requests zarr-python leaves in flight after a failed TileWriter open are ended before finalisation.

zarr-python reads zarr.json, .zarray and .zattrs together; the first refused (403) fails the open while the
others, answered late, stay in flight. One that ends while the interpreter finalises aborts the process from
obstore's tokio thread (exit code 134). The child checks, from an exit hook that runs after stoker's and just
before zarr-python's own, that nothing is still pending on zarr's loop then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = textwrap.dedent("""
    import asyncio, atexit, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            refused = self.path.endswith("zarr.json")
            if not refused:
                time.sleep(20)  # .zarray, .zattrs: still in flight when the script exits
            self.send_response(403 if refused else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    import zarr.core.sync as zsync
    import stoker

    def pending_at_exit():  # registered before stoker's hook: runs after it, then zarr's own cleanup
        loop = zsync.loop[0]
        async def count():
            return sum(not t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())
        n = asyncio.run_coroutine_threadsafe(count(), loop).result(5) if loop is not None else -1
        print("pending at exit", n, flush=True)
        zsync.cleanup_resources()

    atexit.unregister(zsync.cleanup_resources)
    atexit.register(pending_at_exit)
    opts = {"endpoint": f"http://127.0.0.1:{srv.server_address[1]}", "allow_http": True, "region": "us-east-1",
            "retries": 0, "timeout_s": 30}
    try:
        stoker.TileWriter("s3://bkt/o.zarr", (8, 8), (4, 4), "float32", storage_options=opts)
    except stoker.errors.StorageError as e:
        print("refused", type(e).__name__, flush=True)
""")


def test_requests_left_in_flight_by_zarr_end_before_exit(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=env)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert "refused StorageError" in proc.stdout, out
    assert "pending at exit 0" in proc.stdout, out  # without the hook: the two late requests
    assert proc.returncode == 0 and "Fatal Python error" not in out, out
    assert took < 15, f"exit took {took:.1f}s: the requests were waited for, not cancelled"
