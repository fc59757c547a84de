"""``stoker bench``: stoker against tensorstore and zarr-python on the same crops, one process run; scenarios
11 and 12 (samples of named fields) against tensorstore and a DataLoader (bench/fields.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
from pathlib import Path
from typing import Callable

from ..config import least_value
from ..demo.volume import cache_dir
from ..errors import InvalidArgument, MissingDependency
from .args import at_least_one, byte_size, byte_size_at_least, unwritable

PEERS = ("stoker", "tensorstore", "zarr", "dataloader", "bound")
REMOTE_PEERS = ("stoker", "tensorstore", "dataloader")  # --store's default: the decode bound makes no reads
SLOW_BATCHES = 6  # --slow-batches' default


def run(args: argparse.Namespace) -> int:
    import torch

    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # refused now, not after the run
        why = None if path is None else unwritable(path)
        if why is not None:
            raise InvalidArgument(f"{flag} {path}: cannot write it: {why}")
    _check_data_dir(args)
    if args.plot is not None:
        from .plots import figure

        figure(1, 1)  # without matplotlib, say so now rather than after the whole run
    rounds = args.rounds or (1 if args.tiny else 3)
    if args.latency_ms is not None and args.store is None:
        raise InvalidArgument("--latency-ms delays the requests of a served store: give --store http or --store s3")
    if args.epochs is not None and args.store is None:
        raise InvalidArgument("--epochs reads a served store through a local disk cache: give --store http or "
                              "--store s3")
    if args.cache_bytes is not None and args.epochs is None:
        raise InvalidArgument("--cache-bytes bounds the disk cache that --epochs reads through: give --store http "
                              "or --store s3 and --epochs N")
    if args.cache_staleness_s is not None and args.epochs is None:
        raise InvalidArgument("--cache-staleness-s is the staleness bound of the disk cache that --epochs reads "
                              "through: give --store http or --store s3 and --epochs N")
    if args.store is not None and (args.suite == "records" or args.device == "cuda"):
        raise InvalidArgument(f"--store runs the crops suite on the CPU; run it without "
                              f"{'the records suite' if args.suite == 'records' else '--device cuda'}")
    if args.store is not None and args.peers and set(args.peers) & {"bound"}:
        raise InvalidArgument("--peers bound: the decode bound makes no reads, so it has no place in a --store run; "
                              f"choose among {','.join(p for p in PEERS if p != 'bound')}")
    if args.mesh and args.suite != "records":
        raise InvalidArgument("--mesh is a records benchmark: stoker bench records --mesh")
    if args.suite == "records":
        if args.json is not None or args.plot is not None:
            raise InvalidArgument("--json and --plot record the crops suite; stoker bench records prints a table")
        ignored = _crops_only(args)
        if ignored:
            raise InvalidArgument(f"{', '.join(ignored)}: stoker bench records takes --tiny, --mesh, --batches and "
                                  "--data only (the others set up the crops suite); run it without them")
        from ..bench.records import records_for_steady_state
        from ..bench.records import run as run_records

        root = args.data or cache_dir() / "bench"
        if args.mesh:
            from ..bench.meshes import knn_times, run_meshes

            n, nodes, steps, batch = (12, (200, 400), 4, 2) if args.tiny else (200, (2_000, 5_000), 10, 8)
            print(run_meshes(root, n, batch, min(args.batches or 15, 15), nodes, steps), flush=True)
            sizes = (1_000, 10_000) if args.tiny else (10_000, 100_000, 1_000_000)
            print(knn_times(sizes), flush=True)
            return 0
        timed = min(args.batches or 30, 40)  # run() times as many of these as the record set allows
        # Records enough to time that many batches (the tiny set: one) after every core's DataLoader prefetch
        # has filled; the large set is 10x, for the RSS-growth check.
        batch_size, sized_for = (2, 1) if args.tiny else (16, timed)
        small = max(50 if args.tiny else 2000, records_for_steady_state(batch_size, sized_for))
        print(run_records(root, small, 10 * small, batch_size=batch_size, n_batches=timed), flush=True)
        return 0

    from ..bench.runner import (BATCH_SIZE, dataloader_batches, dataset_ratio, format_results, host_budget,
                                run_scenario, scenarios)

    from ..bench import report

    from ..bench.fields import FIELDS_SCENARIOS

    records: list[dict] = []
    threads = args.threads or ()
    chosen = scenarios(tiny=args.tiny)
    fields = list(FIELDS_SCENARIOS)
    if args.scenarios:
        known = [s.number for s in chosen] + fields
        unknown = sorted(set(args.scenarios) - set(known))
        if unknown:
            raise InvalidArgument(f"--scenarios {','.join(map(str, unknown))}: no such scenario; the "
                                  f"{'--tiny ' if args.tiny else ''}scenarios are {','.join(map(str, known))}")
        # in the order given: a run cut short (a device call's time limit) has measured the first named
        by_number = {s.number: s for s in chosen}
        chosen = [by_number[n] for n in dict.fromkeys(args.scenarios) if n in by_number]
        fields = [n for n in fields if n in args.scenarios]
    if fields:  # named: refused with options they do not take; by default: left out of such runs
        _check_fields_args(args, fields, named=bool(args.scenarios))
        fields = fields if args.scenarios or not _fields_refused(args) else []
    peers = set(args.peers) if args.peers else set(PEERS if args.store is None else REMOTE_PEERS)
    _check_installed(args, peers, fields)
    root = args.data or cache_dir() / "bench"
    if args.decode_on in ("gpu", "hybrid") and args.device != "cuda":
        raise InvalidArgument(f"--decode-on {args.decode_on} decodes on the GPU: run it with --device cuda")
    if args.device == "cuda":
        if threads:
            raise InvalidArgument("--threads sweeps the CPU pipeline; run it without --device cuda")
        if args.thread_cpu:
            raise InvalidArgument("--thread-cpu measures the CPU pipeline's threads; run it without --device cuda")
        if args.step_ms is not None:
            raise InvalidArgument("--step-ms runs with the CPU pipeline; run it without --device cuda")
        from ..bench.device import cuda_or_exit, format_device_results, run_device_scenario

        cuda_or_exit()
        print(f"stoker bench --device cuda: {os.cpu_count()} cores, torch {torch.__version__}; batch "
              f"{args.batch_size or f'{BATCH_SIZE} unless a scenario says'}, bf16 out; data in {root}", flush=True)
        for sc in chosen:
            batch_size = args.batch_size or sc.batch_size
            budget = host_budget(sc, batch_size, args.host_buffer_bytes)
            n_batches = args.batches or sc.timed_batches
            results = run_device_scenario(sc, root, n_batches, batch_size, budget, rounds=rounds,
                                          decode_on=args.decode_on)
            ratio = dataset_ratio(root, sc)
            print(format_device_results(sc, results, n_batches, ratio), flush=True)
            records.append(report.scenario_record(sc, results, n_batches, batch_size, compression=ratio))
            _keep(args, records, "cuda", f"stoker bench --device cuda on {torch.cuda.get_device_name()}")
        return 0
    if args.store is not None:
        return _run_remote(args, chosen, peers, root, rounds, threads, records)
    from ..config import default_compute_threads

    print(f"stoker bench: {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}; "
          f"data in {root}" if not chosen else
          f"stoker bench: {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}; "
          f"batch {args.batch_size or f'{BATCH_SIZE} unless a scenario says'}; stoker's compute threads: "
          f"{default_compute_threads()} (the default); timed batches: {args.slow_batches} for zarr, "
          f"{dataloader_batches(args.slow_batches)[1]} in steady state for zarr+DataLoader; f32 out; data in {root}"
          + ("" if args.step_ms is None else "; busy consumer: " + (
              "after each batch, Python for as long as tensorstore's batch (auto)" if args.step_ms == "auto" else
              f"after each batch, {args.step_ms:g} ms of Python")))
    for sc in chosen:
        batch_size = args.batch_size or sc.batch_size
        budget = host_budget(sc, batch_size, args.host_buffer_bytes)
        n_batches = args.batches or sc.timed_batches
        results, step = run_scenario(sc, root, n_batches, batch_size, budget, args.slow_batches, peers,
                                     growth=sc.number == 6, rounds=rounds, threads=threads, step_ms=args.step_ms)
        ratio = dataset_ratio(root, sc)
        print(format_results(sc, results, n_batches, batch_size, step, ratio), flush=True)
        _print_thread_cpu(args, results)
        records.append(report.scenario_record(sc, results, n_batches, batch_size, step.seconds if step else None,
                                              ratio))
        _keep(args, records, "cpu", f"stoker bench on {os.cpu_count()} cores")
    if fields:
        _run_fields(args, fields, peers, root, rounds, records)
    return 0


def _check_data_dir(args: argparse.Namespace) -> None:
    """InvalidArgument when ``--data`` cannot hold the datasets (a file, or a folder not writable)."""
    why = None if args.data is None else unwritable(args.data / "dataset")
    if why is not None:
        raise InvalidArgument(f"--data {args.data}: the datasets cannot be written there: {why}; give a folder "
                              "(made if missing)")


def _check_installed(args: argparse.Namespace, peers: set[str], fields: list[int]) -> None:
    """MissingDependency, before anything is written or timed, for a package that the chosen peers and
    scenarios import and that is not installed (the bench extra's): a full run would stop in it minutes in."""
    needs = []
    if "tensorstore" in peers or args.device == "cuda":  # --device cuda always times tensorstore + pin_memory
        others = ",".join(p for p in PEERS if p in peers and p != "tensorstore")
        needs.append(("tensorstore", "the tensorstore peer" + (f"; or leave it out: --peers {others}" if others
                                                               and args.device != "cuda" else "")))
    if 12 in fields:
        needs.append(("xarray", "scenario 12 (forecasting from an xarray store); or leave it out with --scenarios"))
    for package, what in needs:
        try:
            importlib.import_module(package)
        except ImportError:
            cause, _, rest = what.partition(";")
            raise MissingDependency(f"{cause} needs {package}, which is not installed: pip install 'stoker[bench]' "
                                    f"(or {package}){';' + rest if rest else ''}", package=package,
                                    extra="bench") from None


#: Whether an option was given (other than its default), by the name the messages give it: what the crops
#: suite's options told to the records suite, and scenarios 11 and 12's refusals, are asked of.
_GIVEN: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--store": lambda a: bool(a.store),
    "--device cuda": lambda a: a.device == "cuda",
    "--scenarios": lambda a: bool(a.scenarios),
    "--peers": lambda a: bool(a.peers),
    "--rounds": lambda a: bool(a.rounds),
    "--threads": lambda a: bool(a.threads),
    "--thread-cpu": lambda a: bool(a.thread_cpu),
    "--batch-size": lambda a: bool(a.batch_size),
    "--step-ms": lambda a: a.step_ms is not None,  # more than 0, or "auto"
    "--host-buffer-bytes": lambda a: bool(a.host_buffer_bytes),
    "--slow-batches": lambda a: a.slow_batches != SLOW_BATCHES,
    "--decode-on": lambda a: a.decode_on != "cpu",
}


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """Those of ``flags`` (keys of :data:`_GIVEN`) given, in their order."""
    return [flag for flag in flags if _GIVEN[flag](args)]


