"""Which path serves a request: a co-located or disaggregated fleet always its own; a hybrid fleet
by prompt length (at most the threshold: co-located), and the other path when the preferred one has
lost a role; a fleet is serving while some path is whole."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.planner.capacity import CostModel
from services.planner.hybrid import threshold_tokens
from services.router.paths import PATH_ROLES, Paths

ALL = {"mixed", "prefill", "decode"}


def test_a_hybrid_fleet_splits_by_prompt_length():
    paths = Paths("hybrid", threshold_tokens=2048)
    assert paths.path(200, ALL) == "colocated"
    assert paths.path(2048, ALL) == "colocated"
    assert paths.path(2049, ALL) == "disagg"
    assert paths.path(32_000, ALL) == "disagg"


def test_a_hybrid_fleet_that_lost_a_path_serves_everything_on_the_other():
    paths = Paths("hybrid", threshold_tokens=2048)
    assert paths.path(200, {"prefill", "decode"}) == "disagg"
    assert paths.path(32_000, {"mixed"}) == "colocated"
    assert paths.serving({"mixed"}) and paths.serving({"prefill", "decode"})
    assert not paths.serving({"prefill"}) and not paths.serving(set())


@given(mode=st.sampled_from(["disagg", "colocated"]), prompt=st.integers(0, 1 << 20),
       roles=st.sets(st.sampled_from(sorted(ALL))))
def test_a_single_path_fleet_always_takes_its_own(mode, prompt, roles):
    paths = Paths(mode)
    assert paths.path(prompt, roles) == mode
    assert paths.serving(roles) == (PATH_ROLES[mode] <= roles)


@given(threshold=st.integers(1, 1 << 16), prompt=st.integers(0, 1 << 17))
def test_with_every_role_live_the_threshold_alone_decides(threshold, prompt):
    path = Paths("hybrid", threshold).path(prompt, ALL)
    assert path == ("colocated" if prompt <= threshold else "disagg")


def test_bad_settings_are_refused_with_the_limits():
    with pytest.raises(ValueError, match="mode must be one of"):
        Paths("sideways")
    with pytest.raises(ValueError, match="at least 1 token"):
        Paths("hybrid", 0)


def test_the_capacity_model_puts_the_split_where_a_prefill_takes_one_itl_target():
    cost = CostModel.for_target(model="llama-3-70b", gpu="h200", tp=4, dtype="fp8")
    split = threshold_tokens(cost, itl_target_s=0.1)
    assert cost.prefill_s(split) <= 0.1 < cost.prefill_s(split + 1)
    assert 200 < split < 32_000          # chats co-located, 32K documents disaggregated
    slower = CostModel.for_target(model="llama-3-70b", gpu="h100", tp=2, dtype="fp8")
    assert threshold_tokens(slower, 0.1) < split


def test_a_hybrid_fleets_short_prompt_may_take_either_path_a_long_one_only_its_own():
    paths = Paths("hybrid", threshold_tokens=2048)
    assert paths.options(200, ALL) == ("colocated", "disagg")
    assert paths.options(32_000, ALL) == ("disagg",)
    assert paths.options(200, {"mixed", "decode"}) == ("colocated",)   # no whole disagg path
    assert Paths("colocated").options(200, ALL) == ("colocated",)
