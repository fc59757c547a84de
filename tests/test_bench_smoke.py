"""`stoker bench --tiny` runs every peer end to end (a smoke test: no timing is asserted)."""

import re

import pytest

from stoker.cli import main


@pytest.mark.timeout(300)
def test_bench_tiny_smoke(tmp_path, capsys):
    rc = main(["bench", "--tiny", "--scenarios", "1,2", "--batches", "3", "--slow-batches", "1",
               "--data", str(tmp_path / "bench")])
    assert rc == 0
    out = capsys.readouterr().out
    for peer in ("stoker", "tensorstore", "zarr", "zarr+DataLoader", "decode bound"):
        assert re.search(rf"^{re.escape(peer)}\s+\d+\.\d", out, re.M), (peer, out)
    assert "of decode bound" in out and "first batch" in out
    # a second run reuses the generated datasets
    assert (tmp_path / "bench" / "tiny-lz4" / ".complete").exists()


@pytest.mark.timeout(300)
def test_bench_records_tiny_smoke(tmp_path, capsys):
    assert main(["bench", "records", "--tiny", "--data", str(tmp_path / "bench")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^stoker\.records\.Loader \(threads\)\s+\d+\.\d", out, re.M), out
    assert re.search(r"^DataLoader\(num_workers\) \+ zarr\s+\d+\.\d+\s+\d+\.\d+x", out, re.M), out
    assert re.search(r"^\s+50 records: .* per record\)$", out, re.M) and re.search(r"^\s+500 records:", out, re.M)
