"""Rebalancing in the simulator's loop: the rebalance policy (services/planner/rebalance.py) deciding
every window on a simulated disaggregated fleet, against a fixed-ratio fleet of the same size.

  trace     hours played one after the other (`shifting_plan`: by default shift-chat.yaml, a
            chat-heavy hour, then shift-docs.yaml, a document-heavy one), each compressed into
            `hour_s` simulated seconds (the rates as the specs give them; only the length shrinks)
  windows   every `window_s` the policy sees each pool's window as `kvfleet rebalance` measures
            one: the busy seconds of the workers that served through the whole window (decode:
            weighted by its steps' share of the ITL target), TTFT p99 and ITL p99 of the window,
            each the worst class's p99 relative to its class target (so one target serves every
            class), and decides
  changes   an added worker starts after `startup_s` (loading weights, warming up): until then it
            holds its GPUs but takes no work and is no replica of the policy's; a drained worker
            takes no new work, finishes what it holds, then frees its GPUs (the newest of its
            pool goes). The cool-down is startup_s + window_s: a change is judged on a window of
            its own load, never on its warm-up
  budget    replicas of the policy's budget: GPUs = replicas x the target's TP

`run_loop` returns both runs and the pool sizes over time; `plot` draws them (matplotlib).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from loadtests.workload import PlannedRequest, WorkloadSpec, load_workload
from services.planner.rebalance import (PoolWindow, RebalanceConfig, RebalanceState, decide,
                                        decode_work_s)
from services.planner.simulator import (CALL, MIN_STEP_S, Fleet, SimRunConfig, Simulation,
                                        _Worker, timing_of)

SERVING, STARTING, DRAINING, GONE = "serving", "starting", "draining", "gone"


@dataclass(frozen=True)
class LoopConfig:
    hour_s: float = 600.0            # simulated seconds each hour of the trace is compressed into
    window_s: float = 30.0
    startup_s: float = 30.0          # an added worker's start-up (weights, warm-up), compressed
    policy: RebalanceConfig = field(default_factory=lambda: RebalanceConfig(
        cooldown_s=60.0, budget=8, ttft_p99_target_s=1.0, itl_p99_target_s=0.1))

    def __post_init__(self) -> None:
        if not (self.hour_s > 0 and self.window_s > 0 and self.startup_s >= 0):
            raise ValueError("hour_s and window_s must be > 0, startup_s >= 0")
        if self.policy.cooldown_s < self.startup_s + self.window_s:
            raise ValueError(f"the policy's cool-down ({self.policy.cooldown_s:g} s) must cover a "
                             f"start-up and a window ({self.startup_s + self.window_s:g} s)")


def shifting_plan(specs: list[WorkloadSpec], hour_s: float) -> tuple[WorkloadSpec, list[PlannedRequest]]:
    """Each spec's requests in its own `hour_s`, one after the other; the first spec (with every
    class of all of them) stands for the whole trace."""
    planned, offset = [], 0.0
    classes = {}
    for spec in specs:
        part = spec.with_overrides(duration_s=hour_s)
        from loadtests.workload import plan_requests  # noqa: PLC0415
        for p in plan_requests(part):
            planned.append(replace(p, index=len(planned), at_s=p.at_s + offset,
                                   tenant=f"{spec.name}:{p.tenant}"))
        classes.update(spec.classes)
        offset += hour_s
    tenants = tuple(replace(t, name=f"{spec.name}:{t.name}") for spec in specs
                    for t in spec.tenants)
    whole = replace(specs[0], name="+".join(s.name for s in specs), duration_s=offset,
                    classes=classes, tenants=tenants)
    return whole, planned


class _Tails:
    """TTFT and ITL samples of one window, by class."""

    def __init__(self) -> None:
        self.ttft: dict[str, list[float]] = {}
        self.itl: dict[str, list[float]] = {}

    def worst(self, which: dict[str, list[float]], targets: dict[str, float | None],
              unit_s: float) -> float | None:
        """The worst class's p99 / its target, times `unit_s` (None: no sample)."""
        ratios = [float(np.percentile(v, 99)) / targets[c] for c, v in which.items()
                  if v and targets.get(c)]
        return max(ratios) * unit_s if ratios else None


