"""`stoker bench --scenarios 11,12` (samples of named fields): the tiny run end to end, and every peer reading
the same boxes and values as stoker."""

import re

import numpy as np
import pytest
import torch
import zarr

from stoker import Pipeline
from stoker.bench.fields import MASK_SCALE, FieldCrops, TensorstoreFields, prepare, stoker_config
from stoker.bench.runner import split_batches as split
from stoker.cli import main
from stoker.engine.batch import to_tensors

PEERS = {11: ("stoker", "stoker (no mask)", "tensorstore", "zarr+DataLoader"),
         12: ("stoker", "tensorstore", "xarray+DataLoader")}


def rate(out: str, scenario: int, peer: str) -> float:
    table = out.split(f"Scenario {scenario}:")[1]
    found = re.findall(rf"^{re.escape(peer)}\s+(\d+\.\d)\s", table, re.M)
    assert found, (peer, out)
    return float(found[0])


@pytest.mark.timeout(300)
def test_bench_tiny_fields_scenarios(tmp_path, capsys):
    assert main(["bench", "--tiny", "--scenarios", "11,12", "--rounds", "1", "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for number, peers in PEERS.items():
        for peer in peers:
            assert rate(out, number, peer) > 0, (number, peer, out)
    assert re.search(r"^mask sampling: stoker with the mask at \d+\.\d\dx the same boxes", out, re.M), out
    assert len(re.findall(r"^stoker per batch: \d+\.\d+ ms CPU", out, re.M)) == 2, out


@pytest.mark.parametrize("argv", [["--store", "http"], ["--device", "cuda"], ["--threads", "2"], ["--thread-cpu"]])
def test_bench_fields_refuses_options_they_do_not_take(tmp_path, capsys, argv):
    assert main(["bench", "--tiny", "--scenarios", "11", *argv, "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scenarios 11" in err and argv[0] in err, err


def _stoker_batch(sc, samples):
    with Pipeline(stoker_config(sc)) as p:
        p.push(samples)
        with p.pop(timeout=60) as batch:
            return {k: v.clone() for k, v in to_tensors(batch).items()}


@pytest.mark.timeout(300)
def test_bench_fields_peers_read_what_stoker_reads(tmp_path):
    # scenario 11: raw u16 -> f32 and labels u64 (ids past 2**40) -> i64, centred; drawn by the mask
    sc, run = prepare(11, tmp_path, tiny=True)
    batch = split(run["samples"], sc.batch_size)[0]
    ours = _stoker_batch(sc, batch)
    assert ours["raw"].dtype == torch.float32 and ours["labels"].dtype == torch.int64
    assert int(ours["labels"].max()) > 2**40  # the ids survive: no float on the way
    ts = TensorstoreFields({"raw": np.float32, "labels": np.int64}, run["paths"]["mask"])
    theirs = ts.assemble(ts.issue(batch), batch)
    loader = torch.utils.data.DataLoader(FieldCrops(batch, run["paths"]["mask"]), batch_size=sc.batch_size)
    dl = next(iter(loader))
    raw, labels, mask = (zarr.open_array(run["paths"][k], mode="r") for k in ("raw", "labels", "mask"))
    for i, s in enumerate(batch):
        (z0, z1), (y0, y1), (x0, x1) = s["labels"].aabb
        r0 = s["raw"].aabb
        assert [a - b for (a, _), (b, _) in zip(s["labels"].aabb, r0)] == [8, 8, 8]  # centred
        want_raw = raw[tuple(slice(a, b) for a, b in r0)].astype(np.float32)
        want_labels = labels[z0:z1, y0:y1, x0:x1].astype(np.int64)
        for got in (ours["raw"][i].numpy(), theirs["raw"][i], dl["raw"][i].numpy()):
            np.testing.assert_array_equal(got, want_raw)
        for got in (ours["labels"][i].numpy(), theirs["labels"][i], dl["labels"][i].numpy()):
            np.testing.assert_array_equal(got, want_labels)
        m = mask[z0 // MASK_SCALE:z1 // MASK_SCALE, y0 // MASK_SCALE:y1 // MASK_SCALE, x0 // MASK_SCALE:x1 // MASK_SCALE]
        assert np.count_nonzero(m) / m.size >= 0.25  # the mask let it through
        assert theirs["coverage"][i] == float(dl["coverage"][i]) == np.count_nonzero(m) / m.size

    # scenario 12: 4 variables, 2 input steps and the target 6 steps after the input's last
    sc, run = prepare(12, tmp_path, tiny=True)
    batch = split(run["samples"], sc.batch_size)[0]
    ours = _stoker_batch(sc, batch)
    ts = TensorstoreFields({"input": np.float32, "target": np.float32})
    theirs = ts.assemble(ts.issue(batch), batch)
    dl = next(iter(torch.utils.data.DataLoader(FieldCrops(batch, xarray_store=run["paths"]["store"]),
                                               batch_size=sc.batch_size)))
    import xarray as xr

    ds = xr.open_zarr(run["paths"]["store"])
    for i, s in enumerate(batch):
        (t0, t1), _, _ = s["input"].aabb
        assert s["target"].aabb[0] == (t1 + 5, t1 + 6)
        for name, (a, b) in (("input", (t0, t1)), ("target", (t1 + 5, t1 + 6))):
            want = ds[["t2m", "u10", "v10", "msl"]].isel(time=slice(a, b)).to_array().values
            assert want.shape == (4, b - a, 46, 90)
            for got in (ours[name][i].numpy(), theirs[name][i], dl[name][i].numpy()):
                np.testing.assert_array_equal(got, want)
