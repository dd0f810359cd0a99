"""kvfleet.v1.SamplingParams <-> the engine's SamplingParams: the one reading of the wire's
sampling fields, free of torch so the gateway validates with it (services/gateway/validation.py)
and workers run with it (services.protocol.convert re-exports both functions).

Proto3 has no absent scalars, so "unset" reads as vLLM's default: top_p 0 -> 1.0, n 0 -> 1,
an unset repetition_penalty -> 1.0, unset skip_special_tokens / spaces_between_special_tokens ->
true. max_tokens 0 stays 0 and is rejected by validation like any other bad value.
"""
from __future__ import annotations

from services.engine.sampling_params import SamplingParams
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


def params_from_pb(p: pb.SamplingParams) -> SamplingParams:
    def opt(name: str, unset):
        return getattr(p, name) if p.HasField(name) else unset

    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p or 1.0, seed=opt("seed", None),
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=opt("logprobs", None), prompt_logprobs=opt("prompt_logprobs", None),
        n=p.n or 1, repetition_penalty=opt("repetition_penalty", 1.0),
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        min_p=p.min_p, min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=opt("skip_special_tokens", True),
        spaces_between_special_tokens=opt("spaces_between_special_tokens", True),
        priority=p.priority)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        n=p.n, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        min_p=p.min_p, min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias),
        include_stop_str_in_output=p.include_stop_str_in_output, priority=p.priority)
    for name, unset in (("seed", None), ("logprobs", None), ("prompt_logprobs", None),
                        ("repetition_penalty", 1.0), ("skip_special_tokens", True),
                        ("spaces_between_special_tokens", True)):
        value = getattr(p, name)
        if value != unset:
            setattr(msg, name, value)
    return msg


__all__ = ["params_from_pb", "params_to_pb"]
