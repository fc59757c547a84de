"""docs/architecture.md's module map (the ``src/stoker/`` block of "## Layers") names every module of the
tree under its own folder, and lists nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stoker"
ENTRY = re.compile(r"^( *)(\S+?(?:/|\.py|\.c|\.h))(?:\s|$)")


def _map_lines() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^```\nsrc/stoker/\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md has no src/stoker/ module map"
    return block.group(1).splitlines()


def _sections(lines: list[str]) -> dict[str, str]:
    """Folder (relative to src/stoker, "" for the top) -> the map's text about it: its entry's lines and those
    of its own modules, not its subfolders'."""
    own: dict[str, list[str]] = {"": []}
    stack: list[tuple[int, str]] = [(0, "")]  # (indent of the folder's entries, folder)
    for line in lines:
        m = ENTRY.match(line)
        if m and len(m.group(1)) % 2 == 0 and len(m.group(1)) >= 2:
            indent, name = len(m.group(1)), m.group(2)
            while len(stack) > 1 and indent < stack[-1][0]:
                stack.pop()
            if name.endswith("/"):
                folder = f"{stack[-1][1]}{name}"
                own[folder] = [line]
                stack.append((indent + 2, folder))
                continue
        own[stack[-1][1]].append(line)
    return {k.rstrip("/"): "\n".join(v) for k, v in own.items()}


def _entries(lines: list[str]) -> list[str]:
    """The paths the map lists line by line (folders end in "/")."""
    out, stack = [], []
    for line in lines:
        m = ENTRY.match(line)
        if not m or len(m.group(1)) % 2 or len(m.group(1)) < 2:
            continue
        depth = len(m.group(1)) // 2 - 1
        if depth > len(stack):
            continue  # prose that happens to start with a name
        stack = stack[:depth]
        out.append("".join(stack) + m.group(2))
        if m.group(2).endswith("/"):
            stack.append(m.group(2))
    return out


def test_every_module_is_named_under_its_folder():
    sections = _sections(_map_lines())
    missing = []
    for path in sorted(SRC.rglob("*")):
        if "__pycache__" in path.parts or path.suffix not in (".py", ".c", ".h") or path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(SRC).as_posix()
        folder = "" if folder == "." else folder
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", sections.get(folder, "")):
            missing.append(path.relative_to(SRC).as_posix())
    assert missing == [], f"modules docs/architecture.md's map does not name under their folder: {missing}"


def test_nothing_listed_is_gone():
    gone = [p for p in _entries(_map_lines()) if not (SRC / p).exists()]
    assert gone == [], f"docs/architecture.md's map lists what the tree does not have: {gone}"
