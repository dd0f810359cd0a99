"""The measured step profile: the fit, its file, and `kvfleet sim calibrate` on a real engine."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.planner.profile import TERMS, ProfileError, StepProfile, features, fit_profile
from services.planner.step_time import BatchShape

KNOWN = {"const": 2e-3, "prefill_tokens": 40e-6, "prefill_seqs": 0.3e-3, "decodes": 50e-6,
         "prefill_attention_pairs": 2e-9, "decode_context_tokens": 0.4e-6}


def random_batches(rng: np.random.Generator, n: int) -> list[BatchShape]:
    batches = []
    for _ in range(n):
        chunks = tuple((int(rng.integers(1, 512)), int(rng.integers(0, 4096)))
                       for _ in range(rng.integers(0, 4)))
        decodes = tuple(int(c) for c in rng.integers(1, 4096, size=rng.integers(0, 64)))
        if chunks or decodes:
            batches.append(BatchShape(chunks, decodes))
    return batches


def true_time(batch: BatchShape) -> float:
    return sum(KNOWN[t] * x for t, x in zip(TERMS, features(batch)))


def test_the_fit_recovers_known_coefficients_from_exact_steps():
    batches = random_batches(np.random.default_rng(0), 300)
    profile = fit_profile([(b, true_time(b)) for b in batches])
    for term, c in KNOWN.items():
        assert profile.coefficients[term] == pytest.approx(c, rel=1e-6)
    assert profile.fit.max_abs_rel_error < 1e-6
    assert profile.fit.outliers == 0


def test_the_fit_sees_through_noise_and_leaves_bursts_of_load_out():
    rng = np.random.default_rng(1)
    batches = random_batches(rng, 400)
    times = [true_time(b) * rng.normal(1.0, 0.03) for b in batches]
    for i in range(0, 400, 40):          # a tenth of the steps ran while the box was busy
        times[i] *= 6.0
    profile = fit_profile(list(zip(batches, times)))
    for term in ("const", "prefill_tokens"):
        assert profile.coefficients[term] == pytest.approx(KNOWN[term], rel=0.1)
    errors = [abs(profile.step_s(b) / true_time(b) - 1) for b in batches]
    assert np.mean(errors) < 0.02      # the noise-free truth, bursts and all, within 2%
    assert profile.fit.outliers >= 10
    assert profile.fit.mean_abs_rel_error < 0.05


def test_a_term_that_would_come_out_negative_is_dropped():
    # times that fall with decode context: no physical meaning, so the term goes
    batches = [BatchShape((), tuple([c] * d)) for d in (1, 4, 16) for c in (16, 256, 2048)]
    profile = fit_profile([(b, 1e-3 + 1e-4 * b.num_decodes - 1e-8 * sum(b.decode_contexts))
                           for b in batches])
    assert "decode_context_tokens" not in profile.coefficients
    assert all(c >= 0 for c in profile.coefficients.values())


@given(st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 8192)), max_size=4),
       st.lists(st.integers(1, 8192), max_size=64))
def test_a_profile_step_is_never_negative_and_an_empty_batch_takes_no_time(chunks, decodes):
    profile = StepProfile(KNOWN)
    batch = BatchShape(tuple(chunks), tuple(decodes))
    assert profile.step_s(batch) >= 0
    if batch.is_empty:
        assert profile.step_s(batch) == 0.0
    else:
        assert profile.step_s(batch) >= KNOWN["const"]


def test_save_and_load_round_trip(tmp_path):
    batches = random_batches(np.random.default_rng(2), 50)
    profile = fit_profile([(b, true_time(b)) for b in batches], model="tiny", dtype="float32",
                          threads=2, machine={"cpu": "test"})
    profile.save(tmp_path / "p.json")
    again = StepProfile.load(tmp_path / "p.json")
    assert again == profile
    assert again.step_s(batches[0]) == profile.step_s(batches[0])


@pytest.mark.parametrize("content, says", [
    ("not json", "not JSON"),
    ('{"coefficients": {}}', "not a step profile"),
    ('{"format": "kvfleet-step-profile/1", "coefficients": {"flops": 1.0}}', "unknown profile term"),
    ('{"format": "kvfleet-step-profile/1", "coefficients": {"const": -1.0}}', ">= 0"),
])
def test_a_bad_profile_file_is_a_clear_error(tmp_path, content, says):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=says):
        StepProfile.load(path)
    with pytest.raises(ProfileError, match="cannot read"):
        StepProfile.load(tmp_path / "missing.json")


def test_too_few_steps_to_fit_is_a_clear_error():
    with pytest.raises(ProfileError, match="at least"):
        fit_profile([(BatchShape((), (5,)), 1e-3)])


def test_calibrate_quick_on_a_small_model_writes_a_usable_profile(tmp_path):
    from services.engine.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "model", seed=0, layers=2, hidden=64, heads=4, kv_heads=2,
                            vocab=600, max_positions=2048, intermediate=128)
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "services.cli.cli", "sim", "calibrate",
                           "--model", str(model), "--quick", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "R^2" in done.stdout and "profile written" in done.stdout
    profile = StepProfile.load(out)
    assert profile.threads == 1 and profile.dtype == "float32" and profile.machine["cpu"]
    assert profile.fit.samples >= len(TERMS)
    decode = profile.step_s(BatchShape((), (100,) * 8))
    prefill = profile.step_s(BatchShape(((256, 0),), ()))
    assert decode > 0 and prefill > 0
    assert json.loads(out.read_text())["model"] == str(model)


def test_calibrate_refuses_bad_arguments_clearly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli.cli", "sim", "calibrate",
                           "--threads", "0", "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--threads must be >= 1" in done.stderr
