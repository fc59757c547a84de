"""A loopback HTTP server with Range support and fault injection, for the store tests.

Serves the files under a directory (GET and HEAD; ``Range: bytes=a-b``, ``a-`` and ``-n`` answered
with 206 and ``Content-Range``, unsatisfiable ranges with 416). Faults, set on the server while it
runs, apply to the next requests in order:

- ``fail(n, status)``: the next ``n`` requests get ``status`` (503 by default) and no body;
- ``latency_s``: every request waits this long before it is answered;
- ``hold_until_in_flight(n, timeout_s, under, ending)``: every request of a path starting with ``under`` (and
  ending with ``ending``) waits (after ``latency_s``) until ``n`` have been open at once, or ``timeout_s`` passed:
  a client that opens ``n`` at once is seen to, however loaded the machine;
- ``truncate(n)``: the next ``n`` bodies announce their full length but stop half way, and the
  connection is closed (a dropped connection);
- ``shorten(n)``: the next ``n`` bodies are consistent but shorter than asked (headers and body agree
  on fewer bytes: a misbehaving server or proxy);
- ``ignore_ranges``: every ``Range`` header is ignored, the whole file sent with 200 (as a server without range
  support does);
- ``redirect_status``: every request is answered with this redirect (302, 307...) to the same file under
  ``/moved/``, which is served;
- ``missing_status``: the status of a request for a file that is not there (404; 403 is what S3
  answers a client without ``s3:ListBucket`` permission);
- ``stop()``: stops listening and closes every open connection (a server gone mid-run).

``requests`` counts what it was asked (faulty requests included); ``peak_in_flight`` is the most
requests it answered at once; ``paths`` lists the path of every request, in the order they came, and ``log``
each one's arrival time (``time.monotonic()``), method and path.
"""

from __future__ import annotations

import email.utils
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_MOVED = "/moved/"  # where redirect_status sends every request


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers
    server: "RangeServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        self.server.entered(+1)
        try:
            self._answer(body)
        finally:
            self.server.entered(-1)

    def _answer(self, body: bool) -> None:
        self.server.paths.append(unquote(urlparse(self.path).path))
        self.server.log.append((time.monotonic(), self.command, unquote(urlparse(self.path).path)))
        fault = self.server.next_fault()
        if self.server.latency_s:
            time.sleep(self.server.latency_s)
        self.server.held(unquote(urlparse(self.path).path))
        if fault is not None and fault[0] == "status":
            self.send_response(fault[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        wanted = unquote(urlparse(self.path).path)
        if self.server.redirect_status:
            if not wanted.startswith(_MOVED):  # sent on to the same file under /moved/
                self.send_response(self.server.redirect_status)
                self.send_header("Location", _MOVED + urlparse(self.path).path.lstrip("/"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            wanted = wanted[len(_MOVED):]
        path = os.path.join(self.server.root, wanted.lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(self.server.missing_status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            data = f.read()
        st = os.stat(path)
        size = len(data)
        start, end, status = 0, size, 200
        header = None if self.server.ignore_ranges else self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # suffix: the last n bytes
                start = max(0, size - int(m.group(2)))
            if start >= size or end <= start:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        if fault is not None and fault[0] == "shorten":
            end = start + max(1, (end - start) // 2)
        self.send_response(status)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if self.server.etags:
            self.send_header("ETag", f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{size:x}"')
        self.end_headers()
        if not body:
            return
        if fault is not None and fault[0] == "truncate":
            self.wfile.write(data[start:start + (end - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:end])


class RangeServer(ThreadingHTTPServer):
    """Serves ``root`` on ``127.0.0.1`` (a free port) from a daemon thread until :meth:`stop`."""

    daemon_threads = True

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.latency_s = 0.0
        self.missing_status = 404
        self.redirect_status = 0  # e.g. 302 or 307: every request is sent on to its file under /moved/
        self.ignore_ranges = False  # True: answers every request whole, with 200 (a server without range support)
        self.etags = True  # False: answers name no version of the file (as some servers do)
        self.requests = 0
        self.paths: list[str] = []
        self.log: list[tuple[float, str, str]] = []  # (time.monotonic() on arrival, method, path) of each request
        self.in_flight = self.peak_in_flight = 0
        self._faults: list[tuple] = []
        self._lock = threading.Lock()
        self._entered = threading.Condition(self._lock)
        # (requests open at once, the longest wait, path prefix, path suffix)
        self._hold: tuple[int, float, str, str] | None = None
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a client that hung up (timeouts, cancelled reads)
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fail(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._faults.extend([("status", status)] * n)

    def truncate(self, n: int) -> None:
        with self._lock:
            self._faults.extend([("truncate",)] * n)

    def shorten(self, n: int) -> None:
        with self._lock:
            self._faults.extend([("shorten",)] * n)

    def next_fault(self) -> tuple | None:
        with self._lock:
            self.requests += 1
            return self._faults.pop(0) if self._faults else None

    def entered(self, delta: int) -> None:
        with self._lock:
            self.in_flight += delta
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._entered.notify_all()

    def hold_until_in_flight(self, n: int | None, timeout_s: float = 10.0, under: str = "/",
                             ending: str = "") -> None:
        """From now on every request waits until ``n`` have been open at once (``peak_in_flight``; then no more
        waits) or ``timeout_s`` passed, those of a path starting with ``under`` and ending with ``ending`` (a
        metadata document the client reads before it can ask more is left out); None: no wait."""
        with self._lock:
            self._hold = None if n is None else (n, timeout_s, under, ending)
            self._entered.notify_all()

    def held(self, path: str) -> None:
        """The wait :meth:`hold_until_in_flight` asks of a request for ``path`` (its handler's thread)."""
        with self._lock:
            if self._hold is not None and path.startswith(self._hold[2]) and path.endswith(self._hold[3]):
                n, timeout_s, _, _ = self._hold
                self._entered.wait_for(lambda: self._hold is None or self.peak_in_flight >= n, timeout_s)

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._connections.add if alive else self._connections.discard)(conn)

    def shutdown(self) -> None:
        """:meth:`stop`, for the tests that end the server as socketserver's are ended: socketserver's shutdown
        alone stops the serving loop but leaves each keep-alive connection's handler thread waiting for its
        next request, running on into the tests after it."""
        self.stop()

    def stop(self) -> None:
        """Stop listening and drop every open connection (idempotent)."""
        if self._thread.is_alive():
            super().shutdown()
            self._thread.join(timeout=10)
        self.server_close()
        with self._lock:
            conns, self._connections = list(self._connections), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
