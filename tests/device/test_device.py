"""Device binding and the staging dtype of the CUDA path: the decisions, tested without a GPU.

The CUDA behaviour itself is in test_cuda_pipeline.py (skipped where torch sees no GPU).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import stoker
from stoker.device import resolve as devices
from stoker.engine.cast import copy_cast, staging_dtype

pytestmark = pytest.mark.timeout(60)


def _bind(requested, gpus=1, current=0, local_rank=None):
    return devices.bind(requested, cuda_available=gpus > 0, device_count=gpus, current=current if gpus else None,
                        local_rank=local_rank)


def test_cpu_is_chosen_without_cuda_or_when_asked():
    assert _bind(None, gpus=0).device == torch.device("cpu")
    assert _bind("cpu", gpus=4, local_rank=2) == devices.Binding(torch.device("cpu"))


@pytest.mark.parametrize("requested", [0, "cuda", "cuda:1"], ids=["index", "current", "named"])
def test_a_gpu_asked_for_without_cuda_is_an_error(requested):
    with pytest.raises(stoker.InvalidArgument, match="no CUDA device") as info:
        _bind(requested, gpus=0)
    assert info.value.knob == "device"


def test_none_takes_torch_current_device():
    assert _bind(None, gpus=1) == devices.Binding(torch.device("cuda", 0))
    assert _bind("cuda", gpus=4, current=3, local_rank=3) == devices.Binding(torch.device("cuda", 3))
    assert _bind(2, gpus=4, current=2, local_rank=2) == devices.Binding(torch.device("cuda", 2))


def test_disagreeing_with_torch_current_device_names_both_and_the_fix():
    with pytest.raises(stoker.InvalidArgument) as info:
        _bind(2, gpus=4, current=0, local_rank=2)
    msg = str(info.value)
    assert "Config.device=2" in msg and "cuda:2" in msg and "cuda:0" in msg
    assert "torch.cuda.set_device(local_rank)" in msg


def test_a_device_torch_cannot_see_is_an_error():
    with pytest.raises(stoker.InvalidArgument, match="only 4 CUDA device"):
        _bind("cuda:5", gpus=4, current=0)


def test_warnings_for_ranks_that_may_share_a_gpu():
    forgot = _bind(None, gpus=4, current=0, local_rank=2)  # set_device(local_rank) forgotten
    assert forgot.device == torch.device("cuda", 0)
    assert "LOCAL_RANK=2" in forgot.warning and "set_device" in forgot.warning
    unnamed = _bind(None, gpus=4, current=1)  # several GPUs, no rank, no device named
    assert "4 GPUs are visible" in unnamed.warning and "Config(device=local_rank)" in unnamed.warning
    named = _bind(0, gpus=4, current=0, local_rank=3)
    assert "LOCAL_RANK=3" in named.warning
    # one GPU per rank through CUDA_VISIBLE_DEVICES: LOCAL_RANK=3 on its cuda:0 is right
    assert _bind(0, gpus=1, current=0, local_rank=3).warning is None
    assert _bind(None, gpus=1, current=0, local_rank=3).warning is None


def test_resolve_warns_once_per_local_rank_and_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(devices, "_warned", set())
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.warns(UserWarning, match="LOCAL_RANK=2"):
        assert devices.resolve(None) == torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices.resolve(None)  # the same pair: no second warning
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.warns(UserWarning, match="LOCAL_RANK=3"):
        devices.resolve(None)


# -- staging dtype ----------------------------------------------------------------------------------


@pytest.mark.parametrize("output, sources, staged", [
    (torch.float32, {np.dtype("uint16")}, torch.uint16),
    (torch.float32, {np.dtype("int8")}, torch.int8),
    (torch.float32, {np.dtype("float16")}, torch.float32),  # torch would quiet its signalling NaNs
    (torch.float32, {np.dtype("bool")}, torch.bool),
    (torch.bfloat16, {np.dtype("uint8")}, torch.uint8),
    (torch.bfloat16, {np.dtype("uint16")}, torch.bfloat16),  # no narrower: cast on the host
    (torch.float32, {np.dtype("int32")}, torch.float32),
    (torch.float32, {np.dtype("float64")}, torch.float32),
    (torch.float32, {np.dtype(">u2")}, torch.float32),  # byte-swapped sources are cast on the host
    (torch.float32, {np.dtype("uint16"), np.dtype("uint8")}, torch.float32),  # mixed: one host dtype
    (None, {np.dtype("uint16")}, None),  # native: the batch is the source dtype anyway
    (torch.int32, {np.dtype("uint8")}, torch.uint8),  # widened exactly on the device
    (torch.int64, {np.dtype("int16")}, torch.int16),
    (torch.int64, {np.dtype("uint64")}, torch.int64),  # cast (and every value checked) on the host
    (torch.int32, {np.dtype("int64")}, torch.int32),
])
def test_staging_dtype(output, sources, staged):
    assert staging_dtype(output, sources) == staged


def test_a_cast_after_staging_gives_the_same_bits_as_the_host_cast():
    """The claim behind staging: torch's cast from the staging dtype rounds like copy_cast from the source."""
    staged_pairs = 0
    for source in ["uint8", "int8", "uint16", "int16", "bool", "float16"]:
        for output in [torch.float32, torch.bfloat16, torch.float16]:
            dt = np.dtype(source)
            staged = staging_dtype(output, {dt})
            if staged == output:
                continue  # cast on the host for this pair
            staged_pairs += 1
            if dt.kind in "ui":
                values = np.arange(np.iinfo(dt).min, np.iinfo(dt).max + 1).astype(dt)
            else:
                values = np.array([False, True])
            host = torch.empty(values.shape, dtype=output)
            copy_cast(host, values)
            device_like = torch.from_numpy(values).to(staged).to(output)  # torch's conversion, as on the GPU
            bits = torch.int16 if output.itemsize == 2 else torch.int32
            assert torch.equal(host.view(bits), device_like.view(bits)), (source, output)
    assert staged_pairs == 11  # 4 integer types + bool into float32; uint8, int8, bool into each 16-bit float


