"""Keyed transforms: per-sample keys through a real Pipeline (resumed on another world size, batches
finishing out of order), RandomFlip / RandomTranspose against numpy per sample, on dict batches of related
fields, on CPU and CUDA; ``field=`` of Normalize and FillNaN; docs/augmentation.md's examples and the MONAI
recipe."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.transforms import (Compose, FillNaN, Keyed, Normalize, RandomFlip, RandomTranspose, apply, takes_keys,
                               uniform)

pytestmark = pytest.mark.timeout(120)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "augmentation.md"


def _keys(n, epoch=0, start=0):
    return np.stack([np.full(n, epoch, np.int64), np.arange(start, start + n, dtype=np.int64)], axis=1)


# -- draws -------------------------------------------------------------------------------------------


def test_uniform_is_a_function_of_the_key_alone():
    keys = np.array([[0, 0], [0, 1], [1, 0], [7, 123456789], [0, 2**40]])
    u = uniform(keys, seed=0, n=3)
    assert u.shape == (5, 3) and u.dtype == np.float64 and ((u >= 0) & (u < 1)).all()
    # each row depends on its own key only: any other batch composition gives the same rows
    assert np.array_equal(uniform(keys[::-1], seed=0, n=3), u[::-1])
    assert np.array_equal(uniform(keys[3:4], seed=0, n=3), u[3:4])
    assert np.array_equal(uniform(torch.from_numpy(keys), seed=0, n=3), u)  # a tensor of keys reads the same
    # epoch, index, seed, salt and the draw's number each change it
    assert len({float(v) for v in u.ravel()}) == u.size
    assert not np.isin(uniform(keys, seed=1, n=3), u).any()
    assert not np.isin(uniform(keys, seed=0, n=3, salt=1), u).any()
    many = uniform(_keys(20000), seed=5)[:, 0]
    assert abs(many.mean() - 0.5) < 0.01 and abs((many < 0.25).mean() - 0.25) < 0.015


@pytest.mark.parametrize("bad", [0.5, 2**63, -2**63 - 1, "1", True, None])
def test_uniform_refuses_a_seed_or_salt_that_is_no_int64(bad):
    """A float seed was truncated (0.5 drew what 0 draws) and one past int64 was numpy's OverflowError."""
    keys = _keys(3)
    with pytest.raises(stoker.InvalidArgument, match="seed must be an int64 integer"):
        uniform(keys, seed=bad)
    with pytest.raises(stoker.InvalidArgument, match="salt must be an int64 integer"):
        uniform(keys, seed=0, salt=bad)
    assert np.array_equal(uniform(keys, seed=np.int64(7)), uniform(keys, seed=7))


def test_flip_draws_follow_p():
    keys = _keys(4000)
    assert RandomFlip(seed=0, p=0.0).draws(keys).sum() == 0
    assert RandomFlip(seed=0, p=1.0).draws(keys).all()
    d = RandomFlip(axes=(-3, -2, -1), seed=0, p=0.3).draws(keys)
    assert d.shape == (4000, 3) and np.allclose(d.mean(axis=0), 0.3, atol=0.03)
    assert not np.array_equal(d, RandomFlip(axes=(-3, -2, -1), seed=1, p=0.3).draws(keys))
    orders = RandomTranspose(axes=(-3, -2, -1), seed=0).draws(keys)
    assert np.allclose(np.bincount(orders, minlength=6) / 4000, 1 / 6, atol=0.03)


# -- on tensors and dicts of fields -----------------------------------------------------------------


def _flip_oracle(x, flips, axes):
    out = x.copy()
    for i in range(len(x)):
        ax = tuple(a for a, f in zip(axes, flips[i]) if f)
        if ax:
            out[i] = np.flip(x[i], ax)
    return out


def _transpose_oracle(x, orders, axes, table):
    out = x.copy()
    for i in range(len(x)):
        sample = x[i]
        dims = list(range(sample.ndim))
        pos = [sample.ndim + a for a in axes]
        for k, p in enumerate(pos):
            dims[p] = pos[table[orders[i]][k]]
        out[i] = np.transpose(sample, dims)
    return out


