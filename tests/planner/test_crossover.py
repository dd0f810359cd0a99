"""`kvfleet sim crossover` and the FCFS baseline: a fixed-length workload plans only its length,
rates sit around what the replicas hold by the cost model, the command writes its table and plot,
FCFS without a token budget prefills a long prompt whole, and bad arguments are clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtests.workload import plan_requests
from services.engine.config import SimConfig
from services.planner.capacity import CostModel
from services.planner.crossover import base_rate, fixed_workload, work_of
from services.planner.simulator import Fleet, SimRunConfig, simulate
from services.planner.study import fcfs_engine


def seventy_b() -> CostModel:
    return CostModel.for_target(model="llama-3-70b", gpu="h200", tp=4, dtype="fp8")


def test_a_fixed_workload_plans_one_length_in_the_class_that_takes_it():
    short = plan_requests(fixed_workload(1024, 32, 20.0, 5.0))
    long = plan_requests(fixed_workload(32768, 32, 2.0, 5.0))
    assert short and {(r.prompt_tokens, r.max_tokens, r.traffic_class) for r in short} == {
        (1024, 32, "interactive")}
    assert long and {(r.prompt_tokens, r.traffic_class) for r in long} == {(32768, "document")}


def test_the_base_rate_is_the_replicas_busy_time_over_one_requests_work():
    m = seventy_b()
    pre, dec = work_of(m, 4096, 128)
    assert pre == pytest.approx(m.prefill_s(4096))
    assert base_rate(m, 4, 4096, 128) == pytest.approx(
        4 * m.constants.target_utilization / (pre + dec))
    assert base_rate(m, 4, 32768, 128) < base_rate(m, 4, 256, 128)


def steps_for_one_document(engine=None) -> tuple[int, int]:
    spec = fixed_workload(16384, 4, 0.5, 4.0, seed=1)
    assert len(plan_requests(spec)) >= 1
    cfg = SimRunConfig(fleet=Fleet.parse("colocated:1"), sim=SimConfig())
    if engine is not None:
        cfg = SimRunConfig(fleet=cfg.fleet, sim=cfg.sim, engine=engine)
    out = simulate(spec, cfg)
    assert all(r.status == 200 for r in out.run.records)
    return out.steps, len(out.run.records)


def test_fcfs_prefills_a_long_prompt_whole_where_chunked_takes_many_steps():
    fcfs_steps, n = steps_for_one_document(fcfs_engine())
    chunked_steps, _ = steps_for_one_document()
    # FCFS: one prefill step and 3 decode steps per request at most; chunked: 256-token chunks
    assert fcfs_steps <= 4 * n
    assert chunked_steps >= n * 16384 // 256


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "sim", "crossover", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_small_crossover_writes_its_table_and_plot(tmp_path):
    done = cli("--lengths", "1024,16384", "--factors", "0.5", "--gbps", "400,14.4",
               "--replicas", "2", "--duration", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    got = json.loads((tmp_path / "crossover.json").read_text())
    rows = got["table"]
    assert {(r["prompt_tokens"], r["gbps"]) for r in rows} == {
        (1024, 400.0), (1024, 14.4), (16384, 400.0), (16384, 14.4)}
    assert all(r["colocated"] == "colocated:2" and r["disaggregated"] == "disagg:1:1" for r in rows)
    assert (tmp_path / "crossover.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (("--replicas", "1"), "--replicas must be >= 2"),
    (("--lengths", "abc"), "comma-separated numbers"),
    (("--lengths", "0"), "must be >= 1"),
    (("--gbps", "0"), "bandwidths must be > 0"),
    (("--lengths", "999999"), "prompt lengths must be <="),
])
def test_bad_arguments_are_clear_errors(args, message, tmp_path):
    done = cli(*args, "--out", str(tmp_path))
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr
