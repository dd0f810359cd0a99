"""Everything the gateway checks before a request may touch the fleet (DESIGN section 3, step 1).

REST and gRPC requests both end here as a `Generation`: prompt token ids (tokenized with the
model's own tokenizer), the sampling parameters as they go on the wire, the tenant and class of
the API key. Each check raises a GatewayError whose message says what is wrong and the limits.
"""
from __future__ import annotations

from dataclasses import dataclass

import jinja2

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine import errors as engine_errors
from services.engine.config import TrafficClass
from services.engine.sampling_params import (MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE,
                                             SamplingParams, validate_sampling)
from services.gateway import errors
from services.gateway.config import ApiKey
from services.gateway.model import ServedModel

# Text longer than this many characters per token of the model's context is refused before it is
# tokenized (413): whatever it holds, it could not be a prompt, and tokenizing it costs the gateway CPU
# (3.9 MB: 1.3-1.6 s). Typical text is ~4 characters a token, so 8 leaves room for truncation.
TEXT_CHARS_PER_CONTEXT_TOKEN = 8

__all__ = ["MAX_LOGPROBS", "MAX_STOP_STRINGS", "MAX_TEMPERATURE", "Generation", "Validator"]


@dataclass(frozen=True)
class Generation:
    """One validated request, ready for the router."""

    request_id: str
    key: ApiKey
    traffic_class: TrafficClass
    prompt_ids: tuple[int, ...]
    params: pb.SamplingParams
    requested_max_tokens: int | None = None     # as the client sent it (None: not sent)

    @property
    def output_cap(self) -> int | None:
        """The class output cap when it clamped the client's max_tokens (named in a response
        header, `x-kvfleet-output-cap`), else None."""
        cap = self.traffic_class.output_cap
        return cap if (self.requested_max_tokens or 0) > cap else None


