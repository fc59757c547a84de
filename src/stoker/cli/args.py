"""Argument types shared by the CLI's commands: a bad value is argparse's one-line usage error."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Callable

#: The suffixes :func:`byte_size` takes: powers of 1024.
SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


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


def byte_size(text: str) -> int:
    """An argparse ``type`` taking a size in bytes of at least 1: a whole number, optionally followed by K, M,
    G or T (powers of 1024; ``KiB``... read the same; ``MB`` is refused: 10**6 or 2**20 would be a guess).

    >>> byte_size("64M")
    67108864
    """
    found = re.fullmatch(r"(\d+)(?:([KMGT])(?:iB)?)?", text.strip(), re.IGNORECASE)
    value = int(found[1]) * SIZE_SUFFIXES[(found[2] or "").upper()] if found else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a size in bytes of at least 1: a whole number, optionally followed "
                                         f"by K, M, G or T (powers of 1024), e.g. 64M; got {text!r}")
    return value


def size_text(n: int) -> str:
    """``n`` bytes as :func:`byte_size` reads it, with the largest suffix that divides it exactly.

    >>> size_text(1 << 20), size_text(3072), size_text(1000)
    ('1M', '3K', '1000')
    """
    for suffix in ("T", "G", "M", "K"):
        if n and n % SIZE_SUFFIXES[suffix] == 0:
            return f"{n // SIZE_SUFFIXES[suffix]}{suffix}"
    return str(n)


def byte_size_at_least(least: int, named: str | None = None) -> Callable[[str], int]:
    """An argparse ``type`` as :func:`byte_size`, taking ``least`` bytes or more (``named``: how the error
    writes it, by default :func:`size_text`, e.g. ``"1M"``): a flag that becomes a :class:`~stoker.Config` knob
    with a floor says so at parse time, naming the flag, not the knob the command line does not have.

    >>> byte_size_at_least(1 << 20)("2M")
    2097152
    """
    named = size_text(least) if named is None else named

    def parse(text: str) -> int:
        value = byte_size(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"takes a size in bytes of at least {named} ({least:,} bytes), e.g. "
                                             f"64M; got {text!r}")
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
    obstore takes them from the environment (strings), stoker's settings (``timeout_s``...) and the disk
    cache's bounds (``cache_bytes``, ``cache_staleness_s``) as numbers.

    >>> storage_options([("region", "eu-west-1"), ("retries", "2")])
    {'region': 'eu-west-1', 'retries': 2}
    """
    from ..errors import InvalidArgument
    from ..storage.locate import CACHE_KEYS, SETTING_KEYS

    if not pairs:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidArgument(f"--storage-option {key}= is given twice; give each key once", knob="storage_options")
        if key in SETTING_KEYS or (key in CACHE_KEYS and key != "cache_dir"):  # the disk cache's bounds too
            seconds = key.endswith("_s")
            try:
                value = float(value) if seconds else int(value)
            except ValueError:
                raise InvalidArgument(f"--storage-option {key}= takes {'a number' if seconds else 'a whole number'}",
                                      knob="storage_options") from None
        out[key] = value
    return out


def unwritable(path: str | os.PathLike) -> str | None:
    """Why no file can be written at ``path`` (an output flag's value), checked before the work that would
    fill it; None where it can, as far as can be told without writing (missing folders are made then)."""
    path = Path(path)
    if path.is_dir():
        return "it is a folder; give a file path"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the folders the write makes
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    if not os.access(parent, os.W_OK):
        return f"the folder {parent} is not writable"
    return None
