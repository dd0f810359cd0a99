"""A prefill worker's accept: its initial gRPC metadata, sent once its engine core took the request.

A Prefill call's first token may take long (queueing behind other prompts is allowed up to
Timeouts.first_token_s), but a worker that is frozen (SIGSTOP, a hung process) or whose engine
core does not answer never accepts. The gateway waits for the accept at most
Timeouts.prefill_start_s and then fails over to the plan's fallback prefill worker, so no client
waits out a frozen worker. The accept carries no data: it is the call's headers, which gRPC sends
on their own with the first message otherwise.
"""
from __future__ import annotations

import asyncio

import grpc

ACCEPTED_KEY = "x-kvfleet-accepted"


async def send_accept(context) -> None:
    """The worker's side: the engine core took the request (None: called without a gRPC context,
    as in-process tests do)."""
    if context is not None:
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))


async def accepted_within(call: grpc.aio.Call, within_s: float) -> bool:
    """The gateway's side: whether the call's headers (the accept, or a first message, or the
    call's end) came within `within_s`; the call is left as it is either way."""
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(call.initial_metadata())),
                               within_s)
        return True
    except asyncio.TimeoutError:
        return False
