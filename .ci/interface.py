#!/usr/bin/env python3
"""Writes src/stoker/engine/cpu/interface.py and src/stoker/csrc/interface_names.h from the compiled engine's
header, src/stoker/csrc/stoker_native.h: its enums and #defines (statuses, codecs, element kinds, the plan
tables' columns) are the interface's one source. The Python side takes them by name from the module written
here; the extension exports the same names (interface_names.h lists them for module.c) with the values it
was compiled with.

    .ci/interface.py          (make interface) write both again after changing the header
    .ci/interface.py --check  exit 1 when either is not what the header says (tests/engine/test_interface.py)

A constant is an enum member (counted on from the one before it, as C does) or a #define of an integer
expression; a function-like #define of one parameter (a column that depends on the rank D) becomes a
function of D. Anything else in the header (types, declarations) is not part of the interface.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "src/stoker/csrc/stoker_native.h"
MODULE = REPO / "src/stoker/engine/cpu/interface.py"
NAMES = REPO / "src/stoker/csrc/interface_names.h"

_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def _value(expr: str, known: dict[str, int]) -> int:
    """An integer expression of literals and constants already defined (C's integer syntax: no suffixes)."""
    expr = expr.strip()
    if not re.fullmatch(r"[A-Za-z0-9_+\-*()<>|& x]+", expr):
        raise ValueError(f"not an integer constant expression: {expr!r}")
    return int(eval(expr, {"__builtins__": {}}, dict(known)))  # the repository's own header


def parse(text: str) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
    """``(constants, functions)`` of a header: name -> value, and name -> (parameter, expression)."""
    text = _strip_comments(text)
    constants: dict[str, int] = {}
    functions: dict[str, tuple[str, str]] = {}
    # #defines a line each; enums may span lines: both read from the whole text, in order
    token = re.compile(r"^[ \t]*#define[ \t]+(\w+)(\((\w+)\))?[ \t]*([^\n]*)$|\benum\s*\{(.*?)\}", re.M | re.S)
    for m in token.finditer(text):
        if m.group(1):
            name, param, body = m.group(1), m.group(3), m.group(4).strip()
            if not body or not _NAME.fullmatch(name):
                continue  # the include guard
            if param:
                functions[name] = (param, body)
            else:
                constants[name] = _value(body, constants)
        else:
            at = -1
            for item in (i.strip() for i in m.group(5).split(",")):
                if not item:
                    continue
                name, _, expr = (p.strip() for p in item.partition("="))
                at = _value(expr, constants) if expr else at + 1
                constants[name] = at
    return constants, functions


def render(text: str) -> str:
    """interface.py's text for a header's ``text``."""
    constants, functions = parse(text)
    out = ['"""The compiled engine\'s interface: the constants of src/stoker/csrc/stoker_native.h, by name.',
           "",
           "Written by .ci/interface.py from that header (do not edit: change the header and run",
           "``make interface``; tests/engine/test_interface.py checks the two agree, and the extension exports",
           "the same names with the values it was compiled with, which :mod:`stoker.engine.cpu.native` checks).",
           "",
           ">>> from stoker.engine.cpu import interface",
           ">>> interface.ST_OK, interface.COPY_COLS(3)",
           "(0, 5)",
           '"""',
           ""]
    out += [f"{name} = {value}" for name, value in constants.items()]
    out.append("")
    for name, (param, expr) in functions.items():
        out += ["", f"def {name}({param}: int) -> int:", f"    return {expr}", ""]
    out += ["", "#: every integer constant above, by name (as the extension's ``interface`` holds them)",
            "CONSTANTS = {" + ", ".join(f"{n!r}: {n}" for n in constants) + "}", ""]
    # wrap the long CONSTANTS line at 120 columns
    lines = []
    for line in out:
        while len(line) > 120:
            cut = line.rfind(", ", 0, 118) + 1
            lines.append(line[:cut])
            line = "    " + line[cut:].lstrip()
        lines.append(line)
    return "\n".join(lines)


def render_names(text: str) -> str:
    """interface_names.h's text: INTERFACE_CONSTANT(name) for every integer constant, for module.c."""
    constants, _ = parse(text)
    return "\n".join(["/* Written by .ci/interface.py from stoker_native.h (do not edit: make interface): its integer",
                      " * constants, which module.c exports by name as stoker._native.interface. */",
                      *(f"INTERFACE_CONSTANT({name})" for name in constants), ""])


def main(argv: list[str]) -> int:
    text = HEADER.read_text()
    wanted = {MODULE: render(text), NAMES: render_names(text)}
    if argv[1:] == ["--check"]:
        stale = [p for p, want in wanted.items() if not p.exists() or p.read_text() != want]
        for p in stale:
            print(f"{p.relative_to(REPO)} is not what {HEADER.relative_to(REPO)} says: run make interface",
                  file=sys.stderr)
        return 1 if stale else 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    for p, want in wanted.items():
        p.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
