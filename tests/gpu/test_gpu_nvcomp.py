"""The device decode on a GPU: nvCOMP's streams and the torch unshuffle give numcodecs' bytes, bit for bit.

Every test here needs an NVIDIA GPU (skipped where torch sees none); the decode tests (and the pipeline
test at the end, decode_on="gpu" against "cpu") also need
NVIDIA nvCOMP (``pip install stoker[gpu]``) and are skipped without it.
"""

from __future__ import annotations

import itertools

import numcodecs
import numpy as np
import pytest
import torch

from stoker.engine.gpu import frames, ops
from stoker.engine.gpu.frames import BITSHUFFLE, BYTESHUFFLE, FrameError, UnsupportedFrame, parse_blosc, parse_zstd
from test_gpu_host import _data, _encode, _numcodecs  # tests/ is on sys.path (pytest's prepend mode)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


@pytest.fixture
def decoder():
    pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")
    from stoker.engine.gpu.nvcomp import DeviceDecoder

    return DeviceDecoder(torch.cuda.current_device())


def _on_host(decoder, tensor: torch.Tensor) -> np.ndarray:
    torch.cuda.current_stream().wait_stream(decoder.stream)
    return tensor.cpu().numpy()


def test_the_unshuffle_on_the_device_is_the_one_on_the_cpu():
    rng = np.random.default_rng(5)
    for typesize, size, shuffle in itertools.product([1, 2, 3, 4, 8, 16, 24], [7, 128, 1000, 4096 + 40],
                                                    [BYTESHUFFLE, BITSHUFFLE]):
        blocks = torch.from_numpy(rng.integers(0, 256, (6, size), dtype=np.uint8))
        expected = ops.unshuffle(blocks, typesize, shuffle)
        assert torch.equal(ops.unshuffle(blocks.cuda(), typesize, shuffle).cpu(), expected)


