"""Per-request sampling parameters (the engine's typed view of an OpenAI request's knobs) and the
one check of their ranges, shared by the gateway (before a request touches the fleet) and the
engine (before it touches a batch). Free of torch: the gateway imports it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine import errors

MAX_TEMPERATURE = 2.0        # OpenAI's range
MAX_LOGPROBS = 20            # top alternatives per token (generated or prompt)
MAX_STOP_STRINGS = 16
INT64 = (-(2**63), 2**63 - 1)   # seed: the wire's int64 (kvfleet.v1.SamplingParams.seed)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy (argmax); top_k <= 0 and top_p == 1.0 disable those filters.
    `logprobs` is the number of top alternatives returned per generated token (None = no logprobs;
    0 = only the chosen token's logprob). `prompt_logprobs` likewise for prompt tokens (echo).
    Logprobs are always of the model's raw distribution (log_softmax of the logits, before
    temperature / top-k / top-p), as in vLLM's default.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def validate_sampling(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise InvalidMaxTokensError / InvalidSamplingError (with `param` set to the field's name)
    for the first value out of range; each message names the range. `vocab_size` bounds
    stop_token_ids when given. Whatever passes, the engine's sampler accepts."""
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise _invalid(errors.InvalidMaxTokensError, "max_tokens",
                       f"max_tokens must be a positive integer, got {p.max_tokens!r}")
    if not (_is_real(p.temperature) and 0.0 <= p.temperature <= MAX_TEMPERATURE):
        raise _invalid(errors.InvalidSamplingError, "temperature",
                       f"temperature must be in [0.0, {MAX_TEMPERATURE}], got {p.temperature!r}")
    if not (_is_real(p.top_p) and 0.0 < p.top_p <= 1.0):
        raise _invalid(errors.InvalidSamplingError, "top_p",
                       f"top_p must be in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or p.top_k < -1:
        raise _invalid(errors.InvalidSamplingError, "top_k",
                       f"top_k must be -1, 0 (off) or positive, got {p.top_k!r}")
    if p.seed is not None and not (_is_int(p.seed) and INT64[0] <= p.seed <= INT64[1]):
        raise _invalid(errors.InvalidSamplingError, "seed",
                       f"seed must be an integer in [{INT64[0]}, {INT64[1]}], got {p.seed!r}")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(p, name)
        if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
            raise _invalid(errors.InvalidSamplingError, name,
                           f"{name} must be between 0 and {MAX_LOGPROBS}, got {n!r}")
    _check_stops(p, vocab_size)


def _check_stops(p: SamplingParams, vocab_size: int | None) -> None:
    if len(p.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in p.stop):
        raise _invalid(errors.InvalidSamplingError, "stop",
                       f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {len(p.stop)}")
    top = vocab_size if vocab_size is not None else math.inf
    bad = [t for t in p.stop_token_ids if not (_is_int(t) and 0 <= t < top)]
    if bad:
        raise _invalid(errors.InvalidSamplingError, "stop_token_ids",
                       f"stop_token_ids must be integers in [0, {top}), got {bad[:5]!r}")


def _invalid(kind: type[errors.InvalidRequestError], param: str, message: str) -> errors.InvalidRequestError:
    error = kind(message)
    error.param = param          # the request field at fault, for the gateway's 400
    return error


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
