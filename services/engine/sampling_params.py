"""Per-request sampling parameters (the engine's typed view of an OpenAI request's knobs)."""
from __future__ import annotations

from dataclasses import dataclass


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
