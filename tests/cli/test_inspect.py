"""stoker inspect: amplification estimates against exact expectations, and the CLI end to end."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec

import stoker
from stoker.zarr.amplification import estimate
from stoker.cli import main

pytestmark = pytest.mark.timeout(60)


def _exact_chunks_per_crop(size: int, chunk: int, crop: int) -> float:
    """Mean number of chunks a 1-D crop touches over every possible start (uniform)."""
    starts = range(size - crop + 1)
    return float(np.mean([(s + crop - 1) // chunk - s // chunk + 1 for s in starts]))


@pytest.mark.parametrize("size,chunk,crop", [(1000, 100, 100), (1000, 64, 30), (997, 50, 120), (300, 300, 7)])
def test_chunks_per_crop_matches_the_exact_expectation(tmp_path, size, chunk, crop):
    zarr.create_array(str(tmp_path / "a.zarr"), shape=(size,), chunks=(chunk,), dtype="uint8")
    meta = stoker.open_array(tmp_path / "a.zarr").metadata
    est = estimate(meta, (crop,), n=4000, seed=1)
    exact = _exact_chunks_per_crop(size, chunk, crop)
    assert est.chunks_per_crop == pytest.approx(exact, rel=0.03)
    assert est.decode_full == pytest.approx(est.chunks_per_crop * chunk / crop)


def test_partial_decode_estimate_counts_whole_blocks(tmp_path):
    zarr.create_array(str(tmp_path / "a.zarr"), shape=(64, 64), chunks=(64, 64), dtype="uint8")
    meta = stoker.open_array(tmp_path / "a.zarr").metadata
    # crops of whole rows: 8 rows of 64 bytes from a chunk split into 512-byte blocks (8 rows each)
    est = estimate(meta, (8, 64), n=2000, seed=0, blocksize=512)
    exact = np.mean([(((s + 8) * 64 + 511) // 512 - (s * 64) // 512) * 512 / (8 * 64) for s in range(57)])
    assert est.decode_partial == pytest.approx(exact, rel=0.03)
    assert est.decode_full == pytest.approx(64 * 64 / (8 * 64))
    assert est.read is None and estimate(meta, (8, 64), blocksize=512, compression_ratio=2.0).read > 0


def test_inspect_cli_reports_and_advises(tmp_path, capsys):
    z = zarr.create_array(str(tmp_path / "v.zarr"), shape=(64, 256, 256), chunks=(32, 128, 128), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle"))
    z[:] = np.random.default_rng(0).integers(0, 300, size=z.shape, dtype="uint16")
    assert main(["inspect", str(tmp_path / "v.zarr"), "--sample-shape", "8", "32", "32"]) == 0
    out = capsys.readouterr().out
    assert "chunks per crop" in out and "partial blosc decode" in out and "compression ratio" in out
    assert "advice: chunks limit throughput" in out and "(4, 16, 16)" in out
    assert main(["inspect", str(tmp_path / "v.zarr"), "--sample-shape", "64", "256", "256"]) == 0
    assert "chunking suits this crop shape" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "v.zarr"), "--sample-shape", "8", "8"]) == 2  # wrong rank
    assert main(["inspect", str(tmp_path / "missing.zarr")]) == 2
    assert "no Zarr array" in capsys.readouterr().err


def test_inspect_reads_no_chunk_beyond_one_blosc_header(tmp_path):
    """The compression ratio comes from file sizes and shard index entries, the block size from one 16-byte
    header: a chunk's bytes are never read (a sparse 3 GiB chunk file once cost 9 GiB here)."""
    from stoker.cli.inspect import describe
    from stoker.storage import default_store

    z = zarr.create_array(str(tmp_path / "v.zarr"), shape=(64, 256, 256), chunks=(32, 128, 128), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle"))
    z[:] = np.random.default_rng(0).integers(0, 300, size=z.shape, dtype="uint16")
    counters = default_store().counters
    before = counters.bytes_read
    out = describe(str(tmp_path / "v.zarr"), (8, 32, 32))
    assert "partial blosc decode" in out and "compression ratio" in out
    metadata = (tmp_path / "v.zarr" / "zarr.json").stat().st_size
    # the document twice (the layout, then its attributes and dimension names), one blosc header
    assert counters.bytes_read - before <= 2 * metadata + 16


def test_inspect_shows_dimensions_coordinates_and_cf(tmp_path, capsys):
    """Dimension names, each coordinate's first and last label (times decoded as xarray decodes them) and the
    CF decoding, for a dataset xarray wrote; a plain array shows none of them."""
    import json

    xr = pytest.importorskip("xarray")
    pd = pytest.importorskip("pandas")
    t = pd.date_range("2000-03-01 06:00", periods=5, freq="6h")
    ds = xr.Dataset({"p": (("time", "lat"), np.ones((5, 3), "f4"))},
                    coords={"time": t, "lat": [10.0, 0.0, -10.0]})
    ds.p.encoding.update(dtype="int16", scale_factor=0.5, add_offset=2.0, _FillValue=-1)
    ds.to_zarr(str(tmp_path / "d.zarr"), zarr_format=3, consolidated=False)
    assert main(["inspect", str(tmp_path / "d.zarr" / "p")]) == 0
    out = capsys.readouterr().out
    assert "dimensions   time, lat" in out
    assert "time       2000-03-01T06:00 .. 2000-03-02T06:00 (5 labels, datetime64[ns])" in out
    assert "lat        10.0 .. -10.0 (3 labels, float64)" in out
    assert "cf decoding  scale_factor=0.5, add_offset=2.0, missing values [-1] -> NaN" in out
    assert main(["inspect", str(tmp_path / "d.zarr" / "p"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["dimensions"] == ["time", "lat"]
    assert got["coordinates"]["time"] == {"length": 5, "first": "2000-03-01T06:00", "last": "2000-03-02T06:00",
                                          "dtype": "datetime64[ns]"}
    # xarray left the zarr fill_value 0 (not the _FillValue -1): a chunk not stored decodes to add_offset
    assert zarr.open_array(str(tmp_path / "d.zarr" / "p"), mode="r").fill_value == 0
    assert got["cf"] == {"scale_factor": 0.5, "add_offset": 2.0, "missing": [-1.0], "missing_chunk": 2.0,
                         "unmatched": []}
    zarr.create_array(str(tmp_path / "plain.zarr"), shape=(4,), chunks=(4,), dtype="uint8")
    assert main(["inspect", str(tmp_path / "plain.zarr"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["dimensions"], got["coordinates"], got["cf"]) == (None, {}, None)


@pytest.mark.parametrize("chunks,dtype,shown", [((20, 20), "int16", "(20, 20) (800 bytes decoded)"),
                                                 ((64, 64), "float32", "(64, 64) (16.0 KiB decoded)"),
                                                 ((128, 128), "uint16", "(128, 128) (32.0 KiB decoded)"),
                                                 ((1024, 512), "float32", "(1024, 512) (2.00 MiB decoded)")])
def test_inspect_says_the_decoded_chunk_size_in_a_unit_that_shows_it(tmp_path, capsys, chunks, dtype, shown):
    """A chunk of 800 bytes was '0.00 MiB decoded': a new user read that the chunk held nothing."""
    zarr.create_array(str(tmp_path / "a.zarr"), shape=(2048, 1024), chunks=chunks, dtype=dtype)
    assert main(["inspect", str(tmp_path / "a.zarr")]) == 0
    assert f"read chunk   {shown}\n" in capsys.readouterr().out


def test_inspect_shows_the_element_order_zarr_python_wrote(tmp_path, capsys):
    """A v3 ``transpose`` codec and a v2 ``order: F`` change how every chunk is laid out (and what a crop
    costs to copy); inspect listed neither ('codecs zstd'), unlike zarr-python's metadata."""
    import json

    from zarr.codecs import TransposeCodec

    t = zarr.create_array(str(tmp_path / "t.zarr"), shape=(4, 6, 8), chunks=(2, 3, 4), dtype="int32",
                          filters=[TransposeCodec(order=(2, 0, 1))])
    assert [c.to_dict()["name"] for c in t.metadata.codecs][:2] == ["transpose", "bytes"]
    f = zarr.create_array(str(tmp_path / "f.zarr"), shape=(4, 6), chunks=(2, 3), dtype="int32", zarr_format=2,
                          order="F")
    assert f.metadata.order == "F"
    zarr.create_array(str(tmp_path / "c.zarr"), shape=(4, 6), chunks=(2, 3), dtype="int32", zarr_format=2)
    expected = {"t.zarr": ([2, 0, 1], ["transpose", "zstd"], "order        transpose (2, 0, 1)",
                           "codecs       transpose -> zstd"),
                "f.zarr": ("F", ["zstd"], "order        F", "codecs       zstd"),
                "c.zarr": ("C", ["zstd"], "order        C", "codecs       zstd")}
    for name, (order, codecs, order_line, codecs_line) in expected.items():
        assert main(["inspect", str(tmp_path / name), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert (got["order"], got["codecs"]) == (order, codecs), name
        assert main(["inspect", str(tmp_path / name)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert order_line in out and codecs_line in out, (name, out)


def test_inspect_of_a_group_names_the_arrays_in_it(tmp_path, capsys):
    """The first thing a user tries on a dataset xarray wrote, or an OME-Zarr image, is the group itself:
    the error said 'name one of its arrays' but not which; it now lists them (as zarr-python finds them)."""
    xr = pytest.importorskip("xarray")
    ds = xr.Dataset({"t2m": (("time", "lat"), np.zeros((4, 3), "f4"))},
                    coords={"time": np.arange(4), "lat": [1.0, 2.0, 3.0]})
    for fmt in (2, 3):
        store = tmp_path / f"weather{fmt}.zarr"
        ds.to_zarr(str(store), zarr_format=fmt, consolidated=fmt == 2)
        expected = sorted(name for name, _ in zarr.open_group(str(store), mode="r").arrays())
        assert expected == ["lat", "t2m", "time"]
        assert main(["inspect", str(store)]) == 2
        err = capsys.readouterr().err
        assert "not an array; name one of its arrays: " + ", ".join(f"{store}/{n}" for n in expected) in err, err
    image = zarr.open_group(str(tmp_path / "image.ome.zarr"), mode="w")
    for level in ("0", "1"):
        image.create_array(level, shape=(4, 4), dtype="uint8")
    labels = image.create_group("labels").create_group("cells")
    labels.create_array("0", shape=(4, 4), dtype="uint8")
    assert main(["inspect", str(tmp_path / "image.ome.zarr")]) == 2
    err = capsys.readouterr().err
    root = tmp_path / "image.ome.zarr"
    assert f"name one of its arrays: {root}/0, {root}/1, {root}/labels/cells/0" in err, err
    assert main(["inspect", str(root), "--storage-option", "region=x"]) == 2  # another mistake: its own message
    assert capsys.readouterr().err.strip().endswith("drop them for a local path")


def test_inspect_asks_each_chunks_size_once(tmp_path, capsys):
    """The compression ratio draws up to 32 chunks at random; it drew them with repeats, so an array of a
    few chunks behind HTTP cost 32 HEAD requests of the same few files. Each chunk is asked once."""
    pytest.importorskip("obstore")
    from range_server import RangeServer

    z = zarr.create_array(str(tmp_path / "v.zarr"), shape=(64, 64), chunks=(32, 64), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle"))
    z[:] = np.arange(64 * 64, dtype="uint16").reshape(64, 64)
    server = RangeServer(str(tmp_path))
    try:
        uri = f"{server.url}/v.zarr"
        assert main(["inspect", uri, "--sample-shape", "8", "8"]) == 0
        assert "compression ratio" in capsys.readouterr().out
        chunks = [p for p in server.paths if "/c/" in p]
    finally:
        server.stop()
    assert sorted(set(chunks)) == ["/v.zarr/c/0/0", "/v.zarr/c/1/0"]
    assert len(chunks) <= 3, chunks  # each size once, and one blosc header of one of them


def test_inspect_of_an_arrays_metadata_file_names_its_folder(tmp_path, capsys):
    """`stoker inspect a.zarr/zarr.json` (or .zarray), a common first try, said 'neither zarr.json nor
    .zarray exists' of a path that is zarr.json: it now says to name the array's folder."""
    zarr.create_array(str(tmp_path / "a.zarr"), shape=(4,), dtype="uint8")
    zarr.create_array(str(tmp_path / "b.zarr"), shape=(4,), dtype="uint8", zarr_format=2)
    for path in (tmp_path / "a.zarr" / "zarr.json", tmp_path / "b.zarr" / ".zarray"):
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path} is the array's metadata file: name its folder, {path.parent}" in err, err
        with pytest.raises(stoker.NotFound, match="name its folder"):
            stoker.open_array(path)


def test_a_sample_shape_of_another_rank_says_so(tmp_path, capsys):
    """`stoker inspect v.zarr --sample-shape 4 12` of a 3-d array said "(4, 12) does not fit in shape (120,
    12, 20)", which reads as a crop too large; it names the numbers of axes now. A crop too large keeps its
    message."""
    zarr.create_array(str(tmp_path / "v.zarr"), shape=(120, 12, 20), chunks=(8, 12, 20), dtype="int16")
    assert main(["inspect", str(tmp_path / "v.zarr"), "--sample-shape", "4", "12"]) == 2
    assert "--sample-shape (4, 12) has 2 axes but the array (shape (120, 12, 20)) has 3" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "v.zarr"), "--sample-shape", "4", "13", "20"]) == 2
    assert "does not fit in shape (120, 12, 20)" in capsys.readouterr().err


def test_chunk_advice_keeps_axes_the_crop_spans_whole(tmp_path):
    """A crop that spans an axis whole always starts at 0 on it and straddles no chunk boundary there: one chunk
    across that axis costs no decode waste, while halving it only multiplies the chunks each crop touches. The
    suggestion keeps such axes whole (it once halved them too: (2, 6, 10) against crops of (4, 12, 20) of a
    (64, 12, 20) array, 10 chunks a crop where (2, 12, 20) gives 2.5 at the same amplification)."""
    import re

    zarr.create_array(str(tmp_path / "a.zarr"), shape=(64, 12, 20), chunks=(64, 12, 20), dtype="uint16")
    est = estimate(stoker.open_array(tmp_path / "a.zarr").metadata, (4, 12, 20), n=2000, seed=0)
    assert est.decode_full == pytest.approx(16.0)
    (advice,) = [a for a in est.advice if "Chunks of about" in a]
    suggested = tuple(int(v) for v in re.search(r"Chunks of about \(([\d, ]+)\)", advice).group(1).split(","))
    assert "straddle" not in advice or "axes [0]" in advice  # axes 1 and 2 straddle nothing
    # the suggestion, tried: within the advice's own 4x bound, with one chunk across each whole axis
    zarr.create_array(str(tmp_path / "b.zarr"), shape=(64, 12, 20), chunks=suggested, dtype="uint16")
    tried = estimate(stoker.open_array(tmp_path / "b.zarr").metadata, (4, 12, 20), n=2000, seed=0)
    assert tried.decode_full <= 4
    assert suggested[1:] == (12, 20) and tried.chunks_per_crop == pytest.approx(2.5, rel=0.05)


@pytest.mark.parametrize("fmt", [2, 3])
def test_inspect_shows_an_ome_levels_scale_over_level_0(tmp_path, capsys, fmt):
    """A pyramid level's scale over level 0 (a label image's: over its parent image's level 0, here at half the
    image's resolution), as stoker reads it (level_scale) and ome-zarr's multiscales say; none for level 0."""
    import json

    from ome_images import labelled_image

    root = str(tmp_path / "img.zarr")
    labelled_image(root, fmt)
    want = {"s0": None, "s1": ([2, 2, 2], "level 0"), "labels/cells/s0": ([2, 2, 2], "the parent image's level 0"),
            "labels/cells/s1": ([4, 4, 4], "the parent image's level 0")}
    for path, expected in want.items():
        assert main(["inspect", "--json", f"{root}/{path}"]) == 0
        got = json.loads(capsys.readouterr().out)["ome_level"]
        assert (got if got is None else (got["scale"], got["over"])) == expected, path
        assert main(["inspect", f"{root}/{path}"]) == 0
        text = capsys.readouterr().out
        assert ("ome level" in text) == (expected is not None)
        if expected is not None:
            assert f"ome level    scale {tuple(expected[0])} over {expected[1]}" in text


def test_inspect_of_a_level_under_malformed_multiscales_says_so(tmp_path, capsys, monkeypatch):
    """Regression: a multiscales ``datasets`` entry that is no object (``["0", {"path": "1"}]``) was a raw
    AttributeError from the OME reader, which inspect let through (a traceback). level_scale says it with a
    MetadataError; inspect shows it as the level's error, and shows any other failure of it the same way."""
    import json

    from stoker.cli import inspect as cli_inspect
    from stoker.errors import MetadataError
    from stoker.reader.ome import level_scale

    root = str(tmp_path / "img.zarr")
    g = zarr.open_group(root, mode="w", zarr_format=2)
    g.attrs["multiscales"] = [{"version": "0.4", "datasets": ["0", {"path": "1"}]}]
    g.create_array("1", shape=(16, 16), chunks=(16, 16), dtype="uint8")
    with pytest.raises(MetadataError, match="dataset 0 .* is '0', not an object"):
        level_scale(f"{root}/1")
    assert main(["inspect", "--json", f"{root}/1"]) == 0
    got = json.loads(capsys.readouterr().out)["ome_level"]
    assert got["scale"] is None and "dataset 0" in got["error"]

    def broken(*_args, **_kwargs):
        raise KeyError("scale")

    monkeypatch.setattr(cli_inspect, "level_scale", broken)
    assert cli_inspect.facts(f"{root}/1")["ome_level"]["error"].startswith("KeyError")


@pytest.mark.parametrize("fill", ["xarray", "cf"])
def test_inspect_notes_a_missing_chunk_that_decodes_to_a_value(tmp_path, capsys, fill):
    """xarray writes a packed v3 variable with zarr fill_value 0 beside the CF _FillValue -32768: a chunk not
    stored decodes to add_offset (280 K here), as xarray reads it, not NaN. inspect showed both values and left
    the user to work it out; it says so in a note now (the value held to xarray's), and not where the missing
    chunk decodes to NaN."""
    import json
    import shutil

    xr = pytest.importorskip("xarray")
    t = np.random.default_rng(2).normal(280, 3, (4, 6, 8)).astype("f4")
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), t)})
    encoding = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 280.0, "_FillValue": -32768, "chunks": (2, 6, 8)}
    path = tmp_path / "wx.zarr"
    ds.to_zarr(str(path), zarr_format=3, consolidated=False, encoding={"t2m": encoding})
    uri = str(path / "t2m")
    if fill == "cf":  # the same array with the CF _FillValue as its zarr fill_value: a missing chunk is NaN
        meta = json.loads((path / "t2m" / "zarr.json").read_text())
        meta["fill_value"] = -32768
        (path / "t2m" / "zarr.json").write_text(json.dumps(meta))
    shutil.rmtree(path / "t2m" / "c" / "1")  # the second chunk along time: never written
    gap = xr.open_zarr(str(path), consolidated=False).t2m.values[2:4]
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert main(["inspect", uri, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["cf"]["missing_chunk"]
    if fill == "cf":
        assert np.isnan(gap).all() and got == "nan" and "\nnote " not in out
        return
    assert zarr.open_array(uri, mode="r").fill_value == 0 and (gap == 280.0).all()
    assert got == float(gap[0, 0, 0])
    assert ("note         a chunk not stored decodes to 280.0 (fill value 0 decoded), not NaN: the fill value is "
            "none of the CF missing values [-32768]") in out


def test_inspect_notes_a_missing_chunk_of_a_float_array_whose_fill_value_is_no_missing_value(tmp_path, capsys):
    """A float array whose only CF attribute is _FillValue NaN has no decoding to apply, so inspect said
    nothing, yet its zarr fill_value is 0: a chunk never written reads 0.0 (zarr-python's read here), not NaN."""
    import json

    uri = str(tmp_path / "f.zarr")
    z = zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="f4", fill_value=0.0,
                          attributes={"_FillValue": float("nan"), "_ARRAY_DIMENSIONS": ["y", "x"]})
    z[:4, :4] = 1.5  # the other three chunks never written
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert main(["inspect", uri, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["cf"]
    read = zarr.open_array(uri, mode="r")[4:, 4:]
    assert (read == 0.0).all() and got["missing_chunk"] == 0.0 and got["missing"] == ["nan"]
    assert "note         a chunk not stored decodes to 0.0" in out and "none of the CF missing values" in out


def test_inspect_notes_say_what_is_true_of_fills_that_mask_nothing(tmp_path, capsys):
    """A uint8 array's _FillValue 300 is set, but no stored value can equal it: the note said "no CF
    _FillValue is set". A complex array with scale_factor leaked numpy's ComplexWarning (its missing chunk
    decoded through float64). A float array's _FillValue null (JSON null) was shown as "missing values [None]
    -> NaN". zarr-python's reads of a chunk never written are the oracle of what the notes say it reads."""
    import json
    import warnings

    def inspect(uri):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing escapes
            assert main(["inspect", uri]) == 0
            out = capsys.readouterr().out
            assert main(["inspect", uri, "--json"]) == 0
        return out, json.loads(capsys.readouterr().out)["cf"]

    u1 = str(tmp_path / "u1.zarr")
    zarr.create_array(u1, shape=(4,), chunks=(2,), dtype="u1", fill_value=0,
                      attributes={"_FillValue": 300, "scale_factor": 2.0})
    out, cf = inspect(u1)
    assert zarr.open_array(u1, mode="r")[0] == 0 and cf["missing_chunk"] == 0.0 and cf["unmatched"] == [300]
    assert ("not NaN: the CF missing values [300] are no value a uint8 array can hold, so none is masked"
            in out) and "no CF _FillValue is set" not in out

    cx = str(tmp_path / "cx.zarr")
    zarr.create_array(cx, shape=(4,), chunks=(2,), dtype="c8", fill_value=1 + 2j, attributes={"scale_factor": 0.5})
    out, cf = inspect(cx)
    assert zarr.open_array(cx, mode="r")[0] == 1 + 2j and cf["missing_chunk"] == [0.5, 1.0]
    assert "a chunk not stored decodes to [0.5, 1.0]" in out

    nul = str(tmp_path / "null.zarr")
    zarr.create_array(nul, shape=(4,), chunks=(2,), dtype="f4", fill_value=0.0, attributes={"_FillValue": None})
    out, cf = inspect(nul)
    assert cf is None and "None" not in out and "cf decoding" not in out
