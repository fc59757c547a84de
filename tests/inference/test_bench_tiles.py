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
