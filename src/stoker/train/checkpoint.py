"""Atomic, rotating checkpoint files: a crash never leaves a half-written "newest" checkpoint.

>>> ckpts = Checkpoints("runs/exp1/checkpoints", every=100, keep=3)
>>> ckpts.save({"model": model.state_dict(), ...}, step=100)   # one writer (Trainer: rank 0)
>>> path = ckpts.latest()                                        # newest one that loads, or None
>>> state = ckpts.load(path)

A checkpoint is written to a temporary name in the same directory, flushed and
fsynced, then renamed to ``step-000000100.pt`` (a rename within a directory is
atomic), and the directory is fsynced. Only files with final names count, so a
run killed mid-write leaves at worst a temporary file, which the next
``cleanup()`` removes. After a successful save, the oldest checkpoints beyond
``keep`` are deleted.

:class:`~stoker.train.Trainer` decides what goes in, who writes (rank 0), and puts a
barrier after each save so no rank runs ahead of a checkpoint that is not there yet.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checks import integer
from ..errors import CheckpointError
from ..fsutil import is_temp_path, replace_atomically
from ..storage import open_regular

__all__ = ["Checkpoints", "FORMAT", "VERSION"]

FORMAT = "stoker-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{9,})\.pt$")




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

        Call it only while no save is in progress (Trainer does, on rank 0, before training).
        """
        removed = []
        if self.directory.is_dir():
            for entry in self.directory.iterdir():
                if is_temp_path(entry):
                    entry.unlink(missing_ok=True)
                    removed.append(entry)
        return removed

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (atomically), then drop the oldest beyond ``keep``."""
        step = integer("step", step, 0)
        final = self.path_for(step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            replace_atomically(final, lambda f: torch.save({"format": FORMAT, "version": VERSION, "step": step,
                                                            **state}, f))
        except Exception as exc:  # noqa: BLE001 - a full disk surfaces from torch.save as RuntimeError
            raise CheckpointError(f"cannot write checkpoint {final}: {type(exc).__name__}: {exc}",
                                  path=str(final)) from exc
        # Drop the oldest beyond `keep`, never the one just written (Trainer refuses to run beside
        # checkpoints of later steps, so "oldest" and "lowest step" agree).
        older = [p for s, p in self.list() if s < step]
        for old in older[: max(0, len(older) - (self.keep - 1))]:
            old.unlink(missing_ok=True)
        return final

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Read one checkpoint onto the CPU; CheckpointError when it is not a complete stoker checkpoint."""
        path = Path(path)
        try:
            opened = open_regular(path)  # a regular file only: a FIFO there would block forever
            if opened is None:
                raise FileNotFoundError(f"no file at {path}")
            with os.fdopen(opened[0], "rb") as f:
                # Our own files hold RNG states and optimizer internals, which need full unpickling.
                state = torch.load(f, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle, I/O: all mean "unusable"
            raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})",
                                  path=str(path)) from exc
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a stoker checkpoint", path=str(path))
        if state.get("version") != VERSION:
            raise CheckpointError(f"{path} has checkpoint version {state.get('version')}; this stoker reads "
                                  f"version {VERSION}", path=str(path))
        return state

    def load_latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads, as ``(path, state)``; older ones are tried when newer ones are damaged.

        None when there is none. Raises CheckpointError when checkpoints exist but none
        loads, rather than silently training from scratch over them.
        """
        bad = []
        for _, path in reversed(self.list()):
            try:
                return path, self.load(path)
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