def _crops_only(args: argparse.Namespace) -> list[str]:
    """The crops suite's options given to ``stoker bench records``, which would ignore them without a word."""
    return _given(args, ("--device cuda", "--scenarios", "--peers", "--rounds", "--threads", "--thread-cpu",
                         "--batch-size", "--step-ms", "--host-buffer-bytes", "--slow-batches", "--decode-on"))


def _fields_refused(args: argparse.Namespace) -> list[str]:
    """The options given that scenarios 11 and 12 do not take."""
    return _given(args, ("--store", "--device cuda", "--threads", "--thread-cpu", "--step-ms", "--batch-size",
                         "--host-buffer-bytes"))


def _check_fields_args(args: argparse.Namespace, numbers: list[int], named: bool) -> None:
    """InvalidArgument when scenarios 11 or 12 (samples of named fields, on the CPU) are ``named`` in
    --scenarios with an option they do not take."""
    given = _fields_refused(args)
    if given and named:
        raise InvalidArgument(f"{' and '.join(given)}: scenarios {','.join(map(str, numbers))} (samples of named "
                              "fields against tensorstore and a DataLoader) run on the CPU from the local data "
                              "directory with their own batch and budget; run them without it, or choose other "
                              "scenarios with --scenarios")


def _run_fields(args: argparse.Namespace, numbers: list[int], peers: set[str], root: Path, rounds: int,
                records: list[dict]) -> None:
    """Scenarios 11 and 12 (bench/fields.py): peers ``stoker`` (also ``stoker (no mask)``), ``tensorstore``
    and ``dataloader``; ``--batches`` sets the fast peers' timed batches."""
    from ..bench import report
    from ..bench.fields import run_fields_scenario

    def chosen(name: str) -> bool:
        key = "dataloader" if name.endswith("DataLoader") else name.split(" ")[0]
        return key in peers

    for number in numbers:
        sc, results, table = run_fields_scenario(number, root, rounds=rounds, tiny=args.tiny, n_batches=args.batches,
                                                 peers=chosen)
        print(table, flush=True)
        records.append(report.scenario_record(sc, results, args.batches or sc.timed_batches, sc.batch_size))
        _keep(args, records, "cpu", f"stoker bench on {os.cpu_count()} cores")


