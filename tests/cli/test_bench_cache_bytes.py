"""`stoker bench --store http --epochs N --cache-bytes SIZE`: the flag, and the cache folder's peak size
measured while each epoch runs against the bound (cache_bytes plus the largest entry)."""

import argparse
import os
import re
import time
import tempfile
import threading

import pytest

from stoker.bench.epochs import CachePeak, cache_peak_line
from stoker.cli import main
from stoker.cli.args import byte_size
from stoker.storage.diskcache import HEADER, disk_cache

# stoker e1: cache folder peak 947.5 KiB <= cache_bytes 1.0 MiB + largest entry 96.3 KiB; 582 entries evicted;
# running total read 130 times in 0.41 s (peak 947.5 KiB), 71 full scans (peak 947.5 KiB; 4 left out: ...);
# sampler CPU 38 ms, left out of the peer's; in allocated blocks (as du counts) peak 1.9 MiB OVER ...
SIZE = r"(\d+\.\d) (KiB|MiB|GiB|TiB)"
PEAK = (rf"^(EXCEEDED: )?stoker e(\d): cache folder peak {SIZE} (<=|>) cache_bytes {SIZE} \+ largest entry {SIZE}; "
        rf"(\d+) entries evicted; running total read (\d+) times in \d+\.\d\d s \(peak {SIZE}\), (\d+) full scans "
        rf"\(peak {SIZE}; \d+ left out: an eviction ran during them\); sampler CPU \d+ ms, left out of the peer's; "
        rf"in allocated blocks \(as du counts\) peak {SIZE}( OVER cache_bytes \+ largest entry)?$")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def nbytes(value: str, unit: str) -> float:
    return float(value) * UNITS[unit]


@pytest.mark.parametrize("text, want", [("64M", 64 << 20), ("64m", 64 << 20), ("64MiB", 64 << 20), ("1", 1),
                                        ("3K", 3 << 10), ("2G", 2 << 30), ("1T", 1 << 40)])
def test_byte_size_reads_powers_of_1024(text, want):
    assert byte_size(text) == want


@pytest.mark.parametrize("text", ["0", "0M", "-1", "x", "1.5M", "", "64MB", "64 M", "1e6", "5P"])
def test_byte_size_refuses_what_is_no_size_naming_the_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"at least 1: a whole number, optionally followed by K, "
                                                         r"M, G or T \(powers of 1024\), e.g. 64M; got"):
        byte_size(text)


