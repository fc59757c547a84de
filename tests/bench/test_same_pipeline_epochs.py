"""`stoker bench --store ... --epochs 2`: the second epoch in the pipeline that read the first (`stoker e2 (same
pipeline)`, against `stoker local (same pipeline)`), and `--cache-staleness-s`, against the bench's loopback
server (its counts of requests and bytes)."""

import re
import time

import numpy as np
import pytest

from stoker.bench.datasets import ensure
from stoker.bench.epochs import LOCAL_SAME, SAME, same_pipeline_peers
from stoker.bench.remote import Remote
from stoker.bench.runner import host_budget, make_samples, run_stoker, scenarios
from stoker.bench.serve import Served
from stoker.cli import main
from stoker.storage import diskcache

# a row: peer, samples/s, MB/s, [stoker x], peak RSS MB, requests/batch, MB/batch[, disk cache: ..., hit rate]
ROW = (r"^{}\s+\d+\.\d\s+\d+\.\d\s+(?:\d+\.\d\dx)?\s+\d+\s+(\d+\.\d)\s+(\d+\.\d\d)"
       r"(?:  disk cache: (\d+\.\d\d) MB/batch, hit rate (\d+\.\d)%)?$")
BENCH = ["bench", "--tiny", "--latency-ms", "2", "--scenarios", "2", "--batches", "3", "--slow-batches", "1",
         "--peers", "stoker", "--epochs", "2"]


