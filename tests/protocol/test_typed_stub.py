"""A typed stub turns every failed call into the project's CallFailed, once: a service's typed
refusal keeps its CallStatus, a peer that is not there reads as UNAVAILABLE with its bare gRPC
code, and a streamed call that fails after its first message raises the same type."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.typed_stub import TypedStub
from services.state.redis_server import free_port

REFUSAL = status.failed(pb.OVERLOADED, "all busy", retry_after_s=3)


class RefusingWorker(pb_grpc.WorkerServicer):
    async def Health(self, request, context):
        await status.abort(context, REFUSAL)

    async def Prefill(self, request, context):
        yield pb.PrefillReply(chunk=pb.TokenChunk(request_id=request.request_id, token_ids=[7]))
        await status.abort(context, status.failed(pb.KV_TRANSFER_FAILED, "the KV never landed"))


async def with_worker(story):
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(RefusingWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await story(TypedStub(pb_grpc.WorkerStub(channel)))
    finally:
        await server.stop(None)


def test_a_typed_refusal_arrives_as_call_failed_with_its_status():
    async def story(stub):
        with pytest.raises(status.CallFailed) as refused:
            await stub.Health(pb.HealthRequest(), timeout=5)
        assert refused.value.status == REFUSAL
        assert refused.value.untyped_code is None         # the service answered: not unreachable
    asyncio.run(with_worker(story))


def test_a_stream_that_fails_after_its_first_message_raises_call_failed():
    async def story(stub):
        call = stub.Prefill(pb.PrefillRequest(request_id="r1"), timeout=5)
        replies = []
        with pytest.raises(status.CallFailed) as failed:
            async for reply in call:
                replies.append(reply)
        assert [r.chunk.token_ids for r in replies] == [[7]]
        assert failed.value.status.reason == pb.KV_TRANSFER_FAILED
    asyncio.run(with_worker(story))


def test_a_peer_that_is_not_there_is_unavailable_with_its_bare_code():
    async def story():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
            with pytest.raises(status.CallFailed) as failed:
                await TypedStub(pb_grpc.WorkerStub(channel)).Health(pb.HealthRequest(), timeout=5)
        assert failed.value.status.reason == pb.UNAVAILABLE
        assert failed.value.untyped_code == grpc.StatusCode.UNAVAILABLE
    asyncio.run(story())
