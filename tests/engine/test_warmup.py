"""The warm-up profile (services/engine/warmup.py) on the tiny model: it measures every shape it
is given that fits, and leaves the engine as it found it: the block pool exactly as full (the
same owners, reservations, free blocks and prefix-cache entries, no KV event), no request, no
step counted; a step that fails ends it with the error named, the pool still as it was."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.warmup import Shape, default_shapes, predicted_s, profile

BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(engine_config(str(tiny_model_dir), token_budget=512, chunk_size=256,
                                   max_running=32, kv_cache_mib=1, block_size=BLOCK))


def pool_state(engine) -> tuple:
    pool = engine.pool
    tables = {o: list(pool.block_table(o)) for o in pool.owners()}
    free = sorted(b.block_id for b in pool.blocks if b.ref_count == 0)
    return (tables, {o: pool.reserved(o) for o in tables}, free, pool.num_reserved,
            sorted(pool.cached_hashes()), [(b.block_id, b.block_hash) for b in pool.blocks])


def engine_state(engine) -> tuple:
    stats = engine.stats()
    return (stats.steps, stats.prefill_tokens, stats.decode_tokens, len(engine.scheduler.requests),
            engine.scheduler.prefill_rate.rate, engine.last_step)


shapes = st.builds(
    Shape,
    prefill=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 100)), max_size=3).map(tuple),
    decodes=st.lists(st.integers(1, 120), max_size=4).map(tuple),
).filter(lambda s: s.tokens > 0)


def cache_a_prefix(engine) -> None:
    """A finished request leaves its prompt's full blocks in the prefix cache (free, cached)."""
    engine.generate([list(range(1, 3 * BLOCK + 2))], SamplingParams(max_tokens=1))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(shapes, min_size=1, max_size=4), st.booleans())
def test_the_warm_up_leaves_the_pool_and_the_engine_as_it_found_them(engine, plan, holding):
    """With the pool empty, or holding a live reservation and cached prefix blocks, whatever
    shapes run: the pool's owners, reservations, free blocks and cached hashes are exactly as
    before, no KV event was logged, and the engine counted no step and holds no request."""
    engine.pool.reset_prefix_cache()
    engine.pool.events.take()
    if holding:
        cache_a_prefix(engine)
        engine.pool.reserve("someone", 3)
    engine.pool.events.take()
    before, counted = pool_state(engine), engine_state(engine)
    try:
        result = profile(engine, plan, timeout_s=60, max_step_s=60)
        assert result.error == ""
        assert len(result.steps) + result.skipped == len(plan)
        assert all(s.seconds > 0 for s in result.steps)
        assert pool_state(engine) == before
        assert engine.pool.events.take() == ([], [], False)
        assert engine_state(engine) == counted
        engine.pool.check_invariants()
    finally:
        engine.pool.free("someone")


def test_a_warm_up_step_that_fails_ends_it_named_and_gives_back_its_blocks(engine, monkeypatch):
    cache_a_prefix(engine)
    before = pool_state(engine)
    real, calls = engine.executor.execute, []

    def execute(*args):
        calls.append(1)
        if len(calls) == 5:      # the second shape's second run: the first shape is measured
            raise RuntimeError("out of memory (injected)")
        return real(*args)

    monkeypatch.setattr(engine.executor, "execute", execute)
    result = profile(engine, [Shape(decodes=(8, 9)), Shape(prefill=((20, 0),))], timeout_s=60)
    assert result.error == "RuntimeError: out of memory (injected)"
    assert len(result.steps) == 1 and result.steps[0].decode_tokens == 2
    assert pool_state(engine) == before
    engine.pool.check_invariants()


def test_a_warm_up_past_its_timeout_stops_between_runs_and_says_so(engine):
    ticks = iter(range(100))               # an injected clock: 1 s a reading
    result = profile(engine, default_shapes(512, 256, 32, 2048), timeout_s=2.5,
                     clock=lambda: next(ticks))
    assert result.error == "timed out after 2.5 s"
    assert engine.pool.num_reserved == 0 and not list(engine.pool.owners())


def test_the_default_shapes_run_cheapest_first_and_pin_each_term(tiny_model_dir):
    """Decodes at batch 1 (the fixed cost), chunks at position 0 of several sizes (the token
    cost), a chunk deep in a prompt (the pair cost), and a chat burst's packed step."""
    plan = default_shapes(token_budget=2048, chunk_size=512, max_running=256, max_model_len=4096)
    assert [s.tokens for s in plan] == sorted(s.tokens for s in plan)
    assert plan[0] == Shape(decodes=(256,))
    assert Shape(prefill=((200, 0),) * 10) in plan                # 2,048 // 200 chats
    assert max(start for s in plan for _, start in s.prefill) == 2048
    assert len({s.tokens for s in plan}) >= 4



def test_a_shape_predicted_past_the_step_cap_is_skipped_and_the_cheaper_ones_still_run(
        engine, monkeypatch):
    """Steps that take 10 ms + 1 ms a token (an injected clock): after an 8-token and a
    32-token prefill step, a 200-token one is predicted at 210 ms, past a 100 ms cap, and
    skipped; a 40-token one after it still runs. The decode-only step before them prices
    nothing (one prefill size alone: unknown, run)."""
    now, real = [0.0], engine.executor.execute

    def execute(plan, *rest):
        now[0] += 0.010 + 0.001 * sum(c.num_tokens for c in plan.chunks)
        return real(plan, *rest)

    monkeypatch.setattr(engine.executor, "execute", execute)
    shapes = [Shape(decodes=(16,)), Shape(prefill=((8, 0),)), Shape(prefill=((32, 0),)),
              Shape(prefill=((200, 0),)), Shape(prefill=((40, 0),))]
    result = profile(engine, shapes, timeout_s=1e9, max_step_s=0.1, clock=lambda: now[0])
    assert [s.prefill_tokens + s.decode_tokens for s in result.steps] == [1, 8, 32, 40]
    assert result.skipped == 1 and result.error == ""
    assert predicted_s(result.steps[:3], 200) == pytest.approx(0.210)
    assert predicted_s(result.steps[:2], 10_000) == 0        # one prefill size: unknown
