"""One way to run a service's event loop: uvloop where installed, asyncio's own loop otherwise.

uvloop (libuv) makes each callback, socket read and write cheaper than the selector loop; a
service relays every token, so this is on the per-token path of the gateway, router and workers.
grpc.aio runs on it unchanged.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # noqa: PLC0415 - optional
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
