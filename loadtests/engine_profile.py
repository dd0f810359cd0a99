#!/usr/bin/env python3
"""Where a SmolLM2 burst's CPU time goes in the in-process engine, by part of the step.

    .venv/bin/python loadtests/engine_profile.py --model DIR --dtype bfloat16

The burst of loadtests/vllm_pair.py (`--requests` prompts of `--prompt` seeded random ids,
`--output` greedy tokens, all added at once) after a short warm-up. Each part of the model is
wrapped and charged the process CPU time (`time.process_time`) it took, not the wall clock: on
a shared box a wall-clock profile (torch.profiler's) charges an op for the time the process
waited for a core, which here is most of it. Prints one JSON line: CPU milliseconds per step
for the prefill steps and for the decode steps, by part, and the whole burst's CPU seconds.

A wrapped call inside another wrapped one is charged to both (the MLP's projections are in
"mlp" too; RMSNorm with a residual calls itself once more), so the parts sum to more than the
step. Printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an HF-format checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="EngineConfig.torch_threads")
    p.add_argument("--engine-config", default="{}", help="JSON of engine_config overrides")
    return p.parse_args(argv)


class Charges:
    """CPU seconds per part of the step running now; `file` moves them to the step's phase."""

    def __init__(self) -> None:
        self.on = False
        self.step: Counter = Counter()
        self.cpu: dict[str, Counter] = {"prefill": Counter(), "decode": Counter()}

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def charged(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            t = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[part] += time.process_time() - t

        setattr(owner, name, charged)

    def file(self, phase: str) -> None:
        self.cpu[phase].update(self.step)
        self.step = Counter()


def wrap_parts(charges: Charges, engine) -> None:
    from services.engine.model import attention, layers, llama

    backend = type(engine.executor.runner.backend)
    for owner, name, part in (
            (layers.Linear, "forward", "projections (qkv, o, gate_up, down)"),
            (layers.RMSNorm, "forward", "rmsnorm (+ residual)"),
            (layers.SwiGLU, "forward", "mlp (gate_up, silu * up, down)"),
            (llama, "apply_rope", "rope"),
            (attention, "write_kv", "kv write"),
            (backend, "_gather", "kv gather (decode, later prefill chunks)"),
            (attention, "decode_attention", "decode sdpa"),
            (attention, "prefill_attention", "prefill sdpa"),
            (llama.LlamaForward, "forward", "model forward (all of it)"),
            (type(engine.executor.sampler), "__call__", "sampler"),
            (type(engine.scheduler), "schedule", "scheduler")):
        charges.wrap(owner, name, part)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO_ROOT))
    from loadtests.vllm_pair import prompts, vocab_size
    from services.engine.engine import LLMEngine, engine_config
    from services.engine.sampling_params import SamplingParams

    overrides = {"reject_late": False, "protect_itl": False, "enable_prefix_caching": False,
                 "token_budget": 2048, "chunk_size": 512, "torch_threads": args.threads,
                 **json.loads(args.engine_config)}
    engine = LLMEngine(engine_config(args.model, dtype=args.dtype, **overrides))
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    vocab = vocab_size(args.model)
    engine.generate(prompts(min(args.requests, 4), args.prompt, vocab, 1000), params)
    charges = Charges()
    wrap_parts(charges, engine)
    for ids in prompts(args.requests, args.prompt, vocab, 0):
        engine.add_request(ids, params)
    steps, cpu = Counter(), Counter()
    charges.on = True
    while engine.has_unfinished():
        t = time.process_time()
        engine.step()
        used = time.process_time() - t
        # a step with any prefill tokens is a prefill step (decodes may ride along)
        phase = "prefill" if engine.last_step and engine.last_step.prefill_tokens else "decode"
        charges.file(phase)
        cpu[phase] += used
        steps[phase] += 1
    per_step = {phase: {"steps": steps[phase], "cpu_ms_per_step": _ms(cpu[phase], steps[phase]),
                        "parts_ms_per_step": {k: _ms(v, steps[phase])
                                              for k, v in charges.cpu[phase].most_common()}}
                for phase in ("prefill", "decode")}
    return {"dtype": args.dtype, "requests": args.requests, "prompt": args.prompt,
            "output": args.output, "burst_cpu_s": round(sum(cpu.values()), 2), **per_step}


def _ms(seconds: float, steps: int) -> float:
    return round(1000 * seconds / max(steps, 1), 2)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
