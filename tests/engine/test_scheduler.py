"""The scheduling contract (DESIGN.md section 5), one story at a time."""
from __future__ import annotations

import pytest

from services.engine.config import Tenant
from services.engine.request import Status
from services.engine.scheduler import MIN_CHUNK, attention_pairs
from tests.engine.scheduler_helpers import EOS, add, make_request, make_scheduler, step


def decode_into(sched, req):
    """Run iterations until `req` is decoding."""
    while not req.is_decoding:
        step(sched)


def test_admission_reserves_prompt_plus_bounded_output():
    sched, _ = make_scheduler()
    # 10 prompt tokens + min(max_tokens=30, interactive cap 2048) = 40 tokens = 10 blocks of 4
    req = add(sched, 10, max_tokens=30)
    out = step(sched)
    assert [c.request for c in out.prefills] == [req]
    assert sched.pool.held(req.request_id) + sched.pool.reserved(req.request_id) == 10
    # allocated only as far as computed: 10 prompt tokens -> 3 blocks held, 7 still reserved
    assert sched.pool.held(req.request_id) == 3


def test_output_bound_is_capped_by_the_class():
    sched, _ = make_scheduler(num_blocks=2000)
    req = add(sched, 8, cls="document", max_tokens=3000)   # document output cap is 1024
    step(sched)
    assert sched.pool.held(req.request_id) + sched.pool.reserved(req.request_id) == (8 + 1024) // 4


def test_every_running_decode_goes_first_then_prefill_fills_the_rest():
    sched, _ = make_scheduler(token_budget=64, chunk_size=64, num_blocks=1000)
    chats = [add(sched, 8, max_tokens=100) for _ in range(5)]
    for c in chats:
        decode_into(sched, c)
    doc = add(sched, 500, cls="document", tenant="b", max_tokens=10)
    out = step(sched)
    assert {c.request for c in out.decodes} == set(chats)
    assert [c.request for c in out.prefills] == [doc]
    assert out.prefills[0].num_tokens == 64 - 5          # the budget's remainder
    assert all(c.num_tokens == 1 for c in out.decodes)


def test_a_chat_is_served_before_a_document_that_arrived_first():
    sched, clock = make_scheduler(token_budget=40, chunk_size=32)
    doc = add(sched, 400, cls="document", tenant="b")
    chat = add(sched, 20, tenant="a")
    out = step(sched)
    assert out.prefills[0].request is chat and out.prefills[0].num_tokens == 20
    assert out.prefills[1].request is doc and out.prefills[1].num_tokens == 20


def test_a_lone_prompt_gets_its_whole_chunk_however_small_the_drr_quantum():
    """Found by the evaluation's whole-prefill runs: a lone tenant's DRR turns are a quantum each,
    and the scheduler skipped a request already given a chunk this iteration, so a prompt never
    prefilled more than quantum * weight tokens per iteration (a 65,536-token budget did 128)."""
    sched, _ = make_scheduler(token_budget=1000, chunk_size=600, drr_quantum=8, num_blocks=1000)
    doc = add(sched, 2000, cls="document", tenant="b")
    out = step(sched)
    assert [(c.request, c.num_tokens) for c in out.prefills] == [(doc, 600)]
    chat = add(sched, 300, tenant="a")
    out = step(sched)
    # the chat first, whole; the document's share cap (half of B while chats wait) bounds it
    assert [(c.request, c.num_tokens) for c in out.prefills] == [(chat, 300), (doc, 500)]


def test_a_chunk_deep_in_a_long_prompt_is_cut_to_the_attention_cap_while_chats_decode():
    """A chunk's cost grows with its context: while a chat decodes, the document's chunk at
    position 1,000 may attend over at most max_prefill_attention (query, key) pairs in all; with
    nothing decoding, it takes its whole chunk again."""
    sched, _ = make_scheduler(token_budget=600, chunk_size=500, num_blocks=2000,
                              max_prefill_attention=50_000)
    doc = add(sched, 3000, cls="document", tenant="b", max_tokens=1)
    assert step(sched).prefills[0].num_tokens == 500           # nothing decodes: no cap
    assert step(sched).prefills[0].num_tokens == 500
    chat = add(sched, 8, tenant="a", max_tokens=50)
    decode_into(sched, chat)
    out = step(sched)
    (chunk,) = out.prefills
    assert [c.request for c in out.decodes] == [chat] and chunk.request is doc
    # n tokens from position p attend over n * p + n (n + 1) / 2 pairs: the largest n under 50,000
    p = chunk.start_pos
    assert attention_pairs(p, chunk.num_tokens) <= 50_000 < attention_pairs(p, chunk.num_tokens + 1)
    assert MIN_CHUNK < chunk.num_tokens < 100


