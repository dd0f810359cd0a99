"""The router's admission policy (DESIGN.md sections 2, 5 and 6): what a request may do at the
fleet's stage, and whether a prediction admits it, queues it or refuses it. Pure functions over
one frozen config; services/router/service.py applies them.

For each request, in order:
  1. its class (`TrafficClass`, from the engine config) and tenant (`critical`, `min_kv_blocks`);
     a *protected* request (a critical tenant, or a tenant under its guaranteed KV) may use the
     headroom kept back from everyone else and is served at every stage;
  2. the stage: S4 refuses every unprotected request early; S1 and up hold unprotected batch
     requests in the queue (to their deadline); S2 and up cap a degradable class's max_tokens to
     `s2_output_cap`; S3 sends degradable classes to a fallback pool when one exists, otherwise
     it behaves as S2 and says so;
  3. the prediction (services/router/predict.py) against the class's TTFT target:
       total <= target                       admit (reserve as before);
       total > target, best case <= target   wait in the queue, at most until the moment the best
                                             case would still make the target (and never past the
                                             Admit call's own bound);
       best case > target                    refuse now, naming the term and the seconds.
     The best case is the prediction without the terms that drain (queue wait, decode slot).
     A best case priced by a worker's *prior* (its fit has measured no step yet, or still prices
     the steps it measured more than `probe_ratio` x slower than they ran: `prefill_fit_ratio`)
     is not a measured refusal: an idle such worker (nothing queued, running or placed since its
     beat) takes the request anyway as a *probe*, one at a time per worker and router (`Probes`),
     so that it measures its steps and the next decisions use them. Without it a prior too
     pessimistic for the target refused every request, the worker never ran a step, and the
     fleet stayed cold forever. The bound is safe: a probe may miss its target, but it is one
     request on an otherwise idle worker (nothing else waits behind it there), and what refused
     it was a guess, not a measurement; and while the fit prices slower than the steps ran, the
     probe's own prefill is likely faster than priced. A worker whose fit prices its measured
     steps within `probe_ratio` is never probed (the policy is the measured one), nor a
     request whose best case misses by more than `probe_slack` x its target (a prior that far
     off is not what refused it: the prompt is too long for the class).
     The KV transfer is not part of the TTFT (the first token leaves before the KV moves), but
     the KV must land while the decode reservation holds: a prompt whose transfer takes longer
     than `kv_write_limit_s` is refused now ("kv transfer").
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, Tenant, TrafficClass
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts
from services.router.predict import Prediction, Prior
from services.router.stages import S1, S2, S3, S4, StageConfig

DEFAULT_CLASS = INTERACTIVE        # a request naming no class is judged as interactive
KV_TRANSFER = "kv transfer"        # the refusal's term when the KV could not land in time


@dataclass(frozen=True)
class AdmissionConfig:
    classes: tuple[TrafficClass, ...] = (INTERACTIVE, DOCUMENT, BATCH)
    tenants: tuple[Tenant, ...] = ()
    batch_class: str = "batch"          # what S1 holds back
    s2_output_cap: int = 256            # max_tokens of a degradable class from S2 on
    headroom_kv_fraction: float = 0.05  # of every decode pool: only protected requests use it
    headroom_slot_fraction: float = 0.05  # of a decode worker's batch (max_running, see below)
    max_running: int = 256              # a decode worker's batch limit (the engine's max_running)
    wake_width: int = 4                 # waiters of a class that try on a wake-up (fair order)
    retry_s: float = 2.0                # the safety net: a waiter retries this often without one
    keeper_every_s: float = 0.5         # the stage keeper's period
    ttft_window_s: float = 10.0         # predictions that make the ttft_pressure signal
    # a worker whose fit prices its recent measured steps more than this x slower than they ran
    # still prices by its prior (the worker's CostFit forgets its prior only by 0.98 a step, and
    # steps of one size teach it only their own direction: a SmolLM2 prior on a fast worker still
    # priced a chat 1.25 s after 8 steps of 16 ms); such a worker, idle, takes a probe
    probe_ratio: float = 1.5
    probe_hold_s: float = 10.0          # a probe whose step is not measured by then frees its slot
    # a probe's best case is at most this x its target: a prior that far off is a guess to test
    # (the CPU defaults are x1.5 and warm-up profiles x2 of what was measured), one further off
    # is a prompt that cannot make it (a 131K-token document against a 10-s target). 1: no
    # probes (the policy before them)
    probe_slack: float = 4.0
    prior: Prior = field(default_factory=Prior)
    stages: StageConfig = field(default_factory=StageConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.headroom_kv_fraction < 1 or not 0 <= self.headroom_slot_fraction < 1:
            raise ValueError("headroom fractions must be in [0, 1)")
        if self.s2_output_cap < 1 or self.wake_width < 1 or self.max_running < 1:
            raise ValueError("s2_output_cap, wake_width and max_running must be >= 1")
        if not self.probe_ratio >= 1 or not self.probe_hold_s > 0 or not self.probe_slack >= 1:
            raise ValueError("probe_ratio and probe_slack must be >= 1, probe_hold_s > 0")
        if not self.retry_s > 0 or not self.keeper_every_s > 0 or not self.ttft_window_s > 0:
            raise ValueError("retry_s, keeper_every_s and ttft_window_s must be > 0")
        bad = [t.name for t in self.tenants if not t.weight > 0]
        if bad:      # the wait queue's fair order gives a tenant turns of 1 / weight
            raise ValueError(f"tenant weights must be > 0: {', '.join(bad)}")

    def traffic_class(self, name: str) -> TrafficClass:
        return next((c for c in self.classes if c.name == name), DEFAULT_CLASS)

    def tenant(self, name: str) -> Tenant:
        return next((t for t in self.tenants if t.name == name), Tenant(name or "default"))


@dataclass(frozen=True, slots=True)
class StageRule:
    """What the stage does to one request."""
    refuse: bool = False            # S4: refused early
    hold: bool = False              # S1+: waits in the queue whatever the prediction says
    output_cap: int = 0             # S2+: max_tokens capped to this (0: no cap)
    note: str = ""                  # said on the plan's span and in a refusal


def stage_rule(cfg: AdmissionConfig, stage: int, cls: TrafficClass, protected: bool,
               max_tokens: int, fallback_pool: bool = False) -> StageRule:
    if protected or stage < S1:
        return StageRule()
    if stage >= S4:
        return StageRule(refuse=True, note="S4: early refusal of all but critical tenants")
    hold = cls.name == cfg.batch_class
    cap, note = 0, "S1: batch waits" if hold else ""
    if stage >= S2 and cls.degradable and max_tokens > cfg.s2_output_cap:
        cap, note = cfg.s2_output_cap, f"S2: output capped to {cfg.s2_output_cap} tokens"
    if stage >= S3 and cls.degradable and not fallback_pool:
        note = "S3 without a fallback pool: " + (note or "as S2")
    return StageRule(hold=hold, output_cap=cap, note=note)


def tenant_kv(workers: Sequence[pb.WorkerStats],
              placed: Mapping[str, int] | None = None) -> dict[str, int]:
    """Decode KV blocks each tenant holds fleet-wide: the workers' published shares, plus
    `placed` (blocks by tenant routers placed since those beats: placements.tenant_blocks)."""
    out: dict[str, int] = dict(placed or {})
    for w in workers:
        if w.role in ("decode", "mixed"):
            for share in w.tenants:
                out[share.tenant] = out.get(share.tenant, 0) + share.kv_blocks
    return out


def protected(tenant: Tenant, held: Mapping[str, int], blocks: int) -> bool:
    """Critical, or still under its guaranteed KV with this request's blocks."""
    return tenant.critical or held.get(tenant.name, 0) + blocks <= tenant.min_kv_blocks


