"""The admission benchmark's figures from `kvfleet sim run` reports (docs/benchmarks.md,
"Admission on the 70B simulation"):

    python -m loadtests.admission_figures ramp ON_DIR OFF_DIR [--stairs 6]
    python -m loadtests.admission_figures tenants RUN_DIR SOLO_DIR TENANT [TENANT ...]

`ramp`: per stair of the ramp, offered load, goodput (requests sent in the stair that met their
SLO, per second) and offered / peak goodput; the stage timeline (in order, one change per dwell);
admitted interactive ITL p99; and "would it have met": the router's refusals with admission on
against the requests that missed their SLO with it off, and the SLO attainment of what it admitted.
`tenants`: each named tenant's SLO attainment against its solo run, and Jain's index.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadtests.metrics import meets_slo, percentile
from loadtests.records import ClassSLO, RunResult


def load(folder: str) -> tuple[RunResult, dict]:
    d = Path(folder)
    return RunResult.load(d / "run.json"), json.loads((d / "summary.json").read_text())


def _slo(run: RunResult, r) -> ClassSLO:
    return run.classes.get(r.traffic_class, ClassSLO(r.traffic_class, None, None))


def stairs(run: RunResult, n: int) -> list[dict]:
    """Offered and goodput (req/s) of each of `n` equal stairs of the planned duration."""
    span = run.meta["planned_duration_s"] / n
    out = []
    for k in range(n):
        sent = [r for r in run.records if k * span <= r.scheduled_s < (k + 1) * span]
        met = sum(meets_slo(r, _slo(run, r)) for r in sent)
        out.append({"stair": k + 1, "offered_rps": len(sent) / span, "goodput_rps": met / span})
    return out


SATURATED = 0.95      # a stair served less than this share of what it was offered


def sustained_peak(st: list[dict]) -> float | None:
    """The best goodput of a stair that began saturated: the stair before it already served less
    than SATURATED of its offered load, so the fleet entered it with its batch full and its
    goodput is a rate it keeps. The best stair overall may instead be the first loaded one, which
    starts with empty seats and fills them at once (a transient). None when no stair qualifies."""
    after = [b["goodput_rps"] for a, b in zip(st, st[1:])
             if a["goodput_rps"] < SATURATED * a["offered_rps"]]
    return max(after, default=None)


def refused_by_router(run: RunResult) -> set[int]:
    """Indices the router refused (an engine's late refusal is not among them)."""
    return set(run.meta.get("router_refused", []))


def ramp(on_dir: str, off_dir: str, n: int) -> str:
    lines = []
    runs = {"on": load(on_dir), "off": load(off_dir)}
    peak = {k: max(s["goodput_rps"] for s in stairs(run, n)) for k, (run, _) in runs.items()}
    capacity = max(peak.values())
    lines += [f"capacity (peak stair goodput, on or off): {capacity:.0f} req/s", "",
              "| stair | offered (req/s) | x capacity | goodput on | goodput off |",
              "|---:|---:|---:|---:|---:|"]
    on_st, off_st = stairs(runs["on"][0], n), stairs(runs["off"][0], n)
    for a, b in zip(on_st, off_st):
        lines.append(f"| {a['stair']} | {a['offered_rps']:.0f} | {a['offered_rps'] / capacity:.1f} "
                     f"| {a['goodput_rps']:.0f} | {b['goodput_rps']:.0f} |")
    hot = [(a, b) for a, b in zip(on_st, off_st) if a["offered_rps"] / capacity >= 3.0]
    for name, i, st in (("on", 0, on_st), ("off", 1, off_st)):
        if hot:
            g = min(h[i]["goodput_rps"] for h in hot)
            kept = sustained_peak(st)
            steady = (f", {g / kept:.0%} of its sustained peak {kept:.0f} (best stair entered "
                      f"saturated)") if kept else ""
            lines.append(f"- admission {name}: goodput at >= 3x {g:.0f} req/s = "
                         f"{g / peak[name]:.0%} of its peak {peak[name]:.0f}{steady}")
    run_on, sum_on = runs["on"]
    timeline = sum_on.get("stage_timeline", [])
    steps = [abs(b["stage"] - a["stage"]) for a, b in zip(timeline, timeline[1:])]
    gaps = [b["t_s"] - a["t_s"] for a, b in zip(timeline, timeline[1:])]
    lines += ["- stages: " + " -> ".join(f"{e['name']}@{e['t_s']:.1f}s" for e in timeline),
              f"  one step at a time: {all(s == 1 for s in steps)}; shortest dwell between "
              f"changes {min(gaps, default=float('nan')):.1f} s"]
    lines.append(f"- rejections by stage: {sum_on.get('rejections_by_stage')}")
    for name, (run, _) in runs.items():
        itl = [g for r in run.records if r.ok and r.traffic_class == "interactive" for g in r.itl_s]
        p99 = percentile(itl, 99)
        lines.append(f"- admission {name}: admitted interactive ITL p99 "
                     f"{p99 * 1000:.1f} ms" if p99 is not None else f"- {name}: no ITL")
    by_router = refused_by_router(run_on)
    refused = len(by_router)
    late = sum(r.status == 429 and r.index not in by_router for r in run_on.records)
    admitted = [r for r in run_on.records if r.index not in by_router]
    met_on = sum(meets_slo(r, _slo(run_on, r)) for r in admitted)
    run_off = runs["off"][0]
    missed_off = sum(not meets_slo(r, _slo(run_off, r)) for r in run_off.records)
    served_off = [r for r in run_off.records if not (r.status == 429 and r.ttft_s is None)]
    met_off = sum(meets_slo(r, _slo(run_off, r)) for r in served_off)
    lines += [f"- would it have met: refused by the router {refused} (and {late} late by an "
              f"engine) vs missed their SLO with admission off {missed_off} "
              f"(of {len(run_off.records)}; {len(run_off.records) - len(served_off)} of them "
              f"refused before a token with admission off)",
              f"- admitted SLO attainment {met_on / max(1, len(admitted)):.1%} "
              f"({met_on} of {len(admitted)}); with admission off, of those not refused "
              f"{met_off / max(1, len(served_off)):.1%} ({met_off} of {len(served_off)})"]
    lines.append(waited_and_missed(run_on, by_router))
    return "\n".join(lines)


def waited_and_missed(run: RunResult, by_router: set[int]) -> str:
    """Admitted requests that waited in the router's queue, and how many of them then missed
    their TTFT target (the router compares its prediction from the moment it admits with the
    whole target, not with what is left of it)."""
    if not any(r.timing and "router_wait_s" in r.timing for r in run.records):
        return "- admitted after waiting: not recorded in this run"
    waited = [r for r in run.records if r.index not in by_router and r.timing
              and r.timing.get("predicted_ttft_s") is not None and r.ok
              and r.timing["predicted_ttft_s"] > 0 and _queued(r)]
    slo = {r.index: _slo(run, r) for r in waited}
    missed = sum(slo[r.index].ttft_s is not None and r.ttft_s > slo[r.index].ttft_s
                 for r in waited)
    return f"- admitted after waiting in the router's queue: {len(waited)}, of which {missed} " \
           f"missed their TTFT target"


def _queued(r) -> bool:
    return r.timing.get("router_wait_s", 0.0) > 0


def tenants(run_dir: str, solo_dir: str, names: list[str]) -> str:
    run, summary = load(run_dir)
    solo, _ = load(solo_dir)

    def attainment(r_: RunResult, tenant: str) -> float:
        mine = [r for r in r_.records if r.tenant == tenant]
        return sum(meets_slo(r, _slo(r_, r)) for r in mine) / max(1, len(mine))

    def ttft_ms(r_: RunResult, tenant: str) -> str:
        got = [r.ttft_s for r in r_.records if r.tenant == tenant and r.ok]
        if not got:
            return "-"
        return f"{percentile(got, 50) * 1000:.0f} / {percentile(got, 99) * 1000:.0f}"

    lines = ["| tenant | SLO attainment | solo | ratio | TTFT p50 / p99 (ms) | solo |",
             "|---|---:|---:|---:|---:|---:|"]
    for t in names:
        a, b = attainment(run, t), attainment(solo, t)
        lines.append(f"| {t} | {a:.1%} | {b:.1%} | {a / b if b else float('nan'):.2f} "
                     f"| {ttft_ms(run, t)} | {ttft_ms(solo, t)} |")
    lines.append(f"Jain's index {summary['jain_index']:.3f} (output tokens served against each "
                 f"tenant's weighted max-min fair share of them); "
                 f"rejections by stage {summary.get('rejections_by_stage')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.admission_figures")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("ramp")
    r.add_argument("on")
    r.add_argument("off")
    r.add_argument("--stairs", type=int, default=6)
    t = sub.add_parser("tenants")
    t.add_argument("run")
    t.add_argument("solo")
    t.add_argument("names", nargs="+")
    args = p.parse_args(argv)
    try:
        text = (ramp(args.on, args.off, args.stairs) if args.what == "ramp"
                else tenants(args.run, args.solo, args.names))
    except (OSError, KeyError, ValueError) as e:
        print(f"admission_figures: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
