"""How every service process learns it should stop: SIGTERM or SIGINT (Ctrl-C)."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import NoReturn


async def wait_for_stop_signal(stop: asyncio.Event | None = None) -> None:
    """Return once SIGTERM or SIGINT arrives (installed on the running event loop), or once
    `stop` is set by the process itself (a fatal failure)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def exit_now(code: int) -> NoReturn:
    """End this service process with `code` at once, once everything it started is stopped and
    closed (its servers, its engine core reaped, its ports): the interpreter's own teardown (the
    GC of torch's and grpc's modules) takes seconds on a loaded box, past the stop budget
    (docs/benchmarks.md, the time to stop). Buffered spans are exported first: os._exit skips
    atexit."""
    from services.telemetry import tracing  # noqa: PLC0415
    tracing.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
