"""``Config(transform=...)`` and the built-ins of ``stoker.transforms``: numerics against numpy on zarr-python
reads, on both decode paths, in place in the batch's slot; typed errors for what does not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.records.stats import FieldStats
from stoker.transforms import Compose, FillNaN, Normalize

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf")
    rng = np.random.default_rng(3)
    a = zarr.create_array(str(root / "a.zarr"), shape=(16, 24), chunks=(8, 8), dtype="float32")
    a[:] = rng.normal(10, 2, (16, 24)).astype("float32")
    a[0:3, 5:9] = np.nan
    b = zarr.create_array(str(root / "b.zarr"), shape=(16, 24), chunks=(4, 12), dtype="int16")
    b[:] = rng.integers(-50, 50, (16, 24), dtype="int16")
    uris = [str(root / "a.zarr"), str(root / "b.zarr")]
    return uris, [zarr.open_array(u, mode="r")[:] for u in uris]


BOXES = [[(0, 8), (0, 12)], [(4, 12), (6, 18)], [(8, 16), (12, 24)]]


def _run(samples, **cfg):
    base = dict(batch_size=len(samples), dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0,
                host_buffer_bytes=32 << 20)
    base.update(cfg)
    with stoker.Pipeline(stoker.Config(**base)) as p:
        p.push(samples)
        with p.pop() as batch:
            x = torch.from_dlpack(batch)
            slot_ptr = x.data_ptr()
            # the ring's slots as they are now: a closed pipeline hands its free slots to the next (SPARE_SLOTS)
            slots = [(s.tensor.data_ptr(), s.tensor.dtype) for s in p._host_slots.slots]
            return x.clone(), slot_ptr, slots, p.stats()


def _oracle(data):
    return np.stack([np.stack([d[tuple(slice(*ax) for ax in box)].astype(np.float32) for d in data])
                     for box in BOXES])


def test_fill_then_normalize_per_channel(pair, decode_path):
    uris, data = pair
    mean, std = [10.0, -1.0], [2.0, 25.0]
    x, ptr, slots, stats = _run([stoker.Sample(uris, box) for box in BOXES],
                                transform=[FillNaN(-7.0), Normalize(mean, std)])
    want = _oracle(data)
    want = np.where(np.isnan(want), np.float32(-7.0), want)
    want = (want - np.array(mean, np.float32)[None, :, None, None]) / np.array(std, np.float32)[None, :, None, None]
    assert not torch.isnan(x).any()
    np.testing.assert_array_equal(x.numpy(), want)  # same float32 operations, same order
    # in place: the batch the consumer got is the slot, no other batch-sized buffer
    assert any(at == ptr for at, _ in slots)
    assert stats.stages["transform"].count == 1


def test_bf16_batches_and_a_function_returning_a_new_tensor(pair, decode_path):
    uris, data = pair
    x, _, _, _ = _run([stoker.Sample(uris[0], box) for box in BOXES], dtype="bf16",
                      transform=lambda b: torch.nan_to_num(b, nan=1.0) * 2)  # not in place: copied back
    want = torch.from_numpy(np.nan_to_num(_oracle(data[:1])[:, 0], nan=1.0)).to(torch.bfloat16) * 2
    assert x.dtype == torch.bfloat16 and torch.equal(x, want)


def test_a_transform_returning_a_view_of_the_batch_has_it_copied_back(pair, decode_path):
    """``lambda b: b.transpose(-2, -1)`` returns a tensor of the batch's shape that is a view of the slot:
    copied back as a new tensor is (through a copy, not over itself), on a batch tensor and on a field."""
    uris, data = pair
    boxes = [[(0, 8), (0, 8)], [(4, 12), (6, 14)]]
    x, ptr, _, _ = _run([stoker.Sample(uris[0], box) for box in boxes], transform=lambda b: b.transpose(-2, -1))
    want = np.stack([data[0][tuple(slice(*ax) for ax in box)] for box in boxes]).transpose(0, 2, 1)
    np.testing.assert_array_equal(x.numpy(), want)
    sample = stoker.Sample({"raw": (uris[0], boxes[0]), "ids": (uris[1], boxes[1])})
    cfg = stoker.Config(batch_size=1, dtype={"raw": "f32", "ids": "native"}, device="cpu",
                        transform=lambda b: {name: t.mT for name, t in b.items()})
    with stoker.Pipeline(cfg) as p:
        p.push([sample])
        with p.pop() as batch:
            raw, ids = torch.from_dlpack(batch["raw"]).numpy(), torch.from_dlpack(batch["ids"]).numpy()
            np.testing.assert_array_equal(raw[0], data[0][0:8, 0:8].T)
            np.testing.assert_array_equal(ids[0], data[1][4:12, 6:14].T)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_16_bit_batch_is_transformed_in_float32_and_rounded_once(tmp_path, decode_path, dtype):
    """Values near 280 are 2 apart in bfloat16: normalising after that rounding would be ~45 times off. The
    batch is made and transformed in a float32 work slot, then cast once into the delivered slot."""
    z = zarr.create_array(str(tmp_path / "t.zarr"), shape=(4, 64), chunks=(2, 32), dtype="float32")
    z[:] = np.linspace(270, 290, 256, dtype=np.float32).reshape(4, 64)
    seen = []

    def spy(b):
        seen.append(b.dtype)
        return b

    samples = [stoker.Sample(str(tmp_path / "t.zarr"), [(r, r + 2), (0, 64)]) for r in (0, 2)]
    x, ptr, work, stats = _run(samples, dtype=dtype, transform=[spy, Normalize(280.0, 12.0)])
    want = ((torch.from_numpy(z[:].reshape(2, 2, 64)) - 280.0) / 12.0).to(x.dtype)
    assert seen == [torch.float32] and x.dtype == want.dtype and torch.equal(x, want)
    assert work and all(dt == torch.float32 and at != ptr for at, dt in work)
    assert stats.stages["transform"].count == 1
    # the float32 work slots count against host_buffer_bytes: lookahead_batches of them
    with pytest.raises(stoker.BudgetExceeded, match="float32 work slots for the transform"):
        stoker.Pipeline(stoker.Config(batch_size=8, dtype=dtype, device="cpu", sample_shape=(64, 64, 64),
                                      lookahead_batches=2, host_buffer_bytes=20 << 20, transform=Normalize(0, 1)))
    stoker.Pipeline(stoker.Config(batch_size=8, dtype=dtype, device="cpu", sample_shape=(64, 64, 64),
                                  lookahead_batches=2, host_buffer_bytes=20 << 20)).close()  # 3 x 4 MiB fit


def test_a_16_bit_field_is_transformed_as_delivered_and_an_f32_field_exactly(tmp_path):
    """What the docs say of a batch of named fields: the transform runs at pop on each field in its output
    dtype, so a bf16 field is rounded before Normalize (values near 280 are 2 apart), and a field asked
    for as 'f32' is normalised from its float32 values."""
    uri = str(tmp_path / "t.zarr")
    z = zarr.create_array(uri, shape=(4, 64), chunks=(2, 32), dtype="float32")
    z[:] = np.linspace(270, 290, 256, dtype=np.float32).reshape(4, 64)
    seen = {}

    def spy(b):
        seen.update({name: t.dtype for name, t in b.items()})
        return b

    sample = stoker.Sample({name: (uri, [(0, 2), (0, 64)]) for name in ("raw", "copy")})
    norm = [spy, Normalize(280.0, 3.0, field="raw"), Normalize(280.0, 3.0, field="copy")]
    cfg = stoker.Config(batch_size=1, dtype={"raw": "bf16", "copy": "f32"}, device="cpu", transform=norm)
    with stoker.Pipeline(cfg) as p:
        p.push([sample])
        with p.pop() as batch:
            raw, copy = torch.from_dlpack(batch["raw"]).clone(), torch.from_dlpack(batch["copy"]).clone()
    assert seen == {"raw": torch.bfloat16, "copy": torch.float32}
    values = torch.from_numpy(z[0:2])[None]
    assert torch.equal(copy, (values - 280.0) / 3.0)
    assert torch.equal(raw, (values.to(torch.bfloat16) - 280.0) / 3.0)  # rounded first, as documented
    assert (raw.float() - copy).abs().max() > 0.1


def test_normalize_of_a_16_bit_field_rounds_once_and_is_not_biased(tmp_path):
    """A bf16 field is normalised at pop in its dtype. Its mean 283.7 was rounded to bfloat16 (284) before
    the subtraction: every value came out 0.1 std too low (a bias, not noise). Normalize now computes in
    float32 and rounds once; in float16 a result past 65504 is an InvalidArgument, never an infinity."""
    uri = str(tmp_path / "t.zarr")
    values = (283.7 + 3 * np.random.default_rng(0).normal(size=(4, 64))).astype(np.float32)
    zarr.create_array(uri, shape=(4, 64), chunks=(2, 32), dtype="float32")[:] = values
    sample = stoker.Sample({"raw": (uri, [(0, 4), (0, 64)])})

    def run(dtype, norm):
        with stoker.Pipeline(stoker.Config(batch_size=1, dtype={"raw": dtype}, device="cpu", transform=norm)) as p:
            p.push([sample])
            with p.pop() as batch:
                return torch.from_dlpack(batch["raw"])[0].clone()

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        got = run(dtype, Normalize(283.7, 3.0, field="raw"))
        want = ((torch.from_numpy(values).to(torch_dtype).float() - 283.7) / 3.0).to(torch_dtype)
        assert got.dtype == torch_dtype and torch.equal(got, want)
        assert abs(got.float().mean().item() - ((values - 283.7) / 3.0).mean()) < 0.05  # was 0.1 off
    with pytest.raises(stoker.InvalidArgument, match=r"float16.*65504"):
        run("f16", Normalize(0.0, 1e-3, field="raw"))


def test_the_gpu_budget_counts_the_float32_work_buffer_of_a_transformed_16_bit_batch():
    """Checked without a GPU (the budget is arithmetic): 3 bf16 slots of 4 MiB, the float32 work buffer
    (8 MiB) and the staging of the cast (4 MiB) pass 20 MiB; without a transform, slots and staging fit."""
    from stoker.engine.stats import StatsRecorder
    from stoker.engine.cuda.transfer import CudaExecutor

    def check(**kw):
        cfg = stoker.Config(batch_size=8, dtype="bf16", lookahead_batches=2, host_buffer_bytes=64 << 20,
                            device_buffer_bytes=20 << 20, **kw)
        CudaExecutor(cfg, torch.device("cuda", 0), StatsRecorder(), None).check_budget((64, 64, 64), torch.bfloat16, 0)

    check()
    with pytest.raises(stoker.BudgetExceeded, match="float32 work for the transform.*needs 25,165,824 B"):
        check(transform=Normalize(0, 1))


def test_normalize_from_compute_stats_result():
    st = FieldStats(torch.tensor(10), torch.tensor([1.0, 2.0], dtype=torch.float64),
                    torch.tensor([0.5, 0.0], dtype=torch.float64), torch.zeros(2), torch.ones(2))
    n = Normalize.from_stats(st)
    x = torch.tensor([[[2.0, 3.0], [4.0, 5.0]]])  # (B=1, C=2, 2)
    assert torch.equal(n(x), torch.tensor([[[2.0, 4.0], [2.0, 3.0]]]))  # std 0: only centred
    assert Normalize(5.0, 2.0)(torch.tensor([[7.0, 9.0]])).tolist() == [[1.0, 2.0]]  # scalars: any batch


def test_normalize_axis_holds_the_channels():
    """axis= names the batch axis of the channels (negative from the end); a count that does not fit there, an
    axis the batch lacks or the samples' axis 0 are typed errors; pickling keeps the axis."""
    import pickle

    x = torch.arange(2 * 3 * 2, dtype=torch.float64).reshape(2, 3, 2)  # (B, N=3, C=2): channels last
    want = (x - torch.tensor([1.0, 2.0])) / torch.tensor([2.0, 4.0])
    n = Normalize([1.0, 2.0], [2.0, 4.0], axis=-1)
    assert torch.equal(n(x.clone()), want)
    assert torch.equal(pickle.loads(pickle.dumps(n))(x.clone()), want) and "axis=-1" in repr(n)
    assert torch.equal(Normalize([1.0, 2.0], [2.0, 4.0], axis=2)(x.clone()), want)
    with pytest.raises(stoker.InvalidArgument, match="2 channels .* has 3 channels on axis 1"):
        Normalize([1.0, 2.0], [2.0, 4.0])(x.clone())
    with pytest.raises(stoker.InvalidArgument, match="has no axis -4"):
        Normalize([1.0, 2.0], [2.0, 4.0], axis=-4)(x.clone())
    for bad in (0, 1.0, True, "last"):
        with pytest.raises(stoker.InvalidArgument, match="axis must be"):
            Normalize(0.0, 1.0, axis=bad)


