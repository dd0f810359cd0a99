"""Where an engine step's tokens come from: the strategy `LLMEngine` runs its plans on.

LLMEngine owns everything above the model (scheduler, block pool, validation, output states,
n > 1 forking, cancellation, stats); an executor owns the KV cache's memory and turns one planned
batch into one token per sampling sequence. Two implementations:

  * `ModelExecutor` (services/engine/model_executor.py): the model (ModelRunner) and the Sampler;
  * `SimExecutor` (services/engine/sim_engine.py): deterministic tokens, no logits, and the
    modelled duration of each step from a StepTimer.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.engine.request import Request
from services.engine.token_logprob import TokenLogprob
from services.engine.scheduler import ScheduledChunk, SchedulerOutput


class Executor(Protocol):
    kv_cache: object              # a KVCache (the transports read and write its blocks)
    kv_bytes_per_token: int       # all layers, K + V, of the model served (the target's for a sim)
    num_blocks: int               # the block pool's size
    tp_leader: object | None      # tensor-parallel rank 0's handle on its followers, if any
    last_prepare_s: float         # the last execute()'s input preparation (telemetry)

    def bind(self, block_table) -> None:
        """The block pool's block_table(request_id) (the engine builds the pool after us)."""

    def new_generator(self, seed: int | None) -> object | None:
        """A seeded request's own random state, passed back to execute() with its rows (the
        model's sampler draws from it); None: unseeded, or an executor that needs none."""

    def execute(self, plan: SchedulerOutput, drawers: Sequence[Request],
                sources: Sequence[ScheduledChunk], generators: Sequence[object]
                ) -> tuple[list[TokenLogprob], list[tuple[str, list[TokenLogprob]]]]:
        """Run `plan`'s chunks; one token for each of `drawers`, drawn from the sampling row of
        its `sources` chunk (a forked sample draws from its parent's row). Returns the tokens and
        the prompt logprobs of the chunks that asked for them, as (request id, entries)."""
        ...

    def step_s(self, plan: SchedulerOutput, measured_s: float) -> float:
        """How long the step that ran `plan` counts for: measured (the model) or modelled (sim)."""
        ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def close(self) -> None: ...