def _fields(rng, b=16):
    raw = rng.normal(0, 1, (b, 12, 10, 8)).astype(np.float32)
    return {
        "raw": torch.from_numpy(raw.copy()),
        "labels": torch.from_numpy(raw[:, 2:10, 2:8, 1:7].copy()),  # centred in raw on every axis
        "two": torch.from_numpy(np.stack([raw, -raw], axis=1)),  # a field with a channel axis
    }, raw


def test_random_flip_is_the_same_for_every_field_of_a_sample(rng):
    batch, raw = _fields(rng)
    flip = RandomFlip(axes=(-3, -2, -1), seed=3)
    keys = _keys(16, epoch=2, start=40)
    flips = flip.draws(keys)
    assert 0 < flips.sum() < flips.size and len({tuple(f) for f in flips}) > 3  # groups of several draws
    ptrs = {k: v.data_ptr() for k, v in batch.items()}
    assert flip(batch, keys) is batch
    assert {k: v.data_ptr() for k, v in batch.items()} == ptrs  # in place
    want = _flip_oracle(raw, flips, (-3, -2, -1))
    np.testing.assert_array_equal(batch["raw"].numpy(), want)
    # the labels field is still the centre of the raw one, and each channel of "two" still raw and -raw
    assert torch.equal(batch["labels"], batch["raw"][:, 2:10, 2:8, 1:7])
    assert torch.equal(batch["two"][:, 0], batch["raw"]) and torch.equal(batch["two"][:, 1], -batch["raw"])
    # a plain tensor batch gets the same flips
    plain = torch.from_numpy(raw.copy())
    flip(plain, keys)
    assert torch.equal(plain, batch["raw"])


def test_random_transpose_is_the_same_for_every_field_of_a_sample(rng):
    raw = rng.normal(0, 1, (12, 3, 8, 8, 8)).astype(np.float32)  # (B, C, Z, Y, X), cubic
    batch = {"raw": torch.from_numpy(raw.copy()), "labels": torch.from_numpy(raw[:, 0, 2:6, 2:6, 2:6].copy())}
    t = RandomTranspose(axes=(-3, -2, -1), seed=4)
    keys = _keys(12, start=100)
    orders = t.draws(keys)
    assert len(set(orders.tolist())) >= 4  # several permutations, the identity possibly among them
    t(batch, keys)
    np.testing.assert_array_equal(batch["raw"].numpy(), _transpose_oracle(raw, orders, (-3, -2, -1), t.orders))
    assert torch.equal(batch["labels"], batch["raw"][:, 0, 2:6, 2:6, 2:6])


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_unsigned_label_ids_are_flipped_and_transposed_exactly(tmp_path, dtype):
    """Label ids stored as uint16/32/64 (``dtype='native'``) move with the raw field bit for bit, ids near
    the dtype's top included (torch has no flip or index_copy for these dtypes on every axis)."""
    shape, box = (16, 32, 32), (8, 12, 12)
    rng = np.random.default_rng(7)
    raw_uri, lab_uri = str(tmp_path / "raw.zarr"), str(tmp_path / "lab.zarr")
    raw = zarr.create_array(raw_uri, shape=shape, chunks=(8, 16, 16), dtype="float32")
    raw[:] = rng.normal(0, 1, shape).astype(np.float32)
    lab = zarr.create_array(lab_uri, shape=shape, chunks=(8, 16, 16), dtype=dtype)
    top = np.iinfo(dtype).max
    lab[:] = np.asarray(top, dtype=dtype) - rng.integers(0, 5000, shape).astype(dtype)
    labels = lab[:]
    fields = {"raw": stoker.Field(raw_uri, box), "labels": stoker.Field(lab_uri, box)}
    source = stoker.RandomCrops(fields, seed=2, samples_per_epoch=16)
    flip, turn = RandomFlip(axes=(-3, -2, -1), seed=5), RandomTranspose(axes=(-2, -1), seed=6)
    cfg = _cfg(batch_size=8, dtype={"raw": "f32", "labels": "native"}, transform=[flip, turn])
    seen = 0
    with stoker.Pipeline(cfg) as p:
        p.push(source.for_rank(0, 1))
        for batch in p.batches(2):
            got = torch.from_dlpack(batch["labels"]).numpy()
            assert got.dtype == np.dtype(dtype)
            keys = batch.sample_keys
            want = np.stack([_read(labels, s.fields["labels"]) for s in batch.samples])
            want = _flip_oracle(want, flip.draws(keys), flip.axes)
            want = _transpose_oracle(want, turn.draws(keys), turn.axes, turn.orders)
            np.testing.assert_array_equal(got, want)
            seen += len(got)
    assert seen == 16


