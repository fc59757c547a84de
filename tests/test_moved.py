"""The module paths before the folders by layer: each still imports, and each name in it warns and is the
object of its new place (stoker/_moved.py)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

import pytest

from stoker._moved import MOVED, MovedFinder


def _public_names(module) -> list[str]:
    """Names defined in ``module`` itself (functions and classes), not imported into it."""
    return [n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
            and v.__module__ == module.__name__]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_and_its_names_warn_and_resolve(old):
    sys.modules.pop(old, None)
    module = importlib.import_module(old)
    for target in MOVED[old]:
        new = importlib.import_module(target)
        names = _public_names(new)
        assert names, target
        for name in names[:3]:
            with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; use {target}\.{name}"):
                assert getattr(module, name) is getattr(new, name)


def test_an_old_path_has_no_file_and_unknown_names_fail():
    import stoker.sources

    for old in MOVED:  # answered by the finder, not by a file left behind
        assert isinstance(importlib.util.find_spec(old).loader, MovedFinder), old
    with pytest.raises(AttributeError, match="moved to stoker.sampling.samplers"):
        stoker.sources.NoSuchName  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("stoker.no_such_module")
