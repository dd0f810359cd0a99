"""The TTFT prediction on a co-located (mixed) replica: every step of a prompt carries the replica's
decode batch, which also takes its tokens out of the step's budget; a full batch makes a newcomer
wait for a seat; a deep chunk of a long prompt is cut to the attention cap. Injected numbers, no
timing."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.predict import (DECODE_IN_FLIGHT_STEP, LOWER_CLASS_SHARE, decode_wait_s,
                                     predict, prefill_steps, step_s)

# the fitted cost both replicas publish: 10 ms a step, 0.1 ms a token, 10 ns a (query, key) pair
COST = dict(prefill_step_s=0.01, prefill_s_per_token=1e-4, prefill_s_per_pair=1e-8,
            prefill_drain_tokens_per_s=5000.0, token_budget=512, chunk_size=256)


def replica(role: str = "mixed", decodes: int = 0, context: int = 0, **fields) -> pb.WorkerStats:
    return pb.WorkerStats(worker_id="m0", role=role, num_decoding=decodes, num_running=decodes,
                          decode_context_tokens=context, **{**COST, **fields})


def test_a_colocated_prompts_step_carries_the_decode_batch():
    busy = replica(decodes=100, context=100_000)
    batch_s = 0.01 + 100 * 1e-4 + 100_000 * 1e-8                  # the batch alone: 21 ms a step
    assert step_s(busy, 0, 0) == pytest.approx(batch_s)
    pairs = 200 * 201 // 2
    p = predict(busy, 200)
    # one step (200 tokens fit the chunk) with the batch in it, after half the step in flight
    assert p.prefill_s == pytest.approx(batch_s + 200 * 1e-4 + pairs * 1e-8
                                        + DECODE_IN_FLIGHT_STEP * batch_s)
    # the same numbers on a prefill worker: no decode batch, nothing in flight
    alone = predict(replica(role="prefill", decodes=100, context=100_000), 200)
    assert alone.prefill_s == pytest.approx(0.01 + 200 * 1e-4 + pairs * 1e-8)


def test_the_decode_batch_takes_its_tokens_out_of_the_prompts_share_of_the_budget():
    # 512-token budget, 400 decodes first: 112 tokens a step for the prompt
    assert prefill_steps(replica(decodes=400), 0, 1000) == 9              # ceil(1000 / 112)
    assert prefill_steps(replica(decodes=0), 0, 1000) == 4                # ceil(1000 / 256)


def test_the_queue_ahead_drains_at_what_the_batch_leaves_with_the_batch_in_each_step():
    w = replica(decodes=256, context=256_000, queued_prefill_tokens=1024)
    w.queued_prefill_tokens_ahead["interactive"] = 1024
    per_step = 512 - 256                                       # tokens prefilled a step
    pairs = 1 * (256 * 257 // 2)                               # one 256-token first chunk
    expected = 1024 / per_step * step_s(w, per_step, pairs)
    assert predict(w, 10, traffic_class="interactive").wait_s == pytest.approx(expected)


def test_lower_classes_queued_there_take_their_share_of_each_step_while_a_chat_waits():
    w = replica(decodes=100, queued_prefill_tokens=1000 + 50_000)
    w.queued_prefill_tokens_ahead["interactive"] = 1000       # 50,000 of documents below it
    per_step = 512 - 100 - int(LOWER_CLASS_SHARE * 512)
    pairs = per_step * (per_step + 1) // 2
    assert predict(w, 10, traffic_class="interactive").wait_s == pytest.approx(
        1000 / per_step * step_s(w, per_step, pairs))


def test_a_full_batch_makes_a_newcomer_wait_for_a_seat_and_the_queue_wait_overlaps_it():
    w = replica(decodes=4, max_running=4, num_queued=1, sequences_finished_per_s=2.0,
                kv_blocks_free=1000, queued_prefill_tokens=20)
    w.num_running = 4
    # two sequences must finish (one for the request queued there, one for this one): 1 s
    assert decode_wait_s(w, 1) == pytest.approx(1.0)
    p = predict(w, 10, decode_wait_s=decode_wait_s(w, 1))
    assert p.decode_wait_s == pytest.approx(1.0) and p.wait_s == 0.0   # 20 tokens: far less
    # a prefill worker's or decode worker's batch is not a seat a prompt waits for
    assert decode_wait_s(replica(role="decode", decodes=4, max_running=4, num_queued=1,
                                 sequences_finished_per_s=2.0, kv_blocks_free=1000), 1) == 0.0


def test_a_long_prompts_deep_chunks_are_cut_to_the_attention_cap_while_the_replica_decodes():
    cap = 256 * 1024
    deep = replica(decodes=10, max_prefill_attention=cap)
    # up to position cap / 256 = 1,024 the chunk is the limit (4 steps), then ~cap / pos tokens:
    # (8192^2 - 1024^2) / (2 cap) = 126 steps more
    assert prefill_steps(deep, 0, 8192) == 4 + 126
    # with no decodes the scheduler sets no cap
    assert prefill_steps(replica(decodes=0, max_prefill_attention=cap), 0, 8192) == 32
    # past cap / MIN_CHUNK (16,384) each step still advances 16 tokens
    assert prefill_steps(deep, 20_000, 1600) == 100


@given(st.integers(0, 256), st.integers(0, 10**6), st.integers(0, 10**5), st.integers(1, 10**5),
       st.integers(0, 64), st.integers(0, 10**5))
def test_a_bigger_or_deeper_decode_batch_never_predicts_sooner(decodes, context, queued, prompt,
                                                                more, deeper):
    def total(d: int, ctx: int) -> float:
        w = replica(decodes=d, context=ctx, queued_prefill_tokens=queued,
                    max_prefill_attention=256 * 1024)
        return predict(w, prompt).total_s

    assert total(decodes, context) <= total(decodes + more, context + deeper) + 1e-12


def test_a_document_is_priced_at_its_share_of_the_attention_cap_while_chats_wait_there():
    """The scheduler gives a lower class half the attention pairs while chats wait (documents
    deep in their prompt then advance about half as fast); a replica decoding chats keeps
    receiving them, so a document's prediction there says so; a chat's does not change."""
    cap = 256 * 1024
    busy = replica(decodes=10, max_prefill_attention=cap, queued_prefill_tokens=300)
    # with half the pairs: 2 steps to position 512, then (8192^2 - 512^2) / cap = 255 more
    assert prefill_steps(busy, 0, 8192, LOWER_CLASS_SHARE) == 2 + 255
    assert prefill_steps(busy, 0, 8192) == 4 + 126
    doc = predict(busy, 8192, traffic_class="document")
    chat = predict(busy, 8192, traffic_class="interactive")
    assert doc.prefill_s > 1.5 * chat.prefill_s


def test_a_document_behind_documents_waits_their_tokens_at_its_own_deep_pace():
    """Documents queued ahead on a co-located replica prefill deep in their prompts as this one
    will (a few tokens a step): the wait is at least their tokens at the newcomer's own pace, not
    their tokens as fresh first chunks. A chat's wait is not priced so."""
    w = replica(decodes=10, max_prefill_attention=256 * 1024, queued_prefill_tokens=16_384)
    w.queued_prefill_tokens_ahead.update({"interactive": 0, "document": 16_384})
    doc = predict(w, 8192, traffic_class="document")
    assert doc.wait_s >= 2 * doc.prefill_s * (1 - 1e-9)
    chat = predict(w, 8192, traffic_class="interactive")
    assert chat.wait_s < doc.wait_s