def test_compose_passes_keys_on_and_plain_callables_stay_plain(rng):
    seen = []

    class Record(Keyed):
        def __call__(self, x, keys):
            seen.append(("keyed", keys.copy()))
            return x

    def plain(x, extra="default"):  # a second parameter with a default: still called t(batch)
        seen.append(("plain", extra))
        return x

    keys = _keys(3, epoch=1)
    x = torch.zeros(3, 4)
    c = Compose([plain, Record(), RandomFlip(axes=(-1,), seed=0, p=1.0)])
    assert takes_keys(c) and not takes_keys(plain)
    x[:, 0] = 1.0
    assert apply(c, x, keys) is x
    assert seen[0] == ("plain", "default") and seen[1][0] == "keyed" and np.array_equal(seen[1][1], keys)
    assert torch.equal(x[:, -1], torch.ones(3)) and torch.equal(x[:, 0], torch.zeros(3))  # flipped, p=1
    # a plain callable returning a new dict of fields has it copied back; other fields are an error
    batch = {"a": torch.zeros(2, 3), "b": torch.ones(2, 3)}
    before = batch["a"]
    assert apply(lambda d: {"a": d["a"] + 1, "b": d["b"]}, batch) is batch and batch["a"] is before
    assert torch.equal(before, torch.ones(2, 3))
    with pytest.raises(stoker.InvalidArgument, match=r"returned fields \['a'\]"):
        apply(lambda d: {"a": d["a"]}, batch)
    with pytest.raises(stoker.InvalidArgument, match="field 'b' of a batch of torch.float32"):
        apply(lambda d: {"a": d["a"], "b": d["b"].double()}, batch)


def test_keyed_transform_errors(rng):
    x = torch.zeros(4, 8, 6)
    with pytest.raises(stoker.InvalidArgument, match=r"sizes \[8, 6\] on those axes.*one size"):
        RandomTranspose(axes=(-2, -1))(x, _keys(4))
    with pytest.raises(stoker.InvalidArgument, match="field 'labels' of shape"):
        RandomTranspose(axes=(-2, -1))({"raw": torch.zeros(4, 6, 6), "labels": torch.zeros(4, 6, 5)}, _keys(4))
    with pytest.raises(stoker.InvalidArgument, match="too few axes"):
        RandomTranspose(axes=(-3, -2, -1))(torch.zeros(4, 6, 6), _keys(4))
    with pytest.raises(stoker.InvalidArgument, match=r"RandomFlip\(axes=\(-3,\)\): field 'raw' .* too few axes"):
        RandomFlip(axes=(-3,))({"raw": torch.zeros(4, 6, 6)}, _keys(4))
    with pytest.raises(stoker.InvalidArgument, match="needs the batch's per-sample keys"):
        RandomFlip()(torch.zeros(4, 2, 2, 2))
    with pytest.raises(stoker.InvalidArgument, match="3 keys for a batch of 4 samples"):
        RandomFlip()(torch.zeros(4, 2, 2, 2), _keys(3))
    with pytest.raises(stoker.InvalidArgument, match=r"shape \(4,\)"):
        RandomFlip()(torch.zeros(4, 2, 2, 2), np.arange(4))
    with pytest.raises(stoker.InvalidArgument, match="negative integers"):
        RandomTranspose(axes=(1, 2))
    with pytest.raises(stoker.InvalidArgument, match="2 or more"):
        RandomTranspose(axes=(-1,))
    with pytest.raises(stoker.InvalidArgument, match="distinct"):
        RandomFlip(axes=(-1, -1))
    with pytest.raises(stoker.InvalidArgument, match="probability"):
        RandomFlip(p=1.5)
    with pytest.raises(stoker.InvalidArgument, match="seed"):
        RandomFlip(seed=0.5)  # type: ignore[arg-type]


