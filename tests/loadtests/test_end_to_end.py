"""The load generator against a real local fleet (processes on 127.0.0.1, a real redis-server):
30 s of the `mixed` workload gives a complete report with no client-side errors; the CLI's serve
and compare commands run the same way; quota rejections are recorded with their reason and
Retry-After, not counted as client failures (on the simulated engine core); the quality gate
passes the fleet against its own checkpoint (on the tiny model)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace

import matplotlib.image
import pytest

from loadtests.local_fleet import FleetSetup, local_fleet, tenant_key
from loadtests.metrics import summarize
from loadtests.report import write_report
from loadtests.arrivals import ArrivalProcess
from loadtests.runner import RunConfig, _headers, run_workload
from loadtests.workload import TenantSpec, load_workload, parse_workload

CLIENT_SIDE = ("connect", "timeout", "truncated", "transport")
LIMITED = TenantSpec("limited", "interactive", 1.0, ArrivalProcess("poisson", {"rate_rps": 1}))


def setup(model_dir, engine: str) -> tuple[list[TenantSpec], FleetSetup]:
    tenants = [*load_workload("mixed").tenants, LIMITED]
    return tenants, FleetSetup(mode="colocated", model=str(model_dir), engine=engine,
                               key_overrides={"limited": {"requests_per_minute": 3}})


@pytest.fixture(scope="module")
def fleet(redis_url, tiny_model_dir):
    """The load generator's fleet on the simulated engine core: the claims on it are about the
    report, the quotas and the CLI, which see the same HTTP answers whatever makes the tokens."""
    with local_fleet(*setup(tiny_model_dir, "sim"), redis_url=redis_url) as f:
        yield f


@pytest.fixture
def model_fleet(tiny_model_dir):
    """The same fleet on the tiny model, for the claim about its logprobs; its own Redis (`kvfleet
    up` starts one), since the module's fleet, still up, uses the same worker names."""
    with local_fleet(*setup(tiny_model_dir, "real")) as f:
        yield f


def test_thirty_seconds_of_mixed_traffic_give_a_complete_report(fleet, tmp_path):
    spec = load_workload("mixed")
    assert spec.duration_s == 30
    run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)))

    failed = [(r.index, r.status, r.error) for r in run.records if r.error and r.error.startswith(CLIENT_SIDE)]
    assert not failed, f"client-side errors: {failed}"
    # the fleet may refuse a request it predicts late (503 with a reason) on a slow machine; that
    # is the server's answer, recorded as such, never a silent loss
    refused = [r for r in run.records if not r.ok]
    assert all(r.status in (429, 503) and r.error and r.detail for r in refused)
    assert len(refused) <= 0.05 * len(run.records), [(r.index, r.error) for r in refused]
    served = [r for r in run.records if r.ok]
    assert run.meta["prompt_mode"] == "ids"          # the gateway has /tokenize: exact lengths
    assert all(r.output_tokens == r.max_tokens for r in served)   # ignore_eos: as planned
    # a gap per token event; a token the detokenizer holds back (part of a UTF-8 character) rides
    # with the next one, so a few events carry two tokens
    gaps, tokens = sum(len(r.itl_s) for r in served), sum(r.output_tokens - 1 for r in served)
    assert 0.9 * tokens <= gaps <= tokens

    paths = write_report(run, tmp_path)
    for name in ("run", "summary", "report", "ttft_cdf", "itl_cdf", "latency_over_time", "tenant_throughput"):
        assert paths[name].is_file() and paths[name].stat().st_size > 0, name
    for png in ("ttft_cdf", "itl_cdf", "latency_over_time", "tenant_throughput"):
        assert matplotlib.image.imread(paths[png]).size > 0
    summary = json.loads(paths["summary"].read_text())
    assert set(summary["classes"]) == {"interactive", "document", "batch"}
    assert summary["overall"]["requests"] == len(run.records) and summary["overall"]["errors"] == 0
    assert summary["overall"]["rejected"] == len(refused)
    assert set(summary["tenants"]) == {"acme", "globex", "initech", "docs", "nightly"}
    assert 0 < summary["jain_index"] <= 1
    report = paths["report"].read_text()
    assert "| interactive |" in report and "| document |" in report and "ttft_cdf.png" in report


