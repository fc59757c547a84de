"""The fused gather-cast-scatter and fill kernels (stoker.engine.gpu.fused, Triton), the GPU-decode executor's
placement where triton imports, against the torch-op placement they replace (stoker.engine.gpu.place): the
executor run end to end on CPU tensors (gpu.reference.HostDecoder) with ``placement="torch"`` and then
``"fused"``, batches held bit for bit to each other and to zarr-python's crops, in every output dtype (integer
outputs and their range check, padding, fields, channels, CF decoding). Without a GPU the kernels run in
Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; without
``triton`` (CPU builds of torch do not ship it) the tests are skipped."""

from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

pytest.importorskip("triton")

import stoker  # noqa: E402
from stoker.engine.gpu import fused  # noqa: E402
from stoker.engine.gpu import place as gpu_place  # noqa: E402
from stoker.engine.gpu.executor import GpuDecodeExecutor  # noqa: E402
from stoker.engine.pipeline import facade as pipelines  # noqa: E402
from batch_oracle import bits as _bits, expected as _expected, random_crops  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:stoker's GPU decode:RuntimeWarning")]

#: the tests on CPU tensors: Triton runs them only in its interpreter (tests/conftest.py sets TRITON_INTERPRET=1
#: where torch sees no CUDA; on a GPU host the kernels are compiled, and only the `cuda` test below runs)
interpreted = pytest.mark.skipif(not fused.available(torch.device("cpu")),
                                 reason="Triton runs CPU tensors only with TRITON_INTERPRET=1 set before it is imported")

SHAPE, CHUNKS, CROP = (20, 37, 29), (8, 16, 16), (9, 20, 17)
_FLOAT_OUT = ["f32", "bf16", "f16"]
#: the arrays, and the output dtypes each is read into (int32 into floats: with lossy_casts)
SPECS = {"zstd-u16": ("uint16", ZstdCodec(level=3), [*_FLOAT_OUT, "native", "i32", "i64"]),
         "shuffle-i16": ("int16", BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"),
                         [*_FLOAT_OUT, "native", "i32", "i64"]),
         "bitshuffle-f32": ("float32", BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"),
                            [*_FLOAT_OUT, "native"]),
         "lz4-u8": ("uint8", BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), ["f32", "bf16", "i32"]),
         "zstd-i32": ("int32", ZstdCodec(level=1), [*_FLOAT_OUT, "native", "i32", "i64"]),
         "zstd-bool": ("bool", ZstdCodec(level=1), ["f32", "bf16", "native", "i64"])}
CASES = [(name, dtype) for name, (_, _, dtypes) in SPECS.items() for dtype in dtypes]


