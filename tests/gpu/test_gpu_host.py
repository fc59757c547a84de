"""The host side of GPU decoding, on the CPU: frames parsed into streams, decoded and unshuffled as the
device would, bit for bit what numcodecs decodes; hostile frames refused, never read out of range."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import struct

import numcodecs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stoker.engine.gpu import frames, ops, reference
from stoker.engine.gpu.frames import BITSHUFFLE, BYTESHUFFLE, FrameError, UnsupportedFrame, parse_blosc, parse_zstd

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
CNAMES = [c for c in ("lz4", "lz4hc", "zstd", "blosclz", "zlib") if c in numcodecs.blosc.list_compressors()]
SUPPORTED = {"lz4", "lz4hc", "zstd"}
ITEMSIZES = [1, 2, 3, 4, 8, 16, 24]  # 3: odd; 24: above the 16 items a block may be split into
SPLITMODES = {"forward": 4, "always": 1, "never": 2, "auto": 3}  # c-blosc's BLOSC_*_SPLIT; forward is its default
_blosc_lib = ctypes.CDLL(numcodecs.blosc.__file__)


@contextlib.contextmanager
def splitmode(name: str):
    """c-blosc's (process-wide) split mode for the frames written inside; back to its default after."""
    _blosc_lib.blosc_set_splitmode(SPLITMODES[name])
    try:
        yield
    finally:
        _blosc_lib.blosc_set_splitmode(SPLITMODES["forward"])