def test_from_stats_checks_the_batch_has_the_axes_of_the_array_s_crops():
    """Statistics along an axis of one 2-d array (Y, C) fit (B, Y, C) batches; a (B, A, Y, C) batch of two
    arrays would have both normalised with one array's numbers: an InvalidArgument, unless axis= says so."""
    two = torch.tensor([1.0, 2.0], dtype=torch.float64)
    st = FieldStats(torch.tensor(10), two, two * 2, two, two, channel_axis=-1, ndim=2)
    x = torch.arange(2 * 3 * 2, dtype=torch.float64).reshape(2, 3, 2)  # (B, Y=3, C=2)
    assert torch.equal(Normalize.from_stats(st)(x.clone()), (x - two) / (two * 2))
    several = x.reshape(2, 1, 3, 2).expand(2, 2, 3, 2).clone()  # (B, A=2, Y, C)
    with pytest.raises(stoker.InvalidArgument, match=r"one array of 2 axes.*\(B, A, \*box\).*pass axis=-1"):
        Normalize.from_stats(st)(several.clone())
    assert torch.equal(Normalize.from_stats(st, axis=-1)(several.clone()), (several - two) / (two * 2))
    with pytest.raises(ValueError, match="counts from the end"):
        FieldStats(torch.tensor(10), two, two, two, two, channel_axis=1, ndim=2)


