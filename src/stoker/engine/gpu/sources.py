"""How the GPU-decode executor decodes and places the chunks of one array, for one batch dtype.

An array's chunks are decoded on the device when its codec is a lone zstd or blosc (plain: no filters,
native byte order, C order) and the device casts it as the CPU does (:func:`device_casts`); else on the
CPU, by its own codec, and cast there into the batch dtype (:mod:`.fallback`). :class:`Described` keeps each
array's description per batch dtype (the GPU-decode executor's, and the hybrid executor's split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...zarr.grid import c_strides
from ...errors import DtypeMismatch, NotYetSupported
from ..cast import fill_value_as, torch_dtype_of, unfit_range
from ..cpu.cf import rounds_once

ZSTD, BLOSC, CPU = 1, 2, 3  # how a source's chunks are decoded
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: each chunk's decoded bytes start at a multiple of this in the scratch (any dtype's view)
ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def carrier(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of ``dtype``'s width: what elements are moved as."""
    return _CARRIERS[dtype.itemsize]


def device_casts(source: np.dtype, out: torch.dtype) -> bool:
    """True when the device's cast of ``source`` elements into ``out`` gives the CPU path's bits: no cast,
    integer and bool sources of at most 2 bytes into a float (exact in float32, so the one rounding is
    the same; the rule :func:`~.device.staging_dtype` follows), or bool, 8- and 16-bit integers and int32 into a
    wider integer batch (every value fits: nothing to check). Other sources into another dtype are cast on
    the CPU: torch's conversions on the device are not numpy's for every value (NaN payloads and signalling
    NaNs, float64 into float16 through float32), and a narrowing integer cast is checked there, value by value,
    as is uint16 into float16 (from 65520 a uint16 would be inf: :func:`~..cast.unfit_range`)."""
    try:
        if torch_dtype_of(source) == out:
            return True
    except TypeError:
        return False
    if source.kind in "biu" and out in (torch.int32, torch.int64):  # not uint32: torch has few kernels of it
        return source.kind == "b" or (source.itemsize < out.itemsize and (source.kind == "i" or source.itemsize <= 2))
    if source.kind == "u" and out == torch.float16:
        return source.itemsize < 2
    return source.kind in "biu" and source.itemsize <= 2 and out.is_floating_point


@dataclass
class Source:
    """How the chunks of one array are decoded and placed, for one batch dtype."""

    how: int  # ZSTD, BLOSC (on the device) or CPU
    why: str | None  # why its chunks are decoded on the CPU
    element: torch.dtype  # dtype of its decoded chunks in the scratch (the source's, or the batch's when cast on the CPU)
    nbytes: int  # bytes of one decoded chunk in the scratch (aligned)
    stored: int  # the most bytes one stored chunk takes in the staging
    strides: np.ndarray  # C strides of the chunk, in elements (how it lies in the scratch)
    # the fill value in the batch dtype, as the bits of its carrier: a Python int, because index_fill_ given a
    # tensor on the device reads it back with .item(), which waits for everything queued on the stream
    fill: int


def describe(reader, work: torch.dtype, half_next: bool = False) -> Source:
    """How ``reader``'s chunks are decoded into a ``work`` batch (on the host: nothing touches the device);
    ``half_next``: ``work`` is float32 rounded into float16 next (its fill value as
    :func:`~stoker.engine.cast.half_exact` says)."""
    codec = reader.metadata.codec
    if work.itemsize not in _CARRIERS:  # (complex128 'native': its elements are moved as one integer each)
        raise NotYetSupported(
            f"{reader.uri}: its {codec.dtype} elements ({work.itemsize} bytes) are not placed by the GPU decode, "
            "which moves elements of 1, 2, 4 and 8 bytes; use Config(decode_on='cpu') for this array, or store "
            "its real and imaginary parts as separate arrays", uri=reader.uri, knob="decode_on")
    how, why = CPU, None
    if not codec.plain:
        why = "filters, another byte order or axis order"
    elif not (codec.lone_zstd or codec.lone_blosc):
        why = f"codecs {' -> '.join(codec.names) or 'none'} (the device decodes zstd and blosc with lz4 or zstd)"
    elif not device_casts(codec.dtype, work):
        why = (f"its {codec.dtype} is cast to {work} on the CPU, where every value is checked against it"
               if work in (torch.int32, torch.int64, torch.float16) and codec.dtype.kind in "biu" else
               f"its {codec.dtype} is cast to {work} on the CPU (the device's rounding of it may differ)")
    else:
        how = ZSTD if codec.lone_zstd else BLOSC
    element = torch_dtype_of(codec.dtype) if how != CPU else work
    nbytes = math.prod(codec.shape) * element.itemsize
    if unfit_range(reader.metadata.fill_value, work) is not None:  # the device fills missing chunks unchecked
        raise DtypeMismatch(
            f"{reader.uri}: its fill value {reader.metadata.fill_value} does not fit the output {work} (out of an "
            "integer's range, or inf in a float), "
            "and the GPU decode fills missing chunks with it; use a wider dtype "
            f"({'f32' if work.is_floating_point else 'i64'!r} or 'native'), or "
            "Config(decode_on='cpu'), which fails only where a missing chunk is read", uri=reader.uri)
    fill = int(fill_value_as(reader.metadata.fill_value, work, rounds_once(reader, half_next)).view(
        carrier(work)).item())
    return Source(how, why, element, aligned(nbytes), codec.max_stored_nbytes if how != CPU else nbytes,
                  np.array(c_strides(tuple(codec.shape)), np.int64), fill)


class Described:
    """:func:`describe` of each array for each batch dtype, made once and kept while its reader is the same
    object (a reader is known by identity: another one at a collected reader's address is described anew).
    ``on_new(src)`` runs for each description made (the GPU-decode executor sizes nvCOMP's scratch then).
    At most :attr:`LIMIT` are kept: past it they are all dropped and made again as asked.

    >>> described = Described()
    >>> described.get(reader, torch.float32) is described.get(reader, torch.float32)
    True
    """

    LIMIT = 4096

    def __init__(self, on_new: Callable[[Source], None] | None = None) -> None:
        self._held: dict[tuple, tuple[Any, Source]] = {}  # (id(reader), dtype, half_next) -> (reader, its Source)
        self._on_new = on_new

    def get(self, reader, work: torch.dtype, half_next: bool = False) -> Source:
        """How ``reader``'s chunks are decoded into a ``work`` batch (:func:`describe`, once)."""
        key = (id(reader), work, half_next)
        held = self._held.get(key)
        if held is not None and held[0] is reader:
            return held[1]
        src = describe(reader, work, half_next)
        if self._on_new is not None:
            self._on_new(src)
        if len(self._held) > self.LIMIT:
            self._held.clear()
        self._held[key] = (reader, src)
        return src

    def forget(self, readers: list) -> None:
        """Drop the descriptions of ``readers`` (arrays their pipeline forgot): kept, each holds its reader, and
        through it its store (a replaced zip archive's open file)."""
        gone = {id(r) for r in readers}
        for key, held in list(self._held.items()):  # (a copy: another thread may describe meanwhile)
            if id(held[0]) in gone:
                self._held.pop(key, None)
