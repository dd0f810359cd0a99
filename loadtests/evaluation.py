"""`kvfleet bench evaluation`: regenerates docs/evaluation.md (DESIGN.md section 10) on this machine.

For each fleet setup (co-located and disaggregated; chunked prefill with the engine's default
budget vs a budget so large that every prompt prefills whole) it starts the fleet on the tiny
model, runs the seeded `mixed` workload at each arrival-rate scale, and writes:

  docs/evaluation.md                 tables of every run, the command, commit, machine
  docs/evaluation/*.png              interactive TTFT / ITL p99 and goodput vs offered load;
                                     interactive ITL CDFs per setup at one rate
  docs/evaluation/runs/<setup>-x<rate>/summary.json, report.md   each run's own report

Every number in the document comes from these runs; nothing is typed in by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtests.cli import EVALUATION_SETUPS  # noqa: E402
from loadtests.local_fleet import FleetSetup, local_fleet  # noqa: E402
from loadtests.metrics import summarize  # noqa: E402
from loadtests.records import RunResult  # noqa: E402
from loadtests.report import class_table, render_markdown  # noqa: E402
from loadtests.runner import RunConfig, run_workload  # noqa: E402
from loadtests.workload import load_workload  # noqa: E402

# every prompt prefills in one iteration
WHOLE = {"token_budget": 65536, "chunk_size": 65536, "max_prefill_attention": 0}
TOKENS_ONLY = {"max_prefill_attention": 0}              # Sarathi's budget: tokens, not attention
SETUPS = {
    "colocated-chunked": FleetSetup(mode="colocated"),
    "colocated-tokens-only": FleetSetup(mode="colocated", scheduler=TOKENS_ONLY),
    "colocated-whole": FleetSetup(mode="colocated", scheduler=WHOLE),
    "disagg-chunked": FleetSetup(mode="disagg"),
    "disagg-whole": FleetSetup(mode="disagg", scheduler=WHOLE),
}
assert tuple(SETUPS) == EVALUATION_SETUPS


def run_evaluation(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.rates.split(",")]
    setups = {name: SETUPS[name] for name in args.setups.split(",")}
    base = load_workload(args.workload).with_overrides(duration_s=args.duration)
    out = Path(args.out)
    figures = out / "evaluation"
    results: dict[tuple[str, float], dict] = {}
    runs: dict[tuple[str, float], RunResult] = {}
    started = time.time()
    for name, setup in setups.items():
        setup = replace(setup, model=args.model)
        with local_fleet(base.tenants, setup) as fleet:
            for rate in rates:
                spec = base.with_overrides(rate_scale=rate)
                print(f"{name} x{rate}: {spec.name}, {spec.duration_s:.0f}s ...", flush=True)
                run = asyncio.run(run_workload(spec, RunConfig(fleet.endpoint, tenant_keys=fleet.tenant_keys)))
                run.meta.update(setup=name, command=_command(args))
                results[name, rate] = summary = summarize(run)
                # each run's summary and tables; its raw records and plots stay out of the repository
                folder = figures / "runs" / f"{name}-x{rate:g}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "summary.json").write_text(json.dumps({**summary, "meta": run.meta}, indent=1))
                (folder / "report.md").write_text(render_markdown({**summary, "meta": run.meta}))
                runs[name, rate] = run
    plots = write_plots(results, runs, rates, list(setups), figures)
    text = render(results, rates, list(setups), base, args, plots, time.time() - started)
    (out / "evaluation.md").write_text(text)
    print(f"wrote {out / 'evaluation.md'} and {len(plots)} plots in {figures}")
    return 0


def _command(args: argparse.Namespace) -> str:
    return (f"kvfleet bench evaluation --workload {args.workload} --rates {args.rates}"
            + (f" --duration {args.duration:g}" if args.duration else "")
            + ("" if args.setups == ",".join(SETUPS) else f" --setups {args.setups}"))


def _cls(summary: dict, name: str, *keys: str):
    v = summary["classes"].get(name)
    for k in keys:
        if v is None:
            return None
        v = v[k]
    return v


def summary_rows(results: dict, rates: list[float], setups: list[str]) -> str:
    head = ("| setup | rate x | requests | rejected | errors | goodput (req/s) | tok/s "
            "| chat TTFT p50 / p99 (ms) | chat ITL p50 / p99 (ms) | chat SLO (%) "
            "| document TTFT p99 (s) | document ITL p99 (ms) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for name in setups:
        for rate in rates:
            s = results[name, rate]
            o = s["overall"]
            lines.append(
                f"| {name} | {rate:g} | {o['requests']} | {o['rejected']} | {o['errors']} "
                f"| {o['goodput_rps']:.2f} | {o['output_tokens_per_s']:.0f} "
                f"| {_ms(_cls(s, 'interactive', 'ttft_s', 'p50'))} / {_ms(_cls(s, 'interactive', 'ttft_s', 'p99'))} "
                f"| {_ms(_cls(s, 'interactive', 'itl_s', 'p50'))} / {_ms(_cls(s, 'interactive', 'itl_s', 'p99'))} "
                f"| {_pct(_cls(s, 'interactive', 'attainment', 'slo'))} "
                f"| {_s(_cls(s, 'document', 'ttft_s', 'p99'))} | {_ms(_cls(s, 'document', 'itl_s', 'p99'))} |")
    return "\n".join(lines)


def _ms(v):
    return "-" if v is None else f"{1000 * v:.0f}"


def _s(v):
    return "-" if v is None else f"{v:.2f}"


def _pct(v):
    return "-" if v is None else f"{100 * v:.0f}"


def write_plots(results: dict, runs: dict, rates: list[float], setups: list[str], folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    panels = [("chat TTFT p99 (s)", lambda s: _cls(s, "interactive", "ttft_s", "p99"), "ttft_p99_vs_rate.png"),
              ("chat ITL p99 (s)", lambda s: _cls(s, "interactive", "itl_s", "p99"), "itl_p99_vs_rate.png"),
              ("goodput (req/s)", lambda s: s["overall"]["goodput_rps"], "goodput_vs_rate.png")]
    for ylabel, get, fname in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in setups:
            ys = [get(results[name, r]) for r in rates]
            ax.plot(rates, [y if y is not None else float("nan") for y in ys], marker="o", label=name)
        ax.set_xlabel("offered load (x the mixed workload's rates)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / fname, dpi=100)
        plt.close(fig)
        names.append(fname)
    mid = rates[len(rates) // 2]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in setups:
        gaps = sorted(g for r in runs[name, mid].records if r.ok and r.traffic_class == "interactive" for g in r.itl_s)
        if gaps:
            ax.plot([1000 * g for g in gaps], [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"chat inter-token gap (ms), rate x{mid:g}")
    ax.set_ylabel("fraction of gaps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "itl_cdf_by_setup.png", dpi=100)
    plt.close(fig)
    return [*names, "itl_cdf_by_setup.png"]


def render(results: dict, rates: list[float], setups: list[str], spec, args, plots: list[str],
           elapsed_s: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tenants = ", ".join(f"{t.name} ({t.traffic_class}, weight {t.weight:g}, {t.arrival.process})" for t in spec.tenants)
    parts = [
        "# Evaluation: co-located vs disaggregated, chunked vs whole prefill",
        "",
        "Generated by one command; every number below is a measurement from that run "
        "(DESIGN.md section 10). Regenerate with:",
        "",
        f"    {_command(args)}",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; "
        f"commit `{commit or 'unknown'}`; {elapsed_s / 60:.0f} min in all",
        f"- model: `{args.model}` (the tiny seeded Llama); fleet: `kvfleet up` processes on 127.0.0.1 and a "
        "redis-server, one worker of each role; the load generator runs on the same 2 cores",
        f"- workload: `{spec.name}` ({os.path.relpath(spec.path)}), seed {spec.seed}, {spec.duration_s:.0f} s per run, "
        f"lengths scaled x{spec.scale.prompt:g} (prompts) and x{spec.scale.output:g} (outputs); tenants: {tenants}",
        "- rate x: every tenant's arrival rate multiplied by this (the spec's own rates are x1)",
        "- setups: *chunked* = the engine's defaults (512-token iteration budget, 256-token chunks, and "
        "while sequences decode at most 256 x 1,024 (query, key) attention pairs of prefill per "
        "iteration); *tokens-only* = the same without the attention cap (Sarathi-Serve's token "
        "budget); *whole* = a 65,536-token budget and chunk and no cap, so each prompt prefills in "
        "one iteration",
        "- SLO: a chat meets it with TTFT <= 1 s and its own p99 inter-token gap <= 100 ms; goodput counts "
        "requests of every class that met their class's SLO",
        "",
        "## All runs",
        "",
        summary_rows(results, rates, setups),
        "",
        "## Plots",
        "",
        *[f"![{p}](evaluation/{p})" for p in plots],
        "",
        "## Per-run class tables",
        "",
    ]
    for name in setups:
        for rate in rates:
            parts += [f"### {name}, rate x{rate:g}", "", class_table(results[name, rate]), "",
                      f"Full report: [evaluation/runs/{name}-x{rate:g}/report.md]"
                      f"(evaluation/runs/{name}-x{rate:g}/report.md)", ""]
    return "\n".join(parts)
