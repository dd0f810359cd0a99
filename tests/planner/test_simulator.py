"""`kvfleet sim run`: a workload through a simulated fleet on a virtual clock."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from loadtests.metrics import summarize
from loadtests.workload import load_workload
from services.engine.config import SimConfig
from services.planner.capacity import CostModel
from services.planner.simulator import Fleet, SimError, SimRunConfig, simulate

KV_TOKENS = 200_000        # a smaller pool than the target's: quicker to set up, never short here


def chat(duration_s: float = 4.0, **overrides):
    return load_workload("chat-only").with_overrides(duration_s=duration_s, **overrides)


def config(fleet: str, **sim) -> SimRunConfig:
    return SimRunConfig(fleet=Fleet.parse(fleet), sim=SimConfig(**{"kv_tokens": KV_TOKENS, **sim}))


def kvfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_every_planned_request_is_served_and_timed_on_the_virtual_clock():
    outcome = simulate(chat(), config("colocated:1"))
    records = outcome.run.records
    assert records and all(r.ok for r in records)
    for r in records:
        assert r.output_tokens == r.max_tokens          # ignore_eos, as the load tester sends
        assert len(r.itl_s) == r.max_tokens - 1
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s))
        assert r.ttft_s > 0 and min(r.itl_s, default=1) > 0
    assert outcome.simulated_s >= max(r.send_s for r in records)


def test_the_same_seed_gives_the_same_summary_and_another_seed_another():
    from loadtests.report import summary_of

    def summary(seed: int) -> str:
        """summary.json's content as text (write_report's plots are not needed to compare it)."""
        outcome = simulate(chat(duration_s=3.0, seed=seed), config("disagg:1:2"))
        return json.dumps(summary_of(outcome.run))

    first, again, other = summary(1), summary(1), summary(2)
    assert first == again
    assert first != other


def test_a_disaggregated_request_waits_for_its_kv_between_first_and_second_token():
    # the real fleet streams the first token from the prefill worker before any KV moves
    # (services/gateway/fleet_run.py), so the transfer shows in the first gap, not in TTFT
    spec = chat(duration_s=3.0)
    slow, fast = 0.5, 400.0
    model = CostModel.for_target()
    runs = {g: simulate(spec, config("disagg:1:1", network_gbps=g)).run.records
            for g in (slow, fast)}
    for r in runs[slow]:
        moved = model.transfer_s(r.prompt_tokens, slow)
        assert r.ok and r.timing["transfer_s"] == pytest.approx(moved)
        assert r.itl_s[0] >= moved
    slow_e2e = sum(r.e2e_s for r in runs[slow])
    fast_e2e = sum(r.e2e_s for r in runs[fast])
    assert slow_e2e > fast_e2e
    colocated = simulate(spec, config("colocated:1")).run.records
    assert all(r.timing["transfer_s"] == 0.0 for r in colocated)


def test_a_tiny_kv_pool_queues_co_located_requests_as_the_real_scheduler_does():
    spec = chat(duration_s=3.0)
    roomy = simulate(spec, config("colocated:1")).run.records
    tight = simulate(spec, config("colocated:1", kv_tokens=1024)).run.records
    # they wait for pages; one predicted to start far past its TTFT target is rejected (429)
    # by the scheduler's late rule, as the real engine does; none is lost or left open
    served = [r for r in tight if r.ok]
    late = [r for r in tight if not r.ok]
    assert served and all(r.status == 429 and "time to first token" in r.detail for r in late)
    assert max(r.ttft_s for r in served) > 4 * max(r.ttft_s for r in roomy)


def test_a_tiny_decode_pool_refuses_what_it_cannot_reserve():
    outcome = simulate(chat(duration_s=3.0), config("disagg:1:1", kv_tokens=1024))
    refused = [r for r in outcome.run.records if r.status == 429]
    assert refused and all(r.error == "http_429:overloaded" for r in refused)
    assert any(r.ok for r in outcome.run.records)
    summary = summarize(outcome.run)
    assert summary["overall"]["rejected"] == len(refused)
    # no overload stages in the simulation: its refusals name none
    assert summary["rejections_by_stage"] == {"none": len(refused)}


def test_the_summary_has_the_bench_keys_and_bench_compare_reads_it(tmp_path):
    done = kvfleet("sim", "run", "--workload", "mixed", "--fleet", "colocated:2", "--duration",
                   "3", "--sim-kv-tokens", str(KV_TOKENS), "--out", str(tmp_path / "sim"),
                   "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    written = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert printed == written
    assert {"meta", "duration_s", "classes", "overall", "tenants", "jain_index",
            "errors_by_reason", "retry_after_s", "timeline", "prediction_error",
            "rejections_by_stage", "queue_time_s_by_class"} <= written.keys()
    assert written["meta"]["workload"] == "mixed" and written["meta"]["simulated"] is True
    for c in written["classes"].values():
        assert {"ttft_s", "itl_s", "e2e_s", "attainment", "goodput_rps", "phases",
                "queue_time_s"} <= c.keys()
    # the simulated router admits at once: every served request waited 0 in its queue
    chat = written["queue_time_s_by_class"]["interactive"]
    assert chat["queued"] == 0 and chat["p99"] == 0.0 and chat["requests"] >= 1
    assert {"stage_timeline.png"} <= {p.name for p in (tmp_path / "sim").iterdir()}
    assert {"report.md", "run.json", "ttft_cdf.png"} <= {p.name for p in (tmp_path / "sim").iterdir()}
    compared = kvfleet("bench", "compare", "--summary", str(tmp_path / "sim" / "summary.json"),
                       "--summary", str(tmp_path / "sim" / "summary.json"),
                       "--out", str(tmp_path / "cmp"))
    assert compared.returncode == 0, compared.stderr
    assert "interactive TTFT p99 (s)" in compared.stdout and "| 1.00 |" in compared.stdout
    assert (tmp_path / "cmp" / "compare.md").is_file()


@pytest.mark.parametrize("args, says", [
    (["--fleet", "colocated:0"], "colocated:N, disagg:P:D or hybrid:N:P:D"),
    (["--fleet", "disagg:2"], "colocated:N, disagg:P:D or hybrid:N:P:D"),
    (["--fleet", "hybrid:1:1"], "colocated:N, disagg:P:D or hybrid:N:P:D"),
    (["--fleet", "hybrid:1:1:1", "--hybrid-threshold-tokens", "-5"], "--hybrid-threshold-tokens"),
    (["--fleet", "colocated:1", "--sim-profile", "missing.json"], "cannot read step profile"),
    (["--fleet", "colocated:1", "--sim-gpu", "h9000"], "h9000"),
    (["--fleet", "colocated:1", "--sim-network-gbps", "0"], "network_gbps"),
])
def test_bad_arguments_are_clear_errors(args, says):
    done = kvfleet("sim", "run", "--workload", "chat-only", "--duration", "1", *args)
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr


def test_a_fleet_spec_reads_the_three_modes():
    assert Fleet.parse("colocated:3").roles() == ["mixed"] * 3
    assert Fleet.parse("disagg:1:2").roles() == ["prefill", "decode", "decode"]
    assert Fleet.parse("hybrid:2:1:1").roles() == ["mixed", "mixed", "prefill", "decode"]
    assert str(Fleet.parse("hybrid:2:1:1")) == "hybrid:2:1:1"
    with pytest.raises(SimError):
        Fleet.parse("hybrid:1")


def test_a_hybrid_fleet_serves_short_prompts_co_located_and_long_ones_disaggregated():
    from services.planner.simulator import Simulation, timing_of
    spec = load_workload("mixed").with_overrides(duration_s=6.0)
    cfg = replace(config("hybrid:1:1:1"), hybrid_threshold_tokens=50)
    sim = Simulation(spec, cfg, *timing_of(cfg))
    run = sim.run()
    roles = {t.record.prompt_tokens: {sim.workers[t.prefill_worker].role,
                                       sim.workers[t.decode_worker].role}
             for t in sim.tracks.values() if t.record.ok}
    assert all(r.ok for r in run.records)
    short = {n for n in roles if n <= 50}
    long = set(roles) - short
    assert short and long
    assert all(roles[n] == {"mixed"} for n in short)
    assert all(roles[n] == {"prefill", "decode"} for n in long)
    moved = {r.prompt_tokens: r.timing["transfer_s"] for r in run.records}
    assert all(moved[n] == 0.0 for n in short) and all(moved[n] > 0.0 for n in long)


def served_on(sim) -> dict[str, int]:
    """Served requests by the role of the worker that prefilled them."""
    roles: dict[str, int] = {}
    for t in sim.tracks.values():
        if t.record.ok:
            role = sim.workers[t.prefill_worker].role
            roles[role] = roles.get(role, 0) + 1
    return roles


@pytest.mark.parametrize("admission", [False, True])
def test_a_hybrid_fleets_chats_use_both_pools_when_one_replica_cannot_keep_up(admission):
    # with the router's admission the workers publish their fitted step costs: a chat then goes
    # to an idle prefill replica even on a quiet fleet when the mixed replica's decode batch
    # would make its first token a step later (priced, not assumed: tests/router/test_path_choice)
    from services.planner.sim_admission import SimAdmissionConfig, policy_for
    from services.planner.simulator import Simulation, timing_of

    def run(rate: float):
        spec = chat(duration_s=3.0, rate_scale=rate)
        cfg = config("hybrid:1:1:1")
        if admission:
            cfg = replace(cfg, admission=SimAdmissionConfig(
                policy=policy_for(spec, cfg.sim.network_gbps)))
        sim = Simulation(spec, cfg, *timing_of(cfg))
        return sim, sim.run()

    if not admission:                    # priced by queues alone: 2 chats/s never queue
        quiet, _ = run(0.5)
        assert served_on(quiet) == {"mixed": len(quiet.tracks)}
    busy, result = run(40.0)             # 160 chats/s: more than one replica prefills in time
    on = served_on(busy)
    assert on.get("mixed", 0) > 0 and on.get("prefill", 0) > 0
    assert all(t.path in ("colocated", "disagg") or t.path is None for t in busy.tracks.values())
    spilled = [t for t in busy.tracks.values() if t.record.ok and t.decode_worker is not None
               and busy.workers[t.decode_worker].role == "decode"]
    assert spilled and all(t.record.timing["transfer_s"] > 0.0 for t in spilled)
    assert sum(r.ok for r in result.records) == sum(on.values())


def test_a_measured_profile_drives_the_steps(tmp_path):
    from services.planner.profile import StepProfile
    profile = tmp_path / "p.json"
    StepProfile({"const": 0.01, "prefill_tokens": 1e-5, "decodes": 1e-4}).save(profile)
    outcome = simulate(chat(duration_s=2.0), replace(config("colocated:1"), sim=SimConfig(
        profile=str(profile))))
    gaps = [g for r in outcome.run.records for g in r.itl_s]
    assert gaps and min(gaps) >= 0.01                    # every step at least the constant


def test_after_a_run_every_worker_has_given_every_page_back():
    # one-token answers end on the prefill worker: their decode reservations are cancelled
    import yaml

    from loadtests.workload import WORKLOADS_DIR, parse_workload
    from services.planner.simulator import Simulation, timing_of
    data = yaml.safe_load((WORKLOADS_DIR / "chat-only.yaml").read_text())
    for outputs in ({"dist": "fixed", "value": 1}, {"dist": "fixed", "value": 5}):
        data["classes"]["interactive"]["output_tokens"] = outputs
        spec = parse_workload(data).with_overrides(duration_s=2.0)
        cfg = config("disagg:1:2")
        sim = Simulation(spec, cfg, *timing_of(cfg))
        run = sim.run()
        assert all(r.ok and r.output_tokens == outputs["value"] for r in run.records)
        for w in sim.workers:
            stats = w.engine.stats()
            assert stats.kv_blocks_used == stats.kv_blocks_reserved == stats.num_running == 0, w.worker_id


def test_placement_reads_what_the_engines_own_stats_say_at_every_arrival():
    """The simulation's heartbeat (`worker_stats`) reads the scheduler and the pool directly, not
    through `engine.stats()`: at every arrival of a busy hybrid run (queues, reservations, KV in
    flight), each field placement reads equals the one `stats()` gives."""
    from services.planner.simulator import Simulation, timing_of, worker_stats

    spec = load_workload("mixed").with_overrides(duration_s=4.0, rate_scale=8.0)
    cfg = config("hybrid:1:1:1")
    sim = Simulation(spec, cfg, *timing_of(cfg))
    compared, arrive = [], sim._arrive

    def checked_arrive(planned):
        for w in sim.workers:
            got, s = worker_stats(w.worker_id, w.role, w.engine), w.engine.stats()
            assert (got.kv_blocks_total, got.kv_blocks_free, got.kv_blocks_used,
                    got.kv_blocks_reserved, got.num_running, got.num_queued,
                    got.queued_prefill_tokens) == (
                s.kv_blocks_total, s.kv_blocks_free, s.kv_blocks_used, s.kv_blocks_reserved,
                s.num_running, s.num_queued, s.queued_prefill_tokens), w.worker_id
            assert dict(got.queued_prefill_tokens_ahead) == s.prefill_tokens_ahead
            assert dict(got.prefill_step_tokens_ahead) == s.prefill_step_tokens_ahead
            compared.append(s.num_queued + s.num_running)
        arrive(planned)

    sim._arrive = checked_arrive
    sim.run()
    assert compared and max(compared) > 1            # compared while work was queued and running
