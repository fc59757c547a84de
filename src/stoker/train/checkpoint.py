"""Atomic, rotating, hashed checkpoint files: a crash never leaves a half-written "newest" checkpoint, and a
damaged one is never loaded.

>>> ckpts = Checkpoints("runs/exp1/checkpoints", every=100, keep=3)
>>> ckpts.save({"model": model.state_dict(), ...}, step=100)   # one writer (Trainer: rank 0)
>>> path = ckpts.latest()                                        # newest one that loads, or None
>>> state = ckpts.load(path)

A checkpoint is written to a fresh temporary name in the same directory (see
:mod:`stoker.storage.fsutil`), flushed and fsynced, then renamed to ``step-000000100.pt``
(a rename within a directory is atomic), and the directory is fsynced. Only files
with final names count, so a run killed mid-write leaves at worst a temporary
file, which the next ``cleanup()`` removes. After a successful save, the oldest
checkpoints beyond ``keep`` are deleted. A step's checkpoint is written once: processes
saving the same step into one directory at the same moment (two jobs, two nodes) take
turns through a claim (:func:`stoker.storage.fsutil.write_file_once`), and an intact file of the
step is kept rather than written again.

The file is a fixed header (magic, payload length, SHA-256 of the payload) then the
``torch.save`` payload. Loading checks the length and the hash *before* unpickling,
then the fields (format, version, a step that is an integer >= 0 and the one in the
file's name, the keys the caller requires): a file failing any check is damaged, and
``load_latest`` skips it for the previous good one. Version-1 files (before the
header; no hash) are still read. The hash catches damage, not malice: whoever can
write the directory can write a checkpoint that runs code when unpickled.

:class:`~stoker.train.Trainer` decides what goes in, who writes (rank 0), and puts a
barrier after each save so no rank runs ahead of a checkpoint that is not there yet.
"""

from __future__ import annotations

import hashlib
import os
import stat
import re
import struct
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import torch

from ..checks import integer
from ..errors import CheckpointError
from ..storage.fsutil import remove_dead_temp_files, write_file_once
from ..storage import open_regular

__all__ = ["Checkpoints", "FORMAT", "VERSION"]

FORMAT = "stoker-checkpoint"
VERSION = 2  # 2: the hashed header; 1: a bare torch.save zip (read, unverified)
_NAME = re.compile(r"^step-(\d{9,})\.pt$")
_MAGIC = b"\x89stoker-ckpt\r\n\x1a\n"  # PNG-style: not text, not a zip's "PK"
_HEADER = struct.Struct("<16sQ32s")  # magic, payload length, SHA-256 of the payload
_ZIP = b"PK\x03\x04"  # a bare torch.save file: version 1

Required = Mapping[str, "type | tuple[type, ...]"]


class _Hashing:
    """A write-only file that hashes and counts what passes through (all ``torch.save`` needs)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.size += len(memoryview(b).cast("B"))
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _dump(obj: Any, f: BinaryIO) -> None:
    """Header, then ``torch.save(obj)``; the header is filled in once the payload's hash is known."""
    f.write(bytes(_HEADER.size))
    payload = _Hashing(f)
    torch.save(obj, payload)
    f.seek(0)
    f.write(_HEADER.pack(_MAGIC, payload.size, payload.sha.digest()))
    f.seek(0, os.SEEK_END)


def _read(path: Path) -> tuple[Any, int]:
    """Unpickle a checkpoint file after checking its hash; ``(object, container version)``."""
    opened = open_regular(path)  # a regular file only: a FIFO there would block forever
    if opened is None:
        raise FileNotFoundError(f"no file at {path}")
    with os.fdopen(opened[0], "rb") as f:
        head = f.read(_HEADER.size)
        if head.startswith(_ZIP):
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=False), 1
        _check_payload(f, head, path)
        f.seek(_HEADER.size)  # torch reads the zip relative to where the file stands
        # Our own files hold RNG states and optimizer internals, which need full unpickling.
        return torch.load(f, map_location="cpu", weights_only=False), VERSION


def _intact(path: Path) -> bool:
    """Whether ``path`` is a checkpoint file of this version whose payload matches its hash (nothing unpickled)."""
    try:
        # Not through a symlink at the step's name: whatever it points to, it is replaced, never kept;
        # and non-blocking: a FIFO planted there is not a checkpoint, and must not stall the writer.
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            _check_payload(f, f.read(_HEADER.size), path)
    except OSError:  # CheckpointError included
        return False
    return True


def _check_payload(f: BinaryIO, head: bytes, path: Path) -> None:
    """CheckpointError unless ``head`` is our header and the rest of ``f`` has its length and SHA-256."""
    if len(head) < _HEADER.size or not head.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not a stoker checkpoint", path=str(path))
    _, length, digest = _HEADER.unpack(head)
    actual = os.fstat(f.fileno()).st_size - _HEADER.size
    if actual != length:
        raise CheckpointError(f"checkpoint {path} is damaged: {actual} bytes of payload, its header says "
                              f"{length} (truncated or appended to)", path=str(path))
    sha = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        sha.update(block)
    if sha.digest() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged: its content does not match its SHA-256",
                              path=str(path))


