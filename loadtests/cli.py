"""`kvfleet bench serve` (one run, one report), `kvfleet bench compare` (the same seeded run
against two endpoints, one after the other, and the ratios B/A) and the arguments of
`kvfleet bench evaluation` (loadtests/evaluation.py). The parsers import nothing heavy: the
`kvfleet` command builds them all on every start."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtests.records import RunResult
    from loadtests.runner import RunConfig
    from loadtests.workload import WorkloadSpec

def add_run_args(p: argparse.ArgumentParser, require_workload: bool = True) -> None:
    p.add_argument("--workload", required=require_workload,
                   help="a spec file, or a shipped one: chat-only, mixed, noisy-neighbor, overload-ramp, azure-conv")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="key for tenants without one of their own")
    p.add_argument("--api-keys", default=None,
                   help="kvfleet gateway keys YAML: each tenant's requests use that tenant's key")
    p.add_argument("--seed", type=int, default=None, help="override the spec's seed")
    p.add_argument("--duration", type=float, default=None, help="override the spec's duration_s")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=None, help="override scale.rate (x arrival rates)")
    p.add_argument("--prompt-mode", choices=["auto", "ids", "text"], default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="don't send vLLM's ignore_eos (for servers that refuse it)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    add_run_args(p)
    p.add_argument("--out", default="loadtest-report", help="folder for run.json, summary.json, report.md, PNGs")


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", action="append", default=[],
                   help="base URL; give it twice (A, then B)")
    p.add_argument("--summary", action="append", default=[], metavar="FILE",
                   help="instead of two endpoints, two saved runs' summary.json (A, then B): "
                        "kvfleet bench serve's or kvfleet sim run's")
    add_run_args(p, require_workload=False)
    p.add_argument("--out", default="loadtest-compare", help="folder: A/ and B/ reports plus compare.md")


def add_evaluation_args(p: argparse.ArgumentParser) -> None:
    from loadtests.evaluation import add_args
    add_args(p)


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    from loadtests.workload import load_workload
    return load_workload(args.workload).with_overrides(
        seed=args.seed, duration_s=args.duration, max_requests=args.max_requests, rate_scale=args.rate_scale)


def config_from_args(args: argparse.Namespace, endpoint: str) -> RunConfig:
    from loadtests.runner import RunConfig
    return RunConfig(endpoint=endpoint, model=args.model, api_key=args.api_key,
                     tenant_keys=read_tenant_keys(args.api_keys) if args.api_keys else {},
                     prompt_mode=args.prompt_mode, temperature=args.temperature,
                     ignore_eos=args.ignore_eos, request_timeout_s=args.timeout,
                     progress=args.progress and sys.stderr.isatty())


def read_tenant_keys(path: str) -> dict[str, str]:
    """tenant -> key, from a kvfleet gateway keys file (a list of {key, tenant, ...})."""
    import yaml

    from loadtests.distributions import SpecError
    entries = yaml.safe_load(Path(path).read_text())
    if not isinstance(entries, list):
        raise SpecError(f"{path}: expected a list of {{key, tenant, ...}} entries")
    return {e["tenant"]: e["key"] for e in entries if isinstance(e, dict) and "tenant" in e and "key" in e}


def run_once(spec: WorkloadSpec, cfg: RunConfig, out: Path, command: list[str]) -> tuple[RunResult, dict]:
    import asyncio

    from loadtests.metrics import summarize
    from loadtests.report import write_report
    from loadtests.runner import run_workload
    run = asyncio.run(run_workload(spec, cfg))
    run.meta["command"] = command
    write_report(run, out)
    return run, summarize(run)


def _spec_or_usage_error(args: argparse.Namespace, command: str) -> WorkloadSpec | None:
    """The workload, or None after printing why it can't be used (the caller exits 2)."""
    from loadtests.distributions import SpecError
    try:
        return spec_from_args(args)
    except SpecError as e:
        print(f"kvfleet bench {command}: {e}", file=sys.stderr)
        return None


