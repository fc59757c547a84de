"""A listing page's versions parsed in bulk (objectstore._listed_versions) are those _version states key by key."""

from datetime import datetime, timezone

from stoker.storage.objectstore import _listed_versions, _version

_STAMP = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)


def test_each_key_has_the_version_stated_one_at_a_time():
    e_tags = ['"9b2cf5"', "9b2cf5", 'W/"9b2cf5"', ' "9b2cf5" ', '""9b2cf5""', '"', '""', '"a"', '"a', 'a"',
              '"x""', '""x"', "", None, 17]
    metas = [{"path": f"g.zarr/a/c/{i}", "size": 812, "e_tag": e, "last_modified": _STAMP}
             for i, e in enumerate(e_tags)]
    metas += [{"path": "g.zarr/a/c/x", "size": 812, "e_tag": None, "last_modified": None},
              {"path": "g.zarr/a/c/y", "size": 812.0, "e_tag": '"9b2cf5"', "last_modified": _STAMP},
              {"path": "g.zarr/a/c/z", "size": True, "e_tag": '"9b2cf5"', "last_modified": _STAMP}]
    got = _listed_versions(metas)
    want = [(m["path"], _version(m)) for m in metas]
    assert got == want
    assert [type(v[1][0]) if v[1] else None for v in got] == [type(v[1][0]) if v[1] else None for v in want]
    assert _listed_versions([]) == []
