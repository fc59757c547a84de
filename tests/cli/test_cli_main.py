"""The ``stoker`` command as a shell user meets it: output into a closed pipe, usage errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stoker.cli import main

pytestmark = pytest.mark.timeout(120)


def test_output_into_a_closed_pipe_ends_quietly():
    """``stoker doctor | head -1``: the reader has gone before stoker writes. That is no error of the user's
    and no bug: no traceback, no 'Exception ignored' at exit, and the status a SIGPIPE'd command reports."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone: every write to the pipe fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "stoker", "doctor"], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=100, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stderr == "" and done.returncode == 141


def test_doctor_names_every_codec_the_compiled_reader_decodes():
    """The README says the compiled reader decodes zstd, blosc, lz4, gzip and zlib; doctor said
    'decodes zstd, blosc' whatever it loaded. It names each codec the engine was handed, and no other."""
    from stoker.cli.doctor import report
    from stoker.engine.cpu import native

    if native.Engine is None:
        pytest.skip("the compiled reader is not loaded here")
    (row,) = [value for what, value, _ in report() if what == "compiled reader"]
    expected = [name for name, on in (("zstd", native.zstd), ("blosc", native.blosc), ("lz4", native.lz4_ready),
                                      ("gzip", native.zlib_ready), ("zlib", native.zlib_ready)) if on]
    assert row == f"loaded; decodes {', '.join(expected)}", row