def test_from_stats_of_records_normalises_their_channels_on_the_last_axis(tmp_path):
    """The records' statistics are per channel on the last axis (what normalize and a collated (B, N, C) batch
    hold there): from_stats normalised axis 1 instead, silently where N happened to equal C."""
    from stoker.records import Pad, ZarrRecords, compute_stats, normalize

    rng = np.random.default_rng(4)
    for k in range(4):
        g = zarr.open_group(str(tmp_path / f"r{k}"), mode="w")
        g.create_array("x", data=rng.normal([1.0, 50.0, -300.0], [1.0, 10.0, 100.0], size=(3, 3)))
    ds = ZarrRecords(str(tmp_path), fields={"x": ("N", 3)})
    st = compute_stats(ds, ["x"], cache=False)
    assert st["x"].channel_axis == -1
    batch = Pad()([ds[i] for i in range(len(ds))])  # (B=4, N=3, C=3)
    want = torch.stack([normalize(ds[i], st)["x"] for i in range(len(ds))])
    got = Normalize.from_stats(st["x"], field="x")(dict(batch))["x"]
    torch.testing.assert_close(got, want)
    flat = got.reshape(-1, 3)
    torch.testing.assert_close(flat.mean(0), torch.zeros(3, dtype=flat.dtype), atol=1e-9, rtol=0)
    assert compute_stats(ds, ["x"])["x"].channel_axis == -1  # computed, then from the sidecar: the same
    assert compute_stats(ds, ["x"])["x"].channel_axis == -1
    first = st["x"].with_axis(-2, 2)  # per channel along another axis: normalize's last axis would be wrong
    with pytest.raises(stoker.InvalidArgument, match="along axis -2 .* channel_axis=-1"):
        normalize(ds[0], {"x": first})


