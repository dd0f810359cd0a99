"""One discrete-event point of docs/evaluation.md's des part, taken apart: per class the requests,
those that met their SLO, where they were served (co-located or disaggregated), TTFT and ITL
percentiles and failures; per worker its steps and busy seconds; the router's refusals by stage.
What docs/capacity.md's hybrid diagnosis quotes.

    python -m loadtests.des_diagnose mixed hybrid:2:1:1 22.6274 [--seed 1] [--duration 10]
        [--threshold N] [--every S]

`--every S`: also a timeline, every S simulated seconds of arrivals: the stage, and per worker its
running sequences, its reservations awaiting KV or a seat (a decode worker's seats held while
their prompts are prefilled elsewhere), its queued prompts and their tokens, its last step (ms).

Same settings as `loadtests/eval_des.py des_point` (real prompt lengths, the router's admission
on, llama-3-70b fp8 TP 4 on H200, 400 Gb/s); every figure rests on the capacity model.
"""
from __future__ import annotations

import argparse
import collections
import sys

from loadtests.eval_des import real_lengths
from loadtests.metrics import meets_slo, meets_ttft, percentile
from loadtests.workload import load_workload
from services.engine.config import SimConfig
from services.planner import simulator as S
from services.planner.sim_admission import SimAdmissionConfig, policy_for


class Timed(S.Simulation):
    """The simulation, adding up each worker's modelled step seconds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.busy_s: collections.Counter = collections.Counter()

    def _kick(self, w) -> None:
        was = w.busy
        super()._kick(w)
        if w.busy and not was:
            self.busy_s[w.worker_id] += max(w.engine.last_step_modelled_s, S.MIN_STEP_S)


def _p(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) if values else float("nan")


def _timeline(s: Timed, every: float, until: float) -> None:
    """One timeline line now, and the next `every` seconds on while arrivals last."""
    parts = [f"t={s.clock.now:6.2f}"]
    if s.gate is not None:
        parts.append(f"S{s.gate.stage} waiters {len(s.gate.waiters):4d}")
    for w in s.workers:
        es, sched = w.engine.stats(), w.engine.scheduler
        held = sum(r.status.name == "WAITING_FOR_KV" for r in sched.requests.values())
        parts.append(f"{w.worker_id}: run {es.num_running:3d} held {held + len(sched.slot_waiting):3d} "
                     f"queued {es.num_queued:3d}/{es.queued_prefill_tokens:6d} tok "
                     f"step {w.engine.last_step_modelled_s * 1e3:5.1f} ms")
    print("  " + " | ".join(parts))
    if s.clock.now + every <= until:
        s.call_at(s.clock.now + every, lambda: _timeline(s, every, until))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.des_diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload")
    p.add_argument("fleet", help="colocated:N, disagg:P:D or hybrid:N:P:D")
    p.add_argument("rate", type=float, help="the rate scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=10.0, help="simulated seconds of arrivals")
    p.add_argument("--threshold", type=int, default=0, help="hybrid threshold (0: the model's)")
    p.add_argument("--every", type=float, default=0.0, help="a timeline every S simulated s")
    a = p.parse_args(argv)
    spec = real_lengths(load_workload(a.workload).with_overrides(
        seed=a.seed, duration_s=a.duration)).with_overrides(rate_scale=a.rate)
    sim = SimConfig()
    try:
        cfg = S.SimRunConfig(fleet=S.Fleet.parse(a.fleet), sim=sim, hybrid_threshold_tokens=a.threshold,
                             admission=SimAdmissionConfig(policy=policy_for(spec, sim.network_gbps)))
    except S.SimError as e:
        p.error(str(e))
    timer, transfer_s = S.timing_of(cfg)
    s = Timed(spec, cfg, timer, transfer_s, kv_bytes_per_token=S.kv_bytes_per_token_of(cfg, timer))
    if a.every > 0:
        s.call_at(0.0, lambda: _timeline(s, a.every, a.duration))
    run = s.run()
    print(f"{a.workload} {a.fleet} x{a.rate:g} seed {a.seed}: threshold {S.hybrid_threshold(cfg)} "
          f"tokens, the run drained at {s.end_s:.1f} simulated s")
    for w in s.workers:
        print(f"  {w.worker_id:10s} steps {w.steps:6d}  busy {s.busy_s[w.worker_id]:6.1f} s")
    met_all = 0
    by_class = collections.defaultdict(list)
    for r in run.records:
        by_class[r.traffic_class].append(r)
    for name, records in by_class.items():
        slo = run.classes[name]
        ok = [r for r in records if r.ok]
        met = sum(meets_slo(r, slo) for r in records)
        met_all += met
        coloc = sum(s.tracks[f"sim-{r.index}"].path == "colocated"
                    or (s.tracks[f"sim-{r.index}"].path is None and s.path(r.prompt_tokens)
                        == "colocated") for r in records)
        ttft = [r.ttft_s for r in ok]
        itl = [_p(r.itl_s, 99) for r in ok if r.itl_s]
        fails = collections.Counter(r.error for r in records if not r.ok)
        print(f"  {name:11s} {len(records):5d} requests, met {met}, co-located {coloc}, "
              f"late TTFT {sum(not meets_ttft(r, slo) for r in ok)}, TTFT p50/p99 "
              f"{_p(ttft, 50):.3f}/{_p(ttft, 99):.3f} s, own ITL p99 (p50/p99 over requests) "
              f"{_p(itl, 50) * 1e3:.0f}/{_p(itl, 99) * 1e3:.0f} ms, failed {dict(fails)}")
    print(f"  goodput {met_all / a.duration:.1f} req/s of {len(run.records) / a.duration:.1f} "
          f"offered; refused by stage {s.gate.summary()['rejections_by_stage']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