def test_bench_cache_bytes_mistakes(tmp_path, capsys):
    for bad in ("64MB", "0", "lots"):  # a usage error: argparse's status 2, the form named
        with pytest.raises(SystemExit) as exited:
            main(["bench", "--tiny", "--store", "http", "--epochs", "2", "--cache-bytes", bad, "--data", str(tmp_path)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--cache-bytes: " in err and "e.g. 64M" in err and repr(bad) in err, err
    for argv in (["--cache-bytes", "64M"], ["--store", "http", "--cache-bytes", "64M"]):  # no --epochs: no cache
        assert main(["bench", "--tiny", *argv, "--data", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--cache-bytes bounds the disk cache that --epochs reads through" in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_cache_peak_samples_a_folder_being_filled_and_evicted(tmp_path):
    # a real DiskCache written from another thread past its bound: the sampler sees it fill, evict, and stay
    # within cache_bytes plus the largest entry
    cache = disk_cache(str(tmp_path / "c"), 256 << 10)
    with CachePeak(cache) as peak:
        def fill():
            for i in range(60):
                cache.write(f"key {i}", os.urandom(10_000 + 300 * i))  # entries of 10-28 KB

        writer = threading.Thread(target=fill)
        writer.start()
        writer.join(60)
    assert not writer.is_alive()
    assert peak.evicted > 0 and peak.scans >= 1 and peak.reads >= 1
    # the bound holds the entries in whole blocks and their subfolders (a block each): their bytes fill less
    assert 0.5 * (256 << 10) < peak.scan_peak <= peak.blocks_peak <= 256 << 10 and peak.peak_bytes <= 256 << 10
    assert peak.largest_bytes == HEADER.size + len("key 59") + 27_700  # the last entry: its header and ident, the bytes
    assert peak.within and cache_peak_line("stoker e1", {"cache_peak": [peak]}).startswith("stoker e1: cache folder "
                                                                                             "peak ")


def test_cache_peak_sleeps_while_its_cache_is_quiet(tmp_path):
    # A cached epoch (nothing queued, written or evicted) is timed beside an idle sampler: it looks at the
    # folder once, then not again until the cache changes; a write after the quiet spell is read and scanned.
    cache = disk_cache(str(tmp_path / "c"), 1 << 20)
    cache.write("one", b"x" * 1000)
    assert cache.flush(30)
    with CachePeak(cache, every_s=0.001) as peak:
        deadline = time.monotonic() + 10
        while peak.scans < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # some 300 samples' worth of quiet
        quiet = (peak.reads, peak.scans)
        cache.write("two", b"y" * 30_000)
        assert cache.flush(30)
        while peak.scans < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        changed = (peak.reads, peak.scans)
    assert quiet == (1, 1), quiet
    assert changed[0] >= 2 and changed[1] >= 2, changed
    assert peak.scan_peak >= 31_000


def test_cache_peak_says_exceeded_for_bytes_past_the_bound(tmp_path):
    # bytes on disk past cache_bytes + the largest entry (as a cache that did not evict would leave) are seen
    # by the scan, and the line says EXCEEDED with the numbers
    cache = disk_cache(str(tmp_path / "c"), 64 << 10)
    cache.write("one", b"x" * 20_000)
    stray = cache.root / "ab"
    stray.mkdir(parents=True, exist_ok=True)
    for i in range(4):  # files no write accounted for: only a scan sees them
        (stray / f"{i:032x}").write_bytes(b"y" * 20_000)
    with CachePeak(cache) as peak:
        pass
    assert peak.scan_peak >= 100_000 and peak.total_peak < 64 << 10 and not peak.within
    line = cache_peak_line("stoker e2", {"cache_peak": [peak]})
    found = re.fullmatch(PEAK, line)
    assert found and found[1] == "EXCEEDED: " and found[5] == ">", line


@pytest.mark.timeout(300)
def test_bench_epochs_under_a_small_cache_stay_within_the_bound(tmp_path, capsys, monkeypatch):
    # a 1 MiB cache against ~17 MB an epoch of the tiny sharded scenario: every epoch evicts, and the folder's
    # peak, sampled while it runs, stays within cache_bytes plus the largest entry
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the bench makes its cache folders
    (tmp_path / "tmp").mkdir()
    assert main(["bench", "--tiny", "--store", "http", "--latency-ms", "2", "--scenarios", "2", "--batches", "3",
                 "--slow-batches", "1", "--peers", "stoker", "--epochs", "2", "--cache-bytes", "1M",
                 "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "EXCEEDED" not in out, out
    lines = re.findall(PEAK, out, re.M)
    assert [found[1] for found in lines] == ["1", "2"], out
    for (exceeded, _, peak, peak_unit, sign, bound, bound_unit, largest, largest_unit, evicted, reads, total,
         total_unit, scans, scan, scan_unit, blocks, blocks_unit, _over) in lines:
        cache_bytes = nbytes(bound, bound_unit)
        assert cache_bytes == 1 << 20 and not exceeded and sign == "<=", out
        assert 0.5 * cache_bytes < nbytes(peak, peak_unit) <= cache_bytes + nbytes(largest, largest_unit), out
        assert nbytes(largest, largest_unit) > 0 and int(evicted) > 0, out  # under eviction pressure
        assert int(reads) > 0 and int(scans) > 0 and nbytes(scan, scan_unit) > 0, out
        assert nbytes(blocks, blocks_unit) >= nbytes(scan, scan_unit), out  # whole blocks, and the folders'
    # the rows give the hit rate under that pressure
    # (stoker e1 and e2, each a new pipeline; the same pipeline's e2, "stoker e2 (same pipeline)", has its own)
    rates = re.findall(r"^stoker e\d\s+\d.*disk cache: \d+\.\d\d MB/batch, hit rate (\d+\.\d)%$", out, re.M)
    assert len(rates) == 2 and all(float(r) < 100 for r in rates), out
    assert os.listdir(tmp_path / "tmp") == [], out  # each round's cache folder removed after its last epoch


@pytest.mark.timeout(300)
def test_bench_epochs_default_cache_bound_is_reported(tmp_path, capsys):
    # without --cache-bytes the bound is the bench's constant (1 TiB): nothing evicted, the peak still measured
    assert main(["bench", "--tiny", "--store", "http", "--latency-ms", "2", "--scenarios", "2", "--batches", "3",
                 "--slow-batches", "1", "--peers", "stoker", "--epochs", "1", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (found,) = re.findall(PEAK, out, re.M)
    assert found[5:7] == ("1.0", "TiB") and found[9] == "0" and nbytes(found[2], found[3]) > 1 << 20, out


def test_cache_folder_in_allocated_blocks_stays_within_cache_bytes_plus_an_entry(tmp_path):
    # many small entries, as chunks of a few hundred bytes are: their bytes fit the bound, and so must the
    # blocks they and their subfolders take (the cache counts what the disk gives, storage/diskcache.py)
    cache = disk_cache(str(tmp_path / "c"), 256 << 10)
    with CachePeak(cache) as peak:
        for i in range(1500):
            cache.write(f"marker {i}", b"m" * 100)
    assert peak.within  # the bound as the cache counts it holds
    assert peak.blocks_within, (peak.blocks_peak, peak.scan_peak, peak.cache_bytes, peak.largest_bytes)
