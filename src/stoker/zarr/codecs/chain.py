"""Decoding one stored chunk: the codec chain of a read chunk, built on numcodecs.

A :class:`ChunkCodec` knows the whole path from stored bytes to a chunk array:
bytes-to-bytes codecs (compressors, checksums) in reverse, then v2 filters, then
the element layout (byte order, C/F order or a v3 ``transpose``). It checks the
decoded size against the chunk geometry so a short or oversized payload is a
:class:`~stoker.errors.DecodeError`, never stale memory left in a buffer, and
bounds every stage before it allocates (:mod:`.bounds`): a small hostile chunk
cannot decode to more than about a chunk's bytes, and a stored chunk larger than
its codecs can produce (:attr:`ChunkCodec.max_stored_nbytes`) is refused unread.

Two entry points::

    arr = codec.decode(encoded, key="c/0/0")   # a chunk-shaped view (maybe strided, maybe byte-swapped)
    codec.decode_into(encoded, out, key=...)    # fills a C-contiguous native-order array

numcodecs' codecs release the GIL while they work, so callers can decode on
several threads at once.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numcodecs
import numpy as np
from numcodecs.abc import Codec

from ...runtime import gil
from ...errors import DecodeError, StokerError
from . import blosc, bounds
from ..grid import c_strides


def inverse_permutation(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def decode_stages(compressors: Sequence[Codec], bound: int,
                  slack: int = bounds.OVERHEAD_SLACK) -> tuple[tuple, int]:
    """The bounded decoders of bytes-to-bytes ``compressors`` (encode order) whose decoded output is at
    most ``bound`` bytes: ``((decode, bound, codec id), ...)`` in decode order, and the most bytes their
    stored form can take (``slack``: see ``bounds.encoded_bound``). Each stage may produce at most what
    the next one (in decode order) can store."""
    stages = []
    for c in compressors:
        stages.append((bounds.decoder(c, bound) or c.decode, bound, c.codec_id))
        bound = bounds.encoded_bound(c, bound, slack)
    return tuple(reversed(stages)), bound


def run_stages(stages: tuple, data: Any) -> Any:
    """Decode ``data`` through :func:`decode_stages`' stages (``bounds.TooLarge`` past a bound)."""
    for decompress, bound, codec_id in stages:
        data = gil.released(decompress, data)
        if memoryview(data).nbytes > bound:  # a codec not bounded in advance: checked after the fact
            raise bounds.TooLarge(codec_id, bound)
    return data


