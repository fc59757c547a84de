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