def _run_remote(args: argparse.Namespace, chosen: list, peers: set[str], root: Path, rounds: int,
                threads: tuple[int, ...], records: list[dict]) -> int:
    """The crops suite with every peer reading through the bench server (``--store``)."""
    from ..bench import report
    from ..bench.datasets import ensure
    from ..bench.remote import Remote
    from ..bench.runner import BATCH_SIZE, CACHE_BYTES, dataset_ratio, format_results, host_budget, run_scenario
    from ..bench.serve import Served

    for sc in chosen:  # written before the server starts serving them
        ensure(root, sc.volume)
    for latency in args.latency_ms or (0.0,):  # one served run per latency (--latency-ms 20,100)
        with Served(root, args.store, latency) as server:
            remote = Remote(args.store, server.url, Path(root), latency)
            print(f"stoker bench --store {args.store}: {os.cpu_count()} cores, {platform.python_version()}; batch "
                  f"{args.batch_size or f'{BATCH_SIZE} unless a scenario says'}; f32 out; data in {root}, served at "
                  f"{server.url} (a process of its own) with {latency:g} ms added to every request; requests and "
                  "bytes per timed batch as the server counted them", flush=True)
            for sc in chosen:
                batch_size = args.batch_size or sc.batch_size
                budget = host_budget(sc, batch_size, args.host_buffer_bytes)
                n_batches = args.batches or sc.timed_batches
                results, step = run_scenario(sc, root, n_batches, batch_size, budget, args.slow_batches, peers,
                                             rounds=rounds, threads=threads, step_ms=args.step_ms, remote=remote,
                                             counters=lambda: server.counters(cpu=True), epochs=args.epochs or 0,
                                             cache_bytes=args.cache_bytes or CACHE_BYTES,
                                             cache_staleness_s=args.cache_staleness_s)
                ratio = dataset_ratio(root, sc)
                print(format_results(sc, results, n_batches, batch_size, step, ratio), flush=True)
                _print_thread_cpu(args, results)
                records.append(report.scenario_record(sc, results, n_batches, batch_size,
                                                      step.seconds if step else None, ratio))
                records[-1]["latency_ms"] = latency
                _keep(args, records, "cpu", f"stoker bench --store {args.store} --latency-ms "
                                            f"{','.join(f'{t:g}' for t in args.latency_ms or (0.0,))} on "
                                            f"{os.cpu_count()} cores")
    return 0


