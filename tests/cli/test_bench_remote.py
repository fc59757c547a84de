"""`stoker bench --store http|s3`: every peer reads through the loopback bench server (a smoke test: no
timing is asserted), and what stoker reads through it equals the local read."""

import re

import numpy as np
import pytest
import torch

from stoker import Config, Pipeline
from stoker.bench.datasets import ensure
from stoker.bench.remote import Remote, ZarrOpener
from stoker.bench.runner import make_samples, scenarios
from stoker.bench.serve import Served
from stoker.cli import main

PEERS = ("stoker", "tensorstore", "zarr+DataLoader")
# a peer's row with the server's counts: samples/s ... requests/batch MB/batch
ROW = r"^{}\s+(\d+\.\d)\s+\d+\.\d\s+(?:\d+\.\d\dx)?\s+\d+\s+(\d+\.\d)\s+(\d+\.\d\d)$"


def rows(out: str, peer: str) -> list[tuple[float, float, float]]:
    return [tuple(map(float, m)) for m in re.findall(ROW.format(re.escape(peer)), out, re.M)]


def check_table(out: str, n_scenarios: int) -> None:
    for peer in PEERS:
        got = rows(out, peer)
        assert len(got) == n_scenarios, (peer, out)
        assert all(rate > 0 and requests >= 1 and mb > 0 for rate, requests, mb in got), (peer, out)
    assert "decode bound" not in out and "stoker alone" not in out
    assert len(re.findall(r"^stoker: first batch \d+ ms after push$", out, re.M)) == n_scenarios, out


