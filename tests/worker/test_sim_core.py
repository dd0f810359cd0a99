"""A real engine core process with the simulated engine (EngineConfig.sim, `--engine sim`),
driven through EngineClient over the same typed messages as the model's core. Its checkpoint
directory has no weights at all: the core reads the tokenizer and config only."""
from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace

from services.engine.config import EngineConfig, SimConfig
from services.engine.engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.worker.engine_client import EngineClient

PROMPT = list(range(30, 70))
DEADLINE_S = 120.0   # a deadline for start-up on a loaded box, not a timing claim
STEP_S = 0.005


def weightless(tiny_model_dir, tmp_path) -> str:
    """The tiny checkpoint without its weights: a core that loaded them could not start."""
    target = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, target,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf"))
    return str(target)


def sim_config(model_dir, kv_tokens=16 * 64) -> EngineConfig:
    return EngineConfig(model=model_dir, sim=SimConfig(step_s=STEP_S, kv_tokens=kv_tokens,
                                                       output_len="fixed:9"))


def with_core(cfg, scenario):
    async def main():
        steps = []
        client = EngineClient(cfg, on_step=steps.append)
        await asyncio.wait_for(client.start(), DEADLINE_S)
        try:
            return await asyncio.wait_for(scenario(client, steps), DEADLINE_S)
        finally:
            await client.close()
    return asyncio.run(main())


async def collect(stream) -> list:
    return [out async for out in stream]


def test_a_sim_core_starts_without_weights_and_streams_the_sims_tokens(tiny_model_dir, tmp_path):
    cfg = sim_config(weightless(tiny_model_dir, tmp_path))
    params = SamplingParams(max_tokens=20, seed=5)
    [expected] = LLMEngine(cfg).generate([PROMPT], params)      # in process, same rule

    async def scenario(client, steps):
        assert client.kv_cache.data.shape == (1, 2, 64, 16, 1, 2)   # the sim's tiny layout
        with open(f"/proc/{client.pid}/maps") as maps:                # a running core, no torch
            assert "libtorch" not in maps.read()
        stream = client.stream("a")
        await client.add_request("a", PROMPT, params, None, None)
        outs = await collect(stream)
        return outs, steps

    outs, steps = with_core(cfg, scenario)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected.token_ids and len(tokens) == 9          # EOS at the drawn length
    assert outs[-1].finish_reason == "stop"
    # each step is reported as its modelled time (the core slept to it)
    assert steps and all(s.duration_s == STEP_S for s in steps)


def test_a_sim_core_reserves_refuses_decodes_and_cancels_over_the_real_messages(
        tiny_model_dir, tmp_path):
    cfg = sim_config(weightless(tiny_model_dir, tmp_path), kv_tokens=16 * 8)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, role="decode"))
    params = SamplingParams(max_tokens=60, ignore_eos=True, seed=1)

    async def scenario(client, steps):
        blocks = await client.reserve("r", PROMPT, params, None, None)
        assert blocks is not None and len(blocks) == 3
        assert await client.reserve("refused", PROMPT, params, None, None) is None   # 8 blocks cannot back two
        client.kv_cache.data[:, :, blocks] = 1.0      # the KV transport's write, into real memory
        stream = client.stream("r")
        await client.start_decode("r", 77)
        first = await stream.next()
        assert first.new_token_ids and not first.finished
        assert await client.cancel("r")
        outs = await collect(stream)
        stats = await client.stats()
        return outs, stats

    outs, stats = with_core(cfg, scenario)
    assert outs[-1].finish_reason == "abort"
    assert stats.kv_blocks_free == stats.kv_blocks_total == 8 and stats.kv_blocks_reserved == 0
