"""The fleet's own costs for the simulator: measured from a fleet's records and its engine cores'
step traces, and added by `kvfleet sim run --sim-overhead`."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.records import RequestRecord, RunResult
from loadtests.workload import load_workload
from services.engine.config import SimConfig
from services.planner.in_fleet import TracedStep, fit_in_fleet, read_trace, step_costs
from services.planner.overhead import FleetOverhead, OverheadError, fit_overhead
from services.planner.simulator import Fleet, SimRunConfig, simulate
from services.planner.step_time import BatchShape
from services.protocol import env


def record(i: int, ttft_s: float, queue_s: float, prefill_s: float, transfer_s: float = 0.0,
           prompt: int = 100) -> RequestRecord:
    return RequestRecord(i, "chat", "t", 0.0, send_s=0.0, prompt_tokens=prompt, ttft_s=ttft_s,
                         status=200, timing={"queue_s": queue_s, "prefill_s": prefill_s,
                                             "transfer_s": transfer_s, "pool": "decode"})


def run_of(records: list[RequestRecord]) -> RunResult:
    return RunResult({}, {}, {}, records)


def test_the_path_is_what_the_client_waited_beyond_the_engines_queue_and_prefill():
    run = run_of([record(i, ttft_s=0.1 + 0.01 * i, queue_s=0.02, prefill_s=0.05) for i in range(11)])
    got = fit_overhead([run])
    # client TTFT - queue - prefill: 30, 40, ... 130 ms
    assert got.samples == 11
    assert got.path_s(0.0) == pytest.approx(0.03)
    assert got.path_s(1.0) == pytest.approx(0.13)
    assert got.path_mean_s == pytest.approx(0.08, rel=0.02)


def test_the_hand_off_is_the_measured_transfer_beyond_the_modelled_one():
    run = run_of([record(i, 0.2, 0.0, 0.1, transfer_s=0.004 + 1e-5 * 100) for i in range(5)])
    got = fit_overhead([run], transfer_s=lambda n: 1e-5 * n)
    assert got.handoff_s == pytest.approx(0.004)


def test_a_run_without_phase_times_cannot_be_fitted():
    bare = RequestRecord(0, "chat", "t", 0.0, send_s=0.0, ttft_s=0.1, status=200)
    with pytest.raises(OverheadError, match="phase times"):
        fit_overhead([run_of([bare, bare])])


def test_the_file_round_trips_and_a_bad_one_is_a_clear_error(tmp_path):
    got = FleetOverhead(path_quantiles_s=(0.01, 0.02, 0.05), handoff_s=0.003, samples=9, source="x")
    got.save(tmp_path / "o.json")
    assert FleetOverhead.load(tmp_path / "o.json") == got
    (tmp_path / "bad.json").write_text(json.dumps({"format": "kvfleet-fleet-overhead/1",
                                                   "path_quantiles_s": [0.05, 0.01]}))
    with pytest.raises(OverheadError, match="ascending"):
        FleetOverhead.load(tmp_path / "bad.json")
    with pytest.raises(OverheadError, match="not a fleet overhead"):
        FleetOverhead.from_dict({"format": "other"})


@given(st.lists(st.floats(0, 5), min_size=2, max_size=40), st.integers(0, 2**31))
def test_every_drawn_path_lies_within_the_measured_ones(paths, seed):
    run = run_of([record(i, ttft_s=p + 0.1, queue_s=0.05, prefill_s=0.05) for i, p in enumerate(paths)])
    got = fit_overhead([run])
    draw = got.sampler(seed)
    for _ in range(20):
        assert min(paths) - 1e-9 <= draw() <= max(paths) + 1e-9


def step(t0: float, dur: float, busy: bool, prefill: int = 0, decodes: int = 1) -> TracedStep:
    chunks = ((prefill, 0),) if prefill else ()
    return TracedStep(BatchShape(chunks, (10,) * decodes), t0, dur, busy)


def test_a_step_costs_the_core_until_its_next_step_while_work_was_left():
    core = [step(0.0, 0.010, True), step(0.013, 0.010, True), step(0.027, 0.010, False),
            step(1.0, 0.020, False)]
    costs = [s for _, s in step_costs([core])]
    # between steps: 3 ms and 4 ms (median 3.5 ms), added to the steps before an idle wait
    assert costs == pytest.approx([0.013, 0.014, 0.0135, 0.0235])


def test_an_in_fleet_fit_adds_up_to_the_time_the_core_spent():
    samples = [(BatchShape((), (10,) * d), 0.004 + 0.001 * d * (3 if d % 4 == 0 else 1))
               for d in range(1, 30)]
    got = fit_in_fleet(samples)
    assert sum(got.step_s(b) for b, _ in samples) == pytest.approx(sum(s for _, s in samples))


def test_a_traced_engine_core_writes_each_steps_shape(tmp_path):
    from services.engine.engine import LLMEngine, engine_config
    from services.engine.sampling_params import SamplingParams
    from services.worker import step_trace

    engine = LLMEngine(engine_config("tiny", sim=SimConfig(step_s=0.001, kv_tokens=4096),
                                     chunk_size=64, token_budget=64, max_running=8))
    step_trace.install(engine, {env.STEP_TRACE.name: str(tmp_path)})
    engine.generate([list(range(16, 116))], SamplingParams(max_tokens=4, ignore_eos=True))
    [core] = read_trace(tmp_path)
    assert [s.shape.prefill_tokens for s in core[:2]] == [64, 36]     # 100 prompt tokens in chunks
    assert [s.shape.num_decodes for s in core[2:]] == [1, 1, 1]       # the 3 tokens after the first
    assert sum(s.shape.decode_contexts[0] for s in core[2:]) == 101 + 102 + 103
    assert [s.busy_after for s in core] == [True] * (len(core) - 1) + [False]


def test_the_simulated_ttft_includes_the_drawn_path():
    spec = load_workload("chat-only").with_overrides(duration_s=3.0)
    sim = SimConfig(kv_tokens=200_000)
    alone = simulate(spec, SimRunConfig(fleet=Fleet.parse("colocated:2"), sim=sim)).run
    path = FleetOverhead(path_quantiles_s=(0.05, 0.05))
    with_path = simulate(spec, SimRunConfig(fleet=Fleet.parse("colocated:2"), sim=sim,
                                            overhead=path)).run
    # a constant path shifts every arrival alike: each TTFT grows by it, the gaps stay
    for a, b in zip(alone.records, with_path.records):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.05)
        assert b.itl_s == pytest.approx(a.itl_s)


def test_against_a_discrete_event_run_the_path_is_each_requests_added_ttft():
    # the same seeded requests: the fleet added 30 ms to each, queues included
    fleet = run_of([record(i, ttft_s=0.15 + 0.01 * i, queue_s=0.08, prefill_s=0.05) for i in range(5)])
    des = run_of([record(i, ttft_s=0.12 + 0.01 * i, queue_s=0.05, prefill_s=0.05) for i in range(5)])
    got = fit_overhead([fleet], baseline=des)
    assert got.path_s(0.0) == pytest.approx(0.03)
    assert got.path_s(1.0) == pytest.approx(0.03)


def test_a_request_the_simulation_batched_later_takes_nothing_off_the_mean_path():
    fleet = run_of([record(i, ttft_s=t, queue_s=0.0, prefill_s=0.0) for i, t in enumerate([0.2, 0.2, 0.1])])
    des = run_of([record(i, ttft_s=0.1, queue_s=0.0, prefill_s=0.0) for i in range(2)]
                 + [record(2, ttft_s=0.15, queue_s=0.0, prefill_s=0.0)])
    got = fit_overhead([fleet], baseline=des)
    # differences +100, +100, -50 ms: mean 50 ms, kept as delays 0..75 ms
    assert got.path_s(0.0) == pytest.approx(0.0)
    assert got.path_s(1.0) == pytest.approx(0.075)


def test_sim_run_names_a_bad_overhead_file_and_stops(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "services.cli.cli", "sim", "run", "--workload",
                           "chat-only", "--fleet", "colocated:1", "--duration", "1",
                           "--sim-overhead", str(tmp_path / "bad.json"), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "not a fleet overhead file" in done.stderr and "Traceback" not in done.stderr


def test_bench_fleet_hands_the_simulated_target_to_kvfleet_up_and_paces_its_own_engine():
    from services.cli.fleet_bench import bench_engine, up_args
    from services.engine.config import add_sim_args, sim_config_from_args
    from services.engine.sampling_params import SamplingParams
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", default="disagg")
    p.add_argument("--kv-backend", default="tcp")
    add_sim_args(p)
    args = p.parse_args(["--engine", "sim", "--sim-step-ms", "5", "--sim-kv-tokens", "4096"])
    up = up_args(args, "engine.yaml")
    assert (up.engine, up.sim_step_ms, up.sim_kv_tokens) == ("sim", 5.0, 4096)
    engine = bench_engine("tiny", 1, sim=sim_config_from_args(args))
    # the same pacing as the engine core: a step ends no earlier than its start + its modelled
    # time (a lower bound the sleep guarantees, not a measurement)
    engine.add_request(list(range(16, 48)), SamplingParams(max_tokens=3, ignore_eos=True))
    started = time.monotonic()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += engine.last_step is not None
    assert steps >= 3 and time.monotonic() - started >= steps * 0.005
