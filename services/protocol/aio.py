"""How the services run asyncio and gRPC: uvloop where installed, and one kind of internal channel.

uvloop (libuv) makes each callback, socket read and write cheaper than the selector loop; the
gateway and the workers are on the per-token path.
grpc.aio runs on it unchanged.
"""
from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from services.protocol import fleet_token

T = TypeVar("T")
log = logging.getLogger(__name__)
SETTLE_S = 3.0          # how long a service's leftover tasks get to end once cancelled at exit


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # noqa: PLC0415 - optional
    except ImportError:
        return asyncio.run(_settled(main))
    return uvloop.run(_settled(main))


async def _settled(main: Coroutine[Any, Any, T]) -> T:
    """`main`, then the tasks it left running cancelled while the loop still runs as it did,
    each given SETTLE_S to end; one that does not is logged with its stack. (Left to asyncio.run's
    own cancel-all, after `main` has returned, a worker whose engine core failed sometimes never
    reached its exit status: the supervisor killed it unresponsive after 30 s.)"""
    try:
        return await main
    finally:
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for task in left:
            task.cancel()
        if left:
            _, stuck = await asyncio.wait(left, timeout=SETTLE_S)
            for task in stuck:
                stack = io.StringIO()
                task.print_stack(file=stack)
                log.error("task %s did not end %.0f s after it was cancelled at shutdown:\n%s",
                          task.get_name(), SETTLE_S, stack.getvalue())


def setup_logging(name: str) -> None:
    """A service's log lines on stderr, INFO and up, named by the service."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


# The hosts a kvfleet service (router, worker, KV receiver) may bind or connect to in this build.
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# Channels between the fleet's own services. grpc's transparent retries are off: the gateway
# decides itself what is retried (a prefill, once, before any token; another router), and the
# retry machinery buffers every call's messages for nothing.
INTERNAL_CHANNEL_OPTIONS = (("grpc.enable_retries", 0),)


def internal_channel(address: str, auth: fleet_token.FleetAuth | None = None) -> grpc.aio.Channel:
    """A channel to another kvfleet service on loopback; every call on it carries the fleet token
    (`auth`, else this process's: fleet_token.active())."""
    auth = auth if auth is not None else fleet_token.active()
    return grpc.aio.insecure_channel(address, options=INTERNAL_CHANNEL_OPTIONS,
                                     interceptors=fleet_token.client_interceptors(auth))
