"""`kvfleet sim run`: the fleet as a discrete-event simulation, in one process on a virtual clock.

What runs is the fleet's own decision code, with time modelled instead of spent:

  * arrivals: the load tester's seeded plan of the workload (loadtests/workload.py), request for
    request the one `kvfleet bench serve` sends;
  * placement: the router's ranking (services/router/placement.py) over the `pb.WorkerStats` each
    simulated worker would publish, read fresh at each decision (so nothing is placed since the
    beat: no `Placed` counts), ties broken by the router's ring, turned once a placement;
  * engines: one simulated engine core per worker (LLMEngine with a SimConfig: the real scheduler,
    admission and block pool, deterministic tokens), all on one virtual clock. A step of engine E
    starting at t ends at t + its modelled duration (the StepTimer: a target's cost model or a
    measured profile); its tokens are delivered at the end. An engine steps again at once while it
    has work, and otherwise waits for an event (an arrival, a KV hand-off);
  * co-located (`colocated:N`): the best `mixed` worker serves the whole request;
  * disaggregated (`disagg:P:D`): the router reserves KV on the best decode worker that accepts
    (reserve_remote; none: the request is refused, 429 overloaded), the best prefill worker runs
    the prompt to its first token (streamed to the client then, as the real prefill worker does,
    before any KV moves), the KV moves in `transfer_s` (the cost model's, or the served model's KV
    bytes over --sim-network-gbps for a profile), then the decode worker starts decoding
    (start_decode) and the prefill worker frees the pages (release).

Without `SimRunConfig.admission` the simulated router runs no overload stages and has no wait
queue: it admits or refuses at once, so a record names no stage (its refusals count under "none" in
the summary's rejections_by_stage) and its time in the router's wait queue is 0. With it
(`--admission on`), the router's own admission, wait queue and stages decide each request
(services/planner/sim_admission.py).

With `SimRunConfig.overhead` (a `FleetOverhead` measured in a real or emulated fleet,
services/planner/overhead.py) each request reaches the router after a drawn path, every hand-off
and (for simulated cores) every step takes the fleet's measured extra: the fleet's own costs.

Each request becomes the `RequestRecord` the load tester would have written (TTFT, every
inter-token gap, e2e, status, and the server's phase times), so `loadtests/report.py` writes the
same run.json / summary.json / report.md as `kvfleet bench serve`, and `kvfleet bench compare
--summary` sets a simulated run beside a real one. The same arguments give the same summary.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from loadtests.records import RequestRecord, RunResult
from loadtests.workload import PlannedRequest, WorkloadSpec, plan_requests, slo_table
from services.engine.config import PREFILL_ROLE_DEFAULTS, EngineConfig, SimConfig, Tenant
from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.planner.overhead import FleetOverhead
from services.planner.step_time import StepTimer
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.planner.hybrid import threshold_tokens
from services.router.path_choice import choose
from services.router.paths import DEFAULT_THRESHOLD_TOKENS, Paths
from services.router.placement import can_ever_hold, rank_decode, rank_prefill

MIN_STEP_S = 1e-9          # a step that ran takes at least this (a zero step would never end)


class SimError(ValueError):
    """Arguments the simulator cannot run with (a clear message, never a traceback)."""


@dataclass(frozen=True)
class Fleet:
    mode: str                   # colocated | disagg | hybrid
    prefill: int                # disagg, hybrid: prefill workers (colocated: 0)
    decode: int                 # disagg, hybrid: decode workers; colocated: mixed workers
    mixed: int = 0              # hybrid: mixed workers (short prompts, services/router/paths.py)

    @classmethod
    def parse(cls, text: str) -> "Fleet":
        """colocated:N, disagg:P:D or hybrid:N:P:D."""
        parts = text.split(":")
        try:
            counts = [int(x) for x in parts[1:]]
        except ValueError:
            counts = []
        if parts[0] == "colocated" and len(counts) == 1 and counts[0] >= 1:
            return cls("colocated", 0, counts[0])
        if parts[0] == "disagg" and len(counts) == 2 and min(counts) >= 1:
            return cls("disagg", counts[0], counts[1])
        if parts[0] == "hybrid" and len(counts) == 3 and min(counts) >= 1:
            return cls("hybrid", counts[1], counts[2], mixed=counts[0])
        raise SimError(f"fleet {text!r}: expected colocated:N, disagg:P:D or hybrid:N:P:D with "
                       "counts >= 1")

    def roles(self) -> list[str]:
        if self.mode == "colocated":
            return ["mixed"] * self.decode
        return ["mixed"] * self.mixed + ["prefill"] * self.prefill + ["decode"] * self.decode

    def __str__(self) -> str:
        if self.mode == "hybrid":
            return f"hybrid:{self.mixed}:{self.prefill}:{self.decode}"
        return (f"colocated:{self.decode}" if self.mode == "colocated"
                else f"disagg:{self.prefill}:{self.decode}")


@dataclass(frozen=True)
class SimRunConfig:
    fleet: Fleet
    sim: SimConfig                       # the target (or profile), KV capacity, network
    model: str = "tiny"                  # the served model: its tokenizer and config (no weights)
    # scheduler and KV settings; kv_cache_mib: the workers' default (a profile's KV capacity)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # hybrid: the longest prompt served co-located (0: the capacity model's split for a target,
    # else the router's default; services/planner/hybrid.py)
    hybrid_threshold_tokens: int = 0
    # the router's admission and stages (services/planner/sim_admission.py); None: place all
    admission: object | None = None
    # the fleet's own costs measured in a real fleet (overhead.py); None: the engines alone
    overhead: FleetOverhead | None = None


class VirtualClock:
    """The simulation's time, read by every engine; only the event loop moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Track:
    """One request's story on the virtual clock."""

    record: RequestRecord
    planned: PlannedRequest
    prompt: list[int]
    params: SamplingParams
    prefill_worker: int | None = None
    decode_worker: int | None = None
    last_token_s: float | None = None
    first_token_s: float | None = None
    landed_s: float | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0
    path: str | None = None      # the router's choice ("colocated" | "disagg"); None: by length


