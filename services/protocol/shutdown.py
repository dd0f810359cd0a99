"""How every service process learns it should stop: SIGTERM or SIGINT (Ctrl-C)."""
from __future__ import annotations

import asyncio
import signal


async def wait_for_stop_signal(stop: asyncio.Event | None = None) -> None:
    """Return once SIGTERM or SIGINT arrives (installed on the running event loop), or once
    `stop` is set by the process itself (a fatal failure)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
