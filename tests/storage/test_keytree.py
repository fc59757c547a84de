"""KeyTree: the keys under a folder, as a scan of every key for ``prefix + "/"`` finds them (the reference)."""

import random

from stoker.storage.keytree import KeyTree


def _scan(keys: set[str], prefix: str) -> set[str]:
    under = prefix + "/" if prefix else ""
    return {k for k in keys if k.startswith(under)}


def test_pop_under_matches_the_scan_of_every_key():
    rng = random.Random(0)
    parts = ["a", "ab", "a.zarr", "c", "0", "1", "zarr.json", "", "x y", "é"]
    for _ in range(200):
        keys = {"/".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 40))}
        tree = KeyTree()
        for key in keys:
            tree.add(key)
            tree.add(key)  # twice: held once
        assert len(tree) == len(keys)
        for _ in range(5):
            prefix = "/".join(rng.choice(parts) for _ in range(rng.randint(0, 3)))
            want = _scan(keys, prefix)
            got = tree.pop_under(prefix)
            assert sorted(got) == sorted(want), prefix
            keys -= want
            assert len(tree) == len(keys)
        assert sorted(tree.pop_under("")) == sorted(keys)
        assert len(tree) == 0


def test_a_folder_that_is_also_a_key_stays():
    tree = KeyTree()
    for key in ("g.zarr/a", "g.zarr/a/c/0", "g.zarr/ab/c/0", "g.zarr/a/zarr.json"):
        tree.add(key)
    assert sorted(tree.pop_under("g.zarr/a")) == ["g.zarr/a/c/0", "g.zarr/a/zarr.json"]
    assert tree.pop_under("g.zarr/a") == []
    assert sorted(tree.pop_under("g.zarr")) == ["g.zarr/a", "g.zarr/ab/c/0"]
    tree.add("k")
    tree.clear()
    assert len(tree) == 0 and tree.pop_under("") == []


def test_add_many_holds_what_add_holds_one_at_a_time():
    rng = random.Random(1)
    parts = ["a", "ab", "c", "0", "1", "zarr.json", "", "é"]
    for _ in range(200):
        pages = [[rng.choice(parts) if rng.random() < 0.2 else "/".join(rng.choice(parts) for _ in range(
            rng.randint(1, 4))) for _ in range(rng.randint(0, 30))] for _ in range(3)]
        one, many = KeyTree(), KeyTree()
        for page in pages:
            for key in page:
                one.add(key)
            many.add_many(page)
            one.add("a/c/0")  # between pages: add after add_many finds the same folders
            many.add("a/c/0")
        assert len(many) == len(one)
        for prefix in ("a", "", "ab/c"):
            assert sorted(many.pop_under(prefix)) == sorted(one.pop_under(prefix))
            assert len(many) == len(one)
