"""Placement ranks the workers' heartbeats (pb.WorkerStats) directly: prefill by the cost of the
prompt's blocks plus the queue ahead of it, decode by the KV blocks a reservation can still take,
then by batch size, each less what routers placed there since the beat; ties go round a ring of the
worker ids from the router's turn, so a burst over equal replicas alternates."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.placement import (Placed, can_ever_hold, free_unreserved_blocks,
                                       kv_blocks_needed, prefill_score, rank_decode, rank_mixed, rank_prefill,
                                       room_after)
from services.router.service import RouterServicer
from tests.state.test_fleet_state import make_stats

ROLES = ("prefill", "decode", "mixed")


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


@st.composite
def fleets(draw, min_size: int = 0) -> list[pb.WorkerStats]:
    """Up to 8 workers with distinct ids and any load; free >= reserved + held is not assumed."""
    n = draw(st.integers(min_size, 8))
    small = st.integers(0, 64)
    return [make_stats(
        f"w{i}", draw(st.sampled_from(ROLES)), block_size=draw(st.sampled_from([1, 16, 32])),
        kv_blocks_free=draw(small), kv_blocks_reserved=draw(small), kv_blocks_held=draw(small),
        num_running=draw(st.integers(0, 8)), queued_prefill_tokens=draw(st.integers(0, 5000)))
        for i in range(n)]


# --- stories ----------------------------------------------------------------------------------

def test_decode_prefers_the_most_blocks_a_reservation_can_still_take():
    # d0 has the most free blocks, but most are promised or held for writes that may still land
    d0 = make_stats("d0", kv_blocks_free=500, kv_blocks_reserved=300, kv_blocks_held=150)
    d1 = make_stats("d1", kv_blocks_free=300, kv_blocks_reserved=100, kv_blocks_held=0)
    d2 = make_stats("d2", kv_blocks_free=300, kv_blocks_reserved=50, kv_blocks_held=50)
    assert [free_unreserved_blocks(w) for w in (d0, d1, d2)] == [50, 200, 200]
    assert ids(rank_decode([d0, d1, d2])) == ["d1", "d2", "d0"]          # 200 = 200: by id
    busy = make_stats("d1", kv_blocks_free=300, kv_blocks_reserved=100, num_running=30)
    assert ids(rank_decode([d0, busy, d2])) == ["d2", "d1", "d0"]        # equal room: smaller batch


def test_n_samples_count_the_prompt_once_in_the_kv_pages_a_request_needs():
    """66-token prompt (4 full blocks of 16 + 2 tokens), 20 output tokens: n = 1 takes 6 blocks;
    n = 3 takes the 4 shared prompt blocks + 3 x 2 own blocks = 10, not 18."""
    w = make_stats("d0", block_size=16, kv_blocks_total=12)
    one = pb.SamplingParams(max_tokens=20)
    three = pb.SamplingParams(max_tokens=20, n=3)
    assert kv_blocks_needed(w, 66, one) == 6 and kv_blocks_needed(w, 66, three) == 10
    assert kv_blocks_needed(w, 64, three) == 4 + 3 * 2      # a full last block: nothing copied
    assert can_ever_hold(w, 66, three) and not can_ever_hold(w, 66, pb.SamplingParams(
        max_tokens=20, n=5))                                       # 4 + 5 x 2 = 14 > 12
    small = make_stats("d1", kv_blocks_total=12, kv_blocks_free=900)   # most room, small pool
    big = make_stats("d2", kv_blocks_total=1000, kv_blocks_free=100, kv_blocks_reserved=0)
    n5 = pb.WorkRequest(prompt_token_ids=list(range(66)), params=pb.SamplingParams(max_tokens=20, n=5))
    assert ids(RouterServicer._decode_candidates(n5, [small, big])) == ["d2"]
    n9 = pb.WorkRequest(prompt_token_ids=list(range(66)), params=pb.SamplingParams(max_tokens=2000, n=9))
    assert ids(RouterServicer._decode_candidates(n9, [small, big])) == ["d1"]  # none fits: the best


def test_a_worker_promised_past_its_free_blocks_has_no_room_not_negative_room():
    over = make_stats("d0", kv_blocks_free=10, kv_blocks_reserved=8, kv_blocks_held=5)
    assert free_unreserved_blocks(over) == 0


def test_prefill_prefers_the_shortest_queue_and_counts_the_prompt_in_tokens():
    p0 = make_stats("p0", "prefill", queued_prefill_tokens=4096, prefill_tokens_per_s=1000)
    p1 = make_stats("p1", "prefill", queued_prefill_tokens=0, prefill_tokens_per_s=1000)
    assert prefill_score(p1, 33) == 33 and prefill_score(p0, 33) == 4096 + 33
    assert ids(rank_prefill([p0, p1], 33)) == ["p1", "p0"]


def test_prefill_counts_only_the_tokens_a_worker_does_not_hold():
    busy = make_stats("p0", "prefill", queued_prefill_tokens=300, prefill_tokens_per_s=1000)
    idle = make_stats("p1", "prefill", queued_prefill_tokens=0, prefill_tokens_per_s=1000)
    assert prefill_score(busy, 1000, cached_tokens=960) == 300 + 40
    # busy holds 960 of the prompt's 1000 tokens: waiting 300 beats computing 1000
    assert ids(rank_prefill([busy, idle], 1000, cached={"p0": 960})) == ["p0", "p1"]
    # a prefix worth less than the queue ahead of it does not win
    assert ids(rank_prefill([busy, idle], 1000, cached={"p0": 160})) == ["p1", "p0"]


def test_a_held_prefix_wins_whatever_rates_the_workers_publish():
    """One worker has measured its drain rate on short prompts (slow); the other still publishes
    its prior's full-budget rate (40 times faster). Rates measured on different prompts, or a
    prior beside a measurement, say nothing about which worker is faster: the worker holding
    112 of the prompt's 138 tokens computes 26, the other 138, and it wins."""
    measured = make_stats("p0", "prefill", prefill_drain_tokens_per_s=25_000)
    prior = make_stats("p1", "prefill", prefill_drain_tokens_per_s=1_024_000)
    for turn in range(2):
        assert ids(rank_prefill([measured, prior], 138, turn, cached={"p0": 112})) == ["p0", "p1"]