def test_normalize_and_fill_nan_act_on_one_field(rng):
    raw = torch.tensor([[1.0, float("nan"), 3.0]] * 2)
    other = torch.tensor([[float("nan"), 5.0, 7.0]] * 2)
    batch = {"raw": raw.clone(), "other": other.clone()}
    Compose([FillNaN(0.0, field="raw"), Normalize(1.0, 2.0, field="raw")])(batch)
    assert torch.equal(batch["raw"], torch.tensor([[0.0, -0.5, 1.0]] * 2))
    torch.testing.assert_close(batch["other"], other, rtol=0, atol=0, equal_nan=True)  # left alone
    with pytest.raises(stoker.InvalidArgument, match=r"batch of fields \['other', 'raw'\].*field="):
        Normalize(0.0, 1.0)(batch)
    with pytest.raises(stoker.InvalidArgument, match=r"no field 'labels'; its fields are \['other', 'raw'\]"):
        FillNaN(0.0, field="labels")(batch)
    with pytest.raises(stoker.InvalidArgument, match="single tensor"):
        FillNaN(0.0, field="raw")(raw.clone())
    with pytest.raises(stoker.InvalidArgument, match="field must be a field name"):
        Normalize(0.0, 1.0, field=3)  # type: ignore[arg-type]
    with pytest.raises(stoker.InvalidArgument, match="field 'ids' of the batch"):
        Normalize(0.0, 1.0, field="ids")({"ids": torch.zeros(2, 3, dtype=torch.int64)})
    assert "field='raw'" in repr(Normalize(0.0, 1.0, field="raw")) and "field='raw'" in repr(FillNaN(field="raw"))


# -- through a real Pipeline ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed")
    uri = str(root / "v.zarr")
    z = zarr.create_array(uri, shape=(40, 48), chunks=(8, 16), dtype="float32")
    z[:] = np.random.default_rng(1).normal(0, 1, (40, 48)).astype(np.float32)
    return uri, zarr.open_array(uri, mode="r")[:]


def _cfg(**kw):
    base = dict(batch_size=4, dtype="f32", device="cpu", host_buffer_bytes=16 << 20, pop_timeout_s=30.0,
                lookahead_batches=2, n_compute_threads=2, n_io_threads=1)
    base.update(kw)
    return stoker.Config(**base)


def _read(data, sample):
    return data[tuple(slice(a, b) for a, b in sample.aabb)]


def _drain(p, n=None):
    """{key: (sample, tensor)} of the batches popped (all of them, or n)."""
    out = {}
    it = p if n is None else p.batches(n)
    for batch in it:
        x = torch.from_dlpack(batch)
        assert batch.keys.shape == (len(batch), 2) and batch.keys.dtype == np.int64
        for row, key in enumerate(batch.keys.tolist()):
            assert tuple(key) not in out
            out[tuple(key)] = (batch.samples[row], x[row].clone())
    return out