@pytest.fixture
def placements(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on CPU tensors, placing as
    ``placements.using`` says; ``placements.calls`` counts the calls of each placement function."""

    class Placements:
        using = "torch"
        calls: dict = {}
        made: list = []

    def factory(cfg, device, stats, store):
        Placements.made.append(GpuDecodeExecutor.on_host(cfg, stats, store, placement=Placements.using))
        return Placements.made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    Placements.calls = {}
    def counted(real, key, chunks_at):
        def wrapper(*a):  # counts the chunks placed or filled
            Placements.calls[key] = Placements.calls.get(key, 0) + len(a[chunks_at])
            return real(*a)
        return wrapper

    for module, name in ((fused, "fused"), (gpu_place, "place")):
        monkeypatch.setattr(module, "place", counted(module.place, f"{name}.place", 4))
        monkeypatch.setattr(module, "fill", counted(module.fill, f"{name}.fill", 3))
    return Placements


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """Arrays whose chunks the device decodes (zstd; blosc with byte and bit shuffle, lz4 and zstd), edge
    chunks, and chunks never written (the fill value 7, or True)."""
    root = tmp_path_factory.mktemp("fused")
    made = {}
    for i, (name, (dtype, codec, _)) in enumerate(SPECS.items()):
        fill = True if dtype == "bool" else 7
        z = zarr.create_array(str(root / f"{name}.zarr"), shape=SHAPE, chunks=CHUNKS, dtype=dtype, fill_value=fill,
                              compressors=codec)
        rng = np.random.default_rng(i)
        if dtype == "float32":
            data = rng.normal(0, 300, size=SHAPE).astype(dtype)
            data.reshape(-1)[::97] = np.nan
        elif dtype == "bool":
            data = rng.random(SHAPE) < 0.3
        else:
            data = rng.integers(0, min(np.iinfo(dtype).max, 60000), size=SHAPE).astype(dtype)
        z[8:] = data[8:]  # the first row of chunks is never written: filled
        data[:8] = fill
        made[name] = (str(root / f"{name}.zarr"), data)
    return made


def _samples(uri, n=6, seed=3):
    return random_crops(uri, SHAPE, CROP, n, seed)


def _run(placements, using, samples, dtype, **kw):
    """The batches of ``samples`` (copied out), decoded with the executor placing by ``using``."""
    placements.using = using
    cfg = stoker.Config(**{**dict(batch_size=3, dtype=dtype, device="cpu", n_compute_threads=1, n_io_threads=1,
                                  host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20), **kw})
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        out = []
        for b in p:
            x = torch.from_dlpack(b) if not isinstance(b, stoker.FieldBatch) else b
            out.append({k: torch.from_dlpack(v).clone() for k, v in x.items()} if isinstance(x, stoker.FieldBatch)
                       else x.clone())
        return out


def _same_bits(ref: torch.Tensor, got: torch.Tensor) -> bool:
    """Bit for bit (the dtypes too)."""
    return ref.dtype == got.dtype and ref.shape == got.shape and bool((_bits(ref) == _bits(got)).all())


@interpreted
@pytest.mark.parametrize("name, dtype", CASES)
def test_fused_kernels_place_what_the_torch_ops_place(arrays, placements, name, dtype):
    uri, data = arrays[name]
    samples = _samples(uri)
    lossy = data.dtype == np.int32 and dtype in _FLOAT_OUT  # refused without it (label ids would merge)
    reference = _run(placements, "torch", samples, dtype, lossy_casts=lossy)
    assert placements.made[-1].placement == "torch" and not any(k.startswith("fused") for k in placements.calls)
    placements.calls.clear()
    batches = _run(placements, "fused", samples, dtype, lossy_casts=lossy)
    assert placements.made[-1].placement == "fused"
    # every chunk placed and every missing one filled by the kernels: the torch ops never ran
    assert placements.calls.get("fused.place") and placements.calls.get("fused.fill"), placements.calls
    assert not any(k.startswith("place.") for k in placements.calls), placements.calls
    assert len(batches) == len(reference) == 2
    for ref, got, at in zip(reference, batches, range(0, len(samples), 3)):
        assert _same_bits(ref, got), (name, dtype)  # NaN payloads too: moved as integers or cast from integers
        for row, s in enumerate(samples[at:at + 3]):
            want = _expected(data, s, dtype)
            assert got.dtype == want.dtype
            assert torch.equal(torch.nan_to_num(got[row].double(), 12345.0), torch.nan_to_num(want.double(), 12345.0))


@interpreted
def test_copies_longer_than_a_launch_are_placed_in_parts(arrays, placements, monkeypatch):
    """A copy of more blocks than one launch takes along the grid's second axis (CUDA's 65,535) is placed by
    several launches, each from its first block: here a launch takes 2 blocks of 64 elements."""
    uri, data = arrays["shuffle-i16"]
    samples = _samples(uri)
    reference = _run(placements, "torch", samples, "bf16")
    monkeypatch.setattr(fused, "MAX_BLOCKS", 2)
    monkeypatch.setattr(fused, "BLOCK", 64)
    batches = _run(placements, "fused", samples, "bf16")
    assert batches and all(_same_bits(r, g) for r, g in zip(reference, batches, strict=True))


class _Kernel:
    """Stands in for a Triton kernel: ``warmup`` (the compile) slowed, counted, failing with ``fails``; each
    launch records its constants and whether the launch lock was held."""

    def __init__(self, fails: BaseException | None = None):
        self.fails, self.compiles, self.launches, self.active, self.most = fails, [], [], 0, 0
        self.count = threading.Lock()

    def warmup(self, *args, grid, **constants):
        with self.count:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.05)
        with self.count:
            self.active -= 1
            self.compiles.append(constants["NDIM"])
        if self.fails is not None:
            raise self.fails

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((constants["NDIM"], fused._LAUNCH_LOCK.locked()))


@pytest.fixture
def fresh_variants(monkeypatch):
    """No variant launched or broken yet, and the launches a device's (not the interpreter's: every launch
    of which takes the lock)."""
    monkeypatch.setattr(fused, "_warm", set())
    monkeypatch.setattr(fused, "_broken", {})
    monkeypatch.setattr(fused, "_INTERPRET", False)


def test_a_variant_is_compiled_once_under_the_lock_and_launched_without_it_when_warm(fresh_variants):
    kernel = _Kernel()
    counts = np.array([5000, 10])
    threads = [threading.Thread(target=fused._launch, args=(kernel, counts, torch.zeros(4)), kwargs={"NDIM": n % 2})
               for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(kernel.compiles) == [0, 1] and kernel.most == 1  # two variants, compiled one at a time
    assert len(kernel.launches) == 6
    fused._launch(kernel, counts, torch.zeros(4), NDIM=1)
    assert kernel.launches[-1] == (1, False) and len(kernel.compiles) == 2
    fused._launch(kernel, counts, torch.zeros(4, dtype=torch.int16), NDIM=1)  # another dtype: another variant
    assert kernel.launches[-1] == (1, True) and len(kernel.compiles) == 3


def test_a_variant_that_does_not_compile_is_not_launched_or_compiled_again(fresh_variants):
    kernel = _Kernel(fails=RuntimeError("Failed to find C compiler. Please specify via CC environment variable"))
    for first in (True, False):
        with pytest.raises(fused._CompileFailed, match="Failed to find C compiler") as got:
            fused._launch(kernel, np.array([100]), torch.zeros(4), NDIM=3)
        assert got.value.first is first
    assert kernel.compiles == [3] and not kernel.launches


@interpreted
def test_kernels_triton_cannot_compile_leave_the_placing_to_the_torch_ops(arrays, placements, fresh_variants,
                                                                          monkeypatch):
    """Placement and fill fall back to the torch ops, per variant, with one warning each: the same bits."""
    uri, _ = arrays["zstd-u16"]
    samples = _samples(uri)
    reference = _run(placements, "torch", samples, "bf16")
    monkeypatch.setattr(fused, "_INTERPRET", True)
    error = RuntimeError("PTXAS error: Internal Triton PTX codegen error")
    monkeypatch.setattr(fused, "_gather_cast_scatter", _Kernel(fails=error))
    monkeypatch.setattr(fused, "_fill", _Kernel(fails=error))
    placements.calls.clear()
    with pytest.warns(RuntimeWarning, match="could not compile its (placement|fill) kernel") as warned:
        batches = _run(placements, "fused", samples, "bf16")
    said = [str(w.message) for w in warned if "could not compile" in str(w.message)]
    assert sorted(m.split(" kernel")[0].split()[-1] for m in said) == ["fill", "placement"], said
    assert placements.calls.get("place.place") and placements.calls.get("place.fill"), placements.calls
    assert batches and all(_same_bits(r, g) for r, g in zip(reference, batches, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # warned once per variant: not again
        warnings.filterwarnings("ignore", "stoker's GPU decode: chunks", RuntimeWarning)
        again = _run(placements, "fused", samples, "bf16")
    assert all(_same_bits(r, g) for r, g in zip(reference, again, strict=True))
    assert fused._gather_cast_scatter.compiles and not fused._gather_cast_scatter.launches


@interpreted
def test_padding_fields_and_channels(arrays, placements):
    """Padded boxes (filled after the kernels placed the chunks), a sample of fields (one executor per field,
    each placing with the kernels) and channels: the torch ops' batches, bit for bit."""
    u16, _ = arrays["zstd-u16"]
    i16, _ = arrays["shuffle-i16"]
    b8, _ = arrays["zstd-bool"]
    boxes = [[(-3, 6), (30, 50), (5, 22)], [(15, 24), (-4, 16), (20, 37)], [(2, 11), (0, 20), (0, 17)]]
    for mode in ("fill", "reflect", "edge"):
        samples = [stoker.Sample([u16, i16], box, pad=mode) for box in boxes]
        ref, got = (_run(placements, using, samples, "bf16") for using in ("torch", "fused"))
        assert got and all(_same_bits(r, g) for r, g in zip(ref, got, strict=True)), mode
    fields = [stoker.Sample({"img": ([u16, i16], box), "mask": (b8, box)}, pad="edge") for box in boxes]
    ref, got = (_run(placements, using, fields, {"img": "f16", "mask": "i64"}) for using in ("torch", "fused"))
    assert {ex.placement for ex in placements.made[-2:]} == {"fused"}  # both fields' executors
    assert got
    for r, g in zip(ref, got, strict=True):
        assert r.keys() == g.keys() == {"img", "mask"}
        assert all(_same_bits(r[k], g[k]) for k in r)


