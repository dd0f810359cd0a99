"""Decode protection: a sequence joins the decode batch only while the predicted step time stays
inside the ITL targets of the classes in it; the rest wait in order and start as others finish.

The step model here has known coefficients and learns nothing: a step costs 1/64 s plus 1/64 s per
decoding sequence (powers of two: the arithmetic is exact), and the interactive ITL target is 9/64 s
at headroom 1, so the batch holds exactly 8.
"""
from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings, strategies as st

from services.engine.block_pool import BlockPool
from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, SchedulerConfig, Tenant
from services.engine.decode_protection import Seat, decode_admissions
from services.engine.engine import LLMEngine, engine_config
from services.engine.request import Status
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.step_model import StepCoefficients, StepModel, StepModelConfig
from services.planner.step_time import BatchShape

from tests.engine.scheduler_helpers import EOS, Clock, make_request, step

STEP = 1 / 64
KNOWN = StepCoefficients(fixed_s=STEP, per_decode_s=STEP)
CAP = 8                                        # (1 + 8) / 64 = the 9/64 s target
CLASSES = (replace(INTERACTIVE, itl_target_s=9 / 64), DOCUMENT, BATCH)


def known_model() -> StepModel:
    return StepModel(KNOWN, StepModelConfig(learn=False))


def scheduler(**overrides) -> tuple[Scheduler, Clock]:
    overrides = dict(dict(tenants=(Tenant("a"),), default_tenant="a", token_budget=64,
                          chunk_size=32, max_running=32, itl_headroom=1.0, classes=CLASSES),
                     **overrides)
    clock = Clock()
    return Scheduler(SchedulerConfig(**overrides), BlockPool(512, 4), max_model_len=4096,
                     clock=clock, step_model=known_model()), clock


def decoding(sched: Scheduler) -> int:
    return sum(1 for r in sched.running.values() if r.is_decoding)


def assert_pool_empty(sched: Scheduler) -> None:
    assert sched.pool.num_used == 0 and sched.pool.num_reserved == 0
    assert not sched.requests and not sched.running and not sched.slot_waiting


def run_out(sched, steps: int = 40) -> int:
    """Step until nothing is left (at most `steps`); the largest running batch seen."""
    peak = 0
    for _ in range(steps):
        if not sched.has_work:
            break
        step(sched)
        peak = max(peak, len(sched.running))
    return peak


# ----------------------------------------------------------------------------- the rule itself
@settings(max_examples=200, deadline=None)
@given(fixed=st.floats(1e-4, 0.05), per_seq=st.floats(1e-5, 0.01),
       batch=st.lists(st.tuples(st.integers(1, 8192), st.sampled_from([0.04, 0.1, math.inf])),
                      max_size=20),
       waiting=st.lists(st.tuples(st.integers(1, 8192), st.sampled_from([0.04, 0.1, math.inf]),
                                  st.integers(1, 3)), max_size=20),
       headroom=st.floats(0.5, 1.0))
def test_the_batch_stops_growing_exactly_where_the_predicted_step_passes_the_target(
        fixed, per_seq, batch, waiting, headroom):
    model = StepModel(StepCoefficients(fixed_s=fixed, per_decode_s=per_seq,
                                       per_context_token_s=1e-7), StepModelConfig(learn=False))
    seats = [Seat(c, t) for c, t in batch]
    candidates = [Seat(c, t, n) for c, t, n in waiting]
    n = decode_admissions(model, seats, candidates, headroom)

    def fits(k: int) -> bool:
        joined = seats + candidates[:k]
        shape = BatchShape(decode_contexts=tuple(s.context for s in joined for _ in range(s.copies)))
        return model.step_s(shape) <= headroom * min(s.itl_target_s for s in joined)

    def reachable(k: int) -> bool:
        """Candidate k alone meets the tightest target of the batch with it (else holding it
        back buys nothing, and it joins)."""
        bound = headroom * min(s.itl_target_s for s in seats + candidates[:k + 1])
        return model.step_s(BatchShape(decode_contexts=(candidates[k].context,))) <= bound

    assert 0 <= n <= len(candidates)
    if candidates and not seats:
        assert n >= 1                             # a batch of one cannot be refused
    for k in range(n):                            # each joined where it fit, or could not be helped
        assert fits(k + 1) or not reachable(k) or (k == 0 and not seats)
    if n < len(candidates):                       # the first held back breaks a reachable target
        assert not fits(n + 1) and reachable(n)


