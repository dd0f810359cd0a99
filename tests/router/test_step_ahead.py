"""The router steps a prefill worker's scheduler forward from the queues it publishes: the same
chunks, turns and steps as the engine's Scheduler would run, so a prompt behind other tenants'
work is priced with the steps it really takes. Numbers are injected; the engine's Scheduler (a real
one, over a real BlockPool, no model) is the truth."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from services.engine.config import Tenant
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.predict import ARRIVALS_JOINING, predict
from services.router.step_ahead import MAX_STEPS, Ahead, step_ahead, stepped
from tests.engine.scheduler_helpers import add, make_scheduler, step

STEP_S, PER_TOKEN = 0.010, 2e-5
BUDGET, CHUNK = 256, 64


def worker(queues: dict[str, list[int]], cls: str = "interactive", **fields) -> pb.WorkerStats:
    """A prefill worker publishing `queues` (tenant -> each queued prompt's tokens left)."""
    w = pb.WorkerStats(worker_id="p0", role="prefill", prefill_step_s=STEP_S,
                       prefill_s_per_token=PER_TOKEN, token_budget=BUDGET, chunk_size=CHUNK,
                       queued_prefill_tokens=sum(map(sum, queues.values())), **fields)
    w.prefill_queues.extend(pb.TenantQueue(traffic_class=cls, tenant=t, tokens=sum(p), prompts=p)
                            for t, p in queues.items() if p)
    return w


def test_a_lone_prompt_takes_its_chunks_one_step_each():
    assert step_ahead(worker({}), 200, 0, "interactive", "a", {}, 0.0, 0.5) == Ahead(
        0.0, 3 * (STEP_S + PER_TOKEN * CHUNK) + STEP_S + PER_TOKEN * 8)


def test_a_long_document_past_the_stepped_steps_goes_on_at_their_pace():
    """Past MAX_STEPS the rest is priced in steps like the last one, not stepped one by one:
    the others' part of each alike, its own chunks each at their depth."""
    tokens = 100 * CHUNK + 10
    ahead = step_ahead(worker({}), tokens, 0, "interactive", "a", {}, 0.0, 0.5)
    assert ahead.prefill_s == pytest.approx(101 * STEP_S + PER_TOKEN * tokens)
    pairs = worker({}, prefill_s_per_pair=1e-8)
    deep = step_ahead(pairs, tokens, 0, "interactive", "a", {}, 0.0, 0.5)
    assert deep.prefill_s == pytest.approx(101 * STEP_S + PER_TOKEN * tokens
                                           + 1e-8 * tokens * (tokens + 1) / 2)


def test_behind_other_tenants_a_prompt_takes_more_steps_than_its_chunks():
    """Three tenants' long prompts fill the budget: the deficit round-robin gives the newcomer's
    tenant a quarter of each step, so its 128 tokens take two steps' quarters, not one chunk."""
    busy = worker({"a": [1000], "b": [1000], "c": [1000]})
    own = [n for n, _, _ in stepped(busy, 128, 0, "interactive", "d", {}, 0.0, 0.5)]
    assert own == [CHUNK, CHUNK]
    alone = step_ahead(worker({}), 128, 0, "interactive", "d", {}, 0.0, 0.5)
    shared = step_ahead(busy, 128, 0, "interactive", "d", {}, 0.0, 0.5)
    assert shared.prefill_s > alone.prefill_s and shared.wait_s == 0.0


def test_a_prompt_behind_its_own_tenants_queue_waits_for_it():
    w = worker({"a": [CHUNK] * 8})
    ahead = step_ahead(w, 10, 0, "interactive", "a", {}, 0.0, 0.5)
    assert ahead.wait_s == 2 * (STEP_S + PER_TOKEN * BUDGET)     # FCFS: two full steps first


def test_an_older_build_without_its_prompts_is_not_stepped():
    old = worker({"a": [500]})
    del old.prefill_queues[0].prompts[:]
    assert step_ahead(old, 100, 0, "interactive", "b", {}, 0.0, 0.5) is None
    bare = pb.WorkerStats(role="prefill", token_budget=BUDGET, queued_prefill_tokens=500)
    assert step_ahead(bare, 100, 0, "interactive", "b", {}, 0.0, 0.5) is None


def test_predict_uses_the_stepped_queue_while_the_published_step_runs():
    w = worker({"a": [1000], "b": [1000], "c": [1000]}, step_started_unix_s=100.0,
               step_predicted_s=0.02)
    p = predict(w, 128, traffic_class="interactive", tenant="d", now_unix_s=100.005)
    ahead = step_ahead(w, 128, 0, "interactive", "d", {}, p.in_flight_s, ARRIVALS_JOINING)
    assert p.in_flight_s == pytest.approx(0.015)
    assert (p.wait_s, p.prefill_s) == (ahead.wait_s, ahead.prefill_s)


queued = st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 600)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(queued, st.sampled_from("abc"), st.integers(1, 900), st.dictionaries(
    st.sampled_from("abc"), st.sampled_from((0.5, 1.0, 2.0, 3.0))))
