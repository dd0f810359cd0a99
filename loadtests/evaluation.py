"""`make evaluation` = `python -m loadtests.evaluation` (also `kvfleet bench evaluation`):
regenerates docs/evaluation.md and docs/evaluation/, every setup swept past its knee.

Three parts, each runnable alone (`--parts`), each saving its points as JSON under
docs/evaluation/ with the command, commit and date that made them; the document is rendered from
whichever parts' JSON is there (`--render-only` renders without running anything):

  des       the discrete-event simulator, Llama-3-70B fp8 on 4 x H200 per replica: co-located,
            disaggregated and hybrid fleets of the same GPUs on `mixed`, `azure-conv` and
            `overload-ramp`, router admission on (loadtests/eval_des.py; minutes)
  emulated  the emulated 70B fleet (real processes, simulated cores) at multiples of the
            discrete-event knee of one setup, beside the discrete-event runs at the same rates
            (loadtests/eval_fleet.py)
  cpu       the real CPU fleet on the tiny model, co-located and disaggregated, past its knee

The knee and the sweep: loadtests/knee.py. The document: loadtests/eval_report.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

PARTS = ("des", "emulated", "cpu")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {PARTS}")
    p.add_argument("--out", default="docs", help="folder for evaluation.md and evaluation/")
    p.add_argument("--render-only", action="store_true",
                   help="render evaluation.md from the parts' saved JSON; run nothing")
    d = p.add_argument_group("des: the discrete-event simulator on the 70B target")
    d.add_argument("--des-workloads", default="mixed,azure-conv,overload-ramp")
    d.add_argument("--des-setups", default="colocated:4,disagg:2:2,hybrid:2:1:1",
                   help="setups of equal worker count (colocated:N, disagg:P:D, hybrid:N:P:D)")
    d.add_argument("--des-duration", type=float, default=10.0, help="simulated seconds a run")
    d.add_argument("--des-start", type=float, default=0.5, help="the lowest rate scale")
    d.add_argument("--des-max-rate", type=float, default=128.0, help="the highest rate scale")
    d.add_argument("--refine", type=int, default=2,
                   help="geometric middles measured between the knee and the next point")
    d.add_argument("--jobs", type=int, default=1,
                   help="sweeps run at once, each in a process (the figures do not change)")
    d.add_argument("--cache", default=None, metavar="DIR",
                   help="keep each finished sweep here and reuse it when rerun with the same "
                        "settings (an interrupted run resumes)")
    d.add_argument("--sim-kv-tokens", type=int, default=None,
                   help="KV tokens per worker (default: the target's)")
    e = p.add_argument_group("emulated: the 70B fleet, real processes with simulated cores")
    e.add_argument("--emulated-workload", default="mixed")
    e.add_argument("--emulated-setup", default="colocated:2")
    e.add_argument("--emulated-duration", type=float, default=20.0)
    e.add_argument("--emulated-multiples", default="0.0625,0.125,0.25,0.5,1",
                   help="rates as multiples of the setup's discrete-event knee")
    e.add_argument("--emulated-knee", type=float, default=None, metavar="X",
                   help="the setup's discrete-event knee (rate scale) when already known; "
                        "default: swept here first")
    c = p.add_argument_group("cpu: the real CPU fleet (tiny model)")
    c.add_argument("--cpu-workload", default="mixed")
    c.add_argument("--cpu-setups", default="colocated,disagg")
    c.add_argument("--cpu-duration", type=float, default=20.0)
    c.add_argument("--cpu-start", type=float, default=0.5)
    c.add_argument("--cpu-max-rate", type=float, default=16.0)
    c.add_argument("--cpu-refine", type=int, default=1,
                   help="geometric middles measured between the CPU fleet's knee and the next")
    c.add_argument("--model", default="tiny")


def _split(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def configs(args: argparse.Namespace) -> dict:
    """Each asked part's frozen config (ValueError on a bad argument)."""
    from loadtests.eval_des import DesConfig  # noqa: PLC0415
    from loadtests.eval_fleet import CpuConfig, EmulatedConfig  # noqa: PLC0415
    from loadtests.knee import Sweep  # noqa: PLC0415
    from loadtests.workload import load_workload  # noqa: PLC0415
    from services.engine.config import SimConfig  # noqa: PLC0415
    parts = _split(args.parts)
    if not parts or not set(parts) <= set(PARTS):
        raise ValueError(f"--parts: from {', '.join(PARTS)}")
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    sim = SimConfig(kv_tokens=args.sim_kv_tokens)
    named = {"des": _split(args.des_workloads), "emulated": (args.emulated_workload,),
             "cpu": (args.cpu_workload,)}
    for part in parts:
        for workload in named[part]:
            load_workload(workload)          # a SpecError (a ValueError) names what is wrong
    out = {}
    if "des" in parts:
        out["des"] = DesConfig(_split(args.des_workloads), _split(args.des_setups),
                               args.des_duration, sim=sim, sweep=Sweep(
                                   start=args.des_start, max_rate=args.des_max_rate,
                                   past=1, refine=args.refine))
    if "emulated" in parts:
        multiples = tuple(float(x) for x in _split(args.emulated_multiples))
        out["emulated"] = EmulatedConfig(args.emulated_workload, args.emulated_setup,
                                         args.emulated_duration, multiples, sim=sim,
                                         knee=args.emulated_knee)
    if "cpu" in parts:
        out["cpu"] = CpuConfig(args.cpu_workload, _split(args.cpu_setups), args.cpu_duration,
                               args.model, Sweep(start=args.cpu_start, max_rate=args.cpu_max_rate,
                                                 min_rate=args.cpu_start / 8, past=1,
                                                 refine=args.cpu_refine))
    return out


