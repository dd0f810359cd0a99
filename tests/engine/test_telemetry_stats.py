"""What the engine tells telemetry, on the tiny model with a clock the test sets: each request's
queue and prefill times on its first token, one StepRecord per step that ran the model (batch
composition, gaps, KV read volume, prefix-cache lookups), and the queue age and per-tenant shares
in stats()."""
from __future__ import annotations

import pytest

from services.engine.config import Tenant
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams

BLOCK = 16


class Clock:
    """Time stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, clock: Clock | None = None, **overrides) -> LLMEngine:
    overrides.setdefault("reject_late", False)
    overrides.setdefault("kv_cache_mib", 16)
    overrides.setdefault("max_running", 8)
    cfg = engine_config(str(model_dir), block_size=BLOCK, **overrides)
    return LLMEngine(cfg, clock=clock) if clock is not None else LLMEngine(cfg)


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i % 90 for i in range(n)]


def steps_until_done(engine: LLMEngine) -> list:
    """Every StepRecord of the steps that run until the engine is idle."""
    records = []
    while engine.has_unfinished():
        engine.step()
        if engine.last_step is not None:
            records.append(engine.last_step)
    return records


def test_the_first_token_carries_queue_and_prefill_times_on_the_engines_clock(tiny_model_dir):
    clock = Clock()
    engine = make_engine(tiny_model_dir, clock, token_budget=32, chunk_size=32)
    rid = engine.add_request(prompt(50), params(3))        # arrives at t=0: two chunks of 32 + 18

    clock.now = 2.0
    assert engine.step() == []                               # first chunk scheduled at t=2
    clock.now = 7.0
    first = engine.step()                                    # second chunk samples the first token
    assert [o.new_token_ids != [] for o in first] == [True]
    assert first[0].queue_s == pytest.approx(2.0)
    assert first[0].prefill_s == pytest.approx(5.0)

    later = [o for o in engine.stream() if o.request_id == rid]
    assert later and all(o.queue_s is None and o.prefill_s is None for o in later)


def test_a_reserved_decode_request_has_no_queue_or_prefill_time(tiny_model_dir):
    engine = make_engine(tiny_model_dir, role="decode")
    assert engine.reserve_remote(prompt(20), params(3), request_id="d1") is not None
    engine.start_decode("d1", first_token=5)
    outs = list(engine.stream())
    assert outs and all(o.queue_s is None and o.prefill_s is None for o in outs)


def test_step_records_add_up_to_the_requests_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, token_budget=32, chunk_size=32,
                         enable_prefix_caching=False)
    engine.add_request(prompt(70), params(6))
    records = steps_until_done(engine)

    assert sum(r.prefill_tokens for r in records) == 70
    assert sum(r.num_prefill_seqs for r in records) == 3      # chunks of 32, 32, 6
    assert [n for r in records for _, n in r.prefill_chunks] == [32, 32, 6]
    # the prefill samples the first token; each later token is one decode step
    assert sum(r.decode_tokens for r in records) == 5
    assert all(r.num_decode_seqs == r.decode_tokens for r in records)
    assert all(r.preemptions == 0 and r.prefix_queries == 0 for r in records)


def test_kv_read_bytes_is_the_decoding_context_times_kv_bytes_per_token(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request(prompt(40), params(4))
    records = steps_until_done(engine)
    decodes = [r for r in records if r.decode_tokens]

    per_token = engine.kv_bytes_per_token
    # the first decode step attends over the prompt and the first token, each later one more
    assert [r.kv_read_bytes for r in decodes] == [41 * per_token, 42 * per_token, 43 * per_token]
    assert [r.kv_read_bytes for r in records if not r.decode_tokens] == [0]   # the prefill step


def test_gap_is_zero_back_to_back_and_counts_only_time_work_waited(tiny_model_dir):
    clock = Clock()
    engine = make_engine(tiny_model_dir, clock, token_budget=32, chunk_size=32)
    engine.add_request(prompt(50), params(2))
    clock.now = 1.5                      # the request waited 1.5 s for the first step
    engine.step()
    assert engine.last_step.gap_s == pytest.approx(1.5)
    engine.step()                        # back to back: the clock did not move
    assert engine.last_step.gap_s == 0.0
    clock.now = 2.0                      # 0.5 s between steps with work left
    engine.step()
    assert engine.last_step.gap_s == pytest.approx(0.5)
    assert not engine.has_unfinished()

    clock.now = 100.0                    # idle for 98 s: no gap, nothing waited
    engine.add_request(prompt(10), params(1))
    clock.now = 100.25
    engine.step()
    assert engine.last_step.gap_s == pytest.approx(0.25)


def test_prefix_lookups_count_the_admitted_prompt_and_its_cached_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    shared = prompt(3 * BLOCK + 5)
    engine.add_request(shared, params(1))
    first = steps_until_done(engine)
    engine.add_request(shared, params(1))                   # same tenant, same prompt
    second = steps_until_done(engine)

    assert sum(r.prefix_queries for r in first) == len(shared)
    assert sum(r.prefix_hits for r in first) == 0
    assert sum(r.prefix_queries for r in second) == len(shared)
    assert sum(r.prefix_hits for r in second) == 3 * BLOCK     # every full block was cached
    assert sum(r.prefill_tokens for r in second) == 5


def test_a_step_that_only_flushes_a_cancel_has_no_record(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    rid = engine.add_request(prompt(10), params(1))
    assert engine.cancel(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.last_step is None


def test_stats_give_the_oldest_queued_age_and_each_tenants_share(tiny_model_dir):
    clock = Clock()
    engine = make_engine(tiny_model_dir, clock, tenants=(Tenant("acme"), Tenant("zeta")),
                         default_tenant="acme", max_running=2, token_budget=64, chunk_size=64)
    assert engine.stats().oldest_queued_s == 0.0 and engine.stats().tenants == []

    engine.add_request(prompt(40), params(8), tenant="acme")
    clock.now = 1.0
    engine.add_request(prompt(20), params(8), tenant="zeta")
    clock.now = 3.0
    engine.add_request(prompt(20), params(8), tenant="zeta")   # third: max_running keeps it queued
    clock.now = 4.0
    assert engine.stats().oldest_queued_s == pytest.approx(4.0)

    engine.step()                            # admits acme's and the first zeta request
    stats = engine.stats()
    assert stats.oldest_queued_s == pytest.approx(1.0)        # zeta's second, queued at t=3
    acme_blocks = engine.pool.held("req-0") + engine.pool.reserved("req-0")
    zeta_blocks = engine.pool.held("req-1") + engine.pool.reserved("req-1")
    assert acme_blocks > zeta_blocks
    assert stats.tenants == [("acme", 1, acme_blocks), ("zeta", 1, zeta_blocks)]


def test_a_reservation_counts_in_its_tenants_share(tiny_model_dir):
    engine = make_engine(tiny_model_dir, role="decode")
    blocks = engine.reserve_remote(prompt(40), params(8), request_id="d1")
    assert blocks is not None
    (tenant, sequences, kv_blocks), = engine.stats().tenants
    assert (tenant, sequences) == ("default", 1)
    assert kv_blocks == engine.pool.held("d1") + engine.pool.reserved("d1") >= len(blocks)


def test_a_steps_prefill_is_counted_by_its_prompts_class(tiny_model_dir):
    """A chat and a document prefilled in one step: the record sums each class's tokens and the
    prompts they were (each chunk as its part of its prompt), what the worker's arrival rates by
    class count; the totals agree with the step's."""
    engine = make_engine(tiny_model_dir, token_budget=64, chunk_size=32,
                         enable_prefix_caching=False)
    engine.add_request(prompt(20), params(2), traffic_class="interactive")
    engine.add_request(prompt(80, base=20), params(2), traffic_class="document")
    engine.step()
    record = engine.last_step

    assert record.prefill_by_class == {"interactive": 20, "document": 32}
    assert record.prompts_by_class == pytest.approx({"interactive": 1.0, "document": 32 / 80})
    assert sum(record.prefill_by_class.values()) == record.prefill_tokens
