"""Typed conversions between the wire (kvfleet.v1 protobufs) and the engine's dataclasses."""
from __future__ import annotations

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.outputs import TokenOutput
from services.engine.token_logprob import TokenLogprob
from services.protocol.params import params_from_pb, params_to_pb  # noqa: F401 (re-exported)


def logprob_to_pb(lp: TokenLogprob | None, token_id: int = 0) -> pb.TokenLogprob:
    if lp is None:                      # the first prompt token has no logprob
        return pb.TokenLogprob(token_id=token_id, logprob=float("nan"))
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def chunk_from_output(out: TokenOutput, served_by: str = "") -> pb.TokenChunk:
    """A worker's chunk: token ids and logprobs, no text (the gateway makes it)."""
    chunk = pb.TokenChunk(
        request_id=out.request_id, token_ids=out.new_token_ids,
        logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs], finished=out.finished and not out.prefilled,
        finish_reason=out.finish_reason or "", error=out.error or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        served_by=served_by, index=out.index, num_cached_tokens=out.num_cached_tokens)
    if out.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
    return chunk


def tenant_queues(stats) -> list[pb.TenantQueue]:
    """An engine's queued prefill work (EngineStats `prefill_queues`, `prefill_prompts`) as a
    worker publishes it: per class and tenant, the tokens and each queued prompt's (left and
    computed)."""
    prompts = getattr(stats, "prefill_prompts", {})
    computed = getattr(stats, "prefill_computed", {})
    return [pb.TenantQueue(traffic_class=c, tenant=t, tokens=n, prompts=prompts.get((c, t), ()),
                           computed=computed.get((c, t), ()))
            for c, t, n in stats.prefill_queues]
