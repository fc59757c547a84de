"""The module paths stoker had before its folders by layer, kept as aliases that warn.

``import stoker.sources`` (now :mod:`stoker.sampling.samplers`) still works: a finder at the end of
``sys.meta_path`` answers for each old path with a module whose attributes are looked up in the new
module(s) and warn once per name with a ``DeprecationWarning`` naming the new place. A module that was
split (``stoker.distributed``, ``stoker.pin``) looks in each of its parts.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

#: old module -> the module(s) its names live in now
MOVED: dict[str, tuple[str, ...]] = {
    "stoker.sample": ("stoker.sampling.sample",),
    "stoker.sources": ("stoker.sampling.samplers",),
    "stoker.partition": ("stoker.sampling.partition",),
    "stoker.shard": ("stoker.sampling.partition",),
    "stoker.permutation": ("stoker.sampling.permutation",),
    "stoker.cursor": ("stoker.sampling.cursor",),
    "stoker.distributed": ("stoker.dist.collectives", "stoker.dist.reduce", "stoker.engine.reduce"),
    "stoker.telemetry": ("stoker.dist.telemetry",),
    "stoker.pin": ("stoker.device.pin", "stoker.device.prefetch"),
    "stoker.engine.device": ("stoker.device.resolve",),
    "stoker.array": ("stoker.reader.array",),
    "stoker.box": ("stoker.zarr.box",),
    "stoker.amplification": ("stoker.zarr.amplification",),
    "stoker.cache": ("stoker.storage.cache",),
    "stoker.fsutil": ("stoker.storage.fsutil",),
    "stoker.gil": ("stoker.runtime.gil",),
    "stoker.workers": ("stoker.runtime.workers",),
    "stoker.native": ("stoker.engine.native",),
    "stoker.dataset": ("stoker.train.dataset",),
    "stoker.plots": ("stoker.cli.plots",),
    "stoker.zarr.bounded": ("stoker.zarr.codecs.bounds",),
    "stoker.zarr.blosc_partial": ("stoker.zarr.codecs.blosc",),
}


class MovedModule(types.ModuleType):
    """An old module path: each attribute is found in the new module(s), with a DeprecationWarning."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Deprecated: moved to {', '.join(targets)}.")
        self.__targets = targets

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                warnings.warn(f"{self.__name__} is deprecated; use {target}.{attr}", DeprecationWarning,
                              stacklevel=2)
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self.__targets)}) has no "
                             f"attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self.__targets for n in dir(importlib.import_module(t)) if not n.startswith("_")})


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for the old paths in :data:`MOVED` (asked last: a real module of that name would win)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return MovedModule(spec.name, MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the names are looked up on use."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
