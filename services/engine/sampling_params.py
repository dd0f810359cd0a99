"""Per-request sampling parameters (the engine's typed view of an OpenAI request's knobs) and the
one check of their ranges, shared by the gateway (before a request touches the fleet) and the
engine (before it touches a batch). Free of torch: the gateway imports it."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.engine import errors

MAX_TEMPERATURE = 2.0        # OpenAI's range
MAX_LOGPROBS = 20            # top alternatives per token (generated or prompt)
MAX_STOP_STRINGS = 16
INT64 = (-(2**63), 2**63 - 1)   # seed: the wire's int64 (kvfleet.v1.SamplingParams.seed)
INT32 = (-(2**31), 2**31 - 1)   # priority: the wire's int32
MAX_PENALTY = 2.0            # presence / frequency: OpenAI's and vLLM's [-2, 2]
MAX_LOGIT_BIAS = 100.0       # logit_bias values are clamped to [-100, 100], as vLLM does
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request (OpenAI allows 300; vLLM's GPU runner 1024)
MAX_N = 16                   # parallel samples per request


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy (argmax); top_k <= 0 and top_p == 1.0 disable those filters.
    `logprobs` is the number of top alternatives returned per generated token (None = no logprobs;
    0 = only the chosen token's logprob). `prompt_logprobs` likewise for prompt tokens (echo).
    Generated-token logprobs are of the model's raw distribution (log_softmax of the logits,
    before any processing) unless the engine runs with logprobs_mode="processed_logprobs"
    (EngineConfig); prompt logprobs are always raw. Both as in vLLM.

    vLLM's extra knobs, with vLLM's semantics and defaults (docs/engine.md, "Sampling
    parameters"): repetition_penalty (1 = off; over prompt and output), presence_penalty and
    frequency_penalty (0 = off; over output only), min_p (0 = off), min_tokens (EOS, stop tokens
    and stop strings barred before it), logit_bias ((token_id, bias) pairs, or a mapping, which
    is stored as pairs sorted by token id; biases clamped to [-100, 100]),
    include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens, n (parallel
    samples) and priority (lower first within the request's traffic class and tenant).
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
    n: int = 1                      # parallel samples sharing the prompt's KV (vLLM's `n`)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _normalized_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


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
    _check_penalties(p)
    _check_logit_bias(p, vocab_size)
    _check_vllm_extras(p)


def _check_penalties(p: SamplingParams) -> None:
    if not (_is_real(p.repetition_penalty) and p.repetition_penalty > 0.0):
        raise _invalid(errors.InvalidSamplingError, "repetition_penalty",
                       f"repetition_penalty must be a finite number > 0 (1 = off), "
                       f"got {p.repetition_penalty!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (_is_real(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise _invalid(errors.InvalidSamplingError, name,
                           f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
    if not (_is_real(p.min_p) and 0.0 <= p.min_p <= 1.0):
        raise _invalid(errors.InvalidSamplingError, "min_p",
                       f"min_p must be in [0, 1], got {p.min_p!r}")


def _check_logit_bias(p: SamplingParams, vocab_size: int | None) -> None:
    top = vocab_size if vocab_size is not None else math.inf
    if len(p.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise _invalid(errors.InvalidSamplingError, "logit_bias",
                       f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                       f"got {len(p.logit_bias)}")
    bad = [t for t, b in p.logit_bias if not (_is_int(t) and 0 <= t < top)]
    if bad:
        raise _invalid(errors.InvalidSamplingError, "logit_bias",
                       f"logit_bias token ids must be integers in [0, {top}), got {bad[:5]!r}")
    bad = [b for _, b in p.logit_bias if not _is_real(b)]
    if bad:
        raise _invalid(errors.InvalidSamplingError, "logit_bias",
                       f"logit_bias values must be numbers in [{-MAX_LOGIT_BIAS}, "
                       f"{MAX_LOGIT_BIAS}] (larger ones are clamped), got {bad[:5]!r}")


def _check_vllm_extras(p: SamplingParams) -> None:
    if not (_is_int(p.min_tokens) and 0 <= p.min_tokens <= p.max_tokens):
        raise _invalid(errors.InvalidSamplingError, "min_tokens",
                       f"min_tokens must be an integer in [0, max_tokens={p.max_tokens}], "
                       f"got {p.min_tokens!r}")
    if not (_is_int(p.n) and 1 <= p.n <= MAX_N):
        raise _invalid(errors.InvalidSamplingError, "n",
                       f"n must be an integer in [1, {MAX_N}] (MAX_N), got {p.n!r}")
    if not (_is_int(p.priority) and INT32[0] <= p.priority <= INT32[1]):
        raise _invalid(errors.InvalidSamplingError, "priority",
                       f"priority must be an integer in [{INT32[0]}, {INT32[1]}], "
                       f"got {p.priority!r}")
    for name in ("include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise _invalid(errors.InvalidSamplingError, name,
                           f"{name} must be true or false, got {getattr(p, name)!r}")


def _normalized_bias(bias) -> tuple[tuple[int, float], ...]:
    """A mapping or (token_id, bias) pairs -> pairs sorted by token id (a later duplicate wins,
    as in a dict), numbers clamped to [-100, 100] as vLLM clamps them. Anything malformed is
    kept as given for validate_sampling to name."""
    try:
        items = dict(bias.items() if isinstance(bias, Mapping) else bias)
    except (TypeError, ValueError):
        return bias
    clamp = lambda b: (min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b)))  # noqa: E731
                       if _is_real(b) or (isinstance(b, float) and math.isinf(b)) else b)
    try:
        return tuple(sorted((t, clamp(b)) for t, b in items.items()))
    except TypeError:            # token ids that do not sort (mixed types): validation names them
        return tuple((t, clamp(b)) for t, b in items.items())


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
