"""The remote benchmark's server: the bench data directory over HTTP or as an S3 bucket, on loopback,
with a fixed delay added to every request (``python -m stoker.bench.serve``, or :class:`Served`).

It runs in a process of its own, so its threads never compete with the peers for the benchmark
process's GIL. GET and HEAD; ``Range: bytes=a-b``, ``a-`` and ``-n`` are answered with 206 and
``Content-Range`` (bodies sent with ``sendfile``); a conditional request (``If-None-Match``,
``If-Modified-Since``) of an unchanged object gets 304 without a body, as a cache revalidating expects. S3 mode serves path-style requests
(``/<bucket>/<key>``), the only S3 calls the peers make when reading arrays (ranged and whole
GETs, HEADs, and ListObjectsV2 of an array's keys, which stoker's disk cache revalidates by), and ignores
signatures: the peers read it anonymously.

Every request, counted, waits ``latency_s`` before it is answered (thread per connection, so requests
on different connections wait together, as behind a real network). ``GET /_stoker/counters`` (not
delayed or counted) answers ``{"requests": n, "bytes": body bytes sent}``.
"""

from __future__ import annotations

import email.utils
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse
from xml.sax.saxutils import escape

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
COUNTERS = "/_stoker/counters"
BUCKET = "bench"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers
    # Headers and body go out in separate sends: with Nagle's algorithm the body would wait for the
    # client's delayed ACK of the headers (40 ms on Linux), a delay no real server adds.
    disable_nagle_algorithm = True
    server: "BenchServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        if self.path == COUNTERS:
            body = json.dumps(self.server.counters()).encode()
            self._head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))})
            self.wfile.write(body)
            return
        self._answer(body=True)

    def _head(self, status: int, headers: dict) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _answer(self, body: bool) -> None:
        self.server.count(0)
        if self.server.latency_s:
            time.sleep(self.server.latency_s)
        url = urlparse(self.path)
        if self.server.s3 and "list-type=2" in url.query.split("&"):
            self._list(parse_qs(url.query), body)
            return
        path = self._file()
        if path is None or not os.path.isfile(path):
            self._head(404, {"Content-Length": "0"})
            return
        st = os.stat(path)
        size = st.st_size
        start, end, status = 0, size, 200
        header = self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if m and m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            elif m and m.group(2):  # suffix: the last n bytes
                start = max(0, size - int(m.group(2)))
            if m is None or start >= size or end <= start:
                self._head(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                return
            status = 206
        etag = _etag(st)
        headers = {"Content-Length": str(end - start), "Accept-Ranges": "bytes", "ETag": etag,
                   "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True)}
        if _unchanged(self.headers, etag, st.st_mtime):  # a cache revalidating (tensorstore's): no body
            self._head(304, {"ETag": etag, "Last-Modified": headers["Last-Modified"]})
            return
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self._head(status, headers)
        if body:
            with open(path, "rb") as f:
                self.connection.sendfile(f, start, end - start)
            self.server.count(end - start, request=False)

    def _list(self, query: dict, body: bool) -> None:
        """S3's ListObjectsV2 of the bucket (what a disk cache revalidates an array's objects with): the keys
        under ``prefix`` after ``start-after`` and ``continuation-token`` (the last key of the page before), at
        most ``max-keys`` (1,000), each with the size and ETag its HEAD states."""
        one = {k: v[0] for k, v in query.items()}
        if unquote(urlparse(self.path).path).strip("/") != BUCKET:
            self._head(404, {"Content-Length": "0"})
            return
        prefix = one.get("prefix", "")
        after = max(one.get("start-after", ""), one.get("continuation-token", ""))
        most = min(1000, int(one.get("max-keys", 1000)))
        top = os.path.join(self.server.root, *[p for p in prefix.split("/")[:-1] if p not in ("", ".", "..")])
        found = []
        for folder, _, files in os.walk(top):
            for name in files:
                path = os.path.join(folder, name)
                key = os.path.relpath(path, self.server.root).replace(os.sep, "/")
                if key.startswith(prefix) and key > after:
                    found.append((key, path))
        found.sort()
        page, more = found[:most], len(found) > most
        items = []
        for key, path in page:
            st = os.stat(path)
            items.append(f"<Contents><Key>{escape(key)}</Key><LastModified>"
                         f"{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(st.st_mtime))}</LastModified>"
                         f"<ETag>{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        token = f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>" if more else ""
        doc = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
               f'2006-03-01/"><Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>'
               f"<MaxKeys>{most}</MaxKeys><IsTruncated>{'true' if more else 'false'}</IsTruncated>{''.join(items)}"
               f"{token}</ListBucketResult>").encode()
        self._head(200, {"Content-Type": "application/xml", "Content-Length": str(len(doc))})
        if body:
            self.wfile.write(doc)
            self.server.count(len(doc), request=False)

    def _file(self) -> str | None:
        """The file a request's path names, or None (outside the root, or another bucket)."""
        parts = [p for p in unquote(urlparse(self.path).path).split("/") if p]
        if self.server.s3:
            if not parts or parts[0] != BUCKET:
                return None
            parts = parts[1:]
        if not parts or any(p in (".", "..") for p in parts):
            return None
        return os.path.join(self.server.root, *parts)


def _etag(st: os.stat_result) -> str:
    """A file's ETag: changes when it is rewritten (inode, mtime, size)."""
    return f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'


def _unchanged(headers, etag: str, mtime: float) -> bool:
    """Whether a conditional request's object is unchanged (answered 304, as S3 and HTTP servers do):
    ``If-None-Match`` naming its ETag (or ``*``), else ``If-Modified-Since`` not before its mtime."""
    match = headers.get("If-None-Match")
    if match is not None:
        return any(tag.strip() in (etag, "*", "W/" + etag) for tag in match.split(","))
    since = headers.get("If-Modified-Since")
    if since is not None:
        try:
            return int(mtime) <= email.utils.parsedate_to_datetime(since).timestamp()
        except (TypeError, ValueError):
            return False
    return False


class BenchServer(ThreadingHTTPServer):
    """Serves ``root`` on ``127.0.0.1`` (a free port unless ``port``) until :meth:`shutdown`."""

    daemon_threads = True
    request_queue_size = 256  # many peers' connections open at once

    def __init__(self, root: str, latency_s: float = 0.0, s3: bool = False, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.root, self.latency_s, self.s3 = root, latency_s, s3
        self._requests = self._bytes = 0
        self._lock = threading.Lock()

    def count(self, nbytes: int, request: bool = True) -> None:
        with self._lock:
            self._requests += request
            self._bytes += nbytes

    def counters(self) -> dict:
        with self._lock:
            return {"requests": self._requests, "bytes": self._bytes}

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a client that hung up
            return
        super().handle_error(request, client_address)


class Served:
    """The server in a child process: ``url`` (HTTP: the data root; S3: the endpoint), :meth:`counters`."""

    def __init__(self, root: str, kind: str, latency_ms: float) -> None:
        import subprocess

        self.kind = kind
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.bench.serve", str(root), kind, repr(latency_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # stdin: its lifeline
        line = self._proc.stdout.readline()  # the port, once it listens
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the bench server did not start (exit status {self._proc.poll()})")
        self.url = f"http://127.0.0.1:{int(line)}"

    def counters(self) -> tuple[int, int]:
        """``(requests, bytes)`` served so far."""
        from urllib.request import urlopen

        with urlopen(self.url + COUNTERS, timeout=30) as r:
            doc = json.loads(r.read())
        return doc["requests"], doc["bytes"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except Exception:
                self._proc.kill()
                self._proc.wait(10)

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    root, kind, latency_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    server = BenchServer(root, latency_ms / 1e3, s3=kind == "s3")
    print(server.server_address[1], flush=True)

    def lifeline() -> None:  # the parent gone (its end of stdin closed): stop, whatever killed it
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=lifeline, daemon=True).start()
    server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
