"""What ``Stores.get`` keys a store on (root, storage options, ObjectStore settings, disk cache): options spelled
once, not at every call. A pipeline calls it several times for every array it opens, and spelling the same
options as JSON each time was most of its cost; options that differ still get stores of their own. Against
the loopback HTTP server of the store tests."""

from __future__ import annotations

import json

import pytest

from stoker.storage.locate import Stores, locate

from store_fixtures import range_server_fixture

http = range_server_fixture()


@pytest.fixture
def data(tmp_path):
    return str(tmp_path)


class _Dumps:
    """``json.dumps`` calls while the block runs."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch, self.n = monkeypatch, 0

    def __enter__(self) -> "_Dumps":
        real = json.dumps

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        self.monkeypatch.setattr(json, "dumps", counted)
        return self

    def __exit__(self, *exc) -> None:
        self.monkeypatch.undo()


@pytest.mark.timeout(60)
def test_the_same_options_are_spelled_once_not_at_every_open(http, monkeypatch):
    stores = Stores()
    try:
        loc = locate(f"{http.url}/a.zarr/b")
        options = {"timeout_s": 7.0, "user_agent": "stoker-test", "retries": 2}
        first = stores.get(loc, options)
        with _Dumps(monkeypatch) as dumps:
            again = [stores.get(loc, dict(options)) for _ in range(8)]  # an equal dict, made anew each time
            plain = [stores.get(loc, None) for _ in range(4)]
        assert dumps.n == 0, dumps.n  # before: two a call
        assert all(g[0] is first[0] for g in again)
        assert all(p[0] is plain[0][0] for p in plain) and plain[0][0] is not first[0]
        # options that differ are other stores
        assert stores.get(loc, {**options, "retries": 3})[0] is not first[0]
        assert stores.get(loc, {**options, "user_agent": "other"})[0] is not first[0]
        assert stores.get(loc, {**options, "timeout_s": 7})[0] is not first[0]  # spelled 7, not 7.0, as before
        headers = {"default_headers": {"x-a": "1"}}  # an unhashable value: spelled each time, still one store
        assert stores.get(loc, headers)[0] is stores.get(loc, {"default_headers": {"x-a": "1"}})[0]
    finally:
        stores.close()


@pytest.mark.parametrize("a, b", [({"x": (1, 2)}, {"x": (True, 2)}), ({"x": (1, 2)}, {"x": (1.0, 2.0)}),
                                  ({"x": ((0,),)}, {"x": ((False,),)}), ({"x": frozenset([1])}, {"x": frozenset([True])}),
                                  ({"x": 1}, {"x": True}), ({"x": 1}, {"x": 1.0})])
def test_options_spelled_apart_by_json_are_never_spelled_alike(a, b):
    # equal (and equally hashing) nested values whose items' types differ: the memo keyed (1, 2) and
    # (True, 2) alike, so the second was given the first's spelling (and store)
    from stoker.storage.locate import _spelled

    for first, second in ((a, b), (b, a)):
        assert _spelled(first, repr) == json.dumps(first, sort_keys=True, default=repr)
        assert _spelled(second, repr) == json.dumps(second, sort_keys=True, default=repr)
