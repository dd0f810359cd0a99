"""--device auto|cpu|cuda: one definition, carried by the engine config to every process, and a
clear refusal (one line, no traceback) where CUDA is asked for and torch sees none. This box has
no GPU: `auto` resolves to the CPU, `cuda` is refused."""
from __future__ import annotations

import argparse
import subprocess
import sys

import msgspec
import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.device import DeviceUnavailable, resolve_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the stories assume no GPU")


def test_auto_is_the_cpu_here_and_cuda_is_refused_naming_what_torch_sees():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="--device cuda: torch .* sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        EngineConfig(device="tpu")


def test_the_engine_puts_its_model_and_kv_cache_on_its_device(tiny_model_dir):
    from services.engine.engine import LLMEngine, engine_config
    engine = LLMEngine(engine_config(str(tiny_model_dir), device="cpu", kv_cache_mib=4))
    assert engine.kv_cache.device == torch.device("cpu")
    assert engine.executor.runner.model.device == torch.device("cpu")
    assert type(engine.executor.runner.backend).__name__ == "TorchAttentionBackend"   # auto on CPU


def test_auto_attention_follows_the_engines_device():
    """The engine's runner picks its backend from where its model is: Triton for a model on CUDA
    (a served engine's too, since the core builds the same ModelExecutor), torch on the CPU."""
    from services.engine.model.runner import make_attention_backend
    assert type(make_attention_backend("auto", 8, torch.device("cuda", 0))).__name__ == \
        "TritonAttentionBackend"
    assert type(make_attention_backend("auto", 8, torch.device("cpu"))).__name__ == \
        "TorchAttentionBackend"


def test_the_flag_reaches_the_engine_config_through_serve_and_up_and_the_wire():
    from services.cli.up import add_up_args
    from services.worker.serve import add_worker_args, engine_config_for
    serve = argparse.ArgumentParser()
    add_worker_args(serve)
    assert engine_config_for(serve.parse_args(["mixed"])).device == "auto"
    assert engine_config_for(serve.parse_args(["decode", "--device", "cpu"])).device == "cpu"
    up = argparse.ArgumentParser()
    add_up_args(up)
    assert up.parse_args([]).device is None                    # workers keep their default (auto)
    assert up.parse_args(["--device", "cpu"]).device == "cpu"
    wire = msgspec.msgpack.encode(EngineConfig(device="cuda"))
    assert msgspec.msgpack.decode(wire, type=EngineConfig).device == "cuda"


def test_the_engine_core_shares_a_cpu_cache_through_its_file(tmp_path):
    from services.engine.config import SimConfig
    from services.worker.engine_core import SharedKV, kv_allocator
    shared = SharedKV(str(tmp_path / "kv"))
    assert kv_allocator(EngineConfig(device="cpu"), shared) == shared.alloc
    assert kv_allocator(EngineConfig(device="auto"), shared) == shared.alloc
    assert kv_allocator(EngineConfig(device="cuda", sim=SimConfig()), shared) == shared.alloc_array


@pytest.mark.parametrize("argv, who", [
    (["generate", "--device", "cuda", "--prompt", "hi"], "kvfleet generate"),
    (["up", "--device", "cuda"], "kvfleet up"),
    (["serve", "decode", "--device", "cuda", "--insecure-internal"], "kvfleet serve decode"),
    (["bench", "engine", "--device", "cuda", "--quick"], "kvfleet bench engine"),
])
def test_cuda_without_a_gpu_is_one_line_not_a_traceback(argv, who):
    run = subprocess.run([sys.executable, "-m", "services.cli.cli", *argv], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0
    assert f"{who}: --device cuda: torch" in run.stderr and "sees no CUDA GPU" in run.stderr
    assert "Traceback" not in run.stderr
