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

:func:`parse_blosc_batch` turns a batch of frames, where they were read into one buffer, into a
:class:`Layout`: one row per stream (where its bytes are, how many it decodes to, where they go in
the output, raw or which compressor) and one row per block that needs an unshuffle, in a fixed
number of numpy steps whatever the number of chunks. :func:`parse_blosc` does one frame;
:func:`batch` joins layouts. Everything is checked against each frame's length and chunk's size
first: an inconsistent frame is left out with the reason (:func:`parse_blosc` raises it as a
:class:`FrameError`, a ``ValueError``), never an offset outside the frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...zarr.codecs.blosc import HEADER_SIZE

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


def _as_bytes(frame: Any) -> np.ndarray:
    return np.frombuffer(memoryview(frame).cast("B"), dtype=np.uint8)


def _le32(buf: np.ndarray, pos: np.ndarray, signed: bool = False) -> np.ndarray:
    """Little-endian 32-bit values at byte offsets ``pos`` (the caller has checked ``pos + 4 <= len(buf)``)."""
    b = buf[pos[:, None] + np.arange(4)].astype(_I64)
    v = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    return np.where(v >= 1 << 31, v - (1 << 32), v) if signed else v


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``0..counts[i]-1`` for each ``i``, end to end."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=_I64) - np.repeat(starts, counts)


class _Faults:
    """The first fault of each chunk of a batch: a chunk with one is left out of the layout."""

    def __init__(self, k: int) -> None:
        self.bad = np.zeros(k, bool)
        self.why: dict[int, str] = {}

    def add(self, mask: np.ndarray, message) -> None:
        """Record ``message(i)`` for the chunks ``i`` in ``mask`` that have no fault yet (few: a loop is fine)."""
        new = mask & ~self.bad
        for i in np.flatnonzero(new).tolist():
            self.why[i] = message(i)
        self.bad |= new

    def add_rows(self, row_chunk: np.ndarray, mask: np.ndarray, message) -> None:
        """As :meth:`add` for per-row faults (blocks, streams): ``message(row)`` for each chunk's first bad row."""
        rows = np.flatnonzero(mask & ~self.bad[row_chunk])
        chunks, first = np.unique(row_chunk[rows], return_index=True)
        for c, r in zip(chunks.tolist(), rows[first].tolist()):
            self.why[c] = message(r)
        self.bad[chunks] = True


def _chunk_out(chunk_nbytes: np.ndarray, chunk_out: Sequence[int] | None) -> np.ndarray:
    if chunk_out is None:
        return np.cumsum(chunk_nbytes) - chunk_nbytes
    out = np.asarray(chunk_out, dtype=_I64)
    if out.shape != chunk_nbytes.shape or np.any(out < 0):
        raise ValueError(f"chunk_out must hold {len(chunk_nbytes)} offsets >= 0")
    _check_disjoint(out, chunk_nbytes)
    return out


def _check_disjoint(starts: np.ndarray, sizes: np.ndarray) -> None:
    order = np.argsort(starts, kind="stable")
    if len(order) > 1 and np.any((starts[order] + sizes[order])[:-1] > starts[order][1:]):
        raise ValueError("the chunks' outputs overlap: the unshuffle writes each chunk's blocks in place")


def _chunk_table(buf: np.ndarray, chunk_in: Any, chunk_in_nbytes: Any, chunk_nbytes: Any) -> tuple[np.ndarray, ...]:
    ins, sizes, nbytes = (np.asarray(a, dtype=_I64).reshape(-1) for a in (chunk_in, chunk_in_nbytes, chunk_nbytes))
    if not len(ins) == len(sizes) == len(nbytes):
        raise ValueError("chunk_in, chunk_in_nbytes and chunk_nbytes must have one entry per chunk")
    if np.any(ins < 0) or np.any(sizes < 0) or np.any(nbytes < 0) or np.any(ins + sizes > len(buf)):
        raise ValueError(f"the chunks' stored bytes must lie inside the {len(buf)}-byte input")
    return ins, sizes, nbytes


