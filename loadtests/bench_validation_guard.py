"""The validation guard's errors on captured real runs, old comparison against new
(tests/planner/test_validation.py; docs/benchmarks.md, `s12guard`).

    python -m loadtests.bench_validation_guard capture DIR     # one guard run, kept under DIR
    python -m loadtests.bench_validation_guard table DIR...    # its errors, paired, as a table
    python -m loadtests.bench_validation_guard drift DIR...    # deliberate drifts: does it fail?

`capture` runs what the guard runs (15 s of `chat-only` at x0.5 through one real co-located
fleet, its engine core tracing its steps) and keeps the run and its step trace. `table` replays
each captured run with the comparison the guard made before (the profile and path fitted on the
run, the planned arrivals, the pooled gaps of every ok request) and with the one it makes now
(services/planner/validation.py: `replay_run`, `guard_errors`), and the new one without its
contention replay (send times and refusals only): the same real run on every side, so the
columns differ by the comparison alone. `drift` replays each with a drifted simulator (the
simulated steps x1.15, x1.25, x0.8; the scheduler's chunk 128 or 64 instead of 256) and says
which the 20% bound catches.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from loadtests.records import RunResult
from loadtests.workload import load_workload
from services.engine.config import EngineConfig
from services.planner.validation import (
    RealRun, _saved_real, guard_errors, latencies, real_runs, replay_run, sim_run)

TOLERANCE = 0.20


def spec():
    return load_workload("chat-only").with_overrides(duration_s=15.0, rate_scale=0.5)


def capture(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    load, t = os.getloadavg()[0], time.monotonic()
    [real] = real_runs([spec()], keep_trace=out / "steps")
    real.run.meta["loadavg_start"] = load
    real.run.save(out / "run.json")
    print(f"{out}: load {load:.1f} -> {real.run.meta['loadavg_1m']:.1f}, "
          f"{time.monotonic() - t:.0f} s")


def saved(folder: Path) -> RealRun:
    return _saved_real(RunResult.load(folder / "run.json"), folder / "steps")


def old_errors(real: RealRun) -> tuple[float, float]:
    """The comparison before: every ok request, the pooled gaps, the planned arrivals."""
    got, want = latencies(sim_run(spec(), *real.replay)), latencies(real.run)
    return tuple((got[m]["mean"] - want[m]["mean"]) / want[m]["mean"]
                 for m in ("ttft_s", "itl_s"))


def pct(pair) -> str:
    return " / ".join(f"{e:+.0%}" for e in pair)


def table(folders: list[Path]) -> None:
    print("| run | load 1m (start -> end) | ok real | send lag mean / max (ms) | tokens merged "
          "| real TTFT / gap per token (ms) | old guard TTFT / ITL | new, no contention "
          "| new guard |\n|---|---|---:|---|---:|---|---|---|---|")
    for folder in folders:
        real = saved(folder)
        run = real.run
        ok = [r for r in run.records if r.ok]
        lag = [r.send_s - r.scheduled_s for r in run.records if r.send_s is not None]
        merged = (sum(r.output_tokens - 1 - len(r.itl_s) for r in ok)
                  / max(1, sum(r.output_tokens - 1 for r in ok)))
        bare = guard_errors(run, replay_run(spec(), replace(real, contention=None)))
        new = guard_errors(run, replay_run(spec(), real))
        print(f"| {folder.name} | {run.meta.get('loadavg_start', float('nan')):.1f} -> "
              f"{run.meta['loadavg_1m']:.1f} | {len(ok)}/{len(run.records)} "
              f"| {np.mean(lag) * 1e3:.0f} / {max(lag) * 1e3:.0f} | {merged:.1%} "
              f"| {new['ttft_s'][0] * 1e3:.0f} / {new['itl_s'][0] * 1e3:.1f} "
              f"| {pct(old_errors(real))} | {pct(v[2] for v in bare.values())} "
              f"| **{pct(v[2] for v in new.values())}** |", flush=True)


DRIFTS = {"steps x1.15": 1.15, "steps x1.25": 1.25, "steps x0.8": 0.8,
          "chunk 128": 128, "chunk 64": 64}


def drift(folders: list[Path]) -> None:
    from services.engine.sim_engine import SimExecutor  # noqa: PLC0415
    step_s, base = SimExecutor.step_s, EngineConfig()
    print("| run | " + " | ".join(["none", *DRIFTS]) + " |\n|---|" + "---|" * (len(DRIFTS) + 1))
    for folder in folders:
        real, cells = saved(folder), []
        for name, k in {"none": None, **DRIFTS}.items():
            engine = None
            if name.startswith("steps"):
                SimExecutor.step_s = lambda self, plan, m, k=k: step_s(self, plan, m) * k
            elif k is not None:
                engine = replace(base, scheduler=replace(base.scheduler, chunk_size=k))
            try:
                sim = replay_run(spec(), real, engine)
                e = [v[2] for v in guard_errors(real.run, sim).values()]
            finally:
                SimExecutor.step_s = step_s
            fails = max(abs(v) for v in e) > TOLERANCE
            cells.append(pct(e) + (" **fails**" if fails else ""))
        print(f"| {folder.name} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_validation_guard",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("capture", "table", "drift"))
    p.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.what == "capture":
        for folder in args.folders:
            capture(folder)
    else:
        (table if args.what == "table" else drift)(args.folders)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
