"""Waiting for an event inside a test's event loop: poll a check against a deadline."""
from __future__ import annotations

import asyncio
import inspect
import time


async def eventually(check, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """True once `check()` (a value, or an awaitable of one) is truthy; False if it is not within
    `timeout_s`. The loop keeps running meanwhile, so what is awaited can happen."""
    async def holds() -> bool:
        result = check()
        return bool(await result if inspect.isawaitable(result) else result)

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await holds():
            return True
        await asyncio.sleep(interval_s)
    return await holds()
