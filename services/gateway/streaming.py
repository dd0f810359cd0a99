"""Server-sent events for OpenAI streams: `data: {json}\n\n` per event, `data: [DONE]\n\n` last.

An error after the stream has started (a worker failed mid-way) is sent as one
`data: {"error": {...}}` event, then [DONE], since the 200 status is already on the wire.

The event of the last chunk (the one with finish_reason), and the usage event after it, carry the
request's `timing` object (services/gateway/telemetry.py).

A chunk counts as sent (Session.sent: charged to the tenant) once its events were handed to the
server while the client was still connected: the generator resumes only after the server's send
returned, and `gone()` reads the server's disconnect flag without waiting (`DisconnectSeen`), so a
chunk the server dropped because the client had left is not charged.

Writes: one per chunk (its events joined; chat's opening role event goes with the first), and the
usage event with `[DONE]`: each write is one server send and one socket write.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.types import Receive

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.gateway.core import Session
from services.gateway.errors import GatewayError
from services.gateway.openai_responses import Shaper
from services.gateway.stage_view import admission_fields

DONE = "data: [DONE]\n\n"


_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(event: dict) -> str:
    return f"data: {_ENCODE(event)}\n\n"


class DisconnectSeen:
    """Whether the server has seen the client go, read without waiting: one step of the ASGI
    `receive` coroutine, which answers http.disconnect at once when the server saw it and would
    otherwise wait (the step is then dropped, as nothing else can come after the body). It is
    what Starlette's `Request.is_disconnected` reads, without the anyio cancel scope that call
    opens (and cancels, formatting the task's repr) each time: once per chunk here."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False

    def __call__(self) -> bool:
        if not self.gone:
            step = self._receive()
            try:
                step.send(None)
            except StopIteration as done:
                self.gone = (done.value or {}).get("type") == "http.disconnect"
            finally:
                step.close()
        return self.gone


async def openai_events(session: Session, first: pb.TokenChunk, shaper: Shaper,
                        gone: Callable[[], bool]) -> AsyncIterator[str]:
    """The whole SSE body. Closing the session here (and in the response's background task) means
    a client that goes away, and so cancels this generator, still frees its request everywhere."""
    try:
        opening = "".join(map(sse, shaper.first_events()))
        chunk: pb.TokenChunk | None = first
        timing = None
        last = ""
        try:
            while chunk is not None:
                events = shaper.events(chunk)
                if chunk.finished and events:
                    timing = events[-1]["timing"] = session.telemetry.timing()
                    events[-1].update(admission_fields(session.run.plan))
                text = opening + "".join(map(sse, events))
                opening = ""
                if text:
                    yield text
                if not gone():
                    session.sent(chunk)
                chunk = None if chunk.finished else await session.next()
            if shaper.shape.include_usage:
                usage = shaper.usage_event(session.prompt_tokens, session.sent_tokens)
                last = sse({**usage, "timing": timing or session.telemetry.timing()})
        except GatewayError as e:
            last = sse(e.body())
        session.close()
        yield opening + last + DONE       # the role event too, when no chunk carried text
    finally:
        session.close()