def test_the_deepest_chunk_still_advances_by_the_floor():
    sched, _ = make_scheduler(token_budget=600, chunk_size=500, num_blocks=2000,
                              max_prefill_attention=1_000)
    doc = add(sched, 3000, cls="document", tenant="b", max_tokens=1)
    step(sched)
    chat = add(sched, 8, tenant="a", max_tokens=50)
    decode_into(sched, chat)
    assert [(c.request, c.num_tokens) for c in step(sched).prefills] == [(doc, MIN_CHUNK)]


def test_once_the_pairs_run_out_only_the_first_chat_gets_the_floor():
    """Found on the co-located overload ramp: with the attention cap spent, every queued chat got
    a MIN_CHUNK floor chunk, so a queue of chats advanced 16 tokens each, all together, and every
    one of them started late. Now the pairs go to the chats in order (FCFS within the tenant),
    one floor chunk at most, and those behind wait whole."""
    sched, _ = make_scheduler(token_budget=600, chunk_size=200, num_blocks=4000,
                              max_prefill_attention=30_000)
    streaming = add(sched, 8, tenant="b", max_tokens=100)
    decode_into(sched, streaming)
    chats = [add(sched, 150) for _ in range(6)]
    out = step(sched)
    given = [(c.request, c.num_tokens) for c in out.prefills]
    # 150 tokens from position 0 attend over 11,325 pairs: two chats fit whole in 30,000, the
    # third gets what is left (7,350 pairs: 114 tokens) and the others nothing yet
    assert given[:2] == [(chats[0], 150), (chats[1], 150)]
    assert given[2][0] is chats[2] and MIN_CHUNK < given[2][1] < 150
    assert len(given) == 3


def test_an_aged_document_spends_at_most_its_share_of_the_pairs():
    """Found on the co-located overload ramp: a document aged ahead of the chats, deep in its
    prompt, spent every attention pair of the step, and each chat behind it got the floor. While
    chats wait, a document takes at most its share of the pairs, as of the tokens."""
    sched, clock = make_scheduler(token_budget=600, chunk_size=500, num_blocks=4000,
                                  max_prefill_attention=100_000)
    doc = add(sched, 3000, cls="document", tenant="b", max_tokens=1, clock=clock)
    for _ in range(4):
        step(sched)                                    # nothing decodes: 500-token chunks
    streaming = add(sched, 8, tenant="c", max_tokens=100, clock=clock)
    decode_into(sched, streaming)
    clock.now = 25.0                                    # the document has aged past the chats
    chat = add(sched, 200, tenant="a", clock=clock)
    out = step(sched)
    assert [c.request for c in out.prefills] == [doc, chat]
    doc_chunk = out.prefill_of(doc)
    assert attention_pairs(doc_chunk.start_pos, doc_chunk.num_tokens) <= 50_000   # half the cap
    assert out.prefill_of(chat).num_tokens == 200       # the chat's 20,100 pairs fit whole


def test_document_share_is_capped_while_interactive_work_waits():
    # documents may take at most half of B while a chat waits (here the chat is blocked by its
    # tenant's cap, so without the share cap the document would take everything)
    tenants = (Tenant("a", max_active_seqs=1), Tenant("b"))
    sched, _ = make_scheduler(tenants=tenants, token_budget=64, chunk_size=64, num_blocks=1000)
    first = add(sched, 4, tenant="a", max_tokens=50)
    step(sched)                                   # tenant a now holds its one slot
    add(sched, 30, tenant="a")                    # waits: tenant a is at its cap
    doc = add(sched, 1000, cls="document", tenant="b")
    out = step(sched)
    doc_tokens = sum(c.num_tokens for c in out.prefills if c.request is doc)
    assert doc_tokens == 32                        # 0.5 * 64
    sched.finish(first, Status.FINISHED_STOPPED)   # the waiting chat can now run
    out = step(sched)
    assert out.prefills[0].request.tenant == "a"


def test_aging_lets_an_old_document_go_ahead_of_new_chats():
    sched, clock = make_scheduler(token_budget=16, chunk_size=16)
    doc = add(sched, 100, cls="document", tenant="b", clock=clock)
    clock.now = 25.0     # document: priority 1 + 25 s / 10 s aging = 3.5 > interactive's 2
    add(sched, 40, tenant="a", clock=clock)
    out = step(sched)
    assert out.prefills[0].request is doc


