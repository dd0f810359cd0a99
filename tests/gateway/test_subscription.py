"""A request's tokens 2..N arrive on its decode worker's shared link (fleet_run.Subscription): the
chunks in order, then the end; a worker that never ends the request fails it UNAVAILABLE at the
request's own deadline (one timer per request) and ends it on the worker; a failure the worker
names is raised as it named it."""
from __future__ import annotations

import asyncio

import pytest

from services.gateway.fleet_run import Subscription
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


class QuietLink:
    """A link whose worker says nothing unless the test queues it; it records cancels."""
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


async def read_all(sub: Subscription) -> list[str]:
    return [chunk.text async for chunk in sub]


def test_the_chunks_come_in_order_then_the_end():
    async def story():
        queue: asyncio.Queue = asyncio.Queue()
        link = QuietLink()
        for text in ("a", "b"):
            queue.put_nowait(pb.TokenChunk(request_id="r1", text=text))
        queue.put_nowait(pb.DecodeEnd(request_id="r1"))
        sub = Subscription(link, "r1", queue, deadline_s=0.05)
        assert await read_all(sub) == ["a", "b"]
        assert link.cancelled == []

    asyncio.run(story())


def test_a_worker_that_never_ends_the_request_fails_it_at_its_deadline():
    async def story():
        queue: asyncio.Queue = asyncio.Queue()
        link = QuietLink()
        queue.put_nowait(pb.TokenChunk(request_id="r2", text="a"))
        sub = Subscription(link, "r2", queue, deadline_s=0.05)
        seen = []
        with pytest.raises(status.CallFailed) as failed:
            async for chunk in sub:
                seen.append(chunk.text)
        assert seen == ["a"]
        assert failed.value.status.reason == pb.UNAVAILABLE
        assert "within the request's deadline" in failed.value.status.message
        assert link.cancelled == ["r2"]

    asyncio.run(asyncio.wait_for(story(), 10))


def test_a_failure_the_worker_names_is_raised_as_named():
    async def story():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(pb.DecodeEnd(request_id="r3", failure=status.failed(
            pb.KV_TRANSFER_FAILED, "the KV never came")))
        with pytest.raises(status.CallFailed) as failed:
            await read_all(Subscription(QuietLink(), "r3", queue, deadline_s=5))
        assert failed.value.status.reason == pb.KV_TRANSFER_FAILED

    asyncio.run(story())
