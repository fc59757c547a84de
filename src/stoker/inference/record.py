"""The completion record of a TileWriter: one small JSON file per written region, beside the array.

``<array>.tiles-done/<i>_<j>_<k>.json`` is written after the region's chunks, through an atomic rename for
local arrays (one PUT of the whole object on an object store, :mod:`.target`), so a job killed mid-way and
restarted skips exactly the regions that were written whole. The marks are not fsynced one by one (an fsync per region cost more than the region's
write, and zarr-python does not fsync the chunks they vouch for); :meth:`CompletionRecord.sync` flushes the
folder once, at the writer's close. ``writer.json`` there holds the settings the record is valid for.

>>> rec = CompletionRecord("/out/pred.zarr")
>>> rec.mark((0, 1, 2))
>>> (0, 1, 2) in rec.done()
True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..storage.fsutil import fsync_dir, replace_atomically, sibling_path
from .target import is_remote, remote_store

SUFFIX = ".tiles-done"


class CompletionRecord:
    """Which regions of the array at ``uri`` are written (see the module docstring)."""

    def __init__(self, uri: str, storage_options: dict | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.remote = is_remote(self.uri)
        path = self.uri[len("file://"):] if self.uri.startswith("file://") else self.uri
        self.path = path + SUFFIX
        self._store: Any = None
        if self.remote:  # the record's folder as a store of its own: keys are the marks' names
            self._store = remote_store(self.path, storage_options)
        else:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, blob: bytes, durable: bool = True) -> None:
        if self.remote:
            self._store.put(name, blob)
        elif durable:
            replace_atomically(Path(self.path) / name, lambda f: f.write(blob))
        else:  # atomic (a reader sees the whole mark or none), flushed later by sync()
            final = Path(self.path) / name
            tmp = sibling_path(final, "tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def sync(self) -> None:
        """Make the marks written so far durable (one fsync of the record's folder)."""
        if not self.remote:
            fsync_dir(self.path)

    def _read(self, name: str) -> bytes | None:
        try:
            if self.remote:
                return bytes(self._store.get(name))
            return (Path(self.path) / name).read_bytes()
        except FileNotFoundError:
            return None

    def check_settings(self, settings: dict) -> None:
        """Start the record for ``settings``, or check that those it was started with are the same."""
        blob = self._read("writer.json")
        if blob is None:
            self._write("writer.json", json.dumps(settings, sort_keys=True).encode())
            return
        saved = json.loads(blob)
        if saved != json.loads(json.dumps(settings)):
            raise InvalidArgument(
                f"{self.uri}: the completion record {self.path} was written by a TileWriter with other settings "
                f"({saved}, now {settings}); regions it marks done would not match. Use the same settings, or "
                "remove the array and its record to start over", uri=self.uri)

    def mark(self, index: tuple[int, ...]) -> None:
        """Record region ``index`` as written (after its chunks are)."""
        name = "_".join(map(str, index)) + ".json"
        self._write(name, json.dumps({"region": list(index)}).encode(), durable=False)

    def done(self) -> set[tuple[int, ...]]:
        """The regions recorded as written."""
        if self.remote:
            names = self._store.list()  # an empty folder lists no keys (object stores have no folders)
        else:
            names = os.listdir(self.path)
        out = set()
        for name in names:
            stem, ext = os.path.splitext(name)
            if ext == ".json" and stem != "writer" and all(p.isdigit() for p in stem.split("_")):
                out.add(tuple(int(p) for p in stem.split("_")))
        return out
