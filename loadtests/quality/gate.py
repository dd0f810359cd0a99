"""`kvfleet eval quality`: score a candidate model against a reference on a small eval set.

The gate any output-changing change (a quantized or fallback model, a new kernel) must pass. Both
models see the same items (loadtests/quality/eval_set.jsonl unless --dataset names another):

  ll_gap                 reference minus candidate mean per-token log-likelihood of the
                         continuations, teacher-forced (nats/token; > 0: the candidate is worse)
  mean_abs_ll_diff       mean |reference - candidate| per-token log-likelihood over positions both
                         tokenized alike: catches changes whose signed gap cancels out
  greedy_agreement       fraction of continuation positions where the candidate's top-1 token
                         equals the reference's (teacher-forced, so one early miss costs one position)
  exact_match            fraction of items whose short greedy answer (<= 8 tokens, 16 for chat
                         items, temperature 0, cut at the first newline, stripped) equals the
                         reference's, verbatim
  *_gold_accuracy        each model's greedy answers checked against the items' gold answers by
                         each item's rule (exact, or contains as whole words; both lower-cased,
                         punctuation, articles and extra spaces dropped)
  gold_drop              reference minus candidate gold accuracy (> 0: the candidate is worse)
  *_exact_match_gold     each model's exact match against the gold answer, whatever the item's rule

Gated (QualityThresholds; defaults below, then a --thresholds YAML file, then flags):
|ll_gap| <= max_ll_gap, greedy_agreement >= min_agreement, exact_match >= min_exact_match, and,
when set, mean_abs_ll_diff <= max_ll_abs_diff, candidate_gold_accuracy >= min_gold_accuracy and
gold_drop <= max_gold_drop (the gold gates are off by default: a tiny random model scores ~0).
Items the two models tokenize differently count as disagreement at every reference position and
are left out of mean_abs_ll_diff.

Exit status: 0 every gated metric passes, 1 one fails, 2 a usage error (a missing checkpoint, an
unreadable dataset or thresholds file, an unreachable server), reported in one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from loadtests.quality.dataset import Dataset, DatasetError, EvalItem, load_dataset
from loadtests.quality.scorer import Scorer, ScorerError, TokenScores, open_scorer
from services.engine.config import KV_CACHE_DTYPES, parse_kv_cache_scales  # torch-free

REPORT_KIND = "kvfleet.quality_report"
REPORT_SCHEMA = 1


class UsageError(ValueError):
    """A bad argument (reported in one line, exit status 2)."""


class ThresholdsError(UsageError):
    """A thresholds file or flag is unreadable or out of range."""


OPTIONAL_THRESHOLDS = ("max_ll_abs_diff", "min_gold_accuracy", "max_gold_drop")
THRESHOLD_NAMES = ("max_ll_gap", "min_agreement", "min_exact_match", *OPTIONAL_THRESHOLDS)


@dataclass(frozen=True)
class QualityThresholds:
    max_ll_gap: float = 0.05              # nats/token, |reference - candidate| mean log-likelihood
    min_agreement: float = 0.95           # teacher-forced greedy token agreement
    min_exact_match: float = 0.90         # short greedy answers equal to the reference's
    max_ll_abs_diff: float | None = None  # nats/token, mean per-token |difference|; None: not gated
    min_gold_accuracy: float | None = None  # candidate's answers right by the gold; None: not gated
    max_gold_drop: float | None = None    # reference minus candidate gold accuracy; None: not gated

    def __post_init__(self) -> None:
        for name in THRESHOLD_NAMES:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_THRESHOLDS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ThresholdsError(f"threshold {name} must be a number, got {value!r}")
            if value < 0 or (name.startswith("min_") and value > 1):
                bound = "between 0 and 1" if name.startswith("min_") else ">= 0"
                raise ThresholdsError(f"threshold {name} must be {bound}, got {value}")

    @classmethod
    def from_file(cls, path: str | Path, base: QualityThresholds | None = None) -> QualityThresholds:
        """`base` (default: the defaults) with the keys of a YAML mapping overriding it."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ThresholdsError(f"cannot read thresholds file {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ThresholdsError(f"thresholds file {path} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ThresholdsError(f"thresholds file {path} must hold a mapping of threshold: value")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(map(str, data)) - known)
        if unknown:
            raise ThresholdsError(f"thresholds file {path}: unknown key(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(sorted(known))}")
        return replace(base or cls(), **data)


@dataclass(frozen=True)
class Check:
    metric: str
    value: float
    op: str            # "<=" or ">="
    threshold: float
    passed: bool


@dataclass(frozen=True)
class ItemResult:
    id: str
    tokens: int                       # reference continuation tokens
    aligned: bool                     # both models tokenized the continuation alike
    reference_ll: float               # summed over the item's continuation tokens
    candidate_ll: float
    agreement: int                    # positions whose top-1 tokens agree
    reference_answer: str
    candidate_answer: str
    gold: str
    match: str                        # the item's gold rule: exact or contains
    reference_gold: bool              # the answer is right by that rule
    candidate_gold: bool


@dataclass(frozen=True)
class QualityReport:
    reference: dict
    candidate: dict
    dataset: dict
    counts: dict
    metrics: dict
    thresholds: QualityThresholds
    checks: tuple[Check, ...]
    items: tuple[ItemResult, ...]
    elapsed_s: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def judged(self, thresholds: QualityThresholds) -> QualityReport:
        """The same scores checked against other thresholds (no model is run again)."""
        return replace(self, thresholds=thresholds, checks=_checks(self.metrics, thresholds))

    def to_json(self) -> dict:
        return {
            "kind": REPORT_KIND, "schema": REPORT_SCHEMA,
            "verdict": "PASS" if self.passed else "FAIL", "passed": self.passed,
            "reference": self.reference, "candidate": self.candidate, "dataset": self.dataset,
            "counts": self.counts, "metrics": {k: _finite(v) for k, v in self.metrics.items()},
            "thresholds": asdict(self.thresholds),
            "checks": [{**asdict(c), "value": _finite(c.value)} for c in self.checks],
            "items": [asdict(i) for i in self.items], "elapsed_s": round(self.elapsed_s, 3)}

    def to_markdown(self) -> str:
        m, c = self.metrics, self.counts
        lines = [f"## Quality gate: {'PASS' if self.passed else 'FAIL'}", ""]
        for role, info in (("reference", self.reference), ("candidate", self.candidate)):
            lines.append(f"- {role}: `{info['source']}`: model `{info['model_id']}`, fingerprint "
                         f"`{info['fingerprint']}`, quality version `{info['quality_version']}`")
        d = self.dataset
        lines += [f"- dataset: `{d['name']}` version `{d['version']}`: {c['items']} of "
                  f"{d['items_total']} items, {c['continuation_tokens']} continuation tokens, "
                  f"{c['misaligned_items']} tokenized differently", "",
                  "| metric | value | threshold | result |", "|---|---|---|---|"]
        for check in self.checks:
            lines.append(f"| {check.metric} | {_fmt(check.value)} | {check.op} {_fmt(check.threshold)} "
                         f"| {'PASS' if check.passed else 'FAIL'} |")
        gated = {check.metric for check in self.checks}
        for name, value in m.items():
            if name not in gated:
                lines.append(f"| {name} | {_fmt(value)} | | reported |")
        lines.append(f"\n({self.elapsed_s:.1f} s)")
        return "\n".join(lines)


def _finite(x: float) -> float | None:
    """JSON has no NaN: a metric with nothing to average over is null."""
    return x if math.isfinite(x) else None


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


# --- scoring --------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lower-case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def score(reference: Scorer, candidate: Scorer, items: Sequence[EvalItem],
          thresholds: QualityThresholds | None = None, dataset: Dataset | None = None) -> QualityReport:
    """Score both models on `items` and check the result against `thresholds`."""
    thresholds = thresholds or QualityThresholds()
    t0 = time.perf_counter()
    ref_tf, cand_tf = reference.teacher_forced(items), candidate.teacher_forced(items)
    ref_ans, cand_ans = reference.greedy_answers(items), candidate.greedy_answers(items)
    results = [_item(*row) for row in zip(items, ref_tf, cand_tf, ref_ans, cand_ans)]
    misaligned = sum(not r.aligned for r in results)
    counts = {"items": len(items), "continuation_tokens": sum(len(r.tokens) for r in ref_tf),
              "candidate_continuation_tokens": sum(len(c.tokens) for c in cand_tf),
              "aligned_items": len(items) - misaligned, "misaligned_items": misaligned,
              "boundary_rules": sorted({s.boundary for s in (*ref_tf, *cand_tf)})}
    metrics = _metrics(ref_tf, cand_tf, results)
    ds = ({"name": dataset.name, "path": dataset.path, "version": dataset.version,
           "items_total": len(dataset.items)} if dataset is not None else
          {"name": "(items)", "path": None, "version": None, "items_total": len(items)})
    return QualityReport(reference=reference.info.as_dict(), candidate=candidate.info.as_dict(),
                         dataset=ds, counts=counts, metrics=metrics, thresholds=thresholds,
                         checks=_checks(metrics, thresholds), items=tuple(results),
                         elapsed_s=time.perf_counter() - t0)


def _metrics(ref_tf: list[TokenScores], cand_tf: list[TokenScores], results: list[ItemResult]) -> dict:
    """Token-weighted means over the continuations; answer rates over items."""
    ref_ll = sum(sum(r.logprobs) for r in ref_tf) / sum(len(r.logprobs) for r in ref_tf)
    cand_ll = sum(sum(c.logprobs) for c in cand_tf) / sum(len(c.logprobs) for c in cand_tf)
    diffs = [abs(a - b) for r, c in zip(ref_tf, cand_tf) if r.tokens == c.tokens
             for a, b in zip(r.logprobs, c.logprobs)]
    n = len(results)
    ref_gold = sum(r.reference_gold for r in results) / n
    cand_gold = sum(r.candidate_gold for r in results) / n
    return {
        "ll_gap": ref_ll - cand_ll,
        "mean_abs_ll_diff": sum(diffs) / len(diffs) if diffs else math.nan,
        "greedy_agreement": sum(r.agreement for r in results) / sum(r.tokens for r in results),
        "exact_match": sum(r.reference_answer == r.candidate_answer for r in results) / n,
        "reference_mean_ll": ref_ll,
        "candidate_mean_ll": cand_ll,
        "reference_gold_accuracy": ref_gold,
        "candidate_gold_accuracy": cand_gold,
        "gold_drop": ref_gold - cand_gold,
        "reference_exact_match_gold": sum(matches_gold(r.reference_answer, (r.gold,), "exact")
                                          for r in results) / n,
        "candidate_exact_match_gold": sum(matches_gold(r.candidate_answer, (r.gold,), "exact")
                                          for r in results) / n,
    }


def _checks(m: dict, t: QualityThresholds) -> tuple[Check, ...]:
    checks = [_check("abs_ll_gap", abs(m["ll_gap"]), "<=", t.max_ll_gap)]
    if t.max_ll_abs_diff is not None:
        checks.append(_check("mean_abs_ll_diff", m["mean_abs_ll_diff"], "<=", t.max_ll_abs_diff))
    checks += [_check("greedy_agreement", m["greedy_agreement"], ">=", t.min_agreement),
               _check("exact_match", m["exact_match"], ">=", t.min_exact_match)]
    if t.min_gold_accuracy is not None:
        checks.append(_check("candidate_gold_accuracy", m["candidate_gold_accuracy"], ">=",
                             t.min_gold_accuracy))
    if t.max_gold_drop is not None:
        checks.append(_check("gold_drop", m["gold_drop"], "<=", t.max_gold_drop))
    return tuple(checks)


def _item(item: EvalItem, r: TokenScores, c: TokenScores, ref_answer: str,
          cand_answer: str) -> ItemResult:
    aligned = r.tokens == c.tokens
    return ItemResult(id=item.id, tokens=len(r.tokens), aligned=aligned,
                      reference_ll=sum(r.logprobs), candidate_ll=sum(c.logprobs),
                      agreement=sum(a == b for a, b in zip(r.top1, c.top1)) if aligned else 0,
                      reference_answer=ref_answer, candidate_answer=cand_answer, gold=item.answer,
                      match=item.match, reference_gold=matches_gold(ref_answer, item.golds, item.match),
                      candidate_gold=matches_gold(cand_answer, item.golds, item.match))


def matches_gold(answer: str, golds: Sequence[str], match: str) -> bool:
    """exact: the normalized answer is a normalized gold answer; contains: a gold answer's words
    appear in the answer's, as whole words ("paris" in "capital is paris", not in "parish")."""
    said = normalize_answer(answer)
    for gold in map(normalize_answer, golds):
        if said == gold or (match == "contains" and gold and f" {gold} " in f" {said} "):
            return True
    return False


def _check(metric: str, value: float, op: str, threshold: float) -> Check:
    ok = not math.isnan(value) and (value <= threshold if op == "<=" else value >= threshold)
    return Check(metric, value, op, threshold, ok)


# --- command line ---------------------------------------------------------------------------------

def add_quality_args(p: argparse.ArgumentParser) -> None:
    d = QualityThresholds()
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    p.add_argument("--reference", required=True,
                   help="a local HF checkpoint dir, `tiny`, or an OpenAI-compatible base URL")
    p.add_argument("--candidate", required=True, help="DIR, `tiny`, or URL, as --reference")
    p.add_argument("--dataset", default=None, help="JSON Lines of {id, prompt or messages, "
                   "continuation, answer} (default: the bundled tiny-model set; "
                   "loadtests/quality/smollm2_eval.jsonl: chat items for SmolLM2-135M-Instruct)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--thresholds", default=None, metavar="FILE",
                   help="YAML mapping overriding threshold defaults (flags override the file)")
    p.add_argument("--max-ll-gap", type=float, default=None,
                   help=f"max |mean log-likelihood gap|, nats/token (default {d.max_ll_gap})")
    p.add_argument("--max-ll-abs-diff", type=float, default=None,
                   help="max mean per-token |log-likelihood difference|, nats (default: not gated)")
    p.add_argument("--min-agreement", type=float, default=None,
                   help=f"min teacher-forced greedy token agreement (default {d.min_agreement})")
    p.add_argument("--min-exact-match", type=float, default=None, help="min exact match of greedy "
                   f"answers vs the reference's (default {d.min_exact_match})")
    p.add_argument("--min-gold-accuracy", type=float, default=None, help="min fraction of the "
                   "candidate's greedy answers right by the gold answers (default: not gated)")
    p.add_argument("--max-gold-drop", type=float, default=None, help="max reference minus candidate "
                   "gold accuracy (default: not gated)")
    p.add_argument("--api-key", default=None, help="bearer token for URL models")
    p.add_argument("--reference-model", default=None,
                   help="URL: the model id (default: the only one /v1/models lists)")
    p.add_argument("--candidate-model", default=None, help="URL: the model id, as --reference-model")
    p.add_argument("--reference-dtype", default="float32", choices=dtypes,
                   help="DIR: the dtype the engine runs it in (default float32)")
    p.add_argument("--candidate-dtype", default="float32", choices=dtypes,
                   help="DIR: as --reference-dtype")
    kv_dtypes = list(KV_CACHE_DTYPES)
    p.add_argument("--reference-kv-cache-dtype", default="auto", choices=kv_dtypes,
                   help="DIR: the engine's KV cache dtype (default auto: the model's; fp8: e4m3)")
    p.add_argument("--candidate-kv-cache-dtype", default="auto", choices=kv_dtypes,
                   help="DIR: as --reference-kv-cache-dtype")
    for role in ("reference", "candidate"):
        p.add_argument(f"--{role}-kv-cache-scales", default=(1.0, 1.0), type=parse_kv_cache_scales,
                       metavar="K,V", help=f"DIR, fp8 KV cache: the {role}'s k_scale,v_scale (default 1,1)")


def resolve_thresholds(args: argparse.Namespace) -> QualityThresholds:
    t = QualityThresholds()
    if getattr(args, "thresholds", None):
        t = QualityThresholds.from_file(args.thresholds, t)
    flags = {name: getattr(args, name, None) for name in THRESHOLD_NAMES}
    return replace(t, **{k: v for k, v in flags.items() if v is not None})


def run_quality(args: argparse.Namespace) -> int:
    """0: the candidate passes; 1: a gated metric fails; 2: a usage error (one line on stderr)."""
    scorers: list[Scorer] = []
    try:
        thresholds = resolve_thresholds(args)
        limit = getattr(args, "limit", None)
        if limit is not None and limit < 1:
            raise UsageError(f"--limit must be >= 1, got {limit}")
        dataset = load_dataset(getattr(args, "dataset", None))
        if getattr(args, "out", None):
            _check_writable(args.out)
        for role in ("reference", "candidate"):
            scorers.append(open_scorer(getattr(args, role), api_key=getattr(args, "api_key", None),
                                       model=getattr(args, f"{role}_model", None),
                                       dtype=getattr(args, f"{role}_dtype", "float32"),
                                       kv_cache_dtype=getattr(args, f"{role}_kv_cache_dtype", "auto"),
                                       kv_cache_scales=getattr(args, f"{role}_kv_cache_scales", (1.0, 1.0))))
        report = score(scorers[0], scorers[1], dataset.items[:limit], thresholds, dataset)
    except (UsageError, DatasetError, ScorerError) as e:
        print(f"kvfleet eval quality: error: {e}", file=sys.stderr)
        return 2
    finally:
        for s in scorers:
            s.close()
    print(report.to_markdown())
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return 0 if report.passed else 1


def _check_writable(path: str) -> None:
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"--out {path}: directory {parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet eval quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_quality_args(p)
    return run_quality(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
