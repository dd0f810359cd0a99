"""An online model of one engine iteration's duration, for decode protection (docs/engine.md,
"Decode protection").

    step_s = c0 + c1 . decodes + c2 . decode context tokens + c3 . prefill tokens
                + c4 . prefill attention pairs

fitted by recursive least squares (RLS) with a forgetting factor from the engine's own measured
steps (`observe`), starting from a prior: a `StepTimer` (the cost model, a measured profile) fitted
on a grid of shapes, or `DEFAULT_PRIOR`. So a cold worker predicts from the prior, not from
nothing, and the measured steps take over within tens of steps.

Guarantees (tests/engine/test_step_model.py):
  * never negative, and monotone in every feature: predictions use the coefficients clamped at 0;
  * one outlier step moves the fit a bounded amount: its error is clipped at `outlier_ratio` times
    the prediction (a step 50x slower than predicted counts as one `1 + outlier_ratio` times);
  * bounded uncertainty: the covariance P is scaled back to its prior trace when forgetting would
    inflate it (steps of one shape only, e.g. a decode-only load, leave other directions unexcited);
  * converges to the true coefficients of a linear step time from noisy steps.

Features are scaled to about 1 at typical sizes (FEATURE_SCALE) so that P is well conditioned.
Pure arithmetic on a 5-vector (numpy); no clock, no engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.planner.step_time import BatchShape, StepTimer

# the scale of each feature: (1, decodes, decode context tokens, prefill tokens, prefill pairs)
FEATURE_SCALE = np.array([1.0, 64.0, 65536.0, 512.0, 512.0 * 4096.0])


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Seconds per unit of each feature (natural units, not scaled)."""

    fixed_s: float = 0.0             # per step
    per_decode_s: float = 0.0        # per decoding sequence
    per_context_token_s: float = 0.0  # per token a decode attends over
    per_prefill_token_s: float = 0.0
    per_pair_s: float = 0.0           # per prefill (query, key) attention pair

    def as_array(self) -> np.ndarray:
        return np.array([self.fixed_s, self.per_decode_s, self.per_context_token_s,
                         self.per_prefill_token_s, self.per_pair_s])


# A conservative default for an engine with no profile: on the high side of the tiny model on one
# CPU core (~2 ms a step, ~0.3 ms a decode), so a cold worker under-admits rather than over-admits
# until its own steps say otherwise.
DEFAULT_PRIOR = StepCoefficients(fixed_s=5e-3, per_decode_s=5e-4, per_context_token_s=2e-8,
                                 per_prefill_token_s=5e-5, per_pair_s=1e-9)

# Shapes a StepTimer prior is fitted on: decode batches by context, prefill chunks, mixed steps.
_PRIOR_GRID = tuple(
    [BatchShape(decode_contexts=(ctx,) * b) for b in (1, 8, 32, 128) for ctx in (256, 2048, 16384)]
    + [BatchShape(prefill_chunks=((n, c),)) for n in (64, 512) for c in (0, 4096, 32768)]
    + [BatchShape(prefill_chunks=((256, c),), decode_contexts=(2048,) * b)
       for b in (8, 64) for c in (0, 8192)])


def features(batch: BatchShape) -> np.ndarray:
    """The batch's unscaled feature vector."""
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in batch.prefill_chunks)
    return np.array([1.0, batch.num_decodes, sum(batch.decode_contexts), batch.prefill_tokens,
                     pairs], dtype=float)


@dataclass(frozen=True, slots=True)
class StepModelConfig:
    forgetting: float = 0.995     # RLS forgetting factor: the fit's memory is ~1 / (1 - f) steps
    prior_variance: float = 10.0  # P0 = this x I (scaled features): how little the prior weighs
    outlier_ratio: float = 2.0    # a step's error counts at most this many times the prediction
    min_prediction_s: float = 1e-3  # the floor of that bound (a near-zero prediction learns too)
    learn: bool = True            # False: predictions stay the prior's (tests with known timings)

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if not (self.prior_variance > 0 and self.outlier_ratio > 0 and self.min_prediction_s > 0):
            raise ValueError("prior_variance, outlier_ratio and min_prediction_s must be > 0")


class StepModel:
    """Predicts `step_s(batch)`; learns from `observe(batch, seconds)`. A StepTimer itself."""

    def __init__(self, prior: StepCoefficients = DEFAULT_PRIOR,
                 config: StepModelConfig = StepModelConfig()) -> None:
        self.config = config
        self._theta = prior.as_array() * FEATURE_SCALE           # coefficients, scaled features
        self._p = np.eye(len(FEATURE_SCALE)) * config.prior_variance
        self._p_trace = float(np.trace(self._p))
        self.observed = 0                                         # steps learned from

    @classmethod
    def from_timer(cls, timer: StepTimer, config: StepModelConfig = StepModelConfig()) -> StepModel:
        """A prior from another timer (cost model, profile): its least-squares fit on a grid of
        shapes, negative coefficients set to 0."""
        x = np.array([features(b) / FEATURE_SCALE for b in _PRIOR_GRID])
        y = np.array([timer.step_s(b) for b in _PRIOR_GRID])
        theta, *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(StepCoefficients(*(np.maximum(theta, 0.0) / FEATURE_SCALE)), config)

    @property
    def coefficients(self) -> StepCoefficients:
        """What predictions use now: the fit clamped at 0, in natural units."""
        return StepCoefficients(*(float(v) for v in np.maximum(self._theta, 0.0) / FEATURE_SCALE))

    def step_s(self, batch: BatchShape) -> float:
        """Predicted seconds of one iteration of `batch`; 0 for an empty batch, never negative."""
        if batch.is_empty:
            return 0.0
        return self._predict(features(batch) / FEATURE_SCALE)

    def observe(self, batch: BatchShape, seconds: float) -> None:
        """Learn from one measured step. Empty batches, and non-positive or non-finite durations
        (an injected clock that did not move), are not measurements and are ignored."""
        if not self.config.learn or batch.is_empty or not 0.0 < seconds < float("inf"):
            return
        x = features(batch) / FEATURE_SCALE
        # the fit learns from its own linear prediction (the clamp is for answers only: learning
        # against the clamped one would hide a coefficient below 0 from its own correction)
        bound = self.config.outlier_ratio * max(self._predict(x), self.config.min_prediction_s)
        error = min(seconds - float(self._theta @ x), bound)
        lam = self.config.forgetting
        px = self._p @ x
        gain = px / (lam + x @ px)
        self._theta = self._theta + gain * error
        self._p = (self._p - np.outer(gain, px)) / lam
        self._p = (self._p + self._p.T) / 2                        # keep it symmetric
        trace = float(np.trace(self._p))
        if trace > self._p_trace:
            self._p *= self._p_trace / trace
        self.observed += 1

    def _predict(self, x: np.ndarray) -> float:
        return float(np.maximum(self._theta, 0.0) @ x)