def test_the_steps_are_the_engines_steps(prompts, tenant, tokens, weights):
    """Whatever is queued, by whichever tenants of whatever weights, the new prompt gets the
    tokens in each step that the engine's scheduler gives it, and finishes in the same step."""
    sched, _ = make_scheduler(num_blocks=4096, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="prefill", tenants=tuple(Tenant(t, weight=weights.get(t, 1.0))
                                                            for t in "abc"))
    for t, n in prompts:
        add(sched, n, tenant=t, max_tokens=1)
    by_tenant: dict[str, list[int]] = {}
    for t, n in prompts:
        by_tenant.setdefault(t, []).append(n)
    w = worker(by_tenant)
    mine = add(sched, tokens, tenant=tenant, max_tokens=1)
    engine = []
    while mine.num_computed_tokens < tokens:
        out = step(sched)
        chunk = out.prefill_of(mine)
        engine.append(chunk.num_tokens if chunk else 0)
    router = [n for n, _, _ in stepped(w, tokens, 0, "interactive", tenant, weights, 0.0, 0.5)]
    assert router == engine


def test_a_document_behind_waiting_chats_gets_the_share_the_prefill_worker_gives_it():
    """On a prefill worker the documents' share while chats wait is of two chunks, not of the
    whole budget (services/engine/fairness.py capped_base): the router steps two tenants'
    documents behind a dozen chats as the engine does."""
    sched, _ = make_scheduler(num_blocks=4096, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="prefill", tenants=(Tenant("a"), Tenant("b"), Tenant("c")))
    chats = [CHUNK // 2] * 12
    for n in chats:
        add(sched, n, tenant="a", max_tokens=1)
    add(sched, 300, tenant="b", cls="document", max_tokens=1)
    mine = add(sched, 300, tenant="c", cls="document", max_tokens=1)
    engine = []
    while mine.num_computed_tokens < 300:
        chunk = step(sched).prefill_of(mine)
        engine.append(chunk.num_tokens if chunk else 0)
    w = worker({"a": chats})
    w.prefill_queues.append(pb.TenantQueue(traffic_class="document", tenant="b", tokens=300,
                                           prompts=[300]))
    w.queued_prefill_tokens += 300
    router = [n for n, _, _ in stepped(w, 300, 0, "document", "c", {}, 0.0, 0.0)]
    assert router == engine        # (stepped on the whole budget's share, they differ)


@settings(max_examples=30, deadline=None)
@given(queued, st.sampled_from("abc"), st.integers(1, 900), st.integers(1, 24),
       st.sampled_from((0, 2_000, 20_000)))
def test_on_a_colocated_replica_the_steps_are_the_engines_steps_beside_its_decode_batch(
        prompts, tenant, tokens, decoding, cap):
    """A mixed replica decodes first, so its prompts share what the decode batch leaves of the
    budget, and while it decodes their chunks attend over at most `max_prefill_attention` pairs
    (the class's first chunk at least MIN_CHUNK tokens, a prompt that fits less waiting whole):
    the router steps the same tokens as the engine's scheduler."""
    sched, _ = make_scheduler(num_blocks=8192, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="mixed", protect_itl=False, max_prefill_attention=cap)
    # the decode batch is of another class: the chats' round-robin starts fresh, as stepped
    batch = [add(sched, 4, tenant="a", cls="batch", max_tokens=10_000) for _ in range(decoding)]
    while not all(r.is_decoding for r in batch):
        step(sched)
    for t, n in prompts:
        add(sched, n, tenant=t, max_tokens=1)
    by_tenant: dict[str, list[int]] = {}
    for t, n in prompts:
        by_tenant.setdefault(t, []).append(n)
    w = worker(by_tenant, num_decoding=decoding, max_prefill_attention=cap)
    w.role = "mixed"
    mine = add(sched, tokens, tenant=tenant, max_tokens=1)
    engine = []
    while mine.num_computed_tokens < tokens:
        chunk = step(sched).prefill_of(mine)
        engine.append(chunk.num_tokens if chunk else 0)
    router = [n for n, _, _ in stepped(w, tokens, 0, "interactive", tenant, {}, 0.0, 0.5)]
    assert router == engine[:MAX_STEPS]      # past them the router goes on at the last pace


def test_a_document_after_a_chat_in_the_same_step_takes_the_rest_of_the_budget():
    """With no attention cap (a prefill worker) the classes after the first are as unbounded
    in pairs as it: the document's chunk beside a short chat is the engine's."""
    sched, _ = make_scheduler(num_blocks=4096, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="prefill", tenants=(Tenant("a"), Tenant("b")))
    add(sched, 20, tenant="a", max_tokens=1)
    mine = add(sched, 300, tenant="b", cls="document", max_tokens=1)
    engine = []
    while mine.num_computed_tokens < 300:
        chunk = step(sched).prefill_of(mine)
        engine.append(chunk.num_tokens if chunk else 0)
    w = worker({"a": [20]})
    router = [n for n, _, _ in stepped(w, 300, 0, "document", "b", {}, 0.0, 0.0)]
    assert router == engine and engine[0] == CHUNK


def test_a_document_deep_in_its_prompt_spends_the_attention_cap_as_the_engine_says():
    """On a co-located replica that decodes, a document half prefilled attends over its 3,000
    computed tokens: its chunk spends most of the attention cap, the chat behind it in the same
    tenant's queue gets what is left, then waits whole. Stepped from the published positions
    (`computed`), the router gives the chat the engine's steps; taken as fresh prompts, not."""
    sched, _ = make_scheduler(num_blocks=8192, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="mixed", protect_itl=False, max_prefill_attention=50_000,
                              max_model_len=16_384)
    batch = [add(sched, 4, tenant="b", cls="batch", max_tokens=10_000) for _ in range(2)]
    doc = add(sched, 6000, tenant="a", max_tokens=1)
    while doc.num_computed_tokens < 3000 or not all(r.is_decoding for r in batch):
        step(sched)
    w = worker({"a": [doc.num_prompt_tokens - doc.num_computed_tokens]}, num_decoding=2,
               max_prefill_attention=50_000)
    w.role = "mixed"
    fresh = [n for n, _, _ in stepped(w, 100, 0, "interactive", "a", {}, 0.0, 0.0)]
    w.prefill_queues[0].computed.append(doc.num_computed_tokens)
    router = [n for n, _, _ in stepped(w, 100, 0, "interactive", "a", {}, 0.0, 0.0)]
    mine = add(sched, 100, tenant="a", max_tokens=1)
    engine = []
    while mine.num_computed_tokens < 100:
        chunk = step(sched).prefill_of(mine)
        engine.append(chunk.num_tokens if chunk else 0)
    # the first steps: later, the round-robin's deficits (taken as fresh by the router, with
    # the document's history in the engine) decide by a token which of the two a step cuts
    assert router[:3] == engine[:3] == [60, 22, 0] and fresh[:3] != router[:3]