@interpreted
def test_a_value_past_an_integer_output_fails_its_chunk(tmp_path, placements):
    """Narrowing integer casts are checked on the CPU (the kernels only widen): int64 ids into "i32" fail the
    batch with the CPU path's DtypeMismatch naming the chunk, with either placement."""
    z = zarr.create_array(str(tmp_path / "ids.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="int64", fill_value=0,
                          compressors=ZstdCodec(level=1))
    data = np.arange(np.prod(SHAPE), dtype=np.int64).reshape(SHAPE)
    data[12, 20, 20] = 2**40
    z[:] = data
    inside = [stoker.Sample(str(tmp_path / "ids.zarr"), [(10, 19), (18, 36), (18, 28)])]
    for using in ("torch", "fused"):
        with pytest.raises(stoker.DtypeMismatch,
                           match=r"ids.zarr: chunk 'c/1/1/1' holds values in \[0, 1099511627776\] outside i32"):
            _run(placements, using, inside, "i32", batch_size=1)
        assert placements.made[-1].placement == using
    got = _run(placements, "fused", inside, "i64", batch_size=1)
    assert torch.equal(got[0][0], torch.from_numpy(data[10:19, 18:36, 18:28]))


@interpreted
def test_cf_decoding_after_the_kernels(tmp_path, placements):
    """CF attributes (packed int16, float fills) decoded on the stream after the kernels placed and filled the
    batch, and before the transform: the torch ops' batches, bit for bit."""
    pytest.importorskip("xarray")
    from cf_data import VARS, boxes, check_batches_equal_xarray, write_dataset

    path = write_dataset(tmp_path, 3)
    samples = [stoker.Sample([os.path.join(path, v) for v in VARS], box) for box in boxes(6)]
    for dtype in ("f32", "bf16"):
        ref, got = (_run(placements, using, samples, dtype, cf=True, batch_size=2) for using in ("torch", "fused"))
        assert placements.made[-1].cf_work
        assert got and all(_same_bits(r, g) for r, g in zip(ref, got, strict=True)), dtype
    placements.using = "fused"  # and xarray's decoded values
    check_batches_equal_xarray(stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1,
                                             host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20, cf=True), path)
    assert placements.made[-1].placement == "fused"


