"""docs/evaluation.md from the evaluation parts' saved JSON
(docs/evaluation/{des,emulated,cpu}.json): tables and matplotlib plots, every number from those
files. A part whose JSON is missing is said to be missing; each part names the command, commit
and date that made it."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtests.eval_des import CACHED, gpus  # noqa: E402
from loadtests.eval_points import EvalPoint  # noqa: E402
from loadtests.knee import Knee, find_knee  # noqa: E402

Points = list[EvalPoint]


# ------------------------------------------------------------------ formatting
def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def refusals(p: EvalPoint) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(p.refusals.items())) or "0"


def errors(p: EvalPoint) -> str:
    """Failures (not refusals) by reason: refusals are in `refusals`."""
    failed = {k: v for k, v in p.errors_by_reason.items() if not k.startswith("http_429")
              and not k.startswith("http_503")}
    return ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or str(p.errors)


def pair(p: EvalPoint, a: str, b: str) -> str:
    """Two of the chats' latencies, in ms."""
    return f"{ms(_cls(p, 'interactive', a))} / {ms(_cls(p, 'interactive', b))}"


def both(d: EvalPoint, e: EvalPoint, key: str) -> str:
    """A chat latency on the simulator / the emulated fleet, in ms."""
    return f"{ms(_cls(d, 'interactive', key))} / {ms(_cls(e, 'interactive', key))}"


def _cls(p: EvalPoint, name: str, key: str):
    c = p.classes.get(name)
    return None if c is None else getattr(c, key)


def load_part(folder: Path, part: str) -> dict | None:
    path = folder / f"{part}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def points(raw: list[dict]) -> Points:
    return [EvalPoint.from_dict(d) for d in raw]


def made_by(m: dict) -> str:
    load = m.get("loadavg_1m") or [None, None]
    return (f"Made by `{m['command']}` at commit `{m['commit']}`, {m['date_utc']}, in "
            f"{m['wall_s'] / 60:.0f} min on {m['cores']} cores ({m['machine']}); 1-minute load "
            f"average {load[0]:.1f} at the start, {load[1]:.1f} at the end.")


# ------------------------------------------------------------------ tables
POINT_HEAD = ("| setup | rate x | offered (req/s) | goodput (req/s) | SLO attainment | refused "
              "(by stage) | errors | chat TTFT p50 / p99 (ms) | chat ITL p50 / p99 (ms) | "
              "document TTFT p50 / p99 (s) | document ITL p99 (ms) | KV transfer mean / p99 (ms) | "
              "transfer "
              "share |")
POINT_RULE = "|---|---:|---:|---:|---:|---|---|---|---|---|---:|---|---:|"


def point_row(setup: str, p: EvalPoint, knee: EvalPoint | None, load: bool = False) -> str:
    mark = " **knee**" if knee is not None and p.rate_scale == knee.rate_scale else ""
    t = p.transfer
    cells = [setup + mark, f"{p.rate_scale:g}", f"{p.offered_rps:.1f}", f"{p.goodput_rps:.2f}",
             pct(p.attainment), refusals(p), errors(p),
             pair(p, "ttft_p50_s", "ttft_p99_s"), pair(p, "itl_p50_s", "itl_p99_s"),
             f"{sec(_cls(p, 'document', 'ttft_p50_s'))} / {sec(_cls(p, 'document', 'ttft_p99_s'))}",
             ms(_cls(p, "document", "itl_p99_s")),
             f"{ms(t.mean_s)} / {ms(t.p99_s)}" if t.moved else "-", pct(t.share)]
    if load:
        cells.append(f"{p.loadavg[0]:.1f} / {p.loadavg[1]:.1f}" if p.loadavg else "-")
    return "| " + " | ".join(cells) + " |"


def points_table(groups: dict[str, Points], load: bool = False) -> str:
    head, rule = POINT_HEAD, POINT_RULE
    if load:
        head, rule = head + " load 1m start / end |", rule + "---|"
    lines = [head, rule]
    for setup, ps in groups.items():
        k = find_knee(ps).point
        lines += [point_row(setup, p, k, load) for p in ps]
    return "\n".join(lines)


def knee_cells(ps: Points, n_gpus: int | None) -> list[str]:
    k = find_knee(ps)
    if k.point is None:
        return ["below the SLOs at the lowest rate", *["-"] * 4, refusals(ps[0]),
                f"{refusals(ps[-1])} (x{ps[-1].rate_scale:g})", "-"]
    p, last = k.point, ps[-1]
    per_gpu = f"{p.goodput_rps / n_gpus:.3f}" if n_gpus else "-"
    t = p.transfer
    return [f"x{p.rate_scale:g}" + ("" if k.found else " (not reached)"), f"{p.offered_rps:.1f}",
            f"{p.goodput_rps:.2f}", per_gpu, why(k, ps), refusals(p),
            f"{refusals(last)} (x{last.rate_scale:g})",
            f"{ms(t.mean_s)} / {ms(t.p99_s)} ({pct(t.share)})" if t.moved else "-"]


