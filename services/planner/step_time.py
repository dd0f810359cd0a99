"""How long one engine iteration takes: the interface between the cost model, a measured profile
and the simulated engine core.

A simulated core (DESIGN section 3.5) asks a `StepTimer` how long the batch its real scheduler
planned would run on the target; the discrete-event simulator asks the same. Two implementations:

  * `services/planner/capacity.py` `CostModel`: a roofline of the target (model, GPU, TP, dtype);
  * `services/planner/profile.py` `StepProfile`: a fit of this machine's real engine
    (`kvfleet sim calibrate`).

Both answer from the batch's shape alone, never from its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BatchShape:
    """One iteration's work.

    prefill_chunks:  (new tokens, tokens of the same sequence already in the KV cache before the
                     chunk) per prefill chunk; the chunk attends over context + its own tokens.
    decode_contexts: per decoding sequence, the tokens its one new token attends over (its
                     context including itself).
    """

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_contexts)

    @property
    def is_empty(self) -> bool:
        return not self.prefill_chunks and not self.decode_contexts


class StepTimer(Protocol):
    """Seconds one iteration of `batch` takes on the timer's target (0 for an empty batch)."""

    def step_s(self, batch: BatchShape) -> float: ...


@dataclass(frozen=True, slots=True)
class FixedStepTimer:
    """Every non-empty iteration takes `seconds` (tests that need a step time, not a target)."""

    seconds: float

    def step_s(self, batch: BatchShape) -> float:
        return 0.0 if batch.is_empty else self.seconds
