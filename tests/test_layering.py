"""Layering rules of src/stoker, checked on the source with ``ast`` (nothing is imported).

(a) No module imports another module's private name (``from .x import _y``) or a private module
    (``import stoker._x``): what is shared across modules is public and documented. The one exception is
    the compiled extension ``stoker._native``, which ``stoker.engine.cpu.native`` alone loads and wraps. Nor
    are other libraries' private names or modules imported (``from multiprocessing import _x``).
(a') Nor reaches one by attribute: ``mod._name`` on anything an import statement bound (a module of
    stoker, the standard library's or a dependency's, or a class imported from one), and ``obj._name`` where
    ``_name`` is an attribute or method of a class of another stoker module and never one of this module's
    (by name: ``self._x = ...`` or a class body's ``_x``/``def _x``). Dunder names are public. A library's
    private name is reached only where it has no public one, each listed in ``ALLOWED_ATTRS`` with why.
(b) No import cycle between two modules: every module of the package, its facade and the packages'
    ``__init__`` included, imports inside functions included.
(c) No import cycle between packages. A package is a first-level subpackage of stoker (engine, records,
    train, storage, zarr, cli, bench, gpu, demo); each top-level module counts as a package of its own
    until the modules are grouped into folders by layer (as one "core" node they would form cycles with
    every subpackage that imports ``errors``). The facade ``stoker/__init__.py`` and ``__main__`` re-export
    and start everything by design and are left out. Imports inside functions count too.
(d) The layer diagram in docs/architecture.md is the import graph's: each package on one row, importing
    only packages on lower rows.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ALLOWED_PRIVATE = {
    ("stoker.engine.cpu.native", "stoker._native"),  # the loader of the compiled extension
}
#: Private names of other libraries reached on purpose, each for want of a public one (module, attribute).
ALLOWED_ATTRS = {
    ("os", "_exit"),  # public despite its name: leave without the interpreter's teardown
    ("torch.cuda", "_is_in_bad_fork"),  # device/resolve: no public "was this process forked after CUDA"
    ("torch", "_C"),  # engine/buffers: a storage's use count (getattr with a fallback); no public one
    ("dist.distributed_c10d", "_get_default_store"),  # train/launch: the group's store for the heartbeat
    # train/launch: a spawned rank runs every atexit handler, then leaves with os._exit (gloo's threads can
    # abort the interpreter's teardown); CPython has no public way to run the handlers without the teardown
    ("atexit", "_run_exitfuncs"),
}
FACADE = {"stoker", "stoker.__main__"}
NATIVE = "stoker._native"  # the compiled extension: a module with no source here


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


def _place(finding: str) -> tuple[str, int]:
    """``"module:line ..."`` -> (module, line), to list findings in the order of the source."""
    module, _, line = finding.split(" ")[0].partition(":")
    return module, int(line)


def private_imports(src: Path) -> list[str]:
    """Every import of a private name or module from another module, as ``"module:line imports what"``."""
    mods = _modules(src)
    known = set(mods) | {NATIVE}
    bad = []
    for name, (path, package) in mods.items():
        for target, what, line in _imports(name, path, package, known):
            if (name, target) in ALLOWED_PRIVATE or target == name:
                continue
            if _private(what) or any(_private(p) for p in target.split(".")):
                bad.append(f"{name}:{line} imports {target}{'.' + what if what else ''}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # other libraries' private names
            if isinstance(node, ast.Import):
                found = [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found = [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            bad += [f"{name}:{line} imports {what}" for line, what in found
                    if what.split(".")[0] != "stoker" and any(_private(p) for p in what.split("."))]
    return sorted(bad, key=_place)


def _bound_by_imports(tree: ast.AST, here: str) -> dict[str, str]:
    """Every name an import statement binds in a module (any scope) -> what it names (``"os"``,
    ``"torch.cuda"``, ``"stoker.engine.cpu.executor.CpuExecutor"``)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                bound[a.asname or a.name] = f"{module}.{a.name}"
    return bound


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private attribute names a module gives its objects: methods and class attributes of its classes
    (``def _x``, ``_x = ...``, ``__slots__``) and attributes it sets on ``self`` or ``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                targets = (item.targets if isinstance(item, ast.Assign)
                           else [item.target] if isinstance(item, ast.AnnAssign) else [])
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        names.update(c.value for c in ast.walk(item.value)  # type: ignore[union-attr]
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def private_attributes(src: Path) -> list[str]:
    """Every reach into another module's private name by attribute, as ``"module:line reaches what"``:
    ``mod._x`` (or ``mod.sub._x``) on a name an import bound, and ``obj._x`` where ``_x`` belongs to the
    classes of other stoker modules only (name-based: ``_x`` is never one of this module's own)."""
    mods = _modules(src)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in mods.items()}
    own = {name: _own_private_names(tree) for name, tree in trees.items()}
    bad = []
    for name, tree in trees.items():
        bound = _bound_by_imports(tree, name if mods[name][1] else name.rpartition(".")[0])
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            base, chain = node.value, []
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                if (".".join([base.id, *chain]), node.attr) not in ALLOWED_ATTRS:
                    bad.append(f"{name}:{node.lineno} reaches {ast.unparse(node)} ({bound[base.id]})")
                continue
            if node.attr in own[name]:
                continue
            owners = sorted(m for m, names in own.items() if node.attr in names and m != name)
            if owners:
                bad.append(f"{name}:{node.lineno} reaches {ast.unparse(node)} (of {', '.join(owners)})")
    return sorted(bad, key=_place)


