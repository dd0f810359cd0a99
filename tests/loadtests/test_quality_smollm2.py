"""The quality gate on a real model: SmolLM2-135M-Instruct on its chat eval set.

Stories: the set is well formed (chat items with gold answers); the fp32 model answers most items
right, far above the best constant answer; it passes against itself through `kvfleet eval
quality`; a copy with 2% Gaussian noise on its weights fails, and so does a copy with its last
six of thirty layers cut off; a bfloat16 copy passes under the set's thresholds.

Runtime: one scoring pass of the 52-item set takes about a minute on 2 CPU cores, so the candidates
are scored on every fourth item (`half`: 13, the same mix of kinds) and the reference's scores on it
are computed once per module (`reference`); the command-line self-check scores the first 6 items.
docs/loadtests.md has the full-set figures.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import pytest

from loadtests.quality import variants
from loadtests.quality.dataset import (SMOLLM2_DATASET, SMOLLM2_THRESHOLDS, DatasetError,
                                       load_dataset)
from loadtests.quality.gate import QualityThresholds, add_quality_args, matches_gold, run_quality, score
from loadtests.quality.scorer import EngineScorer

class ScoredOnce:
    """A scorer whose results are computed once per item list and then replayed."""

    def __init__(self, scorer: EngineScorer) -> None:
        self.scorer, self.info = scorer, scorer.info
        self._tf: dict[tuple[str, ...], list] = {}
        self._answers: dict[tuple[str, ...], list] = {}

    def teacher_forced(self, items):
        key = tuple(i.id for i in items)
        if key not in self._tf:
            self._tf[key] = self.scorer.teacher_forced(items)
        return self._tf[key]

    def greedy_answers(self, items):
        key = tuple(i.id for i in items)
        if key not in self._answers:
            self._answers[key] = self.scorer.greedy_answers(items)
        return self._answers[key]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(SMOLLM2_DATASET)


@pytest.fixture(scope="module")
def half(dataset):
    """Every fourth item (13 of 52), to keep CI's time: each candidate is a 135M-parameter model
    scored on CPU. The full-set figures are in docs/loadtests.md."""
    return dataset.items[::4]


@pytest.fixture(scope="module")
def thresholds():
    return QualityThresholds.from_file(SMOLLM2_THRESHOLDS)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    scorer = ScoredOnce(EngineScorer(str(smollm2_dir)))
    yield scorer
    scorer.scorer.close()


def judge(reference, candidate_dir, items, thresholds, dataset):
    candidate = EngineScorer(str(candidate_dir))
    try:
        report = score(reference, candidate, items, thresholds, dataset)
    finally:
        candidate.close()
    print(report.to_markdown())     # the figures, with -s
    return report


def best_constant_answer_accuracy(items) -> float:
    """Chance, for open answers: the share of items the commonest gold answer would get right."""
    counts = Counter(g.lower() for i in items for g in set(i.golds))
    return counts.most_common(1)[0][1] / len(items)


def test_the_smollm2_set_is_chat_items_with_gold_answers(dataset):
    assert 40 <= len(dataset.items) <= 60
    assert all(i.is_chat and i.match == "contains" and i.answer for i in dataset.items)
    assert best_constant_answer_accuracy(dataset.items) < 0.1


def test_contains_matches_the_gold_answer_as_whole_words_and_accepts_aliases():
    assert matches_gold("The capital of France is Paris.", ("Paris",), "contains")
    assert not matches_gold("It is a parish.", ("Paris",), "contains")
    assert matches_gold("Paris.", ("Paris",), "exact")
    assert not matches_gold("It is Paris.", ("Paris",), "exact")
    assert matches_gold("Two plus two is four", ("4", "four"), "contains")
    assert matches_gold("He was George Washington.", ("George Washington",), "contains")


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "messages": [{"role": "user", "content": "Hi"}], "continuation": "Hello", '
     '"answer": "x", "match": "fuzzy"}', "`match` must be one of exact, contains"),
    ('{"id": "a", "messages": [], "continuation": "Hello", "answer": "x"}', "`messages` must be"),
    ('{"id": "a", "messages": [{"role": "user", "content": "Hi"}], "continuation": " Hello", '
     '"answer": "x"}', "must not start with whitespace"),
    ('{"id": "a", "prompt": "Q:", "messages": [{"role": "user", "content": "Hi"}], '
     '"continuation": "Hello", "answer": "x"}', "either `prompt` or `messages`"),
])
def test_malformed_chat_items_are_named_by_file_and_line(line, message, tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_dataset(path)


def test_the_reference_passes_against_itself_through_the_command(smollm2_dir, tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_quality_args(p)
    out = tmp_path / "self.json"
    assert run_quality(p.parse_args(
        ["--reference", str(smollm2_dir), "--candidate", str(smollm2_dir), "--dataset",
         str(SMOLLM2_DATASET), "--thresholds", str(SMOLLM2_THRESHOLDS), "--limit", "6",
         "--out", str(out)])) == 0
    assert "Quality gate: PASS" in capsys.readouterr().out
    report = json.loads(out.read_text())
    m = report["metrics"]
    assert m["greedy_agreement"] == 1.0 and m["exact_match"] == 1.0 and m["gold_drop"] == 0.0
    assert {c["metric"] for c in report["checks"]} >= {"candidate_gold_accuracy", "gold_drop"}
    assert report["items"][0]["reference_answer"] == "The capital of France is Paris."


def test_the_fp32_model_answers_far_above_chance(reference, dataset, half, thresholds):
    report = score(reference, reference, half, thresholds, dataset)
    chance = best_constant_answer_accuracy(half)
    assert report.metrics["reference_gold_accuracy"] >= 0.65 > chance + 0.5


def test_weights_with_two_percent_noise_fail_the_gate(reference, smollm2_dir, dataset, half,
                                                      thresholds, tmp_path):
    """Caught by the per-token difference and the answers: the signed gap (0.03) and the
    teacher-forced agreement (0.97) alone would let it through."""
    noisy = variants.perturb(smollm2_dir, tmp_path / "noisy", relative_std=0.02)
    report = judge(reference, noisy, half, thresholds, dataset)
    assert not report.passed
    failed = {c.metric for c in report.checks if not c.passed}
    assert "mean_abs_ll_diff" in failed      # (exact match fails too on the full set: 0.63)


def test_a_model_missing_its_last_six_layers_fails_the_gate(reference, smollm2_dir, dataset, half,
                                                            thresholds, tmp_path):
    short = variants.truncate(smollm2_dir, tmp_path / "short", num_layers=24)
    report = judge(reference, short, half, thresholds, dataset)
    assert not report.passed
    failed = {c.metric for c in report.checks if not c.passed}
    assert {"abs_ll_gap", "greedy_agreement", "exact_match", "gold_drop"} <= failed


def test_a_bfloat16_copy_passes_under_the_sets_thresholds(reference, smollm2_dir, dataset, half,
                                                          thresholds, tmp_path):
    """The copy `kvfleet make-model --dtype bfloat16` writes, scored as the gate scores any DIR
    (in fp32; bf16 compute is slow on CPU: its full-set figures are in docs/loadtests.md)."""
    bf16 = variants.cast(smollm2_dir, tmp_path / "bf16", "bfloat16")
    report = judge(reference, bf16, half, thresholds, dataset)
    assert report.passed, report.to_markdown()