def test_errors_are_typed_and_reach_pop(pair, decode_path):
    uris, _ = pair
    with pytest.raises(stoker.InvalidArgument, match="3 channels .* has 2 channels"):
        _run([stoker.Sample(uris, box) for box in BOXES], transform=Normalize([0, 0, 0], [1, 1, 1]))
    with pytest.raises(stoker.InvalidArgument, match="has 8 channels on axis 1"):
        _run([stoker.Sample(uris[0], box) for box in BOXES[:1]], batch_size=1,
             transform=Normalize([0, 0], [1, 1]))
    with pytest.raises(stoker.InvalidArgument, match="floating batch"):
        _run([stoker.Sample(uris[1], box) for box in BOXES], dtype="native", transform=Normalize(0, 1))
    with pytest.raises(stoker.InvalidArgument, match="returned shape"):
        _run([stoker.Sample(uris[0], box) for box in BOXES], transform=lambda b: b[:1])
    with pytest.raises(stoker.InvalidArgument, match=r"returned a torch.float32 tensor .* batch of torch.int16.*"
                                                     r"Config\(dtype='f32'\)"):  # not cast back: 0 and 1
        _run([stoker.Sample(uris[1], box) for box in BOXES], dtype="native", transform=lambda b: b / 1000.0)
    with pytest.raises(ZeroDivisionError):  # the user's own error, at pop
        _run([stoker.Sample(uris[0], box) for box in BOXES], transform=lambda b: 1 / 0)