def test_device_budget_is_checked_at_construction(monkeypatch):
    """device_buffer_bytes must hold lookahead + 1 device slots plus the staging for the cast."""
    monkeypatch.setattr(devices, "resolve", lambda requested: torch.device("cuda", 0))
    cfg = stoker.Config(batch_size=8, sample_shape=(32, 128, 128), dtype="f32", device=0,
                        host_buffer_bytes=1 << 30, device_buffer_bytes=16 << 20, lookahead_batches=2)
    with pytest.raises(stoker.BudgetExceeded) as info:
        stoker.Pipeline(cfg)
    slot = 8 * 32 * 128 * 128 * 4
    assert info.value.knob == "device_buffer_bytes" and info.value.needed == 3 * slot + slot // 2
    assert "3 batch slots" in str(info.value)
    # host side on CUDA: only lookahead_batches pinned staging slots
    cfg = stoker.Config(batch_size=8, sample_shape=(32, 128, 128), dtype="f32", device=0,
                        host_buffer_bytes=24 << 20, device_buffer_bytes=1 << 30, lookahead_batches=2)
    with pytest.raises(stoker.BudgetExceeded, match="2 pinned staging slots") as info:
        stoker.Pipeline(cfg)
    assert info.value.knob == "host_buffer_bytes"


def test_a_forked_child_of_a_cuda_parent_falls_back_to_cpu_or_says_why(monkeypatch):
    """A DataLoader worker forked after its parent used CUDA cannot use CUDA itself."""
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert devices.resolve(None) == torch.device("cpu")
    assert devices.resolve("cpu") == torch.device("cpu")
    with pytest.raises(stoker.InvalidArgument, match="forked after its parent used CUDA"):
        devices.resolve(0)


def test_dlpack_stream_numbers_follow_the_protocol():
    """-1 asks for no fence; 0 and 2 are not streams a CUDA consumer may name (checked before any CUDA call)."""
    from stoker.engine.cuda.transfer import consumer_stream

    assert consumer_stream(-1, torch.device("cuda", 0)) is None
    for reserved in (0, 2):
        with pytest.raises(BufferError, match="not supported"):
            consumer_stream(reserved, torch.device("cuda", 0))