@pytest.mark.parametrize("argv, words", [
    (["demo", "--steps", "ten"], "--steps: takes a whole number of at least 1, got 'ten'"),
    (["demo", "--nprocs", "0"], "--nprocs: takes a whole number of at least 1, got '0'"),
    (["demo", "--batch-size", "2.5"], "--batch-size: takes a whole number of at least 1, got '2.5'"),
    (["demo", "--seconds", "soon"], "--seconds: takes seconds (a number above 0), got 'soon'"),
    (["demo", "--seconds", "-3"], "--seconds: takes seconds (a number above 0), got '-3'"),
    (["demo", "--seconds", "nan"], "--seconds: takes seconds (a number above 0), got 'nan'"),
])
def test_demo_usage_errors_say_what_the_option_takes(capsys, argv, words):
    """A value that is not a number was argparse's 'invalid _positive_int value': the name of a private
    function, where every other command says what the option takes."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and "_positive" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, missing, words", [
    (["bench", "--tiny", "--scenarios", "1"], "tensorstore", "--peers stoker,zarr,dataloader,bound"),
    (["bench", "--tiny", "--scenarios", "12", "--peers", "stoker"], "xarray", "scenario 12"),
])
def test_bench_says_what_to_install_before_it_runs_anything(tmp_path, capsys, monkeypatch, argv, missing, words):
    """stoker bench on a plain install (no tensorstore: it is in the bench extra) ran the stoker peer, then
    stopped in the tensorstore peer with a ModuleNotFoundError traceback, minutes into a full run."""
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    assert main([*argv, "--data", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert f"needs {missing}" in err and "pip install 'stoker[bench]'" in err and words in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "data").exists()  # nothing written, nothing run


def test_demo_fresh_deletes_only_what_a_demo_run_wrote(tmp_path):
    """`stoker demo --fresh --run-dir .` in a project folder deleted the whole folder (rmtree, errors
    ignored): --fresh now removes the checkpoints, telemetry and its picture, and nothing else."""
    from stoker.demo.run import DemoSettings, _fresh_start
    from stoker.train import launch

    run = tmp_path / "project"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-000000004.pt").write_bytes(b"ckpt")
    for name in ("telemetry.jsonl", "telemetry.png", "events.out.tfevents.1.host.1.0"):
        (run / name).write_text("run output")
    (run / "train.py").write_text("print('my own code')")
    (run / "data").mkdir()
    (run / "data" / "volume.zarr").write_text("my own data")
    settings = DemoSettings(data="unused", run_dir=str(run), steps=1, seconds=None, batch_size=1, accumulate=1,
                            checkpoint_every=1, resume=False, fresh=True)
    launch(_fresh_start, settings, nprocs=1, use_cuda=False)
    assert sorted(p.name for p in run.iterdir()) == ["data", "train.py"]
    assert (run / "data" / "volume.zarr").read_text() == "my own data"


def test_demo_refuses_a_run_dir_that_is_a_file_before_it_starts(tmp_path, capsys, monkeypatch):
    """--run-dir naming a file trained a step on every rank, then failed writing the checkpoint with a
    rank's traceback; it is a one-line usage mistake, said before any data is written or rank started."""
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "notes.txt").write_text("a file")
    assert main(["demo", "--cpu", "--steps", "1", "--no-progress", "--run-dir", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {tmp_path / 'notes.txt'}" in err and "is not a folder" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("suite", [[], ["records"]])
def test_bench_refuses_a_data_dir_that_is_a_file(tmp_path, capsys, suite):
    """--data naming a file was a FileExistsError traceback from the dataset writer's mkdir."""
    (tmp_path / "notes.txt").write_text("a file")
    assert main(["bench", *suite, "--tiny", "--data", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path / 'notes.txt'}" in err and "is not a folder" in err, err
    assert len(err.strip().splitlines()) == 1


def test_bench_sizes_take_the_same_suffixes():
    """--cache-bytes took 64M but --host-buffer-bytes, the other size in bytes of the same command, refused
    it ('takes a whole number'); both take K, M, G, T (powers of 1024) now."""
    from stoker.cli import build_parser

    args = build_parser().parse_args(["bench", "--host-buffer-bytes", "256M", "--cache-bytes", "64M"])
    assert (args.host_buffer_bytes, args.cache_bytes) == (256 << 20, 64 << 20)
    assert build_parser().parse_args(["bench", "--host-buffer-bytes", "1048576"]).host_buffer_bytes == 1 << 20


def test_bench_host_buffer_bytes_below_what_config_takes_is_a_usage_error(capsys):
    """--host-buffer-bytes 1K passed the parser ('a size in bytes of at least 1'), printed the bench's header and
    then stopped on 'Config.host_buffer_bytes must be an integer >= 1048576, got 1024', a knob the command line
    does not have; the flag now says its own least value, as a usage error before any work."""
    from stoker.cli import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["bench", "--host-buffer-bytes", "1023K"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--host-buffer-bytes" in err and "at least 1M" in err and "'1023K'" in err, err
    assert build_parser().parse_args(["bench", "--host-buffer-bytes", "1M"]).host_buffer_bytes == 1 << 20


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_doctor_says_the_compiled_reader_was_turned_off_however_it_was(value):
    """STOKER_NATIVE=off turns the compiled reader off as STOKER_NATIVE=0 does (native._disabled), but
    doctor matched "0" alone and told the user it was 'not built (no C compiler at install?)'."""
    code = ("from stoker.cli.doctor import report; "
            "print([v for w, v, _ in report() if w == 'compiled reader'][0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "STOKER_NATIVE": value})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"off: STOKER_NATIVE={value}", done.stdout


def test_storage_options_of_the_disk_cache_are_numbers_too():
    """--storage-option cache_bytes=100000000 reached the store as the string '100000000' and was refused
    ('must be an integer >= 0, got '100000000''): the disk cache's settings could not be given at all."""
    from stoker.cli.args import storage_options
    from stoker.errors import InvalidArgument

    got = storage_options([("cache_dir", "/tmp/c"), ("cache_bytes", "100000000"), ("cache_staleness_s", "5"),
                           ("retries", "2"), ("region", "eu-west-1")])
    assert got == {"cache_dir": "/tmp/c", "cache_bytes": 100000000, "cache_staleness_s": 5.0, "retries": 2,
                   "region": "eu-west-1"}
    assert type(got["cache_staleness_s"]) is float and type(got["cache_bytes"]) is int
    with pytest.raises(InvalidArgument, match="retries= takes a whole number"):
        storage_options([("retries", "1.5")])
    with pytest.raises(InvalidArgument, match="cache_staleness_s= takes a number"):
        storage_options([("cache_staleness_s", "soon")])


@pytest.mark.parametrize("extra, flag", [(["--device", "cuda"], "--device cuda"), (["--scenarios", "1"], "--scenarios"),
                                         (["--peers", "stoker"], "--peers"), (["--batch-size", "4"], "--batch-size"),
                                         (["--rounds", "2"], "--rounds"), (["--threads", "2"], "--threads")])
def test_bench_records_refuses_the_crops_suites_options(tmp_path, capsys, extra, flag):
    """`stoker bench records --device cuda` ran the records suite on the CPU, the option ignored without a
    word (as were --scenarios, --peers, --batch-size...): the user read CPU numbers as GPU ones."""
    assert main(["bench", "records", "--tiny", *extra, "--data", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert flag in err and "stoker bench records takes" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "data").exists()


_FULL_DISK = r"""
import resource, signal, sys
from stoker.cli import main

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))  # no file may grow past 16 KiB: a full disk
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("suite,options", [([], ["--scenarios", "1", "--peers", "stoker"]), (["records"], [])])
def test_bench_datasets_the_disk_does_not_take_are_a_storage_error(tmp_path, suite, options):
    """stoker bench writing its datasets onto a full disk stopped with an OSError traceback (EFBIG, ENOSPC)
    from zarr's writer; it is a StorageError naming the dataset's folder, the cause and --data, on one line,
    with nothing half-written left behind."""
    data = tmp_path / "bench-data"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, "bench", *suite, "--tiny", *options,
                          "--batches", "1", "--data", str(data)], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    (err,) = [line for line in out.stderr.splitlines() if line.startswith("stoker bench: cannot write")] or [
        out.stderr[-3000:]]
    assert f"{data}" in err and "File too large" in err, err
    assert "--data" in err and "is full" in err, err
    left = [p.name for p in data.iterdir() if not p.name.startswith(".")]
    assert left == [], (left, out.stderr[-3000:])  # no dataset, no temporary left


def test_bench_host_buffer_bytes_floor_is_configs_own(monkeypatch, capsys):
    """The flag's least value was a 1 MiB written again in cli/bench.py beside Config's table of limits: a
    floor changed there would leave the flag taking sizes Config refuses after the header is printed (or
    refusing sizes it takes). It is read from Config's table now, and its message says that value."""
    import stoker
    from stoker import config
    from stoker.cli import build_parser

    monkeypatch.setitem(config._INTEGER_KNOBS, "host_buffer_bytes", 4 << 20)
    with pytest.raises(stoker.InvalidArgument):
        stoker.Config(host_buffer_bytes=2 << 20)
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["bench", "--host-buffer-bytes", "2M"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--host-buffer-bytes" in err and "at least 4M" in err and f"{4 << 20:,} bytes" in err, err
    assert build_parser().parse_args(["bench", "--host-buffer-bytes", "4M"]).host_buffer_bytes == 4 << 20
    assert stoker.Config(host_buffer_bytes=4 << 20).host_buffer_bytes == 4 << 20
