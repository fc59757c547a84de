"""Stored chunks as flat tables of independent compressed streams, for a batched decode.

A blosc1 frame (c-blosc 1.x, what numcodecs' ``Blosc`` writes) is, byte for byte::

    header (16): version (2), versionlz (1), flags, typesize, nbytes, blocksize, cbytes (3 x <i4)
    bstarts (<i4 per block, absent when memcpyed): where each block starts in the frame
    per block: its streams, each a <i4 stored size followed by that many bytes

``flags``: bit 0 byte shuffle, bit 1 memcpyed (the chunk follows the header as is), bit 2 bit
shuffle, bit 3 reserved (c-blosc refuses it), bit 4 dont_split, bits 5-7 the compressor (0 blosclz,
1 lz4 and lz4hc, 2 snappy, 3 zlib, 4 zstd).

The rules are those of c-blosc's decoder (``blosc_d`` and ``blosc_run_decompression_with_context``
in blosc/blosc.c), which is what numcodecs runs:

- blocks are ``blocksize`` bytes; the last is the rest, ``nbytes % blocksize``, when that is not 0;
- a full block holds ``typesize`` streams of ``blocksize / typesize`` bytes when dont_split is clear,
  ``typesize <= 16`` and ``blocksize / typesize >= 128``, else one stream; the last, partial block
  always one. (The writer's split mode sets dont_split: by default every compressor but zstd
  splits; the size condition is the decoder's own, kept for frames older than the flag.)
- a stream whose stored size equals its decoded size is stored raw (copied, not decompressed);
- per block, after its streams: byte unshuffle when ``typesize > 1``, else bit unshuffle when the
  block holds at least one item (byte shuffle wins when both flags are set).

:func:`parse_blosc` turns one frame into a :class:`Layout`: one row per stream (where its bytes are,
how many it decodes to, where they go in the chunk, raw or which compressor) and one row per block
that needs an unshuffle. :func:`batch` joins the layouts of many chunks into one, for one batched
device decode. Everything is checked against the frame's length and the chunk's size first: an
inconsistent frame is a :class:`FrameError` (a ``ValueError``), never an offset outside the frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..zarr.blosc_partial import HEADER_SIZE

_HEADER = struct.Struct("<BBBBiii")  # signed, as c-blosc reads them: a negative size is an error
VERSION_FORMAT = 2  # the only frame format c-blosc 1.x decodes
MAX_SPLITS = 16
MIN_BUFFERSIZE = 128
MAX_BLOCKSIZE = (2**31 - 1 - 255 * 4) // 3  # BLOSC_MAX_BLOCKSIZE
DOSHUFFLE, MEMCPYED, DOBITSHUFFLE, RESERVED, DONT_SPLIT = 0x1, 0x2, 0x4, 0x8, 0x10

#: compressors of streams (the ``codec`` column)
UNSUPPORTED, LZ4, ZSTD = 0, 1, 2
CODEC_NAMES = {UNSUPPORTED: "unsupported", LZ4: "lz4", ZSTD: "zstd"}
_FORMATS = {0: ("blosclz", UNSUPPORTED), 1: ("lz4", LZ4), 2: ("snappy", UNSUPPORTED), 3: ("zlib", UNSUPPORTED),
            4: ("zstd", ZSTD)}

#: unshuffles of blocks (the ``block_shuffle`` column)
BYTESHUFFLE, BITSHUFFLE = 1, 2

_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # skippable frames: 0x184D2A50 to 0x184D2A5F


class FrameError(ValueError):
    """A stored chunk that is not a well-formed frame (the caller reports it as a DecodeError with the chunk key)."""


class UnsupportedFrame(Exception):
    """A well-formed chunk with streams the device cannot decompress (blosclz, zlib...): decode it on the CPU."""


_I64 = np.int64


@dataclass(frozen=True)
class Layout:
    """Independent streams of one chunk or a batch of chunks, as parallel arrays.

    Per stream (``len(layout)`` rows): ``src`` (offset of its stored bytes in the input), ``csize``
    (stored bytes), ``dst`` (offset of its decoded bytes in the output, before unshuffle), ``dsize``
    (decoded bytes), ``raw`` (copied as is), ``codec`` (:data:`LZ4`, :data:`ZSTD` or
    :data:`UNSUPPORTED`, the frame's compressor also for raw streams), ``chunk`` (index of its chunk).
    Per block to unshuffle: ``block_dst``, ``block_size``, ``block_typesize``, ``block_shuffle``.
    Per chunk: ``chunk_in`` / ``chunk_in_nbytes`` (where its stored bytes sit in the input) and
    ``chunk_out`` / ``chunk_out_nbytes`` (where its decoded bytes go). ``in_nbytes`` and
    ``out_nbytes`` are the sizes of the input and output buffers the offsets index.
    """

    src: np.ndarray
    csize: np.ndarray
    dst: np.ndarray
    dsize: np.ndarray
    raw: np.ndarray
    codec: np.ndarray
    chunk: np.ndarray
    block_dst: np.ndarray
    block_size: np.ndarray
    block_typesize: np.ndarray
    block_shuffle: np.ndarray
    chunk_in: np.ndarray
    chunk_in_nbytes: np.ndarray
    chunk_out: np.ndarray
    chunk_out_nbytes: np.ndarray
    in_nbytes: int
    out_nbytes: int

    def __len__(self) -> int:
        return len(self.src)

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_in)

    def unsupported_chunks(self) -> np.ndarray:
        """Indices of the chunks with a stream to decompress that is neither lz4 nor zstd."""
        return np.unique(self.chunk[~self.raw & (self.codec == UNSUPPORTED)])

    @property
    def supported(self) -> bool:
        """True when every stream is raw, lz4 or zstd."""
        return not np.any(~self.raw & (self.codec == UNSUPPORTED))


def _chunk_layout(in_nbytes: int, out_nbytes: int, streams: Sequence[np.ndarray],
                  blocks: Sequence[np.ndarray]) -> Layout:
    src, csize, dst, dsize, raw, codec = streams
    return Layout(src.astype(_I64), csize.astype(_I64), dst.astype(_I64), dsize.astype(_I64), raw.astype(bool),
                  codec.astype(np.int8), np.zeros(len(src), _I64),
                  *(b.astype(_I64) for b in blocks[:3]), blocks[3].astype(np.int8),
                  np.zeros(1, _I64), np.array([in_nbytes], _I64), np.zeros(1, _I64), np.array([out_nbytes], _I64),
                  int(in_nbytes), int(out_nbytes))


_NO_STREAMS = tuple(np.zeros(0, _I64) for _ in range(6))
_NO_BLOCKS = tuple(np.zeros(0, _I64) for _ in range(4))


def _as_bytes(frame: Any) -> np.ndarray:
    return np.frombuffer(memoryview(frame).cast("B"), dtype=np.uint8)


def _u32(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Little-endian 32-bit values at byte offsets ``pos`` (checked to be in range by the caller)."""
    b = buf[pos[:, None] + np.arange(4)].astype(_I64)
    return b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24


def _first(bad: np.ndarray, first_block: int) -> int:
    return first_block + int(np.flatnonzero(bad)[0])


def _walk(buf: np.ndarray, starts: np.ndarray, first_block: int, nsplits: int, neblock: int) -> tuple[np.ndarray, ...]:
    """``(src, csize)`` of the ``nsplits`` streams of each block starting at ``starts``, shape (blocks, nsplits).

    A block's streams follow one another, so the walk is sequential within a block and vectorised
    over blocks (``nsplits <= 16`` steps).
    """
    size = len(buf)
    src = np.empty((len(starts), nsplits), _I64)
    csize = np.empty((len(starts), nsplits), _I64)
    pos = starts
    for j in range(nsplits):
        bad = pos > size - 4
        if bad.any():
            raise FrameError(f"blosc block {_first(bad, first_block)}: stream {j}'s size field lies past the "
                             f"end of the {size}-byte frame")
        cs = _u32(buf, pos)
        bad = (cs < 1) | (cs > neblock)
        if bad.any():
            raise FrameError(f"blosc block {_first(bad, first_block)}: stream {j} claims "
                             f"{int(cs[bad][0])} stored bytes for {neblock} decoded (1..{neblock} allowed)")
        pos = pos + 4
        bad = pos + cs > size
        if bad.any():
            raise FrameError(f"blosc block {_first(bad, first_block)}: stream {j} runs past the end of the "
                             f"{size}-byte frame")
        src[:, j], csize[:, j] = pos, cs
        pos = pos + cs
    return src, csize


def _block_shuffle(flags: int, typesize: int, bsize: int) -> int:
    """The unshuffle c-blosc applies to a block of ``bsize`` bytes, 0 where it changes nothing."""
    items = bsize // typesize
    if flags & DOSHUFFLE and typesize > 1:
        return BYTESHUFFLE if items else 0  # fewer bytes than an item: copied as they are
    if flags & DOBITSHUFFLE and items and items % 8 == 0:
        return BITSHUFFLE  # c-blosc copies a block whose item count is not a multiple of 8 whole
    return 0


def parse_blosc(frame: Any, nbytes: int) -> Layout:
    """The streams of one blosc1 frame that decodes to a chunk of ``nbytes`` bytes.

    ``frame`` is the stored chunk (any contiguous buffer, exactly the frame). Raises
    :class:`FrameError` for anything c-blosc would refuse, and for frames c-blosc's writer never
    produces and its reader would decode into undefined bytes (a split block whose size is not a
    whole number of items), streams claiming more stored than decoded bytes, or empty streams.
    """
    buf = _as_bytes(frame)
    size = len(buf)
    if size < HEADER_SIZE:
        raise FrameError(f"blosc frame of {size} bytes is shorter than its {HEADER_SIZE}-byte header")
    version, versionlz, flags, typesize, n, blocksize, cbytes = _HEADER.unpack_from(buf)
    if version != VERSION_FORMAT:
        raise FrameError(f"blosc frame format {version}: c-blosc 1.x reads format {VERSION_FORMAT} only")
    if flags & RESERVED:
        raise FrameError(f"blosc frame sets the reserved flag 0x08 (flags {flags:#04x})")
    if cbytes != size:
        raise FrameError(f"blosc frame claims {cbytes} bytes but {size} are stored")
    if n != nbytes:
        raise FrameError(f"blosc frame holds {n} bytes, the chunk has {nbytes}")
    if n == 0:
        return _chunk_layout(size, 0, _NO_STREAMS, _NO_BLOCKS)
    if typesize == 0:
        raise FrameError("blosc frame has typesize 0")
    if not 0 < blocksize <= min(n, MAX_BLOCKSIZE):
        raise FrameError(f"blosc block size {blocksize} is outside 1..{min(n, MAX_BLOCKSIZE)}")
    name, codec = _FORMATS.get(flags >> 5, (None, UNSUPPORTED))
    if flags & MEMCPYED:  # the chunk as is after the header; c-blosc ignores the compressor fields
        if cbytes != n + HEADER_SIZE:
            raise FrameError(f"memcpyed blosc frame of {cbytes} bytes should be {n + HEADER_SIZE}")
        one = np.ones(1, _I64)
        return _chunk_layout(size, n, (one * HEADER_SIZE, one * n, one * 0, one * n, one, one * codec), _NO_BLOCKS)
    if name is None:
        raise FrameError(f"blosc frame names compressor format {flags >> 5}, unknown to c-blosc 1.x")
    if versionlz != 1:
        raise FrameError(f"blosc frame's {name} format version is {versionlz}; c-blosc knows version 1")
    nfull, leftover = divmod(n, blocksize)
    nblocks = nfull + (leftover > 0)
    table_end = HEADER_SIZE + 4 * nblocks
    if table_end > size:
        raise FrameError(f"blosc block table ({nblocks} blocks) runs past the end of the {size}-byte frame")
    bstarts = np.frombuffer(buf, "<i4", nblocks, HEADER_SIZE).astype(_I64)
    bad = (bstarts < table_end) | (bstarts > size - 4)
    if bad.any():
        raise FrameError(f"blosc block {_first(bad, 0)} starts at {int(bstarts[bad][0])}, outside "
                         f"{table_end}..{size - 4} of the frame")
    split = not flags & DONT_SPLIT and typesize <= MAX_SPLITS and blocksize // typesize >= MIN_BUFFERSIZE
    parts = []  # (src, csize, dst, dsize) of the full blocks, then of the partial last one
    if nfull:
        nsplits = typesize if split else 1
        if blocksize % nsplits:
            raise FrameError(f"blosc blocks of {blocksize} bytes are split into {nsplits} streams but are not a "
                             f"whole number of {typesize}-byte items")
        neblock = blocksize // nsplits
        src, csize = _walk(buf, bstarts[:nfull], 0, nsplits, neblock)
        dst = np.arange(nfull, dtype=_I64)[:, None] * blocksize + np.arange(nsplits, dtype=_I64) * neblock
        parts.append((src.ravel(), csize.ravel(), dst.ravel(), np.full(src.size, neblock, _I64)))
    if leftover:
        src, csize = _walk(buf, bstarts[nfull:], nfull, 1, leftover)
        parts.append((src.ravel(), csize.ravel(), np.array([nfull * blocksize], _I64), np.array([leftover], _I64)))
    src, csize, dst, dsize = (np.concatenate(c) for c in zip(*parts))
    streams = (src, csize, dst, dsize, csize == dsize, np.full(len(src), codec, np.int8))
    blocks = _blocks(flags, typesize, blocksize, nfull, leftover)
    return _chunk_layout(size, n, streams, blocks)


def _blocks(flags: int, typesize: int, blocksize: int, nfull: int, leftover: int) -> tuple[np.ndarray, ...]:
    """``(dst, size, typesize, shuffle)`` of the blocks that need an unshuffle."""
    rows = []
    full = _block_shuffle(flags, typesize, blocksize)
    if full and nfull:
        rows.append((np.arange(nfull, dtype=_I64) * blocksize, np.full(nfull, blocksize, _I64), full))
    last = _block_shuffle(flags, typesize, leftover) if leftover else 0
    if last:
        rows.append((np.array([nfull * blocksize], _I64), np.array([leftover], _I64), last))
    if not rows:
        return _NO_BLOCKS
    dst = np.concatenate([r[0] for r in rows])
    size = np.concatenate([r[1] for r in rows])
    shuffle = np.concatenate([np.full(len(r[0]), r[2], _I64) for r in rows])
    return dst, size, np.full(len(dst), typesize, _I64), shuffle


def parse_zstd(frame: Any, nbytes: int) -> Layout:
    """A plain zstd chunk (numcodecs' ``Zstd``): one stream, the whole file, decoding to ``nbytes`` bytes.

    Only the magic number is checked here; the decoder checks that the output is exactly ``nbytes``.
    """
    buf = _as_bytes(frame)
    size = len(buf)
    if nbytes == 0:
        return _chunk_layout(size, 0, _NO_STREAMS, _NO_BLOCKS)
    if size < 4:
        raise FrameError(f"zstd frame of {size} bytes is shorter than its magic number")
    magic = int(_u32(buf, np.zeros(1, _I64))[0])
    if magic != _ZSTD_MAGIC and magic & ~0xF != _ZSTD_SKIPPABLE:
        raise FrameError(f"not a zstd frame (magic number {magic:#010x})")
    one = np.ones(1, _I64)
    return _chunk_layout(size, nbytes, (one * 0, one * size, one * 0, one * nbytes, one * 0, one * ZSTD), _NO_BLOCKS)


def batch(layouts: Sequence[Layout], in_bases: Sequence[int] | None = None,
          out_bases: Sequence[int] | None = None) -> Layout:
    """One layout for the chunks of ``layouts``, their inputs at ``in_bases`` and outputs at ``out_bases``.

    The bases default to the layouts end to end (each input and output right after the previous
    one). Outputs must not overlap: the unshuffle writes blocks back in place.
    """
    k = len(layouts)
    in_sizes = np.array([l.in_nbytes for l in layouts], _I64)
    out_sizes = np.array([l.out_nbytes for l in layouts], _I64)
    ins = _bases(in_bases, in_sizes, k, "in_bases")
    outs = _bases(out_bases, out_sizes, k, "out_bases")
    order = np.argsort(outs, kind="stable")
    ends = outs[order] + out_sizes[order]
    if k > 1 and np.any(ends[:-1] > outs[order][1:]):
        raise ValueError("batch: the chunks' outputs overlap (out_bases too close together)")
    n_streams = np.array([len(l) for l in layouts], _I64)
    n_blocks = np.array([len(l.block_dst) for l in layouts], _I64)
    n_chunks = np.array([l.n_chunks for l in layouts], _I64)
    chunk_base = np.cumsum(n_chunks) - n_chunks

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(l, name) for l in layouts]) if k else np.zeros(0, _I64)

    def shift(name: str, base: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return cat(name) + np.repeat(base, counts)

    return Layout(
        shift("src", ins, n_streams), cat("csize"), shift("dst", outs, n_streams), cat("dsize"),
        cat("raw").astype(bool), cat("codec").astype(np.int8), shift("chunk", chunk_base, n_streams),
        shift("block_dst", outs, n_blocks), cat("block_size"), cat("block_typesize"),
        cat("block_shuffle").astype(np.int8),
        shift("chunk_in", ins, n_chunks), cat("chunk_in_nbytes"), shift("chunk_out", outs, n_chunks),
        cat("chunk_out_nbytes"),
        int((ins + in_sizes).max()) if k else 0, int((outs + out_sizes).max()) if k else 0,
    )


def _bases(given: Sequence[int] | None, sizes: np.ndarray, k: int, name: str) -> np.ndarray:
    if given is None:
        return np.cumsum(sizes) - sizes
    bases = np.asarray(given, dtype=_I64)
    if bases.shape != (k,) or np.any(bases < 0):
        raise ValueError(f"batch: {name} must hold {k} offsets >= 0, got {given!r}")
    return bases


def stage(frames: Sequence[Any], layout: Layout, into: np.ndarray) -> None:
    """Copy each chunk's stored bytes into ``into`` (``layout.in_nbytes`` bytes) where ``layout`` expects them."""
    if len(frames) != layout.n_chunks:
        raise ValueError(f"stage: {len(frames)} frames for a layout of {layout.n_chunks} chunks")
    for frame, base, size in zip(frames, layout.chunk_in.tolist(), layout.chunk_in_nbytes.tolist()):
        data = _as_bytes(frame)
        if len(data) != size:
            raise ValueError(f"stage: a frame of {len(data)} bytes where the layout has {size}")
        into[base:base + size] = data
