"""The shared argument checks, and the rank resolution every rank-aware API goes through."""

import numpy as np
import pytest
import torch

import stoker
from stoker.checks import integer, rank_in_world, seconds
from stoker.dist.collectives import resolve_rank
from stoker.sampling.sample import Sample
from stoker.sampling.samplers import SampleList


def test_integer_accepts_numpy_integers_and_refuses_bools_floats_and_small_values():
    assert integer("n", np.int64(3), 1) == 3 and type(integer("n", np.int64(3), 1)) is int
    assert integer("n", None, 1, optional=True) is None
    for bad in (True, 2.0, "2", 0, None):
        with pytest.raises(stoker.InvalidArgument, match=r"n must be an integer >= 1, got"):
            integer("n", bad, 1)
    with pytest.raises(stoker.InvalidArgument, match=r"an integer >= 1 or None, got 0") as info:
        integer("n", 0, 1, optional=True, knob="n")
    assert info.value.knob == "n"


def test_seconds_refuses_non_positive_and_nan_and_infinity_only_when_finite():
    assert seconds("t", 2) == 2.0 and seconds("t", float("inf")) == float("inf")
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(stoker.InvalidArgument, match="t must be a number of seconds > 0"):
            seconds("t", bad)
    with pytest.raises(stoker.InvalidArgument, match="finite number of seconds"):
        seconds("t", float("inf"), finite=True)


def test_config_stores_numpy_integer_knobs_as_ints():
    cfg = stoker.Config(batch_size=np.int32(4), n_compute_threads=np.int64(2))
    assert (cfg.batch_size, cfg.n_compute_threads) == (4, 2)
    assert type(cfg.batch_size) is int and type(cfg.n_compute_threads) is int


def test_rank_in_world():
    assert rank_in_world(np.int64(2), 4) == (2, 4)
    for rank, world in ((4, 4), (-1, 4), (True, 4), (0, 0)):
        with pytest.raises(stoker.InvalidArgument):
            rank_in_world(rank, world)


def test_sources_take_rank_and_world_from_the_environment_checked(monkeypatch):
    """A source's shard() without arguments resolves the rank as every other rank-aware API does."""
    source = SampleList([Sample("/a.zarr", [(i, i + 1)]) for i in range(6)])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank() == (1, 3)
    assert resolve_rank(world_size=2) == (1, 2)
    part = source.for_rank()
    assert (part.rank, part.world_size) == (1, 3)
    assert [s.aabb for s in part] == [((1, 2),), ((4, 5),)]
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(stoker.InvalidArgument, match="RANK must be an integer"):
        source.for_rank()
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(stoker.InvalidArgument, match="RANK=3 and WORLD_SIZE=3 are inconsistent"):
        source.for_rank()


def test_a_sharded_source_stores_plain_ints_so_its_state_is_json():
    import json

    from stoker.sampling.samplers import RankShare

    source = SampleList([Sample("/a.zarr", [(i, i + 1)]) for i in range(6)])
    part = RankShare(source, np.int64(1), np.int64(3), "strided", "wrap")
    assert type(part.rank) is int and type(part.world_size) is int
    json.dumps(part.state_dict())


def test_config_stores_the_pop_timeout_as_a_float():
    assert stoker.Config(pop_timeout_s=np.float32(2.5)).pop_timeout_s == 2.5
    assert type(stoker.Config(pop_timeout_s=3).pop_timeout_s) is float
    assert stoker.Config(pop_timeout_s=None).pop_timeout_s is None


def test_config_decode_on_is_validated_and_gpu_needs_a_cuda_pipeline():
    assert stoker.Config().decode_on == "auto" and stoker.Config(decode_on="cpu").decode_on == "cpu"
    with pytest.raises(stoker.InvalidArgument, match="decode_on must be one of 'auto', 'cpu', 'gpu', 'hybrid', got 'GPU'") as e:
        stoker.Config(decode_on="GPU")
    assert e.value.knob == "decode_on"
    assert stoker.Config(decode_on="gpu", device="cpu").decode_on == "gpu"  # a valid value: checked by the Pipeline
    with pytest.raises(stoker.InvalidArgument, match="decode_on='gpu' decodes chunks on a CUDA device") as e:
        stoker.Pipeline(stoker.Config(decode_on="gpu", device="cpu"))
    assert e.value.knob == "decode_on"
    for where in ("auto", "cpu"):  # both decode on the CPU ("auto": where the GPU pays is not measured yet)
        with stoker.Pipeline(stoker.Config(decode_on=where, device="cpu", n_compute_threads=1)) as p:
            assert p.cfg.decode_on == where


def test_config_takes_torch_dtypes_by_their_names():
    assert stoker.Config(dtype=torch.float32).dtype == "f32"
    assert stoker.Config(dtype=torch.bfloat16).output_dtype is torch.bfloat16
    assert stoker.Config(dtype=torch.float16) == stoker.Config(dtype="f16")
    assert stoker.Config(dtype=torch.int32).dtype == "i32"
    with pytest.raises(stoker.InvalidArgument, match="torch.int16 is not an output dtype"):
        stoker.Config(dtype=torch.int16)
