"""`kvfleet sim study`: setups of equal worker count swept over rates on the simulator; the knee is
the highest rate that still met the SLO attainment; the table and the plot are written; bad
arguments are clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

from services.planner.study import Fleet, Point, knee, setups


def at(rate: float, attainment: float) -> Point:
    return Point("colocated:2", 400.0, rate, rate, rate * attainment, attainment, 0.1, 0.01, 0)


def test_the_knee_is_the_highest_rate_still_within_the_slos():
    points = [at(1, 1.0), at(2, 0.97), at(4, 0.91), at(8, 0.6)]
    assert knee(points).rate_scale == 4
    assert knee([at(1, 0.5)]) is None


def test_every_setup_has_the_same_workers():
    for replicas in (2, 3, 4, 6):
        fleets = setups(replicas)
        assert fleets[0] == f"colocated:{replicas}"
        assert all(len(Fleet.parse(f).roles()) == replicas for f in fleets)
    assert any(f.startswith("hybrid:") for f in setups(4))


def kvfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "sim", "study", *args],
                          capture_output=True, text=True, timeout=600)


def test_a_small_study_writes_its_table_and_plot(tmp_path):
    done = kvfleet("--workload", "chat-only", "--replicas", "2", "--rates", "1,2", "--gbps", "400",
                   "--duration", "1", "--sim-kv-tokens", "200000", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    study = json.loads((tmp_path / "study.json").read_text())
    assert {k["setup"] for k in study["knees"]} == {"colocated:2", "disagg:1:1"}
    assert all(k["gpus"] == 8 for k in study["knees"])           # 2 replicas of TP 4
    assert len(study["points"]) == 4
    assert (tmp_path / "goodput.png").stat().st_size > 0


def test_bad_arguments_are_clear_errors(tmp_path):
    done = kvfleet("--workload", "chat-only", "--replicas", "1", "--out", str(tmp_path))
    assert done.returncode == 2 and "--replicas must be >= 2" in done.stderr
    assert "Traceback" not in done.stderr
