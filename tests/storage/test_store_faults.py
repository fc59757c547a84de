"""What each fault of a remote store does: a loopback HTTP server (tests/range_server.py) that answers
503s and 429s, waits, cuts bodies short or stops, and the outcome each must have: retried to success,
or a typed error naming the URI, key, status and attempts, in bounded time."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from stoker.errors import InvalidArgument, NotFound, ShutdownError, StorageError
from stoker import Config
from stoker.storage import ByteRange, ObjectStore, open_store
from stoker.storage.locate import Stores, locate, options_for
from stoker.storage.uri import check_remote_url

from range_server import RangeServer

VALUE = bytes(range(256)) * 200  # 51,200 bytes


@pytest.fixture
def server(tmp_path):
    with open(tmp_path / "value", "wb") as f:
        f.write(VALUE)
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "c" / "0", "wb") as f:
        f.write(VALUE[:1000])
    srv = RangeServer(str(tmp_path))
    yield srv
    srv.stop()


def store(server, **settings) -> ObjectStore:
    options = {"timeout_s": 5.0, "retries": 4, "backoff_s": 0.01, "max_backoff_s": 0.05}
    options.update(settings)
    return ObjectStore(server.url, **options)


def test_503_storm_is_retried_to_success(server):
    s = store(server)
    server.fail(3)
    assert bytes(s.get("value")) == VALUE
    assert server.requests == 4
    server.fail(3)
    got = s.get_ranges([ByteRange("value", 100, 50)])
    assert bytes(got[0]) == VALUE[100:150]


def test_429_is_retried(server):
    s = store(server)
    server.fail(2, status=429)
    assert bytes(s.get_ranges([ByteRange.suffix("value", 16)])[0]) == VALUE[-16:]
    assert server.requests == 3


def test_endless_503_is_a_storage_error_naming_uri_key_status_attempts(server):
    s = store(server, retries=2)
    server.fail(100)
    with pytest.raises(StorageError) as info:
        s.get_ranges([ByteRange("c/0", 0, 10)])
    e = info.value
    assert (e.uri, e.key, e.status, e.attempts) == (server.url, "c/0", 503, 3)
    assert server.requests == 3
    assert "c/0" in str(e) and "503" in str(e) and "3 attempts" in str(e)


def test_missing_key_is_not_found_at_once(server):
    s = store(server)
    with pytest.raises(NotFound) as info:
        s.get("c/1")
    assert info.value.key == "c/1" and info.value.uri == server.url
    assert not s.exists("c/1")
    assert server.requests == 2  # no retries


def test_refusal_is_not_retried(server):
    s = store(server)
    server.fail(1, status=403)
    with pytest.raises(StorageError) as info:
        s.get("value")
    assert (info.value.status, info.value.attempts) == (403, 1)


def test_truncated_body_is_retried_then_an_error_never_short_data(server):
    s = store(server, retries=2)
    server.truncate(1)
    assert bytes(s.get("value")) == VALUE  # a dropped connection, tried again
    server.truncate(100)
    with pytest.raises(StorageError) as info:
        s.get_ranges([ByteRange("value", 0, 40_000)])
    assert info.value.key == "value" and info.value.attempts == 3
    with pytest.raises(StorageError):
        s.get("value")


def test_short_but_consistent_body_is_an_error_never_short_data(server):
    """A server (or proxy) that answers fewer bytes than asked with headers that agree."""
    s = store(server, retries=1)
    server.shorten(1)
    assert bytes(s.get_ranges([ByteRange("value", 10, 1000)])[0]) == VALUE[10:1010]
    server.shorten(100)
    with pytest.raises(StorageError) as info:
        s.get_ranges([ByteRange("value", 10, 1000)])
    assert info.value.attempts == 2 and "short" in str(info.value)


def test_a_server_that_ignores_ranges_is_an_error_naming_it_never_the_whole_value_as_the_range(server, tmp_path):
    """A server without range support answers a ranged GET with the whole value and 200: never taken as the
    range (of a shard: its index, its inner chunks), at once (no try mends it), with a message that says the
    server ignores ranges rather than blaming credentials; whole values (a plain array's chunks) read."""
    import numpy as np
    import zarr

    import stoker

    server.ignore_ranges = True
    s = store(server)
    assert bytes(s.get("value")) == VALUE
    for r in (ByteRange("value", 10, 1000), ByteRange.suffix("value", 100), ByteRange("value", 0, len(VALUE))):
        with pytest.raises(StorageError, match="ignores byte ranges") as info:
            s.get_ranges([r])
        assert info.value.key == "value" and info.value.attempts == 1
        assert "credentials" not in str(info.value)
    data = np.arange(16 * 16, dtype="int32").reshape(16, 16)
    zarr.create_array(str(tmp_path / "plain"), shape=data.shape, chunks=(8, 8), dtype="int32")[...] = data
    zarr.create_array(str(tmp_path / "sharded"), shape=data.shape, chunks=(4, 4), shards=(8, 8), dtype="int32")[...] = data
    options = {"timeout_s": 5.0, "retries": 1, "backoff_s": 0.01}
    assert np.array_equal(stoker.open_array(f"{server.url}/plain", options)[...], data)
    with pytest.raises(StorageError, match="ignores byte ranges"):
        stoker.open_array(f"{server.url}/sharded", options)[...]


def test_added_latency_within_the_timeout_reads(server):
    s = store(server, timeout_s=5.0)
    server.latency_s = 0.2
    assert bytes(s.get_ranges([ByteRange("value", 0, 8)])[0]) == VALUE[:8]


@pytest.mark.timeout(30)
def test_latency_past_the_timeout_is_a_storage_error(server):
    s = store(server, timeout_s=0.3, retries=1)
    server.latency_s = 2.0
    with pytest.raises(StorageError) as info:
        s.get("value")
    assert info.value.attempts == 2 and info.value.key == "value"


@pytest.mark.timeout(30)
def test_an_attempt_that_never_answers_is_cut_off_and_retried(server):
    """The store's own per-attempt limit (obstore's timeouts, plus slack), for a request that never ends
    whatever obstore does: each attempt is cancelled at that limit, retried, then a StorageError."""
    s = store(server, timeout_s=0.2, connect_timeout_s=0.2, retries=1)
    started = []

    async def never():
        started.append(1)
        await asyncio.sleep(60)

    with pytest.raises(StorageError, match="timed out") as info:
        s._run(s._attempts("value", "read", never))
    assert info.value.attempts == 2 and len(started) == 2


@pytest.mark.timeout(30)
def test_server_stopped_mid_run_is_a_storage_error_in_bounded_time(server):
    s = store(server, retries=2)
    assert bytes(s.get_ranges([ByteRange("value", 0, 100)])[0]) == VALUE[:100]
    server.stop()
    with pytest.raises(StorageError) as info:
        s.get_ranges([ByteRange("value", 100, 100), ByteRange("c/0", 0, 10)])
    assert info.value.attempts == 3 and info.value.key in ("value", "c/0")


@pytest.mark.timeout(30)
def test_close_cancels_reads_in_flight(server):
    s = store(server, timeout_s=10.0)
    server.latency_s = 5.0
    outcome = []
    started = threading.Event()

    def read():
        started.set()
        try:
            s.get("value")
            outcome.append("read")
        except Exception as exc:
            outcome.append(exc)

    t = threading.Thread(target=read)
    t.start()
    started.wait(5)
    while not s._pending:  # the read is on the loop
        t.join(0.01)
    s.close()
    t.join(10)
    assert not t.is_alive() and isinstance(outcome[0], ShutdownError)
    with pytest.raises(ShutdownError):
        s.get("value")


def _wait_in_flight(server, n: int) -> None:
    for _ in range(1000):  # bounded: 10 s
        if server.in_flight >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"the server never had {n} request(s) in flight")


