"""vLLM's logits processors, per row, in vLLM V1's order (vllm/v1/sample/sampler.py):

    raw logits --(raw logprobs here)--> float32
      1. min_tokens   EOS and stop_token_ids -> -inf while the row has < min_tokens outputs
      2. logit_bias   logits[t] += bias
      3. penalties    repetition (prompt + output tokens): logit > 0 ? logit / p : logit * p;
                      frequency (output): -= f * count;  presence (output): -= p * [count > 0]
      -- greedy rows take the argmax here (processed logprobs: log_softmax of this) --
      4. temperature  logits / T
      5. min_p        drop tokens with prob < min_p * max prob
      6. top-k, top-p (the sampler's, on what is left)

Steps 1-3 change the argmax, so they run for every row that asks for them, greedy or not; step 5
runs only for sampled rows (vLLM sets min_p to 0 for greedy requests). Each step builds tensors
only for the rows that use it, and only over the tokens those rows saw (no [rows, vocab] masks),
with vLLM's float32 arithmetic, so a greedy row picks what vLLM picks from the same logits.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from services.engine.sampling_params import SamplingParams


class History(Protocol):
    """What the processors read of a row's request (services.engine.request.Request has it)."""

    params: SamplingParams
    token_ids: list[int]            # prompt + output so far (not yet the token being sampled)
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]


def needs_processing(p: SamplingParams, h: History | None) -> bool:
    """Whether steps 1-3 touch this row now (min_tokens and penalties need its history)."""
    return bool(p.logit_bias) or (h is not None and (p.has_penalties or _barred(p, h)))


def _barred(p: SamplingParams, h: History) -> bool:
    """min_tokens still bars stop tokens: fewer outputs than min_tokens so far."""
    return p.min_tokens > 0 and len(h.token_ids) - h.num_prompt_tokens < p.min_tokens


class LogitsProcessors:
    """Steps 1-3 on a batch. Keeps, per live request, the unique ids of its prompt (weakly: an
    entry goes with its request), so a long prompt is not re-scanned every decode step."""

    def __init__(self) -> None:
        self._prompt_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 histories: Sequence[History | None]) -> torch.Tensor:
        """logits [n, vocab] float32, changed in place for the rows that need it."""
        rows = [i for i, (p, h) in enumerate(zip(params, histories)) if needs_processing(p, h)]
        known = [i for i in rows if histories[i] is not None]
        barred = [i for i in known if _barred(params[i], histories[i])]
        biased = [i for i in rows if params[i].logit_bias]
        penalized = [i for i in known if params[i].has_penalties]
        if barred:
            _mask_stop_tokens(logits, barred, params, histories)
        if biased:
            _add_bias(logits, biased, params)
        if penalized:
            self._penalize(logits, penalized, params, histories)
        return logits

    def _penalize(self, logits, rows, params, histories) -> None:
        """Penalties on (row, token) entries: repetition on what the row saw (prompt + output),
        frequency and presence on its output tokens with their counts."""
        device, vocab = logits.device, logits.shape[-1]
        seen, out, counts = [], [], []
        for i in rows:
            ids, n = _output_counts(histories[i], vocab)
            out.append(_pairs(i, ids))
            counts.append(n)
            if params[i].repetition_penalty != 1.0:
                prompt = self._unique_prompt(histories[i], vocab)
                seen.append(_pairs(i, torch.cat([prompt, ids]).unique()))
        if seen:
            index = tuple(x.to(device) for x in torch.cat(seen, dim=1))
            _repetition(logits, index, _column(params, "repetition_penalty", device)[index[0]])
        index = tuple(x.to(device) for x in torch.cat(out, dim=1))
        count = torch.cat(counts).to(device=device, dtype=torch.float32)
        # logits -= f * count; logits -= p * [count > 0]: vLLM's two subtractions, in its order
        logits[index] -= _column(params, "frequency_penalty", device)[index[0]] * count
        logits[index] -= _column(params, "presence_penalty", device)[index[0]]

    def _unique_prompt(self, h: History, vocab: int) -> torch.Tensor:
        ids = self._prompt_ids.get(h)
        if ids is None:
            ids = torch.tensor(h.token_ids[:h.num_prompt_tokens], dtype=torch.long).unique()
            ids = ids[ids < vocab]
            self._prompt_ids[h] = ids
        return ids


def _output_counts(h: History, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's distinct output ids (sorted) and how often each occurs."""
    output = torch.tensor(h.token_ids[h.num_prompt_tokens:], dtype=torch.long)
    ids, n = output.unique(return_counts=True)
    keep = ids < vocab
    return ids[keep], n[keep]


def _pairs(row: int, ids: torch.Tensor) -> torch.Tensor:
    """[2, len(ids)]: (row, token) index pairs."""
    return torch.stack([torch.full_like(ids, row), ids])


def _mask_stop_tokens(logits, rows, params, histories) -> None:
    vocab = logits.shape[-1]
    r, t = [], []
    for i in rows:
        stops = {x for x in (*histories[i].eos_token_ids, *params[i].stop_token_ids) if x < vocab}
        r += [i] * len(stops)
        t += sorted(stops)
    if r:
        logits[torch.tensor(r, device=logits.device), torch.tensor(t, device=logits.device)] = (
            float("-inf"))


def _add_bias(logits, rows, params) -> None:
    r = [i for i in rows for _ in params[i].logit_bias]
    t = [tok for i in rows for tok, _ in params[i].logit_bias]
    b = [bias for i in rows for _, bias in params[i].logit_bias]
    device = logits.device
    index = (torch.tensor(r, device=device), torch.tensor(t, device=device))
    logits[index] += torch.tensor(b, dtype=torch.float32, device=device)


def _repetition(logits, index, penalty: torch.Tensor) -> None:
    """vLLM's apply_repetition_penalties_torch on the seen (row, token) entries only: the
    others are multiplied by 1.0 there, which changes nothing."""
    seen = logits[index]
    logits[index] = seen * torch.where(seen > 0, 1.0 / penalty, penalty)


def _column(params, name: str, device) -> torch.Tensor:
    """[n] float32 of one field over the batch's rows (gathered by row index)."""
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] (after temperature), min_p [n]: tokens with prob < min_p * max prob ->
    -inf, as vLLM's MinPLogitsProcessor."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


__all__ = ["History", "LogitsProcessors", "apply_min_p", "needs_processing"]
