"""OpenAI request bodies, strictly typed (pydantic strict mode, unknown fields refused), and their
translation into a validated `Generation` plus a `ResponsePlan` saying how to shape the answer.

Accepted beyond OpenAI's fields, as vLLM does: `top_k`, `ignore_eos`. Accepted only at their
no-op values: n=1, best_of=1, presence/frequency_penalty 0, empty logit_bias, no suffix.

Every number has its range in the schema (so the OpenAPI document states it): an integer never
exceeds the protobuf field it is copied into (uint32 max_tokens, int32 top_k, int64 seed), and a
value out of range is a 400 naming the field and the range.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.config import TrafficClass
from services.gateway import errors
from services.gateway.config import ApiKey
from services.gateway.validation import (MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE,
                                         Generation, Validator)

INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
COMPLETION_DEFAULT_MAX_TOKENS = 16    # OpenAI's default for /v1/completions

MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]            # SamplingParams.max_tokens: uint32
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]                 # int32; -1 and 0 mean off
Seed = Annotated[int, Field(ge=INT64[0], le=INT64[1])]            # int64
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]           # uint32, the engine's limit
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
AtLeastOne = Annotated[int, Field(ge=1)]                          # n, best_of: compared, never copied
# prompt and stop are checked by their validators; these say what they take, for the document
PromptJson = WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                "maximum": UINT32_MAX}}]})
StopJson = WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1}},
    {"type": "null"}]})
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_RANGE_CODES = {"max_tokens": "invalid_max_tokens", "max_completion_tokens": "invalid_max_tokens"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Annotated[Any, StopJson] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: AtLeastOne | None = None
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
    prompt: Annotated[Any, PromptJson]
    echo: bool = False
    logprobs: Logprobs | None = None
    best_of: AtLeastOne | None = None
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
    top_logprobs: Logprobs | None = None


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
        if err["type"] in _RANGE_ERRORS and loc in _ranges(model):
            raise errors.bad_request(f"`{loc}` must be in {_ranges(model)[loc]}, got {err['input']}",
                                     loc, _RANGE_CODES.get(loc, "invalid_value")) from None
        raise errors.bad_request(f"`{loc}`: {msg}" if loc else msg, loc or None) from None


@functools.cache
def _ranges(model: type[_Strict]) -> dict[str, str]:
    """Each bounded field's range as the OpenAPI document states it, e.g. "[-1, 2147483647]"."""
    found = {}
    for name, prop in model.model_json_schema()["properties"].items():
        for s in (prop, *prop.get("anyOf", ())):
            if {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"} & s.keys():
                low = (f"[{s['minimum']}" if "minimum" in s else
                       f"({s['exclusiveMinimum']}" if "exclusiveMinimum" in s else "(-inf")
                high = (f"{s['maximum']}]" if "maximum" in s else
                        f"{s['exclusiveMaximum']})" if "exclusiveMaximum" in s else "inf)")
                found[name] = f"{low}, {high}"
    return found


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
        ids = v.encode_text(req.prompt, cls)
        echo_text = req.prompt
    else:
        ids = v.check_ids(req.prompt)
        echo_text = v.model.tokenizer.decode(ids) if req.echo and v.model.tokenizer else ""
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, COMPLETION_DEFAULT_MAX_TOKENS)
    params = _params(req, max_tokens)
    if req.logprobs is not None:
        params.logprobs = req.logprobs
        if req.echo:
            params.prompt_logprobs = params.logprobs
    v.check_params(params)
    plan = ResponsePlan("completion", request_id, v.model.name, int(time.time()), req.stream,
                        _include_usage(req), req.logprobs is not None,
                        echo_text if req.echo else None)
    return Generation(request_id, key, cls, tuple(ids), params, _requested_max(req)), plan


def chat(req: ChatCompletionRequest, key: ApiKey, cls: TrafficClass, v: Validator,
         request_id: str) -> tuple[Generation, ResponsePlan]:
    _check_common(req, v)
    if not req.messages:
        raise errors.bad_request("messages must hold at least one message", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise errors.bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    ids = v.check_ids(v.encode_chat([m.as_template_input() for m in req.messages], cls), "messages")
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, None,
                              "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    params = _params(req, max_tokens)
    if req.logprobs:
        params.logprobs = req.top_logprobs or 0
    v.check_params(params)
    plan = ResponsePlan("chat", request_id, v.model.name, int(time.time()), req.stream,
                        _include_usage(req), req.logprobs)
    return Generation(request_id, key, cls, tuple(ids), params, _requested_max(req)), plan


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
    if req.stream_options is not None and not req.stream:
        raise errors.bad_request("stream_options is only allowed with stream=true", "stream_options")


def _requested_max(req: _Common) -> int | None:
    a, b = req.max_tokens, req.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise errors.bad_request(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; "
                                 "send one of them", "max_tokens")
    return a if a is not None else b


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