def test_tenants_share_prefill_by_weight_with_deficit_round_robin():
    tenants = (Tenant("a", weight=3.0), Tenant("b", weight=1.0))
    sched, _ = make_scheduler(tenants=tenants, token_budget=32, chunk_size=16, drr_quantum=8,
                              prefix_caching=False,
                              num_blocks=4000)
    for _ in range(20):
        add(sched, 64, tenant="a", max_tokens=1)
        add(sched, 64, tenant="b", max_tokens=1)
    served = {"a": 0, "b": 0}
    for _ in range(30):
        for c in step(sched).prefills:
            served[c.request.tenant] += c.num_tokens
    assert served["a"] + served["b"] == 30 * 32
    assert served["a"] / served["b"] == pytest.approx(3.0, rel=0.1)


def test_tenant_caps_on_active_sequences_and_reserved_blocks():
    tenants = (Tenant("a", max_active_seqs=2), Tenant("b", max_reserved_blocks=10))
    sched, _ = make_scheduler(tenants=tenants)
    a = [add(sched, 4, tenant="a", max_tokens=4) for _ in range(3)]
    b = [add(sched, 16, tenant="b", max_tokens=4) for _ in range(2)]  # 5 blocks each
    step(sched)
    assert [r.status for r in a] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    assert [r.status for r in b] == [Status.RUNNING, Status.RUNNING]
    c = add(sched, 4, tenant="b", max_tokens=4)                      # would be block 11
    step(sched)
    assert c.status == Status.WAITING


def test_eos_releases_every_page_in_the_same_iteration():
    sched, _ = make_scheduler()
    req = add(sched, 10, max_tokens=50)
    step(sched)
    assert sched.pool.num_used > 0 and sched.pool.num_reserved > 0
    step(sched, eos_for={req.request_id})
    assert req.status == Status.FINISHED_STOPPED and req.stop_reason == EOS
    assert sched.pool.num_used == 0 and sched.pool.num_reserved == 0
    assert not sched.has_work


def test_max_tokens_finishes_with_length():
    sched, _ = make_scheduler()
    req = add(sched, 5, max_tokens=3)
    for _ in range(3):
        step(sched)
    assert req.status == Status.FINISHED_LENGTH and req.num_output_tokens == 3
    assert sched.pool.num_used == 0


def test_cancel_frees_everything_wherever_the_request_is():
    sched, _ = make_scheduler(token_budget=16, chunk_size=16, num_blocks=1000)
    prefilling = add(sched, 1000, tenant="a")
    step(sched)
    decoding = add(sched, 4, tenant="b", max_tokens=50)
    while not decoding.is_decoding:
        step(sched)
    assert prefilling.status == Status.RUNNING and not prefilling.is_decoding
    queued = add(sched, 8, tenant="c")
    for r in (queued, prefilling, decoding):
        assert sched.cancel(r.request_id) is r and r.status == Status.FINISHED_ABORTED
    assert sched.cancel(decoding.request_id) is None        # idempotent
    assert sched.pool.num_used == 0 and sched.pool.num_reserved == 0 and not sched.has_work


def test_a_queued_request_that_would_clearly_miss_its_ttft_target_is_rejected_with_a_reason():
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=4000)
    for _ in range(5):
        sched.prefill_rate.observe(1000, 1.0)             # measured: 1000 prefill tokens/s
    big = [add(sched, 1000, tenant="b", max_tokens=1) for _ in range(2)]  # 2 s of prefill queued
    late = add(sched, 10, tenant="b")                    # first token after 2.01 s > 2 x 1.0 s
    out = sched.schedule()
    assert out.rejected == [late]
    assert late.status == Status.FINISHED_REJECTED
    assert "is over 2x the interactive class target" in late.reject_reason
    assert late.retry_after_s == pytest.approx(2000 / 1000 - 1.0)   # the backlog drained enough
    assert big[0].status == Status.RUNNING and not big[1].is_finished


def test_a_near_miss_is_served_not_rejected():
    """The target is a p99 and the prediction is rough: a request predicted past the target
    but within reject_late_factor of it is served (32 concurrent chats were refused at 1.02 s
    predicted while the served ones had TTFT p99 0.5 s)."""
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=4000)
    for _ in range(5):
        sched.prefill_rate.observe(1000, 1.0)
    add(sched, 1500, tenant="b", max_tokens=1)           # 1.5 s of prefill queued
    near = add(sched, 10, tenant="b")                    # 1.51 s: past 1.0 s, within 2 x
    assert near not in sched.schedule().rejected and near.status != Status.FINISHED_REJECTED


