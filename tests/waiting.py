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


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """True once `predicate()` holds, polled every `interval_s`; False if it does not within
    `timeout_s` (checked once more at the deadline). For blocking tests; `eventually` in a loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def ready_line(proc, timeout_s: float) -> str:
    """A started service's `READY ...` line from its stdout pipe (announcement lines such as
    METRICS / KV may come first), or "" if it ended or said nothing within `timeout_s`. Reads the
    pipe unbuffered: a buffered readline could hold READY while select() waits on an empty pipe."""
    import os  # noqa: PLC0415
    import select  # noqa: PLC0415
    deadline, out = time.monotonic() + timeout_s, b""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        data = os.read(proc.stdout.fileno(), 4096) if ready else b""
        if not data:
            return ""
        out += data
        for line in out.decode(errors="replace").split("\n")[:-1]:      # whole lines only
            if line.startswith("READY "):
                return line + "\n"
    return ""