def fits_outside_headroom(cfg: AdmissionConfig, w: pb.WorkerStats, free_blocks: int,
                          running: int, blocks: int) -> bool:
    """Whether an unprotected request's `blocks` leave the protected headroom of `w` free."""
    kv_kept = math.ceil(cfg.headroom_kv_fraction * w.kv_blocks_total)
    slots_kept = math.ceil(cfg.headroom_slot_fraction * cfg.max_running)
    kv_ok = kv_kept == 0 or free_blocks - blocks >= kv_kept     # none kept: the Reserve decides
    slots_ok = slots_kept == 0 or running + 1 <= cfg.max_running - slots_kept
    return kv_ok and slots_ok


def best_case_s(p: Prediction) -> float:
    """The predicted TTFT once everything ahead of it has drained: its own prefill."""
    return p.prefill_s


def kv_write_limit_s(timeouts: Timeouts, target_s: float, p: Prediction) -> float:
    """The longest the KV of a prompt predicted as `p` may take to move to its decode worker:
    one write's limit (`kv_transfer_s`), and what the decode reservation's lifetime leaves after
    the write's margin and the prompt's first token, at the soonest (its best case: a wait in
    the queue does not make the transfer any shorter)."""
    lifetime = timeouts.reservation_for(target_s) - timeouts.kv_deadline_margin_s
    return min(timeouts.kv_transfer_s, lifetime - best_case_s(p))


