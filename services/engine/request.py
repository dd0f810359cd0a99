"""One request's state, made of counters (STYLE 2).

There is no prefill or decode *phase* field: a sequence has `num_tokens` (prompt + output) and
`num_computed_tokens` (tokens whose KV is in the cache). Prefill, chunked prefill, prefix hits and
recompute after preemption are all "num_computed_tokens catching up with num_tokens"; a sequence is
decoding when exactly its last sampled token is left to compute.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.config import TrafficClass
from services.engine.sampling_params import SamplingParams


class Status(enum.IntEnum):
    """Ordered: `is_finished` is `status > PREEMPTED`."""

    WAITING = 0          # queued; holds no KV
    WAITING_FOR_KV = 1   # decode role: reservation made, KV arriving from a prefill worker
    WAITING_FOR_SLOT = 2  # decode role: KV arrived, waits for room in the decode batch (ITL)
    RUNNING = 3          # admitted: holds its reservation and blocks
    PREEMPTED = 4        # `predict` policy: blocks taken back, will recompute from scratch
    FINISHED_STOPPED = 5   # EOS, stop token or stop string
    FINISHED_LENGTH = 6    # max_tokens or the context limit
    FINISHED_ABORTED = 7   # cancelled
    FINISHED_REJECTED = 8  # refused by admission (predicted TTFT past the class target)
    PREFILLED = 9          # prefill role: first token sampled, blocks kept for export until released


FINISH_REASONS = {
    Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length",
    Status.FINISHED_ABORTED: "abort", Status.FINISHED_REJECTED: "rejected",
}


@dataclass(eq=False)
class Request:
    request_id: str
    tenant: str
    traffic_class: TrafficClass
    params: SamplingParams
    prompt_token_ids: list[int]
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    first_scheduled_time: float | None = None   # start of the step that gave it its first chunk
    first_token_time: float | None = None
    stop_reason: str | int | None = None   # the stop string or token that ended it
    reject_reason: str | None = None
    retry_after_s: float | None = None     # with reject_reason: when a retry could meet the target
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # hash chain over its leading full blocks
    num_registered_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int = 0      # prompt tokens its first admission found in the prefix cache
    index: int = 0                  # which of the request's n samples (n > 1: forked at the first token)
    parent_id: str | None = None    # a forked sample's request (sample 0 is the request itself)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def external_id(self) -> str:
        """The id callers know: a forked sample answers under its request's id (and its index)."""
        return self.parent_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Running with exactly its last sampled token left to compute."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status > Status.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
