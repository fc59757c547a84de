"""Scenarios 9 and 10: bench data that compresses like real microscopy and weather data, seeded, with the
compression ratio in the bench's header and its --json."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from stoker.bench.datasets import VolumeSpec, compression_ratio, ensure, write_blocks
from stoker.bench.runner import scenarios
from stoker.cli import main

PEERS = ("stoker", "tensorstore", "zarr", "zarr+DataLoader", "decode bound")
HEADER = re.compile(r"^Scenario (\d+): .*\(batch \d+, \d+ timed batches per fast peer; compression ratio (\d+\.\d\d) "
                    r"\(decoded / stored bytes\)\)$", re.M)


def tiny(number: int):
    return next(s for s in scenarios(tiny=True) if s.number == number)


def files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
def test_bench_tiny_compressible_scenarios_smoke(tmp_path, capsys):
    doc_path = tmp_path / "bench.json"
    assert main(["bench", "--tiny", "--scenarios", "9,10", "--batches", "2", "--slow-batches", "1",
                 "--data", str(tmp_path / "data"), "--json", str(doc_path)]) == 0
    out = capsys.readouterr().out
    for peer in PEERS:
        rates = [float(x) for x in re.findall(rf"^{re.escape(peer)}\s+(\d+\.\d)", out, re.M)]
        assert len(rates) == 2 and min(rates) > 0, (peer, out)
    printed = {int(n): float(r) for n, r in HEADER.findall(out)}
    assert set(printed) == {9, 10}, out
    assert 2.5 <= printed[9] <= 4.0 and 2.0 <= printed[10] <= 5.0, printed
    doc = json.loads(doc_path.read_text())
    recorded = {s["number"]: s["compression_ratio"] for s in doc["scenarios"]}
    assert recorded.keys() == printed.keys()
    assert all(recorded[n] == pytest.approx(printed[n], abs=0.005) for n in printed), (recorded, printed)


def test_every_scenario_header_says_its_compression_ratio(tmp_path, capsys):
    # the older scenarios too: their smooth-plus-noise data is stored nearly as large as it decodes
    assert main(["bench", "--tiny", "--scenarios", "1", "--batches", "2", "--peers", "tensorstore",
                 "--data", str(tmp_path)]) == 0
    (number, ratio), = HEADER.findall(capsys.readouterr().out)
    assert number == "1" and 1.0 < float(ratio) < 2.5


@pytest.mark.timeout(120)
def test_microscopy_like_volume_compresses_2_5_to_4x_with_zstd(tmp_path):
    import zarr

    sc = tiny(9)
    big = next(s for s in scenarios() if s.number == 9)
    # the tiny volume has the full scenario's content, codec and inner chunks, so its ratio is the big one's
    assert (sc.volume.content, sc.volume.codec, sc.volume.chunks) == (big.volume.content, big.volume.codec,
                                                                      big.volume.chunks) == ("microscopy", "zstd",
                                                                                             (32, 64, 64))
    assert big.volume.shards and big.crop == (128, 128, 128) and big.batch_size == 32
    path, = ensure(tmp_path, sc.volume, progress=False)
    ratio = compression_ratio(path, sc.volume)
    assert 2.5 <= ratio <= 4.0, ratio
    z = zarr.open_array(path, mode="r")
    assert z.nbytes / z.nbytes_stored() == pytest.approx(ratio, rel=0.01)  # zarr-python counts the same bytes
    data = z[...]
    # like a fluorescence volume: mostly dark background at the camera's offset, bright thin structures
    assert data.dtype == np.uint16 and np.median(data) < 110 and (data > 500).mean() > 0.005
    assert (data > 500).mean() < 0.1 and data.max() < 4000


@pytest.mark.timeout(120)
def test_weather_like_fields_are_smooth_float32_kelvin(tmp_path):
    import zarr

    sc = tiny(10)
    assert sc.volume.codec == "blosc-zstd-bitshuffle" and sc.volume.chunks[0] == 4
    path, = ensure(tmp_path, sc.volume, progress=False)
    z = zarr.open_array(path, mode="r")
    assert z.compressors[0].shuffle.value == "bitshuffle" and z.compressors[0].cname.value == "zstd"
    data = z[...]
    assert data.dtype == np.float32 and 190 < data.min() and data.max() < 330
    # smooth: neighbours in longitude differ by far less than the field varies
    assert np.abs(np.diff(data, axis=2)).mean() < 0.1 * data.std()
    # on GRIB's 16-bit packing grid (2^-8 K), as reanalyses are distributed, yet with noise resolved
    assert np.array_equal(data * 256, np.rint(data * 256)) and (np.diff(data, axis=2) != 0).mean() > 0.9
    assert 2.0 <= compression_ratio(path, sc.volume) <= 5.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("number", [9, 10])
def test_generation_is_seeded(tmp_path, number):
    spec = tiny(number).volume
    ensure(tmp_path / "a", spec, progress=False)
    ensure(tmp_path / "b", spec, progress=False)
    first, second = files(tmp_path / "a" / spec.name), files(tmp_path / "b" / spec.name)
    assert first.keys() == second.keys() and len(first) > 2
    assert all(first[k] == second[k] for k in first)  # the same bytes twice
    # the seed comes from the dataset's name: another name, other data
    other = replace(spec, name=spec.name + "-other")
    path, = ensure(tmp_path / "c", other, progress=False)
    import zarr

    assert not np.array_equal(zarr.open_array(path, mode="r")[...],
                              zarr.open_array(str(tmp_path / "a" / spec.name / "array.zarr"), mode="r")[...])


def test_synthetic_datasets_are_written_in_whole_chunks_or_shards():
    for spec in (scenarios()[-2].volume, scenarios()[-1].volume, tiny(10).volume):
        boxes = write_blocks(spec)
        unit = spec.shards or spec.chunks
        covered = sum(int(np.prod([b - a for a, b in box])) for box in boxes)
        assert covered == int(np.prod(spec.shape))  # every voxel once (boxes do not overlap: they tile a grid)
        for box in boxes:
            assert all(a % u == 0 and (b % u == 0 or b == s) for (a, b), u, s in zip(box, unit, spec.shape)), box
    weather = scenarios()[-1].volume
    assert weather.shards is None and (write_blocks(weather)[0][0][1] // weather.chunks[0]) > 1  # runs of chunks


def test_datasets_written_before_contents_had_names_are_reused(tmp_path):
    # a smooth dataset's completion marker has no "content": caches written by earlier versions stay valid
    spec = VolumeSpec("old", (8, 32, 32), (8, 16, 16), "uint16", "blosc-lz4")
    path, = ensure(tmp_path, spec, progress=False)
    marker = tmp_path / "old" / ".complete"
    old = {"format": "stoker-bench-volume", "name": "old", "shape": [8, 32, 32], "chunks": [8, 16, 16],
           "dtype": "uint16", "codec": "blosc-lz4", "shards": None, "count": 1}
    marker.write_text(json.dumps(old))
    meta = tmp_path / "old" / "array.zarr" / "zarr.json"
    before = meta.stat().st_mtime_ns
    ensure(tmp_path, spec, progress=False)
    assert meta.stat().st_mtime_ns == before and json.loads(marker.read_text()) == old
    # a synthetic dataset of the same name and layout is other data: it is written anew
    ensure(tmp_path, replace(spec, content="microscopy"), progress=False)
    assert json.loads(marker.read_text())["content"] == "microscopy"


def test_a_retuned_generator_writes_its_datasets_anew(tmp_path, monkeypatch):
    import stoker.bench.synthetic as synthetic

    spec = VolumeSpec("w", (8, 16, 32), (4, 16, 32), "float32", "blosc-zstd-bitshuffle", content="weather")
    ensure(tmp_path, spec, progress=False)
    meta = tmp_path / "w" / "array.zarr" / "zarr.json"
    before = meta.stat().st_mtime_ns
    ensure(tmp_path, spec, progress=False)
    assert meta.stat().st_mtime_ns == before  # complete: reused
    monkeypatch.setattr(synthetic, "VERSION", synthetic.VERSION + 1)
    ensure(tmp_path, spec, progress=False)
    assert meta.stat().st_mtime_ns != before
    assert json.loads((tmp_path / "w" / ".complete").read_text())["generator"] == synthetic.VERSION


def test_gpu_bench_header_says_the_compression_ratio(monkeypatch):
    # the bytes a GPU decoder saves on the bus are the ratio: its report says it too
    from types import SimpleNamespace

    import torch

    from stoker.bench.device import format_device_results
    from stoker.bench.runner import Result

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    stats = SimpleNamespace(stages={}, samples=8, bytes_to_device=4096, bytes_read=4096, batches_emitted=2)
    results = [Result("stoker cpu", 1.0, 8, 0, 0, {}),
               Result("stoker cuda", 1.0, 8, 0, 0, {"stats": stats, "pinned_bytes": 0})]
    report = format_device_results(tiny(9), results, 3, compression=2.866)
    assert "(3 timed batches per peer; compression ratio 2.87 (decoded / stored bytes))" in report
    assert "compression ratio" not in format_device_results(tiny(9), results, 3)