@interpreted
def test_placement_is_chosen_by_device_and_asked_for_explicitly(tmp_path):
    """Torch ops on the host stand-in unless asked; the kernels where asked; anything else refused."""
    from stoker.engine.stats import StatsRecorder
    from stoker.storage import LocalStore

    cfg = stoker.Config(device="cpu")
    store = LocalStore()
    try:
        assert GpuDecodeExecutor.on_host(cfg, StatsRecorder(), store).placement == "torch"
        assert GpuDecodeExecutor.on_host(cfg, StatsRecorder(), store, placement="fused").placement == "fused"
        with pytest.raises(stoker.InvalidArgument, match="placement='triton'"):
            GpuDecodeExecutor.on_host(cfg, StatsRecorder(), store, placement="triton")
    finally:
        store.close()


@pytest.mark.cuda
def test_on_a_gpu_the_kernels_place_what_the_torch_ops_and_the_cpu_path_place(arrays, monkeypatch):
    """On a CUDA device with nvCOMP: the executor places with the compiled kernels by default, and its batches
    are the torch ops' and the CPU path's, bit for bit (NaN bits aside in bfloat16, as the CPU path itself)."""
    pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")
    made = []

    def factory(cfg, device, stats, store, placement=None):
        made.append(GpuDecodeExecutor(cfg, device, stats, store, placement=placement))
        return made[-1]

    for name, (_, _, dtypes) in SPECS.items():
        uri, data = arrays[name]
        samples = _samples(uri)
        for dtype in dtypes:
            lossy = data.dtype == np.int32 and dtype in _FLOAT_OUT
            runs = {}
            for using in ("cpu", "torch", None):
                cfg = stoker.Config(batch_size=3, dtype=dtype, device="cuda", decode_on="cpu" if using == "cpu" else "gpu",
                                    lossy_casts=lossy, pop_timeout_s=60.0, device_buffer_bytes=256 << 20)
                with monkeypatch.context() as mp:
                    if using != "cpu":
                        mp.setattr(pipelines, "make_executor",
                                   lambda c, d, s, st, using=using: factory(c, d, s, st, placement=using))
                    with stoker.Pipeline(cfg) as p:
                        p.push(samples)
                        runs[using] = [torch.from_dlpack(b).cpu().clone() for b in p]
            assert made[-1].placement == "fused" and made[-2].placement == "torch"
            for cpu, torch_ops, kernels in zip(runs["cpu"], runs["torch"], runs[None]):
                assert _same_bits(torch_ops, kernels), (name, dtype)
                same = _bits(cpu) == _bits(kernels)
                if kernels.dtype == torch.bfloat16:
                    same |= torch.isnan(cpu) & torch.isnan(kernels)
                assert bool(same.all()), (name, dtype)
