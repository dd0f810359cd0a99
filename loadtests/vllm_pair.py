#!/usr/bin/env python3
"""Paired throughput runs: kvfleet's in-process engine and vLLM's offline `LLM`, same burst.

One side per process, run with that side's own python (nothing of vLLM is imported into kvfleet):

    .venv/bin/python loadtests/vllm_pair.py kvfleet --model DIR --dtype float32
    /tmp/vllm-venv/bin/python loadtests/vllm_pair.py vllm --model DIR --dtype float32

`pair` alternates the two sides (kvfleet, vLLM, kvfleet, vLLM, ...) `--rounds` times and prints
every run and the medians, so each ratio comes from runs taken back to back on the same cores:

    .venv/bin/python loadtests/vllm_pair.py pair --model DIR --dtype float32 --rounds 3 \
        --vllm-python /tmp/vllm-venv/bin/python

The burst: `--requests` prompts of `--prompt` seeded random token ids (the same ids on both
sides), all added at once, `--output` greedy tokens each with ignore_eos; output tok/s = all
output tokens / wall time from the first add to the last token (prefills included). Each process
loads the model, runs a short warm-up burst, then `--bursts` timed bursts, and prints one JSON
line: output tok/s per burst, and output tokens per CPU-second of the side's processes (on a
loaded box the wall clock says how much CPU the side got; the CPU time what its work cost).
Each line also names the side's busy threads (`busy_threads`: CPU seconds per wall second of
every thread that ran over 2% of the bursts), so a run says how many cores each side computed on.
Printed, never asserted: a measurement for docs/benchmarks.md, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# as loadtests/check_vllm_loads_tiny.py sets them (docs/vllm-check.md says why), before vllm imports
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("side", choices=("kvfleet", "vllm", "pair"))
    p.add_argument("--model", required=True, help="an HF-format checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--bursts", type=int, default=2, help="timed bursts per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="pair: kvfleet-then-vLLM rounds")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-eager", action="store_true",
                   help="vLLM with enforce_eager (default: vLLM's own default, torch.compile on CPU)")
    p.add_argument("--threads", type=int, default=0,
                   help="kvfleet side: EngineConfig.torch_threads (0: the engine's default, "
                        "vLLM 0.32's rule: one thread per physical core less one reserved)")
    p.add_argument("--kvfleet-config", default="{}",
                   help="JSON of engine_config overrides for the kvfleet side")
    return p.parse_args(argv)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Ordinary (non-special) token ids, as services/engine/workload.random_prompt draws them."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 256) for _ in range(length)] for _ in range(n)]


def vocab_size(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def run_kvfleet(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO_ROOT))
    from services.engine.engine import LLMEngine, engine_config
    from services.engine.sampling_params import SamplingParams

    overrides = {"reject_late": False, "protect_itl": False, "enable_prefix_caching": False,
                 "token_budget": 2048, "chunk_size": 512, "torch_threads": args.threads,
                 **json.loads(args.kvfleet_config)}
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(args.model, dtype=args.dtype, **overrides))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)

    def burst(ids: list[list[int]]) -> float:
        t = time.perf_counter()
        outs = engine.generate(ids, params)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)

    import torch
    return {**_timed(args, burst, load_s), "threads": torch.get_num_threads()}


def run_vllm(args: argparse.Namespace) -> dict:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0,
              enforce_eager=args.vllm_eager, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)

    def burst(ids: list[list[int]]) -> float:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    return _timed(args, burst, load_s)


def _timed(args: argparse.Namespace, burst, load_s: float) -> dict:
    """A short warm-up burst (other prompts), then args.bursts timed ones on fresh prompts each."""
    vocab = vocab_size(args.model)
    burst(prompts(min(args.requests, 4), args.prompt, vocab, args.seed + 1000))
    threads0, t0, rates = thread_cpu_seconds(), time.perf_counter(), []
    for i in range(args.bursts):
        rates.append(burst(prompts(args.requests, args.prompt, vocab, args.seed + i)))
    threads, wall = thread_cpu_seconds(), time.perf_counter() - t0
    used = {k: s - threads0.get(k, 0.0) for k, s in threads.items()}
    cpu = sum(used.values())
    tokens = args.bursts * args.requests * args.output
    return {"side": args.side, "dtype": args.dtype, "requests": args.requests,
            "prompt": args.prompt, "output": args.output, "load_s": round(load_s, 1),
            "tok_s": [round(r, 2) for r in rates], "cpu_share": round(cpu / wall, 2),
            "tok_per_cpu_s": round(tokens / cpu, 2), "load_avg": os.getloadavg()[0],
            "busy_threads": busy_threads(used, wall)}


def thread_cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of every thread of this process and its live children (vLLM's
    engine core and worker), keyed "process name:thread id". Their sum over the timed bursts is
    the side's CPU; the busiest threads say how many cores the side computed on (vLLM binds one
    OpenMP thread in its worker; the engine runs on its own thread)."""
    import psutil
    me = psutil.Process()
    out: dict[str, float] = {}
    for p in (me, *me.children(recursive=True)):
        try:
            name = p.name()
            for t in p.threads():
                out[f"{name}:{t.id}"] = t.user_time + t.system_time
        except psutil.NoSuchProcess:
            pass
    return out


def busy_threads(used: dict[str, float], wall: float) -> dict[str, float]:
    """The threads that ran over 2% of the bursts' wall time: CPU seconds / wall seconds each."""
    return {k: round(s / wall, 3) for k, s in sorted(used.items(), key=lambda kv: -kv[1])
            if s > 0.02 * wall}


def run_pair(args: argparse.Namespace) -> dict:
    common = ["--model", args.model, "--dtype", args.dtype, "--requests", str(args.requests),
              "--prompt", str(args.prompt), "--output", str(args.output),
              "--bursts", str(args.bursts), "--seed", str(args.seed)]
    sides = {"kvfleet": [sys.executable, __file__, "kvfleet", *common,
                         "--kvfleet-config", args.kvfleet_config, "--threads", str(args.threads)],
             "vllm": [args.vllm_python, __file__, "vllm", *common,
                      *(["--vllm-eager"] if args.vllm_eager else [])]}
    runs: dict[str, list[dict]] = {"kvfleet": [], "vllm": []}
    for r in range(args.rounds):
        for side, cmd in sides.items():
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{side} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            result = side_result(out.stdout)
            runs[side].append(result)
            print(json.dumps({"round": r, **result}), file=sys.stderr, flush=True)
    med = {s: statistics.median(x for run in rs for x in run["tok_s"]) for s, rs in runs.items()}
    per_cpu = {s: statistics.median(run["tok_per_cpu_s"] for run in rs) for s, rs in runs.items()}
    return {"medians_tok_s": med, "kvfleet_over_vllm": round(med["kvfleet"] / med["vllm"], 3),
            "medians_tok_per_cpu_s": per_cpu,
            "kvfleet_over_vllm_per_cpu": round(per_cpu["kvfleet"] / per_cpu["vllm"], 3), "runs": runs}


def side_result(stdout: str) -> dict:
    """A side's JSON line (vLLM may print more lines to stdout after it, as it shuts down)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith('{"side"'):
            return json.loads(line)
    raise SystemExit(f"no result line in the side's output:\n{stdout[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = {"kvfleet": run_kvfleet, "vllm": run_vllm, "pair": run_pair}[args.side]
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
