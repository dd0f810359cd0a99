"""Tensor-parallel ranks and their devices (services/engine/device.py rank_device): on CUDA rank r
runs on cuda:r of the GPUs its process sees and the ranks talk NCCL; on the CPU every rank is on
the CPU and they talk gloo. A CUDA engine asks for as many GPUs as ranks, and says so when short."""
from __future__ import annotations

import pytest
import torch

from services.engine.device import DeviceUnavailable, check_rank_devices, rank_device
from services.engine.tp_ranks import backend_for


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_rank_r_is_on_cuda_r_and_every_cpu_rank_on_the_cpu(world_size):
    assert [rank_device("cuda", r) for r in range(world_size)] == \
        [torch.device("cuda", r) for r in range(world_size)]
    assert {rank_device("cpu", r) for r in range(world_size)} == {torch.device("cpu")}
    assert backend_for(rank_device("cuda", world_size - 1)) == "nccl"
    assert backend_for(rank_device("cpu", world_size - 1)) == "gloo"


def test_a_rank_on_anything_else_is_refused():
    with pytest.raises(ValueError, match="runs on cpu or cuda, not 'mps'"):
        rank_device("mps", 0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_device("cuda", -1)


def test_more_cuda_ranks_than_gpus_are_refused_naming_both():
    check_rank_devices("cuda", 2, gpus=2)
    check_rank_devices("cpu", 8, gpus=0)           # CPU ranks need no GPU
    with pytest.raises(DeviceUnavailable, match="tensor parallel size 4 on cuda needs 4 GPUs .* sees 2"):
        check_rank_devices("cuda", 4, gpus=2)


def test_a_cpu_engine_starts_its_follower_on_the_cpu_with_gloo_and_runs_it_unpadded(tiny_model_dir):
    """TP 2 on the CPU: the follower is told its device kind (it picks rank_device(kind, 1)), rank 0
    is on the CPU, and --cuda-graphs on stays off under tensor parallelism (the followers'
    forwards must have rank 0's shapes step by step)."""
    import torch.distributed as dist

    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.model.runner import ModelRunner
    from services.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu",
                                    cuda_graphs="on", tensor_parallel_size=2, kv_cache_mib=4))
    try:
        (follower,) = engine.tp_leader.procs
        assert follower.args[-2:] == ["--device", "cpu"]
        assert dist.get_backend() == "gloo" and engine.executor.device == torch.device("cpu")
        assert type(engine.executor.runner.runner) is ModelRunner
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out.token_ids) == 3
    finally:
        engine.close()
    assert not dist.is_initialized()
