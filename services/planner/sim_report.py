"""The admission fields of a simulated run's report (`kvfleet sim run --admission on`), as
markdown: refusals by stage, queue time by class, the stage timeline."""
from __future__ import annotations


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def admission_markdown(fields: dict) -> str:
    lines = ["", "## Admission (router, simulated)", "", "Refusals by stage: "
             + (", ".join(f"{k} {v}" for k, v in fields["rejections_by_stage"].items()) or "none")
             + ".", "", "| class | decided | queued | queue time p50 / p95 / p99 (ms) |",
             "|---|---:|---:|---|"]
    for name, q in fields["queue_time_s_by_class"].items():
        lines.append(f"| {name} | {q['requests']} | {q['queued']} | "
                     f"{_ms(q['p50'])} / {_ms(q['p95'])} / {_ms(q['p99'])} |")
    lines += ["", "| t (s) | stage | why |", "|---:|---|---|"]
    lines += [f"| {e['t_s']:.1f} | {e['name']} | {e['why']} |" for e in fields["stage_timeline"]]
    return "\n".join(lines) + "\n"
