"""The ``stoker`` command line: ``stoker demo``, ``stoker inspect URI``."""

from __future__ import annotations

import argparse
import sys

from .. import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Keeps GPUs fed from Zarr.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import bench, demo, inspect

    demo.add_parser(sub)
    inspect.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
