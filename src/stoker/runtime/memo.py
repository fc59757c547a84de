"""A process's memos (what it keeps to skip a look-up again) bounded in entries: past the bound, forgotten all
at once.

>>> seen = {"a": 1, "b": 2}
>>> remember(seen, "c", 3, bound=2)   # full: emptied first, then seen["c"] = 3
3
>>> seen
{'c': 3}

Forgetting costs only the look-up again (a marker looked for on disk, a shard key formatted, an array
described to the engine), so a bound in entries keeps a long-running process's memory flat, and forgetting
all at once costs nothing per hit (no order kept as an LRU would).
"""

from __future__ import annotations

from typing import MutableMapping, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memo: MutableMapping[K, V], key: K, value: V, bound: int) -> V:
    """``memo[key] = value``, ``memo`` emptied first where it holds ``bound`` keys or more and not ``key``;
    returns ``value``. The bound is the caller's to pass at each call (a module's constant, read as it is now)."""
    if len(memo) >= bound and key not in memo:
        memo.clear()
    memo[key] = value
    return value