def test_a_request_queued_behind_a_stalled_one_gives_up_within_the_callers_bound(server):
    """A pipeline's stores share its requests_in_flight slots. With the server stalled on the request that
    holds the only slot, another store's read waits for that slot no longer than its own bound (every
    try's limit plus backoffs), then a StorageError names its key and says it waited for a slot."""
    stores = Stores(requests_in_flight=1)
    loc = locate(f"{server.url}/value")
    slow, _ = stores.get(loc, {"timeout_s": 30.0, "retries": 0})
    quick, _ = stores.get(loc, {"timeout_s": 0.3, "connect_timeout_s": 0.3, "retries": 0, "retry_timeout_s": 0.3,
                                "max_backoff_s": 0.01})
    assert slow is not quick
    server.latency_s = 10.0  # the server stalls
    outcome: list = []
    holder = threading.Thread(target=lambda: outcome.append(_outcome(slow.get, "value")))
    holder.start()
    try:
        _wait_in_flight(server, 1)  # the slow store's request holds the slot
        with pytest.raises(StorageError, match="free request slot") as err:
            quick.get("c/0")
        assert err.value.key == "c/0" and err.value.attempts == 0 and err.value.waited_s > 0
        assert "requests_in_flight" in str(err.value) and server.requests == 1  # it never went out
    finally:
        stores.close()  # cancels the stalled read
        holder.join(10)
    assert not holder.is_alive() and isinstance(outcome[0], ShutdownError)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - what the read ended with
        return exc


