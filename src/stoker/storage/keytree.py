"""KeyTree: a set of store keys by folder, whose keys under a prefix are found in time proportional to them.

What :meth:`CachingStore.forget <stoker.storage.cachingstore.CachingStore.forget>` needs at every array open:
the generations learnt under the array's prefix dropped. Scanning every key known for those that start with
the prefix costs the keys of every array opened before: a job opening 1,000 arrays of 33 objects each
compared 33,000 keys at each open (about 2 ms of CPU an open, most of an open's cost once its documents come
from the disk cache). Here a key is a path in a tree of its ``/``-separated parts, so the keys under a folder
are that folder's subtree.

>>> tree = KeyTree(); tree.add("g.zarr/a/c/0/0"); tree.add("g.zarr/a/zarr.json"); tree.add("g.zarr/ab/zarr.json")
>>> sorted(tree.pop_under("g.zarr/a"))
['g.zarr/a/c/0/0', 'g.zarr/a/zarr.json']
>>> len(tree)
1
"""

from __future__ import annotations

from typing import Iterable

#: the mark, in a folder's dict, that the folder's own path is a key (its other entries are its parts)
_KEY = None


class KeyTree:
    """Keys (strings; ``/`` separates their parts) in a tree of dicts, one per folder: part -> the folder
    below, and :data:`_KEY` -> True where the path itself is a key. Not thread-safe: its owner's lock holds."""

    __slots__ = ("_root", "_n", "_last")

    def __init__(self) -> None:
        self._root: dict = {}
        self._n = 0
        # the folder of the key added last, and its dict: a listing page's keys come folder by folder
        self._last: tuple[str, dict] | None = None

    def __len__(self) -> int:
        return self._n

    def add(self, key: str) -> None:
        """Hold ``key`` (once, however often added)."""
        self.add_many((key,))

    def add_many(self, keys: Iterable[str]) -> None:
        """Hold each of ``keys``, as :meth:`add` does one at a time: a listing page's 1,000 keys (those of one
        folder after the other) are found their folder's dict once per folder, with no call per key."""
        last = self._last
        n = 0
        for key in keys:
            folder, slash, name = key.rpartition("/")
            if last is not None and slash and last[0] == folder:
                node = last[1]
            else:
                node = self._root
                if slash:
                    for part in folder.split("/"):
                        child = node.get(part)
                        if child is None:
                            child = node[part] = {}
                        node = child
                    last = (folder, node)
            child = node.get(name)
            if child is None:
                node[name] = {_KEY: True}
                n += 1
            elif _KEY not in child:
                child[_KEY] = True
                n += 1
        self._last = last
        self._n += n

    def pop_under(self, prefix: str) -> list[str]:
        """Remove and return the keys under the folder ``prefix`` (those that start with ``prefix + "/"``;
        every key for ``""``), not ``prefix`` itself where it is a key."""
        node = self._root
        if prefix:
            for part in prefix.split("/"):
                node = node.get(part)
                if node is None:
                    return []
        out: list[str] = []
        # each folder below, with its path and the "/" its parts follow (none at the root)
        stack = [(child, part) for part, child in node.items() if part is not _KEY]
        base = prefix + "/" if prefix else ""
        stack = [(child, base + part) for child, part in stack]
        while stack:
            folder, path = stack.pop()
            for part, child in folder.items():
                if part is _KEY:
                    out.append(path)
                else:
                    stack.append((child, path + "/" + part))
        for part in [p for p in node if p is not _KEY]:
            del node[part]
        self._n -= len(out)
        self._last = None  # its folder may be one of those removed
        return out

    def clear(self) -> None:
        self._root = {}
        self._n = 0
        self._last = None
