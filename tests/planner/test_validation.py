"""The simulator against the real fleet on this machine, briefly: a guard against drift between
the simulated and the real engine (docs/capacity.md, "Validation", has the full table).

Calibrated here (`kvfleet sim calibrate --quick`), the same seeded 20 s of chat traffic through a
real co-located fleet (`kvfleet up`, the tiny model) and through `kvfleet sim run` with that
profile: the simulated mean TTFT is within 20% of the real one."""
from __future__ import annotations

import os

import pytest

from services.planner.calibrate import CalibrateConfig, calibrate
from services.planner.validation import compare

TOLERANCE = 0.20


@pytest.mark.xfail(strict=False, reason=(
    "known miss: the profile times the engine alone, not the fleet's own costs (gateway, router, "
    "gRPC hops); a clean-clone make test on a quiet box measured the simulation 32% fast "
    "(docs/capacity.md, Validation). Reported as XPASS once the simulator models them."))
def test_simulated_mean_ttft_is_within_twenty_percent_of_the_real_fleet(tmp_path):
    # On an oversubscribed machine the engine's step time moves by several times within seconds
    # (docs/capacity.md, "Validation": this comparison measured +29% with a quick profile and -35%
    # with a full one, under load averages of 11-15 on 2 cores): it says nothing about drift there.
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        pytest.skip(f"load average {load:.1f} on {cores} cores: the machine is oversubscribed")
    # measured with the threads kvfleet up gives its one worker here (the cores less one)
    threads = max(1, (os.cpu_count() or 1) - 1)
    profile = calibrate(CalibrateConfig(model="tiny", quick=True, threads=threads))
    profile.save(tmp_path / "profile.json")
    [result] = compare("chat-only", [0.5], duration_s=20.0, profile=str(tmp_path / "profile.json"),
                       out=tmp_path)
    assert result.real_ok == result.requests and result.sim_ok == result.requests
    error = result.error("ttft_s", "mean")
    assert error is not None and abs(error) <= TOLERANCE, (
        f"simulated mean TTFT {result.sim['ttft_s']['mean']:.4f}s vs real "
        f"{result.real['ttft_s']['mean']:.4f}s ({error:+.0%}; load average {result.loadavg_1m:.1f})")
