"""What the warm-up profile costs at start, and what it buys (not a test; run it by hand):

    .venv/bin/python -m tests.worker.bench_warmup [--model tiny|smollm2] [--pairs 3]

Per pair of engine cores started one after the other (warm-up off, then on; then on, off):
  start       EngineClient.start() to Ready (the warm-up included when on), and the warm-up alone
  first       the first request's TTFT (a 200-token chat, prefill budget 2,048, chunk 512) and
              its prefill step's duration, then the same for a second, different chat
  prior       with the warm-up: the measured prior's time for a 200-token step, against the
              chats' measured prefill steps (the 3rd..10th), signed (prior - measured) / measured
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from services.engine.engine import engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import attention_pairs
from services.protocol.aio import run
from services.worker.build import measured_source
from services.worker.engine_client import EngineClient
from services.worker.rates import prior_from_steps

CHAT = 200


def prompt(i: int) -> list[int]:
    return [(i * 31 + 7 * j) % 500 + 1 for j in range(CHAT)]


async def one_core(model: str, warm: bool, chats: int) -> dict:
    steps = []
    client = EngineClient(engine_config(model, token_budget=2048, chunk_size=512, role="mixed"),
                          on_step=steps.append, warmup_timeout_s=30.0 if warm else 0.0)
    t0 = time.perf_counter()
    await client.start()
    start_s = time.perf_counter() - t0
    try:
        ttfts, prefill_steps = [], []
        for i in range(chats):
            rid = f"c-{i}"
            stream = client.stream(rid)
            t = time.perf_counter()
            await client.add_request(rid, prompt(i), SamplingParams(max_tokens=2, seed=i),
                                     None, "interactive")
            first = None
            async for _ in stream:
                first = first or time.perf_counter() - t
            ttfts.append(first)
            prefill_steps.append(next(s.duration_s for s in reversed(steps)
                                      if s.prefill_tokens == CHAT))
        result = dict(start_s=start_s, ttft=ttfts, step=prefill_steps)
        if client.warmup is not None:
            prior = prior_from_steps(client.warmup.steps, measured_source(client.warmup))  # no margin: the steps alone
            result.update(warmup_s=client.warmup.elapsed_s, prior=prior,
                          prior_chat_s=prior.step_time(CHAT, attention_pairs(0, CHAT)))
        return result
    finally:
        await client.close()


def fmt(xs) -> str:
    return " ".join(f"{x * 1e3:.0f}" for x in xs)


async def main(model: str, pairs: int, chats: int) -> None:
    print(f"model {model}, load {os.getloadavg()[0]:.2f}")
    rows = {False: [], True: []}
    for p in range(pairs):
        for warm in ((False, True) if p % 2 == 0 else (True, False)):
            r = await one_core(model, warm, chats)
            rows[warm].append(r)
            extra = ""
            if warm:
                measured = statistics.median(r["step"][2:])
                extra = (f" warm-up {r['warmup_s']:.2f} s; prior {r['prior_chat_s'] * 1e3:.1f} ms"
                         f" vs measured {measured * 1e3:.1f} ms a chat step "
                         f"({(r['prior_chat_s'] - measured) / measured:+.2f}); {r['prior']}")
            print(f"{'warm' if warm else 'cold'}: start {r['start_s']:.2f} s; TTFT ms "
                  f"{fmt(r['ttft'][:3])}; prefill step ms {fmt(r['step'][:3])} "
                  f"(later median {statistics.median(r['step'][2:]) * 1e3:.1f}){extra}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    for warm in (False, True):
        rs = rows[warm]
        print(f"{'warm' if warm else 'cold'} medians over {len(rs)}: start "
              f"{statistics.median(r['start_s'] for r in rs):.2f} s, first TTFT "
              f"{statistics.median(r['ttft'][0] for r in rs) * 1e3:.0f} ms, first step "
              f"{statistics.median(r['step'][0] for r in rs) * 1e3:.0f} ms, second TTFT "
              f"{statistics.median(r['ttft'][1] for r in rs) * 1e3:.0f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--chats", type=int, default=10)
    a = p.parse_args()
    run(main(a.model, a.pairs, a.chats))
