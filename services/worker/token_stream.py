"""One gateway's token streams on one worker, over one long-lived DecodeStream call (a decode
worker's tokens 2..N; a mixed worker's whole co-located requests).

The gateway subscribes each request on the call (or cancels it); `serve_token_stream` pumps each
subscribed request's chunks, by a task of its own, into a shared outbox, and whatever is in the
outbox when the sender wakes goes as one `DecodeBatch` (a step's tokens for all of them), then
each request's end with its status. The call ending (the gateway gone) ends every request it
carried. The worker stopping (`stop`, registered in `calls` while the call runs) ends the call
from this side: each request it carries ends SHUTTING_DOWN, then the call returns, so the
server's stop finds no call left to cancel.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

# a subscription -> its chunks (failures raise status.CallFailed; cancelling the task ends it)
Pump = Callable[[pb.DecodeSubscribe], AsyncIterator[pb.TokenChunk]]


async def serve_token_stream(subscriptions, pump_of: Pump, end: Callable[[str], object],
                             calls: set[Callable[[], None]], worker_id: str
                             ) -> AsyncIterator[pb.DecodeBatch]:
    """Serve one DecodeStream call. `end(request_id)`: a cancel for a request not pumped (yet)
    ends it here all the same."""
    outbox = _Outbox()
    pumps: dict[str, asyncio.Task] = {}

    def stop() -> None:
        for rid in pumps:
            outbox.put_end(pb.DecodeEnd(request_id=rid, failure=status.failed(
                pb.SHUTTING_DOWN, f"worker {worker_id} is stopping")))
        outbox.stop()

    async def pump(sub: pb.DecodeSubscribe) -> None:
        rid = sub.request_id
        try:
            async for chunk in pump_of(sub):
                outbox.put_chunk(chunk)
            outbox.put_end(pb.DecodeEnd(request_id=rid))
        except status.CallFailed as e:
            outbox.put_end(pb.DecodeEnd(request_id=rid, failure=e.status))
        finally:
            pumps.pop(rid, None)

    async def read() -> None:
        async for sub in subscriptions:
            if sub.cancel:
                task = pumps.pop(sub.request_id, None)
                if task is not None:
                    task.cancel()
                else:
                    end(sub.request_id)
            elif sub.request_id not in pumps:
                pumps[sub.request_id] = asyncio.get_running_loop().create_task(pump(sub))
        outbox.close()                  # the gateway half-closed: no more subscriptions

    reader = asyncio.get_running_loop().create_task(read())
    calls.add(stop)
    try:
        while True:
            batch = await outbox.take(lambda: reader.done() and not pumps)
            if batch is None:
                return
            yield batch
    finally:
        calls.discard(stop)
        reader.cancel()
        for task in list(pumps.values()):
            task.cancel()


class _Outbox:
    """What a DecodeStream call has to send: chunks and ends in arrival order, taken as one
    batch."""

    def __init__(self) -> None:
        self._batch = pb.DecodeBatch()
        self._ready = asyncio.Event()
        self._closed = False
        self._stopped = False

    def put_chunk(self, chunk: pb.TokenChunk) -> None:
        self._batch.chunks.append(chunk)
        self._ready.set()

    def put_end(self, end: pb.DecodeEnd) -> None:
        self._batch.ends.append(end)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def stop(self) -> None:
        """The worker is stopping: what is in the outbox goes, then `take` returns None."""
        self._stopped = True
        self._ready.set()

    async def take(self, finished) -> pb.DecodeBatch | None:
        """The next batch; None once `finished()` holds and nothing is left to send."""
        while not (self._batch.chunks or self._batch.ends):
            if self._stopped or (self._closed and finished()):
                return None
            self._ready.clear()
            await self._ready.wait()
        batch, self._batch = self._batch, pb.DecodeBatch()
        return batch
