"""The simulator against the real fleet on this machine, briefly: a guard against drift between
the simulated and the real fleet (docs/capacity.md, "Validation", has the full table).

One real co-located fleet (`kvfleet up`, the tiny model, the load tester's own), its engine core
tracing every step, serves 15 s of seeded chat traffic. A step profile and the fleet's overhead
(the request's path to its first token) are fitted on that run, and `kvfleet sim run` replays the
same seeded workload with them: the simulated mean TTFT and mean inter-token gap (over the requests
each side served) are within 20% of the real ones. Fitted on the run itself, the comparison holds on a loaded machine (the contention
of that minute is in the fit); what it guards is the rest: the simulated scheduler, block pool,
step shapes and delivery against the real fleet's.
"""
from __future__ import annotations

from loadtests.workload import load_workload
from services.planner.validation import latencies, real_runs, sim_run

TOLERANCE = 0.20


def test_the_simulator_replays_a_real_fleets_run_within_twenty_percent():
    spec = load_workload("chat-only").with_overrides(duration_s=15.0, rate_scale=0.5)
    [real] = real_runs([spec])
    assert real.replay is not None, "the fleet's engine core traced no steps"
    sim = sim_run(spec, *real.replay)
    # on a loaded box the real router refuses a few late chats, the simulated scheduler a few
    # (the simulation has no router admission): both must serve nearly all
    for run in (real.run, sim):
        served = sum(r.ok for r in run.records)
        assert served >= 0.8 * len(run.records), f"{served} of {len(run.records)} served"
    got, want = latencies(sim), latencies(real.run)
    for metric in ("ttft_s", "itl_s"):
        error = (got[metric]["mean"] - want[metric]["mean"]) / want[metric]["mean"]
        assert abs(error) <= TOLERANCE, (
            f"simulated mean {metric} {got[metric]['mean']:.4f}s vs real "
            f"{want[metric]['mean']:.4f}s ({error:+.0%}; load average "
            f"{real.run.meta['loadavg_1m']:.1f})")