def test_queue_timeout_s_bounds_a_wait_for_one_of_the_calls_slots(server):
    s = store(server, max_gap=0, max_in_flight=1, timeout_s=20.0, queue_timeout_s=0.2)
    server.latency_s = 10.0  # the first range's request stalls, holding the call's only slot
    with pytest.raises(StorageError, match="free request slot") as err:
        s.get_ranges([ByteRange("value", 0, 10), ByteRange("c/0", 900, 10)])
    assert err.value.key == "c/0" and "max_in_flight=1" in str(err.value)
    server.latency_s = 1.0
    got = s.get_each([ByteRange("value", 0, 10), ByteRange("c/0", 900, 10)])  # each range its own outcome
    assert bytes(got[0]) == VALUE[:10]
    assert isinstance(got[1], StorageError) and got[1].key == "c/0" and "free request slot" in str(got[1])
    with pytest.raises(InvalidArgument, match="queue_timeout_s"):
        store(server, queue_timeout_s=0)
    s.close()


def test_near_ranges_are_one_request(server):
    s = store(server, max_gap=1000)
    requests = [ByteRange("value", off, 100) for off in (0, 500, 150, 1200, 30_000)]
    got = s.get_ranges(requests)
    assert [bytes(g) for g in got] == [VALUE[r.start:r.start + 100] for r in requests]
    assert server.requests == 2  # 0..1300 merged; 30,000 is too far


def test_requests_run_at_once_up_to_max_in_flight(server):
    s = store(server, max_gap=0, max_in_flight=3)
    server.latency_s = 0.3  # every request waits: several are in flight together
    requests = [ByteRange("value", off, 10) for off in range(0, 9000, 1000)]
    assert [bytes(g) for g in s.get_ranges(requests)] == [VALUE[r.start:r.start + 10] for r in requests]
    assert server.requests == 9 and 2 <= server.peak_in_flight <= 3


def test_get_each_runs_its_ranges_at_once_and_fails_them_one_by_one(server):
    # A range's failure (missing key, past the end, a 503 storm that outlasts its retries) is its own: the
    # other ranges of the call still get their bytes. Every range is a request of its own, run together.
    s = store(server, max_in_flight=8, retries=1)
    server.latency_s = 0.3  # every request waits: they are in flight together
    requests = [ByteRange("value", 0, 10), ByteRange.suffix("nope", 4), ByteRange("c/0", 990, 20),
                ByteRange.suffix("c/0", 16), ByteRange("value", 5000, 100)]
    got = s.get_each(requests)
    assert bytes(got[0]) == VALUE[:10] and bytes(got[3]) == VALUE[984:1000] and bytes(got[4]) == VALUE[5000:5100]
    assert isinstance(got[1], NotFound) and got[1].key == "nope"
    assert isinstance(got[2], StorageError) and got[2].key == "c/0"
    assert server.requests == 5 and server.peak_in_flight >= 2
    server.latency_s = 0
    server.fail(100)
    got = s.get_each([ByteRange("value", 0, 10)])
    assert isinstance(got[0], StorageError) and got[0].status == 503 and got[0].attempts == 2
    s.close()
    with pytest.raises(ShutdownError):
        s.get_each([ByteRange("value", 0, 10)])