def test_keys_are_epoch_and_index_and_survive_a_resume_on_another_world_size(volume, decode_path):
    """1 rank pops 5 batches and saves; 2 ranks resume from that state. Every sample's key is its
    (epoch, index) in the source's global order, and its flips are those of the uninterrupted run."""
    uri, data = volume
    src = stoker.RandomCrops([uri], (8, 8), seed=5, samples_per_epoch=52)
    flip = RandomFlip(axes=(-2, -1), seed=11)
    cfg = _cfg(transform=[RandomTranspose(axes=(-2, -1), seed=12), flip])
    with stoker.Pipeline(cfg) as p:
        p.push(src.for_rank(0, 1))
        full = _drain(p)
    assert sorted(full) == [(0, i) for i in range(52)]
    for (epoch, index), (sample, x) in full.items():
        assert sample == src.sample(epoch, index)  # the key names the sample
    # the transform did something, and what the per-sample oracle says
    keys = np.array(sorted(full))
    flips, orders = flip.draws(keys), cfg.transform.transforms[0].draws(keys)
    changed = 0
    for row, key in enumerate(keys.tolist()):
        sample, x = full[tuple(key)]
        want = _read(data, sample)[None]
        want = _transpose_oracle(want, orders[row:row + 1], (-2, -1), cfg.transform.transforms[0].orders)
        want = _flip_oracle(want, flips[row:row + 1], (-2, -1))[0]
        np.testing.assert_array_equal(x.numpy(), want)
        changed += not np.array_equal(want, _read(data, sample))
    assert changed > 26

    with stoker.Pipeline(cfg) as p:
        p.push(src.for_rank(0, 1))
        before = _drain(p, 5)
        state = p.state_dict()["sources"][0]
    after = {}
    for rank in range(2):
        share = src.for_rank(rank, 2)
        share.load_state_dict(state)
        with stoker.Pipeline(cfg) as p:
            p.push(share)
            got = _drain(p)
        assert len(got) == 16 and not set(got) & set(after)
        after.update(got)
    assert sorted(list(before) + list(after)) == sorted(full)  # the epoch once, nothing repeated
    for key, (sample, x) in {**before, **after}.items():
        assert sample == full[key][0] and torch.equal(x, full[key][1])


def test_keys_cross_epochs_and_plain_pushes_count_in_push_order(volume):
    uri, _ = volume
    src = stoker.RandomCrops([uri], (8, 8), seed=5, samples_per_epoch=6)
    with stoker.Pipeline(_cfg(batch_size=4)) as p:
        p.push(src.for_rank(1, 2).forever())  # rank 1 of 2: positions 1, 3, 5 of each epoch
        got = [b.keys.tolist() for b in p.batches(3)]
    assert got == [[[0, 1], [0, 3], [0, 5], [1, 1]], [[1, 3], [1, 5], [2, 1], [2, 3]],
                   [[2, 5], [3, 1], [3, 3], [3, 5]]]
    samples = [src.sample(0, i) for i in range(10)]
    with stoker.Pipeline(_cfg(batch_size=4)) as p:
        p.push(samples[:3])
        p.push(iter(samples[3:7]))
        p.push(samples[7])
        p.push(samples[8:])
        batches = [(b.keys.tolist(), list(b.samples)) for b in p.batches(2)]
    assert [k for keys, _ in batches for k in keys] == [[0, i] for i in range(8)]
    assert [s for _, ss in batches for s in ss] == samples[:8]