def why(k: Knee, ps: Points) -> str:
    if not k.found:
        return k.reason
    nxt = min((p for p in ps if p.rate_scale > k.point.rate_scale), key=lambda p: p.rate_scale)
    return (f"{k.reason} at x{nxt.rate_scale:g} ({nxt.goodput_rps:.2f} req/s, "
            f"{pct(nxt.attainment)})")


KNEE_HEAD = ("| knee (x rate) | offered at knee (req/s) | goodput at knee (req/s) | per GPU "
             "(req/s) | why there (the next point) | refused at knee | refused at the highest "
             "rate | KV transfer at knee mean / p99 (ms) (share) |")
KNEE_RULE = "|---:" * 4 + "|---" * 4 + "|"


# ------------------------------------------------------------------ plots
def plot(groups: dict[str, Points], title: str, path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("goodput (req/s within SLO)", lambda p: p.goodput_rps, False),
              ("SLO attainment", lambda p: p.attainment, False),
              ("chat TTFT p99 (s)", lambda p: _cls(p, "interactive", "ttft_p99_s"), True),
              ("chat ITL p99 (s)", lambda p: _cls(p, "interactive", "itl_p99_s"), True)]
    for ax, (label, get, log) in zip(axes.flat, panels):
        for name, ps in groups.items():
            ys = [get(p) for p in ps]
            line, = ax.plot([p.offered_rps for p in ps],
                            [float("nan") if y is None else y for y in ys], marker="o", ms=3,
                            label=name)
            k = find_knee(ps).point
            if k is not None and get(k) is not None:
                ax.plot([k.offered_rps], [get(k)], marker="*", ms=14, color=line.get_color())
        if label == "SLO attainment":
            ax.axhline(0.9, color="grey", ls="--", lw=0.8)
            ax.set_ylim(0, 1.02)
        if log:
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title + " (star: the knee)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------ sections
DEFINITIONS = """\
- **rate x**: every tenant's arrival rate multiplied by this (the workload file's own rates are
  x1); **offered** is the requests the seeded plan sent over the planned duration.
- **goodput**: requests that met their class's SLO (TTFT and the p99 of their own inter-token
  gaps within the class's targets: chats 1 s / 100 ms, documents 10 s / 100 ms, batch none),
  per second of the planned duration, the window they arrived in. (`kvfleet bench serve`'s
  goodput divides by the whole run, arrivals plus the drain; the drain of the last 16-32K-token
  documents lengthens it at every rate, so its figure is lower and noisier; the JSON keeps it as
  `goodput_run_rps`.) **SLO attainment**: met / sent (a refused request is a miss).
- **knee** (loadtests/knee.py): the point before the first *break* in rising rate, a break being
  the next point's attainment under 90% or its goodput growing by less than half as much as its
  offered load (goodput stops following the load). Rates double from the lowest until points lie
  past the knee, then geometric middles between the knee and the next point refine it.
- **refused (by stage)**: refusals by the overload stage the router named (S0_NORMAL ...
  S4_REJECT); `engine`: refused by an engine after admission (its late-TTFT rule); `none`: the
  refusal named no stage.
- **KV transfer**: first token -> the decode worker starts, over the requests whose KV moved
  (disaggregated ones); **transfer share**: its seconds over those requests' end-to-end seconds.
  The first token streams before the KV moves, so the term lands in the first inter-token gap,
  not in TTFT."""


ANCHORS = ("The anchors: DistServe reports up to 7.4x more requests within SLO than co-located "
           "serving on its workloads, TaiChi +29-77% goodput for a hybrid. docs/capacity.md "
           "(\"Hybrid fleets: the split\" and the 70B study) says where these figures agree "
           "and why not.")


def cached_note(results: dict) -> list[str]:
    """Which sweeps `--cache` reused, with the commit each was made at (empty when none)."""
    reused = [f"{wl} {setup} (`{raw[0]['extra'][CACHED]}`)"
              for wl, by_setup in results.items() for setup, raw in by_setup.items()
              if raw and CACHED in raw[0].get("extra", {})]
    if not reused:
        return []
    swept = sum(len(by_setup) for by_setup in results.values()) - len(reused)
    rest = f"; the other {swept} were swept by this run" if swept else ""
    return [f"Sweeps reused from `--cache` as they were saved, at the commit that made them: "
            f"{', '.join(reused)}{rest}.", ""]


