"""Turns one step's logits into tokens plus their logprobs, in vLLM V1's order: vLLM's logits
processors (min_tokens, logit_bias, penalties: logits_process.py), then greedy argmax, or
temperature, min_p, top-k / top-p and a draw.

Sampling is inverse-CDF with one uniform u in (0, 1] per sampled row, drawn from that row's own
generator (or, for unseeded rows, the sampler's engine-wide one, in row order). The distribution a
row is sampled from, and the order its CDF runs in, depend only on that row's logits and params:

    row without top-k / top-p:  weights in vocab order         w = exp(logits/T - max)
    row with top-k or top-p:    weights sorted descending      w[0] >= w[1] >= ...
                                top-k keeps w[:k], top-p the shortest prefix with mass >= top_p

so a seeded request draws the same tokens whatever else is in the batch (up to float rounding of
the batched reductions). min_p removes tokens (-inf) before that, so they get no weight. The uniforms come from CPU generators, so a seed means the same u on any
device. Cumulative sums run in float64: in float32, adding a 1e-8 token to 0.99 adds nothing, and a
150k-token tail would silently lose its mass.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from services.engine.logits_process import History, LogitsProcessors, apply_min_p, needs_processing
from services.engine.sampling_params import SamplingParams
from services.engine.token_logprob import TokenLogprob

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

_NAN = float("nan")
_GREEDY_BELOW = 1e-5  # temperatures this small are argmax (as in vLLM); logits / 1e-30 would overflow


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator for a seeded request; None means "use the sampler's engine-wide one"."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_BELOW


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0


class Sampler:
    """Samples one token per row. Called every iteration with the rows that sample this step.

    `logprobs_mode` is vLLM's --logprobs-mode: "raw_logprobs" (vLLM's default) or
    "processed_logprobs". Prompt logprobs are raw either way (as in vLLM)."""

    def __init__(self, seed: int = 0, logprobs_mode: LogprobsMode = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self._generator = make_generator(seed)
        self.logprobs_mode = logprobs_mode
        self._processors = LogitsProcessors()

    def __call__(
        self,
        logits: torch.Tensor,  # [N, vocab] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History | None] | None = None,   # each row's request; None: no
    ) -> list[TokenLogprob]:                                   # min_tokens / penalties
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
        histories = histories if histories is not None else [None] * len(params)
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        processed = any(needs_processing(p, h) for p, h in zip(params, histories))
        if not wants_logprobs and not processed and all(_greedy(p) for p in params):
            return [TokenLogprob(t, _NAN) for t in logits.argmax(dim=-1).tolist()]
        raw = logits
        if processed:
            logits = self._processors(logits.float().clone(), params, histories)
        token_ids = self._choose(logits, params, generators)
        if self.logprobs_mode == "processed_logprobs" and wants_logprobs:
            return _attach_logprobs(_final_logits(logits, params), token_ids, params,
                                    wants_logprobs)
        return _attach_logprobs(raw, token_ids, params, wants_logprobs)

    def _choose(self, logits, params, generators) -> torch.Tensor:
        """[N] token ids: argmax for greedy rows, a draw for the others."""
        token_ids = logits.argmax(dim=-1)
        plain = [i for i, p in enumerate(params) if not _greedy(p) and not _filters(p)]
        filtered = [i for i, p in enumerate(params) if not _greedy(p) and _filters(p)]
        u = self._uniforms(params, generators, logits.device)
        for rows, sample in ((plain, _sample_plain), (filtered, _sample_filtered)):
            if rows:
                index = torch.tensor(rows, device=logits.device)
                token_ids[index] = sample(logits[index], [params[i] for i in rows], u[index])
        return token_ids

    def _uniforms(self, params, generators, device) -> torch.Tensor:
        """[N] float64 in (0, 1]: one draw per sampled row from its own generator; greedy rows get 1."""
        u = torch.ones(len(params), dtype=torch.float64)
        unseeded = [i for i, p in enumerate(params) if not _greedy(p) and generators[i] is None]
        for i, (p, g) in enumerate(zip(params, generators)):
            if not _greedy(p) and g is not None:
                u[i] = 1.0 - torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
        if unseeded:
            draws = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64)
            u[torch.tensor(unseeded)] = 1.0 - draws
        return u.to(device)


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits / T, then min_p (vLLM's order) for the rows that set it."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits.float() / temperature.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        scaled = apply_min_p(scaled, min_p)
    return scaled


def _final_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """processed_logprobs: what each row sampled from. Greedy rows: the processed logits
    (vLLM skips temperature for them); sampled rows: after temperature, min_p, and -inf outside
    their top-k / top-p."""
    out = logits.float().clone()
    rows = [i for i, p in enumerate(params) if not _greedy(p)]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        picked = [params[i] for i in rows]
        out[index] = _top_k_top_p_mask(_scaled(logits[index], picked), picked)
    return out


def _top_k_top_p_mask(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """-inf outside the candidates _sample_filtered draws from (the whole row without filters)."""
    if not any(_filters(p) for p in params):
        return scaled
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scaled.device)
    weights = (values - values[:, :1]).exp().double()
    weights.masked_fill_(torch.arange(vocab, device=scaled.device) >= k.clamp(max=vocab).unsqueeze(1), 0.0)
    kept = _nucleus_size(weights.cumsum(dim=-1),
                         torch.tensor([p.top_p for p in params], device=scaled.device))
    drop = torch.arange(vocab, device=scaled.device) >= kept.unsqueeze(1)   # in sorted order
    return scaled.scatter(1, order, values.masked_fill(drop, float("-inf")))


def _sample_plain(logits, params, u) -> torch.Tensor:
    """Rows with no top-k / top-p: inverse CDF over the whole vocab, in vocab order."""
    scaled = _scaled(logits, params)
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp().double()
    cdf = weights.cumsum(dim=-1)  # [n, vocab]
    return _invert(cdf, u * cdf[:, -1])


def _sample_filtered(logits, params, u) -> torch.Tensor:
    """Rows with top-k and/or top-p: inverse CDF over the descending-sorted candidates."""
    scaled = _scaled(logits, params)
    vocab = scaled.shape[-1]
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scaled.device)
    k = k.clamp(max=vocab)
    width = int(k.max())
    # Top-k only needs the first k sorted candidates; topk(width) is much cheaper than a full sort.
    values, order = scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True)
    weights = (values - values[:, :1]).exp().double()  # [n, width], descending
    weights.masked_fill_(torch.arange(width, device=scaled.device) >= k.unsqueeze(1), 0.0)
    cdf = weights.cumsum(dim=-1)
    kept = _nucleus_size(cdf, torch.tensor([p.top_p for p in params], device=scaled.device))
    kept_mass = cdf.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    return order.gather(1, _invert(cdf, u * kept_mass).unsqueeze(1)).squeeze(1)


def _nucleus_size(cdf: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n] length of the shortest prefix whose mass >= top_p of the (top-k) total; at least 1.

    Candidate i is kept iff the mass strictly before it is < top_p * total, which is a prefix.
    """
    mass_before = torch.nn.functional.pad(cdf[:, :-1], (1, 0))
    total = cdf[:, -1:]
    return (mass_before < top_p.double().unsqueeze(1) * total).sum(dim=-1).clamp(min=1)


