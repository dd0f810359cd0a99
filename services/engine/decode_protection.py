"""Decode protection: how many waiting sequences may join the decode batch (DESIGN.md section 6,
docs/engine.md "Decode protection"). A pure helper; the scheduler decides who waits.

The rule: candidates join in their order while the predicted step time of the batch with them
stays within `headroom` x the tightest ITL target among the batch's classes and theirs. A
candidate that does not fit stops the pass (those behind it keep their place). An empty batch
always takes its first candidate: a batch of one cannot be refused. A target that a batch of one
already misses (a slow engine: a CPU, a large model on too few devices) cannot be protected by
holding sequences back, only missed at lower throughput, so such a candidate joins: protection
caps the batch only where the cap buys the target.

The predicted step is a decode step of every seat (its current context, the tokens its next
token attends over); the prefill work sharing a step is bounded apart, by the token budget and
`max_prefill_attention`, and the headroom leaves it room.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.planner.step_time import BatchShape, StepTimer


@dataclass(frozen=True, slots=True)
class Seat:
    """A sequence in (or asking into) the decode batch. `copies`: the sequences it decodes as (a
    request that forks into n samples at its first token takes n seats)."""

    context: int             # tokens its next decode attends over
    itl_target_s: float      # its class's ITL target (inf: none)
    copies: int = 1


def decode_admissions(timer: StepTimer, batch: Sequence[Seat], candidates: Iterable[Seat],
                      headroom: float) -> int:
    """How many of `candidates`, taken in order, may join `batch`."""
    contexts = [s.context for s in batch for _ in range(s.copies)]
    limit = min((s.itl_target_s for s in batch), default=math.inf)
    admitted = 0
    for seat in candidates:
        joined = contexts + [seat.context] * seat.copies
        tighter = min(limit, seat.itl_target_s)
        bound = headroom * tighter
        if (contexts and timer.step_s(BatchShape(decode_contexts=tuple(joined))) > bound
                and timer.step_s(BatchShape(decode_contexts=(seat.context,))) <= bound):
            break
        contexts, limit = joined, tighter
        admitted += 1
    return admitted
