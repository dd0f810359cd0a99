"""Where a gRPC call's failure becomes the project's exception, once: a stub whose calls raise
`status.CallFailed` (carrying the call's CallStatus) instead of grpc's `AioRpcError`.

    stub = TypedStub(pb_grpc.WorkerStub(channel))
    try:
        async for reply in stub.Prefill(request, timeout=...): ...
    except status.CallFailed as e:
        e.status.reason               # always a CallStatus (status.of reads an untyped failure)

Code that fails a request locally raises the same `CallFailed`, so a caller catches one type for
a remote refusal, a dead peer and a deadline the caller itself keeps.
"""
from __future__ import annotations

from typing import Any

import grpc

from services.protocol import status


def call_failed(error: grpc.aio.AioRpcError) -> status.CallFailed:
    """The CallFailed a failed gRPC call means: its CallStatus, and its bare gRPC code when it
    carried none (a transport error, a deadline, a peer that died mid-call)."""
    carried = any(key == status.STATUS_KEY for key, _ in (error.trailing_metadata() or ()))
    return status.CallFailed(status.of(error), untyped_code=None if carried else error.code())


class TypedStub:
    """A generated stub (pb_grpc.*Stub) whose every method returns a TypedCall."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(*args, **kwargs) -> TypedCall:
            return TypedCall(method(*args, **kwargs))
        return call


class TypedCall:
    """One call: awaited (unary response) or iterated (streamed response), it raises CallFailed
    where grpc raises AioRpcError. `cancel()` and `initial_metadata()` are the call's own."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self._call = call
        self._messages = None

    def __await__(self):
        try:
            return (yield from self._call.__await__())
        except grpc.aio.AioRpcError as e:
            raise call_failed(e) from None

    def __aiter__(self):
        if self._messages is None:     # one iterator, like grpc's: a loop left early resumes
            self._messages = self._iterate()
        return self._messages

    async def _iterate(self):
        try:
            async for message in self._call:
                yield message
        except grpc.aio.AioRpcError as e:
            raise call_failed(e) from None

    def cancel(self) -> bool:
        return self._call.cancel()

    async def initial_metadata(self):
        return await self._call.initial_metadata()
