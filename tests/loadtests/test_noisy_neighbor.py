"""The noisy-neighbor benchmark's script (loadtests/noisy_neighbor.py) on the discrete-event
simulator: at the workload's own rate (well inside one 70B replica) the quiet tenants fare as
well beside the flood as alone, and the script says so, writing the figures it printed."""
from __future__ import annotations

import json

import pytest

from loadtests import noisy_neighbor


def test_at_a_rate_the_fleet_carries_the_quiet_tenants_meet_the_goal(tmp_path, capsys):
    out = tmp_path / "nn"
    assert noisy_neighbor.main(["--des", "--rate-scale", "1", "--out", str(out)]) == 0
    figures = json.loads((out / "figures.json").read_text())
    assert sorted(figures["quiet"]) == ["quiet-a", "quiet-b", "quiet-c"]
    assert sorted(figures["others"]) == ["flood"]
    for tenant in figures["quiet"].values():
        assert tenant["solo"]["requests"] == tenant["beside"]["requests"] > 0  # same seed, rates
        assert tenant["ratio"] >= noisy_neighbor.GOAL_RATIO
    assert figures["goal_ratio_met"] and figures["goal_jain_met"]
    printed = capsys.readouterr().out
    assert "| quiet-a |" in printed and "of solo: met" in printed

    # the same figures again from the two reports alone
    assert noisy_neighbor.main(["--figures", str(out / "noisy"), str(out / "solo")]) == 0
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("item", ["flood", "flood=0", "=3", "flood=x"])
def test_a_bad_stream_limit_is_refused_naming_it_before_anything_runs(item, tmp_path, capsys):
    out = tmp_path / "never"
    assert noisy_neighbor.main(["--emulated", "--stream-limit", item, "--out", str(out)]) == 2
    assert "--stream-limit wants TENANT=N" in capsys.readouterr().err
    assert not out.exists()


def test_missing_reports_are_a_clear_error(tmp_path, capsys):
    assert noisy_neighbor.main(["--figures", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "noisy_neighbor:" in capsys.readouterr().err