class RebalancingSimulation(Simulation):
    def __init__(self, spec: WorkloadSpec, cfg: SimRunConfig, timer, transfer_s,
                 planned: list[PlannedRequest], loop: LoopConfig | None) -> None:
        super().__init__(spec, cfg, timer, transfer_s)
        self.planned = planned
        self.loop = loop
        self.phase = [SERVING] * len(self.workers)
        self.since = [0.0] * len(self.workers)
        self.busy = [0.0] * len(self.workers)
        self.nsteps = [0] * len(self.workers)
        self._mark = ([0.0] * len(self.workers), [0] * len(self.workers))
        self.tails = _Tails()
        self.state = RebalanceState()
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.gpu_s = 0.0
        self._last_t = 0.0
        slo = {name: c.slo for name, c in spec.classes.items()}
        self.ttft_targets = {c: s.ttft_s for c, s in slo.items()}
        self.itl_targets = {c: s.itl_s for c, s in slo.items()}
        end = max((p.at_s for p in planned), default=0.0)
        window = loop.window_s if loop else 10.0
        for k in range(1, int(end // window) + 1):
            self._push(k * window, CALL, self._tick)

    # ------------------------------------------------------------------ hooks
    def _stats(self):
        return [s for s, ph in zip(super()._stats(), self.phase) if ph == SERVING]

    def _kick(self, w: _Worker) -> None:
        was = w.busy
        super()._kick(w)
        if w.busy and not was:
            i = self.workers.index(w)
            self.busy[i] += max(w.engine.last_step_modelled_s, MIN_STEP_S)
            self.nsteps[i] += 1

    def _token(self, track, now: float) -> None:
        first = track.first_token_s is None
        last = track.last_token_s
        super()._token(track, now)
        cls = track.record.traffic_class
        if first:
            self.tails.ttft.setdefault(cls, []).append(track.record.ttft_s)
        elif last is not None:
            self.tails.itl.setdefault(cls, []).append(now - last)

    # ------------------------------------------------------------------ windows
    def _tick(self) -> None:
        now = self.clock.now
        self._retire_drained()
        self._account(now)
        windows = self._windows(now)
        self.tails = _Tails()
        self._mark = (list(self.busy), list(self.nsteps))
        if self.loop is not None and all(w.replicas for w in windows.values()):
            out = decide(windows, self.loop.policy, self.state, now)
            self.state = out.state
            self.decisions.append({"t": now, **{d.pool: d.as_dict() for d in out.decisions}})
            for d in out.decisions:
                for _ in range(max(0, d.delta)):
                    self._add_worker(d.pool)
                for _ in range(max(0, -d.delta)):
                    self._drain_worker(d.pool)
        self.timeline.append({"t": now, **self.counts(),
                              "demand": {p: round(w.demand, 3) for p, w in windows.items()}})

    def _windows(self, now: float) -> dict[str, PoolWindow]:
        window = self.loop.window_s if self.loop else 10.0
        busy0, steps0 = self._mark
        out = {}
        ttft = self.tails.worst(self.tails.ttft, self.ttft_targets, self._policy.ttft_p99_target_s)
        itl = self.tails.worst(self.tails.itl, self.itl_targets, self._policy.itl_p99_target_s)
        for role in ("prefill", "decode"):
            idx = [i for i, w in enumerate(self.workers) if w.role == role
                   and self.phase[i] == SERVING and self.since[i] <= now - window]
            busy = sum(self.busy[i] - busy0[i] for i in idx)
            if role == "decode":
                steps = sum(self.nsteps[i] - steps0[i] for i in idx)
                busy = decode_work_s(busy, steps, self._policy.itl_p99_target_s)
            out[role] = PoolWindow(len(idx), busy, window, ttft_p99_s=ttft, itl_p99_s=itl)
        return out

    @property
    def _policy(self) -> RebalanceConfig:
        return self.loop.policy if self.loop else LoopConfig().policy

    def counts(self) -> dict[str, int]:
        out = {}
        for role in ("prefill", "decode"):
            for ph in (SERVING, STARTING, DRAINING):
                out[f"{role}_{ph}"] = sum(1 for w, p in zip(self.workers, self.phase)
                                          if w.role == role and p == ph)
        return out

    def _account(self, now: float) -> None:
        held = sum(1 for p in self.phase if p != GONE)
        self.gpu_s += held * (now - self._last_t) * self.cfg.sim.tp
        self._last_t = now

    def _add_worker(self, role: str) -> None:
        i = len(self.workers)
        w = _Worker(f"{role}-{i}", role, self._engine(role))
        self.workers.append(w)
        for column in (self.busy, self._mark[0]):
            column.append(0.0)
        for column in (self.nsteps, self._mark[1]):
            column.append(0)
        self.phase.append(STARTING)
        self.since.append(math.inf)
        self._push(self.clock.now + self.loop.startup_s, CALL, lambda: self._started(i))

    def _started(self, i: int) -> None:
        self.phase[i], self.since[i] = SERVING, self.clock.now

    def _drain_worker(self, role: str) -> None:
        serving = [i for i, w in enumerate(self.workers) if w.role == role and
                   self.phase[i] == SERVING]
        if len(serving) > 1:
            self.phase[max(serving)] = DRAINING

    def _retire_drained(self) -> None:
        for i, w in enumerate(self.workers):
            if self.phase[i] == DRAINING and not w.busy and not w.engine.has_unfinished():
                self.phase[i] = GONE


@dataclass
class LoopRun:
    label: str
    summary: dict                    # loadtests.metrics.summarize
    timeline: list[dict]
    decisions: list[dict]
    gpu_hours: float


def run_one(specs: list[WorkloadSpec], cfg: SimRunConfig, loop: LoopConfig | None,
            hour_s: float) -> LoopRun:
    from loadtests.metrics import summarize  # noqa: PLC0415
    whole, planned = shifting_plan(specs, hour_s)
    timer, transfer_s = timing_of(cfg)
    sim = RebalancingSimulation(whole, cfg, timer, transfer_s, planned, loop)
    result = sim.run()
    sim._account(sim.end_s)
    label = "rebalanced" if loop else f"fixed {cfg.fleet}"
    return LoopRun(label, summarize(result), sim.timeline, sim.decisions, sim.gpu_s / 3600.0)


def run_loop(specs: list[WorkloadSpec], start: Fleet, cfg: SimRunConfig,
             loop: LoopConfig) -> tuple[LoopRun, LoopRun]:
    """(the rebalanced fleet from `start`, the fixed fleet `start`) on the same trace."""
    base = replace(cfg, fleet=start)
    return run_one(specs, base, loop, loop.hour_s), run_one(specs, base, None, loop.hour_s)


def default_specs() -> list[WorkloadSpec]:
    return [load_workload("shift-chat"), load_workload("shift-docs")]


def plot(rebalanced: LoopRun, fixed: list[LoopRun], hour_s: float, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    t = [x["t"] for x in rebalanced.timeline]
    for role, colour in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        serving = [x[f"{role}_serving"] for x in rebalanced.timeline]
        held = [x[f"{role}_serving"] + x[f"{role}_starting"] + x[f"{role}_draining"]
                for x in rebalanced.timeline]
        top.step(t, serving, where="post", color=colour, label=f"{role} serving")
        top.step(t, held, where="post", color=colour, linestyle=":", alpha=0.7,
                 label=f"{role} holding GPUs (starting / draining)")
    top.axvline(hour_s, color="grey", linestyle="--")
    top.text(hour_s * 0.5, top.get_ylim()[1] * 0.95, "chat-heavy hour", ha="center", va="top")
    top.text(hour_s * 1.5, top.get_ylim()[1] * 0.95, "document-heavy hour", ha="center", va="top")
    top.set_ylabel("replicas")
    top.legend(loc="center right", fontsize=8)
    top.set_title("Rebalancing in the loop: pool sizes follow the mix")
    for w in ("prefill", "decode"):
        bottom.plot(t, [x["demand"].get(w, 0) for x in rebalanced.timeline],
                    label=f"{w} demand (replica-s/s)")
    bottom.set_xlabel(f"simulated seconds (each hour compressed to {hour_s:g} s)")
    bottom.set_ylabel("measured demand")
    lines = [f"{r.label}: goodput {r.summary['overall']['goodput_rps']:.2f} req/s, "
             f"{r.gpu_hours:.1f} GPU-h" for r in (rebalanced, *fixed)]
    bottom.legend(loc="upper left", fontsize=8, title="\n".join(lines), title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