@dataclass
class _Worker:
    worker_id: str
    role: str
    engine: object               # LLMEngine with config.sim set
    busy: bool = False
    steps: int = 0


ARRIVE, STEP_END, KV_LANDED, CALL = 0, 1, 2, 3


class Simulation:
    def __init__(self, spec: WorkloadSpec, cfg: SimRunConfig, timer: StepTimer,
                 transfer_s: Callable[[int], float], kv_bytes_per_token: int = 0) -> None:
        self.spec = spec
        self.cfg = cfg
        self.clock = VirtualClock()
        self.timer = timer
        self.transfer_s = transfer_s
        self.workers = [_Worker(f"{role}-{i}", role, self._engine(role))
                        for i, role in enumerate(cfg.fleet.roles())]
        self.vocab = self.workers[0].engine.model_config.vocab_size
        self.planned = plan_requests(spec)
        self.tracks: dict[str, _Track] = {}
        self._events: list = []
        self._seq = itertools.count()
        self.end_s = 0.0
        self.steps = 0
        self.turn = 0            # where placement ties start; turned once a placement (the router's)
        self.paths = Paths(cfg.fleet.mode, hybrid_threshold(cfg))   # the router's path choice
        self.roles = set(cfg.fleet.roles())
        self.gate = None         # the router's admission (sim_admission.SimAdmission), if on
        if cfg.admission is not None:
            from services.planner.sim_admission import SimAdmission  # noqa: PLC0415
            self.gate = SimAdmission(self, cfg.admission, kv_bytes_per_token)

    # ------------------------------------------------------------------ setup
    def _engine(self, role: str):
        from services.engine.engine import LLMEngine  # noqa: PLC0415
        base = self.cfg.engine
        tenants = tuple(Tenant(t.name, weight=t.weight) for t in self.spec.tenants)
        sched = replace(base.scheduler, role=role, tenants=tenants or base.scheduler.tenants,
                        default_tenant=(tenants or base.scheduler.tenants)[0].name)
        if role == "prefill":
            sched = replace(sched, **PREFILL_ROLE_DEFAULTS)
        # no text, as a fleet's engine core makes none (the gateway does): the simulation reads
        # token ids and times only
        config = replace(base, model=self.cfg.model, sim=self.cfg.sim, scheduler=sched,
                         detokenize=False)
        return LLMEngine(config, clock=self.clock, step_timer=self.timer)

    def _push(self, at: float, kind: int, data) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, data))

    # ------------------------------------------------------------------- run
    def run(self) -> RunResult:
        path = self.cfg.overhead.sampler(self.spec.seed) if self.cfg.overhead else float
        for p in self.planned:           # a request reaches the router after the fleet's path
            self._push(p.at_s + path(), ARRIVE, p)
        if self.gate is not None:
            self.gate.start()
        while self._events:
            at, _, kind, data = heapq.heappop(self._events)
            self.clock.now = at
            self.end_s = max(self.end_s, at)
            if kind == ARRIVE:
                self._arrive(data)
            elif kind == STEP_END:
                self._step_end(*data)
            elif kind == KV_LANDED:
                self._kv_landed(data)
            else:                        # CALL: a hook's own event (admission timers, rebalance windows)
                data()
        self._strand_unfinished()
        return self._result()

    def _arrive(self, p: PlannedRequest) -> None:
        rid = f"sim-{p.index}"
        rec = RequestRecord(p.index, p.traffic_class, p.tenant, p.at_s, send_s=p.at_s,
                            prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens)
        prompt = np.random.default_rng(p.prompt_seed).integers(0, self.vocab, p.prompt_tokens).tolist()
        # as the load tester sends: greedy, ignore_eos, max_tokens as planned
        params = SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True)
        track = self.tracks[rid] = _Track(rec, p, prompt, params)
        if self.gate is not None:
            self.gate.arrive(rid)
        elif not self.place(rid, track):
            self.refuse(track, "no decode replica can reserve KV for this request", 1.0)

    # ---------------------------------------------------------------- hooks
    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        self._push(at, CALL, fn)

    def pending(self) -> bool:
        return bool(self._events)

    def place(self, rid: str, track: _Track, only: list[str] | None = None) -> bool:
        """Place a request (on the workers `only` names, when given); False: no decode worker
        could reserve KV for it (nothing placed)."""
        if (track.path or self._choose(track)) == "colocated":
            self._place_colocated(rid, track, only)
            return True
        return self._place_disagg(rid, track, only)

    def _choose(self, track: _Track) -> str:
        """The router's path without its admission: by length, and in a hybrid fleet a short
        prompt where the earlier first token is predicted (services/router/path_choice.py)."""
        return choose(self.paths, self._stats(), len(track.prompt), _pb_params(track.params),
                      self.roles, traffic_class=track.planned.traffic_class)

    def path(self, prompt_tokens: int) -> str:
        """"colocated" or "disagg": the router's path for a prompt (services/router/paths.py)."""
        return self.paths.path(prompt_tokens, self.roles)

    def refuse(self, track: _Track, detail: str, retry_after_s: float) -> None:
        self._fail(track, 429, "http_429:overloaded", detail, retry_after_s=retry_after_s)

    def _place_colocated(self, rid: str, track: _Track, only: list[str] | None = None) -> None:
        ranked = rank_decode(self._stats(), "mixed", None, self.turn)
        ranked = [s for s in ranked if only is None or s.worker_id in only]
        w = self._by_id(ranked[0].worker_id)
        self.turn += 1
        if self._add(w, rid, track):
            track.prefill_worker = track.decode_worker = self.workers.index(w)
            self._kick(w)

    def _place_disagg(self, rid: str, track: _Track, only: list[str] | None = None) -> bool:
        stats = self._stats()
        p, n = track.planned, len(track.prompt)
        ranked = rank_decode(stats, "decode", None, self.turn)
        ranked = [s for s in ranked if only is None or s.worker_id in only]
        prefill = self._by_id(rank_prefill(stats, n, self.turn)[0].worker_id)
        candidates = [s for s in ranked if can_ever_hold(s, n, _pb_params(track.params))] or ranked[:1]
        decode = None
        for s in candidates:
            w = self._by_id(s.worker_id)
            try:
                blocks = w.engine.reserve_remote(track.prompt, track.params, request_id=rid,
                                                 tenant=p.tenant, traffic_class=p.traffic_class)
            except InvalidRequestError as e:
                self._fail(track, 400, f"http_400:{e.code}", str(e))
                return True
            if blocks is not None:
                decode = w
                self.turn += 1
                break
        if decode is None:
            return False
        track.decode_worker = self.workers.index(decode)
        if self._add(prefill, rid, track):
            track.prefill_worker = self.workers.index(prefill)
            self._kick(prefill)
        else:
            decode.engine.cancel(rid)
        return True

    def _add(self, w: _Worker, rid: str, track: _Track) -> bool:
        p = track.planned
        try:
            w.engine.add_request(track.prompt, track.params, tenant=p.tenant,
                                 traffic_class=p.traffic_class, request_id=rid)
        except InvalidRequestError as e:
            self._fail(track, 400, f"http_400:{e.code}", str(e))
            return False
        return True

    # --------------------------------------------------------------- engines
    def _kick(self, w: _Worker) -> None:
        """Start w's next step now if it is idle and has work."""
        if w.busy or not w.engine.has_unfinished():
            return
        outputs = w.engine.step()
        ran = w.engine.last_step is not None
        if not ran:                          # nothing could run: wait for an event
            self._deliver(w, outputs)
            return
        w.busy = True
        w.steps += 1
        if self.gate is not None:
            self.gate.stepped(w)
        self.steps += 1
        d = max(w.engine.last_step_modelled_s, MIN_STEP_S)
        self._push(self.clock.now + d, STEP_END, (w, outputs))

    def _step_end(self, w: _Worker, outputs: list) -> None:
        w.busy = False
        self._deliver(w, outputs)
        self._kick(w)

    def _deliver(self, w: _Worker, outputs: list) -> None:
        now = self.clock.now
        for out in outputs:
            track = self.tracks.get(out.request_id)
            if track is None:
                continue
            rec = track.record
            if out.queue_s is not None:
                track.queue_s, track.prefill_s = out.queue_s, out.prefill_s or 0.0
            for _ in out.new_token_ids:
                self._token(track, now)
            if out.finish_reason == "rejected":
                self._fail(track, 429, "http_429:overloaded", out.error or "rejected",
                           retry_after_s=out.retry_after_s)
                if track.decode_worker is not None and w.role == "prefill":
                    self.workers[track.decode_worker].engine.cancel(out.request_id)
                self._freed(track, finished=False)
            elif out.prefilled:
                first = out.new_token_ids[-1] if out.new_token_ids else 0
                self._push(now + self.transfer_s(len(track.prompt)), KV_LANDED,
                           (out.request_id, first))
            elif out.finished:
                rec.status, rec.finish_reason = 200, out.finish_reason
                rec.e2e_s = now - rec.send_s
                rec.timing = self._timing(track, now)
                if w.role == "prefill":          # ended at its first token: nothing to decode
                    self.workers[track.decode_worker].engine.cancel(out.request_id)
                self._freed(track, finished=True)

    def _freed(self, track: _Track, finished: bool) -> None:
        """The request's decode (or mixed) worker gave back its KV: the router hears of it."""
        if self.gate is not None and track.decode_worker is not None:
            w = self.workers[track.decode_worker]
            blocks = -(-(len(track.prompt) + track.record.output_tokens)
                       // w.engine.config.block_size)
            self.gate.freed(w, blocks, finished)

    def _token(self, track: _Track, now: float) -> None:
        rec = track.record
        if track.first_token_s is None:
            track.first_token_s = now
            rec.ttft_s = now - rec.send_s
        elif track.last_token_s is not None:
            rec.itl_s.append(now - track.last_token_s)
        track.last_token_s = now
        rec.output_tokens += 1

    def _kv_landed(self, data: tuple[str, int]) -> None:
        rid, first = data
        track = self.tracks[rid]
        track.landed_s = self.clock.now
        prefill = self.workers[track.prefill_worker]
        decode = self.workers[track.decode_worker]
        prefill.engine.release(rid)
        decode.engine.start_decode(rid, first)
        if self.gate is not None:
            n = len(track.prompt)
            self.gate.kv_written(prefill, n * self.gate.kv_bytes_per_token, self.transfer_s(n))
        self._kick(prefill)              # pages freed: a queued prompt may now be admitted
        self._kick(decode)

    # --------------------------------------------------------------- records
    def _fail(self, track: _Track, status: int, error: str, detail: str,
              retry_after_s: float | None = None) -> None:
        rec = track.record
        rec.status, rec.error, rec.detail = status, error, detail[:300]
        rec.retry_after_s = retry_after_s
        rec.ttft_s = None

    def _timing(self, track: _Track, now: float) -> dict[str, float]:
        first = track.first_token_s if track.first_token_s is not None else now
        decode_from = track.landed_s if track.landed_s is not None else first
        return {"queue_s": track.queue_s, "prefill_s": track.prefill_s,
                "transfer_s": decode_from - first, "decode_s": now - decode_from,
                "ttft_s": first - track.record.send_s, "e2e_s": now - track.record.send_s,
                "wait_queue_s": 0.0}

    def _strand_unfinished(self) -> None:
        """Requests still open when no event is left could never finish (a bug, or a request no
        worker can ever hold): they end as the load tester's timeouts do."""
        for track in self.tracks.values():
            rec = track.record
            if rec.status == 0 and rec.error is None:
                rec.error, rec.detail = "timeout", "never finished in the simulation"

    def _result(self) -> RunResult:
        records = [t.record for t in self.tracks.values()]
        records.sort(key=lambda r: r.index)
        if self.gate is not None:
            self.gate.finish(records)
        meta = {"workload": self.spec.name, "workload_path": self.spec.path, "seed": self.spec.seed,
                "scale": {"rate": self.spec.scale.rate, "prompt": self.spec.scale.prompt,
                          "output": self.spec.scale.output},
                "duration_s": max(self.end_s, 1e-9), "planned_duration_s": self.spec.duration_s,
                "requests": len(records), "endpoint": f"sim:{self.cfg.fleet}",
                "model": self.cfg.model, "simulated": True, "steps": self.steps,
                "fleet": str(self.cfg.fleet), "send_lag_p99_s": 0.0}
        return RunResult(meta, slo_table(self.spec), {t.name: t.weight for t in self.spec.tenants},
                         records)

    # ----------------------------------------------------------------- stats
    def _stats(self) -> list[pb.WorkerStats]:
        return [worker_stats(w.worker_id, w.role, w.engine) for w in self.workers]

    def _by_id(self, worker_id: str) -> _Worker:
        return next(w for w in self.workers if w.worker_id == worker_id)


def worker_stats(worker_id: str, role: str, engine) -> pb.WorkerStats:
    """What the worker would heartbeat (services/worker/servicer.py, stats): the fields the
    router's placement reads, each read where `engine.stats()` reads it. Placement asks at every
    arrival, so the rest of `stats()` (its scans of every running sequence and tenant) is left
    out: it was over a tenth of a simulated run's CPU time."""
    sched, pool = engine.scheduler, engine.pool
    out = pb.WorkerStats(worker_id=worker_id, role=role, kv_blocks_total=pool.num_blocks,
                         kv_blocks_free=pool.num_free, kv_blocks_used=pool.num_used,
                         kv_blocks_reserved=pool.num_reserved, num_running=len(sched.running),
                         num_queued=sched.num_queued(),
                         queued_prefill_tokens=sched.queued_prefill_tokens(),
                         block_size=engine.config.block_size,
                         max_model_len=engine.max_model_len)
    # a hybrid's path choice prices a chat behind the tokens its class waits for, not the
    # documents queued below it (services/router/path_choice.py)
    out.queued_prefill_tokens_ahead.update(sched.prefill_tokens_ahead())
    out.prefill_step_tokens_ahead.update(sched.prefill_step_tokens_ahead())
    return out


def _pb_params(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=params.max_tokens, n=max(1, params.n))


# ------------------------------------------------------------------- entry
@dataclass(frozen=True)
class SimOutcome:
    run: RunResult
    wall_s: float                # setting the fleet up and running it
    setup_s: float               # of which setting up (engines, block pools)
    simulated_s: float
    steps: int
    admission: dict | None = None    # the router's admission fields for the summary, when on

    @property
    def speedup(self) -> float:
        """Simulated seconds per wall second of the event loop (setup excluded)."""
        loop = self.wall_s - self.setup_s
        return self.simulated_s / loop if loop > 0 else math.inf


def simulate(spec: WorkloadSpec, cfg: SimRunConfig) -> SimOutcome:
    timer, transfer_s = timing_of(cfg)
    if cfg.overhead is not None:
        timer, transfer_s = cfg.overhead.applied(timer, transfer_s)
    sim_cfg = cfg
    if cfg.sim.profile is not None and cfg.sim.kv_tokens is None and not cfg.engine.num_blocks:
        # a profile of this machine: the served model's own KV capacity, as its real worker has
        sim_cfg = replace(cfg, sim=replace(cfg.sim, kv_tokens=served_kv_tokens(cfg)))
    t0 = time.perf_counter()
    sim = Simulation(spec, sim_cfg, timer, transfer_s,
                     kv_bytes_per_token=kv_bytes_per_token_of(sim_cfg, timer))
    t1 = time.perf_counter()
    run = sim.run()
    t2 = time.perf_counter()
    run.meta["target"] = target_meta(sim_cfg.sim)    # meta holds no wall time: same seed, same file
    if sim.gate is not None:
        run.meta["router_refused"] = sim.gate.refused_indices()
    return SimOutcome(run, wall_s=t2 - t0, setup_s=t1 - t0, simulated_s=sim.end_s, steps=sim.steps,
                      admission=sim.gate.summary() if sim.gate is not None else None)


def kv_bytes_per_token_of(cfg: SimRunConfig, timer) -> int:
    """The KV bytes a token a simulated worker publishes: the target's, else the served model's."""
    target = getattr(timer, "target", None)
    return target.kv_bytes_per_token if target is not None else served_kv_bytes_per_token(cfg)


def hybrid_threshold(cfg: SimRunConfig) -> int:
    """The hybrid split: the configured one, else the capacity model's for a target (a profile or
    a fixed step has no target: the router's default)."""
    if cfg.hybrid_threshold_tokens:
        return cfg.hybrid_threshold_tokens
    sim = cfg.sim
    if sim.step_s is not None or sim.profile is not None:
        return DEFAULT_THRESHOLD_TOKENS
    from services.planner.capacity import CostModel  # noqa: PLC0415
    return threshold_tokens(CostModel.for_target(model=sim.target_model, gpu=sim.gpu, tp=sim.tp,
                                                 dtype=sim.dtype, kv_dtype=sim.kv_dtype))


def timing_of(cfg: SimRunConfig) -> tuple[StepTimer, Callable[[int], float]]:
    """The step timer and the KV transfer time (seconds for a prompt of n tokens)."""
    sim, gbps = cfg.sim, cfg.sim.network_gbps
    if sim.step_s is not None:
        from services.planner.step_time import FixedStepTimer  # noqa: PLC0415
        timer = FixedStepTimer(sim.step_s)
    elif sim.profile is not None:
        from services.planner.profile import StepProfile  # noqa: PLC0415
        timer = StepProfile.load(sim.profile)
    else:
        from services.planner.capacity import CostModel  # noqa: PLC0415
        model = CostModel.for_target(model=sim.target_model, gpu=sim.gpu, tp=sim.tp,
                                     dtype=sim.dtype, kv_dtype=sim.kv_dtype)
        return model, lambda n: model.transfer_s(n, gbps)
    per_token = served_kv_bytes_per_token(cfg)
    return timer, lambda n: n * per_token / (gbps * 1e9 / 8)


def served_kv_bytes_per_token(cfg: SimRunConfig) -> int:
    """The served model's KV bytes per token (all layers, K and V) at its checkpoint dtype."""
    from services.engine.engine import resolve_model_dir  # noqa: PLC0415
    from services.engine.model.config import ModelConfig  # noqa: PLC0415
    from services.engine.kv_array import kv_bytes_per_token  # noqa: PLC0415
    mc = ModelConfig.from_dir(resolve_model_dir(cfg.model))
    return kv_bytes_per_token(mc, mc.torch_dtype or "float32")


def served_kv_tokens(cfg: SimRunConfig) -> int:
    """The tokens of KV the served model's real worker holds in its kv_cache_mib."""
    return max(1, (cfg.engine.kv_cache_mib << 20) // served_kv_bytes_per_token(cfg))


def target_meta(sim: SimConfig) -> dict:
    if sim.step_s is not None:
        return {"step_s": sim.step_s}
    if sim.profile is not None:
        return {"profile": sim.profile, "network_gbps": sim.network_gbps}
    return {"model": sim.target_model, "gpu": sim.gpu, "tp": sim.tp, "dtype": sim.dtype,
            "kv_dtype": sim.kv_dtype or sim.dtype, "network_gbps": sim.network_gbps}
