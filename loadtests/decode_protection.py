"""Decode protection on the real engine, in process: N chats arrive, --per-step of them before
each step (so later ones meet a model that has learned from the steps); with protection on
(an interactive ITL target of TARGET s) and off, report the decode batch, the step times streams
saw, the wait for a slot and the TTFTs.

    python -m loadtests.decode_protection [--chats 48] [--per-step 2] [--target 0.02]
                                          [--max-tokens 48]

Numbers go to docs/benchmarks.md, the section on decode protection measured in process.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def run(chats: int, per_step: int, target: float, max_tokens: int, protect: bool) -> dict:
    classes = (replace(INTERACTIVE, itl_target_s=target), DOCUMENT, BATCH)
    engine = LLMEngine(engine_config(classes=classes, protect_itl=protect, reject_late=False,
                                     num_blocks=2048))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    arrivals = iter(range(chats))
    ttft, decode_steps, peak, waiting, added = {}, [], 0, 0, 0
    while added < chats or engine.has_unfinished():
        for i in [i for _, i in zip(range(per_step), arrivals)]:
            engine.add_request([5 + i % 50] * 32, params)
            added += 1
        for out in engine.step():
            ttft.setdefault(out.request_id, time.monotonic() - t0)
        rec = engine.last_step
        if rec is not None and rec.num_decode_seqs:
            decode_steps.append(rec.duration_s)
            peak = max(peak, rec.num_decode_seqs)
        waiting = max(waiting, engine.stats().num_waiting_for_decode_slot)
    return dict(protect=protect, peak_batch=peak, max_waiting=waiting,
                step_p50_ms=1e3 * statistics.median(decode_steps),
                step_p99_ms=1e3 * pct(decode_steps, 0.99),
                ttft_p50_s=pct(list(ttft.values()), 0.5), ttft_max_s=max(ttft.values()),
                total_s=time.monotonic() - t0,
                model=engine.scheduler.step_model.coefficients)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=48)
    p.add_argument("--per-step", type=int, default=2)
    p.add_argument("--target", type=float, default=0.02)
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args()
    for protect in (False, True):
        r = run(a.chats, a.per_step, a.target, a.max_tokens, protect)
        model = r.pop("model")
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        if protect:
            print(f"  learned: {model}")


if __name__ == "__main__":
    main()