def _frames():
    """Frames of lz4 and zstd with every shuffle, several item sizes, raw streams and memcpyed ones."""
    made = []
    for i, (cname, shuffle, itemsize, kind) in enumerate(itertools.product(
            ["lz4", "lz4hc", "zstd"], [0, 1, 2], [1, 2, 4, 8, 3], ["small", "mixed", "random"])):
        data = _data(kind, 70000 + 4 * i + (i % 3), i)
        data = data[:len(data) // itemsize * itemsize]
        made.append((_encode(data, itemsize, cname, shuffle, 5, 4096 if i % 2 else 0), len(data)))
    return made


def test_a_batch_decodes_on_the_device_as_numcodecs_decodes(decoder):
    made = _frames()
    data = _data("small", 300000, 1)
    made.append((numcodecs.Zstd(level=3).encode(data), len(data)))  # a plain zstd chunk among them
    layouts = [parse_blosc(f, n) for f, n in made[:-1]] + [parse_zstd(*made[-1])]
    layout = frames.batch(layouts)
    assert layout.supported and layout.raw.any() and not layout.raw.all()
    got = _on_host(decoder, decoder.decode([f for f, _ in made], layout))
    for (frame, n), base in zip(made[:-1], layout.chunk_out.tolist()):
        assert got[base:base + n].tobytes() == _numcodecs(frame).tobytes()
    base = int(layout.chunk_out[-1])
    assert got[base:].tobytes() == data.tobytes()


def test_frames_read_into_pinned_memory_are_parsed_and_decoded_there(decoder):
    made = _frames()
    sizes = np.array([len(f) for f, _ in made])
    ins = np.cumsum(sizes + 3) - sizes  # gaps between the frames, as reads may leave
    staged = torch.empty(int(ins[-1] + sizes[-1]), dtype=torch.uint8, pin_memory=True)
    for (frame, _), at in zip(made, ins):
        staged[at:at + len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    layout, faults = frames.parse_blosc_batch(staged.numpy(), ins, sizes, [n for _, n in made])
    assert not faults
    got = _on_host(decoder, decoder.decode_staged(staged, layout))
    for (frame, n), base in zip(made, layout.chunk_out.tolist()):
        assert got[base:base + n].tobytes() == _numcodecs(frame).tobytes()


def test_a_scratch_too_small_for_a_batch_decodes_it_in_parts(decoder):
    """The executor reserves nvCOMP's scratch for a group of whole chunks; streams that need more (many small
    blosc blocks) are decoded in parts that fit it, with the same bytes as one decode."""
    made = _frames()
    data = _data("small", 300000, 1)
    made.append((numcodecs.Zstd(level=3).encode(data), len(data)))
    layouts = [parse_blosc(f, n) for f, n in made[:-1]] + [parse_zstd(*made[-1])]
    layout = frames.batch(layouts)
    staged = torch.empty(layout.in_nbytes, dtype=torch.uint8, pin_memory=True)
    frames.stage([f for f, _ in made], layout, staged.numpy())
    zstd_rows = np.flatnonzero(~layout.raw & (layout.codec == frames.ZSTD))
    one = decoder.temp_bytes(1, int(layout.dsize[zstd_rows].max()), int(layout.dsize[zstd_rows].max()))
    temp = torch.empty(one, dtype=torch.uint8, device=decoder.device)  # room for the largest stream alone
    parts = decoder._parts(frames.ZSTD, layout, zstd_rows, temp)
    assert len(parts) > 1  # the test decodes in parts indeed
    checks: list = []
    got = decoder.decode_staged(staged, layout, temp=temp, deferred=checks)
    for check in checks:
        check()
    got = _on_host(decoder, got)
    want = _on_host(decoder, decoder.decode_staged(staged, layout))  # one decode, its own scratch
    assert np.array_equal(got, want)
    for (frame, n), base in zip(made[:-1], layout.chunk_out.tolist()):
        assert got[base:base + n].tobytes() == _numcodecs(frame).tobytes()


def test_the_device_refuses_what_it_cannot_decode(decoder):
    frame = _encode(_data("small", 20000, 0), 2, "blosclz", 1, 5, 4096)
    with pytest.raises(UnsupportedFrame):
        decoder.decode([frame], parse_blosc(frame, 20000))


def test_a_damaged_stream_is_a_frame_error_on_the_device_too(decoder):
    frame = _encode(_data("small", 70000, 2), 4, "lz4", 1, 5, 0)
    lay = parse_blosc(frame, 70000)
    i = int(np.flatnonzero(~lay.raw)[0])
    bad = bytearray(frame)
    bad[lay.src[i]:lay.src[i] + lay.csize[i]] = bytes(int(lay.csize[i]))  # zeros: offset 0 is invalid lz4
    with pytest.raises(FrameError):
        decoder.decode([bytes(bad)], lay)


def test_a_decode_nvcomp_refuses_is_a_device_error_not_a_damaged_chunk(decoder, monkeypatch):
    from stoker.errors import DeviceError
    from stoker.engine.gpu.capi import Batched, NvcompError

    def refuse(self, *args, **kw):
        raise NvcompError("nvCOMP Zstd DecompressAsync: status 21 (ERROR_BATCH_SIZE_TOO_LARGE)")

    monkeypatch.setattr(Batched, "decompress", refuse)
    data = _data("small", 70000, 3)
    frame = numcodecs.Zstd(level=3).encode(data)
    with pytest.raises(DeviceError, match="refused to decode 1 zstd streams of chunks \\[0\\].*status 21"):
        decoder.decode([frame], parse_zstd(frame, len(data)))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "native"])
def test_a_pipeline_decoding_on_the_gpu_gives_the_cpu_decode_s_batches(tmp_path, dtype):
    """End to end: Config(decode_on="gpu") against decode_on="cpu" on the same CUDA device, bit for bit, and
    what crossed PCIe is the encoded bytes read (zstd and blosc arrays, missing chunks, partial edge chunks)."""
    pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")
    import stoker
    from zarr.codecs import BloscCodec, ZstdCodec
    from test_gpu_executor import _samples, _same, _write

    uris = []
    for name, comp in (("zstd", ZstdCodec(level=3)), ("lz4", BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")),
                       ("bzstd", BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"))):
        _write(tmp_path / f"{name}.zarr", (40, 70, 60), (16, 32, 32), "uint16", comp, skip=16)
        uris.append(str(tmp_path / f"{name}.zarr"))
    samples = [s for u in uris for s in _samples(u, (40, 70, 60), (12, 40, 33), 8, seed=len(u))]
    batches, stats = {}, {}
    for where in ("cpu", "gpu"):
        cfg = stoker.Config(batch_size=4, dtype=dtype, device=torch.cuda.current_device(), decode_on=where,
                            host_buffer_bytes=256 << 20, device_buffer_bytes=256 << 20)
        with stoker.Pipeline(cfg) as p:
            p.push(samples)
            batches[where] = [torch.from_dlpack(b).cpu() for b in p]
            stats[where] = p.stats()
    assert len(batches["gpu"]) == len(batches["cpu"]) == 6
    assert all(_same(g, c) for g, c in zip(batches["gpu"], batches["cpu"]))
    assert stats["gpu"].bytes_to_device == stats["gpu"].bytes_read < stats["cpu"].bytes_to_device