def test_arguments_are_checked():
    with pytest.raises(stoker.InvalidArgument, match="std must be > 0"):
        Normalize([0, 0], [1, 0])
    with pytest.raises(stoker.InvalidArgument, match=r"std of 0 is a constant channel.*1\.0.*from_stats"):
        Normalize([0, 9], [1, 0])  # a constant channel: the message says what to give instead
    with pytest.raises(stoker.InvalidArgument, match="mean has 2 channels, std 3"):
        Normalize([0, 0], [1, 1, 1])
    with pytest.raises(stoker.InvalidArgument, match="FillNaN"):
        FillNaN(float("nan"))
    with pytest.raises(stoker.InvalidArgument, match="Config.transform"):
        stoker.Config(transform=3)
    with pytest.raises(stoker.InvalidArgument, match="callable"):
        stoker.Config(transform=[FillNaN(0), "x"])
    assert isinstance(stoker.Config(transform=[FillNaN(0)]).transform, Compose)
    ints = torch.tensor([1, 2], dtype=torch.int16)
    assert FillNaN(0)(ints) is ints
    inf = torch.tensor([float("inf"), float("nan")])
    assert FillNaN(3)(inf).tolist() == [float("inf"), 3.0]


def test_a_transform_class_given_for_an_instance_is_refused_at_config(pair):
    """``Config(transform=RandomFlip)`` (the class, no parentheses) was called with the batch at the first pop:
    RandomFlip(batch, keys) said "axes must be integers, got tensor([...])" with the batch printed, and
    Normalize(batch) was an untyped TypeError. It is refused when the Config is made, naming the class."""
    from stoker.transforms import RandomFlip

    with pytest.raises(stoker.InvalidArgument, match=r"the class RandomFlip.*RandomFlip\(\.\.\.\)"):
        stoker.Config(transform=RandomFlip)
    with pytest.raises(stoker.InvalidArgument, match=r"the class Normalize.*Normalize\(\.\.\.\)"):
        stoker.Config(transform=[FillNaN(0.0), Normalize])
    with pytest.raises(stoker.InvalidArgument, match="the class FillNaN"):
        Compose([FillNaN])


def test_fill_nan_refuses_a_value_a_16_bit_field_cannot_hold(tmp_path):
    """FillNaN(-99999.0) on an 'f16' field (transformed at pop in float16, whose largest finite value is
    65504) put -inf where the NaN were, silently; it is an InvalidArgument naming the dtype. A value it
    holds is filled as before, and an infinite value is what it says."""
    uri = str(tmp_path / "nan.zarr")
    z = zarr.create_array(uri, shape=(4, 8), chunks=(4, 8), dtype="float32")
    z[:] = np.where(np.arange(32).reshape(4, 8) % 3 == 0, np.nan, 1.0).astype(np.float32)
    sample = stoker.Sample({"raw": (uri, [(0, 4), (0, 8)])})

    def run(value):
        cfg = stoker.Config(batch_size=1, dtype={"raw": "f16"}, device="cpu",
                            transform=FillNaN(value, field="raw"))
        with stoker.Pipeline(cfg) as p:
            p.push([sample])
            with p.pop() as batch:
                return torch.from_dlpack(batch["raw"]).clone()

    with pytest.raises(stoker.InvalidArgument, match=r"FillNaN\(-99999.0.*torch.float16.*65504"):
        run(-99999.0)
    nan = np.isnan(z[:])
    assert torch.equal(run(-7.0)[0], torch.from_numpy(np.where(nan, -7.0, 1.0)).half())
    assert torch.equal(run(float("-inf"))[0], torch.from_numpy(np.where(nan, -np.inf, 1.0)).half())


