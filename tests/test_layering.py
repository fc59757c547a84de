"""Layering rules of src/stoker, checked on the source with ``ast`` (nothing is imported).

(a) No module imports another module's private name (``from .x import _y``) or a private module
    (``import stoker._x``): what is shared across modules is public and documented. The one exception is
    the compiled extension ``stoker._native``, which ``stoker.engine.native`` alone loads and wraps.
(b) No import cycle between packages. A package is a first-level subpackage of stoker (engine, records,
    train, storage, zarr, cli, bench, gpu, demo); each top-level module counts as a package of its own
    until the modules are grouped into folders by layer (as one "core" node they would form cycles with
    every subpackage that imports ``errors``). The facade ``stoker/__init__.py`` and ``__main__`` re-export
    and start everything by design and are left out. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ALLOWED_PRIVATE = {
    ("stoker.engine.native", "stoker._native"),  # the loader of the compiled extension
    ("stoker", "stoker._moved"),  # the facade installs the aliases of the old module paths
}
FACADE = {"stoker", "stoker.__main__"}


def _modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__) for every module under ``src/stoker``."""
    out = {}
    for path in sorted((src / "stoker").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _imports(name: str, path: Path, package: bool, known: set[str]) -> list[tuple[str, str, int]]:
    """``(module imported, name imported or "", line)`` for every import of stoker code in one module."""
    here = name if package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "stoker"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "stoker":
                continue
            for a in node.names:  # `from pkg import module` imports the module itself
                sub = f"{target}.{a.name}"
                found.append((sub, "", node.lineno) if sub in known else (target, a.name, node.lineno))
    return found


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(src: Path) -> list[str]:
    """Every import of a private name or module from another module, as ``"module:line imports what"``."""
    mods = _modules(src)
    known = set(mods) | {"stoker._native"}
    bad = []
    for name, (path, package) in mods.items():
        for target, what, line in _imports(name, path, package, known):
            if (name, target) in ALLOWED_PRIVATE or target == name:
                continue
            if _private(what) or any(_private(p) for p in target.split(".")):
                bad.append(f"{name}:{line} imports {target}{'.' + what if what else ''}")
    return bad


def _node(module: str) -> str | None:
    """The package a module belongs to for the cycle check (None: the facade, left out)."""
    if module in FACADE:
        return None
    return module.split(".")[1]


def package_cycles(src: Path) -> list[list[str]]:
    """Strongly connected groups of more than one package in the import graph, each with the imports
    that close it (``"a -> b (module:line)"``)."""
    mods = _modules(src)
    known = set(mods)
    edges: dict[str, dict[str, str]] = {}
    for name, (path, package) in mods.items():
        a = _node(name)
        if a is None:
            continue
        for target, _, line in _imports(name, path, package, known):
            b = _node(target)
            if b is not None and b != a and not b.startswith("_"):
                edges.setdefault(a, {}).setdefault(b, f"{name}:{line}")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(f"{x} -> {y} ({where})" for x in group for y, where in edges.get(x, {}).items()
                                     if y in group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_private_names_imported_across_modules():
    assert private_imports(SRC) == []


def test_no_import_cycles_between_packages():
    assert package_cycles(SRC) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """A planted private import and a planted cycle are reported (the two tests above can fail)."""
    pkg = tmp_path / "stoker"
    for folder in ("", "engine", "records"):
        (pkg / folder).mkdir(exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "distributed.py").write_text("from .engine.stats import Stats\n\ndef _hidden():\n    pass\n")
    (pkg / "engine" / "stats.py").write_text("class Stats:\n    pass\n")
    (pkg / "engine" / "device.py").write_text("def f():\n    from ..distributed import _hidden\n")
    (pkg / "records" / "stats.py").write_text("from ..engine import stats\nfrom . import loader\n")
    (pkg / "records" / "loader.py").write_text("import stoker.records.stats\n")
    assert private_imports(tmp_path) == ["stoker.engine.device:2 imports stoker.distributed._hidden"]
    assert package_cycles(tmp_path) == [["distributed -> engine (stoker.distributed:1)",
                                         "engine -> distributed (stoker.engine.device:2)"]]
