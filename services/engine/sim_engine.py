"""The simulated engine core's executor (docs/engine.md, "Simulated engine"; STYLE 17).

`LLMEngine(EngineConfig(sim=SimConfig(...)))` runs the real Scheduler, BlockPool, validation,
output states, fairness, admission, cancellation and n > 1 forking over this executor, which
differs from the model's only in where tokens and step times come from:

  * tokens: services/engine/sim_tokens.py (deterministic, no logits; the served model's tokenizer
    and config are read, its weights never loaded);
  * step time: a StepTimer (services/planner/step_time.py) for the planned batch's shape, exposed
    as `LLMEngine.last_step_modelled_s`; the engine never sleeps (the engine core process sleeps
    to it on the wall clock, a discrete-event simulator advances its virtual clock by it);
  * KV: the block count is the target's (reservations, refusals and preemptions are the real
    ones); the cache array is tiny per block (one layer, one KV head, head dim 2, float16), so
    the KV transports still move real blocks through real memory. It is a numpy array
    (services/engine/kv_array.py), so a simulated core imports no torch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from services.engine.config import EngineConfig, SimConfig
from services.engine.kv_array import ArrayKVCache, kv_bytes_per_token, kv_cache_shape
from services.engine.model.config import ModelConfig
from services.engine.request import Request
from services.engine.token_logprob import TokenLogprob
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.engine.sim_tokens import TokenRule
from services.engine.tokenizer import Tokenizer
from services.planner.step_time import BatchShape, FixedStepTimer, StepTimer

SIM_KV_DTYPE = np.dtype(np.float16)
SIM_HEAD_DIM = 2


def sim_kv_layout(model_config: ModelConfig) -> ModelConfig:
    """The simulated cache's per-token shape: one layer, one KV head, head dim 2."""
    return replace(model_config, num_layers=1, num_kv_heads=1, head_dim=SIM_HEAD_DIM)


def cost_model(sim: SimConfig):
    """The target's CostModel (services/planner/capacity.py, imported only here), or None when
    this build has no cost model."""
    try:
        from services.planner.capacity import CostModel  # noqa: PLC0415
    except ImportError:
        return None
    return CostModel.for_target(model=sim.target_model, gpu=sim.gpu, tp=sim.tp, dtype=sim.dtype,
                                kv_dtype=sim.kv_dtype)


def step_timer(sim: SimConfig, model=None) -> StepTimer:
    """sim.step_s (fixed), else the measured profile sim.profile, else the target's cost model
    (`model`, when the caller has built it)."""
    if sim.step_s is not None:
        return FixedStepTimer(sim.step_s)
    if sim.profile is not None:
        try:
            from services.planner.profile import StepProfile  # noqa: PLC0415
        except ImportError:
            raise ValueError("--sim-profile: this build has no step profiles "
                             "(services/planner/profile.py)") from None
        return StepProfile.load(sim.profile)
    model = model if model is not None else cost_model(sim)
    if model is None:
        raise ValueError("the simulated engine needs step times: this build has no cost model "
                         "(services/planner/capacity.py); give --sim-step-ms or --sim-profile")
    return model


def target_kv_bytes_per_token(sim: SimConfig, model_config: ModelConfig, model=None) -> int:
    """The real KV bytes one token holds on the target (the cost model's), or, without a cost
    model, the served model's at its checkpoint dtype."""
    model = model if model is not None else cost_model(sim)
    if model is not None:
        return int(model.target.kv_bytes_per_token)
    return kv_bytes_per_token(model_config, model_config.torch_dtype or "float32")


def transfer_timer(sim: SimConfig, model_config: ModelConfig) -> Callable[[int], float]:
    """num_tokens -> seconds a KV transfer of that many prompt tokens takes at
    sim.network_gbps: the cost model's transfer_s (its network efficiency included), else the
    bytes of target_kv_bytes_per_token at the raw bandwidth."""
    model = cost_model(sim)
    if model is not None:
        return lambda n: model.transfer_s(n, sim.network_gbps)
    per_token = target_kv_bytes_per_token(sim, model_config)
    return lambda n: per_token * n * 8 / (sim.network_gbps * 1e9)