class _Late(Keyed):
    """Holds back the batches whose first key index is a multiple of 8, so later batches finish first;
    records the order batches finished their transform in."""

    def __init__(self, batch_size):
        self.batch_size, self.finished, self.lock = batch_size, [], threading.Lock()

    def __call__(self, x, keys):
        first = int(keys[0, 1])
        if first % (2 * self.batch_size) == 0:
            time.sleep(0.25)
        with self.lock:
            self.finished.append(first // self.batch_size)
        return x


def test_a_fast_and_a_slow_consumer_see_the_same_draws_as_a_sequential_run(volume, monkeypatch):
    """Batches finish out of order on several threads (the Python path finishes a batch on the thread that
    placed its last chunk); the draws per sample are still the sequential run's, whatever the consumer's
    pace."""
    from stoker.engine.cpu import native

    monkeypatch.setattr(native, "Engine", None)
    uri, _ = volume
    samples = list(stoker.RandomCrops([uri], (8, 8), seed=2, samples_per_epoch=48))
    flips = [RandomFlip(axes=(-2, -1), seed=7), RandomTranspose(axes=(-2, -1), seed=8)]

    def run(consumer_sleep, late, **kw):
        cfg = _cfg(transform=[late, *flips] if late else flips, **kw)
        with stoker.Pipeline(cfg) as p:
            p.push(samples)
            out = []
            for batch in p:
                out.append((batch.keys.copy(), torch.from_dlpack(batch).clone()))
                time.sleep(consumer_sleep)
        return out

    sequential = run(0.0, None, n_compute_threads=1, lookahead_batches=1)
    assert len(sequential) == 12
    for sleep in (0.0, 0.05):
        late = _Late(4)
        got = run(sleep, late, n_compute_threads=4, lookahead_batches=5)
        assert late.finished != sorted(late.finished)  # batches did finish out of order
        assert len(got) == 12
        for (k1, x1), (k2, x2) in zip(sequential, got):
            assert np.array_equal(k1, k2) and torch.equal(x1, x2)


def test_a_keyed_transform_of_ones_own_gets_the_batch_keys(volume, decode_path):
    uri, _ = volume
    seen = []

    class Record(Keyed):
        def __call__(self, x, keys):
            seen.append(keys.copy())
            x[:] = torch.from_numpy(keys[:, 1].astype(np.float32)).view(-1, 1, 1)
            return x

    samples = list(stoker.RandomCrops([uri], (4, 4), seed=2, samples_per_epoch=8))
    with stoker.Pipeline(_cfg(transform=Record())) as p:
        p.push(samples)
        for batch in p:
            x = torch.from_dlpack(batch)
            assert any(np.array_equal(batch.keys, s) for s in seen)
            assert torch.equal(x[:, 0, 0], torch.from_numpy(batch.keys[:, 1].astype(np.float32)))
            with pytest.raises(ValueError):
                batch.keys[0, 0] = 5  # read-only: the transform's and the consumer's are one array


def test_random_transpose_of_unequal_axes_reaches_pop(volume):
    uri, _ = volume
    samples = [stoker.Sample(uri, [(0, 8), (0, 6)])] * 4
    with stoker.Pipeline(_cfg(transform=RandomTranspose(axes=(-2, -1)))) as p:
        p.push(samples)
        with pytest.raises(stoker.InvalidArgument, match=r"sizes \[8, 6\]"):
            p.pop()


def test_the_gpu_decode_executor_passes_the_keys_too(volume, monkeypatch):
    """The GPU-decode executor (run on the host, as tests/gpu does) transforms its placed batch with the
    same keys, so the same draws, as the CPU executor."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.pipeline import facade

    uri, _ = volume
    src = stoker.RandomCrops([uri], (8, 8), seed=6, samples_per_epoch=12)
    t = [RandomTranspose(axes=(-2, -1), seed=3), RandomFlip(axes=(-2, -1), seed=4)]

    def run():
        with stoker.Pipeline(_cfg(transform=t, device_buffer_bytes=16 << 20)) as p:
            p.push(src.for_rank(0, 1))
            return [(b.keys.copy(), torch.from_dlpack(b).clone()) for b in p]

    want = run()
    made = []
    monkeypatch.setattr(facade, "make_executor",
                        lambda cfg, device, stats, store: made.append(GpuDecodeExecutor.on_host(cfg, stats, store))
                        or made[-1])
    got = run()
    assert made and len(got) == len(want) == 3
    for (k1, x1), (k2, x2) in zip(want, got):
        assert np.array_equal(k1, k2) and torch.equal(x1, x2)


# -- CPU and CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda  # (so `pytest -m cuda` runs it; skipped without a GPU by tests/conftest.py)
@pytest.mark.parametrize("decode_on", ["cpu", "gpu"])
def test_draws_are_equal_on_cpu_and_cuda(volume, rng, decode_on):
    if decode_on == "gpu":
        from stoker.engine.gpu import nvcomp

        if not nvcomp.available():
            pytest.skip("nvCOMP is not installed")
    batch, raw = _fields(rng)
    on_gpu = {k: v.cuda() for k, v in batch.items()}
    keys = _keys(16, epoch=3)
    t = Compose([RandomFlip(seed=1), RandomFlip(axes=(-2,), seed=9, p=0.7)])
    t(batch, keys)
    t(on_gpu, keys)
    for k in batch:
        assert torch.equal(batch[k], on_gpu[k].cpu())
    cube = torch.from_numpy(rng.normal(0, 1, (16, 2, 6, 6, 6)).astype(np.float32))
    gpu = cube.cuda()
    RandomTranspose(axes=(-3, -2, -1), seed=3)(cube, keys)
    RandomTranspose(axes=(-3, -2, -1), seed=3)(gpu, keys)
    assert torch.equal(cube, gpu.cpu())
    # through pipelines on each device: the same batches
    uri, _ = volume
    src = stoker.RandomCrops([uri], (8, 8), seed=5, samples_per_epoch=16)
    got = {}
    for device in ("cpu", 0):
        with stoker.Pipeline(_cfg(device=device, decode_on="cpu" if device == "cpu" else decode_on,
                                  transform=[RandomFlip(axes=(-2, -1), seed=4),
                                                            RandomTranspose(axes=(-2, -1), seed=5)])) as p:
            p.push(src.for_rank(0, 1))
            got[device] = [(b.keys.copy(), torch.from_dlpack(b).cpu().clone()) for b in p]
    assert len(got["cpu"]) == 4
    for (k1, x1), (k2, x2) in zip(got["cpu"], got[0]):
        assert np.array_equal(k1, k2) and torch.equal(x1, x2)


# -- docs/augmentation.md ------------------------------------------------------------------------------


def _blocks():
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_augmentation_page_examples_run(tmp_path, monkeypatch, capsys):
    blocks = _blocks()
    assert len(blocks) == 4 and "class MonaiDict" in blocks[3]
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs"}
    for block in blocks[:3]:
        exec(compile(block, str(PAGE), "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    refused = ("RandomFlip(axes=(-3, -2, -1), seed=1, p=0.5): RandomCrops volume 0: the fields' boxes have other "
               "centres on axes (-3, -2, -1) (reference voxels from the anchor: 'raw' (16, 16, 16), 'labels' "
               "(8, 8, 8))")
    assert printed == ["[[0, 4], [0, 5], [0, 6], [0, 7]]", "[[0, 9], [0, 11], [0, 13], [0, 15]]", refused, "True"]
    gain = namespace["RandomGain"](seed=3)
    x = torch.ones(3, 2, 2)
    gain(x, _keys(3))
    assert ((x[:, 0, 0] >= 0.9) & (x[:, 0, 0] < 1.1)).all() and len(set(x[:, 0, 0].tolist())) == 3
    assert torch.equal(x, namespace["RandomGain"](seed=3)(torch.ones(3, 2, 2), _keys(3)))


def test_monai_recipe_runs_dictionary_transforms_on_a_dict_batch(rng):
    pytest.importorskip("monai")  # in the test extra: runs wherever the project's test deps are installed
    from monai import transforms as mt

    namespace = {"__name__": "docs"}
    exec(compile(_blocks()[3], str(PAGE), "exec"), namespace)
    names = ["raw", "labels"]
    make = lambda seed: namespace["MonaiDict"](mt.Compose([  # noqa: E731
        mt.RandFlipd(keys=names, prob=0.5, spatial_axis=0), mt.RandRotate90d(keys=names, prob=0.5,
                                                                             spatial_axes=(1, 2))]), seed=seed)
    raw = rng.normal(0, 1, (8, 10, 12, 12)).astype(np.float32)
    labels = (raw[:, 2:8, 3:9, 3:9] > 0).astype(np.int64)  # centred, no channel axis (MONAI gets one added)
    batch = {"raw": torch.from_numpy(raw[:, None].copy()), "labels": torch.from_numpy(labels.copy())}
    ptr = batch["raw"].data_ptr()
    keys = _keys(8, epoch=1)
    assert apply(make(0), batch, keys) is batch and batch["raw"].data_ptr() == ptr
    assert batch["labels"].dtype == torch.int64
    assert torch.equal(batch["labels"], (batch["raw"][:, 0, 2:8, 3:9, 3:9] > 0).long())  # aligned
    changed = [not np.array_equal(batch["raw"][i, 0].numpy(), raw[i]) for i in range(8)]
    assert any(changed) and not all(changed)
    # each sample's draw is its key's: the second half alone, in another batch, comes out the same
    again = {"raw": torch.from_numpy(raw[4:, None].copy()), "labels": torch.from_numpy(labels[4:].copy())}
    make(0)(again, keys[4:])
    assert torch.equal(again["raw"], batch["raw"][4:]) and torch.equal(again["labels"], batch["labels"][4:])


def test_monai_recipe_in_a_pipeline_moves_uint32_label_ids_and_refuses_a_new_shape(tmp_path):
    """The recipe through a real Pipeline: uint32 label ids (native) move with the raw field bit for bit (the
    labels are the raw float32's bits, so ids past 2**31 too); a MONAI transform that changes a field's shape
    (rot90 of z and y on an anisotropic (4, 8, 8) box) is an InvalidArgument at pop, not torch's copy error."""
    pytest.importorskip("monai")
    from monai import transforms as mt

    namespace = {"__name__": "docs"}
    exec(compile(_blocks()[3], str(PAGE), "exec"), namespace)
    shape = (8, 24, 24)
    raw = np.random.default_rng(4).normal(0, 1, shape).astype(np.float32)
    raw_uri, lab_uri = str(tmp_path / "raw.zarr"), str(tmp_path / "lab.zarr")
    zarr.create_array(raw_uri, shape=shape, chunks=(4, 8, 8), dtype="float32")[:] = raw
    zarr.create_array(lab_uri, shape=shape, chunks=(4, 8, 8), dtype="uint32")[:] = raw.view(np.uint32)
    fields = {"raw": stoker.Field(raw_uri, (4, 8, 8)), "labels": stoker.Field(lab_uri, (4, 8, 8))}
    source = stoker.RandomCrops(fields, seed=1, samples_per_epoch=8)
    names = ["raw", "labels"]
    turn = namespace["MonaiDict"](mt.Compose([mt.RandFlipd(keys=names, prob=0.5, spatial_axis=0),
                                              mt.RandRotate90d(keys=names, prob=0.5, spatial_axes=(1, 2))]), seed=0)
    changed = 0
    with stoker.Pipeline(_cfg(dtype={"raw": "f32", "labels": "native"}, transform=turn)) as p:
        p.push(source.for_rank(0, 1))
        for batch in p.batches(2):
            x, ids = torch.from_dlpack(batch["raw"]).numpy(), torch.from_dlpack(batch["labels"]).numpy()
            assert ids.dtype == np.uint32 and np.array_equal(ids, x.view(np.uint32))
            changed += sum(not np.array_equal(x[i], _read(raw, s.fields["raw"])) for i, s in enumerate(batch.samples))
    assert changed
    reshape = namespace["MonaiDict"](mt.RandRotate90d(keys=["raw"], prob=1.0, spatial_axes=(0, 1)), seed=0)
    with stoker.Pipeline(_cfg(transform=reshape)) as p:
        p.push(stoker.RandomCrops({"raw": fields["raw"]}, seed=1, samples_per_epoch=4).for_rank(0, 1))
        with pytest.raises(stoker.InvalidArgument, match=r"field 'raw'.*\(1, 4, 8, 8\).*\(1, 8, 4, 8\)"):
            p.pop()


def test_a_batch_of_fields_carries_the_sources_keys_and_stays_a_mapping(tmp_path):
    """Each field's Batch.keys and FieldBatch.sample_keys are the samples' (epoch, index) from the source; the
    FieldBatch is still a plain mapping (``dict(batch)``, ``batch.keys()`` are its field names)."""

    raw = str(tmp_path / "raw.zarr")
    zarr.create_array(raw, shape=(32, 32), chunks=(8, 8), dtype="u2")[:] = np.arange(1024, dtype="u2").reshape(32, 32)
    fields = {"a": stoker.Field(raw, (8, 8)), "b": stoker.Field(raw, (4, 4), offset=(2, 2))}
    source = stoker.RandomCrops(fields, seed=3, samples_per_epoch=8).for_rank(0, 1)
    source.set_epoch(2)
    with stoker.Pipeline(stoker.Config(batch_size=4, dtype="f32", device="cpu")) as p:
        p.push(source)
        with p.pop() as batch:
            assert list(batch.keys()) == ["a", "b"] and set(dict(batch)) == {"a", "b"}
            want = [[2, i] for i in range(4)]
            assert batch.sample_keys.tolist() == want
            assert batch["a"].keys.tolist() == want and batch["b"].keys.tolist() == want
