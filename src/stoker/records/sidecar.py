"""The statistics sidecar: ``root/.stoker-stats.json``, entries keyed by a fingerprint.

The fingerprint hashes what the statistics depend on and metadata can tell:
the field names, every record's name with those fields' shapes (as read, after
``time_slice``) and dtypes, ``per_channel``, the derived names and the
non-finite policy; it is the same on every rank, so ranks compare it (node-local
copies of a dataset included). Each entry also holds ``files``, a digest of the
size and modification time of every file of the fields it covers
(:func:`stoker.records.identity.dataset_digest`): an entry of other files (values
rewritten at the same shapes) is not used. Neither sees a derived function whose
code changed under the same name: delete the file (or pass ``cache=False``) then.

Writes are atomic (a fresh temporary file in the same directory, then ``os.replace``),
so a reader sees the old file or the new one, never half of one. A write reads, changes
and replaces the file under its claim (:func:`stoker.storage.fsutil.claim`), so processes adding
entries of different fingerprints at once keep each other's; :func:`claim_computation`
lets one of several jobs compute an entry while the others wait for it::

    >>> fp = fingerprint(ds, ["positions"], per_channel=True, derived=["edge"])
    >>> entry = load(ds.root, fp)            # None when absent, unreadable or stale
    >>> write(ds.root, fp, {"stats": {...}})
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from ..storage.fsutil import Claim, claim, replace_atomically
from ..storage import read_regular

FILENAME = ".stoker-stats.json"
FORMAT = "stoker-record-stats"
VERSION = 2  # 2: means merged exactly (Moments.mean_lo); version 1 stds could be a percent off
MAX_ENTRIES = 16  # older fingerprints are dropped first; each entry is a few numbers per channel


def path_for(root: str) -> str:
    return os.path.join(root, FILENAME)


def fingerprint(ds: Any, fields: Sequence[str], per_channel: bool, derived: Sequence[str],
                nonfinite: str = "raise") -> str:
    """Hex digest identifying the statistics ``compute_stats`` would produce for ``ds``.

    Covers the full dataset (not a rank's shard), so every rank and every world
    size agree. With derived quantities, every field of ``ds`` is covered, since a
    derived function sees them all. The non-finite policy is part of it: statistics
    that skipped NaNs never stand in for ones that would have refused them.
    """
    covered = list(ds.fields) if derived else list(fields)
    h = hashlib.sha256()
    head = {"format": FORMAT, "version": VERSION, "fields": list(fields), "per_channel": bool(per_channel),
            "derived": sorted(derived), "covered": covered, "records": ds.base_size, "nonfinite": nonfinite}
    h.update(json.dumps(head, sort_keys=True).encode())
    h.update(json.dumps(ds.base_names()).encode())
    for name in covered:
        h.update(name.encode() + b"\0")
        h.update(ds.base_shapes(name).tobytes())
        h.update(",".join(d.str for d in ds.base_dtypes(name)).encode())
    return h.hexdigest()


def _read_doc(root: str) -> dict | None:
    try:  # a regular file only: a FIFO there would block forever (StorageError, an OSError, instead)
        raw = read_regular(path_for(root))
        if raw is None:
            return None
        doc = json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        warnings.warn(f"ignoring unreadable statistics file {path_for(root)}: {exc}", RuntimeWarning, stacklevel=3)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
        return None
    return doc


def load(root: str, fp: str, files: str | None = None) -> dict | None:
    """The entry stored under fingerprint ``fp``, or None; with ``files`` (what the records store now, see
    :func:`stoker.records.identity.dataset_digest`), None too when the entry was computed from other files."""
    doc = _read_doc(root)
    if doc is None or doc.get("version") != VERSION:
        return None
    entry = doc["entries"].get(fp)
    if not isinstance(entry, dict) or (files is not None and entry.get("files") != files):
        return None
    return entry


def claim_computation(root: str, fp: str, files: str | None = None) -> Claim | None:
    """Claim computing the entry ``fp`` (of ``files``, see :func:`load`) of ``root``: the claim, or None once
    another process wrote the entry (this waits for it; see :func:`stoker.storage.fsutil.claim`). ``OSError``
    where ``root`` cannot be written."""
    return claim(Path(path_for(root) + f".{fp[:16]}"), until=lambda: load(root, fp, files) is not None)


def write(root: str, fp: str, entry: dict) -> str:
    """Add (or replace) the entry for ``fp``, atomically; returns the file's path.

    Other entries are kept (up to :data:`MAX_ENTRIES`), so switching between two
    field lists does not recompute each time.
    """
    target = path_for(root)
    with claim(Path(target)):  # read, change, replace: no other writer's entry is lost in between
        doc = _read_doc(root)
        if doc is None or doc.get("version") != VERSION:
            doc = {"format": FORMAT, "version": VERSION, "entries": {}}
        entries = doc["entries"]
        entries.pop(fp, None)
        entries[fp] = entry  # newest last
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        # Python's float repr round-trips float64 exactly, so loaded stats equal computed ones.
        replace_atomically(Path(target), lambda f: f.write(json.dumps(doc, indent=1).encode()))
    return target
