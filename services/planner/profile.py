"""A measured step profile: this machine's real engine, fitted by batch composition.

`kvfleet sim calibrate` (services/planner/calibrate.py) runs the real in-process engine through a
grid of batches and records each step's measured duration with its `BatchShape`; `fit_profile`
fits a linear model of the shape's terms by weighted least squares (relative error):

    step_s ~ c[const]
           + c[prefill_tokens]          * new tokens of the prefill chunks
           + c[prefill_seqs]            * prefill chunks (each samples or gathers its own rows)
           + c[decodes]                 * decoding sequences
           + c[prefill_attention_pairs] * (query, key) pairs the chunks attend over
           + c[decode_context_tokens]   * tokens the decodes attend over (sum of contexts)

A term whose coefficient comes out negative is dropped and the rest refitted (a time can only add
up), so every coefficient kept is >= 0; then steps far off the fit (a burst of load on a shared
machine) are left out once and the rest refitted. The result is a `StepTimer`, saved to and loaded from
JSON with the model, dtype, threads and machine it was measured on and the fit's residuals.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from services.engine.scheduler import attention_pairs
from services.planner.step_time import BatchShape

TERMS = ("const", "prefill_tokens", "prefill_seqs", "decodes", "prefill_attention_pairs",
         "decode_context_tokens")
FORMAT = "kvfleet-step-profile/1"


class ProfileError(ValueError):
    """A profile file that cannot be used, or data that cannot be fitted."""


def features(batch: BatchShape) -> list[float]:
    """The batch's value of each of TERMS, in order."""
    return [1.0, float(batch.prefill_tokens), float(len(batch.prefill_chunks)),
            float(batch.num_decodes),
            float(sum(attention_pairs(start, n) for n, start in batch.prefill_chunks)),
            float(sum(batch.decode_contexts))]


@dataclass(frozen=True)
class FitQuality:
    """How well the fit reproduces the steps it was fitted on (relative error = |fit - measured|
    / measured)."""

    samples: int                 # steps the fit was made on
    outliers: int                # steps left out of the refit (far off the first fit)
    r2: float
    rms_residual_s: float
    mean_abs_rel_error: float
    p90_abs_rel_error: float
    max_abs_rel_error: float
    total_rel_error: float       # (sum of fitted - sum of measured) / sum of measured


@dataclass(frozen=True)
class StepProfile:
    """A `StepTimer` from a fit of measured steps. `coefficients` maps a term of TERMS to seconds
    per unit; absent terms count 0."""

    coefficients: dict[str, float]
    model: str = ""
    dtype: str = ""
    threads: int = 0
    machine: dict = field(default_factory=dict)
    fit: FitQuality | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ProfileError(f"unknown profile term(s) {sorted(unknown)}; known: {list(TERMS)}")
        bad = {k: v for k, v in self.coefficients.items()
               if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0}
        if bad:
            raise ProfileError(f"profile coefficients must be finite numbers >= 0, got {bad}")

    def step_s(self, batch: BatchShape) -> float:
        if batch.is_empty:
            return 0.0
        return sum(self.coefficients.get(t, 0.0) * x for t, x in zip(TERMS, features(batch)))

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": FORMAT, "coefficients": dict(self.coefficients), "model": self.model,
                "dtype": self.dtype, "threads": self.threads, "machine": self.machine,
                "fit": asdict(self.fit) if self.fit else None, "notes": self.notes}

    @classmethod
    def from_dict(cls, d: object) -> "StepProfile":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"not a step profile (expected \"format\": {FORMAT!r})")
        if not isinstance(d.get("coefficients"), dict):
            raise ProfileError("step profile: `coefficients` must be a mapping term -> seconds")
        try:
            fit = FitQuality(**d["fit"]) if d.get("fit") else None
        except TypeError as e:
            raise ProfileError(f"step profile: bad `fit` ({e})") from None
        return cls(coefficients=d["coefficients"], model=str(d.get("model", "")),
                   dtype=str(d.get("dtype", "")), threads=int(d.get("threads", 0)),
                   machine=dict(d.get("machine") or {}), fit=fit, notes=str(d.get("notes", "")))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "StepProfile":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ProfileError(f"cannot read step profile {path}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None


def fit_profile(samples: Sequence[tuple[BatchShape, float]], terms: Sequence[str] = TERMS,
                relative: bool = True, **meta) -> StepProfile:
    """Least-squares fit of measured (batch, seconds) samples over `terms`, weighted by
    1 / seconds so that short decode steps count as much as long prefills (the fit minimises
    relative error). Negative coefficients are dropped one at a time (the most negative first)
    and the rest refitted. `relative=False`: unweighted (absolute error), every step kept (a
    fleet's steps under load: their total is what the simulated queues feel). `meta`:
    StepProfile's model, dtype, threads, machine, notes."""
    rows = [(features(b), s) for b, s in samples if not b.is_empty]
    if len(rows) < len(terms):
        raise ProfileError(f"need at least {len(terms)} non-empty measured steps, got {len(rows)}")
    if any(not (math.isfinite(s) and s > 0) for _, s in rows):
        raise ProfileError("measured step times must be finite and > 0")
    index = [TERMS.index(t) for t in terms]
    x = np.array([[f[i] for i in index] for f, _ in rows])
    y = np.array([s for _, s in rows])
    keep, coef = _nonnegative_fit(x, y, relative)
    # one trimmed refit: steps a burst of load stretched far past the fit are left out
    rel = np.abs(x[:, keep] @ coef - y) / y
    inliers = rel <= max(OUTLIER_FACTOR * float(np.median(rel)), OUTLIER_FLOOR)
    if not relative:
        inliers[:] = True
    if inliers.sum() >= len(terms) and not inliers.all():
        keep, coef = _nonnegative_fit(x[inliers], y[inliers])
    coefficients = {terms[k]: float(c) for k, c in zip(keep, coef)}
    fit = _quality(x[inliers][:, keep] @ coef, y[inliers], outliers=int((~inliers).sum()))
    return StepProfile(coefficients, fit=fit, **meta)


OUTLIER_FACTOR = 4.0    # a step off the fit by this many times the median relative error ...
OUTLIER_FLOOR = 0.25    # ... and by at least 25% is an outlier


def _nonnegative_fit(x: np.ndarray, y: np.ndarray,
                     relative: bool = True) -> tuple[list[int], np.ndarray]:
    """The columns kept and their coefficients, all >= 0 (the most negative dropped first)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = _weighted_lstsq(x[:, keep], y, relative)
        if (coef >= 0).all():
            return keep, coef
        keep.pop(int(np.argmin(coef)))
        if not keep:
            raise ProfileError("no term fits the measured steps with a non-negative coefficient")


def _weighted_lstsq(x: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    w = 1.0 / y if relative else np.ones_like(y)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)      # columns to unit size: conditioning
    coef, *_ = np.linalg.lstsq(x * w[:, None] / scale, y * w, rcond=None)
    return coef / scale


def _quality(fitted: np.ndarray, y: np.ndarray, outliers: int) -> FitQuality:
    rel = np.abs(fitted - y) / y
    ss_res = float(((fitted - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return FitQuality(samples=len(y), outliers=outliers, r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                      rms_residual_s=math.sqrt(ss_res / len(y)),
                      mean_abs_rel_error=float(rel.mean()),
                      p90_abs_rel_error=float(np.percentile(rel, 90)),
                      max_abs_rel_error=float(rel.max()),
                      total_rel_error=float((fitted.sum() - y.sum()) / y.sum()))
