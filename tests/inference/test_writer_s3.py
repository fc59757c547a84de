"""TileWriter on an object store (moto's S3 server): the array goes through zarr-python's ObjectStore over
obstore and the completion record beside it, as objects; the arrays equal those written to a local disk, on
one rank and two (a real gloo group), v2, v3 and sharded, and a killed job restarts to the same array."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import zarr
from obstore.store import from_url

import stoker

from inference.test_writer import SHAPE, reference, run
from store_fixtures import BUCKET, MotoS3

pytestmark = pytest.mark.timeout(240)

PREFIX = "tile-writer"
REGIONS = 4 * 4 * 3  # SHAPE in (4, 8, 8) chunks


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """The input of tests/inference/test_writer.py (its reference is computed from it), on the local disk."""
    path = str(tmp_path_factory.mktemp("vol") / "in.zarr")
    data = np.random.default_rng(0).random(SHAPE).astype("f4")
    zarr.create_array(path, shape=SHAPE, chunks=(5, 8, 7), dtype="f4")[:] = data
    return path, data


@pytest.fixture(scope="module")
def s3():
    server = MotoS3({}, PREFIX)
    yield server
    server.stop()


def _uri(name: str) -> str:
    return f"s3://{BUCKET}/{PREFIX}/{name}"


def _read(s3, uri: str) -> zarr.Array:
    """The array at ``uri`` as zarr-python reads it through obstore, set up here, not by stoker."""
    o = s3.options
    store = from_url(uri, endpoint=o["endpoint"], region=o["region"], access_key_id=o["access_key_id"],
                     secret_access_key=o["secret_access_key"], client_options={"allow_http": True})
    return zarr.open_array(zarr.storage.ObjectStore(store, read_only=True), mode="r")


def _marks(s3, uri: str) -> list[str]:
    """The region marks of the completion record beside ``uri``, as the bucket lists them."""
    key = uri.split(f"{BUCKET}/", 1)[1] + ".tiles-done/"
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=key)
    names = [o["Key"][len(key):] for page in pages for o in page.get("Contents", [])]
    return sorted(n for n in names if n != "writer.json")


@pytest.mark.parametrize("layout", [dict(), dict(zarr_format=2), dict(shards=(8, 16, 16))],
                         ids=["v3", "v2", "sharded"])
def test_an_s3_array_equals_the_local_one(volume, tmp_path, s3, layout):
    uri, data = volume
    out = _uri("one-" + ("-".join(layout) or "v3") + ".zarr")
    writer, _ = run(uri, out, "hann", 0, storage_options=s3.options, **layout)
    run(uri, str(tmp_path / "local.zarr"), "hann", 0, **layout)
    got = _read(s3, out)
    assert got.metadata.zarr_format == layout.get("zarr_format", 3)
    assert tuple(got.shards or got.chunks) == tuple(layout.get("shards", (4, 8, 8)))
    np.testing.assert_array_equal(got[:], zarr.open_array(str(tmp_path / "local.zarr"), mode="r")[:])
    np.testing.assert_allclose(got[:], reference(data, "hann", 0), rtol=2e-7, atol=0)
    regions = 2 * 2 * 2 if "shards" in layout else REGIONS
    assert writer.written == regions and len(_marks(s3, out)) == regions  # every region once, recorded


def _rank_main(rank, world, init, uri, out, options, result):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        writer, _ = run(uri, out, "none", 2, world=world, rank=rank, storage_options=options,
                        shards=(2, 8, 16, 16))
        with open(f"{result}-{rank}.json", "w") as f:
            json.dump({"written": writer.written, "owned": len(writer.owned_regions())}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_s3_give_the_one_rank_local_array(volume, tmp_path, s3):
    uri, data = volume
    run(uri, str(tmp_path / "one.zarr"), "none", 2, shards=(2, 8, 16, 16))
    out = _uri("two-ranks.zarr")
    torch.multiprocessing.spawn(_rank_main, args=(2, str(tmp_path / "init"), uri, out, s3.options,
                                                  str(tmp_path / "r")), nprocs=2, join=True)
    got = _read(s3, out)[:]
    np.testing.assert_array_equal(got, zarr.open_array(str(tmp_path / "one.zarr"), mode="r")[:])  # bit for bit
    np.testing.assert_array_equal(got, reference(data, "none", 2))
    ranks = [json.loads((tmp_path / f"r-{r}.json").read_text()) for r in range(2)]
    assert [r["written"] for r in ranks] == [r["owned"] for r in ranks] == [4, 4]  # each shard by its owner
    assert len(_marks(s3, out)) == 8


_KILLED = """
import sys
sys.path.insert(0, {tests!r})
from inference.test_writer import run
run({uri!r}, {out!r}, "hann", 0, stop_after=10, storage_options={options!r})
"""


def test_a_killed_job_on_s3_restarts_to_the_same_array(volume, s3):
    uri, data = volume
    out = _uri("killed.zarr")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(tests, "..", "src"), tests])}
    script = textwrap.dedent(_KILLED.format(tests=tests, uri=uri, out=out, options=s3.options))
    p = subprocess.run([sys.executable, "-c", script], env=env, timeout=180)
    assert p.returncode == 3
    done = _marks(s3, out)
    assert 0 < len(done) < REGIONS  # killed mid-way: some regions written and recorded, some not
    writer, todo = run(uri, out, "hann", 0, storage_options=s3.options)
    assert todo < len(stoker.TileGrid([uri], (8, 10, 9), stride=(4, 6, 5)))  # only what is left is predicted
    assert writer.written == REGIONS - len(done) and len(_marks(s3, out)) == REGIONS
    np.testing.assert_allclose(_read(s3, out)[:], reference(data, "hann", 0), rtol=2e-7, atol=0)


def test_object_store_arguments_are_checked(tmp_path, s3):
    with pytest.raises(stoker.InvalidArgument, match="apply to object stores only"):
        stoker.TileWriter(str(tmp_path / "a.zarr"), SHAPE, (4, 8, 8), "f4", storage_options=s3.options)
    with pytest.raises(stoker.InvalidArgument, match="plain HTTP server"):
        stoker.TileWriter(f"{s3.endpoint}/{BUCKET}/x.zarr", SHAPE, (4, 8, 8), "f4")


def test_a_write_into_a_missing_bucket_is_not_found_naming_the_array_and_bucket(s3):
    # the first request: listing a record left beside the array (forgotten before the array is made); the
    # server's NoSuchBucket, to a listing as to a write, is the NotFound that names the bucket
    with pytest.raises(stoker.NotFound, match=r"s3://no-such-bucket/out.zarr(\.tiles-done)?: bucket "
                                              r"'no-such-bucket' does not exist"):
        stoker.TileWriter("s3://no-such-bucket/out.zarr", SHAPE, (4, 8, 8), "f4",
                          storage_options={**s3.options, "retries": 0})


def test_marks_on_an_object_store_are_put_by_the_write_threads(volume, s3, monkeypatch):
    """No sync thread on an object store: each region's mark is a PUT sent by the write thread that wrote its
    chunks, right after them (one sync thread would send the marks one at a time behind each other)."""
    from stoker.inference.record import CompletionRecord

    threads = []
    real = CompletionRecord.mark

    def mark(self, region):
        threads.append(threading.current_thread().name)
        real(self, region)

    monkeypatch.setattr(CompletionRecord, "mark", mark)
    uri, data = volume
    out = _uri("marks-inline.zarr")
    writer, _ = run(uri, out, "hann", 0, storage_options=s3.options, write_threads=3)
    assert len(_marks(s3, out)) == REGIONS and len(threads) == REGIONS
    assert writer._marks.threads == []
    assert all(name.startswith("stoker-tilewriter_") for name in threads), set(threads)


def test_a_record_left_beside_a_removed_array_is_forgotten_when_it_is_made_anew(s3):
    """Marks left on the bucket by a removed array (its objects deleted, not its record's) vouch for none of
    the new array's regions: a writer that makes the array removes them, so none of its regions is skipped."""
    from stoker.inference.record import CompletionRecord

    out = _uri("made-anew.zarr")
    old = CompletionRecord(out, s3.options)
    old.check_settings({"shape": [4, 4], "unit": [2, 2], "dtype": "float32", "blend": "none", "crop": None})
    old.mark((0, 1))
    assert _marks(s3, out) == ["0_1.json"]
    writer = stoker.TileWriter(out, (4, 4), (2, 2), "f4", storage_options=s3.options, write_threads=0)
    assert writer.done == set() and _marks(s3, out) == []
    writer.write([stoker.Sample("unused.zarr", [(0, 4), (0, 4)])], np.full((1, 4, 4), 5, "f4"))
    writer.close()
    np.testing.assert_array_equal(_read(s3, out)[:], np.full((4, 4), 5, "f4"))
    assert len(_marks(s3, out)) == 4


@pytest.mark.parametrize("beside, refused", [("notes.txt", False), ("summary.json", False), ("0_1.json", True)])
def test_torn_settings_of_an_s3_record_are_refused_beside_marks_only(s3, beside, refused):
    """A record's settings torn beside an object that is no region's mark (a user's note, a tool's summary) are
    a record never used, started again, as done() counts no mark there; beside a region's mark, refused. Any
    object but writer.json counted as a mark, so such a record refused every restart."""
    from stoker.inference.record import SUFFIX, CompletionRecord

    uri = _uri(f"torn-{beside}.zarr")
    key = uri.split(f"{BUCKET}/", 1)[1] + SUFFIX
    s3.client.put_object(Bucket=BUCKET, Key=f"{key}/writer.json", Body=b'{"shape": [8')
    s3.client.put_object(Bucket=BUCKET, Key=f"{key}/{beside}", Body=b'{"region": [0, 1]}')
    settings = {"shape": [8, 8], "unit": [4, 4], "dtype": "float32", "blend": "none", "crop": None}
    rec = CompletionRecord(uri, s3.options)
    if refused:
        with pytest.raises(stoker.InvalidArgument, match="writer.json"):
            rec.check_settings(settings)
        return
    rec.check_settings(settings)
    assert rec.done() == set()
    assert json.loads(s3.client.get_object(Bucket=BUCKET, Key=f"{key}/writer.json")["Body"].read()) == settings
