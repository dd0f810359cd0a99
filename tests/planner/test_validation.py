"""The simulator against the real fleet on this machine, briefly: a guard against drift between
the simulated and the real fleet (docs/capacity.md, "Validation", has the full table).

One real co-located fleet (`kvfleet up`, the tiny model, the load tester's own), its engine core
tracing every step, serves 15 s of seeded chat traffic. A step profile and the fleet's overhead
(the request's path to its first token) are fitted on that run, and the simulator replays it
(services/planner/validation.py, `replay_run`): the same requests at the moments the load
generator really sent them (those the real fleet refused before a token left out), each simulated
step lasting the profile's time for its own shape times how much slower than the profile the real
steps ran at that moment. Over the requests both sides served, the simulated mean TTFT and mean
gap per token are within 20% of the real ones.

What a loaded box changes (the moments, the contention) is taken from the real run; what the
guard compares is the simulator's own: the scheduler's queueing and chunking, the block pool, the
step shapes and the delivery of tokens.
"""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from loadtests.workload import load_workload
from services.planner.validation import Contention, guard_errors, real_runs, replay_run

TOLERANCE = 0.20


def test_the_simulator_replays_a_real_fleets_run_within_twenty_percent():
    spec = load_workload("chat-only").with_overrides(duration_s=15.0, rate_scale=0.5)
    [real] = real_runs([spec])
    assert real.replay is not None, "the fleet's engine core traced no steps"
    sim = replay_run(spec, real)
    # on a loaded box the real router refuses a few late chats (the replay does not send
    # those), and the simulated scheduler might refuse what it was sent: both serve nearly all
    for run in (real.run, sim):
        served = sum(r.ok for r in run.records)
        assert served >= 0.8 * len(run.records), f"{served} of {len(run.records)} served"
    load = real.run.meta["loadavg_1m"]
    for metric, (want, got, error) in guard_errors(real.run, sim).items():
        assert abs(error) <= TOLERANCE, (
            f"simulated mean {metric} {got:.4f}s vs real {want:.4f}s ({error:+.0%}; load "
            f"average {load:.1f})")


@given(st.lists(st.tuples(st.floats(0, 20), st.floats(1e-4, 1.0)), min_size=1, max_size=60),
       st.floats(0.1, 10), st.floats(0.5, 4), st.floats(-5, 25))
def test_steps_that_all_ran_k_times_their_fit_slow_every_simulated_moment_k_times(
        steps, k, burst, t):
    steps.sort()
    calm = Contention(starts_s=tuple(s for s, _ in steps),
                      measured_s=tuple(k * f for _, f in steps),
                      fitted_s=tuple(f for _, f in steps))
    assert math.isclose(calm.factor(t), k, rel_tol=1e-9)
    # a burst: the steps of the run's second half ran `burst` times slower still; a moment there,
    # a window away from the first half, reads it
    half = len(steps) // 2
    bursty = Contention(starts_s=calm.starts_s, fitted_s=calm.fitted_s, measured_s=tuple(
        m * (burst if i >= half else 1.0) for i, m in enumerate(calm.measured_s)))
    last = steps[-1][0]
    if half and last - steps[half - 1][0] > bursty.window_s / 2:
        assert math.isclose(bursty.factor(last), k * burst, rel_tol=1e-9)
