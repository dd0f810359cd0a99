"""`kvfleet capacity`: what a (model, GPU, TP, dtype) target holds and how fast it runs, from the
cost model in services/planner/capacity.py; `--check` compares it with published measurements."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from services.planner.capacity import CostModel
from services.planner.constants import load_constants
from services.planner.hardware import GPUS, MODELS

CONTEXTS = (200, 8192, 32768)
PROMPTS = (200, 1000, 2000, 8192, 32768)
BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (2048, 8192, 32768)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-70b",
                   help=f"{' | '.join(MODELS)} or a local HF checkpoint directory")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel GPUs per replica")
    p.add_argument("--dtype", default="fp8", choices=["bf16", "fp8"], help="weights")
    p.add_argument("--kv-dtype", default=None, choices=["bf16", "fp8"],
                   help="KV cache (default: --dtype)")
    p.add_argument("--network-gbps", type=float, default=400.0,
                   help="KV transfer path, Gb/s (default 400: one NIC)")
    p.add_argument("--workload", default=None,
                   help="a workload spec (loadtests/workloads/NAME.yaml or a file): offered "
                        "prefill and decode work and the starting prefill:decode ratio")
    p.add_argument("--unscaled", action="store_true",
                   help="with --workload: ignore the spec's scale (shipped specs shrink prompts "
                        "for a CPU); plan for the real mix")
    r = p.add_argument_group("GPUs needed (with --workload): services/planner/sizing.py")
    r.add_argument("--rate", type=float, default=None, metavar="R",
                   help="requests/s to serve: the replicas and GPUs each fleet mode needs for the "
                        "workload's mix at its SLOs, estimated then checked on the simulator")
    r.add_argument("--duration", type=float, default=10.0,
                   help="with --rate: simulated seconds per check (default 10)")
    r.add_argument("--attainment", type=float, default=0.9,
                   help="with --rate: SLO attainment every class with a target must reach "
                        "(default 0.9)")
    r.add_argument("--max-replicas", type=int, default=32,
                   help="with --rate: the search's bound per mode (default 32)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--check", action="store_true",
                   help="compare with published measurements; exit 1 if any is >15%% off")
    p.add_argument("--constants", default=None, metavar="FILE",
                   help="YAML or JSON overriding the cost model's constants")


def run(args: argparse.Namespace) -> int:
    try:
        constants = load_constants(args.constants)
        if args.check:
            return _check(constants, args.json)
        if args.network_gbps <= 0:
            raise ValueError(f"--network-gbps must be > 0, got {args.network_gbps:g}")
        model = CostModel.for_target(args.model, args.gpu, args.tp, args.dtype, args.kv_dtype,
                                     constants=constants)
        _check_fits(model)
        report = capacity_report(model, args.network_gbps)
        if args.rate is not None and not args.workload:
            raise ValueError("--rate needs --workload (the mix to size for)")
        if args.workload:
            report["workload"] = _workload(model, args.workload, args.unscaled)
        if args.rate is not None:
            report["sizing"] = _sizing(model, args)
    except (ValueError, KeyError, FileNotFoundError) as e:   # SpecError is a ValueError
        print(f"kvfleet capacity: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _check_fits(m: CostModel) -> None:
    t, c = m.target, m.constants
    if m.kv_tokens_per_replica < 1:
        usable = t.gpu.hbm_bytes * c.mem_utilization - c.workspace_gb_per_gpu * 1e9
        raise ValueError(f"{t.model.name} {t.dtype} does not fit {t.tp} x {t.gpu.name}: "
                         f"{t.weights_bytes / t.tp / 1e9:.1f} GB of weights per GPU, "
                         f"{usable / 1e9:.1f} GB usable (mem_utilization x memory - workspace)")


def capacity_report(m: CostModel, gbps: float) -> dict:
    t = m.target
    kv_tokens = m.kv_tokens_per_replica
    return {
        "target": {"model": t.model.name, "gpu": t.gpu.name, "tp": t.tp, "dtype": t.dtype,
                   "kv_dtype": t.kv_dtype},
        "weights_bytes": t.weights_bytes,
        "weights_bytes_per_gpu": t.weights_bytes / t.tp,
        "kv_bytes_per_token": t.kv_bytes_per_token,
        "kv_bytes_per_token_per_rank": t.kv_bytes_per_token_per_rank,
        "kv_tokens_per_replica": kv_tokens,
        "concurrent_contexts": {str(n): m.concurrent_contexts(n) for n in CONTEXTS},
        "prefill_s": {str(n): m.prefill_s(n) for n in PROMPTS},
        "decode_step_s": {str(b): {str(c): (m.decode_step_s(b, c) if b * c <= kv_tokens else None)
                                   for c in DECODE_CONTEXTS} for b in BATCHES},
        "network_gbps": gbps,
        "transfer_s": {str(n): m.transfer_s(n, gbps) for n in PROMPTS},
        "constants": asdict(m.constants),
    }


def _workload(m: CostModel, name: str, unscaled: bool) -> dict:
    from services.planner.offered_load import offered_load  # noqa: PLC0415 (numpy, the specs)
    load = offered_load(m, name, unscaled)
    return {**asdict(load), "request_rate": load.request_rate,
            "prefill_to_decode": load.prefill_to_decode}


def _sizing(m: CostModel, args: argparse.Namespace) -> dict:
    from dataclasses import replace  # noqa: PLC0415

    from loadtests.workload import Scale, load_workload  # noqa: PLC0415
    from services.engine.config import SimConfig  # noqa: PLC0415
    from services.planner.sizing import SizingConfig, size  # noqa: PLC0415
    cfg = SizingConfig(rate_rps=args.rate, attainment=args.attainment,
                       max_replicas=args.max_replicas, tp=args.tp)
    spec = load_workload(args.workload).with_overrides(duration_s=args.duration)
    if args.unscaled:
        spec = replace(spec, scale=Scale())
    sim = SimConfig(target_model=args.model, gpu=args.gpu, tp=args.tp, dtype=args.dtype,
                    kv_dtype=args.kv_dtype, network_gbps=args.network_gbps)
    got = size(spec, m, sim, cfg, progress=None if args.json else lambda f, a: print(
        f"  checked {f:14s} worst class's SLO attainment {a:6.1%}", file=sys.stderr, flush=True))
    return {"rate_rps": got["rate_rps"], "rate_scale": got["rate_scale"],
            "attainment": cfg.attainment, "duration_s": args.duration, "tp": cfg.tp,
            "offered": {"prefill_replica_s_per_s": got["load"].prefill_replica_s_per_s,
                        "decode_replica_s_per_s": got["load"].decode_replica_s_per_s},
            "modes": {s.mode: asdict(s) for s in got["modes"]}}


def render(r: dict) -> str:
    t = r["target"]
    lines = [f"{t['model']} on {t['tp']} x {t['gpu']}, weights {t['dtype']}, KV {t['kv_dtype']}",
             f"  weights               {r['weights_bytes'] / 1e9:8.1f} GB "
             f"({r['weights_bytes_per_gpu'] / 1e9:.1f} GB per GPU)",
             f"  KV per token          {r['kv_bytes_per_token']:8,d} B "
             f"({r['kv_bytes_per_token_per_rank']:,d} B per rank)",
             f"  KV tokens per replica {r['kv_tokens_per_replica']:10,d}",
             "  concurrent contexts   " + "   ".join(
                 f"{n} tok: {c:,d}" for n, c in r["concurrent_contexts"].items()),
             "", f"  {'prompt tokens':>14} {'prefill ms':>11} "
             f"{'KV transfer ms @ ' + format(r['network_gbps'], 'g') + ' Gb/s':>26}"]
    lines += [f"  {n:>14} {1e3 * s:11.1f} {1e3 * r['transfer_s'][n]:26.1f}"
              for n, s in r["prefill_s"].items()]
    contexts = list(next(iter(r["decode_step_s"].values())))
    lines += ["", "  decode step ms (- : the batch's KV does not fit)",
              f"  {'batch':>6} " + " ".join(f"{'ctx ' + c:>10}" for c in contexts)]
    lines += [f"  {b:>6} " + " ".join("{:>10}".format("-" if s is None else f"{1e3 * s:.1f}")
                                      for s in row.values())
              for b, row in r["decode_step_s"].items()]
    if "workload" in r:
        lines += ["", *_render_workload(r["workload"])]
    if "sizing" in r:
        lines += ["", *_render_sizing(r["sizing"])]
    return "\n".join(lines)


def _render_workload(w: dict) -> list[str]:
    return [f"  workload {w['workload']}: {w['requests']} requests in {w['duration_s']:g} s "
            f"({w['request_rate']:.2f}/s), mean prompt {w['mean_prompt_tokens']:.0f}, "
            f"mean output {w['mean_output_tokens']:.0f}",
            f"    prefill  {w['prefill_replica_s_per_s']:8.3f} replica-s per s -> "
            f"{w['prefill_replicas']} replica(s)",
            f"    decode   {w['decode_replica_s_per_s']:8.3f} replica-s per s at batch "
            f"{w['decode_batch']} -> {w['decode_replicas']} replica(s)",
            f"    prefill:decode work = {w['prefill_to_decode']:.2f} : 1"]


def _render_sizing(s: dict) -> list[str]:
    o = s["offered"]
    lines = [f"  GPUs needed at {s['rate_rps']:g} requests/s (x{s['rate_scale']:.3g} the spec's "
             f"rates), SLO attainment >= {s['attainment']:.0%} on {s['duration_s']:g} simulated s:",
             f"    offered: prefill {o['prefill_replica_s_per_s']:.2f}, decode "
             f"{o['decode_replica_s_per_s']:.2f} replica-s per s",
             f"    {'mode':10s} {'estimate':>16s} {'checked':>16s} {'replicas':>8s} {'GPUs':>5s}"]
    for mode, m in s["modes"].items():
        lines.append(f"    {mode:10s} {m['estimate']:>16s} {m['fleet'] or 'none':>16s} "
                     f"{m['replicas'] or '-':>8} {m['gpus'] or '-':>5}"
                     + ("" if m["fleet"] else "  (none within --max-replicas)"))
    return lines


def _check(constants, as_json: bool) -> int:
    from services.planner.published import TOLERANCE, check_points  # noqa: PLC0415
    points = check_points(constants)
    if as_json:
        print(json.dumps([{**asdict(p), "error": p.error, "ok": p.ok} for p in points], indent=2))
    else:
        width = max(len(p.source) for p in points)
        print(f"{'source':<{width}} {'metric':<25} {'published':>10} {'model':>10} {'off':>7}")
        for p in points:
            print(f"{p.source:<{width}} {p.name:<25} {p.published:>10,.1f} {p.model:>10,.1f} "
                  f"{p.error:>+7.1%}{'' if p.ok else '  OVER ' + format(TOLERANCE, '.0%')}")
            if p.assumption:
                print(f"{'':<{width}}   assumed: {p.assumption}")
    return 0 if all(p.ok for p in points) else 1
