"""Where the router's TTFT prediction goes wrong, term by term, in the simulator where the truth
is known (docs/benchmarks.md, "TTFT prediction error"):

    python -m loadtests.prediction_terms WORKLOAD [--fleet disagg:1:1] [--rate-scale 10]
        [--duration S] [--seed N]      # the 70B target of `kvfleet sim run`'s defaults

It runs `kvfleet sim run WORKLOAD --admission on` in process with a tracer on the simulated
workers and, for every admitted request, sets what the router predicted (its terms, in
`Prediction`) beside what happened:

  router wait   arrival to the placement (predicted: the same; it is not a prediction)
  in flight     placement to the end of the prefill worker's step then running (0 when idle)
  queue         the end of that step to the start of the step that takes its first chunk
  own prefill   that step's start to its first token
  transfer      predicted only, not in the predicted TTFT: the first token leaves before the
                KV moves
  decode slot   predicted only: the decode KV is reserved before the prefill starts

and prints |predicted - actual| / actual TTFT (p50, p90, median signed) over all, by class and by
prompt length, then what the error would be were each term exact (the others as predicted).
"""
from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from services.planner.simulator import Simulation

LENGTHS = (0, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class Truth:
    placed_s: float
    in_flight_s: float
    first_chunk_s: float | None = None


class Tracer:
    """What happened to each request on its prefill (or mixed) worker, by request id."""

    def __init__(self) -> None:
        self.truth: dict[str, Truth] = {}
        self.step_end: dict[str, float] = {}          # worker id -> end of its step in flight
        self.sims: list[Simulation] = []

    @contextlib.contextmanager
    def attached(self):
        add, kick, init = Simulation._add, Simulation._kick, Simulation.__init__
        tracer = self

        def _init(sim, *a, **k):
            init(sim, *a, **k)
            tracer.sims.append(sim)

        def _add(sim, w, rid, track):
            now = sim.clock.now
            busy = w.busy and tracer.step_end.get(w.worker_id, now) > now
            tracer.truth[rid] = Truth(now, tracer.step_end[w.worker_id] - now if busy else 0.0)
            return add(sim, w, rid, track)

        def _kick(sim, w):
            was_busy = w.busy
            kick(sim, w)
            if w.busy and not was_busy and w.engine.last_step is not None:
                now = sim.clock.now
                tracer.step_end[w.worker_id] = now + w.engine.last_step_modelled_s
                for rid, _ in w.engine.last_step.prefill_chunks:
                    t = tracer.truth.get(rid)
                    if t is not None and t.first_chunk_s is None:
                        t.first_chunk_s = now

        Simulation.__init__, Simulation._add, Simulation._kick = _init, _add, _kick
        try:
            yield self
        finally:
            Simulation.__init__, Simulation._add, Simulation._kick = init, add, kick


@dataclass(frozen=True)
class Row:
    """One admitted request: predicted and actual terms, seconds."""

    traffic_class: str
    prompt_tokens: int
    ttft_s: float
    router_wait_s: float
    in_flight_s: float
    queue_s: float
    own_s: float
    p_wait_s: float
    p_in_flight_s: float
    p_prefill_s: float
    p_transfer_s: float
    p_decode_s: float

    @property
    def predicted_s(self) -> float:
        return (self.router_wait_s + self.p_wait_s + self.p_in_flight_s + self.p_prefill_s
                + self.p_decode_s)


def rows_of(sim: Simulation, tracer: Tracer) -> list[Row]:
    out = []
    for rid, p in sim.gate.terms.items():
        track, t = sim.tracks[rid], tracer.truth.get(rid)
        rec = track.record
        if not rec.ok or track.first_token_s is None or t is None or t.first_chunk_s is None:
            continue
        start = t.placed_s + t.in_flight_s
        out.append(Row(rec.traffic_class, rec.prompt_tokens, rec.ttft_s,
                       t.placed_s - rec.send_s, t.in_flight_s, t.first_chunk_s - start,
                       track.first_token_s - t.first_chunk_s, p.wait_s,
                       getattr(p, "in_flight_s", 0.0), p.prefill_s, p.transfer_s,
                       p.decode_wait_s))
    return out


def errors(rows: list[Row], **exact: bool) -> np.ndarray:
    """Signed (predicted - actual) / actual TTFT, with the terms named in `exact` replaced by
    the truth (`in_flight_prefill` replaces in flight and own prefill together)."""
    out = []
    for r in rows:
        p = r.predicted_s
        if exact.get("wait"):
            p += r.queue_s - r.p_wait_s
        if exact.get("in_flight"):
            p += r.in_flight_s - r.p_in_flight_s
        if exact.get("prefill"):
            p += r.own_s - r.p_prefill_s
        if exact.get("decode"):
            p -= r.p_decode_s
        out.append((p - r.ttft_s) / max(r.ttft_s, 1e-9))
    return np.array(out)


def line(name: str, e: np.ndarray) -> str:
    if not len(e):
        return f"{name:34s} none"
    a = np.abs(e)
    return (f"{name:34s} n={len(e):5d}  p50 {np.percentile(a, 50):6.1%}  p90 "
            f"{np.percentile(a, 90):6.1%}  median signed {np.median(e):+6.1%}")


def report(rows: list[Row]) -> str:
    out = [line("all admitted", errors(rows))]
    by_class = defaultdict(list)
    for r in rows:
        by_class[r.traffic_class].append(r)
    out += [line(f"class {c}", errors(v)) for c, v in sorted(by_class.items())]
    for lo, hi in zip(LENGTHS, LENGTHS[1:] + (1 << 30,)):
        sel = [r for r in rows if lo <= r.prompt_tokens < hi]
        if sel:
            out.append(line(f"prompt [{lo}, {hi if hi < 1 << 30 else 'inf'})", errors(sel)))
    out.append("")
    out.append("actual terms, share of TTFT (median / p90):")
    for name in ("router_wait_s", "in_flight_s", "queue_s", "own_s"):
        share = np.array([getattr(r, name) / max(r.ttft_s, 1e-9) for r in rows])
        out.append(f"  {name:14s} {np.median(share):6.1%} / {np.percentile(share, 90):6.1%}")
    out.append("predicted - actual, share of TTFT (median signed / p90 of |.|):")
    terms = {"queue": lambda r: r.p_wait_s - r.queue_s,
             "in flight": lambda r: r.p_in_flight_s - r.in_flight_s,
             "own prefill": lambda r: r.p_prefill_s - r.own_s,
             "in flight + own prefill": lambda r: (r.p_in_flight_s + r.p_prefill_s
                                                   - r.in_flight_s - r.own_s),
             "decode slot": lambda r: r.p_decode_s}
    for name, f in terms.items():
        v = np.array([f(r) / max(r.ttft_s, 1e-9) for r in rows])
        out.append(f"  {name:24s} {np.median(v):+7.1%} / {np.percentile(np.abs(v), 90):6.1%}")
    out.append("the error were each term exact (the others as predicted):")
    for name, kw in (("queue", {"wait": True}), ("in flight", {"in_flight": True}),
                     ("own prefill", {"prefill": True}),
                     ("in flight + own prefill", {"in_flight": True, "prefill": True}),
                     ("decode slot", {"decode": True}),
                     ("queue + in flight + own", {"wait": True, "in_flight": True,
                                                  "prefill": True})):
        out.append("  " + line(name, errors(rows, **kw)))
    return "\n".join(out)


def outcome(sim: Simulation, run) -> str:
    """What the router's admission did, by class: admitted (served), refused by the router, met
    the class's TTFT target of those served, and goodput (requests that met their SLO, per second
    of the planned duration)."""
    from loadtests.metrics import is_rejected, meets_slo, meets_ttft  # noqa: PLC0415
    from loadtests.records import ClassSLO  # noqa: PLC0415
    refused = {f"sim-{i}" for i in run.meta.get("router_refused", ())}
    rows, met_all = [], 0
    by_class = defaultdict(list)
    for rid, track in sim.tracks.items():
        by_class[track.record.traffic_class].append((rid, track.record))
    for c, recs in sorted(by_class.items()):
        slo = run.classes.get(c, ClassSLO(c, None, None))
        served = [r for _, r in recs if r.ok]
        met = sum(meets_ttft(r, slo) for r in served)
        met_all += sum(meets_slo(r, slo) for r in served)
        ttfts = sorted(r.ttft_s for r in served)
        worst = f", TTFT max {ttfts[-1]:.1f} s" if ttfts else ""
        rows.append(f"class {c:12s} sent {len(recs):5d}  served {len(served):5d}  refused by "
                    f"router {sum(rid in refused for rid, _ in recs):5d}  other refusals "
                    f"{sum(is_rejected(r) for rid, r in recs if rid not in refused):4d}  met TTFT "
                    f"{met:5d} of served ({met / max(1, len(served)):6.1%}){worst}")
    span = run.meta.get("planned_duration_s") or sim.end_s
    rows.append(f"goodput {met_all / span:.1f} req/s ({met_all} met their SLO over {span:.0f} s)")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> list[Row]:
    from loadtests.workload import load_workload  # noqa: PLC0415
    from services.cli.sim_cmd import admission_of  # noqa: PLC0415
    from services.engine.config import EngineConfig, SimConfig  # noqa: PLC0415
    from services.planner.simulator import Fleet, SimRunConfig, simulate  # noqa: PLC0415
    spec = load_workload(args.workload).with_overrides(
        seed=args.seed, duration_s=args.duration, rate_scale=args.rate_scale)
    sim = SimConfig()
    cfg = SimRunConfig(fleet=Fleet.parse(args.fleet), sim=sim, engine=EngineConfig(),
                       admission=admission_of("on", spec, sim.network_gbps))
    with Tracer().attached() as tracer:
        out = simulate(spec, cfg)
    args.outcome = outcome(tracer.sims[-1], out.run)
    return rows_of(tracer.sims[-1], tracer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--fleet", default="disagg:1:1")
    ap.add_argument("--rate-scale", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    print(report(run(args)))
    print()
    print(args.outcome)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
