"""The cost of running a request's Admit in a task of its own, as FleetRun.start does so that a
Cancel call can end it (not a test; run it by hand):

    .venv/bin/python -m tests.gateway.bench_admit_task [--n 5000] [--rounds 15]

An admit stand-in waits for a future that another callback resolves (as the shared call's reader
resolves an ask's), awaited directly or in a task; the two alternate round by round on uvloop,
and the medians of the rounds' microseconds per call are printed with their difference.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from services.protocol.aio import run


async def admit_stand_in() -> int:
    loop = asyncio.get_running_loop()
    answer = loop.create_future()
    loop.call_soon(answer.set_result, 1)
    return await answer


async def direct() -> int:
    return await admit_stand_in()


async def in_a_task() -> int:
    return await asyncio.ensure_future(admit_stand_in())


async def rounds(n: int, count: int) -> dict[str, list[float]]:
    us: dict[str, list[float]] = {"direct": [], "task": []}
    for _ in range(count):
        for name, call in (("direct", direct), ("task", in_a_task)):
            start = time.perf_counter()
            for _ in range(n):
                await call()
            us[name].append((time.perf_counter() - start) / n * 1e6)
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    us = run(rounds(args.n, args.rounds))
    direct_us, task_us = statistics.median(us["direct"]), statistics.median(us["task"])
    print(f"direct {direct_us:.1f} us/call, in a task {task_us:.1f} us/call, "
          f"+{task_us - direct_us:.1f} us")


if __name__ == "__main__":
    main()