# ------------------------------------------------------------------------------ mixed role
def test_mixed_role_the_batch_stops_at_the_target_and_the_rest_start_as_others_finish():
    sched, clock = scheduler()
    reqs = [make_request(sched, 6, max_tokens=4, clock=clock) for _ in range(12)]
    for r in reqs:
        sched.add(r)
    step(sched)
    assert len(sched.running) == CAP                           # exactly where 9/64 s is reached
    assert [r.status for r in reqs[CAP:]] == [Status.WAITING] * 4   # in the queue, no KV taken
    assert sched.num_waiting_for_decode_slot == 1             # the tenant's head; the rest behind
    step(sched, eos_for={reqs[0].request_id, reqs[1].request_id})  # two finish ...
    step(sched)
    assert reqs[CAP].status == reqs[CAP + 1].status == Status.RUNNING  # ... two start, in order
    assert reqs[CAP + 2].status == Status.WAITING
    peak = run_out(sched)
    assert peak <= CAP and all(r.is_finished for r in reqs)   # nobody starves
    assert_pool_empty(sched)


def test_a_target_that_a_batch_of_one_misses_holds_nobody_back():
    """Holding sequences back cannot make a step faster than one sequence's: the batch grows as
    without protection, at full throughput, rather than crawling at batch 1."""
    tight = (replace(INTERACTIVE, itl_target_s=1e-9), DOCUMENT, BATCH)
    sched, clock = scheduler(classes=tight)
    reqs = [make_request(sched, 6, max_tokens=3, clock=clock) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    peak = run_out(sched)
    assert peak == 3 and sched.num_waiting_for_decode_slot == 0
    assert all(r.status == Status.FINISHED_LENGTH for r in reqs)
    assert_pool_empty(sched)


def test_protect_itl_off_restores_unlimited_batches():
    sched, clock = scheduler(protect_itl=False)
    for _ in range(12):
        sched.add(make_request(sched, 6, max_tokens=4, clock=clock))
    step(sched)
    step(sched)
    assert decoding(sched) == 12 and sched.num_waiting_for_decode_slot == 0


def test_a_batch_class_sequence_waits_behind_streaming_chats_but_fills_a_loose_batch():
    sched, clock = scheduler(token_budget=256)
    chats = [make_request(sched, 6, max_tokens=50, clock=clock) for _ in range(CAP)]
    bulk = make_request(sched, 6, cls="batch", max_tokens=4, clock=clock)
    for r in [*chats, bulk]:
        sched.add(r)
    step(sched)
    assert bulk.status == Status.WAITING              # it would slow the chats past 9/64 s
    for r in chats:
        sched.cancel(r.request_id)
    bulks = [make_request(sched, 6, cls="batch", max_tokens=4, clock=clock) for _ in range(20)]
    for r in bulks:
        sched.add(r)
    step(sched)
    assert len(sched.running) == 21                   # no ITL target among them: no cap


def test_a_request_held_back_and_predicted_far_past_its_ttft_target_is_rejected_as_queued_ones_are():
    sched, clock = scheduler()
    for _ in range(3):
        sched.prefill_rate.observe(64, 0.01)          # a known prefill rate: 6,400 tokens/s
    streaming = [make_request(sched, 6, max_tokens=100, clock=clock) for _ in range(CAP)]
    for r in streaming:
        sched.add(r)
    step(sched)
    late = make_request(sched, 6, max_tokens=4, clock=clock)
    sched.add(late)
    step(sched)
    assert late.status == Status.WAITING
    clock.now += 2.5                                  # over 2x its 1 s TTFT target, still held
    out = step(sched)
    assert out.rejected == [late] and late.status == Status.FINISHED_REJECTED
    assert "time to first token" in late.reject_reason


# ----------------------------------------------------------------------------- decode role
def arrive(sched: Scheduler, clock: Clock, cls: str = "interactive", max_tokens: int = 4):
    req = make_request(sched, 6, cls=cls, max_tokens=max_tokens, clock=clock)
    assert sched.add_remote(req) is not None
    clock.now += 0.001
    return req


def test_decode_role_sequences_whose_kv_arrived_wait_for_a_slot_keeping_their_reservation():
    sched, clock = scheduler(role="decode")
    reqs = [arrive(sched, clock) for _ in range(11)]
    bulk = arrive(sched, clock, cls="batch")
    late_chat = arrive(sched, clock)
    for r in [*reqs, bulk, late_chat]:
        sched.kv_arrived(r.request_id, first_token=7)
    assert len(sched.running) == CAP
    waiting = [r for r in [*reqs, bulk, late_chat] if r.status == Status.WAITING_FOR_SLOT]
    assert len(waiting) == 5 and sched.num_waiting_for_decode_slot == 5
    assert all(sched.pool.reserved(r.request_id) > 0 for r in waiting)   # kept, not lost
    reserved = sched.pool.num_reserved
    step(sched, eos_for={reqs[0].request_id, reqs[1].request_id, reqs[2].request_id})
    step(sched)
    # three slots, in order (class priority, then arrival): the chats that came first
    assert [r.status for r in reqs[CAP:]] == [Status.RUNNING] * 3
    assert late_chat.status == bulk.status == Status.WAITING_FOR_SLOT
    assert sched.pool.num_reserved <= reserved
    step(sched)                                       # the first eight finish ...
    step(sched)                                       # ... and the next iteration the rest join
    assert late_chat.status == bulk.status == Status.RUNNING
    for _ in range(40):
        if not sched.has_work:
            break
        step(sched)
        assert len(sched.running) <= CAP
    assert all(r.is_finished for r in [*reqs, bulk, late_chat])
    assert_pool_empty(sched)


def test_decode_role_a_waiting_sequence_counts_against_max_running_and_frees_on_cancel():
    sched, clock = scheduler(role="decode", max_running=10)
    reqs = [arrive(sched, clock) for _ in range(10)]
    for r in reqs:
        sched.kv_arrived(r.request_id, first_token=7)
    extra = make_request(sched, 6, clock=clock)
    assert sched.add_remote(extra) is None           # 8 decoding + 2 waiting: the worker is full
    held = sched.pool.num_reserved + sched.pool.num_used
    waiting = reqs[-1]
    assert waiting.status == Status.WAITING_FOR_SLOT
    sched.cancel(waiting.request_id)
    assert waiting.status == Status.FINISHED_ABORTED and waiting not in sched.slot_waiting
    assert sched.pool.num_reserved + sched.pool.num_used < held
    assert sched.num_waiting_for_decode_slot == 1


def test_decode_role_protect_itl_off_starts_decoding_at_once():
    sched, clock = scheduler(role="decode", protect_itl=False)
    reqs = [arrive(sched, clock) for _ in range(12)]
    for r in reqs:
        sched.kv_arrived(r.request_id, first_token=7)
    assert all(r.status == Status.RUNNING for r in reqs) and not sched.slot_waiting


# ------------------------------------------------------------------------- the real engine
def run_engine(itl_target_s: float, protect: bool) -> tuple[int, list]:
    classes = (replace(INTERACTIVE, itl_target_s=itl_target_s), DOCUMENT, BATCH)
    engine = LLMEngine(engine_config(classes=classes, protect_itl=protect, num_blocks=256,
                                     reject_late=False))     # a loaded box must not reject here
    ids = [engine.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
           for i in range(4)]
    peak, done, waited = 0, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if engine.last_step is not None:
            peak = max(peak, engine.last_step.num_decode_seqs)
        waited = max(waited, engine.stats().num_waiting_for_decode_slot)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
    assert sorted(done) == sorted(ids) and all(o.finish_reason == "length" for o in done.values())
    return peak, waited


def test_engine_with_real_steps_an_unreachable_target_costs_no_throughput():
    """The real engine learns its step time from its own steps; no step is 1 us, so protection
    idles and the batch is what it is without it (the capping itself: the stories above, on a
    step model with known coefficients)."""
    assert run_engine(itl_target_s=1e-6, protect=True) == (4, 0)
    assert run_engine(itl_target_s=1e-6, protect=False) == (4, 0)
