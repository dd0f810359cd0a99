"""Server-sent events for OpenAI streams: `data: {json}\n\n` per event, `data: [DONE]\n\n` last.

An error after the stream has started (a worker failed mid-way) is sent as one
`data: {"error": {...}}` event, then [DONE], since the 200 status is already on the wire.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.gateway.core import Session
from services.gateway.errors import GatewayError
from services.gateway.openai_responses import Shaper

DONE = "data: [DONE]\n\n"


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def openai_events(session: Session, first: pb.TokenChunk, shaper: Shaper) -> AsyncIterator[str]:
    """The whole SSE body. Closing the session here (and in the response's background task) means
    a client that goes away, and so cancels this generator, still frees its request everywhere."""
    try:
        for event in shaper.first_events():
            yield sse(event)
        chunk: pb.TokenChunk | None = first
        try:
            while chunk is not None:
                for event in shaper.events(chunk):
                    yield sse(event)
                chunk = None if chunk.finished else await session.next()
            if shaper.plan.include_usage:
                yield sse(shaper.usage_event(session.prompt_tokens, session.output_tokens))
        except GatewayError as e:
            yield sse(e.body())
        session.close()
        yield DONE
    finally:
        session.close()
