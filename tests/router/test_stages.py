"""The overload stage machine under scripted signals: stages are entered in order, one step per
decision, never twice within a dwell, and left only below the (lower) leave thresholds."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from services.router.stages import S0, S1, S2, S3, S4, Signals, StageConfig, StageMachine


def run(machine: StageMachine, script: list[tuple[float, Signals]], stage: int = S0):
    """Feed (time, signals) in order; returns [(time, stage)] after every decision."""
    since, timeline = float("-inf"), []
    for now, signals in script:
        d = machine.decide(stage, since, signals, now)
        if d.changed:
            stage, since = d.stage, now
        timeline.append((now, stage))
    return timeline


def test_a_rising_load_climbs_the_stages_in_order_one_per_dwell():
    machine = StageMachine(StageConfig(min_dwell_s=5.0))
    full = Signals(kv_reserved=0.99)            # past every enter threshold at once
    timeline = run(machine, [(t, full) for t in range(0, 40)])
    changes = [(t, s) for (t, s), (_, prev) in zip(timeline, [(None, S0)] + timeline) if s != prev]
    assert [s for _, s in changes] == [S1, S2, S3, S4]
    assert [t for t, _ in changes] == [0, 5, 10, 15]


def test_between_leave_and_enter_the_stage_holds():
    machine = StageMachine(StageConfig(min_dwell_s=1.0))
    timeline = run(machine, [(0, Signals(kv_reserved=0.85))])   # enters S1 (0.80)
    assert timeline[-1][1] == S1
    # 0.75 is below S1's enter (0.80) but above its leave (0.70): S1 holds for as long as it lasts
    timeline = run(machine, [(t, Signals(kv_reserved=0.75)) for t in range(2, 30)], stage=S1)
    assert {s for _, s in timeline} == {S1}
    timeline = run(machine, [(31, Signals(kv_reserved=0.69))], stage=S1)
    assert timeline[-1][1] == S0


def test_any_signal_enters_but_every_signal_must_fall_to_leave():
    machine = StageMachine(StageConfig(min_dwell_s=0.0))
    d = machine.decide(S0, 0.0, Signals(error_rate=0.06), 1.0)
    assert (d.stage, d.changed) == (S1, True) and "error_rate" in d.why
    d = machine.decide(S1, 1.0, Signals(error_rate=0.01, queue_age=0.4), 2.0)
    assert (d.stage, d.changed) == (S1, False) and "queue_age" in d.why
    d = machine.decide(S1, 1.0, Signals(error_rate=0.01, queue_age=0.1), 3.0)
    assert (d.stage, d.changed) == (S0, True)


def test_a_noisy_signal_at_the_threshold_does_not_flap():
    machine = StageMachine(StageConfig(min_dwell_s=5.0))
    noisy = [(t * 0.5, Signals(ttft_pressure=0.81 if t % 2 else 0.79)) for t in range(100)]
    stages = [s for _, s in run(machine, noisy)]
    # entered at the first 0.81 and never left: 0.79 is still above S1's leave threshold (0.6)
    assert stages[0] == S0 and set(stages[1:]) == {S1}


def test_thresholds_that_would_flap_are_refused():
    enter = StageConfig().enter
    with pytest.raises(ValueError, match="leave threshold"):
        StageConfig(leave=enter)


signals = st.builds(Signals, *(st.floats(0, 3) for _ in range(4)))


@given(st.lists(st.tuples(st.floats(0.01, 10), signals), min_size=1, max_size=60),
       st.floats(0, 5))
def test_any_script_moves_one_step_at_a_time_and_at_most_once_per_dwell(script, dwell):
    machine = StageMachine(StageConfig(min_dwell_s=dwell))
    now, timed = 0.0, []
    for dt, s in script:
        now += dt
        timed.append((now, s))
    timeline = run(machine, timed)
    last_change, prev = None, S0
    for t, stage in timeline:
        assert abs(stage - prev) <= 1 and S0 <= stage <= S4
        if stage != prev:
            assert last_change is None or t - last_change >= dwell
            last_change = t
        prev = stage


def test_s2_and_s3_names_match_the_wire_enum():
    from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
    from services.router.stages import STAGE_NAMES
    assert [pb.OverloadStage.Value(n) for n in STAGE_NAMES] == [S0, S1, S2, S3, S4]