def run_serve(args: argparse.Namespace) -> int:
    from loadtests.report import class_table
    spec = _spec_or_usage_error(args, "serve")
    if spec is None:
        return 2
    out = Path(args.out)
    run, summary = run_once(spec, config_from_args(args, args.endpoint), out, _command())
    print(f"{spec.name}: {len(run.records)} requests in {run.meta['duration_s']:.1f}s "
          f"against {args.endpoint} ({run.meta['model']}); report in {out}/report.md\n")
    print(class_table(summary))
    overall = summary["overall"]
    print(f"\ngoodput {overall['goodput_rps']:.2f} req/s, {overall['output_tokens_per_s']:.0f} output tok/s, "
          f"errors {overall['errors']}, rejected {overall['rejected']}, Jain {summary['jain_index']}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    if args.summary:
        return compare_summaries(args.summary, Path(args.out))
    if len(args.endpoint) != 2 or not args.workload:
        print("kvfleet bench compare: give --workload and --endpoint exactly twice (A, then B), "
              "or --summary twice", file=sys.stderr)
        return 2
    spec = _spec_or_usage_error(args, "compare")
    if spec is None:
        return 2
    out = Path(args.out)
    summaries = []
    for label, endpoint in zip("AB", args.endpoint):
        _, summary = run_once(spec, config_from_args(args, endpoint), out / label, _command())
        summaries.append(summary)
    table = compare_table(*summaries, labels=tuple(args.endpoint))
    (out / "compare.md").write_text(f"# {spec.name}: A = {args.endpoint[0]}, B = {args.endpoint[1]}\n\n"
                                    f"{table}\n")
    print(table)
    return 0


def compare_summaries(paths: list[str], out: Path) -> int:
    """Two saved summaries side by side (e.g. a simulated run beside a real one)."""
    import json
    if len(paths) != 2:
        print("kvfleet bench compare: give --summary exactly twice (A, then B)", file=sys.stderr)
        return 2
    summaries = []
    for path in paths:
        try:
            summary = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"kvfleet bench compare: cannot read {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(summary, dict) or not {"overall", "classes"} <= summary.keys():
            print(f"kvfleet bench compare: {path} is not a run's summary.json", file=sys.stderr)
            return 2
        summaries.append(summary)
    table = compare_table(*summaries, labels=(paths[0], paths[1]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(f"# A = {paths[0]}, B = {paths[1]}\n\n{table}\n")
    print(table)
    return 0


def compare_rows(a: dict, b: dict) -> list[tuple[str, float | None, float | None]]:
    """(metric, A, B): goodput and tokens/s overall, then p99 TTFT, p99 ITL and SLO attainment per
    class present in both runs."""
    rows = [("goodput (req/s)", a["overall"]["goodput_rps"], b["overall"]["goodput_rps"]),
            ("output tok/s", a["overall"]["output_tokens_per_s"], b["overall"]["output_tokens_per_s"])]
    for name in a["classes"]:
        if name not in b["classes"]:
            continue
        ca, cb = a["classes"][name], b["classes"][name]
        rows += [(f"{name} TTFT p99 (s)", ca["ttft_s"]["p99"], cb["ttft_s"]["p99"]),
                 (f"{name} ITL p99 (s)", ca["itl_s"]["p99"], cb["itl_s"]["p99"]),
                 (f"{name} SLO attained", ca["attainment"]["slo"], cb["attainment"]["slo"]),
                 (f"{name} goodput (req/s)", ca["goodput_rps"], cb["goodput_rps"])]
    return rows


def compare_table(a: dict, b: dict, labels: tuple[str, str] = ("A", "B")) -> str:
    lines = [f"| metric | A: {labels[0]} | B: {labels[1]} | B/A |", "|---|---:|---:|---:|"]
    for name, va, vb in compare_rows(a, b):
        ratio = "-" if va in (None, 0) or vb is None else f"{vb / va:.2f}"
        lines.append(f"| {name} | {_fmt(va)} | {_fmt(vb)} | {ratio} |")
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _command() -> list[str]:
    return ["kvfleet", *sys.argv[1:]] if Path(sys.argv[0]).name in ("kvfleet", "cli.py") else sys.argv
