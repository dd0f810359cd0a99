"""Typed conversions between the wire (kvfleet.v1 protobufs) and the engine's dataclasses."""
from __future__ import annotations

import math

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.outputs import RequestOutput
from services.engine.sampler import TokenLogprob
from services.engine.sampling_params import SamplingParams


def params_from_pb(p: pb.SamplingParams) -> SamplingParams:
    """Proto3 has no absent scalars: top_p 0 means 'not set' (1.0); max_tokens 0 stays 0 and is
    rejected by validation like any other bad value."""
    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p or 1.0, seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                            top_p=p.top_p, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                            ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprob_to_pb(lp: TokenLogprob | None, token_id: int = 0) -> pb.TokenLogprob:
    if lp is None:                      # the first prompt token has no logprob
        return pb.TokenLogprob(token_id=token_id, logprob=float("nan"))
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_pb(m: pb.TokenLogprob) -> TokenLogprob | None:
    if math.isnan(m.logprob) and not m.top:
        return None
    return TokenLogprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))


def chunk_from_output(out: RequestOutput, served_by: str = "") -> pb.TokenChunk:
    chunk = pb.TokenChunk(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
        logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs], finished=out.finished,
        finish_reason=out.finish_reason or "", error=out.error or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        served_by=served_by)
    if out.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
    return chunk
