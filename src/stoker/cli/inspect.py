"""``stoker inspect URI``: what an array is made of."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import numpy as np

from ..zarr.amplification import estimate
from ..reader.array import open_array
from ..reader.coords import attributes, coding, coordinates, dimension_names
from ..reader.ome import is_label_level, level_scale
from ..errors import InvalidArgument, NotFound, StokerError
from ..storage import ByteRange
from ..zarr.codecs.blosc import HEADER_SIZE, blosc_header
from .args import at_least_one, storage_option, storage_options


def _stored_size_and_header(arr, index: tuple[int, ...], header: bool) -> tuple[int | None, bytes]:
    """``(stored bytes, first 16 bytes if header else b"")`` of read chunk ``index`` without reading the
    chunk: the file's size, or the inner chunk's length from its shard's index; ``(None, b"")`` when not
    stored. A chunk larger than its codecs can write is a DecodeError, as a read of it would be."""
    loc = arr.locate(index)
    if loc.path is None:
        return None, b""
    key = arr.key_of(loc.path)  # sizes and headers by key through the array's store (a missing key: not stored)
    if loc.offset is not None:
        size, start = loc.length, loc.offset
    else:
        try:
            size, start = arr.kv.size(key), 0
        except NotFound:
            return None, b""
        arr.metadata.codec.check_stored_size(size, loc.key)  # as a read would (locate checks inner chunks)
    n = min(HEADER_SIZE, size) if header else 0
    head = arr.kv.get_ranges([ByteRange(key, start, n)])[0] if n else b""
    return size, bytes(head)


def _blocksize_and_ratio(arr, samples: int = 32) -> tuple[int | None, float | None]:
    """The blosc block size from one chunk's header, and the compression ratio of up to ``samples`` distinct
    chunks (from their stored sizes: no chunk is read beyond one blosc header)."""
    meta = arr.metadata
    blocksize = None
    sizes = []
    rng = np.random.default_rng(0)
    grid = meta.grid
    seen: set[tuple[int, ...]] = set()
    for _ in range(samples * 4):
        index = tuple(int(rng.integers(0, g)) for g in grid)
        if index in seen:  # each chunk once: a remote store's request each, and one vote in the ratio
            continue
        seen.add(index)
        size, head = _stored_size_and_header(arr, index, blocksize is None and meta.codec.partial)
        if size is None:
            continue
        sizes.append(size)
        if len(head) == HEADER_SIZE:
            blocksize = blosc_header(head)[1]
        if len(sizes) >= samples:
            break
    ratio = meta.codec.nbytes * len(sizes) / sum(sizes) if sizes and sum(sizes) else None
    return blocksize, ratio


def facts(uri: str, sample_shape: tuple[int, ...] | None = None,
          options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``stoker inspect`` reports, as plain values (``--json`` prints this): the array's layout and,
    given a crop shape, the expected amplification of random crops and advice on chunking. ``options``:
    the storage options of a remote ``uri`` (never reported)."""
    try:
        arr = open_array(uri, options)
    except InvalidArgument as exc:
        members = _group_arrays(uri) if getattr(exc, "node_type", None) == "group" else []
        if not members:
            raise
        shown = ", ".join(os.path.join(os.fspath(uri), m) for m in members[:_LISTED])
        more = f" and {len(members) - _LISTED} more" if len(members) > _LISTED else ""
        raise InvalidArgument(f"{exc}: {shown}{more}", uri=uri) from None
    meta = arr.metadata
    codec = meta.codec
    out: dict[str, Any] = {
        "uri": arr.uri, "zarr_format": arr.zarr_format, "shape": list(arr.shape), "dtype": str(arr.dtype),
        "stored_dtype": codec.stored_dtype.str, "chunks": list(arr.chunks), "chunk_bytes": codec.nbytes,
        "shards": list(arr.shards) if arr.shards else None, "order": _order(arr),
        "codecs": (["transpose"] if arr.zarr_format == 3 and codec.order is not None else []) + list(codec.names),
        "fill_value": _plain(arr.fill_value),
    }
    out.update(_named(arr, options))
    out["ome_level"] = _ome_level(uri, options)
    if sample_shape is not None:
        if len(sample_shape) != arr.ndim:
            raise InvalidArgument(f"--sample-shape {sample_shape} has {len(sample_shape)} axes but the array (shape "
                                  f"{arr.shape}) has {arr.ndim}: give one extent per axis")
        if any(c > s for c, s in zip(sample_shape, arr.shape)):
            raise InvalidArgument(f"--sample-shape {sample_shape} does not fit in shape {arr.shape}")
        blocksize, ratio = _blocksize_and_ratio(arr)
        est = estimate(arr.metadata, sample_shape, blocksize=blocksize, compression_ratio=ratio)
        out["crops"] = {
            "sample_shape": list(sample_shape), "chunks_per_crop": est.chunks_per_crop,
            "decode_amplification": est.decode_full, "partial_decode_amplification": est.decode_partial or None,
            "read_amplification": est.read or None, "compression_ratio": ratio, "blosc_blocksize": blocksize,
            "advice": list(est.advice),
        }
    return out


