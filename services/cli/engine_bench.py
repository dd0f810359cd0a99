"""`kvfleet bench engine`: in-process engine throughput and overheads on this machine.

Measures: decode tokens/s at batch 1, 32, 128; prefill tokens/s in 512-token chunks; time to
prefill a 32K-token document (or the model's longest prompt, if shorter); scheduler + input preparation time per iteration at 256 running
sequences, as a fraction of step time; output tokens/s for 32 concurrent 200-in/64-out requests;
peak RSS. Numbers are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from services.engine.device import check_device
from services.engine.engine import LLMEngine, engine_config, resolve_model_dir
from services.engine.model.config import ModelConfig
from services.engine.sampling_params import SamplingParams
from services.engine.workload import random_prompt


def _engine(model: str, **kw) -> LLMEngine:
    kw.setdefault("reject_late", False)
    kw.setdefault("protect_itl", False)     # it measures the batch sizes it asks for
    kw.setdefault("enable_prefix_caching", False)
    return LLMEngine(engine_config(model, **kw))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _fill(engine: LLMEngine, batch: int, prompt: int, max_tokens: int, seed: int = 0,
          traffic_class: str = "interactive") -> None:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        engine.add_request(random_prompt(rng, prompt, vocab), _params(max_tokens),
                           traffic_class=traffic_class)


def _blocks_for(seqs: int, tokens: int, block_size: int = 16) -> int:
    """KV blocks for `seqs` sequences of `tokens` each (the default 512 MiB holds ~11K tokens of
    a 30-layer model such as SmolLM2, too few for 128 x 126)."""
    return seqs * -(-tokens // block_size) + 1


def decode_rate(model: str, batch: int, steps: int, where: dict | None = None) -> dict:
    """Tokens/s of pure decode iterations with `batch` running sequences. where: the engine's
    device and cuda_graphs (EngineConfig fields; their defaults when absent)."""
    prompt, max_tokens = 32, steps + 64
    engine = _engine(model, token_budget=max(512, batch), max_running=max(batch, 1),
                     num_blocks=_blocks_for(batch, prompt + max_tokens), **(where or {}))
    _fill(engine, batch, prompt, max_tokens)
    for _ in range(4 * batch):                  # all prefilled long before this
        if engine.stats().num_decoding >= batch:
            break
        engine.step()
    else:
        raise RuntimeError(f"only {engine.stats().num_decoding} of {batch} sequences decoding")
    times, sched, prep = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        stats = engine.stats()
        sched.append(stats.last_schedule_s)
        prep.append(stats.last_prepare_s)
    med, s_med, p_med = (statistics.median(x) for x in (times, sched, prep))
    return {"batch": batch, "tokens_per_s": batch / med, "step_ms": 1e3 * med,
            "schedule_ms": 1e3 * s_med, "prepare_inputs_ms": 1e3 * p_med,
            "overhead_fraction": (s_med + p_med) / med}


def prefill_rate(model: str, prompt: int, chunk: int = 512, where: dict | None = None) -> dict:
    engine = _engine(model, token_budget=chunk, chunk_size=chunk, **(where or {}))
    _fill(engine, 1, prompt, 1, traffic_class="document")
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    return {"prompt_tokens": prompt, "chunk": chunk, "seconds": dt, "tokens_per_s": prompt / dt}


def concurrent_rate(model: str, n: int = 32, prompt: int = 200, output: int = 64,
                    dtype: str = "auto", repeats: int = 3, where: dict | None = None) -> dict:
    """n requests arriving together; output tokens/s from first add to last token (median of
    `repeats` runs on one warm engine)."""
    engine = _engine(model, token_budget=2048, chunk_size=512, dtype=dtype, **(where or {}))
    engine.generate([[5]], _params(2))  # warm-up
    rng = random.Random(1)
    prompts = [random_prompt(rng, prompt, engine.model_config.vocab_size) for _ in range(n)]
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, _params(output))
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return {"requests": n, "prompt": prompt, "output": output, "dtype": dtype,
            "output_tokens_per_s": statistics.median(rates), "runs": rates}


def run_bench(args: argparse.Namespace) -> int:
    quick = args.quick
    steps = 5 if quick else 30
    device = args.device or "auto"
    check_device(device, "kvfleet bench engine")
    where = {"device": device, "cuda_graphs": args.cuda_graphs or "auto"}
    results: dict = {"model": args.model, **where}
    results["decode"] = [decode_rate(args.model, b, steps, where) for b in (1, 32, 128)]
    results["overhead_at_256"] = decode_rate(args.model, 256, 3 if quick else 10, where)
    results["prefill_512"] = prefill_rate(args.model, 1024 if quick else 4096, where=where)
    # a 32K-token document, or the longest the model takes (SmolLM2: 8K context)
    context = ModelConfig.from_dir(resolve_model_dir(args.model)).max_position_embeddings
    results["prefill_long"] = prefill_rate(args.model, min(2048 if quick else 32768, context - 8),
                                           where=where)
    results["concurrent_32x200x64"] = [concurrent_rate(args.model, 8 if quick else 32, dtype=d,
                                                       where=where)
                                       for d in ("float32", "bfloat16")]
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0


def _print(r: dict) -> None:
    for d in r["decode"]:
        print(f"decode batch {d['batch']:>3}: {d['tokens_per_s']:8.0f} tok/s  step "
              f"{d['step_ms']:.2f} ms  sched+prep {100 * d['overhead_fraction']:.1f}% of step")
    o = r["overhead_at_256"]
    print(f"256 running: step {o['step_ms']:.2f} ms, schedule {o['schedule_ms']:.2f} ms, "
          f"prepare {o['prepare_inputs_ms']:.2f} ms = {100 * o['overhead_fraction']:.1f}% of step")
    p = r["prefill_512"]
    print(f"prefill {p['prompt_tokens']} tokens in {p['chunk']}-token chunks: "
          f"{p['tokens_per_s']:.0f} tok/s")
    p = r["prefill_long"]
    print(f"prefill a {p['prompt_tokens']}-token document: {p['seconds']:.2f} s")
    for c in r["concurrent_32x200x64"]:
        print(f"{c['requests']} concurrent {c['prompt']}-in/{c['output']}-out, {c['dtype']}: "
              f"{c['output_tokens_per_s']:.0f} output tok/s (median of "
              f"{', '.join(f'{x:.0f}' for x in c['runs'])})")
    print(f"peak RSS {r['peak_rss_mib']:.0f} MiB")
