"""Router TokenChunks -> OpenAI response bodies (whole, or one SSE event per chunk).

Logprob shapes, as OpenAI (and vLLM) return them:
  completions  {"tokens": [str], "token_logprobs": [float|null], "top_logprobs": [{str: float}|null],
                "text_offset": [int]}; with echo the prompt's tokens come first, the first of them
                without a logprob (null)
  chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
Token strings are the tokens decoded one by one with special tokens kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.gateway.model import ServedModel
from services.gateway.openai_schema import ResponseShape

NO_LOGPROB = -9999.0      # OpenAI's stand-in for an impossible token


@dataclass
class Collected:
    """A whole generation, merged from its chunks (non-streaming responses): sample 0's choice
    here, samples 1..n-1's (n > 1, by TokenChunk.index) in `samples`."""

    text: str = ""
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    cached_tokens: int = 0            # prompt tokens the prefix cache served (usage)
    samples: dict[int, Collected] = field(default_factory=dict)

    def add(self, c: pb.TokenChunk) -> None:
        self.cached_tokens = max(self.cached_tokens, c.num_cached_tokens)
        choice = self if c.index == 0 else self.samples.setdefault(c.index, Collected())
        choice.text += c.text
        choice.logprobs.extend(c.logprobs)
        choice.prompt_logprobs.extend(c.prompt_logprobs)
        if c.finish_reason:                # this sample ended (the request: c.finished)
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

    def choices(self) -> list[tuple[int, Collected]]:
        return [(0, self), *sorted(self.samples.items())]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; completion tokens summed over the n samples, the prompt counted once.
    `prompt_tokens_details.cached_tokens`: vLLM's (with --enable-prompt-tokens-details; kvfleet
    always), the prompt tokens served from the prefix cache of the worker that ran the prefill."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shaper:
    def __init__(self, shape: ResponseShape, model: ServedModel, prompt_ids: tuple[int, ...]) -> None:
        self.shape = shape
        self.model = model
        self.quality_version = model.quality_version   # the serving worker's, once known
        self.prompt_ids = prompt_ids     # prompt logprobs name their token by position
        self._offset = 0                 # completions' text_offset, across stream events
        self._offsets: dict[int, int] = {}   # ... per sample index (n > 1)
        self._echoed: set[int] = set()   # completions: sample indices whose echo was sent
        self._completion_tokens = 0      # so far, for continuous usage stats
        self._cached_tokens = 0          # the prefix cache's share of the prompt (usage)
        self._opened = {0}               # chat: sample indices whose role delta was sent

    # ------------------------------------------------------------------ whole
    def body(self, c: Collected, prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole response: one choice per sample (n > 1: indices 0..n-1), usage over all."""
        choices = [self._choice(index, one, c) for index, one in c.choices()]
        body = {**self._head(stream=False), "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, c.cached_tokens)}
        if self.shape.prompt_logprobs and self.shape.kind == "chat":   # vLLM's: top-level for chat
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(c.prompt_logprobs)
        return body

    def _choice(self, index: int, c: Collected, whole: Collected) -> dict:
        choice = {"index": index, "finish_reason": _finish(c.finish_reason),
                  "stop_reason": c.stop_reason or None}
        if self.shape.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = self._chat_logprobs(c.logprobs)
            return choice
        self._offset = 0                  # each choice's text_offset counts from its own start
        choice["text"] = (self.shape.echo_text or "") + c.text
        choice["logprobs"] = self._completion_logprobs(whole.prompt_logprobs, c.logprobs,
                                                       self.shape.echo_text or "")
        if self.shape.prompt_logprobs:     # vLLM's: per choice for completions
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(whole.prompt_logprobs)
        return choice

    # ----------------------------------------------------------------- stream
    def first_events(self) -> list[dict]:
        """Chat opens with the assistant's role, as OpenAI's stream does."""
        if self.shape.kind != "chat":
            return []
        return [self._event({"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})]

    def events(self, c: pb.TokenChunk) -> list[dict]:
        """OpenAI chunk events for one router chunk (none for a chunk that carries nothing). A
        chunk is one sample's (`index`); its choice ends when it carries a finish_reason."""
        self._completion_tokens += len(c.token_ids)
        self._cached_tokens = max(self._cached_tokens, c.num_cached_tokens)
        fin = _finish(c.finish_reason)
        if self.shape.kind == "chat":
            if not (c.text or fin or (self.shape.logprobs and c.logprobs)):
                return []
            delta = {"content": c.text} if c.text or not fin else {}
            if c.index not in self._opened:     # a sample's first delta names the role
                self._opened.add(c.index)
                delta = {"role": "assistant", **delta}
            return [self._event({"index": c.index, "delta": delta,
                                 "logprobs": self._chat_logprobs(c.logprobs),
                                 "finish_reason": fin, "stop_reason": c.stop_reason or None})]
        echo = "" if c.index in self._echoed or self.shape.echo_text is None else self.shape.echo_text
        prompt_lps = list(c.prompt_logprobs) if self.shape.echo_text is not None else []
        self._echoed.add(c.index)
        if not (echo or c.text or fin or (self.shape.logprobs and (c.logprobs or prompt_lps))):
            return []
        self._offset = self._offsets.get(c.index, 0)     # text_offset runs per choice
        logprobs = self._completion_logprobs(prompt_lps, c.logprobs, echo)
        self._offsets[c.index] = self._offset
        return [self._event({"index": c.index, "text": echo + c.text,
                             "logprobs": logprobs,
                             "finish_reason": fin, "stop_reason": c.stop_reason or None})]

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(stream=True), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, self._cached_tokens)}

    # ---------------------------------------------------------------- helpers
    def _head(self, stream: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
                ("completion", False): "text_completion", ("completion", True): "text_completion"}
        return {"id": self.shape.request_id, "object": kind[(self.shape.kind, stream)],
                "created": self.shape.created, "model": self.shape.model,
                "system_fingerprint": self.quality_version}

    def _event(self, choice: dict) -> dict:
        event = {**self._head(stream=True), "choices": [choice]}
        if self.shape.continuous_usage:      # vLLM's continuous_usage_stats: the count so far
            event["usage"] = usage(len(self.prompt_ids), self._completion_tokens,
                                   self._cached_tokens)
        elif self.shape.include_usage:
            event["usage"] = None
        return event

    def _token(self, token_id: int) -> str:
        tok = self.model.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok else f"<{token_id}>"

    def _completion_logprobs(self, prompt: list[pb.TokenLogprob], generated: list[pb.TokenLogprob],
                             echo: str) -> dict | None:
        if not self.shape.logprobs:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        ids = [*self.prompt_ids[:len(prompt)], *(lp.token_id for lp in generated)]
        for token_id, lp in zip(ids, [*prompt, *generated]):
            text = self._token(token_id)
            first_prompt_token = math.isnan(lp.logprob) and not lp.top
            out["tokens"].append(text)
            out["token_logprobs"].append(None if first_prompt_token else _finite(lp.logprob))
            out["top_logprobs"].append(None if first_prompt_token else {
                text: _finite(lp.logprob), **{self._token(t.token_id): _finite(t.logprob) for t in lp.top}})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def _vllm_prompt_logprobs(self, prompt: list[pb.TokenLogprob]) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} holding the actual token and the top-N. A rank is known for the top-N
        (1..N); the actual token's is null when it is not among them (kvfleet does not rank the
        whole vocabulary)."""
        out: list[dict | None] = []
        for token_id, lp in zip(self.prompt_ids, prompt):
            if math.isnan(lp.logprob) and not lp.top:
                out.append(None)
                continue
            ranks = {t.token_id: i + 1 for i, t in enumerate(lp.top)}
            entry = {str(token_id): self._vllm_entry(token_id, lp.logprob, ranks.get(token_id))}
            for t in lp.top:
                entry.setdefault(str(t.token_id), self._vllm_entry(t.token_id, t.logprob,
                                                                   ranks[t.token_id]))
            out.append(entry)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self._token(token_id)}

    def _chat_logprobs(self, generated: list[pb.TokenLogprob]) -> dict | None:
        if not self.shape.logprobs:
            return None
        return {"content": [{**self._chat_entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._chat_entry(t.token_id, t.logprob) for t in lp.top]}
                            for lp in generated]}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self._token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NO_LOGPROB


def _finish(reason: str) -> str | None:
    return reason or None
