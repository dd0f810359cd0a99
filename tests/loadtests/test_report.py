"""The report folder of a run: every file written, plots readable, tables and JSON faithful."""
from __future__ import annotations

import json

import matplotlib.image

from loadtests.metrics import summarize
from loadtests.records import ClassSLO, RequestRecord, RunResult
from loadtests.report import class_table, render_markdown, write_report

FILES = {"run": "run.json", "summary": "summary.json", "report": "report.md",
         "ttft_cdf": "ttft_cdf.png", "itl_cdf": "itl_cdf.png",
         "latency_over_time": "latency_over_time.png", "stage_timeline": "stage_timeline.png",
         "tenant_throughput": "tenant_throughput.png"}


def make_run(*, all_failed: bool = False) -> RunResult:
    """Twelve interactive and four batch requests from two tenants over 6 s (every fourth
    interactive one rejected), plus an "audit" class nobody sent. With all_failed, every request
    times out instead."""
    records = []
    for i in range(16):
        cls = "interactive" if i < 12 else "batch"
        r = RequestRecord(index=i, traffic_class=cls, tenant="acme" if i % 2 else "zeta",
                          scheduled_s=i * 0.35, send_s=i * 0.35 + 0.01, prompt_tokens=100,
                          max_tokens=8)
        if all_failed:
            r.error = "timeout"
        elif cls == "interactive" and i % 4 == 3:
            r.status, r.error, r.retry_after_s = 429, "rate_limited", 1.0
        else:
            r.status, r.ttft_s, r.itl_s = 200, 0.05 + 0.01 * i, [0.02, 0.03, 0.04]
            r.e2e_s, r.output_tokens, r.finish_reason = r.ttft_s + 0.09, 4, "length"
        records.append(r)
    return RunResult(
        meta={"workload": "mixed-smoke", "endpoint": "http://gw:8000", "model": "tiny",
              "seed": 7, "duration_s": 6.0, "command": ["kvfleet", "loadtest", "--seed", "7"]},
        classes={"interactive": ClassSLO("interactive", 0.1, 0.05),
                 "batch": ClassSLO("batch", 2.0, None), "audit": ClassSLO("audit", 1.0, None)},
        tenant_weights={"acme": 2.0, "zeta": 1.0}, records=records)


def check_complete_report(run: RunResult, out) -> dict:
    """Every file is there, each PNG decodes to a non-empty image, and summary.json is
    summarize() plus the run's meta. Returns the summary read back."""
    paths = write_report(run, out)
    assert {k: p.name for k, p in paths.items()} == FILES
    for name, path in paths.items():
        assert path.parent == out and path.stat().st_size > 0
        if path.suffix == ".png":
            assert matplotlib.image.imread(path).size > 0
    summary = json.loads(paths["summary"].read_text())
    assert summary == json.loads(json.dumps({"meta": run.meta, **summarize(run)}))
    assert RunResult.load(paths["run"]) == run
    return summary


def test_report_writes_every_file_and_the_markdown_shows_the_class_rows(tmp_path):
    """Interactive: 12 sent, 9 ok (i = 0 1 2 4 5 6 8 9 10, TTFT 50 + 10 i ms), 3 rejected.
    TTFT p95 at rank 7.6 of the nine: 140 + 0.6 * 10 ms. The target is 100 ms: i = 0 1 2 4 5
    meet it, 5 of 12; every ok request's own p99 gap (39.8 ms) is under 50 ms, 9 of 12.
    Tenants: acme (weight 2) got 20 tokens, zeta 32, both asked 64 (backlogged), so the fair split
    of the 52 served is 2:1 and Jain = (10 + 32)^2 / (2 (10^2 + 32^2)) as x scales with 1/weight."""
    out = tmp_path / "report"
    summary = check_complete_report(make_run(), out)
    md = (out / "report.md").read_text()

    assert md.startswith("# Load test: mixed-smoke\n")
    for fact in ("- endpoint: http://gw:8000", "- model: tiny", "- seed: 7",
                 "- duration: 6.0 s", "- command: `kvfleet loadtest --seed 7`"):
        assert fact in md
    assert ("| interactive | 12 | 9 | 3 | 0 | 100.0 / 146.0 / 149.2 | 30.0 / 40.0 / 40.0 "
            "| 0.19 / 0.24 | 100 / 50 | 41.7 / 75.0 / 41.7 | 0.83 | 6.0 |") in md
    assert "| batch | 4 | 4 | 0 | 0 |" in md
    assert "| audit | 0 | 0 | 0 | 0 | - / - / - |" in md
    assert class_table(summary) in md
    assert "| acme | 2 | 8 | 5 | 20 | 3.3 |" in md
    assert "| rate_limited | 3 |" in md
    assert "Jain's fairness index (service against each tenant's weighted max-min fair share): 0.785" in md
    for name in ("ttft_cdf", "itl_cdf", "latency_over_time", "stage_timeline",
                 "tenant_throughput"):
        assert f"({name}.png)" in md


def test_an_all_failed_run_still_gets_a_complete_report(tmp_path):
    """No request succeeded: no latency curves to draw, no tokens to share, yet every file is
    written and the tables show dashes rather than crashing."""
    summary = check_complete_report(make_run(all_failed=True), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert summary["overall"]["ok"] == 0 and summary["jain_index"] is None
    assert "| interactive | 12 | 0 | 0 | 12 | - / - / - | - / - / - | - / - |" in md
    assert "| timeout | 16 |" in md


def test_render_markdown_works_from_a_summary_alone():
    """The compare command holds only summaries: without meta or plots the header falls back
    to dashes and the run duration, and no plot section is written."""
    md = render_markdown(summarize(make_run()))
    assert md.startswith("# Load test: -\n") and "- duration: 6.0 s" in md
    assert "## Plots" not in md and "| interactive | 12 |" in md


def test_the_report_has_a_phase_table_only_when_the_server_reported_phases():
    run = make_run()
    assert "## Phases" not in render_markdown(summarize(run))
    for r in run.records:
        if r.ok:
            r.timing = {"queue_s": 0.01, "prefill_s": 0.02, "transfer_s": 0.003, "decode_s": 0.1}
    md = render_markdown(summarize(run))
    assert "## Phases (server-reported)" in md
    assert "| 10.0 / 10.0 | 20.0 / 20.0 | 3.0 / 3.0 | 100.0 / 100.0 |" in md


def test_the_report_shows_queue_time_and_rejections_by_stage_when_the_server_said_them(tmp_path):
    """The server named a stage on every decision (S0 for the first half, S4 after) and reported
    each admitted request's time in the router's wait queue (20 ms): the markdown has the queue
    table and the rejections by stage, and the stage timeline is drawn from the summary."""
    run = make_run()
    md = render_markdown(summarize(run))
    assert "## Time in the router's wait queue" not in md
    assert "Rejections by overload stage: none 3." in md        # no stage said: "none"
    for r in run.records:
        r.stage = "S0_NORMAL" if r.send_s < 3 else "S4_REJECT"
        if r.ok:
            r.timing = {"queue_s": 0.03, "wait_queue_s": 0.02}
    summary = check_complete_report(run, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Time in the router's wait queue (server-reported)" in md
    assert "| interactive | 9 | 9 | 20.0 / 20.0 / 20.0 | 20.0 |" in md
    # rejected: i = 3, 7, 11 sent at 1.06, 2.46 and 3.86 s
    assert "Rejections by overload stage: S0_NORMAL 2, S4_REJECT 1." in md
    assert [row["stage"] for row in summary["timeline"]] == [0, 0, 0, 4, 4, 4]
