"""Argument types shared by the CLI's commands: a bad value is argparse's one-line usage error."""

from __future__ import annotations

import argparse
from typing import Callable


def at_least_one(what: str) -> Callable[[str], int]:
    """An argparse ``type`` taking a whole number >= 1; ``what`` words the error.

    >>> at_least_one("a whole number")("3")
    3
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"takes {what} of at least 1, got {text!r}")
        return value

    return parse
