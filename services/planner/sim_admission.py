"""The router's admission and overload stages inside the discrete-event simulator
(`kvfleet sim run --admission on`), on the virtual clock.

Nothing here decides anything of its own: each decision is the router's code, called with what
the simulated fleet would publish.

  * signals a worker publishes: `services/worker/rates.py`'s `WorkerRates` per simulated worker
    (its prior from the target's cost model, fed every step, KV write and finished sequence),
    with the engine's stats (prefill tokens ahead per class, tenant shares), read fresh at each
    decision (no heartbeat lag), and the step in flight (its start, and its length by the
    worker's fitted cost of its batch: what a worker could say as a step begins);
  * one decision (`services/router/service.py`, `_try`): the stage rule (`admission.stage_rule`),
    the prediction (`predict.predict`, with `decode_wait_s`), the best case
    (`admission.best_case_s`; its wait term in the engine's tenant-fair order), the probe of an
    idle worker whose best case breaks the target only as priced by its prior
    (`admission.probe`, one in flight per worker: `admission.Probes`), the queue-first
    rule for newcomers (queued behind the waiters the fair order puts ahead), the protected headroom
    (`admission.fits_outside_headroom`), then the simulator's placement;
  * the wait (`_admit`): a miss whose best case still makes the target waits until
    `admission.wait_until` (a miss held by the stage: the whole queue bound) in an in-process
    queue per class in the Redis queue's tenant-fair order (`WaitLine`, on
    services/router/fair_order.py); it tries again when a decode (or mixed) worker frees KV
    and it is among the first `wake_width` of its class, or on its own timer (one heartbeat after
    a miss judged on stats, else `retry_s`); it is refused when even the best case misses, or when
    its wait ends. A refusal carries the router's `Retry-After` (`waiting.retry_after_s` over the
    measured drain of freed blocks);
  * the stage keeper (`keeper.py`): every `keeper_every_s`, the four signals as the keeper
    computes them (decode KV taken, the p95 of recent predicted TTFT / target, the oldest
    waiter's age / target, refusals and failures over two `COUNT_WINDOW_S` windows, those the
    stage made left out) into `StageMachine.decide`, with its one-step moves, hysteresis and dwell;
  * decode protection is the engine's own (the simulated cores run the real scheduler with
    `protect_itl`), so it is on with admission on or off.

What the simulation leaves out: the path's hops (the prediction's constant PATH_S is taken off
before its error is measured), Redis, and stats as old as a heartbeat.
"""
from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from services.engine.config import Tenant
from services.planner.step_time import StepTimer
from services.protocol.convert import tenant_queues
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts
from services.router import admission, fair_order
from services.router.admission import AdmissionConfig
from services.router.keeper import COUNT_WINDOW_S, RecentPredictions
from services.router.placement import can_ever_hold, kv_blocks_needed, rank_decode, rank_prefill
from services.router.path_choice import choose
from services.router.predict import (PATH_S, Prediction, decode_wait_s,
                                     free_unreserved_blocks, kv_bytes_of, predict)
from services.router.stages import S0, Signals, StageMachine, stage_name
from services.router.waiting import DrainRate, retry_after_s
from services.worker.rates import WorkerRates, default_prior, prior_from_timer


@dataclass(frozen=True)
class SimAdmissionConfig:
    """The router's policy and the timeouts that bound a wait, as a fleet would be started."""

    policy: AdmissionConfig = field(default_factory=AdmissionConfig)
    queue_s: float = Timeouts().queue_s           # the longest a request waits in the queue
    heartbeat_s: float = Timeouts().heartbeat_s   # a miss judged on stats retries this much later
    timeouts: Timeouts = field(default_factory=Timeouts)   # the KV write's limit (the reservation)

    def __post_init__(self) -> None:
        if not (self.queue_s >= 0 and self.heartbeat_s > 0):
            raise ValueError("queue_s must be >= 0 and heartbeat_s > 0")