def sim_num_blocks(config: EngineConfig, model=None) -> int:
    """config.num_blocks, else sim.kv_tokens, else the target's KV capacity, in blocks."""
    if config.num_blocks:
        return config.num_blocks
    sim = config.sim
    tokens = sim.kv_tokens
    if tokens is None:
        model = model if model is not None else cost_model(sim)
        if model is None:
            raise ValueError("the simulated engine needs a KV capacity: this build has no cost "
                             "model (services/planner/capacity.py); give --sim-kv-tokens")
        tokens = int(model.kv_tokens_per_replica)
    return max(1, -(-tokens // config.block_size))


class SimExecutor:
    """An Executor (services/engine/executor.py) without a model."""

    tp_leader = None

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 tokenizer: Tokenizer | None, kv_alloc=None,
                 timer: StepTimer | None = None) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError("the simulated engine models tensor parallelism (sim tp); "
                             "tensor_parallel_size must be 1")
        sim = config.sim
        self.cost_model = cost_model(sim)      # None in a build without one
        self.timer = timer if timer is not None else step_timer(sim, self.cost_model)
        self.num_blocks = sim_num_blocks(config, self.cost_model)
        layout = sim_kv_layout(model_config)
        shape = kv_cache_shape(layout, self.num_blocks, config.block_size)
        data = kv_alloc(shape, SIM_KV_DTYPE) if kv_alloc is not None else None
        self.kv_cache = ArrayKVCache(layout, self.num_blocks, config.block_size, SIM_KV_DTYPE,
                                     data=data)
        self.kv_bytes_per_token = target_kv_bytes_per_token(sim, model_config, self.cost_model)
        excluded = set(model_config.eos_token_ids)
        if tokenizer is not None:
            excluded |= tokenizer.eos_token_ids | tokenizer.special_ids
        vocab = max(model_config.vocab_size, tokenizer.vocab_size if tokenizer else 0)
        self.tokens = TokenRule(vocab, excluded, config.seed, sim.output_len)
        self.last_prepare_s = 0.0
        self.last_batch = BatchShape()

    def bind(self, block_table) -> None:
        pass

    def new_generator(self, seed: int | None) -> None:
        return None     # tokens are a function of the seed (sim_tokens.py): no random state

    def execute(self, plan: SchedulerOutput, drawers: Sequence[Request],
                sources: Sequence[ScheduledChunk], generators: Sequence[object]
                ) -> tuple[list[TokenLogprob], list[tuple[str, list[TokenLogprob]]]]:
        prompt_lps = []
        for c in plan.chunks:
            if c.num_prompt_logprob_rows:
                req = c.request
                targets = req.token_ids[c.start_pos + 1:c.start_pos + 1 + c.num_prompt_logprob_rows]
                prompt_lps.append((req.request_id, self.tokens.prompt_logprobs(
                    req, c.start_pos, targets, req.params.prompt_logprobs)))
        return [self.tokens.next_token(r) for r in drawers], prompt_lps

    def batch_shape(self, plan: SchedulerOutput) -> BatchShape:
        """The planned batch as a StepTimer sees it: prefill chunks as (tokens, tokens of the
        sequence already cached), decodes as the context their token attends over."""
        return BatchShape(prefill_chunks=tuple((c.num_tokens, c.start_pos) for c in plan.prefills),
                          decode_contexts=tuple(c.start_pos + 1 for c in plan.decodes))

    def step_s(self, plan: SchedulerOutput, measured_s: float) -> float:
        self.last_batch = self.batch_shape(plan)
        return float(self.timer.step_s(self.last_batch))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv_cache.write_blocks([dst], self.kv_cache.read_blocks([src]))

    def close(self) -> None:
        pass
