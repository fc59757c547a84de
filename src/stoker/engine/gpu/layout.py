"""A staged group as one :class:`~stoker.engine.gpu.frames.Layout` for the stream decoder: blosc1 frames, plain
zstd chunks and raw streams (chunks decoded on the CPU), each chunk's output at its offset in the scratch,
parsed with a fixed number of steps per group (blosc frames walked in C where the compiled engine is built:
:mod:`.native_reads`; else numpy). Frames the parser refuses, or with a stream the
device does not decompress (another compressor inside blosc, or over the decoder's ``max_stream_bytes``),
are left out and returned for the CPU."""

from __future__ import annotations

import numpy as np

from . import frames, native_reads
from .sources import BLOSC, CPU, ZSTD


def too_big(layout: frames.Layout, max_stream_bytes: int) -> np.ndarray:
    """Chunks of ``layout`` with a stream the device does not decompress."""
    bad = ~layout.raw & ((layout.codec == frames.UNSUPPORTED) | (layout.dsize > max_stream_bytes))
    return np.unique(layout.chunk[bad])


def layout_of(buf: np.ndarray, how: np.ndarray, at: np.ndarray, size: np.ndarray, out: np.ndarray,
              nbytes: np.ndarray, max_stream_bytes: int) -> tuple[frames.Layout | None, np.ndarray, np.ndarray]:
    """``(layout, held, cpu)``: the layout of a group's chunks (row ``i``: decoded by ``how[i]``, stored at
    ``at[i]`` in ``buf``, ``size[i]`` bytes, decoding into ``nbytes[i]`` bytes at ``out[i]`` of the
    scratch), the rows it holds, and the rows left for the CPU (sorted)."""
    cpu: list[np.ndarray] = []
    parts, held = [], []
    for kind, parse in ((BLOSC, native_reads.parse_blosc_batch), (ZSTD, frames.parse_zstd_batch)):
        ids = np.flatnonzero(how == kind)
        if not len(ids):
            continue
        layout, faults = parse(buf, at[ids], size[ids], nbytes[ids], out[ids])
        bad = np.union1d(np.asarray(list(faults), np.int64), too_big(layout, max_stream_bytes))
        if len(bad):  # parsed again without them: the layout holds only chunks the device decodes
            cpu.append(ids[bad])
            ids = np.delete(ids, bad)
            if not len(ids):
                continue
            layout, _ = parse(buf, at[ids], size[ids], nbytes[ids], out[ids])
        parts.append(layout)
        held.append(ids)
    raw = np.flatnonzero(how == CPU)
    if len(raw):
        parts.append(frames.raw_layout(len(buf), at[raw], size[raw], out[raw]))
        held.append(raw)
    left = np.sort(np.concatenate(cpu)) if cpu else np.zeros(0, np.int64)
    if not parts:
        return None, np.zeros(0, np.int64), left
    layout = frames.batch(parts, in_bases=[0] * len(parts), out_bases=[0] * len(parts))
    return layout, np.concatenate(held), left