def test_late_rejection_trusts_the_best_recent_prefill_rate():
    """One slow step (a neighbour on a shared core) must not make queued requests look late."""
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=4000)
    for rate in (1000, 1000, 1000, 100):                  # the last step ran 10x slower
        sched.prefill_rate.observe(rate, 1.0)
    add(sched, 1500, tenant="b", max_tokens=1)
    near = add(sched, 10, tenant="b")
    assert near not in sched.schedule().rejected


def test_a_chat_is_not_rejected_for_a_documents_prefill_it_will_overtake():
    """Found by the `mixed` load test: chats were rejected as 'late' behind an admitted document's
    8K-token prefill, which they never wait for (prefill goes by class priority)."""
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=4000)
    for _ in range(5):
        sched.prefill_rate.observe(1000, 1.0)             # measured: 1000 prefill tokens/s
    doc = add(sched, 3000, cls="document", tenant="b", max_tokens=1)   # 3 s of prefill
    step(sched)                                           # admitted, prefilling
    chat = add(sched, 10, tenant="a")
    out = sched.schedule()
    assert chat not in out.rejected and chat.status != Status.FINISHED_REJECTED
    assert out.prefills[0].request is chat
    assert doc.status == Status.RUNNING


def test_a_chat_is_not_rejected_behind_aged_documents_that_only_take_their_share():
    """Found on the co-located overload ramp: documents queued past their aging sort ahead of the
    chats, and late rejection counted all their prompt tokens ahead of every chat (~100K tokens,
    tens of seconds), so it refused thousands of chats the router had just admitted. While chats
    wait the documents take at most their share of a step: a chat does not wait for them."""
    tenants = (Tenant("a"), Tenant("b"), Tenant("c", max_active_seqs=1))
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=8000, tenants=tenants)
    for _ in range(5):
        sched.prefill_rate.observe(1000, 1.0)             # measured: 1000 prefill tokens/s
    add(sched, 10, tenant="c", cls="document", max_tokens=50, clock=clock)
    step(sched)                                           # tenant c now holds its one seat
    docs = [add(sched, 3000, cls="document", tenant="c", max_tokens=1, clock=clock)
            for _ in range(2)]                            # 6 s of prefill, queued
    clock.now = 12.0                                      # aged ahead of any chat (2.2 > 2)
    chat = add(sched, 10, tenant="a", clock=clock)
    out = sched.schedule()
    assert chat not in out.rejected and chat.status != Status.FINISHED_REJECTED
    assert out.rejected == [] and all(d.status == Status.WAITING for d in docs)


def test_a_quiet_tenant_is_not_rejected_behind_a_flooding_tenants_queue():
    """Found by the noisy-neighbor load test: late rejection ordered a class's queue by arrival, so
    a quiet tenant's chat looked 3 s back behind a flood's queue and was refused, though DRR
    serves it next. Now the flood's own late requests are refused and the quiet one is not."""
    sched, clock = make_scheduler(token_budget=16, chunk_size=16, num_blocks=4000)
    for _ in range(5):
        sched.prefill_rate.observe(1000, 1.0)             # measured: 1000 prefill tokens/s
    flood = [add(sched, 100, tenant="b", max_tokens=1) for _ in range(30)]   # 3 s of prefill
    quiet = add(sched, 100, tenant="c", max_tokens=1)
    out = sched.schedule()
    assert quiet not in out.rejected and quiet.status != Status.FINISHED_REJECTED
    # b's k-th request starts after its k earlier ones plus c's 100 tokens, served in turn
    # predicted TTFT of b's k-th: (100 k own + 100 of c + its own 100) / 1000 > 2 x 1.0 s
    assert out.rejected == flood[19:]
    assert all("over 2x the interactive class target" in r.reject_reason for r in out.rejected)


def test_predict_policy_grows_and_preempts_the_lowest_priority_newest():
    # 12 blocks of 4. predict reserves prompt + 4 predicted tokens and grows on demand.
    from services.engine.config import INTERACTIVE, BATCH
    from dataclasses import replace
    classes = (replace(INTERACTIVE, predicted_output_tokens=4),
               replace(BATCH, predicted_output_tokens=4))
    sched, _ = make_scheduler(num_blocks=12, admission="predict", classes=classes,
                              reject_late=False)
    chat = add(sched, 8, max_tokens=40)                       # 3 blocks
    add(sched, 8, cls="batch", tenant="b", max_tokens=40)  # the older batch request
    batch_new = add(sched, 8, cls="batch", tenant="c", max_tokens=40)
    step(sched)
    assert sched.pool.num_available == 12 - 9
    preempted = []
    for _ in range(30):
        preempted += step(sched).preempted
        sched.pool.check_invariants()
    assert preempted and preempted[0] is batch_new
    assert chat.num_preemptions == 0
    assert chat.num_output_tokens > batch_new.num_output_tokens