def des_section(saved: dict, folder: Path) -> list[str]:
    m, results = saved["meta"], saved["results"]
    cfg = m["config"]
    tp, target = cfg["sim"]["tp"], cfg["sim"]
    out = ["## 1. Discrete-event simulator: Llama-3-70B on H200s", "", made_by(m), "",
           f"Target: {target['target_model']} {target['dtype']}, TP {tp} on {target['gpu']} per "
           f"replica, KV link {target['network_gbps']:g} Gb/s; setups of equal GPUs "
           f"({', '.join(cfg['setups'])}); {cfg['duration_s']:g} simulated s a run, seed "
           f"{cfg['seed']}, the workloads at their real prompt and output lengths (the shipped "
           "specs shrink them for a 2-core CPU); the router's admission, wait queue and overload "
           "stages on (`kvfleet sim run --admission on`). Step and transfer times are the "
           "capacity model's (docs/capacity.md), not measurements on H200s.", "",
           "### Goodput at the knee", "",
           "| workload | setup | GPUs " + KNEE_HEAD, "|---|---|---:" + KNEE_RULE]
    for wl, by_setup in results.items():
        for setup, raw in by_setup.items():
            out.append(f"| {wl} | {setup} | {gpus(setup, tp)} | "
                       + " | ".join(knee_cells(points(raw), gpus(setup, tp))) + " |")
    out += ["", *des_findings(results, tp), "", ANCHORS, ""]
    out += cached_note(results)
    for wl, by_setup in results.items():
        groups = {s: points(raw) for s, raw in by_setup.items()}
        name = f"des-{wl}.png"
        plot(groups, f"{wl}: 70B on H200, simulated, admission on", folder / name)
        out += [f"### {wl}", "", f"![{wl}](evaluation/{name})", "", points_table(groups), ""]
    return out


def des_findings(results: dict, tp: int) -> list[str]:
    """Per workload: each setup's goodput at its knee against the co-located fleet's, and the
    hybrid against the better of co-located and disaggregated (the issue's comparison)."""
    lines = ["Goodput at the knee, against the co-located fleet of the same GPUs:", ""]
    for wl, by_setup in results.items():
        at = {s: find_knee(points(raw)).point for s, raw in by_setup.items()}
        good = {s: p.goodput_rps for s, p in at.items() if p is not None}
        base = next((s for s in good if s.startswith("colocated")), None)
        if not good or base is None:
            continue
        cells = [f"{s} {g:.1f} req/s" + ("" if s == base or not good[base] else
                                          f" ({g / good[base] - 1:+.0%})") for s, g in good.items()]
        line = f"- `{wl}`: " + ", ".join(cells)
        hybrid = [s for s in good if s.startswith("hybrid")]
        others = [s for s in good if not s.startswith("hybrid")]
        if hybrid and others:
            h, o = hybrid[0], max(others, key=good.get)
            line += f"; the hybrid against the better of the others ({o}): " \
                    f"{good[h] / good[o] - 1:+.0%}"
        lines.append(line + ".")
    return lines


def emulated_section(saved: dict, folder: Path) -> list[str]:
    m, r = saved["meta"], saved["results"]
    des, emu = points(r["des"]), points(r["emulated"])
    out = ["## 2. Emulated 70B fleet against the simulator", "", made_by(m), "",
           f"`{r['workload']}` on {r['setup']}, the 70B target of section 1: the real gateway, "
           "router, Redis and workers (`kvfleet up --engine sim --sim-model llama-3-70b ...`, "
           "engine cores simulated and paced to the target's step times on the wall clock), "
           "loaded over HTTP by `kvfleet bench serve`'s runner, at multiples of the setup's "
           f"discrete-event knee (x{r['des_knee']:g}, "
           + ("given with `--emulated-knee`: without it this part sweeps the setup on the "
              "simulator first" if r.get("knee_given") else "swept first") +
           "), beside the discrete-event run at the same rates. The difference is the fleet's "
           "own overhead on this machine (its processes share the 2 cores with the load "
           "generator and other work).", "",
           "| rate x | offered (req/s) | goodput DES / emulated (req/s) | attainment DES / "
           "emulated | refused DES / emulated | chat TTFT p50 DES / emulated (ms) | chat TTFT "
           "p99 DES / emulated (ms) | chat TTFT p50, the fleet adds (ms) | chat ITL p99 DES / "
           "emulated (ms) | load 1m start / end |",
           "|---:|---:|---|---|---|---|---|---:|---|---|"]
    for d, e in zip(des, emu):
        out.append(
            f"| {d.rate_scale:g} | {e.offered_rps:.1f} | {d.goodput_rps:.2f} / {e.goodput_rps:.2f} "
            f"| {pct(d.attainment)} / {pct(e.attainment)} | {refusals(d)} / {refusals(e)} "
            f"| {both(d, e, 'ttft_p50_s')} | {both(d, e, 'ttft_p99_s')} "
            f"| {adds(d, e, 'ttft_p50_s')} "
            f"| {both(d, e, 'itl_p99_s')} "
            f"| {e.loadavg[0]:.1f} / {e.loadavg[1]:.1f} |")
    groups = {f"{r['setup']} simulated": des, f"{r['setup']} emulated": emu}
    plot(groups, f"{r['workload']}: emulated 70B fleet vs discrete-event", folder / "emulated.png")
    kd, ke = find_knee(des), find_knee(emu)
    out += ["", "![emulated](evaluation/emulated.png)", "",
            f"Knee over these rates: simulated {knee_text(kd)}, emulated {knee_text(ke)}.", "",
            "All points of each side:", "",
            points_table({f"{r['setup']} DES": des}), "", points_table(
                {f"{r['setup']} emulated": emu}, load=True), ""]
    return out