@pytest.mark.timeout(300)
def test_bench_store_http_smoke(tmp_path, capsys):
    assert main(["bench", "--tiny", "--store", "http", "--latency-ms", "5", "--scenarios", "1,6", "--batches", "3",
                 "--slow-batches", "1", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^stoker bench --store http: .* served at http://127\.0\.0\.1:\d+ .* with 5 ms added to "
                     r"every request", out, re.M), out
    check_table(out, 2)
    # what the loopback server's own process spent a batch, beside each peer's row
    assert len(re.findall(r"^bench server CPU per batch \(its own process, not the peer's\): stoker \d+\.\d\d ms, "
                          r"tensorstore \d+\.\d\d ms", out, re.M)) == 2, out


@pytest.mark.timeout(300)
def test_bench_store_s3_smoke(tmp_path, capsys):
    assert main(["bench", "--tiny", "--store", "s3", "--latency-ms", "5", "--scenarios", "2", "--batches", "3",
                 "--slow-batches", "1", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stoker bench --store s3: " in out
    check_table(out, 1)


@pytest.mark.timeout(300)
def test_bench_store_epochs_through_the_disk_cache(tmp_path, capsys):
    assert main(["bench", "--tiny", "--store", "http", "--latency-ms", "2,5", "--scenarios", "2", "--batches", "3",
                 "--slow-batches", "1", "--peers", "stoker,tensorstore,zarr", "--epochs", "2",
                 "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [float(t) for t in re.findall(r"with (\d+) ms added to every request", out)] == [2.0, 5.0], out
    epoch = r"^stoker e{}\s+\d+\.\d.*\s(\d+\.\d)\s+(\d+\.\d\d)  disk cache: (\d+\.\d\d) MB/batch, hit rate (\d+\.\d)%$"
    firsts, seconds = (re.findall(epoch.format(k), out, re.M) for k in (1, 2))
    assert len(firsts) == len(seconds) == 2, out  # a table per latency
    for first, second in zip(firsts, seconds):
        # the second epoch's crops (the first's again) come from disk: no body from the server, every byte a hit
        assert float(second[1]) == 0.0 and float(second[2]) > 0 and float(second[3]) == 100.0, out
        assert float(first[1]) > 0, out
        # both epochs read about the same bytes a batch (the first partly from the server; prefetch and the
        # short window move some across its ends): disk bytes per batch, not per sample (8 a batch)
        assert float(second[2]) > 0.5 * (float(first[1]) + float(first[2])), out
    # the other peers' epochs, the same crops from local files, and the second epoch against those
    for peer in ("tensorstore e1", "tensorstore e2", "zarr e1", "zarr e2", "stoker local"):
        assert len(rows(out, peer)) == 2, (peer, out)
    assert all(requests == 0 and mb == 0 for _, requests, mb in rows(out, "stoker local")), out
    assert len(re.findall(r"^second epoch from the disk cache: stoker e2 \d+\.\d samples/s = \d+\.\d\dx stoker "
                          r"on local files", out, re.M)) == 2, out
    assert out.count("tensorstore eN: no disk cache") == 2, out


def test_the_bench_server_answers_an_unchanged_objects_conditional_get_with_304(tmp_path):
    # tensorstore's epochs revalidate what their cache_pool holds with conditional GETs: no body when unchanged
    import urllib.error
    import urllib.request

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "k").write_bytes(b"0123456789")
    with Served(tmp_path, "http", 0) as server:
        with urllib.request.urlopen(f"{server.url}/a/k", timeout=10) as answer:
            etag, modified = answer.headers["ETag"], answer.headers["Last-Modified"]
            assert answer.read() == b"0123456789"
        for header in ({"If-None-Match": etag}, {"If-Modified-Since": modified}):
            with pytest.raises(urllib.error.HTTPError) as got:
                urllib.request.urlopen(urllib.request.Request(f"{server.url}/a/k", headers=header), timeout=10)
            assert got.value.code == 304 and got.value.read() == b""
        changed = urllib.request.Request(f"{server.url}/a/k", headers={"If-None-Match": '"another"'})
        with urllib.request.urlopen(changed, timeout=10) as answer:
            assert answer.status == 200 and answer.read() == b"0123456789"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_served_arrays_read_as_the_local_ones(tmp_path, kind):
    # stoker's batches through the server equal the local read, bit for bit; tensorstore and zarr-python
    # read the same bytes through their own stores; the server counts requests and bytes
    import tensorstore as ts

    sc = next(s for s in scenarios(tiny=True) if s.number == 2)  # sharded: index and inner-chunk ranges
    paths = ensure(tmp_path, sc.volume, progress=False)
    local = make_samples(paths, sc.volume.shape, sc.crop, 8, False, seed=1)
    with Served(tmp_path, kind, 1) as server:
        remote = Remote(kind, server.url, tmp_path, 1)
        far = make_samples([remote.uri(p) for p in paths], sc.volume.shape, sc.crop, 8, False, seed=1)
        assert [s.aabb for s in far] == [s.aabb for s in local] and far[0].uri != local[0].uri
        got = {}
        for name, samples, options in (("local", local, None), ("remote", far, remote.storage_options())):
            with Pipeline(Config(batch_size=4, storage_options=options)) as p:
                p.push(samples)
                got[name] = [torch.from_dlpack(p.pop()).clone() for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(got["local"], got["remote"]))
        requests, nbytes = server.counters()
        assert requests >= 2 and nbytes > 0
        s = far[3]
        box = tuple(slice(a, b) for a, b in s.aabb)
        want = got["local"][0][3].numpy()
        arr = ts.open({"driver": "zarr3", "kvstore": remote.tensorstore_kvstore(s.uri)}).result()
        assert np.array_equal(arr[box].read().result().astype(np.float32), want)
        assert np.array_equal(ZarrOpener(remote)(s.uri)[box].astype(np.float32), want)
        assert server.counters()[0] > requests


@pytest.mark.parametrize("argv, words", [
    (["--latency-ms", "5"], "give --store http or --store s3"),
    (["--epochs", "2"], "give --store http or --store s3"),
    (["--store", "http", "--peers", "stoker,bound"], "the decode bound makes no reads"),
    (["--store", "s3", "--device", "cuda"], "without --device cuda"),
])
def test_bench_store_mistakes_are_one_line(tmp_path, capsys, argv, words):
    assert main(["bench", "--tiny", *argv, "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
    for bad in (["--latency-ms", "-1"], ["--latency-ms", "nan"], ["--latency-ms", "soon"], ["--latency-ms", "20,"],
                ["--store", "ftp"]):
        with pytest.raises(SystemExit) as exited:  # usage errors: argparse's status 2
            main(["bench", "--tiny", "--store", "http", *bad, "--data", str(tmp_path)])
        assert exited.value.code == 2