@dataclass(frozen=True)
class ChunkCodec:
    """How the bytes of one read chunk become an array of ``shape`` and ``dtype``.

    ``stored_dtype`` carries the stored byte order. ``order`` is the permutation
    the stored elements are laid out in (``None``: C order of ``shape``; v2 ``F``
    order is the reversed permutation). ``filters`` are v2 filters and
    ``compressors`` the bytes-to-bytes codecs, both in encode order.
    """

    uri: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stored_dtype: np.dtype
    order: tuple[int, ...] | None = None
    filters: tuple[Codec, ...] = ()
    compressors: tuple[Codec, ...] = ()
    plain: bool = field(init=False, repr=False, compare=False)  # decoded bytes are the chunk in C order, native
    _decompress: tuple = field(init=False, repr=False, compare=False)  # (decode, bound, codec id), decode order
    _unfilter: tuple = field(init=False, repr=False, compare=False)  # the filters' stages, likewise
    _output_bound: int = field(init=False, repr=False, compare=False)  # what the compressors may produce
    nbytes: int = field(init=False, repr=False, compare=False)  # decoded size of one chunk in bytes
    # the most bytes these codecs can store for one chunk (generous): a larger chunk file or inner chunk
    # is not a chunk of this array and is refused before it is read
    max_stored_nbytes: int = field(init=False, repr=False, compare=False)
    _element_strides: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plain = (
            not self.filters
            and self.order is None
            and (self.stored_dtype.isnative or self.stored_dtype.itemsize == 1)
        )
        object.__setattr__(self, "plain", plain)
        object.__setattr__(self, "_element_strides", self._strides())
        n = math.prod(self.shape)
        object.__setattr__(self, "nbytes", n * self.dtype.itemsize)
        # What the last compressor (in decode order) may produce: the chunk's bytes exactly, or, with v2
        # filters (which may change the size: AsType, FixedScaleOffset or Delta to another dtype), a bound
        # from the element count. Each earlier stage may produce at most what the next one can store.
        filtered = n * max(16, self.stored_dtype.itemsize) + bounds.OVERHEAD_SLACK
        bound = self.nbytes if not self.filters else filtered
        object.__setattr__(self, "_output_bound", bound)
        stages, stored = decode_stages(self.compressors, bound)
        object.__setattr__(self, "_decompress", stages)
        object.__setattr__(self, "max_stored_nbytes", stored)
        # A filter may be any numcodecs codec, a compressor too: each one's output has the same bound, and a
        # compressor among them decodes through its bounded decoder like the compressors do.
        object.__setattr__(self, "_unfilter", tuple((bounds.decoder(c, filtered) or c.decode, filtered, c.codec_id)
                                                    for c in reversed(self.filters)))

    @property
    def element_strides(self) -> tuple[int, ...]:
        """Per axis of :attr:`shape`, how many elements apart neighbours are in the decoded bytes (C order
        of the stored layout: v2 ``F`` order and v3 ``transpose`` permute the axes), before any filter.
        Computed once (every batch plan asks, per array).

        >>> ChunkCodec("u", (2, 3), dt, dt, order=(1, 0)).element_strides
        (1, 2)
        """
        return self._element_strides

    def _strides(self) -> tuple[int, ...]:
        if self.order is None:
            return c_strides(tuple(self.shape))
        stored = c_strides(tuple(self.shape[o] for o in self.order))
        return tuple(stored[i] for i in inverse_permutation(self.order))

    def stored_bound(self, slack: int) -> int:
        """:attr:`max_stored_nbytes` with ``slack`` in place of the default room per compressor: many small
        chunks stored together (a compressed shard) need their share, not 64 KiB each."""
        return decode_stages(self.compressors, self._output_bound, slack)[1]

    @property
    def partial(self) -> bool:
        """True when a byte range of the chunk can be decoded without the rest (lone blosc, plain layout)."""
        return self.plain and self.lone_blosc and blosc.available()

    @property
    def lone_blosc(self) -> bool:
        """True when the stored chunk is one blosc frame and nothing else (no filters, no checksum)."""
        return not self.filters and len(self.compressors) == 1 and self.compressors[0].codec_id == "blosc"

    @property
    def lone_zstd(self) -> bool:
        """True when the stored chunk is one zstd frame and nothing else (no filters, no checksum)."""
        return not self.filters and len(self.compressors) == 1 and type(self.compressors[0]) is numcodecs.Zstd

    @property
    def names(self) -> tuple[str, ...]:
        """Codec ids in encode order, for summaries and messages."""
        return tuple(c.codec_id for c in (*self.filters, *self.compressors))

    def decode_error(self, key: str, exc: BaseException) -> DecodeError:
        """The typed error for chunk ``key`` whose stored bytes ``exc`` rejected."""
        return DecodeError(
            f"{self.uri}: chunk {key!r} could not be decoded ({type(exc).__name__}: {exc}); "
            "the stored bytes are corrupt or truncated",
            uri=self.uri, key=key,
        )

    def check_stored_size(self, stored: int, key: str) -> None:
        """DecodeError, before reading, when chunk ``key`` is stored in more bytes than these codecs write."""
        if stored > self.max_stored_nbytes:
            raise DecodeError(
                f"{self.uri}: chunk {key!r} is stored in {stored} bytes, more than the {self.max_stored_nbytes} "
                f"that codecs {' -> '.join(self.names) or 'none'} can write for a chunk of shape {self.shape} of "
                f"{self.dtype}; the file is corrupt or not a chunk of this array (it was not read)",
                uri=self.uri, key=key, stored=stored, limit=self.max_stored_nbytes,
            )

    def too_large(self, key: str, exc: bounds.TooLarge) -> DecodeError:
        """The typed error for chunk ``key`` whose decode stopped at its bound."""
        if exc.bound == self.nbytes:
            what = f"the {exc.bound} bytes a chunk of shape {self.shape} of {self.dtype} holds"
        else:  # an earlier stage, or the input of v2 filters
            what = f"the {exc.bound} bytes {exc.codec_id} may produce for a chunk of shape {self.shape} of {self.dtype}"
        claimed = f" (its header claims {exc.claimed})" if exc.claimed is not None else ""
        return DecodeError(
            f"{self.uri}: chunk {key!r} decodes to more than {what}{claimed}; decoding stopped there: the "
            "chunk is corrupt, hostile or written with other metadata",
            uri=self.uri, key=key,
        )

    @contextmanager
    def typed_errors(self, key: str) -> Iterator[None]:
        """Decoding chunk ``key``: a StokerError passes as it is, a stage's ``bounds.TooLarge`` becomes
        :meth:`too_large`'s error and any other failure :meth:`decode_error`'s."""
        try:
            yield
        except StokerError:
            raise
        except bounds.TooLarge as exc:
            raise self.too_large(key, exc) from None
        except Exception as exc:
            raise self.decode_error(key, exc) from exc

    def check_size(self, nbytes: int, key: str) -> None:
        """DecodeError unless chunk ``key`` decoded to exactly :attr:`nbytes`."""
        if nbytes != self.nbytes:
            raise DecodeError(
                f"{self.uri}: chunk {key!r} decoded to {nbytes} bytes, expected {self.nbytes} "
                f"for shape {self.shape} of {self.dtype}; the chunk is corrupt or written with other metadata",
                uri=self.uri, key=key,
            )

    def _stored_layout(self, flat: np.ndarray) -> np.ndarray:
        """View decoded bytes as the chunk: element type, then shape and axis order."""
        arr = flat.view(self.stored_dtype)
        if self.order is None:
            return arr.reshape(self.shape)
        stored_shape = tuple(self.shape[o] for o in self.order)
        return arr.reshape(stored_shape).transpose(inverse_permutation(self.order))

    def decode(self, encoded: Any, key: str = "?") -> np.ndarray:
        """Decode into a new chunk-shaped array (maybe strided, maybe in the stored byte order)."""
        with self.typed_errors(key):
            data = run_stages(self._unfilter, run_stages(self._decompress, encoded))
            # compressors return bytes: frombuffer is a view, and cheaper than numcodecs' ensure_ndarray
            flat = (data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)).reshape(-1).view(np.uint8)
        self.check_size(flat.nbytes, key)
        return self._stored_layout(flat)

    def decode_into(self, encoded: Any, out: np.ndarray, key: str = "?") -> None:
        """Decode into ``out`` (C-contiguous, ``shape``, native ``dtype``).

        A lone blosc compressor on a plain layout decompresses straight into
        ``out`` after its header has been checked against the chunk size.
        """
        if out.shape != self.shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"decode_into needs a C-contiguous {self.shape} {self.dtype} array")
        if self.plain and self.lone_blosc:
            with self.typed_errors(key):
                self.check_size(blosc.blosc_frame_nbytes(encoded), key)
                gil.released(self.compressors[0].decode, encoded, out=out)
            return
        out[...] = self.decode(encoded, key)

    def decode_range_into(self, encoded: Any, out: np.ndarray, byte_start: int, byte_stop: int,
                          key: str = "?", read_end: int | None = None) -> int:
        """Decode at least bytes ``[byte_start, byte_stop)`` (C order) of the chunk into ``out``.

        Only the blosc blocks covering the range are decompressed when
        :attr:`partial` holds and that is cheaper than a full decode; otherwise the
        whole chunk is decoded. Bytes of ``out`` outside the range may be left
        stale: read only inside it. Returns the bytes decompressed. ``read_end``:
        ``encoded`` holds only the header, the block table and the needed blocks,
        read up to this offset (see ``blosc.decode_range``).
        """
        if not self.partial:
            self.decode_into(encoded, out, key)
            return self.nbytes
        if out.shape != self.shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"decode_range_into needs a C-contiguous {self.shape} {self.dtype} array")
        try:
            done = blosc.decode_range(encoded, byte_start, byte_stop, out, read_end)
        except blosc.PartialDecodeError as exc:
            raise self.decode_error(key, exc) from None
        if done is None:
            if read_end is not None:  # the read decided on a partial decode, the decode disagrees
                raise self.decode_error(key, ValueError("the blocks read do not decode the range"))
            self.decode_into(encoded, out, key)
            return self.nbytes
        return done


# ---------------------------------------------------------------------------------------------
# Building codecs from metadata
