"""Argument types shared by the CLI's commands: a bad value is argparse's one-line usage error."""

from __future__ import annotations

import argparse
from typing import Any, Callable


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


def storage_option(text: str) -> tuple[str, str]:
    """An argparse ``type`` for ``--storage-option KEY=VALUE``: ``(key, value)``. The error never repeats
    the text (it may be a secret given without its key)."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError("takes KEY=VALUE (e.g. region=eu-west-1, skip_signature=true)")
    return key.strip(), value


def storage_options(pairs: list[tuple[str, str]] | None) -> dict[str, Any] | None:
    """The ``storage_options`` of repeated ``--storage-option`` flags (None when none was given): values as
    obstore takes them from the environment (strings), stoker's settings (``timeout_s``...) as numbers.

    >>> storage_options([("region", "eu-west-1"), ("retries", "2")])
    {'region': 'eu-west-1', 'retries': 2}
    """
    from ..errors import InvalidArgument
    from ..storage.locate import SETTING_KEYS

    if not pairs:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidArgument(f"--storage-option {key}= is given twice; give each key once", knob="storage_options")
        if key in SETTING_KEYS:
            try:
                value = float(value) if key.endswith("_s") else int(value)
            except ValueError:
                raise InvalidArgument(f"--storage-option {key}= takes a number", knob="storage_options") from None
        out[key] = value
    return out
