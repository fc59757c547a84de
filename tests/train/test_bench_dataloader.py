"""benchmarks/dataloader_epochs.py runs, tiny: its four peers read the same crops (the script checks their first
batches), and the persistent dataset's second epoch over the loopback S3 server asks it nothing while the one
with a new pipeline per epoch revalidates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dataloader_epochs.py"

pytestmark = pytest.mark.timeout(240)


def test_the_benchmark_runs_its_peers_and_a_kept_pipeline_asks_nothing(tmp_path):
    spec = importlib.util.spec_from_file_location("dataloader_epochs_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    medians = bench.main(["--tiny", "--rounds", "1", "--batches", "4", "--store", "s3", "--latency-ms", "0",
                          "--data", str(tmp_path / "data")])
    assert set(medians) == {"local, new pipeline", "local, persistent", "s3 cache, new pipeline",
                            "s3 cache, persistent"}
    assert all(m["samples_per_s"] > 0 and m["cpu_ms"] > 0 for m in medians.values())
    assert medians["s3 cache, persistent"]["requests"] == 0 and medians["s3 cache, persistent"]["mb"] == 0
    assert medians["s3 cache, new pipeline"]["requests"] > 0
    assert medians["local, new pipeline"]["requests"] == 0
