"""``stoker inspect URI``: what an array is made of."""

from __future__ import annotations

import argparse

from ..array import open_array
from ..errors import StokerError


def describe(uri: str) -> str:
    arr = open_array(uri)
    meta = arr.metadata
    codec = meta.codec
    lines = [
        f"array        {arr.uri}",
        f"format       zarr v{arr.zarr_format}",
        f"shape        {arr.shape}",
        f"dtype        {arr.dtype} (stored {codec.stored_dtype.str})",
        f"read chunk   {arr.chunks} ({codec.nbytes / 2**20:.2f} MiB decoded)",
        f"shard        {arr.shards}" if arr.shards else "shard        none",
        f"codecs       {' -> '.join(codec.names) or 'none'}",
        f"fill value   {arr.fill_value!r}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        print(describe(args.uri))
    except StokerError as exc:
        print(f"stoker inspect: {exc}")
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="summarise a Zarr array: shape, chunks, shards, codecs")
    p.add_argument("uri", help="local path or file:// URI of a Zarr array")
    p.set_defaults(run=run)