def test_a_mixed_worker_holding_the_prefix_wins_while_it_has_room():
    roomy = make_stats("m0", "mixed", kv_blocks_free=700, kv_blocks_reserved=0, kv_blocks_held=0)
    holder = make_stats("m1", "mixed", kv_blocks_free=100, kv_blocks_reserved=0, kv_blocks_held=0)
    assert ids(rank_mixed([roomy, holder], 50, cached={"m1": 320})) == ["m1", "m0"]
    assert ids(rank_mixed([roomy, holder], 50)) == ["m0", "m1"]          # no prefix: by room
    full = {"m1": Placed(blocks=80, streams=1)}                           # 20 left < 50 needed
    assert ids(rank_mixed([roomy, holder], 50, full, cached={"m1": 320})) == ["m0", "m1"]


def test_each_rank_takes_only_its_role():
    fleet = [make_stats("p0", "prefill"), make_stats("d0", "decode"), make_stats("m0", "mixed")]
    assert ids(rank_prefill(fleet, 100)) == ["p0"]
    assert ids(rank_decode(fleet)) == ["d0"]
    assert ids(rank_decode(fleet, role="mixed")) == ["m0"]
    assert rank_decode([]) == [] and rank_prefill([], 10) == []


def burst(workers, requests: int, blocks: int, count_placed: bool = True, turns: bool = True) -> dict[str, int]:
    """A router placing `requests` requests within one beat: -> how many each worker got."""
    placed: dict[str, Placed] = {}
    got = {w.worker_id: 0 for w in workers}
    for turn in range(requests):
        best = rank_decode(workers, "decode", placed if count_placed else None, turn if turns else 0)[0]
        got[best.worker_id] += 1
        was = placed.get(best.worker_id, Placed())
        placed[best.worker_id] = Placed(was.blocks + blocks, was.streams + 1)
    return got


def test_a_burst_within_one_beat_splits_evenly_over_equal_replicas():
    equal = [make_stats("decode-0"), make_stats("decode-1")]
    assert burst(equal, 16, blocks=3) == {"decode-0": 8, "decode-1": 8}
    # what the fleet did before: the beat alone, ties by id: all sixteen on one replica
    assert burst(equal, 16, blocks=3, count_placed=False, turns=False) == {"decode-0": 16, "decode-1": 0}
    # either half alone spreads it too: the counts (ties by id), or the turning ring (a stale beat)
    assert burst(equal, 16, blocks=3, turns=False) == {"decode-0": 8, "decode-1": 8}
    assert burst(equal, 16, blocks=3, count_placed=False) == {"decode-0": 8, "decode-1": 8}


