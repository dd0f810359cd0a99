"""The `kvfleet` command line. Each subcommand is a thin parser over a module that does the work."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand that imports its module only when it runs, so that one subcommand does not
    pay for another's imports (matplotlib, the load tester, the fleet)."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)
    return run


def _make_tiny_model(args: argparse.Namespace) -> int:
    from services.engine.tiny_model import make_tiny_model
    path = make_tiny_model(args.dir, seed=args.seed, layers=args.layers, hidden=args.hidden,
                           heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                           max_positions=args.max_positions)
    print(path)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.fleet:
        from services.cli.fleet_demo import run_fleet_demo
        return run_fleet_demo(args)
    from services.cli.engine_demo import run_demo
    return run_demo(args)


def _serve(args: argparse.Namespace) -> int:
    from services.protocol.aio import run
    from services.worker.serve import serve
    return run(serve(args))


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
    t.set_defaults(func=_make_tiny_model)

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
    g.set_defaults(func=_lazy("services.cli.engine_generate", "run_generate"))

    d = sub.add_parser("demo", help="mixed chats + documents through the engine, SLOs per class")
    d.add_argument("--model", default="tiny")
    d.add_argument("--chats", type=int, default=48)
    d.add_argument("--documents", type=int, default=2)
    d.add_argument("--doc-tokens", type=int, default=8192)
    d.add_argument("--rate", type=float, default=12.0, help="chat arrivals per second")
    d.add_argument("--budget", type=int, default=256, help="tokens per iteration")
    d.add_argument("--chunk", type=int, default=128, help="max prefill chunk per sequence")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--fleet", action="store_true",
                   help="through `kvfleet up` and the REST API instead of the in-process engine")
    d.add_argument("--mode", choices=["disagg", "colocated"], default="disagg",
                   help="with --fleet: the fleet's mode")
    d.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the baseline run whose prefills are not chunked")
    d.set_defaults(func=_demo)

    from services.worker.serve import add_worker_args
    w = sub.add_parser("serve", help="run one worker process (prefill | decode | mixed)")
    add_worker_args(w)
    w.set_defaults(func=_serve)

    from services.cli.up import add_up_args
    u = sub.add_parser("up", help="start the whole fleet on this host (Ctrl-C stops it)")
    add_up_args(u)
    u.set_defaults(func=_lazy("services.cli.up", "run_up"))

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="target", required=True)
    be = bsub.add_parser("engine", help="in-process engine throughput and overheads")
    be.add_argument("--model", default="tiny")
    be.add_argument("--json", action="store_true")
    be.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    be.set_defaults(func=_lazy("services.cli.engine_bench", "run_bench"))
    bf = bsub.add_parser("fleet", help="what the fleet adds over the in-process engine")
    bf.add_argument("--model", default="tiny")
    bf.add_argument("--mode", choices=["disagg", "colocated"], default="colocated")
    bf.add_argument("--kv-backend", choices=["tcp", "nixl"], default="tcp")
    bf.add_argument("--repeats", type=int, default=40)
    bf.add_argument("--json", action="store_true")
    bf.set_defaults(func=_lazy("services.cli.fleet_bench", "run_fleet_bench"))
    from loadtests.burst import add_burst_args
    bb = bsub.add_parser("burst", help="N chats (+ M documents) at once against an OpenAI endpoint: "
                                       "refusals, TTFT / ITL, tok/s")
    add_burst_args(bb)
    bb.set_defaults(func=_lazy("loadtests.burst", "run_burst"))
    from services.cli.fleet_soak import add_soak_args
    bk = bsub.add_parser("soak", help="a supervised fleet under closed-loop load with random "
                                      "disconnects: outcomes, leaks, RSS")
    add_soak_args(bk)
    bk.set_defaults(func=_lazy("services.cli.fleet_soak", "run_soak"))
    from loadtests.cli import add_compare_args, add_evaluation_args, add_serve_args
    bs = bsub.add_parser("serve", help="open-loop load test of an OpenAI-compatible endpoint: SLO report")
    add_serve_args(bs)
    bs.set_defaults(func=_lazy("loadtests.cli", "run_serve"))
    bc = bsub.add_parser("compare", help="the same seeded load test against two endpoints, and the ratios")
    add_compare_args(bc)
    bc.set_defaults(func=_lazy("loadtests.cli", "run_compare"))
    bv = bsub.add_parser("evaluation", help="regenerate docs/evaluation.md: setups x arrival rates")
    add_evaluation_args(bv)
    bv.set_defaults(func=_lazy("loadtests.evaluation", "run_evaluation"))

    ev = sub.add_parser("eval", help="evaluations")
    esub = ev.add_subparsers(dest="target", required=True)
    from loadtests.quality.gate import add_quality_args
    eq = esub.add_parser("quality", help="gate: score a candidate model against the reference on an eval set")
    add_quality_args(eq)
    eq.set_defaults(func=_lazy("loadtests.quality.gate", "run_quality"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM ends a command as Ctrl-C does: its `finally` blocks stop the fleets and servers it
    # started (the bench and demo commands launch whole fleets). `kvfleet up` and the workers
    # install their own handlers on top of this one.
    signal.signal(signal.SIGTERM, _terminate)
    return args.func(args)


def _terminate(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
