"""`kvfleet capacity --workload FILE --rate R`: the first estimate's arithmetic, the search's walk
(it finds the smallest fleet that meets the attainment from any start), a higher rate never
needing fewer GPUs on the real simulator, and bad input as clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.workload import load_workload, plan_requests
from services.engine.config import SimConfig
from services.planner.capacity import CostModel
from services.planner.offered_load import OfferedLoad
from services.planner.sizing import (SizingConfig, candidates, estimate, fleet_of, rate_scale_for,
                                     search, size)


def seventy_b() -> CostModel:
    return CostModel.for_target(model="llama-3-70b", gpu="h200", tp=4, dtype="fp8")


def load(prefill: float, decode: float) -> OfferedLoad:
    return OfferedLoad("w", 100, 10.0, 500.0, 50.0, 64, prefill, decode, 0, 0)


def test_the_estimate_divides_the_offered_work_by_the_target_utilization():
    # 1.5 replica-s/s of prefill and 0.3 of decode at 80% busy: 2 + 1 apart, 3 together
    assert estimate(load(1.5, 0.3), 0.8) == {"colocated": 3, "disagg": 3, "hybrid": 3}
    # little work still needs one replica per pool; a hybrid needs three
    assert estimate(load(0.01, 0.01), 0.8) == {"colocated": 1, "disagg": 2, "hybrid": 3}
    assert estimate(load(4.0, 2.0), 0.5) == {"colocated": 12, "disagg": 12, "hybrid": 12}


def test_a_fleet_of_n_splits_by_the_prefill_share():
    assert fleet_of("colocated", 5, 0.9) == "colocated:5"
    assert fleet_of("disagg", 4, 0.75) == "disagg:3:1"
    assert fleet_of("disagg", 2, 0.99) == "disagg:1:1"       # each pool keeps one replica
    assert fleet_of("hybrid", 4, 0.5) == "hybrid:2:1:1"
    assert candidates("disagg", 4, 0.5) == ["disagg:2:2", "disagg:1:3", "disagg:3:1"]
    assert candidates("disagg", 2, 0.5) == ["disagg:1:1"]


def test_the_rate_scales_the_specs_own_planned_rate():
    spec = load_workload("chat-only")
    planned = len(plan_requests(spec)) / spec.duration_s
    assert rate_scale_for(spec, 2 * planned) == pytest.approx(2.0)


def served_within(capacity_per_replica: float, rate: float):
    """A stand-in for the simulator (named as such): a fleet meets its SLOs while the rate is
    under its replicas' summed capacity."""
    def attained(fleet: str) -> float:
        n = sum(int(x) for x in fleet.split(":")[1:])
        return 1.0 if rate <= n * capacity_per_replica else 0.5
    return attained


@given(st.sampled_from(["colocated", "disagg", "hybrid"]), st.integers(1, 40),
       st.floats(0.5, 200.0), st.floats(0.5, 10.0))
def test_the_search_finds_the_smallest_fleet_from_any_start(mode, start, rate, per_replica):
    cfg = SizingConfig(rate_rps=rate, max_replicas=32)
    got = search(mode, start, 0.5, cfg, served_within(per_replica, rate))
    lo = {"colocated": 1, "disagg": 2, "hybrid": 3}[mode]
    need = max(lo, -(-rate // per_replica))
    if need > 32:
        assert got.fleet is None and got.gpus is None
    else:
        assert got.replicas == need and got.gpus == 4 * need and got.attainment == 1.0


def test_a_higher_rate_never_needs_fewer_gpus_on_the_simulator():
    """One second of `chat-only` at 10, 150 and 300 requests/s on the 70B target, fleets of up
    to three replicas per mode. The co-located answer rises at each step (1, 2, then 3 replicas)
    and the disaggregated one at the last, and every answer is found under the cap, so neither
    the cap nor the search's start decides it (the search finds the smallest fleet from any
    start: above): it is the simulator's attainment that grows the fleet with the rate."""
    spec = load_workload("chat-only").with_overrides(duration_s=1)
    sim = SimConfig()
    gpus = []
    for rate in (10.0, 150.0, 300.0):
        got = size(spec, seventy_b(), sim, SizingConfig(rate_rps=rate, max_replicas=3))
        modes = {s.mode: s for s in got["modes"]}
        assert all(s.attainment is None or s.attainment >= 0.9 for s in modes.values())
        gpus.append([(modes[m].gpus or 10**6) for m in ("colocated", "disagg", "hybrid")])
    assert all(g < 10**6 for row in gpus for g in row), gpus      # each found under the cap
    for lower, higher in zip(gpus, gpus[1:]):
        assert all(a <= b for a, b in zip(lower, higher)), gpus
        assert lower[0] < higher[0], gpus           # and each higher rate needs more co-located


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "capacity", *args],
                          capture_output=True, text=True, timeout=300)


def test_json_names_the_gpus_per_mode():
    done = cli("--workload", "chat-only", "--rate", "10", "--duration", "2", "--json")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)["sizing"]
    assert set(s["modes"]) == {"colocated", "disagg", "hybrid"}
    for m in s["modes"].values():
        assert m["gpus"] == 4 * m["replicas"] and m["fleet"] in m["tried"]


@pytest.mark.parametrize("args, message", [
    (("--rate", "5"), "--rate needs --workload"),
    (("--workload", "chat-only", "--rate", "0"), "--rate must be"),
    (("--workload", "chat-only", "--rate", "-3"), "--rate must be"),
    (("--workload", "chat-only", "--rate", "inf"), "--rate must be"),
    (("--workload", "chat-only", "--rate", "5", "--max-replicas", "1"), "--max-replicas"),
    (("--workload", "no-such-workload", "--rate", "5"), "no-such-workload"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = cli(*args)
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr


def test_the_worst_class_with_a_target_decides_not_the_chats_that_outnumber_it():
    from loadtests.workload import slo_table
    from services.planner.sizing import class_attainment
    slos = slo_table(load_workload("mixed"))
    summary = {"overall": {"met": 95, "requests": 100},
               "classes": {"interactive": {"requests": 90, "attainment": {"slo": 1.0}},
                           "document": {"requests": 5, "attainment": {"slo": 0.2}},
                           "batch": {"requests": 5, "attainment": {"slo": 0.0}}}}
    assert class_attainment(summary, slos) == 0.2           # batch has no target: not counted