@dataclass(frozen=True, slots=True)
class Miss:
    """One try that placed nothing (services/router/service.py's Miss, less its Redis detail)."""

    term: str
    prediction: Prediction
    blocks: int
    final: bool = False          # refuse now
    by_stage: bool = False       # the stage held or refused it (not an error for the signal)
    from_stats: bool = False     # retry after one heartbeat
    protected: bool = False      # it waits ahead of every borrower


class WaitLine:
    """The wait queue, in process: per class, the order the Redis queue keeps
    (services/router/fair_order.py): protected waiters by deadline, then each tenant's waiters by
    deadline, tenants interleaved by start-time fair queuing."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._first: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        self._tenants: dict[str, dict[str, list[tuple[float, int, str]]]] = defaultdict(dict)
        self._where: dict[str, tuple[str, str | None]] = {}     # rid -> (class, tenant)
        self._enqueued: dict[str, float] = {}
        self._v: dict[str, float] = defaultdict(float)
        self._served: dict[str, dict[str, float]] = defaultdict(dict)
        self._seq = itertools.count()

    def enqueue(self, rid: str, cls: str, deadline: float, now: float, tenant: str = "default",
                protected: bool = False) -> None:
        entry = (deadline, next(self._seq), rid)
        if protected:
            bisect.insort(self._first[cls], entry)
        else:
            bisect.insort(self._tenants[cls].setdefault(tenant, []), entry)
        self._where[rid] = (cls, None if protected else tenant)
        self._enqueued[rid] = now

    def leave(self, rid: str, cls: str) -> None:
        if self._enqueued.pop(rid, None) is None:
            return
        _, tenant = self._where.pop(rid)
        line = self._first[cls] if tenant is None else self._tenants[cls][tenant]
        line[:] = [e for e in line if e[2] != rid]
        if tenant is not None and not line:
            del self._tenants[cls][tenant]

    def admitted(self, cls: str, tenant: str, weight: float) -> None:
        """Charge `tenant` one turn (the Redis queue's `admitted`)."""
        served = self._served[cls]
        self._v[cls], served[tenant] = fair_order.charge(self._v[cls], served.get(tenant, 0.0),
                                                         weight)

    def _lines(self, cls: str, tenant: str | None = None) -> dict[str, fair_order.Line]:
        v, served = self._v[cls], self._served[cls]
        names = set(self._tenants[cls]) | ({tenant} if tenant is not None else set())
        return {t: fair_order.Line(len(self._tenants[cls].get(t, ())),
                                   self._weights.get(t, 1.0),
                                   fair_order.start_of(v, served.get(t, 0.0))) for t in names}

    def first(self, cls: str, n: int) -> list[str]:
        out = [rid for _, _, rid in self._first[cls][:n]]
        lines = self._tenants[cls]
        deadlines = {t: _Deadlines(q) for t, q in lines.items()}
        for t, k in fair_order.merged(self._lines(cls), deadlines):
            if len(out) >= n:
                break
            out.append(lines[t][k][2])
        return out[:n]

    def ahead(self, cls: str, tenant: str, deadline: float) -> int:
        """Waiters served before a newcomer of `tenant` with `deadline` (the Redis queue's)."""
        own = self._tenants[cls].get(tenant, [])
        rank = bisect.bisect_left([d for d, _, _ in own], deadline)
        lines = self._lines(cls, tenant)
        tied = {(u, j): self._tenants[cls][u][j][0]
                for u, j in fair_order.ties(tenant, rank, lines)}
        return len(self._first[cls]) + fair_order.ahead(tenant, rank, deadline, lines, tied)

    def waiting(self, cls: str) -> int:
        return len(self._first[cls]) + sum(len(q) for q in self._tenants[cls].values())

    def oldest_age_s(self, cls: str, now: float) -> float:
        ages = [now - self._enqueued[rid] for rid, (c, _) in self._where.items() if c == cls]
        return max(ages, default=0.0)


class _Deadlines:
    """The deadlines of a tenant's line, read where asked (the line itself is not copied)."""

    def __init__(self, line: list[tuple[float, int, str]]) -> None:
        self._line = line

    def __getitem__(self, k: int) -> float:
        return self._line[k][0]


class ErrorWindows:
    """Decisions and errors by `COUNT_WINDOW_S` window (the keeper's DecisionCounts, in process)."""

    def __init__(self) -> None:
        self._decided: Counter[int] = Counter()
        self._errors: Counter[int] = Counter()

    def count(self, now: float, error: bool) -> None:
        w = int(now // COUNT_WINDOW_S)
        self._decided[w] += 1
        self._errors[w] += int(error)

    def rate(self, now: float) -> float:
        w = int(now // COUNT_WINDOW_S)
        total = self._decided[w] + self._decided[w - 1]
        return (self._errors[w] + self._errors[w - 1]) / total if total else 0.0


@dataclass(frozen=True, slots=True)
class Decided:
    """How the router decided one request (for tests and the summary)."""

    request_id: str
    admitted: bool
    waited_s: float              # from arrival to the decision
    predicted_s: float           # the last try's predicted TTFT
    best_case_s: float           # its best case (own prefill and transfer)
    target_s: float
    stage: int
    term: str = ""               # a refusal's reason
    by_stage: bool = False
    wait_bound_s: float | None = None   # how long it could wait (from arrival), once it missed
    probe: bool = False          # admitted as a probe (admission.probe)


@dataclass
class _Waiter:
    cls: str
    began: float
    until: float | None = None
    queued: bool = False
    generation: int = 0


def worker_rates(timer: StepTimer, engine, kv_bytes_per_token: int, clock) -> WorkerRates:
    """What a simulated worker measures of itself, from the prior a real worker of the target
    would start from (services/worker/build.py: the cost model's roofline, else the CPU default)."""
    sched = engine.config.scheduler
    if hasattr(timer, "target"):
        t = timer.target
        prior = prior_from_timer(timer, f"cost-model:{t.model.name}/{t.gpu.name}/tp{t.tp}",
                                 sched.token_budget)
    else:
        prior = default_prior(kv_bytes_per_token)
    return WorkerRates(prior, token_budget=sched.token_budget, chunk_size=sched.chunk_size,
                       kv_bytes_per_token=kv_bytes_per_token, clock=clock, wall=clock)


def policy_for(spec, network_gbps: float, base: AdmissionConfig | None = None) -> AdmissionConfig:
    """The router's policy for a simulated run: the workload's tenants (as the engines and the
    router know them: weight, guaranteed KV, critical), the router's prior KV bandwidth the
    simulated network's."""
    base = base or AdmissionConfig()
    tenants = tuple(Tenant(t.name, weight=t.weight, min_kv_blocks=t.min_kv_blocks,
                           critical=t.critical) for t in spec.tenants)
    return replace(base, tenants=tenants, prior=replace(base.prior, kv_gbps=network_gbps))


class SimAdmission:
    """The router in the simulation: `arrive` decides a new request; the simulator calls
    `stepped`, `kv_written` and `freed` as its engines work, and `finish` on the records."""

    def __init__(self, sim, config: SimAdmissionConfig, kv_bytes_per_token: int) -> None:
        self.sim = sim
        self.cfg = config
        self.kv_bytes_per_token = kv_bytes_per_token
        self.policy = config.policy
        clock = sim.clock
        self.rates = {w.worker_id: worker_rates(sim.timer, w.engine, kv_bytes_per_token, clock)
                      for w in sim.workers}
        self.machine = StageMachine(self.policy.stages)
        self.stage, self.since = S0, 0.0
        self.timeline: list[dict] = [{"t_s": 0.0, "stage": S0, "name": stage_name(S0),
                                      "why": "start"}]
        self.recent = RecentPredictions(self.policy.ttft_window_s, clock=clock)
        self.drain = DrainRate(clock=clock)
        self.errors = ErrorWindows()
        self.weights = {t.name: t.weight for t in self.policy.tenants}
        self.line = WaitLine(self.weights)
        self.waiters: dict[str, _Waiter] = {}
        self.refusals: Counter[str] = Counter()
        self.queue_s: dict[str, list[float]] = defaultdict(list)
        self.predicted: dict[str, float] = {}        # request id -> predicted TTFT from arrival
        self.terms: dict[str, Prediction] = {}       # request id -> the admitting prediction
        self.decisions: list[Decided] = []
        self.waited: dict[str, float] = {}           # request id -> seconds in the wait queue
        self._wake_due = False
        self._changes = 0
        self._cached: tuple | None = None
        self._step: dict[str, tuple[float, float]] = {}   # worker id -> (began, predicted length)
        self.probes = admission.Probes(self.policy.probe_hold_s, clock=lambda: self.now)
        self._probed: set[str] = set()                    # request ids admitted as probes

    @property
    def now(self) -> float:
        return self.sim.clock.now

    # ------------------------------------------------------------ the simulator's calls
    def start(self) -> None:
        self.sim.call_at(0.0, self._keeper)

    def arrive(self, rid: str) -> None:
        self.waiters[rid] = _Waiter(self.sim.tracks[rid].planned.traffic_class, self.now)
        self._attempt(rid, first=True)

    def stepped(self, w) -> None:
        s = w.engine.last_step
        self._changes += 1
        if s is not None:
            # the step in flight as the worker publishes it: its start, its length by the fit
            fit = self.rates[w.worker_id].fit
            self._step[w.worker_id] = (self.now, fit.step_time(s.prefill_tokens + s.decode_tokens,
                                                               s.attention_pairs))
            self.rates[w.worker_id].on_step(s.prefill_tokens, s.decode_tokens, s.attention_pairs,
                                            s.duration_s, s.gap_s,
                                            prefill_by_class=s.prefill_by_class,
                                            prompts_by_class=s.prompts_by_class)

    def kv_written(self, w, nbytes: int, seconds: float) -> None:
        self._changes += 1
        self.rates[w.worker_id].kv_written(nbytes, seconds)

    def freed(self, w, blocks: int, finished: bool) -> None:
        """A decode (or mixed) worker freed `blocks` (a sequence ended, a reservation released):
        its capacity notification, delivered to the waiters once this instant's events are done."""
        self._changes += 1
        if w.role not in ("decode", "mixed"):
            return
        if finished:
            self.rates[w.worker_id].finished(blocks)
        self.drain.add(max(1, blocks))
        if not self._wake_due and self.waiters:
            self._wake_due = True
            self.sim.call_at(self.now, self._wake)

    def finish(self, records) -> None:
        """Each admitted request's prediction error, as the gateway writes it in `timing`."""
        for r in records:
            predicted = self.predicted.get(f"sim-{r.index}")
            if predicted is not None and r.ok and r.timing is not None:
                actual = max(r.ttft_s, 1e-9)
                r.timing["predicted_ttft_s"] = predicted
                r.timing["router_wait_s"] = self.waited.get(f"sim-{r.index}", 0.0)
                r.timing["ttft_prediction_error"] = (predicted - actual) / actual
                p = self.terms[f"sim-{r.index}"]
                r.timing.update(predicted_wait_s=p.wait_s, predicted_prefill_s=p.prefill_s,
                                predicted_transfer_s=p.transfer_s,
                                predicted_decode_wait_s=p.decode_wait_s)

    def refused_indices(self) -> list[int]:
        """The planned indices of the requests the router refused (an engine may refuse more)."""
        return sorted(int(d.request_id.removeprefix("sim-")) for d in self.decisions
                      if not d.admitted)

    def summary(self) -> dict:
        """The summary's admission fields (see docs/benchmarks.md)."""
        from loadtests.metrics import latency_stats  # noqa: PLC0415
        return {"rejections_by_stage": dict(sorted(self.refusals.items())),
                "queue_time_s_by_class": {
                    c: {"requests": len(v), "queued": sum(x > 0 for x in v), **latency_stats(v)}
                    for c, v in sorted(self.queue_s.items())},
                "stage_timeline": self.timeline}

    # ------------------------------------------------------------ one decision
    def _attempt(self, rid: str, first: bool) -> None:
        waiter = self.waiters[rid]
        outcome = self._try(rid, first)
        now = self.now
        cls = self.policy.traffic_class(waiter.cls)
        if isinstance(outcome, Prediction):
            self._decided(rid, error=False, record=Decided(
                rid, True, now - waiter.began, outcome.total_s, admission.best_case_s(outcome),
                cls.ttft_target_s, self.stage, wait_bound_s=self._bound(waiter),
                probe=rid in self._probed))
            return
        if waiter.until is None:
            waiter.until = (now + self.cfg.queue_s if outcome.by_stage else admission.wait_until(
                now, cls.ttft_target_s, outcome.prediction, self.cfg.queue_s))
        if outcome.final or now >= waiter.until:
            self._refuse(rid, outcome, cls)
            return
        if not waiter.queued:
            tenant = self.policy.tenant(self.sim.tracks[rid].planned.tenant).name
            self.line.enqueue(rid, waiter.cls, waiter.until, now, tenant, outcome.protected)
            waiter.queued = True
        waiter.generation += 1
        timer = self.cfg.heartbeat_s if outcome.from_stats else self.policy.retry_s
        gen = waiter.generation
        self.sim.call_at(min(waiter.until, now + timer), lambda: self._retry(rid, gen))

    def _retry(self, rid: str, generation: int | None = None) -> None:
        waiter = self.waiters.get(rid)
        if waiter is None or (generation is not None and generation != waiter.generation):
            return                                  # decided, or woken since this timer was set
        self._attempt(rid, first=False)

    def _wake(self) -> None:
        """A capacity notification: the first `wake_width` waiters of each class try, in order."""
        self._wake_due = False
        for c in self.policy.classes:
            for rid in self.line.first(c.name, self.policy.wake_width):
                self._retry(rid)

    def _try(self, rid: str, first: bool) -> Miss | Prediction:
        """services/router/service.py `_try` on the simulated fleet: its prediction once placed."""
        sim, pol = self.sim, self.policy
        track = sim.tracks[rid]
        planned = track.planned
        cls = pol.traffic_class(planned.traffic_class)
        stats = self._stats()
        n = len(track.prompt)
        params = pb.SamplingParams(max_tokens=track.params.max_tokens, n=max(1, track.params.n))
        track.path = choose(sim.paths, stats, n, params, sim.roles, traffic_class=cls.name,
                            prior=pol.prior, tenant=pol.tenant(planned.tenant).name,
                            weights=self.weights)
        colocated = track.path == "colocated"           # hybrid: by length and predicted TTFT
        role = "mixed" if colocated else "decode"
        ranked = rank_decode(stats, role, None, sim.turn)
        ranked = [s for s in ranked if can_ever_hold(s, n, params)] or ranked[:1]
        prefill = ranked[0] if colocated else rank_prefill(stats, n, sim.turn)[0]
        blocks = kv_blocks_needed(ranked[0], n, params)
        tenant = pol.tenant(planned.tenant)
        protected = admission.protected(tenant, admission.tenant_kv(stats), blocks)
        rule = admission.stage_rule(pol, self.stage, cls, protected, track.params.max_tokens)
        p = predict(prefill, n, traffic_class=cls.name,
                    kv_bytes=0 if colocated else kv_bytes_of(prefill, n),
                    decode_wait_s=decode_wait_s(ranked[0], blocks), prior=pol.prior,
                    tenant=tenant.name, weights=self.weights, now_unix_s=self.now,
                    classes=pol.classes)
        target = cls.ttft_target_s
        if first and admission.best_case_s(p) <= target:
            self.recent.add(p.total_s / target)
        if rule.refuse:
            return Miss(rule.note, p, blocks, final=True, by_stage=True)
        if rule.hold:
            return Miss(rule.note, p, blocks, by_stage=True, protected=protected)
        probing = admission.probe(pol, self.probes, prefill, p, target)
        missed = self._try_placed(rid, first, probing, p, blocks, protected, ranked, rule)
        if probing and missed is not None:
            self.probes.give_back(prefill.worker_id)
        if probing and missed is None:
            self._probed.add(rid)
        return p if missed is None else missed

    def _try_placed(self, rid: str, first: bool, probing: bool, p: Prediction, blocks: int,
                    protected: bool, ranked, rule) -> Miss | None:
        """The rest of `_try` once predicted: None once placed, else why not."""
        pol, sim = self.policy, self.sim
        track = sim.tracks[rid]
        cls = pol.traffic_class(track.planned.traffic_class)
        tenant = pol.tenant(track.planned.tenant)
        target = cls.ttft_target_s
        if admission.best_case_s(p) > target and not probing:
            return Miss("prefill", p, blocks, final=True)
        if p.transfer_s > admission.kv_write_limit_s(self.cfg.timeouts, target, p):
            return Miss(admission.KV_TRANSFER, p, blocks, final=True)
        budget = target - (self.now - self.waiters[rid].began)   # what waiting left of it
        if admission.best_case_s(p) > budget and not probing:
            return Miss("queue", p, blocks, final=True)
        if p.total_s > budget and not probing:
            return Miss(p.dominant(), p, blocks, from_stats=True, protected=protected)
        contended = not first                # it waited: its tenant is charged a turn
        if first and not protected and not probing and self.line.waiting(cls.name):
            contended = True
            deadline = self.now + min(budget - admission.best_case_s(p), self.cfg.queue_s)
            if self.line.ahead(cls.name, tenant.name, deadline):
                return Miss("queue", p, blocks, from_stats=True)
        if not protected:
            ranked = [w for w in ranked if admission.fits_outside_headroom(
                pol, w, free_unreserved_blocks(w), w.num_running, blocks)]
            if not ranked:
                return Miss("decode KV headroom", p, blocks, from_stats=True)
        if rule.output_cap:
            track.params = replace(track.params,
                                   max_tokens=min(track.params.max_tokens, rule.output_cap))
        if not sim.place(rid, track, [w.worker_id for w in ranked]):
            return Miss("decode slot", p, blocks, protected=protected)
        if contended and not protected:
            self.line.admitted(cls.name, tenant.name, tenant.weight)
        waited = self.now - self.waiters[rid].began
        self.predicted[rid] = waited + p.total_s - PATH_S
        self.terms[rid] = p
        self.waited[rid] = waited
        return None

    # ------------------------------------------------------------ outcomes
    def _decided(self, rid: str, error: bool, record: Decided) -> None:
        self.decisions.append(record)
        waiter = self.waiters.pop(rid)
        if waiter.queued:
            self.line.leave(rid, waiter.cls)
        self.queue_s[waiter.cls].append(self.now - waiter.began)
        self.errors.count(self.now, error)

    @staticmethod
    def _bound(waiter: _Waiter) -> float | None:
        return None if waiter.until is None else waiter.until - waiter.began

    def _refuse(self, rid: str, miss: Miss, cls) -> None:
        stage = stage_name(self.stage)
        waited = self.now - self.waiters[rid].began
        if miss.by_stage:
            message = f"{miss.term} (stage {stage})"
        elif miss.term == admission.KV_TRANSFER:
            message = admission.explain_transfer(
                miss.prediction,
                admission.kv_write_limit_s(self.cfg.timeouts, cls.ttft_target_s, miss.prediction),
                stage)
        else:
            message = admission.explain(miss.term, miss.prediction.total_s, cls.ttft_target_s,
                                        stage)
        if waited > 0.01:
            message += f"; waited {waited:.2f} s in the queue"
        prefill = [w for w in self._stats() if w.role in ("prefill", "mixed")]
        retry = retry_after_s(miss.blocks, self.drain.blocks_per_s(),
                              sum(w.queued_prefill_tokens for w in prefill),
                              sum(w.prefill_drain_tokens_per_s for w in prefill))
        self.refusals[stage] += 1
        # every refusal here is for load: a decision, not an error (the router counts none)
        self._decided(rid, error=False, record=Decided(
            rid, False, self.now - self.waiters[rid].began, miss.prediction.total_s,
            admission.best_case_s(miss.prediction), cls.ttft_target_s, self.stage, miss.term,
            miss.by_stage, self._bound(self.waiters[rid])))
        self.sim.refuse(self.sim.tracks[rid], message, retry)

    # ------------------------------------------------------------ the stage keeper
    def _keeper(self) -> None:
        now = self.now
        decision = self.machine.decide(self.stage, self.since, self.signals(), now)
        if decision.changed:
            self.stage, self.since = decision.stage, now
            self.timeline.append({"t_s": now, "stage": decision.stage,
                                  "name": stage_name(decision.stage), "why": decision.why})
        if self.sim.pending() or self.waiters:
            self.sim.call_at(now + self.policy.keeper_every_s, self._keeper)

    def signals(self) -> Signals:
        """services/router/service.py `fleet_signals`, on the simulated workers."""
        stats = self._stats()
        pools = [w for w in stats if w.role in ("decode", "mixed")]
        total = sum(w.kv_blocks_total for w in pools)
        taken = sum(w.kv_blocks_total - w.kv_blocks_free + w.kv_blocks_reserved
                    + w.kv_blocks_held for w in pools)
        ages = [self.line.oldest_age_s(c.name, self.now) / c.ttft_target_s
                for c in self.policy.classes]
        return Signals(kv_reserved=min(1.0, taken / total) if total else 0.0,
                       ttft_pressure=self.recent.quantile(), queue_age=max(ages, default=0.0),
                       error_rate=self.errors.rate(self.now))

    # ------------------------------------------------------------ what workers publish
    def _stats(self) -> list[pb.WorkerStats]:
        """What every worker would publish now. Built once per state of the fleet: the engines
        change only by a step (steps), a placement (turn), or an ending, a rejection or a KV
        hand-off (the hooks count those in `_changes`)."""
        key = (self.now, self.sim.steps, self.sim.turn, self._changes)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, [self._published(w) for w in self.sim.workers])
        return self._cached[1]

    def _published(self, w) -> pb.WorkerStats:
        es = w.engine.stats()
        s = pb.WorkerStats(worker_id=w.worker_id, role=w.role, kv_blocks_total=es.kv_blocks_total,
                           kv_blocks_free=es.kv_blocks_free, kv_blocks_used=es.kv_blocks_used,
                           kv_blocks_reserved=es.kv_blocks_reserved, num_running=es.num_running,
                           num_queued=es.num_queued,
                           queued_prefill_tokens=es.queued_prefill_tokens,
                           block_size=w.engine.config.block_size,
                           max_model_len=w.engine.max_model_len, num_decoding=es.num_decoding,
                           decode_context_tokens=es.decode_context_tokens,
                           max_running=es.max_running,
                           max_prefill_attention=es.max_prefill_attention)
        s.queued_prefill_tokens_ahead.update(es.prefill_tokens_ahead)
        s.prefill_queues.extend(tenant_queues(es))
        s.prefill_step_tokens_ahead.update(es.prefill_step_tokens_ahead)
        for tenant, seqs, kv in es.tenants:
            s.tenants.add(tenant=tenant, sequences=seqs, kv_blocks=kv)
        for k, v in self.rates[w.worker_id].fields().items():
            if isinstance(v, dict):
                getattr(s, k).update(v)
            else:
                setattr(s, k, v)
        s.step_started_unix_s, s.step_predicted_s = self._step.get(w.worker_id, (0.0, 0.0))
        return s