@pytest.mark.cuda
def test_channels_and_transforms_on_the_gpu(pair):
    """A CUDA pipeline: channels of two dtypes, cast and transformed on the device on the pipeline's stream,
    equal to the CPU pipeline's batch."""
    uris, _ = pair
    samples = [stoker.Sample(uris, box) for box in BOXES]
    tf = [FillNaN(-7.0), Normalize([10.0, -1.0], [2.0, 25.0])]
    cpu, _, _, _ = _run(samples, transform=tf)
    cfg = stoker.Config(batch_size=3, dtype="f32", device="cuda", n_compute_threads=2, pop_timeout_s=20.0,
                        host_buffer_bytes=32 << 20, device_buffer_bytes=32 << 20, transform=tf)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as batch:
            x = torch.from_dlpack(batch).cpu()
    assert x.shape == (3, 2, 8, 12) and torch.equal(x, cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("decode_on", ["cpu", "gpu", "hybrid"])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_uint16_staging_with_a_transform_on_the_gpu(tmp_path, dtype, decode_on):
    """uint16 crosses PCIe as uint16 (or encoded, decode_on="gpu") and is cast on the device; with a
    transform and a 16-bit output it is cast into a float32 work buffer, transformed there and rounded once,
    as the CPU pipeline does. The transform's time is its own stage, not the transfer's."""
    if decode_on in ("gpu", "hybrid"):
        pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")
    z = zarr.create_array(str(tmp_path / "u.zarr"), shape=(8, 64), chunks=(4, 32), dtype="uint16")
    z[:] = np.arange(512, dtype=np.uint16).reshape(8, 64) * 97 + 20000
    samples = [stoker.Sample(str(tmp_path / "u.zarr"), [(r, r + 2), (0, 64)]) for r in (0, 2, 4)]
    tf = Normalize(30000.0, 9000.0)
    cpu, _, _, _ = _run(samples, dtype=dtype, transform=tf)
    cfg = stoker.Config(batch_size=3, dtype=dtype, device="cuda", n_compute_threads=2, pop_timeout_s=20.0,
                        host_buffer_bytes=32 << 20, device_buffer_bytes=32 << 20, transform=tf, decode_on=decode_on)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as batch:
            x = torch.from_dlpack(batch).cpu()
        stats = p.stats()
    assert x.dtype == cpu.dtype and torch.equal(x, cpu)
    assert stats.stages["transform"].count == 1
    if decode_on == "cpu":  # (the GPU decode has no transfer of decoded bytes: they are made on the device)
        assert stats.stages["transfer"].count == 1


@pytest.mark.cuda
def test_a_failing_transform_on_the_gpu_frees_the_staging_slot_behind_its_copy(pair):
    uris, _ = pair
    cfg = stoker.Config(batch_size=3, dtype="f32", device="cuda", n_compute_threads=2, pop_timeout_s=20.0,
                        host_buffer_bytes=32 << 20, device_buffer_bytes=32 << 20, transform=lambda b: 1 / 0,
                        decode_on="cpu")  # the CUDA path's staging ("auto" is the hybrid decode with nvCOMP)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uris[0], box) for box in BOXES])
        with pytest.raises(ZeroDivisionError):
            p.pop()
        staging = p._host_slots.slots
        # released by the copy's own event (the copy may still be reading it), not unfenced by the failure
        assert not any(s.busy for s in staging) and any(s.ready_after is not None for s in staging)