def _print_thread_cpu(args: argparse.Namespace, results: list) -> None:
    """With --thread-cpu: each stoker peer's CPU per batch by thread (:mod:`stoker.bench.threadcpu`)."""
    if args.thread_cpu:
        from ..bench.threadcpu import thread_cpu_table

        print("\n".join(thread_cpu_table(results)), flush=True)


def _keep(args: argparse.Namespace, records: list[dict], device: str, title: str) -> None:
    """Write --json and --plot as of the scenarios done so far (a long run interrupted keeps what it measured)."""
    if args.json is None and args.plot is None:
        return
    from ..bench import report

    doc = report.document(records, suite=args.suite, device=device, title=title)
    if args.json is not None:
        report.write(args.json, doc)
    if args.plot is not None:
        from .plots import plot_bench

        plot_bench(doc, args.plot)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark stoker against tensorstore and zarr-python")
    p.add_argument("suite", nargs="?", choices=("crops", "records"), default="crops",
                   help="crops: the crop pipeline (default); records: the record Loader")
    p.add_argument("--scenarios", type=_positive_ints, help="comma-separated scenario numbers, run in that order (default: all); 11 and 12 are samples of named "
                        "fields (segmentation with a mask, forecasting from xarray), on the CPU")
    p.add_argument("--peers", type=_peers, help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--batches", type=_positive_int, default=None,
                   help="timed batches per fast peer (default: per scenario, about a second of stoker)")
    p.add_argument("--slow-batches", type=_positive_int, default=SLOW_BATCHES,
                   help=f"timed batches for the zarr peers (default {SLOW_BATCHES})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: stoker on the GPU vs stoker on the CPU vs tensorstore + pin_memory().to(cuda), "
                        "bf16 out")
    p.add_argument("--decode-on", choices=("cpu", "gpu", "hybrid"), default="cpu",
                   help="with --device cuda: decode chunks on the CPU (default), on the GPU with nvCOMP "
                        "(pip install 'stoker[gpu]'), or hybrid: the GPU decode's peers plus both at once "
                        "(decode_on='hybrid'); the report gives the bytes over PCIe per batch, per engine")
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help="interleaved rounds of every peer; each one's median round is shown "
                        "(default 3; 1 with --tiny)")
    p.add_argument("--threads", type=_positive_ints, help="comma-separated compute thread counts: a stoker peer "
                                                          "for each, beside the default one (a thread sweep)")
    p.add_argument("--thread-cpu", action="store_true",
                   help="also print each stoker peer's CPU per batch by thread: coordinator, finisher, consumer, "
                        "Python pools, the compiled engine's threads, the rest; and the serial part (the Python "
                        "threads, which share the GIL) with the samples/s it allows (CPU pipeline)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="samples per batch in every scenario (default: per scenario, 8 unless it says)")
    p.add_argument("--step-ms", type=_step_ms, default=None,
                   help="busy consumer: after each batch, every peer's consumer runs this many milliseconds of "
                        "pure Python holding the GIL, as a training step does; 'auto': as long as "
                        "tensorstore's median batch time in the scenario, measured first")
    # Config's floor for host_buffer_bytes, from its table (config.least_value), checked before the bench prints
    # or writes
    p.add_argument("--host-buffer-bytes", type=byte_size_at_least(least_value("host_buffer_bytes")), default=None,
                   metavar="SIZE",
                   help="stoker's budget, e.g. 512M (K, M, G, T: powers of 1024; default: per scenario, batch "
                        "slots + 256 MiB)")
    p.add_argument("--data", type=lambda s: __import__("pathlib").Path(s), help="dataset directory")
    p.add_argument("--store", choices=("http", "s3"), default=None,
                   help="read every peer's arrays through a loopback server of the data directory: plain HTTP, "
                        "or an S3 bucket (stoker by URI, tensorstore with its http/s3 kvstore, zarr-python "
                        "through obstore); also reports requests and bytes per batch")
    p.add_argument("--latency-ms", type=_latency_ms, default=None,
                   help="with --store: milliseconds the server waits before answering each request (default 0); "
                        "a comma-separated list runs the suite once per latency (e.g. 20,100)")
    p.add_argument("--epochs", type=_positive_int, default=None,
                   help="with --store: also stoker through a local disk cache, one peer per epoch (stoker e1 "
                        "from an empty cache, e2... a new pipeline each over the same crops), with the bytes "
                        "served from disk per batch and the hit rate, and the cache folder's peak size against "
                        "--cache-bytes; with 2 or more, also the second epoch of the pipeline that read the first "
                        "(stoker e2 (same pipeline)) against the same from local files")
    p.add_argument("--cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="with --epochs: the disk cache's bound (cache_bytes), e.g. 64M (K, M, G, T: powers of "
                        "1024); default 1T, more than any scenario reads, so an epoch fits; smaller puts the "
                        "cache under eviction pressure")
    p.add_argument("--cache-staleness-s", type=_seconds, default=None, metavar="S",
                   help="with --epochs: the disk cache's staleness bound (cache_staleness_s) for every stoker "
                        "epoch, default the library's 60 s; shorter than an epoch, the same pipeline's second "
                        "epoch revalidates its objects again (in the background) and shows what that costs")
    p.add_argument("--tiny", action="store_true", help="small datasets: a smoke run in seconds")
    p.add_argument("--mesh", action="store_true",
                   help="with records: crash-simulation meshes ((T, N, 3) trajectories, edge lists) batched by "
                        "Concat along named dims vs a DataLoader (2 workers) with zarr-python and a hand collate; "
                        "then knn_graph's brute force and k-d tree on 10^4-10^6 points")
    p.add_argument("--json", type=Path, metavar="FILE", default=None,
                   help="also write the numbers as JSON: every peer's samples/s per round, stoker's stages")
    p.add_argument("--plot", type=Path, metavar="FILE.png", default=None,
                   help="also draw samples/s per peer and scenario (range over rounds) and stoker's stage "
                        "breakdown (needs matplotlib: pip install 'stoker[plot]')")
    p.set_defaults(run=run)

    h2d = sub.add_parser("bench-h2d", help="host-to-device bandwidth: pageable vs pinned, and pin_object batches")
    h2d.add_argument("--data", type=lambda s: __import__("pathlib").Path(s), help="dataset directory (scenario 1)")
    h2d.set_defaults(run=run_h2d)


_positive_int = at_least_one("a whole number")


def _positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers of at least 1."""
    values = tuple(_positive_int(t.strip()) for t in text.split(","))
    if not values:
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers of at least 1, got {text!r}")
    return values


def _peers(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(","))
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(map(repr, unknown))}; the peers are "
                                          f"{','.join(PEERS)}")
    return names


def _latency_ms(text: str) -> tuple[float, ...]:
    """``--latency-ms``: milliseconds, 0 or more (finite), or a comma-separated list of them (a run each)."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"takes milliseconds (a number, 0 or more, or a comma-separated "
                                             f"list of them), got {text!r}")
        values.append(value)
    return tuple(values)


def _positive(text: str, takes: str) -> float:
    """``text`` as a number above 0 and finite, else an argparse error saying what the option ``takes``."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes {takes}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """``--cache-staleness-s``: seconds, more than 0 and finite."""
    return _positive(text, "seconds (a number above 0)")


def _step_ms(text: str) -> float | str:
    """``--step-ms``: milliseconds (more than 0, finite) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    return _positive(text, "milliseconds (a number above 0) or 'auto'")


def run_h2d(args: argparse.Namespace) -> int:
    from ..bench.device import cuda_or_exit, pipeline_pinned_bytes, run_h2d as measure
    from ..bench.runner import LOOKAHEAD, host_budget, scenarios

    _check_data_dir(args)
    cuda_or_exit()
    print(measure(), flush=True)
    sc = scenarios()[0]
    budget = host_budget(sc, 8, None)
    pinned = pipeline_pinned_bytes(sc, args.data or cache_dir() / "bench", 8, budget)
    print(f"pinned RAM held by a CUDA pipeline on scenario 1 (batch 8, lookahead {LOOKAHEAD}, bf16 out): "
          f"{pinned / 2**20:.0f} MiB of host_buffer_bytes {budget / 2**20:.0f} MiB", flush=True)
    return 0
