"""Latency of the server <-> engine core boundary (not a test; run it by hand):

    .venv/bin/python -m tests.worker.bench_engine_core [--n 500]

  command round trip   await client.stats() on an idle core: encode, IPC, the core's poll wake-up,
                       engine.stats(), reply, decode, future resolved (median / p90 over n)
  step output latency  a step's StepOutputs from the core's send to the client's dispatch, while
                       one greedy request decodes (median / p90 over n steps)
"""
from __future__ import annotations

import argparse
import statistics
import time

from services.engine.engine import engine_config
from services.protocol.aio import run
from services.engine.sampling_params import SamplingParams
from services.worker.engine_client import EngineClient
from services.worker.engine_core import StepOutputs


def summary(name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"{name}: median {statistics.median(xs) * 1e6:.0f} us, "
            f"p90 {xs[int(0.9 * len(xs))] * 1e6:.0f} us (n={len(xs)})")


async def main(n: int, threads: int) -> None:
    client = EngineClient(engine_config("tiny", kv_cache_mib=64), torch_threads=threads)
    await client.start()
    try:
        for _ in range(20):
            await client.stats()                       # warm up
        rtts = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.stats()
            rtts.append(time.perf_counter() - t0)
        print(summary("command round trip (stats)", rtts))

        lags: list[float] = []
        dispatch = client._dispatch

        def timed(msg):
            if isinstance(msg, StepOutputs):
                lags.append(time.monotonic() - msg.sent_at_s)
            dispatch(msg)
        client._dispatch = timed
        stream = client.stream("bench")
        await client.add_request("bench", [1, 2, 3, 4], SamplingParams(
            max_tokens=n + 1, temperature=0, ignore_eos=True), None, None)
        async for _ in stream:
            pass
        stats = await client.stats()
        print(summary("step output latency", lags))
        print(f"(the tiny model's step itself: {stats.last_step_s * 1e3:.2f} ms)")
    finally:
        await client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--threads", type=int, default=1, help="the core's torch threads")
    args = p.parse_args()
    run(main(args.n, args.threads))       # uvloop where installed, as the worker runs
