"""Pictures and JSON: stoker bench --json/--plot, stoker plot RUN_DIR, stoker inspect --json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import stoker.train as st
import train_jobs as jobs
from stoker.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path, at_least=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > at_least, (path, len(data))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real short training run's telemetry, with evaluation and a skipped (NaN) step."""
    pytest.importorskip("matplotlib")
    run = tmp_path_factory.mktemp("run")
    model = jobs.Tiny()
    trainer = st.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), jobs.mse, device="cpu",
                         telemetry_dir=run, log_every=1, progress=False)
    batches = jobs.global_batches(8, 4)
    batches[3] = batches[3].clone()
    batches[3][0, 0] = float("nan")
    trainer.fit(batches, steps=8, resume=None, eval_data=jobs.global_batches(10, 4)[8:], eval_every=4)
    return run


def test_stoker_plot_draws_a_runs_telemetry(run_dir, capsys):
    assert main(["plot", str(run_dir)]) == 0
    out = run_dir / "telemetry.png"
    assert capsys.readouterr().out.strip() == str(out)
    _png(out)
    other = run_dir / "elsewhere" / "t.png"
    assert main(["plot", str(run_dir / "telemetry.jsonl"), "-o", str(other)]) == 0
    _png(other)


def test_plot_reads_every_metric_and_survives_a_resumed_log(run_dir, tmp_path):
    from stoker.cli.plots import read_telemetry

    series = read_telemetry(run_dir)
    assert sorted(series["loss"]) == [1, 2, 3, 5, 6, 7, 8]  # step 4's NaN loss is null: left out
    assert sorted(series["eval_loss"]) == [4, 8] and series["skipped_steps"][8] == 1
    assert all(v > 0 for v in series["samples_per_s"].values())
    log = tmp_path / "telemetry.jsonl"  # a killed run's steps logged again by its resumption, and a cut line
    lines = (run_dir / "telemetry.jsonl").read_text().splitlines()
    log.write_text("\n".join(lines + lines[2:4] + ['{"step": 9, "lo']) + "\n")
    assert read_telemetry(tmp_path)["loss"] == series["loss"]


