"""The ramp's peak goodput: the best stair, and the sustained peak (the best stair the fleet
entered already saturated, so not the transient of a first loaded stair filling empty seats)."""
from __future__ import annotations

from hypothesis import given, strategies as st

from loadtests.admission_figures import SATURATED, sustained_peak


def stair(offered: float, goodput: float) -> dict:
    return {"offered_rps": offered, "goodput_rps": goodput}


def test_the_first_loaded_stairs_transient_is_not_the_sustained_peak():
    # the co-located ramp: stair 2 fills ~200 empty seats at once (157), then 117-127 a second
    ramp = [stair(42, 42), stair(204, 157), stair(368, 117), stair(525, 117), stair(688, 118),
            stair(842, 127)]
    assert max(s["goodput_rps"] for s in ramp) == 157
    assert sustained_peak(ramp) == 127


def test_a_stair_that_served_all_it_was_offered_does_not_make_the_next_one_sustained():
    ramp = [stair(42, 42), stair(204, 204), stair(368, 219), stair(525, 192)]
    assert sustained_peak(ramp) == 192


def test_no_saturated_stair_no_sustained_peak():
    assert sustained_peak([stair(10, 10), stair(20, 20)]) is None


@given(st.lists(st.tuples(st.floats(1, 1000), st.floats(0, 1)), min_size=1, max_size=8))
def test_the_sustained_peak_is_one_of_the_stairs_and_never_above_the_best(pairs):
    ramp = [stair(o, o * f) for o, f in pairs]
    kept = sustained_peak(ramp)
    best = max(s["goodput_rps"] for s in ramp)
    if kept is None:
        assert all(s["goodput_rps"] >= SATURATED * s["offered_rps"] for s in ramp[:-1])
    else:
        assert kept <= best and kept in [s["goodput_rps"] for s in ramp[1:]]
