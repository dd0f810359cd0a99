"""The simulated engine's token rule: every token a function of (the request's seed, or the engine
seed and the sample's index; a hash of the prompt; the output position), no logits.

  * a token is drawn from the served tokenizer's vocabulary less its special and EOS ids, and less
    the request's stop ids while it has fewer than min_tokens outputs;
  * without ignore_eos a request's output length L is drawn once from the seeded distribution
    `SimConfig.output_len` (at least min_tokens + 1) and its L-th output token is EOS;
  * logprobs are synthetic: a deterministic value in [-4.05, -0.05) per position (the token's
    first in its top-N list, the others below it), the same rule for prompt logprobs.
"""
from __future__ import annotations

import hashlib
import math
import random
import struct
import weakref
from collections.abc import Iterable, Sequence

from services.engine.config import parse_output_len
from services.engine.request import Request
from services.engine.token_logprob import TokenLogprob

_MASK = (1 << 64) - 1
_NAN = float("nan")
_OUTPUT_LEN, _LOGPROB, _UNSEEDED = 1, 2, 3     # salts: one stream of draws per use


def mix(*values: int) -> int:
    """A 64-bit hash of integers, the same in every process (no PYTHONHASHSEED)."""
    data = struct.pack(f"<{len(values)}Q", *(v & _MASK for v in values))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_key(token_ids: Sequence[int]) -> int:
    data = struct.pack(f"<{len(token_ids)}Q", *(t & _MASK for t in token_ids))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def draw_output_len(spec: str, key: int) -> int:
    """One output length (>= 1) from the distribution `spec` names, seeded by `key`.
    lognormal:mean=M,sigma=S has mean M (mu = ln M - S^2/2); geometric:mean=M counts trials
    until the first success at p = 1/M (mean M); fixed:N is N."""
    kind, p = parse_output_len(spec)
    rng = random.Random(key)
    if kind == "fixed":
        return int(p["n"])
    if kind == "geometric":
        q = 1.0 - 1.0 / p["mean"]
        return 1 if q <= 0 else 1 + int(math.log(1.0 - rng.random()) / math.log(q))
    mu = math.log(p["mean"]) - p["sigma"] ** 2 / 2
    return max(1, round(rng.lognormvariate(mu, p["sigma"])))


class TokenRule:
    def __init__(self, vocab_size: int, excluded: Iterable[int], engine_seed: int,
                 output_len: str) -> None:
        excluded = set(excluded)
        self.vocab = [t for t in range(vocab_size) if t not in excluded]
        if not self.vocab:
            raise ValueError("the simulated engine needs a vocabulary with ordinary tokens")
        self.engine_seed = engine_seed
        self.output_len_spec = output_len
        self._prompts: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._lengths: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def key(self, req: Request) -> int:
        """The request's stream: its seed, or the engine seed and its sample index, with its
        prompt."""
        pk = self._prompts.get(req)
        if pk is None:
            pk = self._prompts[req] = prompt_key(req.prompt_token_ids)
        seed = req.params.seed
        return mix(pk, seed) if seed is not None else mix(pk, _UNSEEDED, self.engine_seed, req.index)

    def output_len(self, req: Request) -> int:
        """L: the request ends with EOS as its L-th output token (not under ignore_eos)."""
        n = self._lengths.get(req)
        if n is None:
            n = self._lengths[req] = max(draw_output_len(self.output_len_spec,
                                                         mix(self.key(req), _OUTPUT_LEN)),
                                         req.params.min_tokens + 1)
        return n

    def next_token(self, req: Request) -> TokenLogprob:
        """The token at output position req.num_output_tokens."""
        pos, p = req.num_output_tokens, req.params
        key = self.key(req)
        if not p.ignore_eos and req.eos_token_ids and pos + 1 >= self.output_len(req):
            token = min(req.eos_token_ids)
        else:
            i = mix(key, pos) % len(self.vocab)
            token = self.vocab[i]
            while pos < p.min_tokens and token in p.stop_token_ids:   # as the real min_tokens mask
                i = (i + 1) % len(self.vocab)
                token = self.vocab[i]
        return self.logprob(token, key, pos, p.logprobs)

    def logprob(self, token: int, key: int, pos: int, top_n: int | None) -> TokenLogprob:
        """Synthetic: NaN unless asked for (top_n not None)."""
        if top_n is None:
            return TokenLogprob(token, _NAN)
        h = mix(key, _LOGPROB, pos)
        lp = -0.05 - 4.0 * (h % 10_000) / 10_000
        others = [self.vocab[(h + j) % len(self.vocab)] for j in range(1, top_n)]
        top = [(token, lp)] + [(t, lp - 0.5 * j) for j, t in enumerate(others, 1)] if top_n else []
        return TokenLogprob(token, lp, tuple(top))

    def prompt_logprobs(self, req: Request, start: int, targets: Sequence[int],
                        top_n: int) -> list[TokenLogprob]:
        """Synthetic prompt logprobs of `targets` (the prompt tokens at start + 1 ...)."""
        key = mix(self.key(req), _LOGPROB)
        return [self.logprob(t, key, -(start + 1 + i), top_n) for i, t in enumerate(targets)]
