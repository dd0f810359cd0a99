"""What the engine hands back: per-step deltas (streaming) and finished completions, plus the
per-request output state that turns sampled tokens into text (detokenizer + stop strings) for
in-process use. An engine that makes no text (EngineConfig.detokenize False: the fleet's engine
cores) hands back TokenOutputs (token ids and logprobs, no text field: the gateway makes the
text); an in-process engine hands back RequestOutputs, the same with the delta's text."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.detokenizer import SampleText
from services.engine.request import Request, Status
from services.engine.token_logprob import TokenLogprob


@dataclass
class TokenOutput:
    """One step's news for one request (a stream delta), without text: what an engine core
    sends its worker. The last one has finished=True.

    n > 1: each output is one sample's (`index`); a sample's last output carries its
    finish_reason, and only the last output of the last sample to end has finished=True."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool                        # the engine's last output for the request
    finish_reason: str | None = None     # stop | length | abort | rejected
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None              # why it was rejected
    retry_after_s: float | None = None    # rejected: when a retry could meet the target
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the prompt completes
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    block_ids: list[int] | None = None    # prefilled: the request's KV blocks in position order,
                                          # for the prefill worker to ship (no second ask)
    # On the output carrying the request's first token, when this engine computed its prompt
    # (None otherwise, e.g. a decode-role request whose prompt was prefilled elsewhere), seconds
    # on the engine's clock: arrival -> first scheduled, first scheduled -> first token sampled.
    queue_s: float | None = None
    prefill_s: float | None = None
    index: int = 0                        # which of the request's n samples
    num_cached_tokens: int = 0            # prompt tokens this engine found in its prefix cache
    # Prefill role: this sample's prompt is computed and its first token sampled; its KV is held
    # for export until release(). Not an end: the request goes on at a decode worker, so it has
    # no finish_reason (`finished` still marks the engine's last output for the request).
    prefilled: bool = False


@dataclass
class RequestOutput(TokenOutput):
    """A TokenOutput with the text its tokens add (an in-process engine's; "" without a
    tokenizer)."""

    new_text: str = ""


@dataclass
class CompletionOutput:
    """A finished request, accumulated from its deltas (what `generate` returns)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    index: int = 0                        # which of the request's n samples
    num_cached_tokens: int = 0

    def add(self, delta: TokenOutput) -> None:
        self.token_ids += delta.new_token_ids
        if isinstance(delta, RequestOutput):
            self.text += delta.new_text
        self.logprobs += delta.new_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:      # this sample ended
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error = delta.error


class OutputState:
    """Per-request output state: its text (SampleText: incremental detokenizing, stop strings,
    what is final), pending logprobs, and what has been emitted. `tokenizer` None (a checkpoint
    without one, or an engine that makes no text, EngineConfig.detokenize): token ids only.
    `makes_text` False (an engine core's): its deltas are TokenOutputs, with no text field."""

    def __init__(self, req: Request, tokenizer, makes_text: bool = True) -> None:
        self.req = req
        self.output_type = RequestOutput if makes_text else TokenOutput
        self.text = (SampleText.for_params(tokenizer.raw, req.prompt_token_ids, req.params)
                     if tokenizer is not None else None)
        self.emitted_tokens = 0
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if req.params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False

    def on_token(self, token: int, logprob: TokenLogprob) -> str | None:
        """Record one sampled token; returns the stop string if one just completed."""
        if self.req.params.logprobs is not None:
            self.pending_logprobs.append(logprob)
        if self.text is None or self._is_stop_token(token):
            return None
        return self.text.push(token, self.req.num_output_tokens)

    def _is_stop_token(self, token: int) -> bool:
        """The EOS / stop token that just ended the request: as in vLLM, its text is left out
        unless include_stop_str_in_output."""
        req = self.req
        return (req.status == Status.FINISHED_STOPPED and req.stop_reason == token
                and not isinstance(req.stop_reason, str)
                and not req.params.include_stop_str_in_output)

    def seed_first_token(self, token: int) -> None:
        """Decode role: the first token was sampled and streamed by the prefill worker (which
        matched stop strings on it): its text is context here, not sent again."""
        if self.text is not None and not self._is_stop_token(token):
            self.text.push(token, 0)     # output token 0: no stop string is matched on it
            self.text.mark_sent()
        self.emitted_tokens = 1

    def delta(self) -> TokenOutput:
        req = self.req
        finished = req.is_finished
        text = {} if self.output_type is TokenOutput else {
            "new_text": self.text.take(finished) if self.text is not None else ""}
        out = self.output_type(
            request_id=req.external_id, index=req.index, num_cached_tokens=req.num_cached_tokens,
            new_token_ids=req.output_token_ids[self.emitted_tokens:], **text,
            new_logprobs=self.pending_logprobs, finished=finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            error=req.reject_reason, retry_after_s=req.retry_after_s,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            prefilled=req.status == Status.PREFILLED)
        if self.emitted_tokens == 0 and req.num_output_tokens > 0:
            out.queue_s, out.prefill_s = first_token_times(req)
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent and (
                req.num_output_tokens > 0 or finished):
            out.prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        self.emitted_tokens = req.num_output_tokens
        self.pending_logprobs = []
        return out


def first_token_times(req: Request) -> tuple[float | None, float | None]:
    """(queue_s, prefill_s) of a request that has its first token; (None, None) when this engine
    never scheduled its prompt."""
    if req.first_scheduled_time is None or req.first_token_time is None:
        return None, None
    return (req.first_scheduled_time - req.arrival_time,
            req.first_token_time - req.first_scheduled_time)
