"""`python -m loadtests.evaluation` (docs/evaluation.md): the knee finder on curves whose knee is
known, the sweep that brackets and refines it, and the command's discrete-event part at a tiny
size writing its points, its document and its plots; bad arguments are clear errors."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.knee import KneeRule, Sweep, find_knee, rates_around


@dataclass(frozen=True)
class Synthetic:
    rate_scale: float
    offered_rps: float
    goodput_rps: float
    attainment: float


def saturating(capacity: float):
    """A fleet that serves everything up to `capacity` req/s and nothing more: goodput is
    min(offered, capacity), attainment goodput / offered."""
    def measure(rate: float) -> Synthetic:
        good = min(rate, capacity)
        return Synthetic(rate, rate, good, good / rate)
    return measure


def test_the_knee_is_the_last_point_before_attainment_falls_under_90_percent():
    ps = [Synthetic(r, r, r * a, a) for r, a in ((1, 1.0), (2, 0.99), (4, 0.93), (8, 0.7))]
    knee = find_knee(ps)
    assert knee.point.rate_scale == 4 and knee.reason == "attainment" and knee.found


def test_the_knee_is_where_goodput_stops_following_the_load():
    # every point meets 90%, but from x4 to x8 goodput grows by 10% while the offered load doubles
    ps = [Synthetic(1, 10, 10, 1.0), Synthetic(2, 20, 20, 1.0), Synthetic(4, 40, 39, 0.98),
          Synthetic(8, 80, 43, 0.95)]
    knee = find_knee(ps)
    assert knee.point.rate_scale == 4 and knee.reason == "goodput flat"


def test_no_knee_below_the_lowest_rate_and_none_reached_when_all_grow():
    assert find_knee([Synthetic(1, 1, 0.5, 0.5)]).point is None
    grows = [Synthetic(r, r, r, 1.0) for r in (1, 2, 4)]
    knee = find_knee(grows)
    assert knee.point.rate_scale == 4 and not knee.found and knee.reason == "not reached"


def test_the_sweep_doubles_past_a_known_knee_then_refines_it():
    measured = []

    def measure(rate):
        measured.append(rate)
        return saturating(10.0)(rate)
    points = Sweep(start=1, past=1, refine=2).run(measure)
    # doubling until a point lies past the knee (x16 meets 62%), then the middles: x11.3 meets
    # 88% (past it), x9.5 meets all (the knee)
    assert measured == [1, 2, 4, 8, 16, 11.3137, 9.5137]
    assert [p.rate_scale for p in points] == sorted(measured)
    assert find_knee(points).point.rate_scale == 9.5137


@settings(max_examples=60, deadline=None)
@given(capacity=st.floats(min_value=0.1, max_value=100.0), refine=st.integers(0, 3))
def test_the_found_knee_brackets_the_capacity_to_the_sweeps_resolution(capacity, refine):
    points = Sweep(start=1, max_rate=1024, past=1, refine=refine).run(saturating(capacity))
    knee = find_knee(points)
    assert knee.found and knee.point.attainment >= 0.9
    after = min(p.rate_scale for p in points if p.rate_scale > knee.point.rate_scale)
    assert after / knee.point.rate_scale <= 2 ** (1 / 2 ** refine) * (1 + 1e-3)
    assert knee.point.rate_scale <= capacity / 0.9 * (1 + 1e-6)      # within its SLOs
    assert after > capacity * (1 - 1e-6)                             # the next one is past it


def test_a_start_that_already_misses_the_slos_sweeps_down_to_a_rate_that_meets_them():
    measured = []

    def measure(rate):
        measured.append(rate)
        return saturating(0.3)(rate)
    points = Sweep(start=1, past=1, refine=0).run(measure)
    assert measured == [1, 0.5, 0.25]          # 0.25 meets all of them; 0.5 is past the knee
    assert find_knee(points).point.rate_scale == 0.25


def test_bad_rules_and_sweeps_are_refused():
    for bad in (dict(attainment=0), dict(min_growth=2)):
        try:
            KneeRule(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
    for bad in (dict(start=0), dict(factor=1), dict(past=0), dict(refine=-1),
                dict(start=1, min_rate=2)):
        try:
            Sweep(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
    assert rates_around(8, (0.5, 1, 2)) == [4, 8, 16]


def evaluation(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtests.evaluation", *args],
                          capture_output=True, text=True, timeout=600)


def test_the_des_part_at_a_tiny_size_writes_its_points_document_and_plots(tmp_path):
    args = ("--parts", "des", "--des-workloads", "chat-only",
            "--des-setups", "colocated:2,disagg:1:1", "--des-duration", "2",
            "--sim-kv-tokens", "200000", "--des-start", "1", "--des-max-rate", "4",
            "--refine", "0", "--cache", str(tmp_path / "sweeps"), "--out", str(tmp_path))
    done = evaluation(*args)
    assert done.returncode == 0, done.stderr
    assert {f.name for f in (tmp_path / "sweeps").iterdir()} == {
        "chat-only--colocated-2.json", "chat-only--disagg-1-1.json"}
    saved = json.loads((tmp_path / "evaluation" / "des.json").read_text())
    assert {"command", "commit", "date_utc", "wall_s", "loadavg_1m"} <= saved["meta"].keys()
    by_setup = saved["results"]["chat-only"]
    assert set(by_setup) == {"colocated:2", "disagg:1:1"}
    for points in by_setup.values():
        rates = [p["rate_scale"] for p in points]
        assert rates == sorted(rates) and rates[0] == 1 and max(rates) <= 4
        for p in points:
            assert {"offered_rps", "goodput_rps", "attainment", "refusals", "classes",
                    "transfer"} <= p.keys()
            assert "interactive" in p["classes"]
    assert all(p["transfer"]["moved"] > 0 for p in by_setup["disagg:1:1"])
    assert all(p["transfer"]["moved"] == 0 for p in by_setup["colocated:2"])
    doc = (tmp_path / "evaluation.md").read_text()
    assert "## 1. Discrete-event simulator" in doc and "### Goodput at the knee" in doc
    assert "| chat-only | colocated:2 | 8 |" in doc and "| chat-only | disagg:1:1 | 8 |" in doc
    assert "emulated: not run yet" in doc and "cpu: not run yet" in doc
    assert (tmp_path / "evaluation" / "des-chat-only.png").stat().st_size > 0
    again = evaluation("--render-only", "--out", str(tmp_path))    # the page from the JSON alone
    assert again.returncode == 0 and (tmp_path / "evaluation.md").read_text() == doc
    assert "reused from `--cache`" not in doc
    rerun = evaluation(*args)          # every sweep from the cache: the page says so, and where
    assert rerun.returncode == 0, rerun.stderr
    made = json.loads((tmp_path / "sweeps" / "chat-only--disagg-1-1.json").read_text())["commit"]
    assert f"chat-only disagg:1:1 (`{made}`)" in (tmp_path / "evaluation.md").read_text()


def test_bad_arguments_are_clear_errors(tmp_path):
    for args, says in ((["--parts", "nope"], "--parts"),
                       (["--des-setups", "colocated:4,disagg:1:1"], "worker count"),
                       (["--des-workloads", "no-such-workload"], "no-such-workload"),
                       (["--des-setups", "colocated:x"], "colocated:N")):
        done = evaluation(*args, "--parts", args[1] if args[0] == "--parts" else "des",
                          "--out", str(tmp_path))
        assert done.returncode == 2, (args, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "evaluation.md").exists()
