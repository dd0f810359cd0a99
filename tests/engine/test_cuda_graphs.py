"""--cuda-graphs on|off: one definition beside --device, carried by the engine config to every
process; auto (the default) is on where the device is CUDA. On this GPU-less box `on` runs the
padded decode steps eagerly through the static buffers a graph would replay, and the engine's
greedy tokens and logprobs are the unpadded engine's."""
from __future__ import annotations

import argparse

import msgspec
import pytest
import torch

from services.cli.cli import build_parser
from services.engine.config import EngineConfig
from services.engine.device import use_cuda_graphs
from services.engine.engine import LLMEngine, engine_config
from services.engine.model.decode_graphs import DecodeGraphRunner
from services.engine.model.runner import ModelRunner
from services.engine.sampling_params import SamplingParams

TOLERANCE = 1e-4      # logprob units, as the equivalence tests (tests/engine/model/test_runner.py)


def test_auto_is_on_exactly_where_the_device_is_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [use_cuda_graphs(s, cpu) for s in ("auto", "on", "off")] == [False, True, False]
    assert [use_cuda_graphs(s, cuda) for s in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(ValueError, match="unknown cuda_graphs 'yes'"):
        use_cuda_graphs("yes", cpu)
    with pytest.raises(ValueError, match="unknown cuda_graphs 'yes'"):
        EngineConfig(cuda_graphs="yes")


def test_the_flag_reaches_the_engine_config_from_generate_serve_up_and_the_benches():
    from services.cli.up import add_up_args
    from services.worker.serve import add_worker_args, engine_config_for
    serve, up = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_worker_args(serve)
    add_up_args(up)
    assert engine_config_for(serve.parse_args(["decode"])).cuda_graphs == "auto"
    assert engine_config_for(serve.parse_args(["decode", "--cuda-graphs", "off"])).cuda_graphs == "off"
    assert up.parse_args([]).cuda_graphs is None                  # workers keep their default
    assert up.parse_args(["--cuda-graphs", "on"]).cuda_graphs == "on"
    for argv in (["generate", "--prompt", "hi"], ["bench", "engine"], ["bench", "fleet"]):
        assert build_parser().parse_args([*argv, "--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        serve.parse_args(["mixed", "--cuda-graphs", "maybe"])
    wire = msgspec.msgpack.encode(EngineConfig(cuda_graphs="off"))
    assert msgspec.msgpack.decode(wire, type=EngineConfig).cuda_graphs == "off"


class FakeLauncher:
    """A stand-in for services.cli.launcher.Launcher that only records what it was asked to start."""

    class Stop(Exception):
        pass

    def __init__(self):
        self.specs: dict[str, list[str]] = {}

    def start_many(self, specs):
        self.specs.update(specs)
        raise FakeLauncher.Stop


def test_up_passes_the_flag_to_every_worker(tiny_model_dir):
    from services.cli.up import add_up_args, start_fleet
    up = argparse.ArgumentParser()
    add_up_args(up)
    launcher = FakeLauncher()
    with pytest.raises(FakeLauncher.Stop):
        start_fleet(up.parse_args(["--model", str(tiny_model_dir), "--mode", "disagg",
                                   "--cuda-graphs", "off"]), launcher, "redis://127.0.0.1:1")
    workers = {name: argv for name, argv in launcher.specs.items() if argv[1] == "serve"}
    assert sorted(workers) == ["decode-0", "prefill-0"]
    for argv in workers.values():
        assert argv[argv.index("--cuda-graphs") + 1] == "off"


def greedy(engine: LLMEngine, prompts, n: int = 8):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    return engine.generate(prompts, params)


def test_padded_decode_steps_give_the_engines_greedy_tokens_and_logprobs(tiny_model_dir):
    """Five prompts of different lengths decode together (padded to 8), then three (padded to 4),
    then one alone: the same tokens and logprobs as --cuda-graphs off, and the padded runner did
    run the decode steps."""
    prompts = [[5 + i] * n for i, n in enumerate((3, 20, 7, 40, 11))]
    outs, runners = {}, {}
    for setting in ("off", "on"):
        engine = LLMEngine(engine_config(str(tiny_model_dir), device="cpu", cuda_graphs=setting,
                                         kv_cache_mib=4, max_running=8, token_budget=512))
        outs[setting] = [greedy(engine, prompts[:k], n) for k, n in ((5, 9), (3, 6), (1, 4))]
        runners[setting] = engine.executor.runner
    assert type(runners["off"]) is ModelRunner
    assert isinstance(runners["on"], DecodeGraphRunner) and runners["on"].padded_steps > 0
    for off, on in zip(outs["off"], outs["on"]):
        for a, b in zip(off, on):
            assert b.token_ids == a.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= TOLERANCE


def test_auto_leaves_a_cpu_engine_unpadded(tiny_model_dir):
    engine = LLMEngine(engine_config(str(tiny_model_dir), device="cpu", kv_cache_mib=4))
    assert type(engine.executor.runner) is ModelRunner