def adds(des: EvalPoint, emu: EvalPoint, key: str) -> str:
    a, b = _cls(des, "interactive", key), _cls(emu, "interactive", key)
    return "-" if a is None or b is None else f"{(b - a) * 1000:+.0f}"


def knee_text(k: Knee) -> str:
    if k.point is None:
        return "none (below the SLOs at the lowest rate)"
    return (f"x{k.point.rate_scale:g} ({k.point.goodput_rps:.2f} req/s"
            + ("" if k.found else ", not reached") + ")")


def cpu_section(saved: dict, folder: Path) -> list[str]:
    m, results = saved["meta"], saved["results"]
    cfg = m["config"]
    groups = {s: points(raw) for s, raw in results.items()}
    out = ["## 3. Real CPU fleet (tiny model)", "", made_by(m), "",
           f"**Measured on a loaded 2-core box** shared with other engineers' test runs: every "
           "point names the 1-minute load average at its start and end. `kvfleet up` on "
           f"127.0.0.1 with a redis-server, one worker of each role, the `{cfg['model']}` model, "
           f"`{cfg['workload']}` as shipped (prompts x0.25), {cfg['duration_s']:g} s a run; the "
           "load generator runs on the same cores.", "",
           "| setup " + KNEE_HEAD, "|---" + KNEE_RULE]
    for setup, ps in groups.items():
        out.append(f"| {setup} | " + " | ".join(knee_cells(ps, None)) + " |")
    plot(groups, f"{cfg['workload']}: real CPU fleet, tiny model", folder / "cpu.png")
    out += ["", "![cpu](evaluation/cpu.png)", "", points_table(groups, load=True), ""]
    return out


LIMITS = """\
## What these figures rest on

- **Section 1 is the cost model's**, not a measurement on H200s: its step and KV-transfer times
  come from the roofline of docs/capacity.md with calibrated efficiencies, checked against three
  published points. Each point is one seed; a short run holds few 16-32K-token documents (at x8
  on `mixed`, about one a second), so the document class's figures are thin. The knee is known
  to the sweep's last refinement (see each table's rates), not exactly.
- **Section 2 measures this machine, not a GPU node**: the emulated fleet's processes share two
  cores with the load generator and other engineers' work, so what it adds to the simulator is
  the overhead of Python processes on a loaded 2-core box (its load average is beside every
  point); on a real node the same code would have cores of its own.
- **Section 3 is the tiny model on a loaded 2-core box**: its knee says where this box stops
  meeting the SLOs under the load of the moment (recorded per point), which moves by the minute;
  it is not a capacity figure for any GPU.
- Each part's JSON keeps every point (per-class counts, p50 / p99, refusals, the transfer term,
  and `goodput_run_rps`); the FCFS (no token budget) baseline and the KV-link sweep are in
  docs/capacity.md, not here."""


def write_document(out: Path) -> Path:
    folder = out / "evaluation"
    folder.mkdir(parents=True, exist_ok=True)
    parts = {p: load_part(folder, p) for p in ("des", "emulated", "cpu")}
    text = ["# Evaluation: co-located, disaggregated and hybrid fleets past their knee", "",
            "Regenerated by one command, `make evaluation` (= `python -m loadtests.evaluation "
            "--out docs`); each part runs alone with `--parts des|emulated|cpu` and saves its "
            "points in `docs/evaluation/<part>.json`, and `--render-only` rewrites this page "
            "from them. Every number below comes from those files; each part names the command, "
            "commit and date that made it.", "", DEFINITIONS, ""]
    sections = {"des": des_section, "emulated": emulated_section, "cpu": cpu_section}
    for name, saved in parts.items():
        if saved is None:
            text += [f"## {name}: not run yet (`python -m loadtests.evaluation --parts {name}`)",
                     ""]
            continue
        text += sections[name](saved, folder)
    text += [LIMITS, ""]
    path = out / "evaluation.md"
    path.write_text("\n".join(text))
    return path
