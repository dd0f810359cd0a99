"""A hybrid fleet's path for a prompt: a long prompt is disaggregated; a short one goes co-located
unless the disaggregated path predicts an earlier first token (its co-located replicas are
queued deep, say), and co-located on a tie. Worker heartbeats with injected numbers, no timing."""
from __future__ import annotations

from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.path_choice import choose, priced_s
from services.router.paths import Paths

# one fitted cost on every replica: 10 ms a step, 0.1 ms a token; 100 blocks of 16 tokens
COST = dict(prefill_step_s=0.01, prefill_s_per_token=1e-4, prefill_drain_tokens_per_s=5000.0,
            token_budget=512, chunk_size=256, block_size=16, kv_blocks_total=100,
            kv_blocks_free=100, kv_transfer_bytes_per_s=1e9, kv_bytes_per_token=1000)
HYBRID = Paths("hybrid", threshold_tokens=2048)
PARAMS = pb.SamplingParams(max_tokens=64, n=1)


def worker(wid: str, role: str, queued: int = 0, **fields) -> pb.WorkerStats:
    return pb.WorkerStats(worker_id=wid, role=role, queued_prefill_tokens=queued,
                          **{**COST, **fields})


def fleet(mixed_queued: int = 0, prefill_queued: int = 0, **mixed) -> list[pb.WorkerStats]:
    return [worker("m0", "mixed", mixed_queued, **mixed),
            worker("p0", "prefill", prefill_queued), worker("d0", "decode")]


def test_an_idle_hybrid_fleet_serves_a_chat_colocated_and_a_document_disaggregated():
    assert choose(HYBRID, fleet(), 200, PARAMS) == "colocated"
    assert choose(HYBRID, fleet(), 20_000, PARAMS) == "disagg"


def test_a_chat_goes_disaggregated_while_the_colocated_replicas_are_queued_deep():
    busy = fleet(mixed_queued=20_000)          # 4 s of prompts ahead on the only mixed replica
    assert priced_s(busy, "disagg", 200, PARAMS) < priced_s(busy, "colocated", 200, PARAMS)
    assert choose(HYBRID, busy, 200, PARAMS) == "disagg"


def test_a_chat_stays_colocated_when_the_prefill_pool_is_queued_deeper():
    assert choose(HYBRID, fleet(mixed_queued=5_000, prefill_queued=50_000), 200,
                  PARAMS) == "colocated"


def test_a_document_never_moves_to_the_colocated_path_while_the_disaggregated_one_is_whole():
    assert choose(HYBRID, fleet(prefill_queued=500_000), 20_000, PARAMS) == "disagg"


def test_a_path_whose_replicas_can_never_hold_the_request_is_not_a_choice():
    small = fleet(mixed_queued=20_000)
    small[2] = worker("d0", "decode", kv_blocks_total=4, kv_blocks_free=4)   # 64 tokens of KV
    assert priced_s(small, "disagg", 200, PARAMS) is None
    assert choose(HYBRID, small, 200, PARAMS) == "colocated"


def test_a_hybrid_fleet_without_a_whole_disaggregated_path_serves_chats_colocated():
    workers = [worker("m0", "mixed", 20_000), worker("d0", "decode")]
    assert choose(HYBRID, workers, 200, PARAMS) == "colocated"


@given(mode=st.sampled_from(["disagg", "colocated"]), prompt=st.integers(1, 40_000),
       mixed_queued=st.integers(0, 100_000), prefill_queued=st.integers(0, 100_000))
def test_a_single_path_fleet_never_prices_the_other(mode, prompt, mixed_queued, prefill_queued):
    assert choose(Paths(mode), fleet(mixed_queued, prefill_queued), prompt, PARAMS) == mode


@given(prompt=st.integers(1, 40_000), mixed_queued=st.integers(0, 100_000),
       prefill_queued=st.integers(0, 100_000))
def test_the_choice_is_one_of_the_prompts_options_and_never_the_later_priced_one(
        prompt, mixed_queued, prefill_queued):
    workers = fleet(mixed_queued, prefill_queued)
    options = HYBRID.options(prompt, {"mixed", "prefill", "decode"})
    path = choose(HYBRID, workers, prompt, PARAMS)
    assert path in options
    prices = {p: priced_s(workers, p, prompt, PARAMS) for p in options}
    assert all(prices[path] <= s for s in prices.values() if s is not None)
