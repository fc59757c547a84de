"""The ``stoker`` command line: ``stoker demo``, ``inspect URI``, ``bench``, ``plot RUN_DIR``, ``doctor``."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import StokerError

#: Exit status of a command that stopped on a StokerError (argparse uses 2 for usage errors too).
EXIT_ERROR = 2
#: Exit status when the reader of stdout went away (``stoker doctor | head -1``): a shell's for SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (and status 2), like every other error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stoker", description="Keeps GPUs fed from Zarr.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import bench, demo, doctor, inspect, plot

    demo.add_parser(sub)
    inspect.add_parser(sub)
    bench.add_parser(sub)
    doctor.add_parser(sub)
    plot.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader of our output left (| head): nothing to say, and no one to say it to
        _drop_stdout()
        return EXIT_BROKEN_PIPE


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit finds no closed pipe to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (a test's capture)
        pass


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside main, not in the interpreter's flush at exit
        return status
    except StokerError as exc:  # a typed error says what to change: its message, not a traceback
        print(f"stoker {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