def test_prefill_role_stops_after_the_first_token_and_keeps_pages_for_export():
    sched, _ = make_scheduler(role="prefill")
    req = add(sched, 10, max_tokens=20)
    step(sched)
    assert req.status == Status.PREFILLED and req.num_output_tokens == 1
    assert sched.pool.held(req.request_id) == 3        # the prompt's pages, kept
    assert sched.pool.reserved(req.request_id) == 0    # the decode side reserves the output
    assert not sched.has_work
    sched.release(req.request_id)
    assert sched.pool.num_used == 0


def test_decode_role_reserves_for_remote_kv_and_refuses_what_it_cannot_back():
    sched, _ = make_scheduler(role="decode", num_blocks=10)
    req = make_request(sched, 10, max_tokens=10)             # 20 tokens = 5 blocks
    blocks = sched.add_remote(req)
    assert len(blocks) == 3 and req.status == Status.WAITING_FOR_KV
    assert sched.pool.reserved(req.request_id) == 2
    too_big = make_request(sched, 10, max_tokens=14)         # 6 blocks > 5 left
    assert sched.add_remote(too_big) is None and sched.pool.held(too_big.request_id) == 0
    sched.kv_arrived(req.request_id, 42)
    assert req.is_decoding and req.output_token_ids == [42]
    out = step(sched)
    assert [c.request for c in out.decodes] == [req] and out.decodes[0].start_pos == 10


def test_prefix_cache_is_shared_within_a_tenant_and_never_across_tenants():
    sched, _ = make_scheduler()
    prompt = list(range(100, 121))                            # 21 tokens: 5 full blocks of 4
    first = add(sched, prompt=prompt, tenant="a", max_tokens=10)
    step(sched)
    first_blocks = sched.pool.block_table(first.request_id)[:5]
    same = add(sched, prompt=prompt, tenant="a", max_tokens=2)
    other = add(sched, prompt=prompt, tenant="b", max_tokens=2)
    out = step(sched)
    starts = {c.request.request_id: c.start_pos for c in out.prefills}
    assert starts[same.request_id] == 20                      # 5 cached blocks reused
    assert starts[other.request_id] == 0                      # salted by tenant: no hit
    assert sched.pool.block_table(same.request_id)[:5] == first_blocks
    assert sched.pool.block_table(other.request_id)[:5] != first_blocks


def test_a_step_that_gave_every_queued_prompt_a_whole_chunk_is_unstarved():
    """The prefill rate is measured from such steps: a lone long prompt's chunks fill far less
    than half a large budget, yet the step ran as fast as prefill can go."""
    sched, _ = make_scheduler(token_budget=256, chunk_size=32, num_blocks=4000)
    doc = add(sched, 200, cls="document", tenant="b", max_tokens=1)
    out = sched.schedule()
    assert out.num_prefill_tokens == 32 < 256 // 2
    assert sched.prefill_unstarved(out)
    sched.update(out, [])
    add(sched, 10, tenant="a")       # a chat shorter than a chunk: its step had room to spare
    out = sched.schedule()
    assert doc in {c.request for c in out.prefills} and out.num_prefill_tokens == 32 + 10
    assert not sched.prefill_unstarved(out)


def test_a_step_cut_short_by_the_budget_or_with_nothing_to_prefill_is_not_unstarved():
    sched, _ = make_scheduler(token_budget=64, chunk_size=32, num_blocks=4000)
    assert not sched.prefill_unstarved(sched.schedule())          # idle: nothing prefilled
    for tenant in "abc":
        add(sched, 100, tenant=tenant, max_tokens=1)               # 3 x 32 wanted, 64 fit
    out = sched.schedule()
    assert out.num_prefill_tokens == 64
    assert not sched.prefill_unstarved(out)


def test_what_the_prompts_ahead_take_of_a_step_is_each_ones_chunk_at_most():
    sched, _ = make_scheduler(token_budget=256, chunk_size=32, num_blocks=4000)
    add(sched, 1000, cls="document", tenant="b", max_tokens=1)
    add(sched, 10, tenant="a")
    ahead = sched.prefill_step_tokens_ahead()
    assert ahead["interactive"] == 10                  # only the chat is ahead of a chat
    assert ahead["document"] == 10 + 32                # the document: one chunk, not 1,000
    assert sched.prefill_tokens_ahead()["document"] == 1010
