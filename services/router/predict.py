"""Predicted time to first token for a placement (DESIGN.md section 3, router):

    TTFT = wait        prefill tokens queued ahead on the chosen prefill worker / its prefill rate
         + prefill     this prompt's uncached tokens through the prefill cost model
         + transfer    the prompt's KV bytes / the KV path's bandwidth (disaggregated only)
         + decode wait  until the decode worker has a slot for it (0 while it has free KV)

Every term is in seconds and non-negative; the parts are kept so a refusal, a span and the
load-test summary can say which term broke the target. A worker that has measured nothing yet is
predicted with the `Prior` (from the capacity model or a measured profile), never as 0: a cold
fleet does not admit blindly.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


@dataclass(frozen=True, slots=True)
class Prior:
    """What a worker is assumed to do before it has measured itself."""

    prefill_tokens_per_s: float = 2000.0      # a conservative CPU figure (docs/benchmarks.md)
    attention_s_per_pair: float = 0.0         # the quadratic term: seconds per (query, key) pair
    kv_gbps: float = 8.0                      # loopback tcp (docs/benchmarks.md)


@dataclass(frozen=True, slots=True)
class Prediction:
    wait_s: float
    prefill_s: float
    transfer_s: float
    decode_wait_s: float

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.transfer_s + self.decode_wait_s

    def dominant(self) -> str:
        """The term that costs the most, for a refusal's message."""
        parts = {"queue": self.wait_s, "prefill": self.prefill_s, "kv transfer": self.transfer_s,
                 "decode slot": self.decode_wait_s}
        return max(parts, key=parts.get)


def prefill_rate(w: pb.WorkerStats, prior: Prior) -> float:
    return w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else prior.prefill_tokens_per_s


def attention_pairs(cached: int, tokens: int) -> int:
    """(query, key) pairs of prefilling `tokens` new tokens after `cached` ones."""
    return tokens * cached + tokens * (tokens + 1) // 2


def predict(w: pb.WorkerStats, prompt_tokens: int, *, cached_tokens: int = 0,
            kv_bytes: int = 0, decode_wait_s: float = 0.0,
            prior: Prior = Prior()) -> Prediction:
    """TTFT of a prompt placed on prefill (or mixed) worker `w`; `kv_bytes` > 0 when its KV
    moves to a decode worker afterwards."""
    rate = prefill_rate(w, prior)
    own = max(0, prompt_tokens - cached_tokens)
    prefill = own / rate + attention_pairs(cached_tokens, own) * prior.attention_s_per_pair
    transfer = kv_bytes * 8 / (prior.kv_gbps * 1e9) if kv_bytes else 0.0
    return Prediction(wait_s=w.queued_prefill_tokens / rate, prefill_s=prefill,
                      transfer_s=transfer, decode_wait_s=max(0.0, decode_wait_s))
