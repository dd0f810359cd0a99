"""TokenLogprob: one position's token and its logprob info, as every executor returns it (the
model's sampler and the simulated core's deterministic tokens); torch-free, so the simulated path
imports no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token and, when requested, its logprob info.

    `logprob` is of the model's raw distribution (log_softmax of the logits, before any
    processing), or under logprobs_mode "processed_logprobs" of the distribution the token was
    drawn from (after penalties, bias, temperature, min_p, top-k / top-p; -inf for a token
    they removed); NaN when the request did not ask for logprobs. `top` is the top-N
    (token_id, logprob) by descending logprob; () when N == 0 or not requested.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