def meta(part: str, cfg, started: float, load_before: float) -> dict:
    return {"part": part, "command": command(), "commit": commit(),
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "wall_s": time.time() - started, "cores": os.cpu_count(),
            "machine": f"{platform.machine()}, Python {platform.python_version()}",
            "loadavg_1m": [load_before, loadavg_1m()], "config": asdict(cfg)}


def loadavg_1m() -> float:
    return os.getloadavg()[0]


def command() -> str:
    args = sys.argv[1:]
    prog = ("kvfleet" if Path(sys.argv[0]).name in ("kvfleet", "cli.py")
            else "python -m loadtests.evaluation")
    return " ".join([prog, *map(shlex.quote, args)])


def commit() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def run_part(part: str, cfg, args: argparse.Namespace) -> dict:
    from loadtests import eval_des, eval_fleet  # noqa: PLC0415
    if part == "des":
        return _dicts(eval_des.run_des(cfg, args.jobs, Path(args.cache) if args.cache else None))
    if part == "emulated":
        return _dicts(eval_fleet.run_emulated(cfg))
    return _dicts(eval_fleet.run_cpu(cfg))


def _dicts(x):
    """Points as dicts, everywhere in a nest of dicts and lists."""
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, dict):
        return {k: _dicts(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_dicts(v) for v in x]
    return x


def run_evaluation(args: argparse.Namespace) -> int:
    out = Path(args.out)
    folder = out / "evaluation"
    try:
        parts = {} if args.render_only else configs(args)
    except ValueError as e:
        print(f"evaluation: {e}", file=sys.stderr)
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    for part, cfg in parts.items():
        started, load = time.time(), loadavg_1m()
        results = run_part(part, cfg, args)
        saved = {"meta": meta(part, cfg, started, load), "results": results}
        (folder / f"{part}.json").write_text(json.dumps(saved, indent=1, default=str))
        print(f"{part}: {time.time() - started:.0f} s, saved {folder / (part + '.json')}",
              flush=True)
    from loadtests.eval_report import write_document  # noqa: PLC0415
    path = write_document(out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.evaluation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run_evaluation(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
