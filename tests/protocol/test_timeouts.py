"""A decode reservation's lifetime follows its class (Timeouts.reservation_for), bounded both ways,
and the flags that carry it to a child rebuild the same config."""
from __future__ import annotations

import argparse

from hypothesis import given, strategies as st

from services.protocol.timeouts import Timeouts, add_args, from_args


@given(target=st.one_of(st.none(), st.floats(0.0, 1e4)),
       base=st.floats(1.5, 60.0), per=st.floats(0.0, 10.0), cap=st.floats(60.0, 600.0))
def test_a_reservation_lives_at_least_its_base_and_at_most_its_cap(target, base, per, cap):
    t = Timeouts(reservation_s=base, reservation_per_target=per, reservation_max_s=cap).check()
    assert base <= t.reservation_for(target) <= cap


def test_a_document_waits_longer_than_a_chat_and_an_unknown_class_gets_the_base():
    t = Timeouts()
    assert t.reservation_for(None) == t.reservation_s
    assert t.reservation_for(1.0) < t.reservation_for(10.0) <= t.reservation_max_s


def test_a_cap_below_the_base_is_refused_by_name():
    problems = Timeouts(reservation_s=30.0, reservation_max_s=10.0).problems()
    assert any("reservation_max_s" in p for p in problems)
    assert any("reservation_per_target" in p for p in Timeouts(reservation_per_target=-1).problems())


def test_the_factor_travels_to_a_child_as_its_own_flag():
    t = Timeouts(reservation_per_target=2.5, reservation_max_s=90.0)
    p = argparse.ArgumentParser()
    add_args(p)
    args = t.as_args()
    assert "--timeout-reservation-per-target" in args
    assert from_args(p.parse_args(args)) == t