class Validator:
    def __init__(self, model: ServedModel) -> None:
        self.model = model

    # -------------------------------------------------------------- model, prompt
    @property
    def served_name(self) -> str:
        """The name responses carry (vLLM's: the first --served-model-name)."""
        return self.model.name

    def check_model(self, name: str | None) -> None:
        """Any served name (`--served-model-name A B`) is this model; None is the first name."""
        if name is not None and name not in self.model.names:
            raise errors.model_not_found(name, ", ".join(self.model.names))

    def encode_text(self, text: str, cls: TrafficClass, param: str = "prompt", *,
                    add_special_tokens: bool = True, check_bytes: bool = True) -> list[int]:
        """A text prompt's ids: plain text (a typed `<|eot_id|>` is text, not the control token),
        the tokenizer's bos added unless `add_special_tokens` is false. `check_bytes` false (the
        prompt is truncated afterwards) skips the refusal of text too long to fit."""
        if not text:
            raise errors.bad_request(f"{param} is empty; send at least one token", param, "empty_prompt")
        tok = self.model.tokenizer
        if tok is None:
            raise errors.bad_request("this model has no tokenizer: send prompt token ids", param)
        if check_bytes:   # the tighter bound, when it applies
            self._check_text_bytes(len(text.encode("utf-8")), cls, param)
        self.check_text_chars(len(text), param)
        return tok.encode_user_text(text, add_special_tokens)

    def encode_chat(self, messages: list[dict], cls: TrafficClass, *,
                    add_generation_prompt: bool = True, check_bytes: bool = True) -> list[int]:
        """The chat template's ids; special tokens only where the template writes them, the
        messages' text as plain text."""
        tok = self.model.tokenizer
        if tok is None or tok.chat_template is None:
            raise errors.bad_request(f"model `{self.model.name}` has no chat template; "
                                     "use /v1/completions", "messages")
        # templates trim message text: only what is left of it must become tokens
        if check_bytes:
            self._check_text_bytes(sum(len(m["content"].strip().encode("utf-8")) for m in messages),
                                   cls, "messages")
        self.check_text_chars(sum(len(m["content"]) for m in messages), "messages")
        try:   # holds the bos
            return tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise errors.bad_request(f"messages do not fit the chat template: {e}", "messages") from None

    @property
    def max_text_chars(self) -> int:
        return TEXT_CHARS_PER_CONTEXT_TOKEN * self.model.max_model_len

    def check_text_chars(self, n_chars: int, param: str) -> None:
        """Refuse (413) text too long to be worth tokenizing, even to truncate it."""
        if n_chars > self.max_text_chars:
            raise errors.GatewayError(
                413, f"{param} holds {n_chars} characters of text; at most {self.max_text_chars} are "
                f"tokenized ({TEXT_CHARS_PER_CONTEXT_TOKEN} per token of the model's "
                f"{self.model.max_model_len}-token context)", code="text_too_long", param=param)

    def check_token_count(self, n: int, param: str) -> None:
        """Refuse more ids than the model's context: /tokenize never returns more."""
        if n > self.model.max_model_len:
            raise errors.context_too_long(
                f"{param} is {n} tokens; this model's maximum context length is "
                f"{self.model.max_model_len} tokens, and /tokenize returns at most that many", param)

    def _check_text_bytes(self, n_bytes: int, cls: TrafficClass, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the prompt limit: no token covers
        more than `max_bytes_per_token` bytes, so n_bytes > limit * that means > limit tokens."""
        per_token = self.model.tokenizer.max_bytes_per_token
        limit = min(cls.max_prompt_tokens, self.model.max_model_len - 1)
        if per_token is None or n_bytes <= limit * per_token:
            return
        raise errors.context_too_long(
            f"{param} holds {n_bytes} bytes of text; at most {limit * per_token} bytes can fit: "
            f"traffic class {cls.name!r} allows at most {limit} prompt tokens (model context "
            f"{self.model.max_model_len}) and no token of this model covers more than "
            f"{per_token} bytes", param)

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise errors.bad_request(f"{param} is empty; send at least one token", param, "empty_prompt")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise errors.bad_request(f"prompt token ids must be in [0, {self.model.vocab_size}); "
                                     f"got {bad[:5]}{' ...' if len(bad) > 5 else ''}", param,
                                     "token_out_of_vocab")
        return ids

    # ------------------------------------------------------------------- lengths
    def max_tokens(self, requested: int | None, n_prompt: int, cls: TrafficClass,
                   default: int | None, param: str = "max_tokens") -> int:
        """The output bound: `requested` clamped to the class's output cap (the request then ends
        with finish_reason "length" at the cap, as the engine clamps it too: the KV reservation
        covers prompt + min(max_tokens, cap)), or `default`, or (None) what the context and the
        cap leave. Checks the prompt against the class and prompt + output against the context."""
        self._check_prompt(n_prompt, cls)
        if requested is None:
            room = self.model.max_model_len - n_prompt
            requested = default if default is not None else min(room, cls.output_cap)
            requested = max(1, min(requested, room))   # a default never overflows by itself
        if requested < 1:
            raise errors.bad_request(f"{param} must be a positive integer, got {requested}", param,
                                     "invalid_max_tokens")
        requested = min(requested, cls.output_cap)
        total = n_prompt + requested
        if total > self.model.max_model_len:
            raise errors.context_too_long(
                f"this model's maximum context length is {self.model.max_model_len} tokens; the "
                f"request asks for {total} ({n_prompt} in the prompt, {requested} in the output): "
                f"shorten the prompt or lower {param}", param)
        return requested

    def _check_prompt(self, n: int, cls: TrafficClass) -> None:
        if n > cls.max_prompt_tokens:
            raise errors.context_too_long(
                f"prompt has {n} tokens; traffic class {cls.name!r} allows at most "
                f"{cls.max_prompt_tokens} prompt tokens (model context {self.model.max_model_len})")
        if n >= self.model.max_model_len:
            raise errors.context_too_long(
                f"prompt has {n} tokens; this model's maximum context length is "
                f"{self.model.max_model_len} tokens, prompt and output together")

    # ---------------------------------------------------------- sampling params
    def check_params(self, p: pb.SamplingParams) -> None:
        """The wire params through the engine's own check (one validation for both), its error
        as a 400 naming the field, with the engine's message."""
        try:
            validate_sampling(_engine_params(p), self.model.vocab_size)
        except engine_errors.InvalidRequestError as e:
            code = ("invalid_max_tokens" if isinstance(e, engine_errors.InvalidMaxTokensError)
                    else "invalid_value")
            raise errors.bad_request(e.message, getattr(e, "param", None), code) from None


def _engine_params(p: pb.SamplingParams) -> SamplingParams:
    """The wire params as the engine reads them: services.protocol.params.params_from_pb, the
    one reading (torch-free; proto3's unset fields are vLLM's defaults), every field included."""
    from services.protocol.params import params_from_pb  # noqa: PLC0415
    return params_from_pb(p)