def test_settings_are_checked(server):
    with pytest.raises(InvalidArgument):
        store(server, retries=-1)
    with pytest.raises(InvalidArgument):
        store(server, timeout_s=0)
    with pytest.raises(InvalidArgument):
        ObjectStore(server.url, {"timeout": "5s"})
    with pytest.raises(InvalidArgument):
        ObjectStore(server.url, {"no_such_option": 1})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_after_obstore_ran_is_refused_at_once(server):
    """obstore's runtime does not survive a fork of a process that used it: a request in the child would wait
    out its timeout (or for ever). The child gets a StorageError at once that names the fix, for a store it
    inherited and for one it makes; the parent's store still works."""
    import multiprocessing as mp

    s = store(server)
    assert bytes(s.get("value")) == VALUE
    ctx = mp.get_context("fork")
    out = ctx.Queue()

    def child():
        said = []
        for make in (lambda: s, lambda: store(server)):
            try:
                make().get("value")
                said.append("read")
            except StorageError as exc:
                said.append((type(exc).__name__, "forkserver" in str(exc)))
        out.put(said)

    p = ctx.Process(target=child)
    p.start()
    try:
        # bounded: a refused read answers at once; a request left to the dead runtime waits its bound (80 s)
        said = out.get(timeout=30)
    finally:
        if p.is_alive():
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert said == [("StorageError", True)] * 2, said
    assert bytes(s.get("value")) == VALUE


def test_credentials_and_queries_in_a_url_are_refused_never_printed(server):
    # obstore never sends a URL's user:password (nor its query): refused, and the refusal does not repeat them.
    host = server.url.split("://", 1)[1]
    for url in (f"http://user:s3cr3tpw@{host}", f"http://s3cr3tpw@{host}", f"{server.url}/root?sig=s3cr3tpw",
                "s3://key:s3cr3tpw@bucket"):
        with pytest.raises(InvalidArgument) as info:
            ObjectStore(url, retries=0)
        assert "s3cr3tpw" not in str(info.value) and "s3cr3tpw" not in info.value.context["uri"], url
        assert "storage_options" in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        open_store(f"http://user:s3cr3tpw@{host}/root")
    assert "s3cr3tpw" not in str(info.value)
    from stoker.storage.locate import locate

    with pytest.raises(InvalidArgument) as info:  # a path locate refuses on its own (..) names no password
        locate(f"http://user:s3cr3tpw@{host}/a/../b")
    assert "s3cr3tpw" not in str(info.value)
    assert server.requests == 0
    check_remote_url("abfs://container@account.dfs.core.windows.net/x")  # Azure's spelling: no password


def test_config_repr_hides_storage_options():
    cfg = Config(storage_options={"s3://bucket/": {"secret_access_key": "s3cr3tpw"}})
    assert "s3cr3tpw" not in repr(cfg) and "s3cr3tpw" not in str(cfg)
    assert cfg.storage_options["s3://bucket/"]["secret_access_key"] == "s3cr3tpw"


def test_options_apply_under_their_prefix_only():
    by_prefix = {"https://host": {"a": 1}, "s3://data": {"b": 2}, "s3://data/x/": {"c": 3}}
    assert options_for(by_prefix, "https://host") == {"a": 1}
    assert options_for(by_prefix, "https://host/g.zarr/a") == {"a": 1}
    assert options_for(by_prefix, "https://host.evil.com/g.zarr/a") is None
    assert options_for(by_prefix, "https://host:8443/g.zarr/a") is None
    assert options_for(by_prefix, "s3://data-public/g.zarr") is None
    assert options_for(by_prefix, "s3://data/g.zarr") == {"b": 2}
    assert options_for(by_prefix, "s3://data/x/g.zarr") == {"c": 3}  # the longest prefix


def test_a_value_announced_larger_than_max_value_bytes_is_refused_unread(server):
    s = store(server, max_value_bytes=50_000)
    with pytest.raises(StorageError, match="51,200 bytes as the server announces it.*max_value_bytes") as info:
        s.get("value")
    assert (info.value.key, info.value.attempts, info.value.announced_size) == ("value", 1, 51_200)
    assert bytes(s.get("c/0")) == VALUE[:1000]  # within the bound
    assert bytes(store(server).get("value")) == VALUE  # (2 GiB by default)
    with pytest.raises(InvalidArgument, match="max_value_bytes"):
        store(server, max_value_bytes=0)


