"""The object stores' event loop ends its requests before the interpreter finalises.

An obstore request is a Rust future whose tokio thread takes the GIL to hand its result to the loop that
awaits it; one ending while the interpreter finalises aborts the process ("Fatal Python error: Aborted",
exit code 134), which a script reading one ``s3://`` array did about once in 15 to 40 runs. The exit hook
cancels what the loop still runs, waits for it (bounded), stops the loop and leaves the GIL a moment.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stoker.errors import ShutdownError
from stoker.storage.objectstore import _Loop

CHILD = textwrap.dedent("""
    import asyncio, atexit, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.set()
            time.sleep(20)  # stalls: the request is still in flight when the script exits
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    from stoker.storage import objectstore

    hooked = getattr(objectstore, "_hooked_pid", None) is not None
    print("hooked before", hooked, flush=True)  # never read a remote store: no hook
    outcome = []

    async def count():
        return sum(not t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())

    def at_exit():  # registered before stoker's hook: runs after it
        reader.join(5)
        loop = objectstore._Loop._current.loop
        if loop.is_running():
            pending = asyncio.run_coroutine_threadsafe(count(), loop).result(5)
        else:  # stopped: its tasks can be read from here
            pending = sum(not t.done() for t in asyncio.all_tasks(loop))
        print("at exit: pending", pending, "running", loop.is_running(), "reader", outcome, flush=True)

    atexit.register(at_exit)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    if sys.argv[1] == "s3":
        s = objectstore.ObjectStore("s3://bkt/root", {"endpoint": url, "allow_http": True, "region": "us-east-1"},
                                    timeout_s=30, retries=0)
    else:
        s = objectstore.ObjectStore(url + "/root", timeout_s=30, retries=0)

    def read():
        try:
            s.get("value")
        except Exception as e:
            outcome.append(type(e).__name__)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert asked.wait(20)
    print("in flight", type(s._obstore()).__name__, flush=True)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_request_in_flight_at_exit_is_cancelled_before_finalisation(tmp_path, kind):
    """Without the hook the request is still pending on the loop when the last exit hooks run, and its reader
    still waits; with it the request was cancelled (its reader got ShutdownError), the loop stopped, and the
    process exits at once with code 0. Repeated: an abort at exit is a matter of timing."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    for _ in range(2):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=60,
                              env=env)
        took = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        assert "hooked before False" in proc.stdout, out
        assert f"in flight {'S3Store' if kind == 's3' else 'HTTPStore'}" in proc.stdout, out
        assert "at exit: pending 0 running False reader ['ShutdownError']" in proc.stdout, out
        assert proc.returncode == 0 and "Fatal Python error" not in out, out
        assert took < 20, f"exit took {took:.1f}s: the request was waited for, not cancelled"


def test_settle_cancels_pending_work_stops_the_loop_and_refuses_more():
    """A loop of this test's own (not the process's): settle cancels what it runs, waits for it, stops the
    loop's thread; a later request fails at once with ShutdownError; settling again costs nothing."""
    loop = _Loop()
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    future = loop.start(forever())
    done = loop.start(asyncio.sleep(0, "fine"))
    assert done.result(5) == "fine"
    deadline = time.monotonic() + 5
    while not started.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert loop.settle(wait_s=2.0) == 1
    assert time.monotonic() - t0 < 1.5  # cancelled at once, then the grace
    assert future.cancelled()
    assert not loop.thread.is_alive() and not loop.loop.is_running()
    coro = asyncio.sleep(0)
    with pytest.raises(ShutdownError, match="exiting"):
        loop.start(coro)
    assert coro.cr_frame is None  # closed, not left "never awaited"
    t0 = time.monotonic()
    assert loop.settle() == 0
    assert time.monotonic() - t0 < 0.05
    loop.loop.close()
