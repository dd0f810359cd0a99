"""Server-sent events for OpenAI streams: `data: {json}\n\n` per event, `data: [DONE]\n\n` last.

An error after the stream has started (a worker failed mid-way) is sent as one
`data: {"error": {...}}` event, then [DONE], since the 200 status is already on the wire.

The event of the last chunk (the one with finish_reason), and the usage event after it, carry the
request's `timing` object (services/gateway/telemetry.py).

A chunk counts as sent (Session.sent: charged to the tenant) once its events were handed to the
server while the client was still connected: the generator resumes only after the server's send
returned, and `gone()` reads the server's disconnect flag without waiting, so a chunk the server
dropped because the client had left is not charged.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.gateway.core import Session
from services.gateway.errors import GatewayError
from services.gateway.openai_responses import Shaper
from services.gateway.stage_view import admission_fields

DONE = "data: [DONE]\n\n"


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def openai_events(session: Session, first: pb.TokenChunk, shaper: Shaper,
                        gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """The whole SSE body. Closing the session here (and in the response's background task) means
    a client that goes away, and so cancels this generator, still frees its request everywhere."""
    try:
        for event in shaper.first_events():
            yield sse(event)
        chunk: pb.TokenChunk | None = first
        timing = None
        try:
            while chunk is not None:
                events = shaper.events(chunk)
                if chunk.finished and events:
                    timing = events[-1]["timing"] = session.telemetry.timing()
                    events[-1].update(admission_fields(session.run.plan))
                for event in events:
                    yield sse(event)
                if not await gone():
                    session.sent(chunk)
                chunk = None if chunk.finished else await session.next()
            if shaper.shape.include_usage:
                usage = shaper.usage_event(session.prompt_tokens, session.sent_tokens)
                yield sse({**usage, "timing": timing or session.telemetry.timing()})
        except GatewayError as e:
            yield sse(e.body())
        session.close()
        yield DONE
    finally:
        session.close()
