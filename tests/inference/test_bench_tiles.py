"""benchmarks/tile_inference.py runs, tiny and untimed: every peer that imports writes the blend of an identity
model, which the script checks equals its input, for both blends; a wrong output is caught."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import zarr

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tile_inference.py"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tile_inference_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_runs_every_peer_and_checks_them(bench, tmp_path):
    pytest.importorskip("monai")
    result = bench.main(["--shape", "20", "36", "30", "--tile", "16", "16", "16", "--crop", "4", "--chunks", "8",
                         "16", "16", "--rounds", "2", "--batch-size", "3", "--threads", "1", "--dir", str(tmp_path)])
    peers = {"stoker", "monai"} | ({"torchio"} if "torchio" not in result["missing"] else set())
    assert set(result["blends"]) == {"none", "hann"}
    for r in result["blends"].values():
        assert set(r["median_s"]) == peers and all(t > 0 for t in r["median_s"].values())
        assert set(r["speedup"]) == {f"stoker_vs_{p}" for p in peers - {"stoker"}}
    assert not [p for p in tmp_path.iterdir() if p.name != "in.zarr"]  # outputs removed after each run


def test_the_check_refuses_an_output_that_is_not_the_input(bench, tmp_path):
    src = bench.make_volume(tmp_path / "in.zarr", (8, 8, 8), (4, 4, 4))
    out = zarr.create_array(str(tmp_path / "out.zarr"), shape=(8, 8, 8), chunks=(4, 4, 4), dtype="f4")
    out[:] = zarr.open_array(src)[:].astype("f4")
    bench.check(src, str(tmp_path / "out.zarr"), "peer", "hann")  # equal: passes
    out[7, 7, 7] = out[7, 7, 7] + 1
    with pytest.raises(SystemExit, match=r"1 voxels differ, the first at \(7, 7, 7\)"):
        bench.check(src, str(tmp_path / "out.zarr"), "peer", "hann")


def test_the_components_are_measured_apart(bench, tmp_path):
    result = bench.main(["--shape", "20", "36", "30", "--tile", "16", "16", "16", "--crop", "4", "--chunks", "8",
                         "16", "16", "--rounds", "1", "--batch-size", "3", "--threads", "1", "--peers", "stoker",
                         "--components", "--dir", str(tmp_path)])
    parts = result["components_cpu_s"]
    for key in ("read: zarr-python whole + astype", "encode: zstd of the output chunks",
                "store: zarr-python write (create + write)", "store: ChunkWriter (create + write)",
                "read: stoker tiles (TileGrid + CropDataset)", "blend none: stoker TileWriter (+ encode + store)",
                "blend hann: stoker TileWriter (+ encode + store)"):
        assert parts[key] >= 0, key
    assert not [p for p in tmp_path.iterdir() if p.name != "in.zarr"]


def test_codec_none_writes_every_peers_output_without_a_compressor(bench, tmp_path):
    """The second codec row (``--codec none``): every peer's output array has no compressor, the default one
    zarr-python's bytes + zstd."""
    import argparse

    src = bench.make_volume(tmp_path / "in.zarr", (20, 36, 30), (8, 16, 16))
    a = argparse.Namespace(shape=(20, 36, 30), tile=(16, 16, 16), crop=4, chunks=(8, 16, 16), batch_size=3,
                           threads=1, write_threads=1)
    peers = ["stoker", "monai"] if importlib.util.find_spec("monai") else ["stoker"]
    for codec in ("zstd", "none"):
        a.codec = codec
        for peer in peers:
            out = str(tmp_path / f"{peer}-{codec}.zarr")
            bench.PEERS[peer](src, out, a, "none")
            bench.check(src, out, peer, "none")
            names = [type(c).__name__ for c in zarr.open_array(out, mode="r").compressors]
            assert names == (["ZstdCodec"] if codec == "zstd" else []), (peer, codec, names)


def test_smooth_data_is_a_seeded_microscopy_like_volume_every_peer_gets(bench, tmp_path):
    """``--data smooth``: the same volume every time (seeded), 12-bit, far smoother than the noise row's
    and so far more compressible (as real predictions are); the run checks every peer's output on it and
    names the data in its result."""
    import numcodecs
    import numpy as np

    shape = (24, 40, 36)
    smooth, again, noise = (bench.volume_data("smooth", shape), bench.volume_data("smooth", shape),
                            bench.volume_data("noise", shape))
    np.testing.assert_array_equal(smooth, again)
    assert smooth.dtype == np.uint16 and smooth.max() <= 4095 and smooth.std() > 20  # structure, not a constant
    step = [np.abs(np.diff(v.astype(float), axis=2)).mean() for v in (smooth, noise)]
    assert step[0] < step[1] / 10
    size = [len(numcodecs.Zstd(level=0).encode(np.ascontiguousarray(v.astype(np.float32)))) for v in (smooth, noise)]
    assert size[0] < size[1] * 0.8
    peers = ["stoker", "monai"] if importlib.util.find_spec("monai") else ["stoker"]
    result = bench.main(["--shape", "20", "36", "30", "--tile", "16", "16", "16", "--crop", "4", "--chunks", "8",
                         "16", "16", "--rounds", "1", "--batch-size", "3", "--threads", "1", "--data", "smooth",
                         "--peers", *peers, "--dir", str(tmp_path)])
    assert result["data"] == "smooth" and set(result["blends"]["hann"]["median_s"]) == set(peers)
    written = zarr.open_array(str(tmp_path / "in.zarr"), mode="r")[:]
    np.testing.assert_array_equal(written, bench.volume_data("smooth", (20, 36, 30)))


def test_omp_passive_starts_the_run_again_with_the_policy_and_the_result_names_it(bench, tmp_path, monkeypatch):
    """``--omp-passive``: libgomp reads OMP_WAIT_POLICY once, when torch loads it, so the script starts itself
    again with it set (the same arguments); a run that has it goes on, and every result names the policy."""
    args = ["--shape", "20", "36", "30", "--tile", "16", "16", "16", "--crop", "4", "--chunks", "8", "16", "16",
            "--rounds", "1", "--batch-size", "3", "--threads", "1", "--peers", "stoker", "--blends", "none"]
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise SystemExit(0)

    monkeypatch.setattr(bench.os, "execve", execve)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # without the flag: no new process
    assert bench.main([*args, "--dir", str(tmp_path / "a")])["omp_wait_policy"] == "default"
    with pytest.raises(SystemExit):
        bench.main([*args, "--omp-passive"])
    [(path, argv, env)] = calls
    assert argv[1:] == [str(SCRIPT), *args, "--omp-passive"] and env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # started again: it runs here
    assert bench.main([*args, "--omp-passive", "--dir", str(tmp_path / "b")])["omp_wait_policy"] == "passive"
    assert len(calls) == 1
