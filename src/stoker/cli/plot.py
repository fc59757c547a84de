"""``stoker plot RUN_DIR``: a PNG of a training run's telemetry (or of ``stoker bench --json`` results)."""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from .plots import plot_bench, plot_telemetry

    source = args.source
    if source.suffix == ".json" and not source.is_dir():  # bench results; missing: NotFound naming the file
        out = plot_bench(source, args.output or source.with_suffix(".png"))
    else:
        out = plot_telemetry(source, args.output)
    print(out)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss, samples/s and data wait over steps (PNG; needs matplotlib)",
                       description="Draws the telemetry a Trainer wrote (telemetry.jsonl in its telemetry_dir): "
                                   "loss and eval loss, samples/s and data wait over steps. Given the JSON of "
                                   "stoker bench --json instead, draws the bench results. Needs matplotlib "
                                   "(pip install 'stoker[plot]').")
    p.add_argument("source", type=Path, metavar="RUN_DIR",
                   help="a run folder holding telemetry.jsonl, the file itself, or a bench JSON file")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE.png",
                   help="where to write (default: telemetry.png beside the telemetry; for bench JSON, "
                        "the same name with .png)")
    p.set_defaults(run=run)