#: Arrays of a group named in the error of ``stoker inspect GROUP``; the rest are counted.
_LISTED = 12


def _group_arrays(uri: str, depth: int = 3) -> list[str]:
    """The arrays under the local Zarr group at ``uri`` (v2 or v3), as paths relative to it, sorted, at most
    ``depth`` levels down (an OME-Zarr image's levels and its labels' levels); [] where ``uri`` is not a
    local group (a remote one is not listed: plain HTTP cannot)."""
    root = os.fspath(uri)
    if "://" in root and not root.startswith("file://"):
        return []
    root = root.removeprefix("file://")

    def kind(folder: str) -> str | None:
        if os.path.isfile(os.path.join(folder, ".zarray")):
            return "array"
        if os.path.isfile(os.path.join(folder, ".zgroup")):
            return "group"
        try:
            with open(os.path.join(folder, "zarr.json"), encoding="utf-8") as f:
                node = json.load(f).get("node_type")
        except (OSError, ValueError, AttributeError):
            return None
        return node if node in ("array", "group") else None

    if not os.path.isdir(root) or kind(root) != "group":
        return []
    found: list[str] = []

    def walk(folder: str, rel: str, left: int) -> None:
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for name in names:
            child, child_rel = os.path.join(folder, name), f"{rel}{name}"
            node = kind(child)
            if node == "array":
                found.append(child_rel)
            elif node == "group" and left > 1:
                walk(child, child_rel + "/", left - 1)

    walk(root, "", depth)
    return found