def _invert(cdf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[n] first index with cdf >= x. With 0 < x <= cdf[last kept], that index has weight > 0."""
    return torch.searchsorted(cdf, x.unsqueeze(1)).squeeze(1)


def _attach_logprobs(logits, token_ids: torch.Tensor, params, rows: list[int]) -> list[TokenLogprob]:
    """Wrap token ids; rows listed in `rows` also get their logprob (log_softmax of `logits`) and
    top-N alternatives."""
    ids = token_ids.tolist()
    out = [TokenLogprob(t, _NAN) for t in ids]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)
        entries = _entries(logprobs, token_ids[index], [params[i].logprobs for i in rows])
        for i, entry in zip(rows, entries):
            out[i] = entry
    return out


def _entries(logprobs: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[TokenLogprob]:
    """logprobs [n, vocab] (already log_softmax), token_ids [n] -> one TokenLogprob per row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    width = min(max(top_ns, default=0), logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(width, dim=-1)  # [n, width], descending; width may be 0
    top = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    return [
        TokenLogprob(t, lp, top[r][:n] if n > 0 else ())
        for r, (t, lp, n) in enumerate(zip(token_ids.tolist(), chosen, top_ns))
    ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """The logprob the model gave each actual next prompt token (echo / prompt_logprobs).

    logits [q, vocab] at prompt positions 0..q-1; next_token_ids[i] is the prompt token at i+1.
    """
    assert logits.shape[0] == len(next_token_ids)
    if not next_token_ids:
        return []
    ids = torch.tensor(list(next_token_ids), device=logits.device)
    return _entries(torch.log_softmax(logits.float(), dim=-1), ids, [top_n] * len(next_token_ids))


__all__ = ["LOGPROBS_MODES", "LogprobsMode", "Sampler", "TokenLogprob", "make_generator",
           "prompt_logprobs"]