def explain_transfer(p: Prediction, limit_s: float, stage_name: str) -> str:
    return (f"kv transfer: predicted {p.transfer_s:.3g} s to move the KV vs the {limit_s:.3g} s "
            f"its decode reservation allows (stage {stage_name})")


def wait_until(now: float, target_s: float, p: Prediction, bound_s: float) -> float:
    """The last moment (same clock as `now`) a waiter still tries: its best case must still make
    the target from then, and the Admit call's own bound holds."""
    return now + max(0.0, min(target_s - best_case_s(p), bound_s))


def explain(term: str, predicted_s: float, target_s: float, stage_name: str) -> str:
    return (f"{term}: predicted TTFT {predicted_s:.3g} s vs target {target_s:.3g} s "
            f"(stage {stage_name})")


def unmeasured(cfg: AdmissionConfig, w: pb.WorkerStats) -> bool:
    """Whether `w`'s published costs are still its prior's: its fit has measured no prefill step,
    or prices the ones it measured more than `probe_ratio` x slower than they ran."""
    return w.prefill_fit_steps == 0 or w.prefill_fit_ratio > cfg.probe_ratio


def idle(w: pb.WorkerStats) -> bool:
    """Nothing queued or running on `w` (as published, with what routers placed since its beat
    counted in: placements.PlacedPrompts.onto)."""
    return not (w.num_running or w.num_queued or w.queued_prefill_tokens)


class Probes:
    """The probe in flight on each worker (at most one): taken when a probe is admitted there,
    free again once the worker publishes more measured steps than it had then (the probe's
    prefill was measured), or `hold_s` after it was taken (the probe went nowhere), or given
    back at once when its plan was not made."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s, self.clock = hold_s, clock
        self._held: dict[str, tuple[int, float]] = {}    # worker id -> (its fit steps, taken at)

    def busy(self, w: pb.WorkerStats) -> bool:
        held = self._held.get(w.worker_id)
        if held is None:
            return False
        steps, at = held
        if w.prefill_fit_steps > steps or self.clock() - at >= self.hold_s:
            del self._held[w.worker_id]
            return False
        return True

    def take(self, w: pb.WorkerStats) -> bool:
        """Hold `w`'s probe slot; False when a probe is already in flight there."""
        if self.busy(w):
            return False
        self._held[w.worker_id] = (w.prefill_fit_steps, self.clock())
        return True

    def give_back(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

    def in_flight(self) -> int:
        return len(self._held)


def probe(cfg: AdmissionConfig, probes: Probes, w: pb.WorkerStats, p: Prediction,
          target_s: float) -> bool:
    """Whether a request whose best case `p` breaks `target_s` (by at most `probe_slack` x) on
    prefill worker `w` goes as a probe (module docstring), taking `w`'s probe slot if so."""
    return (target_s < best_case_s(p) <= cfg.probe_slack * target_s and unmeasured(cfg, w)
            and idle(w) and probes.take(w))
