"""The quality gate (`kvfleet eval quality`): a candidate scored against a reference.

Stories: the reference passes against itself with nothing to report; a copy whose weights were
perturbed fails, on every gated metric, with exit status 1; a rounding-level perturbation still
passes (so the gate flags output changes, not changed bytes); a lenient thresholds file turns the
perturbed copy's verdict to pass; bad arguments give one clear line and exit status 2. HttpScorer
is checked against an in-process server on 127.0.0.1 that shapes its answers with the gateway's
own `Shaper`, so the URL path must agree with the in-process one token for token.
"""
from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from loadtests.quality.dataset import DEFAULT_DATASET, EvalItem, load_dataset
from loadtests.quality.gate import (QualityThresholds, add_quality_args, resolve_thresholds, run_quality,
                                    score)
from loadtests.quality.scorer import EngineScorer, HttpScorer, clean_answer

STRONG_NOISE = 0.05     # relative to each tensor's RMS: flips ~20% of greedy tokens on the tiny model
ROUNDING_NOISE = 1e-6   # far below anything that moves an argmax


def perturb(src: Path, dst: Path, relative_std: float, seed: int = 1) -> Path:
    """A copy of checkpoint `src` with N(0, (relative_std * rms(w))^2) noise added to every tensor."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {name: w + relative_std * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=gen)
             for name, w in sorted(weights.items())}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir, tmp_path_factory):
    return perturb(tiny_model_dir, tmp_path_factory.mktemp("perturbed") / "model", STRONG_NOISE)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return EngineScorer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def items():
    return load_dataset().items


def quality(*argv: str) -> int:
    p = argparse.ArgumentParser()
    add_quality_args(p)
    return run_quality(p.parse_args(list(argv)))


def test_the_bundled_eval_set_is_found_next_to_the_module_and_well_formed():
    """~40 hand-written items, each with a prompt that ends without whitespace and a continuation
    that starts with its own space (so the boundary falls between tokens), and a short answer."""
    ds = load_dataset()
    assert DEFAULT_DATASET.parent.name == "quality" and ds.name == "eval_set"
    assert 35 <= len(ds.items) <= 50 and len(ds.version) == 12
    for item in ds.items:
        assert item.prompt == item.prompt.rstrip() and item.continuation.startswith(" ")
        assert len(item.answer.split()) <= 3


def test_the_reference_against_itself_passes_with_nothing_to_report(tiny_model_dir, tmp_path, capsys):
    """Two engines on the same checkpoint: gap 0, agreement 1, every greedy answer equal; exit 0, and
    the JSON report names both models, their fingerprint and quality version, and the eval set."""
    out = tmp_path / "report.json"
    assert quality("--reference", str(tiny_model_dir), "--candidate", str(tiny_model_dir),
                   "--out", str(out)) == 0
    report = json.loads(out.read_text())
    m = report["metrics"]
    assert report["verdict"] == "PASS"
    # the same weights twice: equal up to float summation order (MKL's threads under load)
    assert abs(m["ll_gap"]) < 1e-6 and m["mean_abs_ll_diff"] < 1e-6
    assert m["greedy_agreement"] == 1.0 and m["exact_match"] == 1.0
    assert m["reference_mean_ll"] < 0
    assert report["counts"]["items"] == 40 and report["counts"]["misaligned_items"] == 0
    assert report["counts"]["continuation_tokens"] > 200
    for role in ("reference", "candidate"):
        info = report[role]
        assert info["source"] == str(tiny_model_dir) and info["kind"] == "dir"
        assert len(info["fingerprint"]) == 16 and info["quality_version"].startswith("float32-")
    assert report["dataset"]["name"] == "eval_set" and report["dataset"]["version"] == load_dataset().version
    assert report["thresholds"] == {"max_ll_gap": 0.05, "min_agreement": 0.95, "min_exact_match": 0.9,
                                    "max_ll_abs_diff": None, "min_gold_accuracy": None,
                                    "max_gold_drop": None}
    assert {c["metric"] for c in report["checks"]} == {"abs_ll_gap", "greedy_agreement", "exact_match"}
    text = capsys.readouterr().out
    assert "Quality gate: PASS" in text and report["reference"]["fingerprint"] in text


def test_a_candidate_with_perturbed_weights_fails_the_gate(tiny_model_dir, perturbed_dir, tmp_path, capsys):
    """5% noise on every weight: a different fingerprint, and each gated metric past its default
    threshold on its own (not just one marginal miss), so `run_quality` exits 1."""
    out = tmp_path / "report.json"
    assert quality("--reference", str(tiny_model_dir), "--candidate", str(perturbed_dir),
                   "--out", str(out)) == 1
    report = json.loads(out.read_text())
    m = report["metrics"]
    assert report["verdict"] == "FAIL"
    assert report["candidate"]["fingerprint"] != report["reference"]["fingerprint"]
    assert abs(m["ll_gap"]) > 0.05 and m["mean_abs_ll_diff"] > 0.1
    assert m["greedy_agreement"] < 0.9 and m["exact_match"] < 0.5
    assert all(not c["passed"] for c in report["checks"])
    assert report["counts"]["misaligned_items"] == 0      # same tokenizer: a fair comparison
    assert "Quality gate: FAIL" in capsys.readouterr().out


def test_a_rounding_level_perturbation_still_passes(reference, tiny_model_dir, tmp_path, items):
    """Changed bytes alone do not fail the gate: 1e-6 relative noise (a different fingerprint) keeps
    every greedy token and answer, and the gap far below the threshold."""
    cand = EngineScorer(str(perturb(tiny_model_dir, tmp_path / "rounding", ROUNDING_NOISE)))
    report = score(reference, cand, items)
    assert cand.info.fingerprint != reference.info.fingerprint
    assert report.passed, report.to_markdown()
    assert report.metrics["greedy_agreement"] == 1.0 and report.metrics["exact_match"] == 1.0
    assert 0 < report.metrics["mean_abs_ll_diff"] < 1e-3


def test_a_lenient_thresholds_file_changes_the_verdict_and_flags_override_it(
        tiny_model_dir, perturbed_dir, tmp_path):
    """The perturbed copy passes a file that tolerates it, and a flag overrides the file's value
    (back to failing). `--limit` scores the first items only."""
    lenient = tmp_path / "lenient.yaml"
    lenient.write_text("max_ll_gap: 0.5\nmin_agreement: 0.5\nmin_exact_match: 0.0\n")
    args = ("--reference", str(tiny_model_dir), "--candidate", str(perturbed_dir), "--limit", "10",
            "--thresholds", str(lenient))
    out = tmp_path / "r.json"
    assert quality(*args, "--out", str(out)) == 0
    report = json.loads(out.read_text())
    assert report["counts"]["items"] == 10 and report["dataset"]["items_total"] == 40
    assert report["thresholds"]["max_ll_gap"] == 0.5 and report["verdict"] == "PASS"
    assert quality(*args, "--min-agreement", "0.95") == 1


def test_thresholds_resolve_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("max_ll_gap: 0.2\nmin_agreement: 0.8\n")
    args = argparse.Namespace(thresholds=str(path), max_ll_gap=None, min_agreement=0.9,
                              min_exact_match=None, max_ll_abs_diff=0.1)
    assert resolve_thresholds(args) == QualityThresholds(max_ll_gap=0.2, min_agreement=0.9,
                                                         min_exact_match=0.9, max_ll_abs_diff=0.1)


def test_the_optional_per_token_gate_catches_what_the_signed_gap_misses(reference, perturbed_dir, items):
    """Judged again without rescoring: with agreement and exact match relaxed and a signed-gap
    threshold it meets, the perturbed copy still fails on mean |per-token difference| once gated."""
    report = score(reference, EngineScorer(str(perturbed_dir)), items[:10])
    m = report.metrics
    relaxed = QualityThresholds(max_ll_gap=abs(m["ll_gap"]) + 0.01, min_agreement=0.0, min_exact_match=0.0)
    assert m["mean_abs_ll_diff"] > abs(m["ll_gap"]) + 0.05
    assert report.judged(relaxed).passed
    gated = report.judged(replace(relaxed, max_ll_abs_diff=0.05))
    assert not gated.passed
    assert [c.metric for c in gated.checks if not c.passed] == ["mean_abs_ll_diff"]


def test_thresholds_default_and_a_file_overrides_only_what_it_names(tmp_path):
    base = QualityThresholds()
    assert (base.max_ll_gap, base.min_agreement, base.min_exact_match, base.max_ll_abs_diff) == (
        0.05, 0.95, 0.90, None)
    path = tmp_path / "t.yaml"
    path.write_text("min_exact_match: 0.8\nmax_ll_abs_diff: 0.2\n")
    assert QualityThresholds.from_file(path) == QualityThresholds(min_exact_match=0.8, max_ll_abs_diff=0.2)
    path.write_text("max_ll_gap: lots\n")
    with pytest.raises(ValueError, match="max_ll_gap must be a number"):
        QualityThresholds.from_file(path)


SELF = ("--reference", "{tiny}", "--candidate", "{tiny}")


@pytest.mark.parametrize("argv, message", [
    (("--reference", "/no/such/checkpoint", "--candidate", "tiny"), "/no/such/checkpoint"),
    (("--reference", "{tiny}", "--candidate", "{empty}"), "lacks config.json"),
    (SELF + ("--dataset", "/no/such/set.jsonl"), "cannot read dataset /no/such/set.jsonl"),
    (SELF + ("--dataset", "{bad_set}"), "bad.jsonl:2: not valid JSON"),
    (SELF + ("--dataset", "{short_set}"), "missing or empty string field(s): answer"),
    (SELF + ("--thresholds", "{bad_thresholds}"), "unknown key(s) min_agreemnt"),
    (SELF + ("--min-agreement", "1.5"), "min_agreement must be between 0 and 1"),
    (SELF + ("--limit", "0"), "--limit must be >= 1"),
    (("--reference", "{tiny}", "--candidate", "http://127.0.0.1:9"),
     "GET http://127.0.0.1:9/v1/models failed"),     # nothing listens on the discard port
])
def test_bad_arguments_exit_2_with_one_clear_line(argv, message, tiny_model_dir, tmp_path, capsys):
    """No traceback: one `error:` line on stderr naming the problem, nothing on stdout, status 2."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text(
        '{"id": "a", "prompt": "p", "continuation": " c", "answer": "x"}\n{oops\n')
    (tmp_path / "short.jsonl").write_text('{"id": "a", "prompt": "p", "continuation": " c"}\n')
    (tmp_path / "t.yaml").write_text("min_agreemnt: 0.9\n")
    subs = {"tiny": str(tiny_model_dir), "empty": str(tmp_path / "empty"),
            "bad_set": str(tmp_path / "bad.jsonl"), "short_set": str(tmp_path / "short.jsonl"),
            "bad_thresholds": str(tmp_path / "t.yaml")}
    assert quality(*(a.format(**subs) for a in argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvfleet eval quality: error: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_missing_required_flags_is_an_argparse_usage_error():
    with pytest.raises(SystemExit) as e:
        quality("--reference", "tiny")
    assert e.value.code == 2


# --- HttpScorer -------------------------------------------------------------------------------------

class EngineHTTPServer:
    """/v1/models and non-streaming /v1/completions on 127.0.0.1, answered by an in-process LLMEngine
    and shaped by the gateway's own Shaper (echo, logprobs, text_offset exactly as the REST gateway
    returns them). Rejects max_tokens=0 like strict servers do; checks the bearer key."""

    API_KEY = "sk-quality-test"

    def __init__(self, model_dir: Path, name: str = "tiny-served") -> None:
        from services.engine.engine import LLMEngine, engine_config
        from services.gateway.model import load_served_model

        self.engine = LLMEngine(engine_config(str(model_dir), dtype="float32", kv_cache_mib=16))
        self.model = load_served_model(str(model_dir), name)
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> EngineHTTPServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def complete(self, body: dict) -> tuple[int, dict]:
        from services.protocol.convert import logprob_to_pb
        from services.engine.sampling_params import SamplingParams
        from services.gateway.openai_responses import Collected, Shaper
        from services.gateway.openai_schema import ResponseShape

        self.requests.append(body)
        if body.get("model") != self.model.name:
            return 404, {"error": {"message": f"model {body.get('model')!r} not found"}}
        if body.get("max_tokens", 16) < 1:
            return 400, {"error": {"message": "max_tokens must be at least 1"}}
        ids = self.model.tokenizer.encode(body["prompt"])
        logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
        params = SamplingParams(max_tokens=body.get("max_tokens", 16),
                                temperature=body.get("temperature", 1.0), logprobs=logprobs,
                                prompt_logprobs=logprobs if echo else None)
        with self.lock:
            out = self.engine.generate([ids], params)[0]
        collected = Collected(text=out.text, finish_reason=out.finish_reason or "")
        collected.logprobs.extend(logprob_to_pb(lp) for lp in out.logprobs)
        if echo and out.prompt_logprobs is not None:
            collected.prompt_logprobs.extend(logprob_to_pb(lp, t) for lp, t in zip(out.prompt_logprobs, ids))
        shape = ResponseShape(kind="completion", request_id="cmpl-test", model=self.model.name,
                            created=int(time.time()), stream=False, include_usage=False,
                            logprobs=logprobs is not None, echo_text=body["prompt"] if echo else None)
        return 200, Shaper(shape, self.model, tuple(ids)).body(collected, len(ids), len(out.token_ids))

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("authorization") == f"Bearer {server.API_KEY}":
                    return True
                self._reply(401, {"error": {"message": "invalid api key"}})
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path != "/v1/models":
                    return self._reply(404, {"error": {"message": "not found"}})
                self._reply(200, {"object": "list", "data": [
                    {"id": server.model.name, "object": "model",
                     "quality_version": server.model.quality_version}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if not self._authorized():
                    return
                if self.path != "/v1/completions":
                    return self._reply(404, {"error": {"message": "not found"}})
                self._reply(*server.complete(body))

        return Handler


@pytest.fixture(scope="module")
def http_server(tiny_model_dir):
    with EngineHTTPServer(tiny_model_dir) as server:
        yield server


def test_http_scorer_agrees_with_the_in_process_scorer_token_for_token(http_server, reference, items):
    """Through /v1/completions (text, echo, logprobs=1, max_tokens=1) the continuation is placed by
    text_offset (the bos counted in the offsets but not in `text`), and every continuation token,
    its log-likelihood, its top-1 token and every greedy answer equal the in-process engine's."""
    subset = items[:12]
    scorer = HttpScorer(http_server.url + "/v1/", api_key=EngineHTTPServer.API_KEY)
    try:
        assert scorer.model == "tiny-served"
        http_tf, engine_tf = scorer.teacher_forced(subset), reference.teacher_forced(subset)
        for h, e in zip(http_tf, engine_tf):
            assert h.boundary == "text_offset" and e.boundary == "ids"
            assert h.tokens == e.tokens and h.top1 == e.top1
            assert h.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert scorer.greedy_answers(subset) == reference.greedy_answers(subset)
        info = scorer.info
        assert info.kind == "url" and info.fingerprint == "tiny-served"
        assert info.quality_version == http_server.model.quality_version
        assert info.quality_versions_seen == (http_server.model.quality_version,)
    finally:
        scorer.close()
    sent = http_server.requests[0]
    assert sent["echo"] is True and sent["logprobs"] == 1 and sent["max_tokens"] == 1


def test_run_quality_with_a_url_candidate_passes_and_names_the_served_model(
        http_server, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    assert quality("--reference", str(tiny_model_dir), "--candidate", http_server.url,
                   "--api-key", EngineHTTPServer.API_KEY, "--limit", "8", "--out", str(out)) == 0
    report = json.loads(out.read_text())
    assert report["candidate"]["source"] == http_server.url
    assert report["candidate"]["model_id"] == "tiny-served"
    assert report["candidate"]["quality_version"] == report["reference"]["quality_version"]
    assert report["metrics"]["greedy_agreement"] == 1.0 and abs(report["metrics"]["ll_gap"]) < 1e-4


def test_http_errors_are_usage_errors(http_server, tiny_model_dir, capsys):
    """A wrong key or an unknown model id: exit 2 with the server's message, not a traceback."""
    assert quality("--reference", str(tiny_model_dir), "--candidate", http_server.url,
                   "--api-key", "sk-wrong") == 2
    assert "HTTP 401: invalid api key" in capsys.readouterr().err
    assert quality("--reference", str(tiny_model_dir), "--candidate", http_server.url,
                   "--api-key", EngineHTTPServer.API_KEY, "--candidate-model", "other") == 2
    assert "does not serve model 'other'; it serves: tiny-served" in capsys.readouterr().err


def mock_server(tokens: list[str], offsets: list[int], n_prompt: int) -> httpx.MockTransport:
    """An OpenAI-style server that echoes `tokens` (plus one generated token) with these offsets."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mock-model"}]})
        body = json.loads(request.content)
        if not body.get("echo"):
            return httpx.Response(200, json={"choices": [{"text": " Paris\nQuestion"}],
                                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": 2}})
        toks = tokens + ["\n"]
        return httpx.Response(200, json={
            "system_fingerprint": "fp-1",
            "choices": [{"text": body["prompt"] + "\n", "logprobs": {
                "tokens": toks, "token_logprobs": [None] + [-1.0] * (len(toks) - 1),
                "top_logprobs": [None] + [{t: -1.0, "zz": -0.5} for t in toks[1:]],
                "text_offset": offsets + [offsets[-1] + len(tokens[-1])]}}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1}})
    return httpx.MockTransport(handler)


def _cumulative(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


@pytest.mark.parametrize("convention", ["bos-counted", "bos-zero-width", "spaces-dropped"])
def test_http_scorer_places_the_continuation_under_each_offset_convention(convention):
    """vLLM and kvfleet count the bos text in text_offset (`text` does not hold it); a server may
    give the bos offset 0 and the text true offsets; a SentencePiece server's token strings drop
    their leading spaces, so they do not spell the text and the prompt's own token count
    (usage.prompt_tokens) places the boundary. Each way the continuation is the same 3 tokens."""
    item = EvalItem("x", "Q: Hi?\nA:", " It is Paris.", "Paris")
    prompt = ["<|begin_of_text|>", "Q", ":", " Hi", "?", "\n", "A", ":"]
    cont = [" It", " is", " Paris", "."]
    if convention == "spaces-dropped":
        prompt, cont = [t.lstrip() for t in prompt], [t.lstrip() for t in cont]
    tokens = prompt + cont
    offsets = _cumulative(tokens)
    if convention == "bos-zero-width":
        offsets = [0] + [o - len(prompt[0]) for o in offsets[1:]]
    scorer = HttpScorer("http://127.0.0.1:1", transport=mock_server(tokens, offsets, len(prompt)))
    try:
        [scores] = scorer.teacher_forced([item])
        assert scores.boundary == ("token_count" if convention == "spaces-dropped" else "text_offset")
        assert scores.tokens == tuple(cont) and scores.top1 == ("zz",) * 4
        assert scores.logprobs == (-1.0,) * 4
        assert scorer.greedy_answers([item]) == ["Paris"]
        assert scorer.info.model_id == "mock-model" and scorer.info.quality_version == "fp-1"
    finally:
        scorer.close()


def test_clean_answer_cuts_at_the_first_newline():
    assert clean_answer("  Paris.\nQuestion: next") == "Paris."
    assert clean_answer("\n\n") == ""


@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype"])     # transformers < 5, >= 5
def test_a_checkpoint_dir_reports_the_quality_version_its_gateway_would(tiny_model_dir, tmp_path,
                                                                        dtype_key):
    from loadtests.quality.scorer import _served_quality_version
    from services.gateway.model import load_served_model
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("torch_dtype", None), config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps({**config, dtype_key: "bfloat16"}))
    version = _served_quality_version(str(model))
    assert version.startswith("bfloat16-")
    assert version == load_served_model(str(model), "m").quality_version