def parse_blosc_batch(buf: Any, chunk_in: Any, chunk_in_nbytes: Any, chunk_nbytes: Any,
                      chunk_out: Sequence[int] | None = None) -> tuple[Layout, dict[int, str]]:
    """The streams of a batch of blosc1 frames, stored in ``buf`` at ``chunk_in`` (``chunk_in_nbytes`` each).

    Chunk ``i`` decodes to ``chunk_nbytes[i]`` bytes at ``chunk_out[i]`` of the output (default: end
    to end). The work is vectorised over the batch: Python steps do not grow with its chunks or
    blocks (a loop of at most 16 steps walks the streams of all blocks at once). Returns the layout
    of the well-formed chunks and ``{chunk index: why}`` for the others, which the layout leaves
    out (no streams, no blocks): anything c-blosc's reader refuses, plus frames its writer never
    produces and its reader would decode into undefined bytes (a split block that is not a whole
    number of items), streams claiming more stored than decoded bytes, and empty streams.
    """
    buf = _as_bytes(buf)
    ins, sizes, nbytes = _chunk_table(buf, chunk_in, chunk_in_nbytes, chunk_nbytes)
    outs = _chunk_out(nbytes, chunk_out)
    k = len(ins)
    faults = _Faults(k)
    faults.add(sizes < HEADER_SIZE, lambda i: f"blosc frame of {sizes[i]} bytes is shorter than its {HEADER_SIZE}-byte "
                                              "header")
    at = np.where(faults.bad, 0, ins)  # the header of every chunk still in, in range
    head = buf[at[:, None] + np.arange(HEADER_SIZE)] if len(buf) >= HEADER_SIZE else np.zeros((k, 16), np.uint8)
    version, versionlz, flags, typesize = (head[:, j].astype(_I64) for j in range(4))
    n, blocksize, cbytes = head[:, 4:].copy().view("<i4").astype(_I64).T
    faults.add(version != VERSION_FORMAT,
               lambda i: f"blosc frame format {version[i]}: c-blosc 1.x reads format {VERSION_FORMAT} only")
    faults.add(flags & RESERVED != 0, lambda i: f"blosc frame sets the reserved flag 0x08 (flags {flags[i]:#04x})")
    faults.add(cbytes != sizes, lambda i: f"blosc frame claims {cbytes[i]} bytes but {sizes[i]} are stored")
    faults.add(n != nbytes, lambda i: f"blosc frame holds {n[i]} bytes, the chunk has {nbytes[i]}")
    live = ~faults.bad & (n > 0)  # a frame of 0 bytes decodes to nothing, whatever else it says
    faults.add(live & (typesize == 0), lambda i: "blosc frame has typesize 0")
    top = np.minimum(n, MAX_BLOCKSIZE)
    faults.add(live & ((blocksize < 1) | (blocksize > top)),
               lambda i: f"blosc block size {blocksize[i]} is outside 1..{top[i]}")
    memcpyed = flags & MEMCPYED != 0
    faults.add(live & memcpyed & (cbytes != n + HEADER_SIZE),
               lambda i: f"memcpyed blosc frame of {cbytes[i]} bytes should be {n[i] + HEADER_SIZE}")
    fmt = flags >> 5
    compressed = live & ~memcpyed
    faults.add(compressed & (fmt >= len(_FORMATS)),
               lambda i: f"blosc frame names compressor format {fmt[i]}, unknown to c-blosc 1.x")
    faults.add(compressed & (versionlz != 1), lambda i: f"blosc frame's {_FORMATS[int(fmt[i])][0]} format version is "
                                                        f"{versionlz[i]}; c-blosc knows version 1")
    codec = np.array([c for _, c in _FORMATS.values()] + [UNSUPPORTED] * 3, np.int8)[fmt]
    bs = np.maximum(blocksize, 1)
    nfull, leftover = n // bs, n % bs
    nblocks = np.where(compressed, nfull + (leftover > 0), 0)
    table_end = HEADER_SIZE + 4 * nblocks
    faults.add(compressed & (table_end > sizes), lambda i: f"blosc block table ({nblocks[i]} blocks) runs past the "
                                                           f"end of the {sizes[i]}-byte frame")
    split = (flags & DONT_SPLIT == 0) & (typesize <= MAX_SPLITS) & (bs // np.maximum(typesize, 1) >= MIN_BUFFERSIZE)
    nsplits = np.where(split, typesize, 1)
    faults.add(compressed & (nfull > 0) & (bs % np.maximum(nsplits, 1) != 0),
               lambda i: f"blosc blocks of {blocksize[i]} bytes are split into {nsplits[i]} streams but are not a "
                         f"whole number of {typesize[i]}-byte items")

    # blocks of the chunks still in: where each starts, its size and how many streams it holds
    ok = compressed & ~faults.bad
    counts = np.where(ok, nblocks, 0)
    b_chunk = np.repeat(np.arange(k, dtype=_I64), counts)
    b_index = _ranges(counts)
    b_start = _le32(buf, ins[b_chunk] + HEADER_SIZE + 4 * b_index, signed=True)
    faults.add_rows(b_chunk, (b_start < table_end[b_chunk]) | (b_start > sizes[b_chunk] - 4),
                    lambda r: f"blosc block {b_index[r]} starts at {b_start[r]}, outside {table_end[b_chunk[r]]}.."
                              f"{sizes[b_chunk[r]] - 4} of the frame")
    partial = (b_index == nfull[b_chunk]) & (leftover[b_chunk] > 0)
    b_size = np.where(partial, leftover[b_chunk], bs[b_chunk])
    b_splits = np.where(partial, 1, nsplits[b_chunk])
    b_neblock = b_size // b_splits

    # the streams, walked in step over every block: stream j of each block that has one
    pos = ins[b_chunk] + np.where(faults.bad[b_chunk], 0, b_start)  # absolute, in buf
    end = (ins + sizes)[b_chunk]
    parts = []
    for j in range(int(b_splits.max()) if len(b_splits) else 0):
        rows = np.flatnonzero((b_splits > j) & ~faults.bad[b_chunk])
        p, c = pos[rows], b_chunk[rows]
        faults.add_rows(c, p > end[rows] - 4, lambda r: f"blosc block {b_index[rows[r]]}: stream {j}'s size field "
                                                        f"lies past the end of the {sizes[c[r]]}-byte frame")
        live_rows = ~faults.bad[c]
        rows, p, c = rows[live_rows], p[live_rows], c[live_rows]
        cs = _le32(buf, p)
        ne = b_neblock[rows]
        faults.add_rows(c, (cs < 1) | (cs > ne), lambda r: f"blosc block {b_index[rows[r]]}: stream {j} claims {cs[r]} "
                                                           f"stored bytes for {ne[r]} decoded (1..{ne[r]} allowed)")
        faults.add_rows(c, p + 4 + cs > end[rows], lambda r: f"blosc block {b_index[rows[r]]}: stream {j} runs past "
                                                             f"the end of the {sizes[c[r]]}-byte frame")
        pos[rows] = p + 4 + cs
        dst = outs[c] + b_index[rows] * bs[c] + j * ne
        parts.append((p + 4, cs, dst, ne, c))
    m = np.flatnonzero(memcpyed & live & ~faults.bad)
    parts.append((ins[m] + HEADER_SIZE, n[m], outs[m], n[m], m))
    src, csize, dst, dsize, chunk = (np.concatenate(x) for x in zip(*parts))
    keep = ~faults.bad[chunk]
    order = np.argsort(dst[keep], kind="stable")
    src, csize, dst, dsize, chunk = (a[keep][order] for a in (src, csize, dst, dsize, chunk))

    # blocks to unshuffle (c-blosc: byte shuffle when typesize > 1, else bit shuffle when the block
    # holds a multiple of 8 items; a block that is less than one item is left as it is)
    ts = typesize[b_chunk]
    items = b_size // np.maximum(ts, 1)
    byte = flags[b_chunk] & DOSHUFFLE != 0
    kind = np.where(byte & (ts > 1), np.where(items > 0, BYTESHUFFLE, 0),
                    np.where((flags[b_chunk] & DOBITSHUFFLE != 0) & (items > 0) & (items % 8 == 0), BITSHUFFLE, 0))
    sel = (kind > 0) & ~faults.bad[b_chunk]
    block_dst = outs[b_chunk[sel]] + b_index[sel] * bs[b_chunk[sel]]
    layout = Layout(src, csize, dst, dsize, csize == dsize, codec[chunk], chunk,
                    block_dst, b_size[sel], ts[sel], kind[sel].astype(np.int8),
                    ins, sizes, outs, nbytes, len(buf), int((outs + nbytes).max()) if k else 0)
    return layout, faults.why


def parse_blosc(frame: Any, nbytes: int) -> Layout:
    """The streams of one blosc1 frame (exactly the stored chunk) that decodes to ``nbytes`` bytes.

    A :class:`FrameError` for a frame :func:`parse_blosc_batch` leaves out, saying why.
    """
    buf = _as_bytes(frame)
    layout, faults = parse_blosc_batch(buf, [0], [len(buf)], [nbytes])
    if faults:
        raise FrameError(faults[0])
    return layout


def parse_zstd_batch(buf: Any, chunk_in: Any, chunk_in_nbytes: Any, chunk_nbytes: Any,
                     chunk_out: Sequence[int] | None = None) -> tuple[Layout, dict[int, str]]:
    """Plain zstd chunks (numcodecs' ``Zstd``): each one stream, its stored bytes, decoding to its chunk.

    Checked here: the magic number (a zstd frame, or a skippable one first) and, in a zstd frame's header,
    that its reserved bit is clear, that it needs no dictionary, and that the content size it states, if it
    states one, is the chunk's (nvCOMP's behaviour on such frames is undefined; the CPU decode of them
    fails). A chunk that starts with a skippable frame has no header checked. The decoder checks that each
    stream decodes to exactly its chunk's size. Arguments and result as for :func:`parse_blosc_batch`.
    """
    buf = _as_bytes(buf)
    ins, sizes, nbytes = _chunk_table(buf, chunk_in, chunk_in_nbytes, chunk_nbytes)
    outs = _chunk_out(nbytes, chunk_out)
    faults = _Faults(len(ins))
    live = nbytes > 0  # an empty chunk needs no stream
    faults.add(live & (sizes < 4), lambda i: f"zstd frame of {sizes[i]} bytes is shorter than its magic number")
    magic = _le32(buf, np.where(faults.bad | ~live, 0, ins)) if len(buf) >= 4 else np.zeros(len(ins), _I64)
    faults.add(live & (magic != _ZSTD_MAGIC) & (magic & ~0xF != _ZSTD_SKIPPABLE),
               lambda i: f"not a zstd frame (magic number {magic[i]:#010x})")
    stated, dictionary, reserved = _zstd_headers(buf, ins, sizes, live & ~faults.bad & (magic == _ZSTD_MAGIC))
    faults.add((stated == -2), lambda i: f"zstd frame header of {sizes[i]} bytes is cut short")
    faults.add(reserved, lambda i: "zstd frame header has its reserved bit set")
    faults.add(dictionary != 0, lambda i: f"zstd frame needs dictionary {dictionary[i]}")
    faults.add((stated >= 0) & (stated != nbytes),
               lambda i: f"zstd frame holds {stated[i]} bytes, the chunk {nbytes[i]}")
    c = np.flatnonzero(live & ~faults.bad)
    empty = np.zeros(0, _I64)
    layout = Layout(ins[c], sizes[c], outs[c], nbytes[c], np.zeros(len(c), bool), np.full(len(c), ZSTD, np.int8), c,
                    empty, empty, empty, empty.astype(np.int8), ins, sizes, outs, nbytes, len(buf),
                    int((outs + nbytes).max()) if len(ins) else 0)
    return layout, faults.why


def _zstd_headers(buf: np.ndarray, ins: np.ndarray, sizes: np.ndarray,
                  mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the header of each zstd frame in ``mask`` says (RFC 8878, 3.1.1.1): ``(content size, dictionary id,
    reserved bit set)``. The content size is -1 where it states none (or outside ``mask``) and -2 where the
    frame ends inside its header."""
    stated = np.full(len(ins), -1, _I64)
    dictionary = np.zeros(len(ins), _I64)
    reserved = np.zeros(len(ins), bool)
    i = np.flatnonzero(mask & (sizes >= 5))
    stated[mask & (sizes < 5)] = -2
    if not len(i):
        return stated, dictionary, reserved
    fhd = buf[ins[i] + 4].astype(_I64)
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    reserved[i] = (fhd & 0x08) != 0
    did_bytes = np.array([0, 1, 2, 4], _I64)[fhd & 3]
    fcs_bytes = np.where(fcs_flag == 0, single, 1 << fcs_flag)  # 0 or 1, 2, 4, 8
    did_at = ins[i] + 5 + (1 - single)  # past the window descriptor (absent in a single segment)
    fcs_at = did_at + did_bytes
    short = fcs_at + fcs_bytes > ins[i] + sizes[i]
    stated[i[short]] = -2
    ok = ~short
    dictionary[i[ok]] = _le_var(buf, did_at[ok], did_bytes[ok]).astype(_I64)  # (at most 4 bytes)
    has = ok & (fcs_bytes > 0)
    value = _le_var(buf, fcs_at[has], fcs_bytes[has])
    value += np.where(fcs_bytes[has] == 2, np.uint64(256), np.uint64(0))  # a 2-byte size is stored less 256
    # (a size beyond int64 is beyond any chunk: clamped, it still differs from the chunk's)
    stated[i[has]] = np.minimum(value, np.uint64(np.iinfo(_I64).max)).astype(_I64)
    return stated, dictionary, reserved


def _le_var(buf: np.ndarray, at: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Little-endian unsigned values of ``n`` (0 to 8) bytes at ``at`` (within ``buf``), as uint64."""
    value = np.zeros(len(at), np.uint64)
    for k in range(int(n.max()) if len(n) else 0):
        byte = buf[np.where(k < n, at + k, at)].astype(np.uint64)  # (a value of no bytes reads nothing)
        value |= np.where(k < n, byte << np.uint64(8 * k), np.uint64(0))
    return value


def parse_zstd(frame: Any, nbytes: int) -> Layout:
    """One plain zstd chunk: a :class:`FrameError` where :func:`parse_zstd_batch` leaves it out."""
    buf = _as_bytes(frame)
    layout, faults = parse_zstd_batch(buf, [0], [len(buf)], [nbytes])
    if faults:
        raise FrameError(faults[0])
    return layout


def batch(layouts: Sequence[Layout], in_bases: Sequence[int] | None = None,
          out_bases: Sequence[int] | None = None) -> Layout:
    """One layout for the chunks of ``layouts``: each layout's input at ``in_bases`` and output at ``out_bases``.

    The bases default to the layouts end to end (each input and output right after the previous
    one); zeros keep offsets as they are (layouts parsed from one staged buffer). The chunks'
    outputs must not overlap: the unshuffle writes blocks back in place.
    """
    k = len(layouts)
    in_sizes = np.array([l.in_nbytes for l in layouts], _I64)
    out_sizes = np.array([l.out_nbytes for l in layouts], _I64)
    ins = _bases(in_bases, in_sizes, k, "in_bases")
    outs = _bases(out_bases, out_sizes, k, "out_bases")
    n_streams = np.array([len(l) for l in layouts], _I64)
    n_blocks = np.array([len(l.block_dst) for l in layouts], _I64)
    n_chunks = np.array([l.n_chunks for l in layouts], _I64)
    chunk_base = np.cumsum(n_chunks) - n_chunks

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(l, name) for l in layouts]) if k else np.zeros(0, _I64)

    def shift(name: str, base: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return cat(name) + np.repeat(base, counts)

    chunk_out, chunk_out_nbytes = shift("chunk_out", outs, n_chunks), cat("chunk_out_nbytes")
    _check_disjoint(chunk_out, chunk_out_nbytes)
    return Layout(
        shift("src", ins, n_streams), cat("csize"), shift("dst", outs, n_streams), cat("dsize"),
        cat("raw").astype(bool), cat("codec").astype(np.int8), shift("chunk", chunk_base, n_streams),
        shift("block_dst", outs, n_blocks), cat("block_size"), cat("block_typesize"),
        cat("block_shuffle").astype(np.int8),
        shift("chunk_in", ins, n_chunks), cat("chunk_in_nbytes"), chunk_out, chunk_out_nbytes,
        int((ins + in_sizes).max()) if k else 0, int((outs + out_sizes).max()) if k else 0,
    )


def raw_layout(in_nbytes: int, chunk_in: Any, chunk_nbytes: Any, chunk_out: Any) -> Layout:
    """Chunks stored as they are (decoded elsewhere): one raw stream each, ``chunk_nbytes[i]`` bytes copied
    from ``chunk_in[i]`` of an ``in_nbytes`` input to ``chunk_out[i]`` of the output."""
    ins, nbytes, outs = (np.asarray(a, dtype=_I64).reshape(-1) for a in (chunk_in, chunk_nbytes, chunk_out))
    if not len(ins) == len(nbytes) == len(outs) or np.any(ins < 0) or np.any(ins + nbytes > in_nbytes) or \
            np.any(outs < 0):
        raise ValueError(f"raw_layout: one offset per chunk, its bytes inside the {in_nbytes}-byte input")
    _check_disjoint(outs, nbytes)
    k, empty = len(ins), np.zeros(0, _I64)
    return Layout(ins, nbytes, outs, nbytes, np.ones(k, bool), np.full(k, UNSUPPORTED, np.int8), np.arange(k, dtype=_I64),
                  empty, empty, empty, empty.astype(np.int8), ins, nbytes, outs, nbytes, int(in_nbytes),
                  int((outs + nbytes).max()) if k else 0)


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
