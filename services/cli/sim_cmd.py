"""`kvfleet sim calibrate` (a measured step profile of this machine's engine) and `kvfleet sim run`
(the discrete-event fleet simulator). Arguments here; the work in services/planner/."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.engine.config import KV_CACHE_MIB


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, a named model, or a checkpoint dir")
    p.add_argument("--out", default="step-profile.json", help="the profile file to write")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads; default: the engine's (vLLM's rule: the physical cores less "
                        "one, at least 1). Measure with the threads the fleet's workers use")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds): a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="a step's time over its repeated runs: median (typical on a shared "
                        "machine, default) or min (the machine unloaded)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    f = p.add_argument_group("in a fleet: the steps and the fleet's own costs under load")
    f.add_argument("--in-fleet", action="store_true",
                   help="measure inside a real co-located fleet serving a workload (its engine "
                        "core traces every step) instead of the engine alone; also writes the "
                        "fleet's overhead (--overhead-out) for kvfleet sim run --sim-overhead")
    f.add_argument("--workload", default="mixed", help="with --in-fleet: the workload served")
    f.add_argument("--rate-scale", type=float, default=0.75, help="with --in-fleet: x arrival rates")
    f.add_argument("--duration", type=float, default=30.0, help="with --in-fleet: seconds served")
    f.add_argument("--overhead-out", default="fleet-overhead.json",
                   help="with --in-fleet: the fleet overhead file to write")


def run_in_fleet(args: argparse.Namespace, threads: int) -> int:
    from loadtests.distributions import SpecError  # noqa: PLC0415
    from loadtests.workload import load_workload  # noqa: PLC0415
    from services.planner.in_fleet import calibrate_in_fleet, with_overhead_of  # noqa: PLC0415
    try:
        spec = load_workload(args.workload).with_overrides(duration_s=args.duration,
                                                           rate_scale=args.rate_scale)
        got = calibrate_in_fleet(spec, model=args.model, threads=threads)
    except (SpecError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvfleet sim calibrate: {e}", file=sys.stderr)
        return 2
    got.profile.save(args.out)
    got.overhead.save(args.overhead_out)
    print(json.dumps(with_overhead_of(got), indent=1))
    print(f"profile written to {args.out}, fleet overhead to {args.overhead_out}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from services.planner.calibrate import CalibrateConfig, calibrate  # noqa: PLC0415
    if args.threads is not None and args.threads < 1:
        print("kvfleet sim calibrate: --threads must be >= 1", file=sys.stderr)
        return 2
    from services.engine.model.threads import engine_threads  # noqa: PLC0415
    threads = args.threads if args.threads is not None else engine_threads(0)
    if args.in_fleet:
        return run_in_fleet(args, threads)
    try:
        profile = calibrate(CalibrateConfig(model=args.model, threads=threads,
                                            quick=args.quick, seed=args.seed, stat=args.stat),
                            progress=None if args.json else lambda m: print(m, file=sys.stderr))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvfleet sim calibrate: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    fit = profile.fit
    print(f"{profile.model} ({profile.dtype}, {profile.threads} threads): {fit.samples} steps, "
          f"R^2 {fit.r2:.4f}, |relative error| mean {fit.mean_abs_rel_error:.1%} "
          f"p90 {fit.p90_abs_rel_error:.1%} max {fit.max_abs_rel_error:.1%}, "
          f"total {fit.total_rel_error:+.1%}")
    for term, c in profile.coefficients.items():
        print(f"  {term:24s} {c * 1e6:12.4f} us")
    print(f"profile written to {args.out}")
    return 0


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True,
                   help="a spec file, or a shipped one: chat-only, mixed, noisy-neighbor, "
                        "overload-ramp, azure-conv")
    p.add_argument("--fleet", required=True,
                   help="colocated:N | disagg:P:D | hybrid:N:P:D (N mixed, P prefill, D decode)")
    p.add_argument("--hybrid-threshold-tokens", type=int, default=0, metavar="N",
                   help="hybrid: the longest prompt served co-located (default: the capacity "
                        "model's split for the target, services/planner/hybrid.py)")
    p.add_argument("--model", default="tiny",
                   help="the served model: its tokenizer and config (vocab, context); no weights")
    t = p.add_argument_group("step times: a target's cost model (default) or a measured profile")
    t.add_argument("--sim-model", default=None, help="target model (default llama-3-70b)")
    t.add_argument("--sim-gpu", default=None, help="target GPU (default h200)")
    t.add_argument("--sim-tp", type=int, default=None, help="target tensor parallelism (default 4)")
    t.add_argument("--sim-dtype", default=None, help="target weights: bf16 | fp8 (default fp8)")
    t.add_argument("--sim-kv-dtype", default=None, help="target KV cache (default: --sim-dtype)")
    t.add_argument("--sim-profile", default=None, metavar="FILE",
                   help="a kvfleet sim calibrate profile instead of a target (KV capacity: the "
                        "served model's real worker's)")
    t.add_argument("--sim-step-ms", type=float, default=None, metavar="MS",
                   help="every step takes MS (no target, no profile)")
    t.add_argument("--sim-overhead", default=None, metavar="FILE",
                   help="the fleet's own costs measured in a real fleet (kvfleet sim calibrate "
                        "--in-fleet): each request's path to its first token, the KV hand-off")
    p.add_argument("--sim-network-gbps", type=float, default=None, metavar="G",
                   help="KV transfer bandwidth in Gbit/s (default 400)")
    p.add_argument("--sim-kv-tokens", type=int, default=None, metavar="N",
                   help="KV capacity per worker in tokens (default: the target's; with "
                        "--sim-profile, what --kv-cache-mib holds of the served model's KV)")
    p.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB,
                   help=f"with --sim-profile: the real worker's KV cache (default {KV_CACHE_MIB})")
    p.add_argument("--seed", type=int, default=None, help="override the spec's seed")
    p.add_argument("--duration", type=float, default=None, help="override the spec's duration_s")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=None,
                   help="override scale.rate (x arrival rates)")
    p.add_argument("--out", default="sim-report",
                   help="folder for run.json, summary.json, report.md, PNGs (as kvfleet bench serve)")
    p.add_argument("--json", action="store_true", help="print summary.json's content")
    p.add_argument("--admission", choices=("on", "off"), default="off",
                   help="on: the router's admission, wait queue and overload stages decide each "
                        "request (services/planner/sim_admission.py); off: every request is placed")


def sim_config_of(args: argparse.Namespace):
    from services.engine.config import SimConfig  # noqa: PLC0415
    if args.sim_profile and (args.sim_model or args.sim_gpu or args.sim_tp or args.sim_dtype):
        raise ValueError("give a target (--sim-model/--sim-gpu/--sim-tp/--sim-dtype) or "
                         "--sim-profile, not both")
    given = {"target_model": args.sim_model, "gpu": args.sim_gpu, "tp": args.sim_tp,
             "dtype": args.sim_dtype, "kv_dtype": args.sim_kv_dtype, "profile": args.sim_profile,
             "network_gbps": args.sim_network_gbps, "kv_tokens": args.sim_kv_tokens,
             "step_s": None if args.sim_step_ms is None else args.sim_step_ms / 1000.0}
    return SimConfig(**{k: v for k, v in given.items() if v is not None})


def run_sim(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415

    from loadtests.cli import spec_from_args  # noqa: PLC0415
    from loadtests.distributions import SpecError  # noqa: PLC0415
    from loadtests.report import class_table, write_report  # noqa: PLC0415
    from services.engine.config import EngineConfig  # noqa: PLC0415
    from services.planner.overhead import FleetOverhead  # noqa: PLC0415
    from services.planner.profile import ProfileError  # noqa: PLC0415
    from services.planner.simulator import Fleet, SimRunConfig, simulate  # noqa: PLC0415
    try:
        spec = spec_from_args(args)
        sim = sim_config_of(args)
        cfg = SimRunConfig(fleet=Fleet.parse(args.fleet), sim=sim, model=args.model,
                           engine=EngineConfig(kv_cache_mib=args.kv_cache_mib),
                           admission=admission_of(args.admission, spec, sim.network_gbps),
                           hybrid_threshold_tokens=args.hybrid_threshold_tokens,
                           overhead=FleetOverhead.load(args.sim_overhead) if args.sim_overhead
                           else None)
        if args.hybrid_threshold_tokens < 0:
            raise ValueError("--hybrid-threshold-tokens must be >= 1 (0: the model's split)")
        outcome = simulate(spec, cfg)
    except (SpecError, ProfileError, ValueError, KeyError) as e:
        print(f"kvfleet sim run: {e}", file=sys.stderr)
        return 2
    run = outcome.run
    run.meta["command"] = ["kvfleet", "sim", "run", *sys.argv[3:]] if sys.argv[1:3] == ["sim", "run"] \
        else sys.argv
    out = Path(args.out)
    paths = write_report(run, out)
    summary = json.loads(paths["summary"].read_text())
    if outcome.admission is not None:
        summary = add_admission(paths, summary, outcome.admission)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{spec.name} on {cfg.fleet} (simulated): {len(run.records)} requests, "
          f"{outcome.simulated_s:.1f} simulated s in {outcome.wall_s - outcome.setup_s:.1f} wall s "
          f"({outcome.speedup:.1f}x real time; {outcome.steps} engine steps; setup "
          f"{outcome.setup_s:.1f} s); report in {out}/report.md\n")
    print(class_table(summary))
    overall = summary["overall"]
    print(f"\ngoodput {overall['goodput_rps']:.2f} req/s, {overall['output_tokens_per_s']:.0f} "
          f"output tok/s, errors {overall['errors']}, rejected {overall['rejected']}")
    return 0


def add_study_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="a spec file or a shipped workload")
    p.add_argument("--prompt-scale", type=float, default=1.0,
                   help="the workload's prompt scale (1.0: the seed's real lengths; the shipped "
                        "specs scale prompts down for a CPU)")
    p.add_argument("--replicas", type=int, default=4,
                   help="workers per setup (each one replica of --sim-tp GPUs); default 4")
    p.add_argument("--fleets", default=None,
                   help="comma-separated setups (default: co-located, every disaggregated "
                        "split and a hybrid of --replicas workers)")
    p.add_argument("--rates", default="0.5,1,2,4,8,16", help="rate scales to sweep, ascending")
    p.add_argument("--gbps", default="3200,400,14.4",
                   help="KV transfer bandwidths to sweep, Gbit/s (8 x 400, 1 x 400, 1.8 GB/s)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    for flag, default in (("--sim-model", "llama-3-70b"), ("--sim-gpu", "h200"),
                          ("--sim-dtype", "fp8")):
        p.add_argument(flag, default=default)
    p.add_argument("--sim-tp", type=int, default=4)
    p.add_argument("--sim-kv-tokens", type=int, default=None, metavar="N",
                   help="KV capacity per worker in tokens (default: the target's)")
    p.add_argument("--scheduler", choices=("chunked", "fcfs"), default="chunked",
                   help="chunked: the engine's scheduler (token budget, chunked prefill); fcfs: "
                        "the baseline, whole prompts first come first served with no token "
                        "budget (services/planner/study.py fcfs_engine)")
    p.add_argument("--out", default="docs/capacity/study", help="folder for study.json, goodput.png")


def run_study(args: argparse.Namespace) -> int:
    from dataclasses import replace  # noqa: PLC0415

    from loadtests.distributions import SpecError  # noqa: PLC0415
    from loadtests.workload import load_workload  # noqa: PLC0415
    from services.engine.config import SimConfig  # noqa: PLC0415
    from services.planner import study  # noqa: PLC0415
    try:
        spec = load_workload(args.workload).with_overrides(seed=args.seed, duration_s=args.duration)
        spec = replace(spec, scale=replace(spec.scale, prompt=args.prompt_scale))
        rates = sorted(float(x) for x in args.rates.split(","))
        gbps = [float(x) for x in args.gbps.split(",")]
        if args.replicas < 2 or min(rates) <= 0 or min(gbps) <= 0:
            raise ValueError("--replicas must be >= 2, rates and bandwidths > 0")
        fleets = args.fleets.split(",") if args.fleets else study.setups(args.replicas)
        sim = SimConfig(target_model=args.sim_model, gpu=args.sim_gpu, tp=args.sim_tp,
                        dtype=args.sim_dtype, kv_tokens=args.sim_kv_tokens)
        points = study.sweep(spec, sim, fleets, rates, gbps, progress=lambda p: print(
            f"{p.setup:16s} {p.gbps:7g} Gb/s x{p.rate_scale:<5g} offered {p.offered_rps:7.2f} "
            f"goodput {p.goodput_rps:7.2f} req/s attainment {p.attainment:6.1%} "
            f"TTFT p99 {p.ttft_p99_s:7.3f} s ITL p99 {p.itl_p99_s * 1000:6.1f} ms",
            file=sys.stderr, flush=True),
            engine=study.fcfs_engine() if args.scheduler == "fcfs" else None)
    except (SpecError, ValueError, KeyError) as e:
        print(f"kvfleet sim study: {e}", file=sys.stderr)
        return 2
    table = study.write(points, spec, sim, Path(args.out))
    for k in table["knees"]:
        print(f"{k['setup']:16s} {k['gbps']:7g} Gb/s  knee x{k['knee_rate_scale']}  goodput "
              f"{k['goodput_rps']:.2f} req/s = {k['goodput_rps_per_gpu']:.3f} per GPU "
              f"({k['gpus']} GPUs)")
    return 0


def admission_of(mode: str, spec, network_gbps: float):
    """The router's admission for `--admission on` (None: off)."""
    if mode != "on":
        return None
    from services.planner.sim_admission import SimAdmissionConfig, policy_for  # noqa: PLC0415
    return SimAdmissionConfig(policy=policy_for(spec, network_gbps))


def add_admission(paths: dict, summary: dict, fields: dict) -> dict:
    """summary.json and report.md gain the admission's fields: refusals by stage, queue time by
    class and the stage timeline."""
    from services.planner.sim_report import admission_markdown  # noqa: PLC0415
    summary = {**summary, **fields}
    paths["summary"].write_text(json.dumps(summary, indent=1))
    with paths["report"].open("a") as f:
        f.write(admission_markdown(fields))
    return summary
