"""The online step-time model: it learns a linear step time from noisy measured steps, never
predicts a negative time, is monotone in batch size and context, and one outlier step moves it
a bounded amount."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from services.engine.step_model import (DEFAULT_PRIOR, StepCoefficients, StepModel,
                                        StepModelConfig)
from services.planner.capacity import CostModel
from services.planner.step_time import BatchShape, FixedStepTimer

coefficient = st.tuples(
    st.floats(1e-4, 2e-2),     # fixed
    st.floats(1e-5, 1e-3),     # per decode
    st.floats(1e-9, 1e-6),     # per context token
    st.floats(1e-6, 1e-4),     # per prefill token
    st.floats(1e-11, 1e-8),    # per pair
).map(lambda c: StepCoefficients(*c))


def random_shape(rng: np.random.Generator) -> BatchShape:
    decodes = tuple(int(c) for c in rng.integers(16, 8192, size=rng.integers(0, 96)))
    chunks = tuple((int(rng.integers(16, 512)), int(rng.integers(0, 16384)))
                   for _ in range(rng.integers(0, 3)))
    return BatchShape(prefill_chunks=chunks, decode_contexts=decodes or (128,))


def true_step(c: StepCoefficients, b: BatchShape) -> float:
    pairs = sum(n * k + n * (n + 1) // 2 for n, k in b.prefill_chunks)
    return (c.fixed_s + c.per_decode_s * b.num_decodes + c.per_context_token_s
            * sum(b.decode_contexts) + c.per_prefill_token_s * b.prefill_tokens
            + c.per_pair_s * pairs)


@settings(max_examples=15, deadline=None)
@given(truth=coefficient, seed=st.integers(0, 2**32 - 1))
def test_it_converges_to_a_linear_step_time_from_noisy_steps(truth, seed):
    rng = np.random.default_rng(seed)
    model = StepModel()                            # from the default prior, however far off
    steps = []
    for _ in range(1000):
        shape = random_shape(rng)
        steps.append(true_step(truth, shape))
        model.observe(shape, steps[-1] * rng.uniform(0.98, 1.02))
    # held-out shapes: within 5%, or for a small step within 1% of a typical one (the noise on
    # the large steps, a few % of them, bounds what can be known of the small ones)
    typical = float(np.mean(steps))
    for _ in range(50):
        shape = random_shape(rng)
        assert model.step_s(shape) == pytest.approx(true_step(truth, shape), rel=0.05,
                                                    abs=0.01 * typical)


def test_with_forgetting_it_follows_a_step_time_that_changed():
    rng = np.random.default_rng(7)
    before = StepCoefficients(0.004, 2e-4, 5e-8, 3e-5, 2e-9)
    after = StepCoefficients(*(2 * c for c in before.as_array()))  # a neighbour took the clocks
    model = StepModel()
    for truth in (before, after):
        for _ in range(1200):
            shape = random_shape(rng)
            model.observe(shape, true_step(truth, shape) * rng.uniform(0.98, 1.02))
    for _ in range(50):
        shape = random_shape(rng)
        assert model.step_s(shape) == pytest.approx(true_step(after, shape), rel=0.05, abs=5e-4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 200), context=st.integers(1, 32768),
       more=st.integers(1, 4096))
def test_predictions_are_never_negative_and_monotone_in_batch_size_and_context(
        seed, batch, context, more):
    rng = np.random.default_rng(seed)
    model = StepModel()
    for _ in range(int(rng.integers(0, 40))):      # any learned state, even from wild timings
        model.observe(random_shape(rng), float(rng.exponential(0.05)))
    small = model.step_s(BatchShape(decode_contexts=(context,) * batch))
    assert small >= 0.0
    assert model.step_s(BatchShape(decode_contexts=(context,) * (batch + 1))) >= small
    assert model.step_s(BatchShape(decode_contexts=(context + more,) * batch)) >= small


def test_one_outlier_step_moves_the_prediction_a_bounded_amount():
    model = StepModel(StepCoefficients(fixed_s=0.01, per_decode_s=0.001))
    shape = BatchShape(decode_contexts=(1024,) * 16)
    for _ in range(50):
        model.observe(shape, 0.03)
    before = model.step_s(shape)
    model.observe(shape, 30.0)                     # a step 1000x too long (a paused process)
    ratio = model.config.outlier_ratio
    assert before < model.step_s(shape) <= before * (1 + ratio)


def test_a_cold_model_predicts_from_its_prior():
    assert StepModel().coefficients == pytest.approx(DEFAULT_PRIOR)
    fixed = StepModel.from_timer(FixedStepTimer(0.05))
    assert fixed.step_s(BatchShape(decode_contexts=(100,) * 7)) == pytest.approx(0.05)
    assert fixed.step_s(BatchShape()) == 0.0
    cost = CostModel.for_target()                  # Llama-3-70B, H200 TP4 fp8
    prior = StepModel.from_timer(cost)
    for batch in (8, 64):
        shape = BatchShape(decode_contexts=(2048,) * batch)
        assert prior.step_s(shape) == pytest.approx(cost.step_s(shape), rel=0.5)


def test_learning_off_and_non_measurements_leave_it_unchanged():
    frozen = StepModel(config=StepModelConfig(learn=False))
    shape = BatchShape(decode_contexts=(64,))
    frozen.observe(shape, 1.0)
    assert frozen.coefficients == DEFAULT_PRIOR and frozen.observed == 0
    model = StepModel()
    for seconds in (0.0, -1.0, float("inf"), float("nan")):
        model.observe(shape, seconds)
    model.observe(BatchShape(), 1.0)
    assert model.observed == 0


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="forgetting"):
        StepModelConfig(forgetting=1.5)
    with pytest.raises(ValueError, match="outlier_ratio"):
        StepModelConfig(outlier_ratio=0)