def _type_names(t: Any) -> str:
    return " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))


def _check(state: Any, path: Path, container: int, require: Required) -> None:
    """CheckpointError unless ``state`` is a complete stoker checkpoint for ``path``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a stoker checkpoint", path=str(path))
    version = state.get("version")
    if version not in (1, VERSION):
        raise CheckpointError(f"{path} has checkpoint version {version!r}; this stoker reads versions 1 to "
                              f"{VERSION}", path=str(path))
    if version != container:  # e.g. a version-2 payload without its header: nothing vouches for it
        raise CheckpointError(f"checkpoint {path} is damaged: it says version {version} but is laid out as "
                              f"version {container}", path=str(path))
    step = state.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"checkpoint {path} is damaged: its step is {step!r}, not an integer >= 0",
                              path=str(path))
    m = _NAME.match(path.name)
    if m is not None and int(m.group(1)) != step:
        raise CheckpointError(f"checkpoint {path} is damaged: it holds step {step}, its name says "
                              f"{int(m.group(1))}", path=str(path))
    missing = [k for k in require if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(map(repr, missing))}; it was not written by "
                              "this kind of run, or is damaged", path=str(path), missing=missing)
    wrong = [f"{k!r} is {type(state[k]).__name__}, not {_type_names(t)}" for k, t in require.items()
             if not isinstance(state[k], t)]
    if wrong:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(wrong)}", path=str(path))


class Checkpoints:
    """Numbered checkpoint files in ``directory``: save atomically every ``every`` steps, keep the last ``keep``.

    ``every=None`` saves only when asked (and at the end of ``Trainer.fit``).
    """

    def __init__(self, directory: str | os.PathLike, every: int | None = 100, keep: int = 3) -> None:
        every = integer("every", every, 1, optional=True)
        keep = integer("keep", keep, 1)
        self.directory = Path(directory)
        self.every = every
        self.keep = keep

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, every={self.every}, keep={self.keep})"

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}.pt"

    def due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every``."""
        return self.every is not None and step > 0 and step % self.every == 0

    def list(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            m = _NAME.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def cleanup(self) -> list[Path]:
        """Remove temporary files left by writers that died mid-save; returns what was removed.

        Only regular files named as temporary files, whose writer process is gone, are removed
        (never a symlink, a directory or another file). Trainer calls it on rank 0 before training.
        """
        return remove_dead_temp_files(self.directory)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (atomically), then drop the oldest beyond ``keep``.

        A checkpoint of ``step`` is written once: where an intact one is there already, or another process
        sharing the directory (a second job, a node that also thinks it is rank 0) writes it at the same
        moment, that one is kept and ``state`` is not written (see :func:`stoker.storage.fsutil.write_file_once`).
        """
        step = integer("step", step, 0)
        final = self.path_for(step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_file_once(final, lambda f: _dump({"format": FORMAT, "version": VERSION, "step": step, **state}, f),
                            is_complete=_intact)
        except Exception as exc:  # noqa: BLE001 - a full disk surfaces from torch.save as RuntimeError
            raise CheckpointError(f"cannot write checkpoint {final}: {type(exc).__name__}: {exc}",
                                  path=str(final)) from exc
        # Drop the oldest beyond `keep`, never the one just written (Trainer refuses to run beside
        # checkpoints of later steps, so "oldest" and "lowest step" agree).
        older = [p for s, p in self.list() if s < step]
        for old in older[: max(0, len(older) - (self.keep - 1))]:
            old.unlink(missing_ok=True)
        return final

    def load(self, path: str | os.PathLike, require: Required | None = None) -> dict[str, Any]:
        """Read one checkpoint onto the CPU; CheckpointError when it is not a complete, intact stoker checkpoint.

        ``require`` maps keys the state must hold to their types (e.g. ``{"model": dict}``).
        """
        path = Path(path)
        try:
            state, container = _read(path)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle, I/O: all mean "unusable"
            raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})",
                                  path=str(path)) from exc
        _check(state, path, container, require or {})
        return state

    def load_latest(self, require: Required | None = None) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads, as ``(path, state)``; older ones are tried when newer ones are damaged.

        ``require`` as for :meth:`load`. None when there is none. Raises CheckpointError
        when checkpoints exist but none loads, rather than silently training from scratch over them.
        """
        bad = []
        for _, path in reversed(self.list()):
            try:
                return path, self.load(path, require)
            except CheckpointError as exc:
                bad.append(str(exc))
                warnings.warn(f"skipping damaged checkpoint: {exc}", RuntimeWarning, stacklevel=2)
        if bad:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be read ({len(bad)} damaged); move them away to start "
                f"afresh. First problem: {bad[0]}", path=str(self.directory))
        return None

    def latest(self) -> Path | None:
        """The path of :meth:`load_latest`'s checkpoint, or None."""
        found = self.load_latest()
        return found[0] if found else None
