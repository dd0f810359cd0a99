"""OpenAI request bodies, strictly typed (pydantic strict mode), and their translation into a
validated `Generation` plus a `ResponseShape` saying how to shape the answer.

Three kinds of field (README, "Coming from vLLM"):
  - OpenAI's and vLLM's sampling fields that kvfleet implements (`repetition_penalty`, `min_p`,
    `min_tokens`, `logit_bias`, `priority`, ...): typed here, ranged, carried on the wire;
  - fields OpenAI or vLLM define that kvfleet does not implement (`UNSUPPORTED`: `best_of` > 1,
    `tools`, `guided_json`, `response_format`, ...): accepted only at the value that changes
    nothing, otherwise a 400 `unsupported_field` naming the field, never silently ignored;
  - anything else: a 400 `unknown_field`.

Every number has its range in the schema (so the OpenAPI document states it): an integer never
exceeds the protobuf field it is copied into (uint32 max_tokens, int32 top_k, int64 seed), and a
value out of range is a 400 naming the field and the range.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator,
                      model_validator)

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.gateway import errors
from services.gateway.classes import ClassChoice
from services.gateway.config import ApiKey
from services.gateway.validation import (MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE,
                                         Generation, Validator)

INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
COMPLETION_DEFAULT_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
MAX_N = 16                            # parallel samples per request (the engine's check agrees)

MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]            # SamplingParams.max_tokens: uint32
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]                 # int32; -1 and 0 mean off
Seed = Annotated[int, Field(ge=INT64[0], le=INT64[1])]            # int64
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]           # uint32, the engine's limit
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
AtLeastOne = Annotated[int, Field(ge=1)]                          # best_of: compared, never copied
Samples = Annotated[int, Field(ge=1, le=MAX_N)]                   # n: uint32 on the wire
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]                # presence / frequency (OpenAI's)
RepetitionPenalty = Annotated[float, Field(gt=0.0)]                # 1.0: off (vLLM's)
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
MinTokens = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Priority = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]  # int32; lower runs first
Truncate = Annotated[int, Field(ge=-1, le=INT64[1])]              # -1: to the context; k: last k
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
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
LOGIT_BIAS_RANGE = (-100.0, 100.0)    # OpenAI's

# Fields OpenAI or vLLM define (vLLM 0.32's CompletionRequest / ChatCompletionRequest) that kvfleet
# does not implement: each maps to the values that change nothing, the only ones accepted.
_NOOP_FALSE = (None, False)
_UNSUPPORTED_COMMON: dict[str, tuple] = {
    "use_beam_search": _NOOP_FALSE, "length_penalty": (None, 1.0, 1), "watermarking": _NOOP_FALSE,
    "allowed_token_ids": (None,), "bad_words": (None, []), "logprob_token_ids": (None,),
    "truncation_side": (None, "left"), "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "logits_processors": (None,), "request_id": (None,),
    "session_id": (None,), "return_tokens_as_token_ids": _NOOP_FALSE,
    "return_token_ids": _NOOP_FALSE, "return_token_offsets": _NOOP_FALSE,
    "routed_experts_prompt_start": (None, 0), "mm_payload": (None,),
    "return_mm_kwargs": _NOOP_FALSE, "cache_salt": (None,), "kv_transfer_params": (None,),
    "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
    "thinking_token_budget": (None,), "stream_interval": (None, 1), "prompt_embeds": (None,),
    "metadata": (None,), "store": _NOOP_FALSE, "service_tier": (None, "auto", "default"),
}
_UNSUPPORTED_COMPLETION = {**_UNSUPPORTED_COMMON, "best_of": (None, 1), "suffix": (None, "")}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON, "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none"),
    "reasoning_effort": (None,), "include_reasoning": (None, True), "echo": _NOOP_FALSE,
    "continue_final_message": _NOOP_FALSE, "documents": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "media_io_kwargs": (None,), "mm_processor_kwargs": (None,),
    "return_prompt_text": _NOOP_FALSE, "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "verbosity": (None,),
}
_UNSUPPORTED_TOKENIZE = {"return_token_strs": _NOOP_FALSE, "tools": (None, []),
                         "chat_template": (None,), "chat_template_kwargs": (None, {}),
                         "continue_final_message": _NOOP_FALSE, "media_io_kwargs": (None,),
                         "mm_processor_kwargs": (None,)}
_RANGE_CODES = {"max_tokens": "invalid_max_tokens", "max_completion_tokens": "invalid_max_tokens"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        """Drop the UNSUPPORTED fields sent at a value that changes nothing; refuse the others."""
        if not isinstance(data, dict) or not cls.UNSUPPORTED.keys() & data.keys():
            return data
        for name in cls.UNSUPPORTED.keys() & data.keys():
            if not _noop(data[name], cls.UNSUPPORTED[name]):
                raise errors.bad_request(
                    f"`{name}` is not supported by kvfleet (got {_short(data[name])}); it is "
                    f"accepted only as {' or '.join(_short(v) for v in cls.UNSUPPORTED[name])}",
                    name, "unsupported_field")
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}


def _noop(value: Any, accepted: tuple) -> bool:
    return any(value == a and type(value) is type(a) or value is None and a is None
               or (isinstance(a, float) and type(value) is int and value == a) for a in accepted)


def _short(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False   # vLLM's: usage on every chunk


class _Common(_Strict):
    model: str | None = None             # vLLM's: absent means the first served name
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Annotated[Any, StopJson] = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Samples | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Truncate | None = None
    prompt_logprobs: Logprobs | None = None
    priority: Priority = 0

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
    """vLLM's `POST /tokenize` body, completion form (the load generator sizes its prompts with it)."""
    UNSUPPORTED = _UNSUPPORTED_TOKENIZE
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize` body -> {"prompt": text}."""
    model: str | None = None
    tokens: list[TokenId]


class CompletionRequest(_Common):
    UNSUPPORTED = _UNSUPPORTED_COMPLETION
    prompt: Annotated[Any, PromptJson]
    echo: bool | None = False
    logprobs: Logprobs | None = None
    add_special_tokens: bool = True      # vLLM's: the tokenizer's BOS on a text prompt

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
    UNSUPPORTED = _UNSUPPORTED_CHAT
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True   # vLLM's: end the template with the assistant's turn


class TokenizeChatRequest(_Strict):
    """vLLM's `POST /tokenize` body, chat form: the chat template's ids."""
    UNSUPPORTED = _UNSUPPORTED_TOKENIZE
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


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
            raise errors.bad_request(f"unknown field `{loc}`: neither OpenAI nor vLLM defines it",
                                     loc, "unknown_field") from None
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
class ResponseShape:
    """How to shape the answer to one OpenAI request."""

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    created: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo_text: str | None = None        # completions with echo: the prompt, prepended
    continuous_usage: bool = False      # stream_options.continuous_usage_stats: usage on each chunk
    prompt_logprobs: bool = False       # vLLM's `prompt_logprobs` field: a choice-level list


def completion(req: CompletionRequest, key: ApiKey, classes: ClassChoice, v: Validator,
               request_id: str) -> tuple[Generation, ResponseShape]:
    _check_common(req, v)
    truncate = _truncation(req, v)
    if isinstance(req.prompt, str):
        ids = v.encode_text(req.prompt, classes.widest, add_special_tokens=req.add_special_tokens,
                            check_bytes=truncate is None)
    else:
        ids = v.check_ids(req.prompt)
    ids = _truncate(ids, truncate)
    cls = classes.pick(len(ids))
    echo_text = None
    if req.echo:
        echo_text = (req.prompt if isinstance(req.prompt, str) and truncate is None else
                     v.model.tokenizer.decode(ids) if v.model.tokenizer else "")
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, COMPLETION_DEFAULT_MAX_TOKENS)
    params = _params(req, max_tokens)
    if req.logprobs is not None:
        params.logprobs = req.logprobs
        if req.echo:    # echo's prompt logprobs, at least as many alternatives as the output's
            params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    v.check_params(params)
    shape = ResponseShape("completion", request_id, v.served_name, int(time.time()), bool(req.stream),
                        _include_usage(req), req.logprobs is not None, echo_text,
                        _continuous_usage(req), req.prompt_logprobs is not None)
    return Generation(request_id, key, cls, tuple(ids), params, _requested_max(req)), shape


def chat(req: ChatCompletionRequest, key: ApiKey, classes: ClassChoice, v: Validator,
         request_id: str) -> tuple[Generation, ResponseShape]:
    _check_common(req, v)
    if not req.messages:
        raise errors.bad_request("messages must hold at least one message", "messages")
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise errors.bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    truncate = _truncation(req, v)
    messages = [m.as_template_input() for m in req.messages]
    ids = v.check_ids(v.encode_chat(messages, classes.widest,
                                    add_generation_prompt=req.add_generation_prompt,
                                    check_bytes=truncate is None), "messages")
    ids = _truncate(ids, truncate)
    cls = classes.pick(len(ids))
    max_tokens = v.max_tokens(_requested_max(req), len(ids), cls, None,
                              "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    params = _params(req, max_tokens)
    if req.logprobs:
        params.logprobs = req.top_logprobs or 0
    v.check_params(params)
    shape = ResponseShape("chat", request_id, v.served_name, int(time.time()), bool(req.stream),
                        _include_usage(req), bool(req.logprobs),
                        continuous_usage=_continuous_usage(req),
                        prompt_logprobs=req.prompt_logprobs is not None)
    return Generation(request_id, key, cls, tuple(ids), params, _requested_max(req)), shape


def _check_common(req: _Common, v: Validator) -> None:
    if req.model is not None:
        v.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise errors.bad_request("stream_options is only allowed with stream=true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise errors.bad_request("prompt_logprobs are not available with stream=true (as in vLLM)",
                                 "prompt_logprobs")


def _truncation(req: _Common, v: Validator) -> int | None:
    """vLLM's truncate_prompt_tokens: -1 keeps the last max_model_len tokens, k the last k."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    limit = v.model.max_model_len
    if k > limit:
        raise errors.bad_request(f"truncate_prompt_tokens ({k}) must be at most the model's context "
                                 f"({limit}), or -1 for the context", "truncate_prompt_tokens")
    return limit if k == -1 else k


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]


def _requested_max(req: _Common) -> int | None:
    a, b = req.max_tokens, req.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise errors.bad_request(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; "
                                 "send one of them", "max_tokens")
    return a if a is not None else b


def _params(req: _Common, max_tokens: int) -> pb.SamplingParams:
    """The wire's SamplingParams: OpenAI's defaults where the client sent nothing (temperature 1,
    top_p 1), vLLM's for its own fields (an unset optional is vLLM's default)."""
    p = pb.SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=req.stop,
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        min_p=req.min_p or 0.0, min_tokens=req.min_tokens, logit_bias=_logit_bias(req.logit_bias),
        include_stop_str_in_output=req.include_stop_str_in_output, n=req.n or 1,
        priority=req.priority)
    if req.seed is not None:
        p.seed = req.seed
    if req.repetition_penalty is not None:
        p.repetition_penalty = req.repetition_penalty
    if not req.skip_special_tokens:
        p.skip_special_tokens = False
    if not req.spaces_between_special_tokens:
        p.spaces_between_special_tokens = False
    if req.prompt_logprobs is not None:
        p.prompt_logprobs = req.prompt_logprobs
    return p


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias}; ids are checked against the vocabulary later."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) > UINT32_MAX:
            raise errors.bad_request(f"logit_bias keys must be token ids (decimal strings), got "
                                     f"{_short(key)}", "logit_bias")
        if not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
            raise errors.bad_request(f"logit_bias values must be in [{LOGIT_BIAS_RANGE[0]:g}, "
                                     f"{LOGIT_BIAS_RANGE[1]:g}], got {value} for token {key}",
                                     "logit_bias")
        out[int(key)] = value
    return out


def _include_usage(req: _Common) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: _Common) -> bool:
    return bool(_include_usage(req) and req.stream_options.continuous_usage_stats)