def row(out: str, peer: str) -> tuple[str, ...]:
    (found,) = re.findall(ROW.format(re.escape(peer)), out, re.M)
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_second_epoch_in_the_same_pipeline_asks_the_server_nothing_within_the_staleness_bound(tmp_path, capsys,
                                                                                                  kind):
    # the default staleness bound (60 s) outlasts the tiny run's first epoch: its second in the same pipeline
    # finds every object revalidated and every byte on disk, so the server is asked nothing while it is timed
    assert main([*BENCH, "--store", kind, "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    requests, mb, disk, rate = row(out, SAME)
    assert float(requests) == 0 and float(mb) == 0 and float(disk) > 0 and float(rate) == 100, out
    assert row(out, LOCAL_SAME)[:2] == ("0.0", "0.00"), out  # the local files: no server, no cache
    for peer in ("stoker e1", "stoker e2", "stoker local"):  # the rows there were, still there
        assert row(out, peer), (peer, out)
    # a line for each kind of second epoch, saying which it is, against the local read measured the same way
    new, same = (re.findall(rf"^second epoch from the disk cache: {re.escape(name)} \d+\.\d samples/s = \d+\.\d\dx "
                            rf"{re.escape(local)} \(\d+\.\d\) \[(.*?)\]; (\d+\.\d) requests and (\d+\.\d\d) MB a "
                            rf"batch from the server, hit rate (\d+\.\d)% \(write queue full in the epoch "
                            rf"before: (\d+) entries not cached\); CPU per batch "
                            rf"\d+\.\d\d ms \(e2\) against \d+\.\d\d ms \(local\)$", out, re.M)
                 for name, local in (("stoker e2", "stoker on local files"), (SAME, LOCAL_SAME)))
    assert len(new) == len(same) == 1, out
    assert new[0][0].startswith("a new pipeline") and "every object revalidated" in new[0][0], out
    assert same[0][0].startswith("in the same pipeline") and "cache_staleness_s 60 s (the default)" in same[0][0], out
    assert re.search(r"; its epoch 1 and the cache's flush took \d+\.\d\d s before it$", same[0][0]), out
    assert same[0][1:] == (requests, mb, rate, "0") and new[0][4] == "0", out  # every entry written
    assert f"{SAME}: one pipeline reads the crops twice" in out and "then only once older than cache_staleness_s " \
                                                                    "60 s (the default)" in out, out
    assert f"{SAME}: cache folder peak " in out and f"{LOCAL_SAME} per batch: " in out, out


@pytest.mark.timeout(300)
def test_cache_staleness_s_reaches_the_stoker_epochs(tmp_path, capsys):
    # a bound far shorter than the first epoch: the second, in the same pipeline, asks the server again
    assert main([*BENCH, "--store", "http", "--cache-staleness-s", "0.001", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    requests, _mb, _disk, _rate = row(out, SAME)
    assert float(requests) > 0, out
    assert "cache_staleness_s 0.001 s (--cache-staleness-s)" in out, out


@pytest.mark.timeout(300)
def test_entries_the_write_queue_dropped_are_the_second_epochs_misses(tmp_path, capsys, monkeypatch):
    # the cache's write queue made too small to hold the first epoch's entries: it drops some (counted), and
    # those the same pipeline's second epoch reads again from the server, within the staleness bound
    monkeypatch.setattr(diskcache, "QUEUE_BYTES", 64 << 10)
    assert main([*BENCH, "--store", "http", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = re.findall(rf"^second epoch from the disk cache: {re.escape(SAME)} .*$", out, re.M)
    found = re.search(r"; (\d+\.\d) requests and (\d+\.\d\d) MB a batch from the server, hit rate (\d+\.\d)% \(write "
                      r"queue full in the epoch before: (\d+) entries not cached\)", line)
    assert found and int(found[4]) > 0 and float(found[1]) > 0 and float(found[2]) > 0, line
    assert float(found[3]) < 100, line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_past_the_staleness_bound_the_same_pipeline_revalidates_in_the_background(tmp_path, kind):
    # the second epoch starts past the bound (a pause between the epochs): the objects it reads are revalidated
    # again by bodiless requests, ahead of their batches (revalidate_ahead), and every byte still comes from disk;
    # within the default bound the same pause costs no request
    stale_s = 2.0
    sc = next(s for s in scenarios(tiny=True) if s.number == 6)  # 20 arrays of 8 chunks each
    paths = ensure(tmp_path, sc.volume, progress=False)
    itemsize = np.dtype(sc.volume.dtype).itemsize
    with Served(tmp_path, kind, 2) as server:
        remote = Remote(kind, server.url, tmp_path, 2)
        samples = make_samples([remote.uri(p) for p in paths], sc.volume.shape, sc.crop, 4 * 8, False, seed=3)
        budget = host_budget(sc, 8, None)
        marks: list[tuple[int, int]] = []

        def run(mark, folder, between, stale: float | None):
            def pause() -> None:
                between()
                time.sleep(stale_s + 0.5)

            return run_stoker(samples, 8, itemsize, budget, storage_options=remote.storage_options(), mark=mark,
                              cache_dir=folder, cache_staleness_s=stale, between=pause)

        got = {}
        for stale in (None, stale_s):  # within the default bound (60 s) despite the pause; then past it
            peers = same_pipeline_peers(lambda m, folder, between: run(m, folder, between, stale),
                                        lambda m, between: None, staleness_s=stale)
            marks.clear()
            result = peers[SAME](lambda: marks.append(server.counters()))
            (q0, b0), (q1, b1) = marks[0], marks[-1]
            got[stale] = (q1 - q0, b1 - b0, result)
    within, past = got[None], got[stale_s]
    assert within[0] == 0 and within[1] == 0, within[:2]
    requests, nbytes, result = past
    assert requests > 0, past[:2]
    disk = result.extra["disk_bytes_per_batch"] * result.extra["batches"]
    assert result.extra["cache_staleness_s"] == stale_s and disk > 0
    assert result.extra["first_epoch_s"] > stale_s  # the pause: what made the second epoch's objects stale
    # every byte from disk: the server sent no chunk again (over S3, only the listing's few KB)
    assert nbytes < 0.05 * disk, (requests, nbytes, disk)


def test_cache_staleness_s_mistakes(tmp_path, capsys):
    assert main(["bench", "--tiny", "--store", "http", "--cache-staleness-s", "5", "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--cache-staleness-s is the staleness bound of the disk cache that --epochs reads through" in err, err
    assert len(err.strip().splitlines()) == 1, err
    for bad in ("0", "-1", "nan", "inf", "soon"):  # usage errors: argparse's status 2, the form named
        with pytest.raises(SystemExit) as exited:
            main(["bench", "--tiny", "--store", "http", "--epochs", "2", "--cache-staleness-s", bad,
                  "--data", str(tmp_path)])
        assert exited.value.code == 2
        assert "--cache-staleness-s: takes seconds (a number above 0)" in capsys.readouterr().err


def test_the_second_epoch_line_gives_each_rounds_ratio_and_their_median():
    """With interleaved rounds the e2/local ratio of each round (its two peers run back to back) and their
    median are on the second epoch's line; with one round, nothing more than before."""
    from types import SimpleNamespace

    from stoker.bench.epochs import LOCAL_SAME, SAME, second_epoch_lines

    def peer(rounds, cpu_ms):
        return SimpleNamespace(samples_per_s=sorted(rounds)[(len(rounds) - 1) // 2],
                               extra={"rounds": rounds, "rounds_cpu_ms": cpu_ms, "batches": 10,
                                      "cpu_s": cpu_ms[0] / 100})

    line = second_epoch_lines({SAME: peer([450.0, 380.0, 500.0], [20.0, 22.0, 20.0]),
                               LOCAL_SAME: peer([500.0, 400.0, 500.0], [19.0, 20.0, 21.0])})[0]
    assert line.endswith("; per round: samples/s e2/local 0.90 0.95 1.00 (median 0.95); "
                         "CPU per batch local/e2 0.95 0.91 1.05 (median 0.95)"), line
    one = second_epoch_lines({SAME: peer([450.0], [20.0]), LOCAL_SAME: peer([500.0], [19.0])})[0]
    assert "per round" not in one
