"""Server-sent events for OpenAI streams: `data: {json}\n\n` per event, `data: [DONE]\n\n` last.

An error after the stream has started (a worker failed mid-way) is sent as one
`data: {"error": {...}}` event, then [DONE], since the 200 status is already on the wire.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.responses import Response

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


class SSEResponse(Response):
    """An ASGI response for an SSE body: Starlette's StreamingResponse, minus its task group (a
    Response, so FastAPI returns it as it is and middleware sees it).

    The body is sent from the request's own task (no second task to start before the first
    event). A watcher task reads the ASGI receive channel: a client that disconnects cancels the
    sending task, so the generator's `finally` runs and `close` releases the request everywhere.
    `close` also runs after a normal end. Either way the response ends quietly.
    """

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str], close) -> None:
        # no Response.__init__: there is no body to render
        self.status_code = 200
        self.background = None
        self.events = events
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        gone = asyncio.Event()
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, task, gone))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise                        # cancelled from outside (shutdown): not ours to hide
            task.uncancel()
        except OSError:
            pass                             # the client went away mid-write
        finally:
            watch.cancel()
            self.close()


async def _cancel_on_disconnect(receive, task: asyncio.Task, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()
    task.cancel()
