"""The SSE stream asks, after each write, whether the server has seen its client go
(streaming.DisconnectSeen): it answers at once either way, never waits for the client, and once it
has seen the disconnect it keeps saying so without asking the server again. The server here is a
stand-in with uvicorn's receive: it waits for its next message unless the client is gone."""
from __future__ import annotations

import asyncio

from services.gateway.streaming import DisconnectSeen


class Server:
    """uvicorn's RequestResponseCycle.receive, after the body: wait, or say disconnect."""

    def __init__(self) -> None:
        self.disconnected = False
        self.message = asyncio.Event()
        self.asked = 0

    async def receive(self) -> dict:
        self.asked += 1
        if not self.disconnected:
            await self.message.wait()
            self.message.clear()
        if self.disconnected:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    def client_goes(self) -> None:
        self.disconnected = True
        self.message.set()


def test_a_connected_client_is_not_gone_and_asking_does_not_wait():
    async def story():
        server = Server()
        gone = DisconnectSeen(server.receive)
        assert gone() is False
        assert gone() is False
        assert server.asked == 2
        server.client_goes()                      # a waiter left behind would be woken here
        assert gone() is True

    asyncio.run(asyncio.wait_for(story(), 10))


def test_once_seen_gone_it_stays_gone_without_asking_again():
    async def story():
        server = Server()
        gone = DisconnectSeen(server.receive)
        server.client_goes()
        assert gone() is True
        assert gone() is True
        assert server.asked == 1

    asyncio.run(asyncio.wait_for(story(), 10))