def _data(kind: str, nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":  # incompressible: raw streams, or a memcpyed frame
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(nbytes, np.uint8)
    if kind == "small":  # runs of a few values: what LZ4 compresses
        return np.repeat(rng.integers(0, 4, nbytes // 16 + 1, dtype=np.uint8), 16)[:nbytes]
    out = rng.integers(0, 256, nbytes, dtype=np.uint8)  # "mixed": raw and compressed streams in one frame
    start = 0
    while start < nbytes:  # runs of random bytes and of a few values, long enough to fill whole streams
        run = int(rng.integers(256, 32768))
        if rng.random() < 0.5:
            out[start:start + run] = _data("small", len(out[start:start + run]), seed + start)
        start += run
    return out


# numcodecs' Blosc takes the item size of a byte buffer since 0.13; older ones take it from the dtype
RAGGED = "typesize" in inspect.signature(numcodecs.Blosc).parameters


def _encode(data: np.ndarray, itemsize: int, cname: str, shuffle: int, clevel: int, blocksize: int,
            split: str = "forward") -> bytes:
    """``data`` as numcodecs writes it with items of ``itemsize`` bytes; a size that is not a whole
    number of items (a trailing partial item) needs numcodecs' ``typesize``."""
    kw = dict(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize)
    if len(data) % itemsize:
        kw["typesize"] = itemsize
    elif itemsize > 1:
        data = data.view(f"V{itemsize}")
    with splitmode(split):
        return numcodecs.Blosc(**kw).encode(data)


def _numcodecs(frame: bytes) -> np.ndarray | None:
    if len(frame) >= 16 and struct.unpack_from("<i", frame, 4)[0] == 0:
        return np.zeros(0, np.uint8)  # numcodecs takes c-blosc's 0 decoded bytes for an error; they are the chunk
    try:
        return np.frombuffer(numcodecs.Blosc().decode(frame), np.uint8)
    except RuntimeError:  # c-blosc refused the frame
        return None


def _check_layout(layout: frames.Layout, frame_nbytes: int, nbytes: int, blosc: bool = True) -> None:
    """Every stream reads inside the frame; outputs tile the chunk exactly; blocks lie inside it."""
    assert (layout.src >= 0).all() and (layout.src + layout.csize <= frame_nbytes).all()
    assert (layout.csize >= 1).all() and (not blosc or (layout.csize <= layout.dsize).all())
    order = np.argsort(layout.dst)
    ends = layout.dst[order] + layout.dsize[order]
    assert (layout.dst[order] == np.concatenate([[0], ends[:-1]])).all() if len(layout) else nbytes == 0
    assert not len(layout) or ends[-1] == nbytes
    assert (layout.raw == (layout.csize == layout.dsize)).all()
    assert (layout.block_dst >= 0).all() and (layout.block_dst + layout.block_size <= nbytes).all()


frame_specs = st.fixed_dictionaries({
    "cname": st.sampled_from(CNAMES),
    "shuffle": st.sampled_from([0, 1, 2]),
    "itemsize": st.sampled_from(ITEMSIZES),
    "clevel": st.sampled_from([5, 1, 9, 5, 0]),  # 0: a memcpyed frame
    "blocksize": st.sampled_from([0, 0, 64, 128, 200, 256, 1000, 4096, 1 << 14]),  # 64: c-blosc raises it to 128
    "split": st.sampled_from(["forward", "forward", "forward", "always", "never", "auto"]),
    "kind": st.sampled_from(["small", "small", "mixed", "mixed", "zeros", "random"]),
    # tiny buffers (memcpyed under 128 bytes), small ones, and some over c-blosc's 64 KiB least block
    # for compressors that split (so that split frames have several blocks); drawn from the seed,
    # uniformly (hypothesis' integers favour the ends of their range)
    "size": st.sampled_from(["tiny", "small", "small", "large"]),
    "ragged": st.booleans() if RAGGED else st.just(False),  # a partial item at the end
    "seed": st.integers(0, 2**32 - 1),
})


SIZES = {"tiny": (0, 300), "small": (300, 20000), "large": (60000, 300000)}


def _frame(spec: dict) -> tuple[bytes, int]:
    size, itemsize = int(np.random.default_rng(spec["seed"] + 1).integers(*SIZES[spec["size"]])), spec["itemsize"]
    if not spec["ragged"]:
        size -= size % itemsize
    data = _data(spec["kind"], size, spec["seed"])
    frame = _encode(data, spec["itemsize"], spec["cname"], spec["shuffle"], spec["clevel"], spec["blocksize"],
                    spec["split"])
    return frame, len(data)


@settings(max_examples=300, **SETTINGS)
@given(frame_specs)
def test_streams_decode_to_what_numcodecs_decodes(spec):
    frame, nbytes = _frame(spec)
    expected = _numcodecs(frame)
    try:
        layout = parse_blosc(frame, nbytes)
    except FrameError:
        # only frames c-blosc cannot read either: split mode "always" splits where its own reader will not
        assert expected is None and spec["split"] == "always"
        return
    _check_layout(layout, len(frame), nbytes)
    event(f"streams raw: {'all' if layout.raw.all() else 'some' if layout.raw.any() else 'none'}")
    blocksize = struct.unpack_from("<i", frame, 8)[0]
    event(f"memcpyed: {bool(frame[2] & frames.MEMCPYED)}")
    event(f"blocks: {'several' if nbytes > blocksize else 'one'}; split: {bool(len(layout) > -(-nbytes // blocksize))}")
    event(f"unshuffled blocks: {sorted(set(layout.block_shuffle.tolist()))}")
    if not layout.supported:
        assert spec["cname"] not in SUPPORTED
        with pytest.raises(UnsupportedFrame):
            reference.decode_blosc(frame, nbytes)
        return
    if expected is None:
        with pytest.raises(FrameError):
            reference.decode_blosc(frame, nbytes)
        return
    got = reference.decode_blosc(frame, nbytes)
    assert got.tobytes() == expected.tobytes()


def _layout_of(cname, itemsize, nbytes, blocksize, shuffle=1, kind="small", clevel=5, split="forward"):
    frame = _encode(_data(kind, nbytes, 0), itemsize, cname, shuffle, clevel, blocksize, split)
    return frame, parse_blosc(frame, nbytes)


def test_the_split_rule_is_c_blosc_s():
    """By default every compressor but zstd splits a full block into one stream per byte of an item
    (when items are at most 16 bytes and a block holds at least 128 of them); the last, partial block
    is one stream."""
    # c-blosc's writer makes the blocks of a compressor that splits at least 64 KiB (4096 * typesize here)
    frame, lay = _layout_of("lz4", 4, 65536 * 3 + 1000, 4096)
    assert len(lay) == 3 * 4 + 1 and (lay.dsize[:12] == 16384).all() and lay.dsize[12] == 1000
    _, lay = _layout_of("zstd", 4, 4096 * 3 + 1000, 4096)
    assert len(lay) == 4 and list(lay.dsize) == [4096, 4096, 4096, 1000]
    _, lay = _layout_of("zstd", 4, 65536 * 3, 4096, split="always")  # zstd splits if the writer is told to
    assert len(lay) == 12 and (lay.dsize == 16384).all()
    _, lay = _layout_of("lz4", 4, 4096 * 3, 4096, split="never")  # and lz4 does not (nor are blocks enlarged)
    assert len(lay) == 3 and (lay.dsize == 4096).all()
    # the reader's own condition: items over 16 bytes, or under 128 items a block, are one stream even
    # where dont_split is clear (frames older than the flag; c-blosc's reader decodes them so)
    for itemsize, nbytes, blocksize in ((24, 24 * 512, 24 * 256), (8, 8 * 500, 8 * 100)):
        frame, _ = _layout_of("lz4", itemsize, nbytes, blocksize, split="never")
        assert frame[2] & frames.DONT_SPLIT
        frame = _patch(frame, 2, "B", frame[2] & ~frames.DONT_SPLIT)
        lay = parse_blosc(frame, nbytes)
        assert len(lay) == nbytes // blocksize and (lay.dsize == blocksize).all()
        assert reference.decode_blosc(frame, nbytes).tobytes() == _numcodecs(frame).tobytes()
    _, lay = _layout_of("lz4", 1, 1000, 0)  # one block of the whole buffer, split into 1 stream
    assert len(lay) == 1 and not lay.raw.any()


def test_incompressible_blocks_are_raw_and_tiny_or_level_0_frames_memcpyed():
    data = np.concatenate([_data("random", 4096, 0), np.zeros(6000, np.uint8)])  # 2 incompressible blocks of 5
    frame = _encode(data, 2, "zstd", 1, 5, 2048)
    lay = parse_blosc(frame, len(data))
    assert list(lay.raw) == [True, True, False, False, False]
    assert reference.decode_blosc(frame, len(data)).tobytes() == data.tobytes()
    for nbytes, clevel in ((100, 5), (5000, 0)):
        frame, lay = _layout_of("zstd", 4, nbytes, 0, clevel=clevel)
        assert frame[2] & frames.MEMCPYED and len(lay) == 1 and lay.raw.all() and lay.src[0] == 16
        assert not len(lay.block_dst)  # a memcpyed chunk is stored unshuffled
    frame, lay = _layout_of("lz4", 4, 64 * 1024, 0, kind="random")
    assert frame[2] & frames.MEMCPYED  # c-blosc gives up on incompressible data and copies the whole chunk


def test_unshuffle_follows_c_blosc_on_partial_blocks():
    """Bit shuffle skips blocks whose item count is not a multiple of 8; byte shuffle leaves the bytes
    past the last whole item where they are, and a block smaller than an item is not shuffled."""
    # zstd: c-blosc's writer keeps the block size asked for (it enlarges the blocks of compressors that split)
    frame, lay = _layout_of("zstd", 4, 4096 + 4 * 12, 4096, shuffle=2)  # 12 items in the last block
    assert list(lay.block_size) == [4096] and (lay.block_shuffle == BITSHUFFLE).all()
    assert reference.decode_blosc(frame, 4096 + 48).tobytes() == _numcodecs(frame).tobytes()
    if not RAGGED:
        return
    for nbytes, shuffle, sizes in ((4096 + 1003, 1, [4096, 1003]), (4096 + 4 * 16 + 3, 2, [4096, 67]),
                                   (4096 + 3, 1, [4096])):
        frame, lay = _layout_of("zstd", 4, nbytes, 4096, shuffle=shuffle)
        assert list(lay.block_size) == sizes
        assert reference.decode_blosc(frame, nbytes).tobytes() == _numcodecs(frame).tobytes()


def test_blocks_stored_out_of_order_decode_in_place():
    """c-blosc compressing on several threads stores blocks as they finish: the table, not the order, counts."""
    nbytes = 4096 * 5 + 100
    frame, lay = _layout_of("zstd", 2, nbytes, 4096)
    nblocks = 6
    starts = list(struct.unpack_from(f"<{nblocks}i", frame, 16))
    bounds = sorted(starts) + [len(frame)]
    extent = {s: frame[s:bounds[bounds.index(s) + 1]] for s in starts}
    order = [5, 2, 0, 4, 1, 3]  # the stored order of the blocks
    head = 16 + 4 * nblocks
    body, new_starts = b"", [0] * nblocks
    for b in order:
        new_starts[b] = head + len(body)
        body += extent[starts[b]]
    shuffled = frame[:16] + struct.pack(f"<{nblocks}i", *new_starts) + body
    expected = _numcodecs(frame)
    assert _numcodecs(shuffled).tobytes() == expected.tobytes()
    assert reference.decode_blosc(shuffled, nbytes).tobytes() == expected.tobytes()


def test_compressors_other_than_lz4_and_zstd_are_reported_unsupported():
    for cname in set(CNAMES) - SUPPORTED:
        frame, lay = _layout_of(cname, 2, 20000, 4096)
        assert not lay.supported and (lay.unsupported_chunks() == [0]).all()
        with pytest.raises(UnsupportedFrame):
            reference.decode_blosc(frame, 20000)
        frame, lay = _layout_of(cname, 2, 50, 0)  # memcpyed: nothing to decompress, supported
        assert lay.supported and reference.decode_blosc(frame, 50).tobytes() == _numcodecs(frame).tobytes()


@settings(max_examples=60, **SETTINGS)
@given(st.lists(frame_specs, min_size=1, max_size=4), st.lists(st.integers(0, 40), min_size=4, max_size=4),
       st.booleans())
def test_a_batch_of_chunks_decodes_as_one(specs, gaps, with_zstd):
    """Chunks of every kind side by side in one input and one output, as a batched device decode takes them."""
    made = [_frame(s) for s in specs]
    layouts = [parse_blosc(f, n) for f, n in made]
    expected = [_numcodecs(f) for f, _ in made]
    if with_zstd:
        data = _data("small", 3000, len(made))
        made.append((numcodecs.Zstd(level=3).encode(data), len(data)))
        layouts.append(parse_zstd(made[-1][0], len(data)))
        expected.append(data)
    keep = [i for i, (lay, e) in enumerate(zip(layouts, expected)) if lay.supported and e is not None]
    made, layouts, expected = ([x[i] for i in keep] for x in (made, layouts, expected))
    out_bases = np.cumsum([0] + [n + g for (_, n), g in zip(made, gaps)])[:len(made)]
    lay = frames.batch(layouts, out_bases=out_bases)
    assert lay.n_chunks == len(made) and (lay.chunk_out == out_bases).all()
    got = reference.decode([f for f, _ in made], lay)
    for i, ((_, n), e) in enumerate(zip(made, expected)):
        assert got[out_bases[i]:out_bases[i] + n].tobytes() == e.tobytes()


def _mutate(frame: bytes, edits, how: str, cut: int) -> bytes:
    bad = bytearray(frame)
    if how == "truncate":
        bad = bad[:cut % (len(bad) + 1)]
    elif how == "extend":
        bad += bytes(1 + cut % 64)
    elif how in ("bytes", "table"):
        span = 16 + 4 * 40 if how == "table" else len(bad)  # the header, table and first stream sizes
        for pos, value in edits:
            if bad:
                bad[pos % min(span, len(bad))] = value
    return bytes(bad)


mutations = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6)
damage = st.tuples(mutations, st.sampled_from(["none", "none", "bytes", "truncate", "extend", "table"]),
                   st.integers(0, 2**16))


@settings(max_examples=40, **SETTINGS)
@given(st.lists(st.tuples(frame_specs, damage), min_size=1, max_size=6), st.integers(0, 2**16))
def test_a_staged_batch_parses_as_its_chunks_do_one_by_one(chunks, seed):
    """parse_blosc_batch over frames read into one buffer (gaps between them): each well-formed chunk has
    the streams parse_blosc gives it alone, each other one is left out with the same reason."""
    made = []
    for spec, (edits, how, cut) in chunks:
        spec = {**spec, "size": "tiny" if spec["size"] == "tiny" else "small"}
        frame, nbytes = _frame(spec)
        made.append((_mutate(frame, edits, how, cut), nbytes))
    gaps = np.random.default_rng(seed).integers(0, 9, len(made))
    sizes = np.array([len(f) for f, _ in made])
    ins = np.cumsum(sizes + gaps) - sizes
    buf = np.full(int(ins[-1] + sizes[-1]), 0xAB, np.uint8)
    for (frame, _), at in zip(made, ins):
        buf[at:at + len(frame)] = np.frombuffer(frame, np.uint8)
    layout, faults = frames.parse_blosc_batch(buf, ins, sizes, [n for _, n in made])
    for i, (frame, nbytes) in enumerate(made):
        try:
            alone = parse_blosc(frame, nbytes)
        except FrameError as exc:
            assert faults.get(i) == str(exc)
            assert not (layout.chunk == i).any()
            continue
        assert i not in faults
        rows = layout.chunk == i
        assert (layout.src[rows] - ins[i] == alone.src).all() and (layout.csize[rows] == alone.csize).all()
        assert (layout.dst[rows] - layout.chunk_out[i] == alone.dst).all() and (layout.raw[rows] == alone.raw).all()
        mine = (layout.block_dst >= layout.chunk_out[i]) & (layout.block_dst < layout.chunk_out[i] + nbytes)
        assert (layout.block_dst[mine] - layout.chunk_out[i] == alone.block_dst).all()
        assert (layout.block_shuffle[mine] == alone.block_shuffle).all()
    # the undamaged chunks, parsed again where they are in buf, decode as numcodecs decodes them (those c-blosc
    # cannot read either, split "always" above 16 bytes an item, fail both ways: left out)
    clean = [i for i, (_, (_, how, _)) in enumerate(chunks) if how == "none" and _numcodecs(made[i][0]) is not None]
    layout, faults = frames.parse_blosc_batch(buf, ins[clean], sizes[clean], [made[i][1] for i in clean])
    assert not faults
    if layout.supported and clean:
        got = reference.decode_streams(buf, layout)
        for j, i in enumerate(clean):
            out = got[layout.chunk_out[j]:layout.chunk_out[j] + made[i][1]]
            assert out.tobytes() == _numcodecs(made[i][0]).tobytes()


def test_batch_refuses_overlapping_outputs():
    f1, l1 = _layout_of("lz4", 2, 1000, 0)
    with pytest.raises(ValueError, match="overlap"):
        frames.batch([l1, l1], out_bases=[0, 999])
    assert frames.batch([l1, l1], out_bases=[1000, 0]).out_nbytes == 2000


# -- zstd chunks ------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(st.sampled_from(["small", "random", "mixed", "zeros"]), st.integers(1, 20000), st.integers(0, 2**32 - 1),
       st.sampled_from([1, 5, 19]), st.booleans())
def test_zstd_chunks_decode_as_one_stream(kind, nbytes, seed, level, checksum):
    data = _data(kind, nbytes, seed)
    frame = numcodecs.Zstd(level=level, checksum=checksum).encode(data)
    lay = parse_zstd(frame, nbytes)
    _check_layout(lay, len(frame), nbytes, blosc=False)
    assert len(lay) == 1 and not lay.raw.any() and lay.codec[0] == frames.ZSTD
    assert reference.decode_zstd(frame, nbytes).tobytes() == data.tobytes()


def test_damaged_zstd_chunks_are_frame_errors():
    data = _data("small", 5000, 1)
    frame = numcodecs.Zstd().encode(data)
    for bad, nbytes in ((b"\0" + frame[1:], 5000), (frame[:3], 5000), (frame[:-10], 5000), (frame, 4999),
                        (frame, 5001)):
        with pytest.raises(FrameError):
            reference.decode_zstd(bad, nbytes)


def test_zstd_frames_whose_header_states_another_size_are_left_out():
    data = _data("small", 70000, 2)
    good = numcodecs.Zstd().encode(data)  # a 4-byte content size
    magic = struct.pack("<I", 0xFD2FB528)
    no_size = magic + bytes([0x00, 0x58]) + good[9:]  # no content size: a window descriptor instead (allowed)
    huge = magic + bytes([0xE0]) + struct.pack("<Q", 2**40) + good[9:]  # 8 bytes, single segment
    no_dict = magic + bytes([0x63]) + b"\0\0\0\0" + struct.pack("<H", 65000 - 256)  # dictionary id 0; 2 bytes
    with_dict = magic + bytes([0x61]) + b"\7" + struct.pack("<H", 65000 - 256)  # dictionary 7: not for the device
    reserved = bytes(good[:4]) + bytes([good[4] | 0x08]) + good[5:]
    frames_ = [good, good, no_size, huge, no_dict, no_dict, good[:7], with_dict, reserved]
    nbytes = [70000, 69999, 70000, 70000, 65000, 65001, 70000, 65000, 70000]
    ins = np.cumsum([len(f) for f in frames_]) - [len(f) for f in frames_]
    buf = np.frombuffer(b"".join(frames_), np.uint8)
    layout, faults = frames.parse_zstd_batch(buf, ins, [len(f) for f in frames_], nbytes)
    assert layout.chunk.tolist() == [0, 2, 4]
    assert faults == {1: "zstd frame holds 70000 bytes, the chunk 69999",
                      3: "zstd frame holds 1099511627776 bytes, the chunk 70000",
                      5: "zstd frame holds 65000 bytes, the chunk 65001",
                      6: "zstd frame header of 7 bytes is cut short",
                      7: "zstd frame needs dictionary 7",
                      8: "zstd frame header has its reserved bit set"}
    for bad in (with_dict, reserved):  # the CPU refuses them too
        with pytest.raises(RuntimeError):
            numcodecs.Zstd().decode(bad)


# -- hostile blosc frames ---------------------------------------------------------------------------


def _patch(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(frame)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_malformed_frames_are_frame_errors_naming_the_fault():
    nbytes = 65536 * 3 + 500
    frame, lay = _layout_of("lz4", 4, nbytes, 16384)  # 3 full blocks of 4 streams, then one of 500 bytes
    assert len(lay) == 13
    first = int(lay.src[0]) - 4  # block 0's first stream size field
    cases = {
        "shorter than its 16-byte header": frame[:15],
        "claims": frame[:-1],
        "format 1": _patch(frame, 0, "B", 1),
        "reserved flag": _patch(frame, 2, "B", frame[2] | 0x08),
        "the chunk has": _patch(frame, 4, "<i", nbytes + 1),
        "typesize 0": _patch(frame, 3, "B", 0),
        "block size 0": _patch(frame, 8, "<i", 0),
        "block size -4": _patch(frame, 8, "<i", -4),
        "block size 197109": _patch(frame, 8, "<i", nbytes + 1),
        "unknown to c-blosc": _patch(frame, 2, "B", (frame[2] & 0x1F) | 5 << 5),
        "format version is 2": _patch(frame, 1, "B", 2),
        "block table": _patch(frame, 8, "<i", 1),  # one-byte blocks: the table outgrows the frame
        "block 0 starts at 3": _patch(frame, 16, "<i", 3),
        "block 2 starts at": _patch(frame, 24, "<i", len(frame) - 2),
        "claims 0 stored bytes": _patch(frame, first, "<i", 0),
        "claims 16385 stored bytes": _patch(frame, first, "<i", 16385),
        "claims 4294967295 stored": _patch(frame, first, "<i", -1),
        "not a whole number": _patch(frame, 8, "<i", 65534),  # split in 4, 65534-byte blocks
    }
    for message, bad in cases.items():
        with pytest.raises(FrameError, match=message):
            reference.decode_blosc(bad, nbytes)
    last = int(np.argmax(lay.src))  # the stream stored last: claiming more bytes runs it past the end
    assert lay.csize[last] < lay.dsize[last]
    with pytest.raises(FrameError, match="runs past the end"):
        reference.decode_blosc(_patch(frame, int(lay.src[last]) - 4, "<i", int(lay.dsize[last])), nbytes)
    memcpyed, _ = _layout_of("lz4", 4, 100, 0)
    with pytest.raises(FrameError, match="memcpyed blosc frame of 116 bytes should be 117"):
        parse_blosc(_patch(memcpyed, 4, "<i", 101)[:116], 101)


def test_a_damaged_stream_is_a_frame_error_naming_its_chunk():
    frame, lay = _layout_of("lz4", 4, 20000, 4096)
    i = int(np.flatnonzero(~lay.raw)[0])
    bad = bytearray(frame)
    bad[lay.src[i]:lay.src[i] + lay.csize[i]] = bytes(int(lay.csize[i]))  # zeros: offset 0 is invalid lz4
    with pytest.raises(FrameError, match="chunk 0: a lz4 stream of"):
        reference.decode_blosc(bytes(bad), 20000)


@settings(max_examples=300, **SETTINGS)
@given(frame_specs, mutations, st.sampled_from(["bytes", "truncate", "extend", "table"]), st.integers(0, 2**16))
def test_hostile_frames_never_read_outside_the_frame(spec, edits, how, cut):
    """Mutated headers, block tables and stream sizes: a FrameError, or a layout inside the frame whose
    decode (when numcodecs decodes the frame too) is numcodecs' decode."""
    spec = {**spec, "size": "tiny" if spec["size"] == "tiny" else "small"}
    frame, nbytes = _frame(spec)
    bad = _mutate(frame, edits, how, cut)
    try:
        layout = parse_blosc(bad, nbytes)
    except FrameError:
        event("refused by the parser")
        return
    _check_layout(layout, len(bad), nbytes)
    try:
        got = reference.decode_blosc(bad, nbytes)
    except (FrameError, UnsupportedFrame):
        event("refused by the decode")
        return
    event("decoded")
    expected = _numcodecs(bad)
    if expected is not None:
        assert got.tobytes() == expected.tobytes()


# -- the unshuffle on its own -----------------------------------------------------------------------


def test_unshuffle_inverts_a_numpy_shuffle_on_many_blocks_at_once():
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (5, 8 * 24 + 5), dtype=np.uint8)  # 24 items of 8 bytes, 5 bytes over
    shuffled = blocks.copy()
    body = blocks[:, :192].reshape(5, 24, 8)
    shuffled[:, :192] = body.transpose(0, 2, 1).reshape(5, 192)
    assert (ops.unshuffle(torch.from_numpy(shuffled), 8, BYTESHUFFLE).numpy() == blocks).all()
    # bit shuffle: row 8 * j + k holds bit k of byte j of every item, item i at bit i % 8 of byte i // 8
    bits = np.unpackbits(body[:, :, :, None], axis=3, bitorder="little")  # [block, item, byte j, bit k]
    rows = np.packbits(bits.transpose(0, 2, 3, 1), axis=3, bitorder="little")  # [block, j, k, item // 8]
    shuffled[:, :192] = rows.reshape(5, 192)
    assert (ops.unshuffle(torch.from_numpy(shuffled), 8, BITSHUFFLE).numpy() == blocks).all()
    twelve = torch.from_numpy(blocks[:, :8 * 12 + 5].copy())  # 12 items: c-blosc leaves such a block as it is
    assert torch.equal(ops.unshuffle(twelve, 8, BITSHUFFLE), twelve)
    small = torch.from_numpy(blocks[:, :7].copy())  # less than an item
    for shuffle in (BYTESHUFFLE, BITSHUFFLE):
        assert torch.equal(ops.unshuffle(small, 8, shuffle), small)
    with pytest.raises(ValueError, match="2-D uint8"):
        ops.unshuffle(torch.zeros(10, dtype=torch.uint8), 2, BYTESHUFFLE)
