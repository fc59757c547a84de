"""What a CachingStore learns of its keys' generations (cachingstore._set_known_many): a listing page's 1,000
keys and a HEAD's or a read's one key by the same rule, a newer answer kept, every change counted."""

from __future__ import annotations

from stoker.storage import MemoryStore
from stoker.storage.cachingstore import _UNCACHED, CachingStore, _Listing
from stoker.storage.diskcache import DiskCache


def test_a_listing_page_learns_as_single_answers_do_and_keeps_newer_ones(tmp_path):
    kv = CachingStore(MemoryStore({}), DiskCache(str(tmp_path / "cache"), 1 << 20))
    with kv._lock:
        for key, generation in (("g/a", "A"), ("g/b", "B"), ("g/c", _UNCACHED)):
            kv._set_known(key, generation, 10.0)  # a HEAD's answers
        kv._set_known("g/d", "D", 30.0)  # a read asked after the listing below started
        assert kv.changes == 0 and len(kv._known_keys) == 4
        kv._set_known("g/a", "A", 11.0)  # the same generation again: no change
        assert kv.changes == 0 and kv._known["g/a"] == ("A", 11.0)
        listing = _Listing("g", 20.0)
        kv._listings["g"] = listing
        kv._learn_page(listing, [("g/a", "A"), ("g/b", "B2"), ("g/c", "C"), ("g/d", "D2"), ("g/e", None)], False)
    assert kv._known == {"g/a": ("A", 20.0), "g/b": ("B2", 20.0), "g/c": ("C", 20.0), "g/d": ("D", 30.0),
                         "g/e": (_UNCACHED, 20.0)}  # d: the newer read's answer stays; e: stated no version
    assert kv.changes == 2  # b and c changed; a the same, d kept, e new
    assert len(kv._known_keys) == 5 and listing.listed == 5 and listing.upto == "g/e" and listing.complete
    with kv._lock:
        kv._set_known("g/e", "E", 40.0)  # a read through learnt a generation: a change, as a page's would be
        kv._set_known("g/a", _UNCACHED, 40.0)
    assert kv.changes == 4 and len(kv._known_keys) == 5
