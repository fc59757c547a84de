"""The remote benchmark's server: the bench data directory over HTTP or as an S3 bucket, on loopback,
with a fixed delay added to every request (``python -m stoker.bench.serve``, or :class:`Served`).

It runs in a process of its own, so it never competes with the peers for the benchmark process's GIL;
it still shares the machine's cores with them, so it is cheap per request: one asyncio event loop thread,
no thread per connection, a body sent with its headers in one send (large ones with ``sendfile``, straight to
the socket as far as it takes them), and its CPU time is reported with its counters (what the loopback server
costs each batch; a real server's is not the client's). Flow control: an answer that leaves more than the
transport's high-water mark unsent waits for the client to read it before the connection's next request is read
(a ``sendfile`` waits so itself), so a client that stops reading holds the socket buffers and one answer, not
all it asked; one that reads nothing for :data:`STALL_S` is dropped (no timer is pending unless one waits: a
timer pending makes every wait of the loop's a timed one, which costs CPU at every request). GET and HEAD;
``Range: bytes=a-b``, ``a-`` and ``-n`` are answered with 206 and ``Content-Range``; a conditional request
(``If-None-Match``, ``If-Modified-Since``) of an unchanged object gets 304 without a body, as a cache
revalidating expects. S3 mode serves path-style requests (``/<bucket>/<key>``), the only S3 calls the peers
make when reading arrays (ranged and whole GETs, HEADs, and ListObjectsV2 of an array's keys, which stoker's
disk cache revalidates by), and ignores signatures: the peers read it anonymously. A listing page costs
what the page holds, not the whole tree: folders are walked in key order, those wholly before the page or
outside the prefix are skipped, and the walk stops once the page is full.

Every request, counted, waits ``latency_s`` before it is answered (requests on different connections
wait together, as behind a real network). ``GET /_stoker/counters`` (not delayed or counted) answers
``{"requests": n, "bytes": body bytes sent, "cpu_s": the server process's CPU seconds}``.

>>> with Served(root, "http", 20) as server:   # server.url: http://127.0.0.1:PORT
...     requests, nbytes, cpu_s = server.counters(cpu=True)
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import email.utils
import itertools
import json
import os
import re
import socket
import stat
import sys
import threading
import time
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from ..runtime.memo import remember

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
COUNTERS = "/_stoker/counters"
BUCKET = "bench"
#: Bodies up to this many bytes are read and sent with their headers in one send (sendfile's set-up on the
#: event loop costs more than copying them: a 72 KB chunk 95-135 us of the server's CPU against 165-210 us by
#: sendfile); larger ones with sendfile (a 737 KB chunk: 250-310 us against 375-405 us read and sent). Measured
#: with the loop's sendfile; with os.sendfile straight to the socket (now) a 72 KB chunk costs the same either way.
SMALL_BODY = 256 << 10
#: Folders whose sorted listing the S3 mode keeps (revalidated by the folder's mtime), at most.
MAX_FOLDERS = 8192
#: A folder's listing is kept only once its mtime is this old: where timestamps are coarse (1 s on ext3 and
#: HFS+, 2 s on FAT) a name added in the tick the folder was listed leaves its mtime as it was, and a listing
#: kept then would miss that name for as long as it is kept.
SETTLED_NS = 2_000_000_000
#: How long stopping waits for the connections it ended to be gone (they go at once: they are aborted).
CLOSE_S = 5.0
#: The longest an answer waits for its client to read (its unsent bytes to fall below the transport's low-water
#: mark, a ``sendfile`` to end): a client that stopped reading for that long is dropped (its connection aborted,
#: what was buffered for it freed), so it cannot hold the server's memory and a connection for ever.
STALL_S = 30.0
_REASONS = {200: "OK", 206: "Partial Content", 304: "Not Modified", 400: "Bad Request", 404: "Not Found",
            416: "Requested Range Not Satisfiable", 501: "Not Implemented"}


class BenchServer:
    """Serves ``root`` on ``127.0.0.1`` (a free port unless ``port``): :meth:`serve_forever` on a thread
    until :meth:`shutdown` (from another), then :meth:`server_close`, as ``socketserver`` servers do."""

    def __init__(self, root: str, latency_s: float = 0.0, s3: bool = False, port: int = 0) -> None:
        self.root, self.latency_s, self.s3 = root, latency_s, s3
        self._requests = self._bytes = 0
        self._lock = threading.Lock()
        self._folders: dict[str, tuple[int, list[str]]] = {}  # folder -> (its mtime_ns, its names: see _names)
        self._sock = socket.create_server(("127.0.0.1", port), backlog=256)  # many peers' connections at once
        self.server_address = self._sock.getsockname()
        # shutdown() asked: done from any thread, before or while serve_forever runs (its loop awaits it)
        self._stop: concurrent.futures.Future = concurrent.futures.Future()
        self._idle = threading.Event()  # serve_forever is not running
        self._idle.set()
        self._starting = threading.Lock()  # serve_forever's check of _stop and its clear of _idle, as one
        self._connections: set[asyncio.Task] = set()  # each open connection's task (on the loop thread)
        self._serving: int | None = None  # serve_forever's thread (its event loop's), while it runs
        self._date = (0, "")

    # -- counters ---------------------------------------------------------------------------------

    def count(self, nbytes: int, request: bool = True) -> None:
        with self._lock:
            self._requests += request
            self._bytes += nbytes

    def counters(self) -> dict:
        with self._lock:
            return {"requests": self._requests, "bytes": self._bytes, "cpu_s": time.process_time()}

    # -- running ----------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Answer requests until :meth:`shutdown` (from another thread); at once if it was asked before."""
        with self._starting:
            if self._stop.done():
                return
            self._idle.clear()
            self._serving = threading.get_ident()
        try:
            asyncio.run(self._serve())
        finally:
            self._serving = None
            self._idle.set()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._sock)
        try:
            await asyncio.wrap_future(self._stop)
        finally:
            server.close()  # no new connections
            # Since Python 3.12.1 Server.wait_closed (and so ``async with server``) waits for every connection
            # to end (cpython gh-79033), and an idle keep-alive one waits in readuntil for ever: end each here.
            # One way on every version (3.13's Server.close_clients would do the same from 3.13 on).
            tasks = list(self._connections)
            for task in tasks:
                task.cancel()
            try:
                if tasks:
                    await asyncio.wait(tasks, timeout=CLOSE_S)
                await asyncio.wait_for(server.wait_closed(), CLOSE_S)
            except asyncio.TimeoutError:  # not expected (every connection was ended): asyncio.run cancels the rest
                pass

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait (at most 10 s) until it has returned. Called on serve_forever's
        own thread (in a request's handling, on its event loop), it asks the stop and returns at once: the loop
        stops once control is back with it, which waiting here would block (for the whole 10 s)."""
        try:
            self._stop.set_result(None)
        except concurrent.futures.InvalidStateError:  # asked before
            pass
        if self._serving == threading.get_ident():
            return
        with self._starting:  # a serve_forever starting now has either seen the stop or cleared _idle
            pass
        self._idle.wait(10)

    def server_close(self) -> None:
        self._sock.close()

    # -- one connection ---------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stop.done():  # accepted as the server stops, after _serve ended the connections it knew
            writer.transport.abort()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # headers and body go out in separate sends: with Nagle's algorithm the body would wait for the
            # client's delayed ACK of the headers (40 ms on Linux), a delay no real server adds
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = asyncio.current_task()
        self._connections.add(task)  # type: ignore[arg-type]
        stalled = False
        try:
            while True:  # keep-alive (HTTP/1.1), as real servers
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _ = lines[0].split(" ", 2)
                except ValueError:
                    await self._send(writer, 400, {"Content-Length": "0", "Connection": "close"})
                    return
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                if length:  # a body no GET or HEAD has: read past it
                    await reader.readexactly(length)
                await self._request(method, target, headers, writer)
                if headers.get("connection", "").lower() == "close":
                    return
        except _Stalled:  # a client that stopped reading
            stalled = True
            return
        except (ConnectionError, OSError, asyncio.IncompleteReadError):  # a client that hung up
            return
        except asyncio.CancelledError:  # the server stopping with the connection open: it ends here (a task
            return  # left cancelled makes asyncio's stream callback log an error)
        finally:
            self._connections.discard(task)  # type: ignore[arg-type]
            if stalled or self._stop.done():
                writer.transport.abort()  # at once: close() would wait for a client that stopped reading
            else:
                writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, headers: dict, body: bytes = b"") -> None:
        now = int(time.time())
        if self._date[0] != now:  # the Date header, formatted once a second
            self._date = (now, email.utils.formatdate(now, usegmt=True))
        out = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nServer: stoker-bench\r\nDate: {self._date[1]}\r\n"]
        out += [f"{k}: {v}\r\n" for k, v in headers.items()]
        out.append("\r\n")
        writer.write("".join(out).encode("latin-1") + body)
        transport = writer.transport
        if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            # the client reads slower than it asks (or not at all): this waits for it, so the connection's
            # next request is not read, nor its answer buffered, before it does (checked first: drain's own
            # check costs a coroutine, and on loopback an answer mostly goes out whole at once)
            await _within(writer.drain())

    async def _request(self, method: str, target: str, headers: dict, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and target == COUNTERS:
            doc = json.dumps(self.counters()).encode()
            await self._send(writer, 200, {"Content-Type": "application/json", "Content-Length": str(len(doc))}, doc)
            return
        if method not in ("GET", "HEAD"):
            await self._send(writer, 501, {"Content-Length": "0"})
            return
        body = method == "GET"
        self.count(0)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        url = urlsplit(target)
        if self.s3 and "list-type=2" in url.query.split("&"):
            await self._list(url.path, parse_qs(url.query), body, writer)
            return
        path = self._file(url.path)
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            await self._send(writer, 404, {"Content-Length": "0"})
            return
        size = st.st_size
        start, end, status = 0, size, 200
        header = headers.get("range")
        if header:
            m = _RANGE.match(header.strip())
            if m and m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            elif m and m.group(2):  # suffix: the last n bytes
                start = max(0, size - int(m.group(2)))
            if m is None or start >= size or end <= start:
                await self._send(writer, 416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                return
            status = 206
        etag = _etag(st)
        modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        if _unchanged(headers, etag, st.st_mtime):  # a cache revalidating (tensorstore's): no body
            await self._send(writer, 304, {"ETag": etag, "Last-Modified": modified})
            return
        out = {"Content-Length": str(end - start), "Accept-Ranges": "bytes", "ETag": etag, "Last-Modified": modified}
        if status == 206:
            out["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if not body:
            await self._send(writer, status, out)
            return
        with open(path, "rb") as f:  # type: ignore[arg-type]
            if end - start <= SMALL_BODY:  # read and sent with the headers: one send, no sendfile set-up
                await self._send(writer, status, out, os.pread(f.fileno(), end - start, start))
            else:
                await self._send(writer, status, out)
                await self._sendfile(writer, f, start, end - start)
        self.count(end - start, request=False)

    async def _sendfile(self, writer: asyncio.StreamWriter, f, start: int, count: int) -> None:
        """``count`` bytes of ``f`` from ``start`` sent: as far as the socket takes them now, by ``os.sendfile``
        straight to it (the headers sent before it, so nothing of the transport's goes out after it); the rest,
        once the client reads, by the loop's ``sendfile`` within :data:`STALL_S`. The loop's for all of it cost
        more and needed a timer for every answer: a timer pending arms every wait of the loop's (epoll) with a
        timeout, which cost 30-60 us of the server's CPU per answer here."""
        sock = writer.get_extra_info("socket")
        if sock is not None and writer.transport.get_write_buffer_size() == 0 and hasattr(os, "sendfile"):
            fd, source = sock.fileno(), f.fileno()
            while count:
                try:
                    sent = os.sendfile(fd, source, start, count)
                except (BlockingIOError, InterruptedError):  # the socket's buffer is full: waited for below
                    break
                if sent == 0:  # the file is shorter than it was: the answer cannot be whole
                    raise ConnectionAbortedError("a file being served shrank")
                start += sent
                count -= sent
        if count:
            await _within(asyncio.get_running_loop().sendfile(writer.transport, f, start, count))

    async def _list(self, path: str, query: dict, body: bool, writer: asyncio.StreamWriter) -> None:
        """S3's ListObjectsV2 of the bucket (what a disk cache revalidates an array's objects with): the keys
        under ``prefix`` after ``start-after`` and ``continuation-token`` (the last key of the page before), at
        most ``max-keys`` (1,000), each with the size and ETag its HEAD states."""
        one = {k: v[0] for k, v in query.items()}
        if unquote(path).strip("/") != BUCKET:
            await self._send(writer, 404, {"Content-Length": "0"})
            return
        prefix = one.get("prefix", "")
        after = max(one.get("start-after", ""), one.get("continuation-token", ""))
        most = min(1000, int(one.get("max-keys", 1000)))
        found = self._keys(prefix, after, most + 1)  # one more: whether the page is the last
        page, more = found[:most], len(found) > most
        items = []
        for key in page:
            try:
                st = os.stat(os.path.join(self.root, *key.split("/")))
            except OSError:  # removed since it was listed
                continue
            items.append(f"<Contents><Key>{escape(key)}</Key><LastModified>"
                         f"{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(st.st_mtime))}</LastModified>"
                         f"<ETag>{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        token = f"<NextContinuationToken>{escape(page[-1])}</NextContinuationToken>" if more else ""
        doc = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
               f'2006-03-01/"><Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(items)}</KeyCount>'
               f"<MaxKeys>{most}</MaxKeys><IsTruncated>{'true' if more else 'false'}</IsTruncated>{''.join(items)}"
               f"{token}</ListBucketResult>").encode()
        await self._send(writer, 200, {"Content-Type": "application/xml", "Content-Length": str(len(doc))},
                         doc if body else b"")
        if body:
            self.count(len(doc), request=False)

    def _keys(self, prefix: str, after: str, n: int) -> list[str]:
        """The first ``n`` keys under ``prefix`` after ``after``, in key order (see :meth:`_walk`)."""
        return list(itertools.islice(self._walk(self.root, "", prefix, after), n))

    def _walk(self, folder: str, rel: str, prefix: str, after: str) -> Iterator[str]:
        """The keys under ``folder`` (whose keys start with ``rel``: "" or ending in "/") that start with
        ``prefix`` and come after ``after``, in key order, lazily. Names sort with a "/" after each folder's
        (so ``a.x`` comes before ``a/b``, as S3 orders keys); a folder starts where ``after`` or ``prefix``
        falls among them (bisected), folders wholly before the page or outside the prefix are not entered,
        and the names past the prefix are not looked at: a page costs the folders on its path and its keys."""
        names = self._names(folder)
        lo = max(after[len(rel):] if after.startswith(rel) else "", prefix[len(rel):] if prefix.startswith(rel) else "")
        i = bisect.bisect_left(names, lo)
        if i and names[i - 1].endswith("/") and lo.startswith(names[i - 1]):
            i -= 1  # the folder holding the first key
        for name in names[i:]:
            key = rel + name
            if key > prefix and not key.startswith(prefix) and not prefix.startswith(key):
                return  # past the prefix: every name after it too
            if name.endswith("/"):
                if (key.startswith(prefix) or prefix.startswith(key)) and not (after > key and not after.startswith(key)):
                    yield from self._walk(os.path.join(folder, name[:-1]), key, prefix, after)
            elif key.startswith(prefix) and key > after:
                yield key

    def _names(self, folder: str) -> list[str]:
        """The names in ``folder``, sorted, a folder's with a "/" after it; kept while its mtime stays, once
        that is :data:`SETTLED_NS` old (a folder changed in the last tick of a coarse clock is listed anew)."""
        try:
            mtime = os.stat(folder).st_mtime_ns
        except OSError:
            return []
        held = self._folders.get(folder)
        if held is not None and held[0] == mtime:
            return held[1]
        names = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        names.append(entry.name + "/" if entry.is_dir() else entry.name)
                    except OSError:  # removed since listed
                        continue
        except OSError:
            return []
        names.sort()
        if time.time_ns() - mtime < SETTLED_NS:  # (a mtime ahead of this clock too: not kept)
            return names
        remember(self._folders, folder, (mtime, names), MAX_FOLDERS)
        return names

    def _file(self, path: str) -> str | None:
        """The file a request's path names, or None (outside the root, or another bucket)."""
        parts = [p for p in unquote(path).split("/") if p]
        if self.s3:
            if not parts or parts[0] != BUCKET:
                return None
            parts = parts[1:]
        if not parts or any(p in (".", "..") for p in parts):
            return None
        return os.path.join(self.root, *parts)


class _Stalled(ConnectionError):
    """A client read nothing of an answer for :data:`STALL_S`: its connection is dropped."""


async def _within(step) -> None:
    """Await ``step`` (a drain, a sendfile: the client reading an answer), at most :data:`STALL_S`; then
    :class:`_Stalled`. A timer that cancels the task, not ``asyncio.wait_for``: no task made per answer (and
    ``asyncio.timeout`` is 3.11's); cancelling, not aborting the transport: a ``sendfile`` in progress waits on
    the socket itself, and would wait for ever on a socket the abort closed under it."""
    task = asyncio.current_task()
    stalled: list[bool] = []

    def stall() -> None:
        stalled.append(True)
        task.cancel()  # type: ignore[union-attr]

    timer = asyncio.get_running_loop().call_later(STALL_S, stall)
    try:
        await step
    except asyncio.CancelledError:
        if stalled:
            if hasattr(task, "uncancel"):  # 3.11+: the cancel was this timer's, handled here
                task.uncancel()  # type: ignore[union-attr]
            raise _Stalled(f"the client read nothing for {STALL_S:g} s") from None
        raise
    finally:
        timer.cancel()


def _etag(st: os.stat_result) -> str:
    """A file's ETag: changes when it is rewritten (inode, mtime, size)."""
    return f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'


def _unchanged(headers: dict, etag: str, mtime: float) -> bool:
    """Whether a conditional request's object is unchanged (answered 304, as S3 and HTTP servers do):
    ``If-None-Match`` naming its ETag (or ``*``), else ``If-Modified-Since`` not before its mtime."""
    match = headers.get("if-none-match")
    if match is not None:
        return any(tag.strip() in (etag, "*", "W/" + etag) for tag in match.split(","))
    since = headers.get("if-modified-since")
    if since is not None:
        try:
            return int(mtime) <= email.utils.parsedate_to_datetime(since).timestamp()
        except (TypeError, ValueError):
            return False
    return False


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

    def counters(self, cpu: bool = False) -> tuple:
        """``(requests, bytes)`` served so far; with ``cpu``, ``(requests, bytes, cpu_s)``: also the server
        process's CPU seconds so far (what the loopback server cost; a remote server's is not the peers')."""
        from urllib.request import urlopen

        with urlopen(self.url + COUNTERS, timeout=30) as r:
            doc = json.loads(r.read())
        return (doc["requests"], doc["bytes"], doc["cpu_s"]) if cpu else (doc["requests"], doc["bytes"])

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
    server.serve_forever()


if __name__ == "__main__":
    main()