def _ome_level(uri: str, options: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where the array is a level of an OME-Zarr image other than its reference: its scale per axis (level-0
    voxels per voxel) and what it is over (level 0; a label image's level: its parent image's level 0), or the
    reason the scale cannot be told; None for level 0 and for an array that is no OME-Zarr level."""
    try:
        scale = level_scale(uri, options)
        if scale is None:
            return None
        over = "the parent image's level 0" if is_label_level(uri, options) else "level 0"
    except StokerError as exc:
        return {"scale": None, "over": None, "error": str(exc)}
    except Exception as exc:  # metadata malformed in a way not foreseen: said, never a crash of inspect
        return {"scale": None, "over": None, "error": f"{type(exc).__name__}: {exc} (malformed OME-Zarr metadata?)"}
    return {"scale": list(scale), "over": over, "error": None}


def _order(arr) -> str | list[int]:
    """How a chunk's elements are laid out: ``"C"`` or ``"F"`` (a v2 ``order``; of one dimension, where the
    two lay out alike, ``"C"``), or a v3 ``transpose`` codec's permutation (the codec list names the codec,
    as zarr.json does; one that changes nothing, ``"C"``)."""
    order = arr.metadata.codec.order
    if order is None:
        return "C"
    return "F" if arr.zarr_format == 2 else list(order)


def _named(arr, options: dict[str, Any] | None) -> dict[str, Any]:
    """Dimension names, each named dimension's coordinates (length, first and last label, decoded as
    xarray decodes them) and the CF decoding the pipeline applies (Config.cf), as plain values."""
    names = dimension_names(arr)
    code = coding(arr)
    cf = {"scale_factor": code.scale, "add_offset": code.offset, "missing": [_plain(v) for v in code.fills],
          "missing_chunk": _plain(_missing_chunk(arr, code)),
          "unmatched": _unmatched(arr, code)} if code is not None else _declared_missing(arr)
    if names is None:
        return {"dimensions": None, "coordinates": {}, "cf": cf}
    found = coordinates(arr, options)
    coords = {name: None if c is None or not len(c) else
              {"length": len(c), "first": _label(c[0]), "last": _label(c[-1]), "dtype": str(c.dtype)}
              for name, c in found.items()}
    return {"dimensions": list(names), "coordinates": coords, "cf": cf}


def _declared_missing(arr) -> dict[str, Any] | None:
    """For an array CF decoding leaves as it is (a float array whose ``_FillValue`` is NaN): its declared
    missing values and what a chunk never written reads as, where that is a value and not one of them
    (xarray's v3 float writes: zarr ``fill_value`` 0 beside ``_FillValue`` NaN, so such a chunk reads 0.0)."""
    declared = _declared(arr)
    if not declared:
        return None
    fill = np.asarray(arr.fill_value).reshape(-1)[0] if np.asarray(arr.fill_value).size else None
    if not isinstance(fill, (np.floating, float)) or math.isnan(fill) or any(
            isinstance(d, (int, float)) and not isinstance(d, bool) and float(d) == float(fill) for d in declared):
        return None
    return {"scale_factor": None, "add_offset": None, "missing": [_plain(v) for v in declared],
            "missing_chunk": _plain(float(fill)), "unmatched": []}


def _declared(arr) -> list[Any]:
    """The CF missing values the attributes declare (``_FillValue``, ``missing_value``), as stored; a JSON
    null (``_FillValue: null``, what some writers leave for "none") declares nothing, as CF decoding reads it."""
    attrs = attributes(arr)
    declared = [attrs[k] for k in ("_FillValue", "missing_value") if attrs.get(k) is not None]
    return [v for d in declared for v in (d if isinstance(d, list) else [d]) if v is not None]


def _unmatched(arr, code) -> list[Any]:
    """The declared missing values CF decoding masks none with: those no stored value of the dtype can equal
    (``_FillValue: 300`` of a uint8 array), and NaN (a NaN is NaN already)."""
    masked = {float(v) for v in code.fills}
    out = []
    for v in _declared(arr):
        try:
            number = float(v)
        except (TypeError, ValueError):  # a base64 float: decoded by coding_of, compared there
            continue
        if number not in masked:
            out.append(_plain(v))
    return out


def _missing_chunk(arr, code) -> float | complex:
    """What an element of a chunk never written decodes to: the Zarr ``fill_value``, decoded as any stored
    value is (xarray does the same). A ``fill_value`` other than the CF ``_FillValue`` (xarray's v3 writes
    leave it 0) gives a real-looking number, ``add_offset`` for 0, not NaN."""
    fill = np.asarray([arr.fill_value], dtype=arr.dtype)
    if fill.dtype.kind == "c":  # decoded as complex numbers: through float64, the imaginary part was lost (and warned)
        value = complex(fill[0]) * (1.0 if code.scale is None else code.scale) + (code.offset or 0.0)
        return float("nan") if any(complex(fill[0]) == complex(f) for f in code.fills) else value
    return float(code.decode(fill, np.float64)[0])


def _label(value: Any) -> Any:
    if isinstance(value, np.datetime64):
        return str(np.datetime_as_string(value, unit="auto"))
    return _plain(value) if isinstance(value, (np.generic, int, float)) else str(value)


def _plain(value: Any) -> Any:
    """A fill value as JSON holds it: numbers as numbers, NaN and infinities as strings, bytes as hex."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, complex):
        return [_plain(value.real), _plain(value.imag)]
    if isinstance(value, bytes):
        return value.hex()
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _bytes(n: int) -> str:
    """``n`` bytes in the unit that shows them (an 800-byte chunk is not "0.00 MiB").

    >>> _bytes(800), _bytes(16384), _bytes(3 << 20)
    ('800 bytes', '16.0 KiB', '3.00 MiB')
    """
    if n < 1 << 10:
        return f"{n} bytes"
    return f"{n / 2**10:.1f} KiB" if n < 1 << 20 else f"{n / 2**20:.2f} MiB"


def describe(uri: str, sample_shape: tuple[int, ...] | None = None, options: dict[str, Any] | None = None) -> str:
    f = facts(uri, sample_shape, options)
    arr_shape = tuple(f["shape"])
    lines = [
        f"array        {f['uri']}",
        f"format       zarr v{f['zarr_format']}",
        f"shape        {arr_shape}",
        f"dtype        {f['dtype']} (stored {f['stored_dtype']})",
        f"read chunk   {tuple(f['chunks'])} ({_bytes(f['chunk_bytes'])} decoded)",
        f"shard        {tuple(f['shards'])}" if f["shards"] else "shard        none",
        f"order        {f['order']}" if isinstance(f["order"], str) else f"order        transpose {tuple(f['order'])}",
        f"codecs       {' -> '.join(f['codecs']) or 'none'}",
        f"fill value   {f['fill_value']}",
    ]
    if f["dimensions"] is not None:
        lines.append(f"dimensions   {', '.join(str(d) for d in f['dimensions'])}")
        for name, c in f["coordinates"].items():
            lines.append(f"  {name:<10} " + ("no coordinate array" if c is None else
                                             f"{c['first']} .. {c['last']} ({c['length']} labels, {c['dtype']})"))
    ome = f.get("ome_level")
    if ome is not None:
        lines.append(f"ome level    scale {tuple(ome['scale'])} over {ome['over']}" if ome["error"] is None else
                     f"ome level    scale unknown: {ome['error']}")
    if f["cf"] is not None:
        cf = f["cf"]
        parts = [f"{k}={cf[k]}" for k in ("scale_factor", "add_offset") if cf[k] is not None]
        parts += [f"missing values {cf['missing']} -> NaN"] if cf["missing"] else []
        lines.append(f"cf decoding  {', '.join(parts)} (as xarray; Config(cf=False): stored values)")
        gap = cf["missing_chunk"]
        if not (isinstance(gap, str) and gap == "nan"):  # a missing chunk reads as data, not as missing
            unmatched = cf.get("unmatched") or []
            never = [v for v in unmatched if not math.isnan(float(v))]
            why = f"the fill value is none of the CF missing values {cf['missing']}" if cf["missing"] else \
                (f"the CF missing values {never} are no value a {f['dtype']} array can hold, so none is masked"
                 if never else "the fill value is not the CF missing value NaN") if unmatched else \
                "no CF _FillValue is set"
            lines.append(f"note         a chunk not stored decodes to {gap!r} (fill value {f['fill_value']} decoded), "
                         f"not NaN: {why}; a chunk never written (or left out for holding only the fill value) "
                         "reads as that value, as in xarray")
    crops = f.get("crops")
    if crops is not None:
        partial = crops["partial_decode_amplification"]
        lines += [
            "",
            f"random crops of {tuple(crops['sample_shape'])} (512 seeded crops):",
            f"  chunks per crop            {crops['chunks_per_crop']:.2f}",
            f"  decode amplification       {crops['decode_amplification']:.2f}x decoding whole chunks"
            + (f", {partial:.2f}x with stoker's partial blosc decode" if partial else ""),
            f"  read amplification         {crops['read_amplification']:.2f}x (compression ratio "
            f"{crops['compression_ratio']:.2f})" if crops["read_amplification"] else
            "  read amplification         unknown (no chunk written)",
            "",
            *(f"advice: {a}" for a in crops["advice"]),
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    shape = tuple(args.sample_shape) if args.sample_shape else None
    options = storage_options(args.storage_option)
    if args.json:
        print(json.dumps(facts(args.uri, shape, options), indent=1))
    else:
        print(describe(args.uri, shape, options))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="summarise a Zarr array: shape, chunks, shards, codecs")
    p.add_argument("uri", help="a Zarr array: local path, file://, s3://, gs://, az://, http(s):// URI or a path "
                   "inside a zip archive (credentials from the environment; see docs/remote.md)")
    p.add_argument("--sample-shape", type=_extent, nargs="+", metavar="N",
                   help="crop shape: estimate read and decode amplification and advise on chunking")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--storage-option", type=storage_option, action="append", metavar="KEY=VALUE",
                   help="an option of the remote URI's store, repeated for several (obstore's keys such as "
                   "endpoint, region, skip_signature=true, allow_http=true, access_key_id; stoker's timeout_s, "
                   "retries...); over the environment's; never printed")
    p.set_defaults(run=run)


_extent = at_least_one("crop extents")
