"""What the GPU-decode executor leaves to the CPU: chunks of arrays the device does not decode, frames
the parser refuses or whose streams the device cannot take (decoded by the array's own codec, cast into
the batch dtype by the CPU path's rules, and staged as raw streams), chunks of shards rewritten since
their index was read (fetched again through the reader), and the error of a group the device failed on
(decoded again on the CPU, so the batch fails with the CPU path's error for that chunk, or with
``DeviceError`` when the CPU decodes every one of them). Each array's
first such chunk is noted once, naming the array and why."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from ...errors import DeviceError
from ...reader.array import ChunkLocation, fetch_stored
from ..cast import copy_cast, numpy_view, range_error, unfit_range
from ..cpu.cf import rounds_once
from ..planning.tables import TablePlan, file_ident


def fetch(plan: TablePlan, cid: int, path: str | None):
    """Chunk ``cid``'s stored bytes through its reader (a new buffer), or None (the fill value). ``path``:
    its file (its store key for an array in a store)."""
    reader = plan.sources[int(plan.chunk_source[cid])]
    index = tuple(int(v) for v in plan.chunk_index[cid])
    if not reader.kv.is_local and int(plan.chunk_offset[cid]) >= 0:
        f = int(plan.chunk_file[cid])
        ident = file_ident(plan.files[f])
        loc = ChunkLocation(plan.key(cid), path, int(plan.chunk_offset[cid]), int(plan.chunk_length[cid]), ident)
        return fetch_stored(reader.kv, [], [(reader, index, loc)])[1][0]  # checked against its index's generation
    return reader.encoded_chunk(index)[1]


def cpu_decode(plan: TablePlan, cid: int, data: Any, dtype: torch.dtype, stats, counts: dict,
               half_next: bool = False) -> np.ndarray:
    """Chunk ``cid`` decoded by its codec on the CPU and cast into ``dtype`` (the CPU path's rules; ``half_next``:
    float32 rounded into float16 next, :func:`~stoker.engine.cast.copy_cast`'s), as bytes in C order."""
    reader = plan.sources[int(plan.chunk_source[cid])]
    codec = reader.metadata.codec
    key = plan.key(cid)
    codec.check_stored_size(len(data), key)
    t0 = time.perf_counter()
    chunk = codec.decode(data, key)
    span = unfit_range(chunk, dtype)  # the whole chunk is cast here: any value of it that does not fit fails it
    if span is not None:
        raise range_error(reader.uri, key, codec.dtype, dtype, span)
    out = torch.empty(codec.shape, dtype=dtype)
    view = numpy_view(out)
    copy_cast(view if view is not None else out, chunk, rounds_once(reader, half_next))
    stats.chunk(time.perf_counter() - t0, 0.0, len(data), codec.nbytes)
    counts["bytes_decoded"] += codec.nbytes
    counts["chunks_decoded"] += 1
    return out.view(-1).view(torch.uint8).numpy()


def decode_again(plan: TablePlan, buf: np.ndarray, cids, at, size, exc: BaseException) -> None:
    """The device failed on a group: decode its chunks (``cids``, stored at ``at`` in ``buf``, ``size``
    bytes each) on the CPU, in order, so the batch fails with the CPU path's error for the first bad chunk
    (raised from here; :class:`~stoker.errors.DeviceError` when every one decodes there)."""
    for cid, a, n in zip(cids, at, size):
        reader = plan.sources[int(plan.chunk_source[cid])]
        reader.metadata.codec.decode(bytes(buf[a:a + n]), plan.key(int(cid)))
    raise _healthy(plan, cids, exc)


def decode_fetched(plan: TablePlan, cids, path_of, exc: BaseException) -> None:
    """As :func:`decode_again`, for a group whose staging is reused already (a damaged stream found by a
    deferred check): its chunks ``cids`` fetched again through their readers (``path_of(cid)``: the file)."""
    for cid in (int(c) for c in cids):
        data = fetch(plan, cid, path_of(cid))
        if data is not None:
            plan.sources[int(plan.chunk_source[cid])].metadata.codec.decode(bytes(data), plan.key(cid))
    raise _healthy(plan, cids, exc)


def _healthy(plan: TablePlan, cids, exc: BaseException) -> DeviceError:
    """The error for a group the device failed on although the CPU decodes every chunk of it: the chunks are
    not damaged (so not a DecodeError, which would send a caller to mend good data)."""
    keys = [plan.key(int(c)) for c in cids]
    uris = sorted({plan.sources[int(plan.chunk_source[int(c)])].uri for c in cids})
    shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return DeviceError(f"the GPU decode failed on chunks {shown} of {', '.join(uris)}, which the CPU decodes: "
                       f"{exc}; Config(decode_on='cpu') reads them without it", uris=uris, keys=keys)


class Notices:
    """One ``RuntimeWarning`` per array and reason: its chunks are decoded on the CPU."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    def note(self, uri: str, why: str) -> None:
        with self._lock:
            if (uri, why) in self._seen:
                return
            self._seen.add((uri, why))
        warnings.warn(f"stoker's GPU decode: chunks of {uri} are decoded on the CPU: {why}", RuntimeWarning,
                      stacklevel=3)