def test_quota_rejections_are_recorded_with_reason_and_retry_after(fleet):
    spec = parse_workload({"name": "burst", "duration_s": 2.0, "max_requests": 8,
                           "classes": {"interactive": {"slo": {"ttft_s": 1.0}, "prompt_tokens": 20,
                                                       "output_tokens": 4}},
                           "tenants": {"limited": {"class": "interactive",
                                                   "arrival": {"process": "poisson", "rate_rps": 8}}}})
    # requests_per_minute counts in fixed minute windows of the wall clock: a burst across a
    # boundary gets each window's 3, so the bound counts the windows the burst touched
    started = time.time()
    run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)))
    windows = len({int(started // 60), int(time.time() // 60)})
    rejected = [r for r in run.records if r.status == 429]
    assert 1 <= sum(r.ok for r in run.records) <= 3 * windows and rejected
    assert {r.error for r in rejected} == {"http_429:rate_limit_exceeded"}
    assert all(r.retry_after_s and r.retry_after_s >= 1 for r in rejected)
    summary = summarize(run)
    assert summary["classes"]["interactive"]["rejected"] == len(rejected)
    assert summary["errors_by_reason"] == {"http_429:rate_limit_exceeded": len(rejected)}


def kvfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_serve_and_compare_from_the_command_line(fleet, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("".join(f"- {{key: {tenant_key(t)}, tenant: {t}}}\n" for t in ("acme", "globex")))
    # 1.5 s of chat-only at seed 5 plans 3 requests from both tenants: enough for a table and a
    # same-requests check (3 s planned 9; each of the three runs waited out its duration)
    common = ["--workload", "chat-only", "--duration", "1.5", "--seed", "5",
              "--api-keys", str(keys)]
    serve = kvfleet("bench", "serve", "--endpoint", fleet.endpoint, "--out", str(tmp_path / "one"), *common)
    assert serve.returncode == 0, serve.stderr
    assert "| interactive |" in serve.stdout and (tmp_path / "one" / "report.md").is_file()

    compare = kvfleet("bench", "compare", "--endpoint", fleet.endpoint, "--endpoint", fleet.endpoint,
                      "--out", str(tmp_path / "cmp"), *common)
    assert compare.returncode == 0, compare.stderr
    assert "| goodput (req/s) |" in compare.stdout and "| interactive TTFT p99 (s) |" in compare.stdout
    a, b = (json.loads((tmp_path / "cmp" / x / "run.json").read_text()) for x in "AB")
    # the same seeded requests went to both
    assert [(r["tenant"], r["scheduled_s"], r["max_tokens"]) for r in a["records"]] == \
           [(r["tenant"], r["scheduled_s"], r["max_tokens"]) for r in b["records"]]


def test_a_bad_workload_is_a_usage_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nclasses: {}\ntenants: {}\n")
    out = kvfleet("bench", "serve", "--endpoint", "http://127.0.0.1:9", "--workload", str(bad))
    assert out.returncode == 2 and "classes: expected a non-empty mapping" in out.stderr
    assert "Traceback" not in out.stderr


def test_each_tenant_uses_its_own_key_and_unknown_tenants_fall_back():
    cfg = RunConfig("http://x", api_key="sk-default", tenant_keys={"acme": "sk-acme"})
    assert _headers(cfg, "acme") == {"Authorization": "Bearer sk-acme"}
    assert _headers(cfg, "other") == {"Authorization": "Bearer sk-default"}
    assert _headers(replace(cfg, api_key=None), "other") == {}


@pytest.mark.real_model("the fleet's logprobs score as the checkpoint's own")
def test_the_quality_gate_passes_the_served_fleet_against_its_own_checkpoint(
        model_fleet, tiny_model_dir, tmp_path):
    """The URL path of `kvfleet eval quality`: the fleet (REST, echo + logprobs through the gateway)
    scores the same as the checkpoint run in-process."""
    out = kvfleet("eval", "quality", "--reference", str(tiny_model_dir),
                  "--candidate", model_fleet.endpoint,
                  "--api-key", tenant_key("acme"), "--limit", "8", "--out", str(tmp_path / "q.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["metrics"]["greedy_agreement"] == 1.0 and report["metrics"]["exact_match"] == 1.0
    assert abs(report["metrics"]["ll_gap"]) < 1e-4 and report["passed"]
