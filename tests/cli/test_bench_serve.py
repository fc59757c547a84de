"""The bench server's S3 listing (ListObjectsV2): a page costs what it holds, not the whole tree, and what
obstore's S3 client lists through it (pages, start-after; raw pages under a prefix that ends mid-name too)
is every key in S3's order with the size and ETag a HEAD states."""

from __future__ import annotations

import asyncio.base_events
import http.client
import os
import socket
import sys
import threading
import time
import urllib.request

import pytest

from stoker.bench.serve import BUCKET, BenchServer
from stoker.storage import ObjectStore

N_ARRAYS = 120
N_CHUNKS = 10


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for i in range(N_ARRAYS):
        folder = root / "g" / f"a{i:03d}"
        (folder / "c").mkdir(parents=True)
        (folder / "zarr.json").write_bytes(b"{}" * (i + 1))
        for j in range(N_CHUNKS):
            (folder / "c" / str(j)).write_bytes(bytes([j]) * (j + 1))
    (root / "g" / "a005.x").write_bytes(b"x")  # sorts before g/a005/... in S3's order ('.' < '/')
    (root / "g" / "a005-y").write_bytes(b"y")
    keys = sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                  for d, _, files in os.walk(root) for f in files)
    server = BenchServer(str(root), 0.0, s3=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, keys, server
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def _page(server, **query) -> bytes:
    url = f"http://127.0.0.1:{server.server_address[1]}/{BUCKET}?list-type=2&" + "&".join(
        f"{k}={v}" for k, v in query.items())
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read()


@pytest.fixture
def scanned(monkeypatch) -> list[str]:
    """The folders os.scandir lists from now on, in order."""
    folders: list[str] = []
    real = os.scandir

    def scandir(path):
        folders.append(str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return folders


def test_a_list_page_reads_the_folders_on_its_path_not_the_tree(tree, scanned):
    root, keys, server = tree
    doc = _page(server, prefix="g/a100", **{"max-keys": 5})
    assert doc.count(b"<Key>") == 5 and b"<Key>g/a100/c/0</Key>" in doc and b"<IsTruncated>true" in doc
    # the root, g, g/a100, g/a100/c: not the 120 arrays' 240 folders
    assert len(scanned) <= 4, scanned
    scanned.clear()
    doc = _page(server, prefix="g/", **{"start-after": "g/a060/c/5", "max-keys": 3})
    assert [k for k in keys if k.startswith("g/") and k > "g/a060/c/5"][:3] == \
        [part.split(b"</Key>")[0].decode() for part in doc.split(b"<Key>")[1:]]
    assert len(scanned) <= 4, scanned  # at most the folders on the page's path (some kept from before)
    # a prefix that ends mid-name: the keys that start with it, whichever folder they are in
    doc = _page(server, prefix="g/a005", **{"max-keys": 4})
    assert [part.split(b"</Key>")[0].decode() for part in doc.split(b"<Key>")[1:]] == \
        [k for k in keys if k.startswith("g/a005")][:4] == ["g/a005-y", "g/a005.x", "g/a005/c/0", "g/a005/c/1"]


def test_obstore_lists_every_key_in_order_with_its_heads_version(tree):
    root, keys, server = tree
    url = f"http://127.0.0.1:{server.server_address[1]}"
    store = ObjectStore(f"s3://{BUCKET}", {"endpoint": url, "region": "us-east-1", "skip_signature": True,
                                           "allow_http": True})
    try:
        listed = store.list_versions("g")  # more than one page of 1,000 keys
        assert [k for k, _ in listed] == [k for k in keys if k.startswith("g/")]
        heads = store.versions([k for k, _ in listed[::97]])
        assert [v for _, v in listed[::97]] == heads
        # a page at a time, after an offset (obstore lists a prefix as a folder: "g/a011" asks "g/a011/")
        pairs, more = store.result_of(store.start_list_versions("g", "g/a005.x", 4))
        assert [k for k, _ in pairs] == [k for k in keys if k.startswith("g/") and k > "g/a005.x"][:4] and more
        pairs, more = store.result_of(store.start_list_versions("g/a011", None, 1000))
        assert [k for k, _ in pairs] == [k for k in keys if k.startswith("g/a011/")] and not more
        assert store.list_versions("g/nothing") == [] and store.list_versions("g/a00") == []
    finally:
        store.close()


async def _wait_closed_as_in_312(self):
    """Python 3.12.1's ``asyncio.Server.wait_closed`` (cpython gh-79033): it waits until every connection
    has ended, not only until the server was closed (3.10 and 3.11 return once it is closed)."""
    if self._waiters is None:
        return
    waiter = self._loop.create_future()
    self._waiters.append(waiter)
    await waiter


@pytest.fixture
def server_of(tmp_path, monkeypatch):
    """``server_of(files, s3=False)``: a BenchServer of a folder of ``files`` (path -> bytes) serving on a
    thread, and the thread. Its ``asyncio.Server.wait_closed`` is 3.12.1's on every interpreter (emulated before 3.12.1,
    the version that made it wait for the connections): a shutdown that leaves a connection open then hangs
    here as it would there."""
    if sys.version_info < (3, 12, 1):
        monkeypatch.setattr(asyncio.base_events.Server, "wait_closed", _wait_closed_as_in_312)
    started = []

    def start(files: dict[str, bytes], s3: bool = False):
        for name, data in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(data)
        server = BenchServer(str(tmp_path), s3=s3)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return server, thread

    yield start
    for server, thread in started:
        server.shutdown()
        thread.join(10)
        server.server_close()


def _shutdown_time(server, thread) -> float:
    t0 = time.monotonic()
    server.shutdown()
    took = time.monotonic() - t0
    thread.join(2)
    assert not thread.is_alive(), "serve_forever did not return: its thread and event loop stay behind"
    return took


@pytest.mark.timeout(60)
def test_shutdown_ends_an_idle_keep_alive_connection(server_of):
    server, thread = server_of({"k": b"x"})
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    try:
        conn.request("GET", "/k")
        assert conn.getresponse().read() == b"x"  # the connection stays open, idle, as a client's pool keeps it
        assert _shutdown_time(server, thread) < 2
        try:  # and the server ended it
            assert conn.sock.recv(1) == b""
        except ConnectionResetError:
            pass
    finally:
        conn.close()


def test_shutdown_before_serving_starts_ends_serve_forever_at_once(server_of, tmp_path):
    server = BenchServer(str(tmp_path))  # (server_of: with 3.12.1's wait_closed here too)
    try:
        server.shutdown()  # serve_forever not running yet: returns at once, and serve_forever will too
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        thread.join(2)
        assert not thread.is_alive()
    finally:
        server.server_close()


def _stuck(server, wait_s: float = 0.5, limit_s: float = 20.0) -> int:
    """The bytes the server has sent once they stop growing for ``wait_s`` (its client reads nothing)."""
    deadline = time.monotonic() + limit_s
    last = -1
    while time.monotonic() < deadline:
        now = server.counters()["bytes"]
        if now == last:
            return now
        last = now
        time.sleep(wait_s)
    raise AssertionError(f"the server kept sending for {limit_s} s to a client that reads nothing")


def _read_all(sock, limit_s: float = 10.0) -> int:
    """The bytes ``sock`` reads until the server ends the connection (EOF or reset)."""
    sock.settimeout(limit_s)
    n = 0
    try:
        while chunk := sock.recv(1 << 20):
            n += len(chunk)
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"the server kept the connection {limit_s} s after the last byte it sent") from None
    return n


@pytest.mark.timeout(60)
def test_shutdown_ends_a_connection_whose_client_stopped_reading(server_of):
    server, thread = server_of({"k": os.urandom(200 << 10)})
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        # 20 MB of answers asked and none read: the server waits with what the socket buffers do not hold, which
        # a graceful close would flush first (for ever)
        sock.sendall(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
        assert 0 < _stuck(server) < 100 * (200 << 10)
        assert _shutdown_time(server, thread) < 2


def _backlog_bound(rcvbuf: int, body: int) -> int:
    """What a server may have sent a client that reads nothing: the socket buffers both ends (the kernel's
    largest send buffer; the receive buffer asked, which Linux doubles), the transport's high-water mark
    (asyncio's default 64 KiB) and one answer over it."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        wmem = int(f.read().split()[2])
    return wmem + 2 * rcvbuf + (64 << 10) + body + (256 << 10)


@pytest.mark.timeout(60)
def test_a_client_that_stops_reading_holds_the_socket_buffers_not_every_answer(server_of):
    body = os.urandom(200 << 10)  # sent with its headers in one write (not sendfile, which waits itself)
    server, _ = server_of({"k": body})
    n = 200  # 40 MB of answers
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        asked = threading.Thread(target=sock.sendall, args=(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n" * n,))
        asked.start()  # (the server stops reading requests too: these may wait in the socket)
        sent = _stuck(server)
        assert sent <= _backlog_bound(64 << 10, len(body)) < n * len(body), sent
        # and once the client reads, every answer comes, whole
        asked.join(30)
        got = _read_answers(sock, n, len(body))
        assert got == n
        # the server counts an answer once its write returned, which may be after the client read it
        deadline = time.monotonic() + 10
        while server.counters()["bytes"] < n * len(body) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.counters()["bytes"] == n * len(body)


def _read_answers(sock, n: int, size: int) -> int:
    """Read ``n`` answers of a ``size``-byte body each from ``sock``; how many came whole."""
    sock.settimeout(30)
    f = sock.makefile("rb")
    whole = 0
    for _ in range(n):
        line = f.readline()
        if not line.startswith(b"HTTP/1.1 200"):
            break
        length = None
        while (line := f.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length != size or len(f.read(length)) != size:
            break
        whole += 1
    return whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [200 << 10, 1 << 20], ids=["with-headers", "sendfile"])
def test_a_client_that_reads_nothing_for_stall_s_is_dropped(server_of, monkeypatch, size):
    from stoker.bench import serve

    monkeypatch.setattr(serve, "STALL_S", 0.5, raising=False)
    server, thread = server_of({"k": os.urandom(size)})
    n = 100
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        asked = threading.Thread(target=_send_quietly, args=(sock, b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n" * n))
        asked.start()
        _stuck(server)
        time.sleep(1.5)  # past STALL_S with nothing read: dropped
        got = _read_all(sock)
        asked.join(30)
    assert got < n * size  # what the buffers held, then the end: not every answer
    # and the server goes on serving others
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    try:
        conn.request("GET", "/k")
        assert len(conn.getresponse().read()) == size
    finally:
        conn.close()
    assert _shutdown_time(server, thread) < 2


def _send_quietly(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server ended the connection before it took them all
        pass


@pytest.mark.timeout(60)
def test_shutdown_on_the_servers_own_thread_returns_at_once_and_stops_it(server_of, tmp_path):
    from stoker.bench.serve import BenchServer

    took: list[float] = []

    class Stopping(BenchServer):
        async def _request(self, method, target, headers, writer):
            if target == "/stop":  # the request's handling, on the server's event loop thread, stops it
                t0 = time.monotonic()
                self.shutdown()
                took.append(time.monotonic() - t0)
            await super()._request(method, target, headers, writer)

    (tmp_path / "k").write_bytes(b"x")
    server = Stopping(str(tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        try:
            conn.request("GET", "/stop")
            conn.getresponse().read()
        except (http.client.HTTPException, OSError):  # the answer may be cut by the stop
            pass
        finally:
            conn.close()
        thread.join(5)
        assert took and took[0] < 1, took  # not the 10 s shutdown waits for serve_forever to return
        assert not thread.is_alive()
    finally:
        server.shutdown()
        server.server_close()


def test_a_folder_changed_within_its_mtimes_tick_is_listed_anew(server_of, tmp_path, scanned):
    server, _ = server_of({"g/a": b"a", "old/a": b"a"}, s3=True)

    def keys(prefix: str) -> list[str]:
        doc = _page(server, prefix=prefix)
        return [part.split(b"</Key>")[0].decode() for part in doc.split(b"<Key>")[1:]]

    folder = tmp_path / "g"
    st = os.stat(folder)
    assert keys("g/") == ["g/a"]
    # a name added in the same tick of a coarse clock (1 s on ext3, 2 s on FAT) leaves the folder's mtime as it
    # was: emulated here by setting it back
    (folder / "b").write_bytes(b"b")
    os.utime(folder, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert keys("g/") == ["g/a", "g/b"]
    # a folder whose mtime is older than a tick is listed once while it stays, and anew once it changes
    old = time.time_ns() - 60 * 10**9
    os.utime(tmp_path / "old", ns=(old, old))
    assert keys("old/") == ["old/a"]
    scanned.clear()
    assert keys("old/") == ["old/a"] and str(tmp_path / "old") not in scanned
    (tmp_path / "old" / "b").write_bytes(b"b")
    assert keys("old/") == ["old/a", "old/b"] and str(tmp_path / "old") in scanned