def test_plot_mistakes_are_one_line_and_status_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no telemetry at" in capsys.readouterr().err
    (tmp_path / "telemetry.jsonl").write_text("not json\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no telemetry records" in capsys.readouterr().err
    bad = tmp_path / "bench.json"
    bad.write_text('{"scenarios": 3}')
    assert main(["plot", str(bad)]) == 2
    assert "not the JSON stoker bench --json writes" in capsys.readouterr().err
    missing = tmp_path / "results.json"
    assert main(["plot", str(missing)]) == 2
    assert f"no bench results at {missing} (write them with stoker bench --json FILE)" in capsys.readouterr().err


def test_telemetry_with_bytes_that_are_not_text_skips_those_lines(tmp_path, capsys):
    """A line of telemetry that is not UTF-8 (a disk's garbage after a crash, or not a telemetry file at all)
    is a line that does not parse: skipped, as read_telemetry says, never a UnicodeDecodeError."""
    from stoker.cli.plots import read_telemetry

    log = tmp_path / "telemetry.jsonl"
    log.write_bytes(b'{"step": 1, "loss": 0.5}\n\xe9\xff\x00garbage\n{"step": 2, "loss": 0.25}\n')
    assert read_telemetry(tmp_path) == {"loss": {1: 0.5, 2: 0.25}}
    log.write_bytes(bytes(range(256)) * 4)
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no telemetry records" in capsys.readouterr().err


def test_bench_json_without_a_peers_numbers_is_a_one_line_error(tmp_path, capsys):
    """JSON with a 'scenarios' list whose peers lack what stoker bench --json writes (a hand edit, another
    tool's file): the error names what is missing, not a KeyError traceback."""
    bad = tmp_path / "bench.json"
    for peer, missing in (({"peer": "x"}, "samples_per_s"), ({"samples_per_s": 3.0}, "peer"),
                          ({"peer": "x", "samples_per_s": None}, "samples_per_s"), ("x", "peer")):
        bad.write_text(json.dumps({"scenarios": [{"number": 4, "peers": [peer]}]}))
        assert main(["plot", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "not the JSON stoker bench --json writes" in err and missing in err and "scenario 4" in err, err


def test_without_matplotlib_the_error_is_typed_and_one_line(tmp_path):
    # a process where matplotlib cannot be imported (whether or not it is installed here)
    code = ("import sys; sys.modules['matplotlib'] = None; from stoker.cli import main; "
            f"sys.exit(main(['plot', {str(tmp_path)!r}]))")
    (tmp_path / "telemetry.jsonl").write_text('{"step": 1, "time": 0, "loss": 1.0}\n')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "needs matplotlib" in proc.stderr and "stoker[plot]" in proc.stderr
    code = "import sys; sys.modules['matplotlib'] = None; import stoker.cli.plots as p; p.plot_telemetry(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "stoker.errors.MissingDependency" in proc.stderr


@pytest.mark.timeout(300)
def test_bench_json_holds_the_numbers_and_plot_draws_them(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--tiny", "--scenarios", "1", "--batches", "2", "--peers", "stoker,tensorstore",
                 "--rounds", "2", "--data", str(tmp_path / "data"), "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    (sc,) = doc["scenarios"]
    assert sc["number"] == 1 and sc["batch_size"] == 8 and sc["timed_batches"] == 2
    peers = {p["peer"]: p for p in sc["peers"]}
    assert sorted(peers) == ["stoker", "tensorstore"]
    for name, p in peers.items():
        assert len(p["rounds"]) == 2 and min(p["rounds"]) <= p["samples_per_s"] <= max(p["rounds"])
        assert f"{p['samples_per_s']:.1f}" in printed  # the table's number
        assert p["samples"] == 16 and p["samples_per_s"] == pytest.approx(p["samples"] / p["seconds"])
    stages = peers["stoker"]["breakdown"]["stages_ms_per_batch"]
    assert set(stages) == {"decode", "read", "cast", "plan", "other"} and stages["decode"] > 0
    assert sum(stages.values()) == pytest.approx(peers["stoker"]["breakdown"]["cpu_ms_per_batch"])
    assert peers["stoker"]["read_amplification"] > 1 and "breakdown" not in peers["tensorstore"]
    _png(png)
    again = tmp_path / "again.png"  # stoker plot draws the same from the JSON
    assert main(["plot", str(out), "-o", str(again)]) == 0
    _png(again)


def test_inspect_json_holds_the_layout_and_the_estimate(tmp_path, capsys):
    import numpy as np
    import zarr

    path = tmp_path / "v.zarr"
    z = zarr.create_array(str(path), shape=(16, 64, 64), chunks=(8, 32, 32), dtype="float32", fill_value=float("nan"))
    z[:] = np.arange(16 * 64 * 64, dtype=np.float32).reshape(16, 64, 64)
    assert main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["shape"] == [16, 64, 64] and doc["chunks"] == [8, 32, 32] and doc["dtype"] == "float32"
    assert doc["zarr_format"] == 3 and doc["shards"] is None and doc["fill_value"] == "nan"
    assert doc["chunk_bytes"] == 8 * 32 * 32 * 4 and "crops" not in doc
    assert main(["inspect", str(path), "--json", "--sample-shape", "8", "32", "32"]) == 0
    crops = json.loads(capsys.readouterr().out)["crops"]
    assert crops["sample_shape"] == [8, 32, 32] and crops["chunks_per_crop"] > 1
    assert crops["read_amplification"] > 1 and crops["compression_ratio"] > 0 and isinstance(crops["advice"], list)


def test_an_output_path_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys):
    """-o naming a folder, or a file under a file: the user's mistake, said in one line (it was an
    IsADirectoryError or FileExistsError traceback, after the drawing)."""
    pytest.importorskip("matplotlib")
    (tmp_path / "telemetry.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    (tmp_path / "notes.txt").write_text("a file")
    for out, words in ((tmp_path, "is a folder"), (tmp_path / "notes.txt" / "t.png", "is not a folder")):
        assert main(["plot", str(tmp_path), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {out}" in err and words in err and len(err.strip().splitlines()) == 1, err


def test_bench_refuses_an_unwritable_json_or_plot_path_before_it_runs(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("a file")
    for flag, out in (("--json", tmp_path / "notes.txt" / "b.json"), ("--plot", tmp_path)):
        assert main(["bench", "--tiny", "--scenarios", "1", "--peers", "stoker", flag, str(out),
                     "--data", str(tmp_path / "data")]) == 2
        err = capsys.readouterr().err
        assert f"{flag} {out}: cannot write" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "data").exists()  # refused before any data was written or timed


def test_telemetry_without_a_loss_draws_without_warnings(tmp_path):
    """A log of samples/s alone (a loader's, or a run that logged no loss yet): the loss panel says so,
    as the others do, instead of matplotlib's 'No artists with labels found to put in legend' on stderr."""
    pytest.importorskip("matplotlib")
    import warnings

    from stoker.cli.plots import plot_telemetry

    (tmp_path / "telemetry.jsonl").write_text('{"step": 1, "samples_per_s": 3.0}\n{"step": 2, "samples_per_s": 4.0}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _png(plot_telemetry(tmp_path), at_least=1000)