def test_a_burst_fills_the_roomier_replica_until_both_have_equal_room():
    roomy = make_stats("decode-0", kv_blocks_free=700, kv_blocks_reserved=200, kv_blocks_held=0)  # 500
    tight = make_stats("decode-1", kv_blocks_free=700, kv_blocks_reserved=300, kv_blocks_held=0)  # 400
    got = burst([roomy, tight], 60, blocks=10)
    assert got == {"decode-0": 35, "decode-1": 25}   # 10 to catch up, then alternating


def test_placed_blocks_and_streams_count_against_room_and_batch():
    w = make_stats("d0", kv_blocks_free=100, kv_blocks_reserved=10, kv_blocks_held=0, num_running=3)
    assert room_after(w, Placed()) == (90, 3)
    assert room_after(w, Placed(blocks=40, streams=2)) == (50, 5)
    assert room_after(w, Placed(blocks=400, streams=2)) == (0, 5)   # promised past its room: none left


def test_ties_between_prefill_replicas_turn_too():
    fleet = [make_stats(f"p{i}", "prefill", queued_prefill_tokens=0) for i in range(3)]
    firsts = [rank_prefill(fleet, 100, turn)[0].worker_id for turn in range(6)]
    assert firsts == ["p0", "p1", "p2", "p0", "p1", "p2"]


# --- properties -------------------------------------------------------------------------------

@given(fleets(), st.sampled_from(["decode", "mixed"]), st.integers(0, 100))
def test_decode_rank_is_every_worker_of_the_role_once_whatever_the_input_order(fleet, role, turn):
    ranked = rank_decode(fleet, role, turn=turn)
    assert sorted(ids(ranked)) == sorted(w.worker_id for w in fleet if w.role == role)
    assert ids(rank_decode(list(reversed(fleet)), role, turn=turn)) == ids(ranked)   # same turn: alike


@given(fleets(), st.dictionaries(st.sampled_from([f"w{i}" for i in range(8)]),
                                 st.builds(Placed, st.integers(0, 64), st.integers(0, 8))),
       st.integers(0, 100))
def test_counting_placements_ranks_by_the_room_left_after_them(fleet, placed, turn):
    ranked = rank_decode(fleet, "decode", placed, turn)
    rooms = [room_after(w, placed.get(w.worker_id, Placed())) for w in ranked]
    assert [(-free, running) for free, running in rooms] == sorted((-free, running) for free, running in rooms)


@given(fleets())
def test_more_room_never_ranks_below_less_room_at_equal_batch_size(fleet):
    pos = {w.worker_id: i for i, w in enumerate(rank_decode(fleet))}
    for a in fleet:
        for b in fleet:
            if a.role == b.role == "decode" and a.num_running == b.num_running \
                    and free_unreserved_blocks(a) > free_unreserved_blocks(b):
                assert pos[a.worker_id] < pos[b.worker_id]


@given(fleets())
def test_a_smaller_batch_never_ranks_below_a_larger_one_at_equal_room(fleet):
    pos = {w.worker_id: i for i, w in enumerate(rank_decode(fleet))}
    for a in fleet:
        for b in fleet:
            if a.role == b.role == "decode" and a.num_running < b.num_running \
                    and free_unreserved_blocks(a) == free_unreserved_blocks(b):
                assert pos[a.worker_id] < pos[b.worker_id]


@given(fleets(), st.integers(1, 20_000))
def test_prefill_rank_is_by_cost_and_a_shorter_queue_never_loses(fleet, prompt_tokens):
    ranked = rank_prefill(fleet, prompt_tokens)
    assert sorted(ids(ranked)) == sorted(w.worker_id for w in fleet if w.role == "prefill")
    costs = [prefill_score(w, prompt_tokens) for w in ranked]
    assert costs == sorted(costs)
    pos = {w.worker_id: i for i, w in enumerate(ranked)}
    for a in ranked:
        for b in ranked:
            if a.block_size == b.block_size and a.queued_prefill_tokens < b.queued_prefill_tokens:
                assert pos[a.worker_id] < pos[b.worker_id]
