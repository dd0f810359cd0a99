"""OpenAI request bodies, strictly typed (pydantic strict mode, unknown fields refused), and their
translation into a validated `Generation` plus a `ResponsePlan` saying how to shape the answer.

Accepted beyond OpenAI's fields, as vLLM does: `top_k`, `ignore_eos`. Accepted only at their
no-op values: n=1, best_of=1, presence/frequency_penalty 0, empty logit_bias, no suffix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from services.common.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.config import TrafficClass
from services.gateway import errors
from services.gateway.config import ApiKey
from services.gateway.validation import Generation, Validator

INT64 = (-(1 << 63), (1 << 63) - 1)
COMPLETION_DEFAULT_MAX_TOKENS = 16    # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("stop must be a string or a list of strings")


class TokenizeRequest(_Strict):
    """vLLM's `POST /tokenize` body (the load generator sizes its prompts with it)."""
    model: str
    prompt: str
    add_special_tokens: bool = True


class CompletionRequest(_Common):
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        """A string or a list of token ids; a list holding exactly one of those is unwrapped."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(type(t) is int for t in v):
            return v
        if isinstance(v, list) and all(isinstance(p, (str, list)) for p in v):
            raise ValueError(f"a list of {len(v)} prompts was sent; this gateway takes one prompt "
                             "per request (a string or a list of token ids)")
        raise ValueError("prompt must be a string or a list of token ids (integers)")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content if not isinstance(self.content, list) else \
            "".join(p.text for p in self.content)
        return {"role": self.role, "content": content or "", "name": self.name}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            raise errors.bad_request(f"body is not valid JSON: {msg}", None, "invalid_json") from None
        if err["type"] == "missing":
            raise errors.bad_request(f"missing required field `{loc}`", loc, "missing_field") from None
        if err["type"] == "extra_forbidden":
            raise errors.bad_request(f"unknown or unsupported field `{loc}`", loc,
                                     "unsupported_field") from None
        raise errors.bad_request(f"`{loc}`: {msg}" if loc else msg, loc or None) from None


@dataclass(frozen=True)
class ResponsePlan:
    """How to shape the answer to one OpenAI request."""

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    created: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo_text: str | None = None        # completions with echo: the prompt, prepended


def completion(req: CompletionRequest, key: ApiKey, cls: TrafficClass, v: Validator,
               request_id: str) -> tuple[Generation, ResponsePlan]:
    _check_common(req, v)
    for name, value, ok in (("best_of", req.best_of, (None, 1)), ("suffix", req.suffix, (None,))):
        if value not in ok:
            raise errors.bad_request(f"{name} is not supported (got {value!r})", name, "unsupported_value")
    if isinstance(req.prompt, str):
        ids = v.encode_text(req.prompt)
        echo_text = req.prompt
    else:
        ids = v.check_ids(req.prompt)
        echo_text = v.model.tokenizer.decode(ids) if req.echo and v.model.tokenizer else ""
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, COMPLETION_DEFAULT_MAX_TOKENS)
    params = _params(req, max_tokens)
    if req.logprobs is not None:
        params.logprobs = _nonneg(req.logprobs, "logprobs")
        if req.echo:
            params.prompt_logprobs = params.logprobs
    v.check_params(params)
    plan = ResponsePlan("completion", request_id, v.model.name, int(time.time()), req.stream,
                        _include_usage(req), req.logprobs is not None,
                        echo_text if req.echo else None)
    return Generation(request_id, key, cls, tuple(ids), params), plan


def chat(req: ChatCompletionRequest, key: ApiKey, cls: TrafficClass, v: Validator,
         request_id: str) -> tuple[Generation, ResponsePlan]:
    _check_common(req, v)
    if not req.messages:
        raise errors.bad_request("messages must hold at least one message", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise errors.bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    ids = v.check_ids(v.encode_chat([m.as_template_input() for m in req.messages]), "messages")
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, None,
                              "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    params = _params(req, max_tokens)
    if req.logprobs:
        params.logprobs = _nonneg(req.top_logprobs or 0, "top_logprobs")
    v.check_params(params)
    plan = ResponsePlan("chat", request_id, v.model.name, int(time.time()), req.stream,
                        _include_usage(req), req.logprobs)
    return Generation(request_id, key, cls, tuple(ids), params), plan


def _check_common(req: _Common, v: Validator) -> None:
    v.check_model(req.model)
    if req.n not in (None, 1):
        raise errors.bad_request(f"n={req.n} is not supported: this gateway returns one choice per "
                                 "request (n must be 1)", "n", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise errors.bad_request(f"{name} is not supported (only 0)", name, "unsupported_value")
    if req.logit_bias:
        raise errors.bad_request("logit_bias is not supported", "logit_bias", "unsupported_value")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise errors.bad_request(f"top_p must be in (0, 1], got {req.top_p}", "top_p", "invalid_value")
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise errors.bad_request("seed must fit in a signed 64-bit integer", "seed", "invalid_value")
    if req.stream_options is not None and not req.stream:
        raise errors.bad_request("stream_options is only allowed with stream=true", "stream_options")


def _requested_max(req: _Common) -> int | None:
    a, b = req.max_tokens, req.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise errors.bad_request(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; "
                                 "send one of them", "max_tokens")
    return a if a is not None else b


def _nonneg(n: int, name: str) -> int:
    if n < 0:
        raise errors.bad_request(f"{name} must be between 0 and 20, got {n}", name, "invalid_value")
    return n


def _params(req: _Common, max_tokens: int) -> pb.SamplingParams:
    p = pb.SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=req.stop,
        ignore_eos=req.ignore_eos)
    if req.seed is not None:
        p.seed = req.seed
    return p


def _include_usage(req: _Common) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)