def import_graph(src: Path) -> dict[str, dict[str, str]]:
    """Module -> {module it imports: "module:line" of the first such import}, over every module of the
    package (facade and ``__init__`` modules included; ``from pkg import mod`` is an import of ``mod``)."""
    mods = _modules(src)
    known = set(mods)
    edges: dict[str, dict[str, str]] = {}
    for name, (path, package) in mods.items():
        for target, _, line in _imports(name, path, package, known | {NATIVE}):
            if target in known and target != name:
                edges.setdefault(name, {}).setdefault(target, f"{name}:{line}")
    return edges


def _cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node, each as the edges that close it
    (``"a -> b (module:line)"``)."""
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


def module_cycles(src: Path) -> list[list[str]]:
    """Import cycles between modules (see :func:`import_graph`)."""
    return _cycles(import_graph(src))


def _node(module: str) -> str | None:
    """The package a module belongs to for the cycle check (None: the facade, left out)."""
    if module in FACADE:
        return None
    return module.split(".")[1]


def package_cycles(src: Path) -> list[list[str]]:
    """Strongly connected groups of more than one package in the import graph, each with the imports
    that close it (``"a -> b (module:line)"``)."""
    return _cycles(package_edges(src))


def package_edges(src: Path) -> dict[str, dict[str, str]]:
    """Package -> {package it imports: "module:line" of the first such import} (see :func:`_node`)."""
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
    return edges


def diagram_rows(doc: Path) -> dict[str, int]:
    """Package -> row of the layer diagram in docs/architecture.md (the first code block of "## Layers",
    lines ``" 9  cli   description"``: row, then the packages separated by commas)."""
    text = doc.read_text().split("## Layers", 1)[1].split("```", 2)[1]
    rows = {}
    for line in text.strip().splitlines():
        row, _, rest = line.strip().partition("  ")
        for package in rest.strip().split("  ")[0].split(","):
            rows[package.strip()] = int(row)
    return rows


def diagram_violations(src: Path, doc: Path) -> list[str]:
    """Imports that go up or sideways in the diagram, and packages missing from it or drawn there in vain."""
    rows = diagram_rows(doc)
    edges = package_edges(src)
    packages = {_node(m) for m in _modules(src)} - {None}
    bad = [f"{p} is not in the diagram" for p in sorted(packages - set(rows))]
    bad += [f"{p} is in the diagram but not in src/stoker" for p in sorted(set(rows) - packages)]
    for a, targets in sorted(edges.items()):
        for b, where in sorted(targets.items()):
            if a in rows and b in rows and rows[b] >= rows[a]:
                bad.append(f"{a} (row {rows[a]}) imports {b} (row {rows[b]}) at {where}")
    return bad


def test_no_private_names_imported_across_modules():
    assert private_imports(SRC) == []


def test_no_private_names_reached_by_attribute():
    assert private_attributes(SRC) == []


def test_no_import_cycles_between_modules():
    assert module_cycles(SRC) == []


def test_no_import_cycles_between_packages():
    assert package_cycles(SRC) == []


def test_the_layer_diagram_is_drawn_from_the_imports():
    """docs/architecture.md's diagram: every package on one row, importing only rows below it."""
    assert diagram_violations(SRC, SRC.parent / "docs" / "architecture.md") == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """Planted private imports, reaches and cycles are reported (the tests above can fail)."""
    pkg = tmp_path / "stoker"
    for folder in ("", "engine", "records"):
        (pkg / folder).mkdir(exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "distributed.py").write_text("from .engine.stats import Stats\n\ndef _hidden():\n    pass\n")
    (pkg / "engine" / "stats.py").write_text(
        "class Stats:\n    _kind = 1\n    __slots__ = ('_held',)\n\n    def _merge(self):\n        self._count = 0\n"
        "        return self._kind, self._held, self.__class__\n")
    (pkg / "engine" / "device.py").write_text(
        "import os\nimport sys\nfrom multiprocessing import _private\n\ndef f(s):\n"
        "    from ..distributed import _hidden\n    os._exit(0)\n    sys._getframe(0)\n    s._merge()\n")
    (pkg / "records" / "stats.py").write_text(
        "from ..engine import stats\nfrom . import loader\n\n\nclass Own:\n    def _merge(self, s):\n"
        "        stats._helper, s._kind, s._held\n        return s._merge(), self._count\n")
    (pkg / "records" / "loader.py").write_text("import stoker.records.stats as st\n\ndef f():\n    st.Own()._count\n")
    assert private_imports(tmp_path) == ["stoker.engine.device:3 imports multiprocessing._private",
                                         "stoker.engine.device:6 imports stoker.distributed._hidden"]
    # os._exit is allowed; s._merge in records.stats is that module's own name (it defines a _merge too)
    assert private_attributes(tmp_path) == [
        "stoker.engine.device:8 reaches sys._getframe (sys)",
        "stoker.engine.device:9 reaches s._merge (of stoker.engine.stats, stoker.records.stats)",
        "stoker.records.loader:4 reaches st.Own()._count (of stoker.engine.stats)",
        "stoker.records.stats:7 reaches stats._helper (stoker.engine.stats)",
        "stoker.records.stats:7 reaches s._kind (of stoker.engine.stats)",
        "stoker.records.stats:7 reaches s._held (of stoker.engine.stats)",
        "stoker.records.stats:8 reaches self._count (of stoker.engine.stats)",
    ]
    doc = tmp_path / "architecture.md"
    doc.write_text("# x\n\n## Layers\n\n```\n 2  records         text\n 1  engine, distributed   text\n```\n")
    assert diagram_violations(tmp_path, doc) == [
        "distributed (row 1) imports engine (row 1) at stoker.distributed:1",
        "engine (row 1) imports distributed (row 1) at stoker.engine.device:6"]
    assert module_cycles(tmp_path) == [["stoker.records.loader -> stoker.records.stats (stoker.records.loader:1)",
                                        "stoker.records.stats -> stoker.records.loader (stoker.records.stats:2)"]]
    assert package_cycles(tmp_path) == [["distributed -> engine (stoker.distributed:1)",
                                         "engine -> distributed (stoker.engine.device:6)"]]
