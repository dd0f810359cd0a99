"""The simulated engine: the real LLMEngine (scheduler, block pool, output states) over the
SimExecutor, whose tokens are a function of seed, prompt and position and whose steps last what
a StepTimer says. The tiny model's tokenizer and config are read; its weights are never loaded."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.config import EngineConfig, SchedulerConfig, SimConfig, parse_output_len
from services.engine.engine import LLMEngine
from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.engine.sim_tokens import draw_output_len
from services.planner.step_time import BatchShape, FixedStepTimer

PROMPT = list(range(40, 90))


def sim_engine(model_dir, clock=None, timer=None, **sim) -> LLMEngine:
    sim = {"step_s": 0.02, "kv_tokens": 16 * 512, **sim}
    config = EngineConfig(model=str(model_dir), sim=SimConfig(**sim))
    return LLMEngine(config, step_timer=timer, **({"clock": clock} if clock else {}))


def run(engine, prompt=PROMPT, **params):
    [out] = engine.generate([prompt], SamplingParams(**params))
    return out


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(tiny_model_dir):
    a, b = sim_engine(tiny_model_dir), sim_engine(tiny_model_dir)
    first = run(a, seed=7, max_tokens=20, ignore_eos=True).token_ids
    assert run(b, seed=7, max_tokens=20, ignore_eos=True).token_ids == first
    assert run(b, seed=8, max_tokens=20, ignore_eos=True).token_ids != first
    assert run(b, prompt=PROMPT[1:], seed=7, max_tokens=20, ignore_eos=True).token_ids != first
    # without a seed: the engine's seed (and the same engine seed gives the same tokens)
    assert run(a, max_tokens=20, ignore_eos=True).token_ids == run(b, max_tokens=20,
                                                                   ignore_eos=True).token_ids


def test_tokens_avoid_eos_and_special_ids_until_the_drawn_length_ends_the_request(tiny_model_dir):
    engine = sim_engine(tiny_model_dir, output_len="fixed:12")
    eos = set(engine.model_config.eos_token_ids) | set(engine.tokenizer.eos_token_ids)
    out = run(engine, seed=1, max_tokens=100)
    assert out.finish_reason == "stop" and len(out.token_ids) == 12
    assert out.token_ids[-1] in eos
    assert not (set(out.token_ids[:-1]) & (eos | engine.tokenizer.special_ids))


def test_max_tokens_min_tokens_and_ignore_eos_behave_as_in_the_real_engine(tiny_model_dir):
    engine = sim_engine(tiny_model_dir, output_len="fixed:5")
    assert len(run(engine, seed=1, max_tokens=3).token_ids) == 3          # length first
    assert run(engine, seed=1, max_tokens=3).finish_reason == "length"
    assert len(run(engine, seed=1, max_tokens=50).token_ids) == 5         # EOS at the drawn length
    out = run(engine, seed=1, max_tokens=50, min_tokens=9)               # EOS held back
    assert out.finish_reason == "stop" and len(out.token_ids) == 10
    out = run(engine, seed=1, max_tokens=30, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 30


def test_a_stop_id_ends_the_request_where_the_sim_draws_it_but_not_before_min_tokens(
        tiny_model_dir):
    engine = sim_engine(tiny_model_dir)
    tokens = run(engine, seed=3, max_tokens=12, ignore_eos=True).token_ids
    stop = tokens[5]
    if stop in tokens[:5]:
        pytest.skip("the drawn token repeats earlier")
    out = run(engine, seed=3, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    assert out.finish_reason == "stop" and out.token_ids == tokens[:6]
    held = run(engine, seed=3, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
               min_tokens=8)
    assert stop not in held.token_ids[:8]


def test_n_samples_fork_and_draw_their_own_tokens(tiny_model_dir):
    engine = sim_engine(tiny_model_dir)
    outs = engine.generate([PROMPT], SamplingParams(n=3, seed=4, max_tokens=6, ignore_eos=True))
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 3
    # sample i draws from seed + i, as the real engine's samples do
    assert outs[1].token_ids == run(engine, seed=5, max_tokens=6, ignore_eos=True).token_ids


def test_logprobs_are_synthetic_but_deterministic_and_shaped_as_asked(tiny_model_dir):
    engine = sim_engine(tiny_model_dir)
    a = run(engine, seed=2, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    b = run(engine, seed=2, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    assert all(-5 < lp.logprob < 0 and len(lp.top) == 3 and lp.top[0][0] == lp.token_id
               for lp in a.logprobs)
    assert len(a.prompt_logprobs) >= len(PROMPT) - 1


def test_output_lengths_are_drawn_from_the_seeded_distribution():
    draws = [draw_output_len("lognormal:mean=200,sigma=0.8", k) for k in range(2000)]
    assert draws == [draw_output_len("lognormal:mean=200,sigma=0.8", k) for k in range(2000)]
    assert 170 < sum(draws) / len(draws) < 230 and min(draws) >= 1
    geo = [draw_output_len("geometric:mean=50", k) for k in range(2000)]
    assert 42 < sum(geo) / len(geo) < 58 and min(geo) >= 1
    assert draw_output_len("fixed:17", 3) == 17
    for bad in ("lognormal:mean=200", "poisson:mean=3", "fixed:x", "geometric:mean=0"):
        with pytest.raises(ValueError, match="output length spec"):
            parse_output_len(bad)


def test_each_step_lasts_what_the_step_timer_says_for_the_planned_batch(tiny_model_dir):
    shapes = []

    class Recording:
        def step_s(self, batch: BatchShape) -> float:
            shapes.append(batch)
            return 0.001 * batch.prefill_tokens + 0.01 * batch.num_decodes

    now = [100.0]
    engine = sim_engine(tiny_model_dir, clock=lambda: now[0], timer=Recording())
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()                      # the prompt, in one chunk, samples the first token
    assert shapes[-1] == BatchShape(prefill_chunks=((len(PROMPT), 0),))
    assert engine.last_step_modelled_s == pytest.approx(0.001 * len(PROMPT))
    assert engine.last_step.duration_s == pytest.approx(engine.last_step_modelled_s)
    now[0] += engine.last_step_modelled_s          # a virtual clock advanced by the step
    engine.step()
    assert shapes[-1] == BatchShape(decode_contexts=(len(PROMPT) + 1,))
    assert engine.last_step_modelled_s == pytest.approx(0.01)
    assert engine.last_step.gap_s == pytest.approx(0.0)


def test_the_block_count_is_the_targets_and_the_cache_is_tiny_per_block(tiny_model_dir):
    engine = sim_engine(tiny_model_dir, kv_tokens=2_600_000)
    assert engine.pool.num_blocks == 2_600_000 // 16 == engine.stats().kv_blocks_total
    assert engine.kv_cache.data.nbytes < 24 << 20        # float16, one layer, one head, dim 2


def test_a_reservation_the_sim_cannot_back_is_refused(tiny_model_dir):
    engine = sim_engine(tiny_model_dir, kv_tokens=16 * 8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert engine.reserve_remote(PROMPT, params, request_id="a") is not None
    assert engine.reserve_remote(PROMPT, params, request_id="b") is None
    with pytest.raises(InvalidRequestError):
        engine.add_request(list(range(40, 40 + 16 * 9)), params)


# --------------------------------------------------------------- the sim against the real engine
COMMANDS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 8)),
    st.tuples(st.just("reserve"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 8)),
    st.tuples(st.just("start"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 3)),
), min_size=1, max_size=18)


def _pool(engine) -> tuple:
    p = engine.pool
    return p.num_free, p.num_used, p.num_reserved, p.num_cached


def _drive(engine, commands) -> list:
    """Run a trace; everything the scheduler decided, in order, and the pool after each command."""
    seen, ids, reserved = [], [], []
    for cmd in commands:
        if cmd[0] in ("add", "reserve"):
            _, base, length, max_tokens = cmd
            prompt = [(base * 7 + i) % 200 + 10 for i in range(length)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1)
            rid = f"r{len(ids)}"
            ids.append(rid)
            if cmd[0] == "add":
                try:
                    engine.add_request(prompt, params, request_id=rid)
                    seen.append(("added", rid))
                except InvalidRequestError as e:
                    seen.append(("invalid", rid, e.code))
            else:
                blocks = engine.reserve_remote(prompt, params, request_id=rid)
                seen.append(("reserved", rid, blocks))
                if blocks is not None:
                    reserved.append(rid)
        elif cmd[0] == "start" and reserved:
            rid = reserved.pop(cmd[1] % len(reserved))
            engine.start_decode(rid, 33)
            seen.append(("started", rid))
        elif cmd[0] == "cancel" and ids:
            rid = ids[cmd[1] % len(ids)]
            if rid in reserved:
                reserved.remove(rid)
            seen.append(("cancelled", rid, engine.cancel(rid)))
        elif cmd[0] == "step":
            for _ in range(cmd[1]):
                outs = engine.step()
                seen.append(("step", [(o.request_id, len(o.new_token_ids), o.finish_reason)
                                      for o in outs]))
        seen.append(("pool", _pool(engine)))
    while engine.has_unfinished() and not all(engine.scheduler.requests[r].status.name ==
                                              "WAITING_FOR_KV" for r in engine.scheduler.requests):
        outs = engine.step()
        seen.append(("step", [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outs]))
        seen.append(("pool", _pool(engine)))
    return seen


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(commands=COMMANDS)
def test_the_sim_decides_exactly_as_the_real_engine_on_the_same_trace(tiny_model_dir, commands):
    """Same refusals, reservations (block ids), block-pool counts after every command, and the
    same outputs per step (which request, how many tokens, why it finished): only the token
    values differ."""
    sched = SchedulerConfig(token_budget=32, chunk_size=16, max_running=4, role="mixed")
    base = EngineConfig(model=str(tiny_model_dir), num_blocks=12, scheduler=sched)
    real = LLMEngine(base)
    sim = LLMEngine(replace(base, sim=SimConfig(step_s=0.01)), step_timer=FixedStepTimer(0.01))
    assert _drive(sim, commands) == _drive(real, commands)


def test_a_config_file_may_name_the_simulated_core_and_bad_specs_are_clear_errors():
    from services.engine.config_file import engine_config_from_dict
    cfg = engine_config_from_dict({"sim": {"kv_tokens": 4096, "output_len": "geometric:mean=30"}})
    assert cfg.sim == SimConfig(kv_tokens=4096, output_len="geometric:mean=30")
    with pytest.raises(ValueError, match="unknown keys"):
        engine_config_from_dict({"sim": {"gpus": 4}})
    with pytest.raises(ValueError, match="output length spec"):
        SimConfig(output_len="normal:mean=3")


def test_the_sim_flags_make_one_sim_config_and_kvfleet_up_passes_them_on():
    import argparse

    from services.engine.config import add_sim_args, sim_args, sim_config_from_args
    p = argparse.ArgumentParser()
    add_sim_args(p)
    args = p.parse_args(["--engine", "sim", "--sim-tp", "8", "--sim-kv-tokens", "100",
                         "--sim-step-ms", "5", "--sim-output-len", "fixed:3"])
    assert sim_config_from_args(args) == SimConfig(tp=8, kv_tokens=100, step_s=0.005,
                                                   output_len="fixed:3")
    assert sim_config_from_args(p.parse_args(sim_args(args))) == sim_config_from_args(args)
    assert sim_config_from_args(p.parse_args([])) is None and sim_args(p.parse_args([])) == []


def test_a_prefill_worker_measures_its_rate_from_a_lone_documents_chunks(tiny_model_dir):
    """The prefill role's budget (2048) is four of its chunks (512): one long prompt never fills
    half of it, and its steps still measure the prefill rate (each gives the prompt its whole
    chunk)."""
    sched = SchedulerConfig(role="prefill", token_budget=2048, chunk_size=512)
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=8192, scheduler=sched,
                          sim=SimConfig(step_s=0.02, kv_tokens=16 * 1024))
    engine = LLMEngine(config)
    run(engine, prompt=[40 + i % 50 for i in range(4096)], max_tokens=1)
    assert engine.scheduler.prefill_rate.samples >= 7          # 8 chunks of 512
    assert engine.stats().prefill_tokens_per_s > 0
