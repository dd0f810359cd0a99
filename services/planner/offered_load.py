"""The work a workload offers a target, in accelerator-seconds per second of traffic.

prefill: each request's prompt as one prefill iteration, summed, over the spec's duration.
decode:  each output token costs step(batch, context) / batch, where context is the workload's
         mean mid-generation context (prompt + output / 2) and batch a full replica's: the most
         sequences of the mean length whose KV fits (at most `max_decode_batch`). This is the
         work at scale, where decode replicas run full; a load under one replica's worth still
         needs one decode replica, which then iterates on smaller batches for the same latency.
Replica-seconds per second is how many replicas the phase keeps busy; dividing by
`target_utilization` gives the replicas to start with, and their ratio is the starting
prefill:decode split (DESIGN section 8's rebalance starts there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loadtests.workload import Scale, WorkloadSpec, load_workload, plan_requests
from services.planner.capacity import CostModel


@dataclass(frozen=True, slots=True)
class OfferedLoad:
    workload: str
    requests: int
    duration_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    decode_batch: int
    prefill_replica_s_per_s: float
    decode_replica_s_per_s: float
    prefill_replicas: int
    decode_replicas: int

    @property
    def request_rate(self) -> float:
        return self.requests / self.duration_s

    @property
    def prefill_to_decode(self) -> float:
        """Prefill work over decode work: the starting prefill:decode replica ratio."""
        return self.prefill_replica_s_per_s / self.decode_replica_s_per_s


def offered_load(model: CostModel, name_or_path: str, unscaled: bool = False) -> OfferedLoad:
    """The load of a workload spec (a file or a shipped name). `unscaled` drops the spec's `scale`
    (which shrinks shipped workloads to a 2-core CPU) to plan for the real mix."""
    spec = load_workload(name_or_path)
    if unscaled:
        spec = replace(spec, scale=Scale())
    return offered_load_of(model, spec)


def offered_load_of(model: CostModel, spec: WorkloadSpec) -> OfferedLoad:
    """The load of a parsed spec, at its own scales."""
    requests = plan_requests(spec)
    if not requests:
        raise ValueError(f"workload {spec.name!r} plans no requests in {spec.duration_s:g} s")
    duration = spec.duration_s
    if spec.max_requests is not None and len(requests) == spec.max_requests:
        duration = max(requests[-1].at_s, 1e-9)      # cut by max_requests: the span they arrive in
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.max_tokens for r in requests]
    return _load(model, spec.name, duration, prompts, outputs)


def _load(model: CostModel, name: str, duration: float, prompts: list[int],
          outputs: list[int]) -> OfferedLoad:
    n = len(prompts)
    mean_prompt, mean_output = sum(prompts) / n, sum(outputs) / n
    context = round(mean_prompt + mean_output / 2)
    batch = max(1, min(model.constants.max_decode_batch,
                       int(model.kv_tokens_per_replica // (mean_prompt + mean_output))))
    per_token = model.decode_step_s(batch, context) / batch
    prefill = sum(model.prefill_s(p) for p in prompts) / duration
    decode = sum(outputs) * per_token / duration
    util = model.constants.target_utilization
    return OfferedLoad(name, n, duration, mean_prompt, mean_output, batch, prefill, decode,
                       max(1, math.ceil(prefill / util)), max(1, math.ceil(decode / util)))

