"""Typed access to a parsed metadata document: each field checked for its JSON shape.

A metadata document is hostile input. Every value parsing takes from it goes
through one of these checks, so a field of the wrong JSON type is a
:class:`~stoker.errors.MetadataError` naming the array and the field, never a
bare ``TypeError`` or ``AttributeError`` from deeper down::

    config = obj(entry.get("configuration", {}), "codec 'zstd' configuration", uri)
    level = integer(config.get("level", 0), "zstd level", uri)

Messages show values through :func:`show`, which bounds their length and depth:
a hostile document can hold a very long or deeply nested value.
"""

from __future__ import annotations

import reprlib
from typing import Any

from ..errors import MetadataError

_SHOW = reprlib.Repr()
_SHOW.maxlevel = 3
_SHOW.maxstring = 60
_SHOW.maxother = 60
_SHOW.maxlong = 40
_SHOW.maxlist = _SHOW.maxdict = 8


def show(value: Any) -> str:
    """A short repr of a metadata value for messages (long or deep values are elided)."""
    return _SHOW.repr(value)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def wrong(what: str, value: Any, expected: str, uri: str) -> MetadataError:
    """The error for field ``what`` holding ``value`` where ``expected`` was required."""
    return MetadataError(f"{uri}: {what} must be {expected}, got {_kind(value)} ({show(value)})", uri=uri)


def obj(value: Any, what: str, uri: str) -> dict:
    if not isinstance(value, dict):
        raise wrong(what, value, "a JSON object", uri)
    return value


def lst(value: Any, what: str, uri: str) -> list:
    if not isinstance(value, list):
        raise wrong(what, value, "a JSON list", uri)
    return value


def string(value: Any, what: str, uri: str) -> str:
    if not isinstance(value, str):
        raise wrong(what, value, "a string", uri)
    return value


def integer(value: Any, what: str, uri: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (JSON ``true``/``false`` are not integers) within ``[lo, hi]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong(what, value, "an integer", uri)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else \
            f"at least {lo}" if lo is not None else f"at most {hi}"
        raise MetadataError(f"{uri}: {what} must be {bounds}, got {show(value)}", uri=uri)
    return value


def boolean(value: Any, what: str, uri: str) -> bool:
    if not isinstance(value, bool):
        raise wrong(what, value, "true or false", uri)
    return value


def required(doc: dict, key: str, where: str, uri: str) -> Any:
    """``doc[key]``; a MetadataError naming the document when the key is missing."""
    if key not in doc:
        raise MetadataError(f"{uri}: {where} has no {key!r}; the field is required", uri=uri)
    return doc[key]
