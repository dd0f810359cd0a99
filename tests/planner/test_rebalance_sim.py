"""The rebalancer in the simulator's loop (services/planner/rebalance_sim.py), on a short shifting
trace: the pools follow the mix, a new worker serves only after its start-up, the budget holds,
and the plot is written."""
from __future__ import annotations

import pytest

from services.engine.config import SimConfig
from services.planner.rebalance import RebalanceConfig
from services.planner.rebalance_sim import LoopConfig, default_specs, plot, run_one, shifting_plan
from services.planner.simulator import Fleet, SimRunConfig

HOUR_S = 8.0
LOOP = LoopConfig(hour_s=HOUR_S, window_s=1.0, startup_s=1.0,
                  policy=RebalanceConfig(cooldown_s=2.0, budget=5, down_windows=2))


def test_the_shifting_trace_plays_each_hour_in_its_own_span():
    whole, planned = shifting_plan(default_specs(), HOUR_S)
    first = [p for p in planned if p.at_s < HOUR_S]
    second = [p for p in planned if p.at_s >= HOUR_S]
    assert {p.tenant.split(":")[0] for p in first} == {"shift-chat"}
    assert {p.tenant.split(":")[0] for p in second} == {"shift-docs"}
    assert [p.index for p in planned] == list(range(len(planned)))
    assert whole.duration_s == 2 * HOUR_S


def test_a_cool_down_shorter_than_a_start_up_and_a_window_is_refused():
    with pytest.raises(ValueError, match="cool-down"):
        LoopConfig(window_s=30, startup_s=30, policy=RebalanceConfig(cooldown_s=30))


def test_the_pools_follow_the_mix_within_the_budget(tmp_path):
    specs = [s.with_overrides(rate_scale=0.5) for s in default_specs()]
    cfg = SimRunConfig(fleet=Fleet.parse("disagg:2:2"), sim=SimConfig())
    run = run_one(specs, cfg, LOOP, HOUR_S)
    assert run.summary["overall"]["requests"] > 0
    assert run.timeline and run.decisions
    for x in run.timeline:
        held = sum(x[f"{r}_{p}"] for r in ("prefill", "decode")
                   for p in ("serving", "starting"))
        assert held <= LOOP.policy.budget
    changes = [d for d in run.decisions
               if any(isinstance(v, dict) and v["recommended"] != v["current"] for v in d.values())]
    assert changes, "the policy never moved a pool on a shifting mix"
    starting = [x for x in run.timeline if x["prefill_starting"] or x["decode_starting"]]
    assert all(x["prefill_serving"] >= 1 and x["decode_serving"] >= 1 for x in run.timeline)
    assert starting                  # an added worker held its GPUs before it served
    fixed = run_one(specs, cfg, None, HOUR_S)
    assert not fixed.decisions and fixed.summary["overall"]["requests"] == \
        run.summary["overall"]["requests"]
    path = tmp_path / "loop.png"
    plot(run, [fixed], HOUR_S, str(path))
    assert path.stat().st_size > 10_000