@pytest.mark.timeout(60)
def test_a_server_announcing_a_terabyte_is_a_storage_error_not_an_abort(tmp_path):
    # obstore reserves the announced size at once when it reads a body whole: a terabyte aborted the process
    import subprocess
    import sys

    script = tmp_path / "liar.py"
    script.write_text(
        "import threading\n"
        "from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer\n"
        "import stoker\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    protocol_version = 'HTTP/1.1'\n"
        "    def log_message(self, *a): pass\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.send_header('Content-Length', str(1 << 40)); self.end_headers()\n"
        "        try:\n"
        "            for _ in range(4096): self.wfile.write(b' ' * (1 << 16))\n"
        "        except OSError: pass\n"
        "srv = ThreadingHTTPServer(('127.0.0.1', 0), H); srv.daemon_threads = True\n"
        "threading.Thread(target=srv.serve_forever, daemon=True).start()\n"
        "try:\n"
        "    stoker.open_array(f'http://127.0.0.1:{srv.server_address[1]}/a.zarr', {'timeout_s': 5.0, 'retries': 0})\n"
        "except stoker.StorageError as e:\n"
        "    print('StorageError', e)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "StorageError" in done.stdout and "1,099,511,627,776 bytes" in done.stdout


@pytest.mark.timeout(60)
def test_a_fault_of_the_event_loop_thread_fails_pending_and_later_requests_at_once(server, monkeypatch):
    """The event loop that runs every store's requests raising past asyncio's own handling ended its thread:
    a read in flight waited to its timeout (30 s here) and then blamed the store. Now it, and every later
    request of any store, fails at once with an InternalError naming the thread, chained to the fault."""
    from stoker.errors import InternalError
    from stoker.storage.objectstore import _Loop

    monkeypatch.setattr(_Loop, "_current", None)  # a loop of this test's own (the process's is put back after)
    s = store(server, timeout_s=30.0, retries=0)
    assert bytes(s.get("c/0")) == VALUE[:1000]  # the loop runs
    loop = _Loop.get()
    server.latency_s = 60.0  # the server stalls: the read is pending on the loop
    outcome: list = []
    reader = threading.Thread(target=lambda: outcome.append(_outcome(s.get, "value")))
    reader.start()
    _wait_in_flight(server, 1)

    def broken() -> None:
        raise RuntimeError("an injected bug escaping the event loop")

    hooked: list = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)  # nothing left to the last resort
    monkeypatch.setattr(loop.loop, "_run_once", broken)  # what run_forever calls at each turn
    loop.loop.call_soon_threadsafe(lambda: None)  # wakes it
    reader.join(10.0)  # far sooner than the read's 30 s timeout
    assert not reader.is_alive()
    err = outcome[0]
    assert isinstance(err, InternalError) and err.thread == "stoker-objectstore"
    assert isinstance(err.__cause__, RuntimeError) and "report" in str(err)
    for later in (s, store(server)):  # every later request fails at once, of any store
        with pytest.raises(InternalError) as again:
            later.get("c/0")
        assert again.value is err
    s.close()
    assert not hooked


def test_a_range_server_shut_down_leaves_no_connection_thread(tmp_path):
    """The tests' RangeServer (tests/range_server.py) shut down as socketserver's servers are (many tests call
    ``server.shutdown()``) drops its keep-alive connections too: socketserver's shutdown alone left each one's
    handler thread waiting for a next request, running into the tests after it on the same worker."""
    import http.client

    (tmp_path / "a").write_bytes(b"abc")
    before = set(threading.enumerate())
    server = RangeServer(str(tmp_path))
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    try:
        conn.request("GET", "/a")
        assert conn.getresponse().read() == b"abc"  # the connection stays open (HTTP/1.1)
        server.shutdown()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and [t for t in threading.enumerate() if t not in before]:
            time.sleep(0.01)
        assert [t.name for t in threading.enumerate() if t not in before] == []
    finally:
        conn.close()
        server.stop()
