"""The report of one load-test run: run.json, summary.json, report.md and PNG plots in one folder.

`write_report` is the entry point; `render_markdown` and `class_table` work on a summary dict alone
(as written to summary.json) so the compare command and docs can reuse the tables.
"""
from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

from loadtests.metrics import summarize
from loadtests.records import RunResult

NONE = "-"  # how a missing number (no data, no target) is shown


# --- formatting ------------------------------------------------------------------------------

def _num(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return NONE if v is None else f"{v * scale:.{digits}f}"


def _triple(stats: dict, scale: float, digits: int, keys: tuple[str, ...]) -> str:
    return " / ".join(_num(stats[k], scale, digits) for k in keys)


def class_table(summary: dict) -> str:
    """The per-class markdown table: counts, latency percentiles, targets, attainment, goodput."""
    rows = ["| class | requests | ok | rejected | errors | TTFT p50/p95/p99 (ms) "
            "| ITL p50/p95/p99 (ms) | e2e p50/p99 (s) | SLO TTFT / ITL (ms) "
            "| attained TTFT / ITL / SLO (%) | goodput (req/s) | tok/s |",
            "|---|---:|---:|---:|---:|---|---|---|---|---|---:|---:|"]
    pct = ("p50", "p95", "p99")
    for name, c in summary["classes"].items():
        att = c["attainment"]
        rows.append(
            f"| {name} | {c['requests']} | {c['ok']} | {c['rejected']} | {c['errors']} "
            f"| {_triple(c['ttft_s'], 1000, 1, pct)} | {_triple(c['itl_s'], 1000, 1, pct)} "
            f"| {_triple(c['e2e_s'], 1, 2, ('p50', 'p99'))} "
            f"| {_num(c['slo']['ttft_s'], 1000, 0)} / {_num(c['slo']['itl_s'], 1000, 0)} "
            f"| {_triple(att, 100, 1, ('ttft', 'itl', 'slo'))} "
            f"| {_num(c['goodput_rps'], digits=2)} | {_num(c['output_tokens_per_s'])} |")
    return "\n".join(rows)


def phase_table(summary: dict) -> str | None:
    """Per class, the median and p99 of each server-reported phase (ms) and its median share of
    e2e; None when no class has phase times."""
    rows = ["| class | timed | queue p50/p99 (ms) | prefill p50/p99 (ms) | transfer p50/p99 (ms) "
            "| decode p50/p99 (ms) | median share queue / prefill / transfer / decode (%) |",
            "|---|---:|---|---|---|---|---|"]
    any_rows = False
    for name, c in summary["classes"].items():
        ph = c.get("phases")
        if not ph:
            continue
        any_rows = True
        cells = [_triple(ph[k], 1000, 1, ("p50", "p99"))
                 for k in ("queue_s", "prefill_s", "transfer_s", "decode_s")]
        shares = " / ".join(_num(ph[k]["share_p50"], 100) for k in
                            ("queue_s", "prefill_s", "transfer_s", "decode_s"))
        rows.append(f"| {name} | {ph['requests']} | " + " | ".join(cells) + f" | {shares} |")
    return "\n".join(rows) if any_rows else None


def _tenant_table(summary: dict) -> str:
    rows = ["| tenant | weight | requests | ok | output tokens | tok/s | share (%) "
            "| demand served (%) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, t in summary["tenants"].items():
        rows.append(f"| {name} | {t['weight']:g} | {t['requests']} | {t['ok']} "
                    f"| {t['output_tokens']} | {_num(t['output_tokens_per_s'])} "
                    f"| {_num(t['share'], 100)} | {_num(t['demand_served'], 100)} |")
    return "\n".join(rows)


def _header(meta: Mapping) -> list[str]:
    command = meta.get("command")
    if isinstance(command, list):
        command = shlex.join(command)
    lines = [f"# Load test: {meta.get('workload', NONE)}", "",
             f"- endpoint: {meta.get('endpoint', NONE)}",
             f"- model: {meta.get('model', NONE)}",
             f"- seed: {meta.get('seed', NONE)}",
             f"- duration: {_num(meta.get('duration_s'), digits=1)} s"]
    if command:
        lines.append(f"- command: `{command}`")
    return lines


def render_markdown(summary: dict, plots: Mapping[str, str] | None = None) -> str:
    """The whole report as markdown. `summary` is summarize()'s dict, optionally with the run's
    "meta" (the header reads workload, endpoint, model, seed, duration_s, command); `plots` maps
    a title to an image path relative to the report, embedded at the end."""
    o = summary["overall"]
    retry = summary["retry_after_s"]
    lines = [*_header(summary.get("meta", {"duration_s": summary["duration_s"]})),
             "", "## Classes", "", class_table(summary), "",
             f"**Overall:** {o['requests']} requests, {o['ok']} ok, {o['rejected']} rejected, "
             f"{o['errors']} errors; goodput {_num(o['goodput_rps'], digits=2)} req/s, "
             f"{_num(o['request_throughput_rps'], digits=2)} ok req/s, "
             f"{_num(o['output_tokens_per_s'])} output tok/s.",
             *(["", "## Phases (server-reported)", "", phases] if (phases := phase_table(summary))
               else []),
             *(["", "## TTFT prediction error (server-reported)", "", errors]
               if (errors := prediction_table(summary)) else []),
             *(["", "## Time in the router's wait queue (server-reported)", "", waits]
               if (waits := queue_table(summary)) else []),
             "", "## Tenants", "", _tenant_table(summary), "",
             f"Jain's fairness index (service against each tenant's weighted max-min fair share): "
             f"{_num(summary['jain_index'], digits=3)}",
             "", "## Errors and rejections", ""]
    if summary["errors_by_reason"]:
        lines += ["| reason | count |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in summary["errors_by_reason"].items()]
    else:
        lines.append("None.")
    if summary.get("rejections_by_stage"):
        lines += ["", "Rejections by overload stage: " + ", ".join(
            f"{stage} {n}" for stage, n in summary["rejections_by_stage"].items()) + "."]
    if retry["count"]:
        lines += ["", f"Retry-After sent on {retry['count']} rejections, "
                      f"median {_num(retry['median'], digits=2)} s."]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({path})" for title, path in plots.items()]
    return "\n".join(lines) + "\n"


def prediction_table(summary: dict) -> str | None:
    """Per class and overall, p50 / p90 of |predicted - actual| / actual TTFT (%); None when no
    request reported a prediction."""
    rows = ["| class | requests | p50 (%) | p90 (%) |", "|---|---:|---:|---:|"]
    parts = [(n, c.get("prediction_error")) for n, c in summary["classes"].items()]
    parts.append(("all", summary.get("prediction_error")))
    rows += [f"| {n} | {e['requests']} | {_num(e['p50'], 100)} | {_num(e['p90'], 100)} |"
             for n, e in parts if e]
    return "\n".join(rows) if summary.get("prediction_error") else None


def queue_table(summary: dict) -> str | None:
    """Per class, how many ok requests waited in the router's wait queue and for how long (ms);
    None when no class reported it."""
    rows = ["| class | requests | queued | p50 / p95 / p99 (ms) | mean (ms) |",
            "|---|---:|---:|---|---:|"]
    parts = [(n, c.get("queue_time_s")) for n, c in summary["classes"].items()]
    rows += [f"| {n} | {q['requests']} | {q['queued']} "
             f"| {_triple(q, 1000, 1, ('p50', 'p95', 'p99'))} | {_num(q['mean'], 1000)} |"
             for n, q in parts if q]
    return "\n".join(rows) if any(q for _, q in parts) else None


# --- plots -----------------------------------------------------------------------------------

def _colours(summary: dict) -> dict[str, str]:
    """A fixed colour per class, shared by every plot."""
    return {name: f"C{i % 10}" for i, name in enumerate(summary["classes"])}


def _by_class(run: RunResult) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in run.records:
        if r.ok:
            out.setdefault(r.traffic_class, []).append(r)
    return out


def _cdf(ax, values_by_class: dict[str, list[float]], colours: dict[str, str], xlabel: str,
         ylabel: str) -> None:
    """Empirical CDF per class (classes without values are skipped); log x when all positive."""
    plotted = []
    for name, values in values_by_class.items():
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name, color=colours.get(name))
        plotted += xs
    if plotted:
        if min(plotted) > 0:
            ax.set_xscale("log")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)


def _ttft_cdf(run: RunResult, summary: dict, ax) -> None:
    ok = _by_class(run)
    _cdf(ax, {n: [r.ttft_s for r in ok.get(n, [])] for n in summary["classes"]},
         _colours(summary), "TTFT (s)", "fraction of requests")
    ax.set_title("TTFT CDF per class")


def _itl_cdf(run: RunResult, summary: dict, ax) -> None:
    ok = _by_class(run)
    _cdf(ax, {n: [g for r in ok.get(n, []) for g in r.itl_s] for n in summary["classes"]},
         _colours(summary), "inter-token gap (s)", "fraction of gaps")
    ax.set_title("ITL CDF per class (all gaps)")


def _latency_over_time(run: RunResult, summary: dict, ax) -> None:
    colours = _colours(summary)
    for name, recs in _by_class(run).items():
        ax.scatter([r.send_s for r in recs], [r.ttft_s for r in recs], s=8,
                   color=colours.get(name), label=name)
    if ax.collections:
        ax.legend(loc="upper left")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", transform=ax.transAxes)
    ax.set_xlabel("send time (s from run start)")
    ax.set_ylabel("TTFT (s)")
    rate = ax.twinx()
    rows = summary["timeline"]
    if rows:  # one step per one-second bucket, the last one drawn to its end
        sent = [row["sent"] for row in rows]
        rate.step([row["t_s"] for row in rows] + [len(rows)], sent + sent[-1:], where="post",
                  color="grey", alpha=0.6)
    rate.set_ylim(bottom=0)
    rate.set_ylabel("requests sent per second (grey)")
    ax.set_title("TTFT over time, with offered rate")


STAGE_NAMES = ("S0 normal", "S1 no batch", "S2 cap output", "S3 fallback", "S4 reject")


def _stage_timeline(run: RunResult, summary: dict, ax) -> None:
    """The highest overload stage requests were decided in, per second of sending (a gap where
    no request said), with the requests rejected per second on a second axis."""
    rows = summary["timeline"]
    ts = [row["t_s"] for row in rows]
    stages = [float("nan") if row["stage"] is None else row["stage"] for row in rows]
    if any(row["stage"] is not None for row in rows):
        ax.step(ts + [len(rows)], stages + stages[-1:], where="post", color="C3")
    else:
        ax.text(0.5, 0.5, "no request named a stage", ha="center", transform=ax.transAxes)
    ax.set_yticks(range(len(STAGE_NAMES)), STAGE_NAMES)
    ax.set_ylim(-0.3, len(STAGE_NAMES) - 0.7)
    ax.set_xlabel("send time (s from run start)")
    rejected = ax.twinx()
    if rows:
        rejected.bar(ts, [row["rejected"] for row in rows], width=1.0, align="edge",
                     color="grey", alpha=0.35)
    rejected.set_ylim(bottom=0)
    rejected.set_ylabel("requests rejected per second (grey)")
    ax.set_title("Overload stage over time (highest per second), with rejections")


def _tenant_throughput(run: RunResult, summary: dict, ax) -> None:
    names = list(summary["tenants"])
    rates = [summary["tenants"][n]["output_tokens_per_s"] for n in names]
    bars = ax.bar(names, rates)
    for bar, n in zip(bars, names):
        ax.annotate(f"w={summary['tenants'][n]['weight']:g}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput per tenant (w = weight)")


PLOTS: dict[str, Callable] = {"ttft_cdf": _ttft_cdf, "itl_cdf": _itl_cdf,
                              "latency_over_time": _latency_over_time,
                              "stage_timeline": _stage_timeline,
                              "tenant_throughput": _tenant_throughput}


def _save_plot(draw: Callable, run: RunResult, summary: dict, path: Path) -> None:
    # imported here, not with the module: pyplot costs ~0.7 CPU s, which every `kvfleet sim run`,
    # `bench serve` and `capacity` process paid at start-up, even one that only refused its input
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")  # files only, no display; must precede the pyplot import
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        draw(run, summary, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


# --- entry point -----------------------------------------------------------------------------

def summary_of(run: RunResult) -> dict:
    """summary.json's content: summarize() plus the run's "meta"."""
    return {"meta": run.meta, **summarize(run)}


def write_report(run: RunResult, out_dir: str | Path) -> dict[str, Path]:
    """Write run.json, summary.json (summarize() plus "meta"), the five PNG plots and report.md
    into out_dir (created if needed). Returns the paths by name: "run", "summary", "report" and
    one per plot ("ttft_cdf", "itl_cdf", "latency_over_time", "stage_timeline",
    "tenant_throughput")."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_of(run)
    paths = {"run": out / "run.json", "summary": out / "summary.json", "report": out / "report.md"}
    run.save(paths["run"])
    paths["summary"].write_text(json.dumps(summary, indent=1))
    for name, draw in PLOTS.items():
        paths[name] = out / f"{name}.png"
        _save_plot(draw, run, summary, paths[name])
    paths["report"].write_text(render_markdown(
        summary, {name: f"{name}.png" for name in PLOTS}))
    return paths
