"""The hybrid fleet's split from the capacity model: the longest prompt served co-located.

A co-located prefill shares the engine's steps with the decodes running there: while it runs, their
next token waits. The split is the prompt whose whole prefill on the target takes the interactive
class's ITL target: a prompt at most that long delays the co-located streams by at most one ITL
target even if it ran in one step (with chunked prefill it is spread over several), so it gains
nothing from moving; a longer one would stall them for several targets' worth, and its KV transfer
is small against its prefill. (The threshold is a starting point the operator may override:
`kvfleet up --hybrid-threshold-tokens`; docs/capacity.md sets it beside the measured crossover.)
"""
from __future__ import annotations

from services.engine.config import INTERACTIVE
from services.planner.capacity import CostModel

MAX_PROMPT_TOKENS = 1 << 20        # the search's upper end (longer than any served context)


def threshold_tokens(cost: CostModel, itl_target_s: float = INTERACTIVE.itl_target_s) -> int:
    """The largest prompt length (>= 1) whose prefill on `cost`'s target takes at most
    `itl_target_s` (prefill time grows with the prompt: a bisection)."""
    if cost.prefill_s(1) > itl_target_s:
        return 1
    lo, hi = 1, MAX_PROMPT_TOKENS
    if cost.prefill_s(hi) <= itl_target_s:
        return hi
    while hi - lo > 1:               # invariant: prefill_s(lo) <= target < prefill_s(hi)
        mid = (lo + hi) // 2
        if cost.prefill_s(mid) <= itl_target_s:
            lo = mid
        else:
            hi = mid
    return lo
