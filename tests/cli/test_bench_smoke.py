"""`stoker bench --tiny` runs every peer end to end (a smoke test: no timing is asserted)."""

import json
import os
import re

import pytest

from stoker.bench.records import records_for_steady_state
from stoker.engine.cpu.executor import engine_available
from stoker.cli import main

PEERS = ("stoker", "tensorstore", "zarr", "zarr+DataLoader", "decode bound")
# where stoker's CPU time goes, per batch: the stages the decode bound leaves out are named, and the
# time the pipeline's threads held the GIL, with the garbage collections in it
CPU_LINE = re.compile(r"^stoker per batch: (\d+\.\d+) ms CPU \((\d+\.\d) cores busy\); decode [\d.]+ \(\d+%\), "
                      r"read [\d.]+ \(\d+%\), cast [\d.]+ \(\d+%\), plan [\d.]+ \(\d+%\), other -?[\d.]+ \(-?\d+%\); "
                      r"GIL held ([\d.]+) \((\d+)%; garbage collection ([\d.]+) of it\)$", re.M)


def rates(out: str, peer: str) -> list[float]:
    return [float(x) for x in re.findall(rf"^{re.escape(peer)}\s+(\d+\.\d)", out, re.M)]


@pytest.mark.timeout(300)
def test_bench_tiny_smoke(tmp_path, capsys):
    data = tmp_path / "bench"
    rc = main(["bench", "--tiny", "--scenarios", "1,2,6", "--batches", "3", "--slow-batches", "1",
               "--data", str(data)])
    assert rc == 0
    out = capsys.readouterr().out
    for peer in PEERS:
        assert len(rates(out, peer)) == 3 and min(rates(out, peer)) > 0, (peer, out)
    assert out.count("of decode bound") == 3 and out.count("first batch") == 3
    per_batch = CPU_LINE.findall(out)
    assert len(per_batch) == 3 and all(float(ms) > 0 and float(held) > 0 for ms, _, held, _, _ in per_batch), out
    assert out.count("stoker alone (fresh process): peak RSS") == 3
    # the cold first batch is measured, not only the warm one (where the page cache can be dropped)
    cold = re.findall(r"; \d+ ms in a fresh process with its arrays out of the page cache$", out, re.M)
    assert len(cold) == (3 if hasattr(os, "posix_fadvise") else 0), out
    assert re.search(r"^stoker dataset growth \(\d+ batches, every array visited\)", out, re.M), out
    # a second run reuses the generated datasets instead of writing them again
    meta = data / "tiny-lz4" / "array.zarr" / "zarr.json"
    before = meta.stat().st_mtime_ns
    capsys.readouterr()
    doc = tmp_path / "sweep.json"
    assert main(["bench", "--tiny", "--scenarios", "1", "--batches", "2", "--peers", "tensorstore", "--threads", "1",
                 "--data", str(data), "--json", str(doc)]) == 0
    assert meta.stat().st_mtime_ns == before
    # a thread sweep: a stoker peer per thread count beside the default one, each with its CPU line, and a
    # row of where its engine threads' time went (busy, the split, the OS's view, the coordinator per batch)
    out = capsys.readouterr().out
    assert re.search(r"^stoker t=1\s+\d+\.\d", out, re.M) and re.search(r"^stoker t=1 per batch: ", out, re.M), out
    if engine_available():
        assert "engine threads in the timed window" in out, out
        assert re.search(r"^stoker t=1\s+1\s+\d+\.\d\s+[\d.]+-[\d.]+(\s+[\d.]+){8}", out, re.M), out
        workers = json.loads(doc.read_text())["scenarios"][0]["peers"][0]["workers"]
        assert workers["threads"] == 1 and len(workers["per_thread"]) == 1 and workers["chunks"] > 0
        assert abs(sum(workers["shares"].values()) - 1) < 1e-6 and 0 < workers["busy_share"] <= 1
        assert workers["coordinator_ms_per_batch"] > 0 and workers["us_per_chunk"]["decode"] > 0
        assert workers["cpu_us_per_chunk"] is None or workers["cpu_us_per_chunk"] > 0
    with pytest.raises(SystemExit) as exited:  # usage errors: one line on stderr, status 2
        main(["bench", "--tiny", "--threads", "0", "--data", str(data)])
    assert exited.value.code == 2 and "at least 1" in capsys.readouterr().err
    assert main(["bench", "--tiny", "--device", "cuda", "--threads", "2", "--data", str(data)]) == 2
    assert "without --device cuda" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_bench_tiny_scenario_8_small_inner_chunks(tmp_path, capsys):
    # scenario 8's layout in small: zstd shards of small inner chunks, crops twice an inner chunk, batch 16
    from stoker.bench.runner import scenarios

    sc = next(s for s in scenarios(tiny=True) if s.number == 8)
    big = next(s for s in scenarios() if s.number == 8)
    layout = [(s.volume.codec, s.volume.dtype, s.batch_size) for s in (sc, big)]
    assert layout == [("zstd", "uint16", 16)] * 2
    assert sc.volume.shards and all(c * 2 == k for c, k in zip(sc.volume.chunks, sc.crop))
    assert big.volume.shards == (128, 256, 256) and big.volume.chunks == (32, 32, 32) and big.crop == (64, 64, 64)
    assert main(["bench", "--tiny", "--scenarios", "8", "--batches", "2", "--slow-batches", "1",
                 "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Scenario 8: .*\(batch 16, 2 timed batches per fast peer; compression ratio", out, re.M), out
    for peer in PEERS:
        assert len(rates(out, peer)) == 1 and rates(out, peer)[0] > 0, (peer, out)
    assert len(CPU_LINE.findall(out)) == 1, out
    capsys.readouterr()
    # --batch-size still sets every scenario's batch
    assert main(["bench", "--tiny", "--scenarios", "8", "--batches", "2", "--peers", "tensorstore",
                 "--batch-size", "4", "--data", str(tmp_path)]) == 0
    assert "(batch 4, 2 timed batches" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_bench_busy_consumer(tmp_path, capsys):
    # after each batch every peer's consumer runs Python for --step-ms; the decode bound is left out
    assert main(["bench", "--tiny", "--scenarios", "1,8", "--batches", "3", "--slow-batches", "1", "--step-ms", "2",
                 "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("busy consumer: 2.00 ms of Python holding the GIL after each batch (--step-ms)") == 2, out
    for peer in PEERS[:-1]:
        assert len(rates(out, peer)) == 2 and min(rates(out, peer)) > 0, (peer, out)
    assert not rates(out, "decode bound") and "of decode bound" not in out
    assert out.count("decode bound left out") == 2
    assert len(CPU_LINE.findall(out)) == 2, out
    capsys.readouterr()
    # auto: a step as long as tensorstore's median batch, measured first without one
    assert main(["bench", "--tiny", "--scenarios", "1", "--batches", "3", "--peers", "stoker,tensorstore",
                 "--step-ms", "auto", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    step = re.search(r"^busy consumer: (\d+\.\d+) ms of Python holding the GIL after each batch \(auto: "
                     r"tensorstore's median batch time without a step\); the steps alone allow at most "
                     r"(\d+\.\d) samples/s", out, re.M)
    assert step and float(step[1]) > 0 and float(step[2]) == pytest.approx(8 / float(step[1]) * 1e3, rel=0.01), out
    assert min(rates(out, "stoker") + rates(out, "tensorstore")) > 0
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["bench", "--tiny", "--step-ms", bad, "--data", str(tmp_path)])
    capsys.readouterr()
    assert main(["bench", "--tiny", "--device", "cuda", "--step-ms", "2", "--data", str(tmp_path)]) == 2
    assert "--step-ms runs with the CPU pipeline" in capsys.readouterr().err


def test_busy_step_holds_the_gil_for_its_length():
    # the step is Python, not a sleep: it spends its time on the CPU (a sleep would release the GIL)
    import time

    from stoker.bench.runner import Consumer, busy_step

    t0, c0 = time.perf_counter(), time.thread_time()
    busy_step(0.05)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert wall >= 0.05 and cpu > 0.005  # a sleep would spend next to no CPU (wide margin: a shared machine)
    consume = Consumer(0.02)
    consume(None)
    assert consume.step_cpu_s > 0  # kept, to leave out of the loader's CPU time
    assert Consumer(0.0)(None) is None and Consumer(0.0).step_cpu_s == 0


@pytest.mark.timeout(300)
def test_bench_records_tiny_smoke(tmp_path, capsys):
    assert main(["bench", "records", "--tiny", "--data", str(tmp_path / "bench")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^stoker\.records\.Loader \(threads\)\s+\d+\.\d", out, re.M), out
    assert re.search(r"^DataLoader\(num_workers\) \+ zarr\s+\d+\.\d+\s+\d+\.\d+x", out, re.M), out
    small = max(50, records_for_steady_state(2, 1))  # more than 50 only on machines of many cores
    assert re.search(rf"^\s+{small:,} records: .* per record\)$", out, re.M), out
    assert re.search(rf"^\s+{10 * small:,} records:", out, re.M), out


def test_bench_records_sizes_its_data_for_every_core(monkeypatch, tmp_path):
    # 16 cores keep 32 DataLoader batches in flight: 50 records were too few to time them (a ValueError)
    import stoker.bench.records as records

    seen = {}
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(records, "run", lambda root, n_small, n_large, batch_size, n_batches: seen.update(
        n_small=n_small, n_large=n_large, batch_size=batch_size) or "")
    for tiny in ([], ["--tiny"]):
        assert main(["bench", "records", *tiny, "--data", str(tmp_path)]) == 0
        timed = seen["n_small"] // seen["batch_size"] - 1 - 2 * 32  # what run() can time after the prefetch
        assert timed >= 1 and seen["n_large"] == 10 * seen["n_small"]


@pytest.mark.timeout(120)
def test_gpu_benchmarks_say_why_they_cannot_run_without_cuda(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--device", "cuda", "--tiny", "--data", str(tmp_path)], ["bench-h2d"]):
        assert main(argv) == 2  # one line, status 2, as every other mistake (it exited 1 with SystemExit)
        err = capsys.readouterr().err
        assert "torch sees no CUDA device" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_device_bench_stoker_peer_runs_on_cpu(tmp_path):
    """The GPU benchmark's stoker peer is the real pipeline; on the CPU it runs end to end here."""
    from stoker.bench.datasets import ensure
    from stoker.bench.device import run_stoker_on
    from stoker.bench.runner import make_samples, scenarios

    sc = scenarios(tiny=True)[0]
    paths = ensure(tmp_path, sc.volume, progress=False)
    samples = make_samples(paths, sc.volume.shape, sc.crop, 4 * 3, sc.grid)
    r = run_stoker_on(samples, 4, 2, 64 << 20, "cpu")
    assert r.peer == "stoker cpu" and r.samples == 8 and r.samples_per_s > 0
    assert r.extra["stats"].batches_emitted == 2 and r.extra["pinned_bytes"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,codecs", [
    ("zstd", [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]),
    ("blosc", [{"name": "bytes", "configuration": {"endian": "little"}},
               {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 2}}]),
    ("gzip", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip", "configuration": {"level": 1}}]),
], ids=["zstd", "blosc", "gzip"])
def test_decode_bound_decodes_every_byte_of_the_chunk(tmp_path, monkeypatch, name, codecs):
    """The bound decodes each chunk in full: a lone zstd or blosc frame straight into the reused buffer,
    anything else through the codec chain; either way it yields the chunk zarr wrote."""
    import numpy as np
    import zarr

    from stoker.reader.array import open_array
    from stoker.bench.runner import decode_chunk_into

    rng = np.random.default_rng(0)
    data = rng.integers(0, 1000, (8, 32, 32), dtype=np.uint16)
    path = str(tmp_path / "a.zarr")
    z = zarr.create_array(path, shape=data.shape, chunks=(4, 32, 32), dtype="uint16", serializer=codecs[0],
                          compressors=codecs[1:], zarr_format=3)
    z[...] = data
    reader = open_array(path)
    codec = reader.metadata.codec
    fast = codec.lone_zstd or (codec.plain and codec.lone_blosc)
    assert fast == (name != "gzip")  # each case takes the path it is named for
    chain_results = []
    chain_decode = type(codec).decode
    monkeypatch.setattr(type(codec), "decode",
                        lambda self, d, k="?": chain_results.append(chain_decode(self, d, k)) or chain_results[-1])
    out = np.full(codec.nbytes, 0xAB, dtype=np.uint8)
    for index in ((0, 0, 0), (1, 0, 0)):
        key, stored = reader.encoded_chunk(index)
        decode_chunk_into(codec, key, stored, out)
        expected = data[4 * index[0]:][:4]
        if fast:  # into the reused buffer, without the codec chain
            assert chain_results == []
            np.testing.assert_array_equal(out.view(np.uint16).reshape(4, 32, 32), expected)
        else:  # through the chain, once per chunk
            assert len(chain_results) == 1
            np.testing.assert_array_equal(chain_results.pop(), expected)


@pytest.mark.parametrize("cpu_samples, gpu_rate, verdict", [
    (360, 590.6, "GPU delivery runs at 1.64x the CPU path's throughput"),
    (360, 324.0, "GPU delivery costs 10.0% of the CPU path's throughput"),
    (0, 324.0, "GPU delivery: no CPU baseline"),
])
def test_gpu_bench_says_which_way_delivery_went(monkeypatch, cpu_samples, gpu_rate, verdict):
    # on the H100 the GPU path beat the CPU path (its cast runs on the GPU): "costs -64.1%" read badly
    from types import SimpleNamespace

    import torch

    from stoker.bench.device import format_device_results
    from stoker.bench.runner import Result, scenarios

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    stats = SimpleNamespace(stages={}, samples=8, bytes_to_device=4096, bytes_read=4096, batches_emitted=2)
    results = [Result("stoker cpu", 1.0, cpu_samples, 0, 0, {}),
               Result("stoker cuda", 1.0, gpu_rate, 0, 0, {"stats": stats, "pinned_bytes": 0}),
               Result("tensorstore+pin", 1.0, 558, 0, 0, {})]
    report = format_device_results(scenarios(tiny=True)[0], results, 3)
    assert verdict in report and "bytes over PCIe per batch 2,048" in report


def test_gpu_bench_sets_gpu_decode_beside_the_cpu_decode_path(monkeypatch):
    from types import SimpleNamespace

    import torch

    from stoker.bench.device import format_device_results
    from stoker.bench.runner import Result, scenarios

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    cuda = SimpleNamespace(stages={}, samples=8, bytes_to_device=8192, bytes_read=4096, batches_emitted=2)
    gpu = SimpleNamespace(stages={}, samples=8, bytes_to_device=4096, bytes_read=4096, batches_emitted=2)
    results = [Result("stoker cpu", 1.0, 400, 0, 0, {"cores": 1.9}),
               Result("stoker cuda", 1.0, 500, 0, 0, {"stats": cuda, "pinned_bytes": 0, "cores": 1.8}),
               Result("tensorstore+pin", 1.0, 300, 0, 0, {}),
               Result("stoker gpu-decode", 1.0, 1250, 0, 0, {"stats": gpu, "pinned_bytes": 0, "cores": 0.75})]
    report = format_device_results(scenarios(tiny=True)[0], results, 3)
    assert "GPU decode: 2.50x the CPU-decode path with 0.75 CPU cores busy" in report
    assert "stoker gpu-decode: bytes over PCIe per batch 2,048 (encoded bytes read per batch 2,048)" in report
    assert "stoker cuda: bytes over PCIe per batch 4,096" in report
    row = next(line for line in report.splitlines() if line.startswith("tensorstore+pin"))
    assert row.split()[-2:] == ["1.67x", "4.17x"]  # cuda x, gpu-decode x


def test_gpu_bench_reports_the_hybrid_decode_s_pcie_bytes_per_engine(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    import torch

    from stoker.bench.device import format_device_results
    from stoker.bench.runner import Result, scenarios

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    cuda = SimpleNamespace(stages={}, samples=8, bytes_to_device=8192, bytes_read=4096, batches_emitted=2)
    hybrid = SimpleNamespace(stages={}, samples=8, bytes_to_device=7000, bytes_to_device_host=5000,
                             bytes_read=4096, batches_emitted=2)
    results = [Result("stoker cpu", 1.0, 400, 0, 0, {"cores": 1.9}),
               Result("stoker cuda", 1.0, 500, 0, 0, {"stats": cuda, "pinned_bytes": 0, "cores": 1.8}),
               Result("stoker hybrid", 1.0, 800, 0, 0, {"stats": hybrid, "pinned_bytes": 0, "cores": 1.5})]
    report = format_device_results(scenarios(tiny=True)[0], results, 3)
    assert ("stoker hybrid: bytes over PCIe per batch 3,500 (host part 2,500, device part 1,000; encoded bytes "
            "read per batch 2,048)") in report
    assert "hybrid decode: 2.00x the CPU path, 1.60x the CPU-decode CUDA path, with 1.50 CPU cores busy" in report
    assert "stoker cuda: bytes over PCIe per batch 4,096 (encoded" in report  # one engine: no split
    assert main(["bench", "--tiny", "--decode-on", "hybrid", "--data", str(tmp_path)]) == 2
    assert "--decode-on hybrid decodes on the GPU: run it with --device cuda" in capsys.readouterr().err


def test_gpu_bench_times_the_cpu_path_without_a_cpu_reduction(monkeypatch):
    # the CPU peer of `bench --device cuda` used to sum every bf16 batch on the CPU, which cost more than
    # the pipeline itself and flattered the GPU path
    import stoker
    import stoker.bench.device as device_bench

    seen = {}

    def fake_time_pipeline(p, samples, batch_size, consume=lambda x: None, sync=lambda: None, clock=None):
        seen["consume"] = consume
        clock["cpu"] = 0.5
        return 1, 1.0, 0.0

    class NoSum:
        def sum(self):
            raise AssertionError("the CPU peer reduced its batch on the CPU")

    monkeypatch.setattr(device_bench, "time_pipeline", fake_time_pipeline)
    result = device_bench.run_stoker_on([stoker.Sample("unused.zarr", [(0, 4), (0, 4)])], 1, 2, 64 << 20, "cpu")
    assert result.peer == "stoker cpu"
    seen["consume"](NoSum())


def test_bench_writes_every_batch_slot_before_its_clock_starts():
    # a pipeline reuses its slots for the whole run: their first touch is not the steady state (it cost
    # scenario 4's 30-batch window a third of its rate); the first-batch time is still the first batch's
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch

    from stoker.bench.runner import time_pipeline

    events = []

    class FakePipeline:
        cfg = SimpleNamespace(lookahead_batches=3)

        def push(self, samples):
            events.append(("push", len(samples)))

        def pop(self):
            events.append(("pop",))
            return nullcontext(torch.zeros(1))

        def stats_reset(self):
            events.append(("clock",))

    n, _, _ = time_pipeline(FakePipeline(), list(range(10 * 2)), 2)
    clock = events.index(("clock",))
    assert events[:clock].count(("pop",)) == 4  # lookahead 3 + the consumer's slot
    assert events[:2] == [("push", 2), ("pop",)]  # the first batch alone: its latency is measured clean
    assert n == 9 and events[clock:].count(("pop",)) == 9


@pytest.mark.parametrize("argv, words", [
    (["bench", "--peers", "stoker,foo"], "unknown peer 'foo'; the peers are stoker,tensorstore"),
    (["bench", "--tiny", "--scenarios", "3"], "--scenarios 3: no such scenario; the --tiny scenarios are 1,2,6,8,9,10"),
    (["bench", "--scenarios", "one"], "whole number of at least 1, got 'one'"),
    (["bench", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["bench", "--rounds", "0"], "whole number of at least 1"),
    (["inspect", "/nowhere.zarr", "--sample-shape", "0", "4"], "crop extents of at least 1, got '0'"),
    (["inspect", "/nowhere.zarr"], "no Zarr array at /nowhere.zarr"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["inspect"], "the following arguments are required: uri"),
    (["inspect", "/nowhere.zarr", "--sample-shape"], "--sample-shape: expected at least one argument"),
    (["inspect", "/nowhere.zarr", "--sample-shape", "1.5"], "crop extents of at least 1, got '1.5'"),
    (["inspect", "ftp://host/v.zarr"], "unknown URI scheme 'ftp'"),
    (["bench", "records", "--json", "x.json"], "--json and --plot record the crops suite"),
    (["plot"], "the following arguments are required: RUN_DIR"),
])
def test_cli_mistakes_are_one_line_and_status_2(tmp_path, capsys, argv, words):
    try:
        code = main([*argv, *(["--data", str(tmp_path)] if argv[0] == "bench" else [])])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_doctor_reports_what_loading_data_depends_on(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for what in ("stoker", "torch", "numcodecs", "zarr", "tensorboard", "matplotlib", "compiled reader", "GPUs",
                 "CPUs", "locked memory", "open files", "/dev/shm"):
        assert re.search(rf"^{re.escape(what)}\s+\S", out, re.M), (what, out)
    from stoker.engine.cpu import native

    assert ("loaded; decodes" in out) == (native.Engine is not None), out


@pytest.mark.timeout(300)
def test_bench_records_mesh_tiny_smoke(tmp_path, capsys):
    assert main(["bench", "records", "--mesh", "--tiny", "--data", str(tmp_path / "bench")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^stoker Loader \(\d+ threads\) \+ Concat\(along\)\s+\d+\.\d", out, re.M), out
    assert re.search(r"^DataLoader\(2 workers\) \+ zarr \+ hand collate\s+\d+\.\d+\s+\d+\.\d+x", out, re.M), out
    assert re.search(r"^\s+10,000\s+\d+\.\d{3}\s+\d+\.\d{3}", out, re.M), out  # both knn methods timed
    assert "DISAGREE" not in out
    assert main(["bench", "--mesh", "--tiny"]) != 0
    assert "stoker bench records --mesh" in capsys.readouterr().err
