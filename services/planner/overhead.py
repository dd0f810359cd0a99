"""The fleet's own costs, measured in a running fleet, for the discrete-event simulator.

A step profile calibrated in-process times the engine alone. In a fleet a request also crosses the
load generator, the gateway (HTTP, SSE, detokenizing), the router, two gRPC hops and the engine
core's command socket before its first token reaches the client, and on a small machine those
processes share the cores with the engine, so its steps run slower than alone. Both are measured
from a real fleet under load (`kvfleet sim calibrate --in-fleet`, services/planner/in_fleet.py):

  * the steps: every engine step the fleet ran (its shape and the time the core spent on it,
    services/worker/step_trace.py) fitted by the same model as an in-process profile
    (services/planner/profile.py), so the contention of that run is in the profile;
  * the path (`FleetOverhead.path_quantiles_s`): per request, what the fleet added to its TTFT
    beyond the engine: its client TTFT less its TTFT in the discrete-event simulation of the same
    seeded workload with the in-fleet profile (or, without such a run, less the server's queue
    and prefill times), the distribution kept as quantiles. The simulator draws one per request
    (seeded) and delays the request's arrival at the router by it: a delay spent before or after
    the engine changes the TTFT alike;
  * the hand-off (`handoff_s`, disaggregated fleets): the transfer phase the fleet measured
    beyond the modelled KV transfer time (the prefill worker's "prefilled" to the decode worker's
    start: a gRPC call, a reservation check and the transport's own set-up), added to every
    simulated transfer.

Inter-token gaps take nothing more: a token's trip from the core to the client is the same for
every token, so it leaves the gaps as the steps make them, and the CPU the streaming costs is in
the in-fleet steps.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loadtests.records import RunResult
from services.planner.step_time import BatchShape, StepTimer

FORMAT = "kvfleet-fleet-overhead/1"
QUANTILES = 21                  # the path's distribution at 0, 5, ..., 100%


class OverheadError(ValueError):
    """An overhead file that cannot be used, or a run it cannot be fitted from."""


@dataclass(frozen=True)
class FleetOverhead:
    path_quantiles_s: tuple[float, ...]    # the path's seconds at evenly spaced quantiles 0..1
    handoff_s: float = 0.0                 # per disaggregated hand-off, beyond the modelled transfer
    step_s: float = 0.0                    # per engine step, beyond the modelled step (simulated cores)
    samples: int = 0                       # requests the path was measured on
    source: str = ""                       # what it was measured on (workload, rate, load average)

    def __post_init__(self) -> None:
        q = self.path_quantiles_s
        if len(q) < 2 or any(not math.isfinite(v) or v < 0 for v in q) or list(q) != sorted(q):
            raise OverheadError("path_quantiles_s: at least 2 finite, non-negative, ascending seconds")
        for name in ("handoff_s", "step_s"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise OverheadError(f"{name} must be finite and >= 0")

    @property
    def path_mean_s(self) -> float:
        return float(np.trapezoid(self.path_quantiles_s, np.linspace(0, 1, len(self.path_quantiles_s))))

    def path_s(self, u: float) -> float:
        """The path at quantile u in [0, 1] (linear between the kept quantiles)."""
        q = self.path_quantiles_s
        return float(np.interp(u, np.linspace(0, 1, len(q)), q))

    def applied(self, timer: StepTimer, transfer_s: Callable[[int], float]
                ) -> tuple[StepTimer, Callable[[int], float]]:
        """The simulation's step timer and KV transfer time with this fleet's per-step cost and
        hand-off added."""
        if self.step_s > 0:
            timer = SlowerSteps(timer, self.step_s)
        if self.handoff_s > 0:
            base, handoff = transfer_s, self.handoff_s
            transfer_s = lambda n: base(n) + handoff  # noqa: E731
        return timer, transfer_s

    def sampler(self, seed: int) -> Callable[[], float]:
        """Seeded draws of the path, one per request in arrival order."""
        rng = np.random.default_rng(seed)
        return lambda: self.path_s(float(rng.random()))

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self), "path_mean_s": self.path_mean_s}

    @classmethod
    def from_dict(cls, d: object) -> "FleetOverhead":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise OverheadError(f"not a fleet overhead file (expected \"format\": {FORMAT!r})")
        try:
            return cls(path_quantiles_s=tuple(float(v) for v in d["path_quantiles_s"]),
                       handoff_s=float(d.get("handoff_s", 0.0)), step_s=float(d.get("step_s", 0.0)),
                       samples=int(d.get("samples", 0)),
                       source=str(d.get("source", "")))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, OverheadError):
                raise
            raise OverheadError(f"fleet overhead: bad field ({e})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "FleetOverhead":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise OverheadError(f"cannot read fleet overhead {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise OverheadError(f"{path}: not JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except OverheadError as e:
            raise OverheadError(f"{path}: {e}") from None


@dataclass(frozen=True)
class SlowerSteps:
    """A StepTimer whose every non-empty step takes `extra_s` more (the fleet's own per-step cost)."""

    timer: StepTimer
    extra_s: float

    def step_s(self, batch: BatchShape) -> float:
        base = self.timer.step_s(batch)
        return base if batch.is_empty else base + self.extra_s


def path_samples(run: RunResult) -> list[float]:
    """Per ok request with the server's phase times: client TTFT - (queue_s + prefill_s)."""
    out = []
    for r in run.records:
        t = r.timing or {}
        if r.ok and isinstance(t.get("queue_s"), (int, float)) and isinstance(t.get("prefill_s"), (int, float)):
            out.append(max(0.0, r.ttft_s - t["queue_s"] - t["prefill_s"]))
    return out


def handoff_samples(run: RunResult, transfer_s: Callable[[int], float] | None) -> list[float]:
    """Per ok disaggregated request: its measured transfer phase less the modelled transfer."""
    out = []
    for r in run.records:
        t = r.timing or {}
        if r.ok and t.get("pool") != "mixed" and isinstance(t.get("transfer_s"), (int, float)) \
                and t["transfer_s"] > 0:
            modelled = transfer_s(r.prompt_tokens) if transfer_s else 0.0
            out.append(max(0.0, t["transfer_s"] - modelled))
    return out


def _mean_kept(differences: list[float]) -> list[float]:
    """Delays from signed per-request differences: the negative ones (a request the simulation
    happened to batch later) are 0 and the rest scaled so that the mean stays the differences'
    mean (clipping alone would add to every TTFT what the negative ones took off)."""
    if not differences:
        return []
    kept = [max(0.0, d) for d in differences]
    mean, kept_mean = float(np.mean(differences)), float(np.mean(kept))
    scale = max(0.0, mean) / kept_mean if kept_mean > 0 else 0.0
    return [k * scale for k in kept]


def fit_overhead(runs: Sequence[RunResult], transfer_s: Callable[[int], float] | None = None,
                 source: str = "", baseline: RunResult | None = None,
                 per_step: bool = False) -> FleetOverhead:
    """The path's quantiles and the mean hand-off over the runs' ok requests.

    Without `baseline`, a request's path is its client TTFT less the server's queue and prefill
    times (`path_samples`). With `baseline`, the discrete-event run of the same seeded workload
    (one run in `runs`), it is the request's TTFT less the simulated TTFT of the same request
    (ok in both): everything the fleet added, its own queues included (the gateway's wait for
    the router's admission is in the server's queue time, where the first form cannot tell it
    from the engine's), and nothing the engines did. `per_step` (with `baseline`; runs on
    simulated cores, whose steps last exactly their modelled time): `step_s` is the mean
    inter-token gap the fleet added over the baseline's, the core's own work between steps and
    the streaming's contention for the CPU (a measured profile holds these already)."""
    if baseline is not None:
        simulated = {r.index: r.ttft_s for r in baseline.records if r.ok}
        paths = _mean_kept([r.ttft_s - simulated[r.index] for run in runs for r in run.records
                            if r.ok and r.index in simulated])
    else:
        paths = [p for run in runs for p in path_samples(run)]
    if len(paths) < 2:
        raise OverheadError("need at least 2 ok requests with the server's phase times to fit the "
                            "fleet's path (a kvfleet fleet sends them in `timing`)")
    handoffs = [h for run in runs for h in handoff_samples(run, transfer_s)]
    q = np.quantile(np.array(paths), np.linspace(0, 1, QUANTILES))
    step_s = 0.0
    if per_step and baseline is not None:
        gaps = [g for run in runs for r in run.records if r.ok for g in r.itl_s]
        base = [g for r in baseline.records if r.ok for g in r.itl_s]
        if gaps and base:
            step_s = max(0.0, float(np.mean(gaps) - np.mean(base)))
    return FleetOverhead(path_quantiles_s=tuple(float(v) for v in np.maximum.accumulate(q)),
                         handoff_s=float(np.mean(handoffs)) if handoffs else 0.0, step_s=step_s,
                         samples=len(paths), source=source)
