"""The router's reservation stream against a real decode worker process: many reservations share
one call and each gets its own answer; an invalid request is refused without ending the stream;
a worker that dies fails the reservation waiting on it (no hang), and the next one opens a new
stream to whatever answers at that address."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.aio import internal_channel
from services.common.launcher import Launcher
from services.common.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.common.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.router.reserve_stream import ReserveStream


def reserve_request(rid: str, n_prompt: int = 40, max_tokens: int = 8) -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)),
                             params=pb.SamplingParams(max_tokens=max_tokens, temperature=0))


@pytest.fixture
def decode_worker(tiny_model_dir):
    launcher = Launcher()
    try:
        address = launcher.start("decode-0", [
            "services.common.cli", "serve", "decode", "--model", str(tiny_model_dir),
            "--worker-id", "decode-0", "--kv-cache-mib", "16"])
        yield launcher, address
    finally:
        launcher.stop_all()


def run(address: str, scenario):
    async def main():
        channel = internal_channel(address)
        stub = pb_grpc.WorkerStub(channel)
        stream = ReserveStream(stub, address)
        try:
            return await scenario(stream, stub)
        finally:
            await stream.close()
            await channel.close()
    return asyncio.run(main())


def test_concurrent_reservations_share_one_stream_and_get_their_own_answers(decode_worker):
    _, address = decode_worker

    async def scenario(stream: ReserveStream, stub):
        answers = await asyncio.gather(*(stream.reserve(reserve_request(f"r{i}", 16 + i))
                                         for i in range(12)))
        first_call = stream._call
        again = await stream.reserve(reserve_request("r-last"))
        assert stream._call is first_call                       # still the same call
        stats = await stub.Stats(pb.StatsRequest())
        for i in range(12):
            await stub.Cancel(pb.CancelRequest(request_id=f"r{i}"))
        await stub.Cancel(pb.CancelRequest(request_id="r-last"))
        return answers, again, stats

    answers, again, stats = run(address, scenario)
    assert [a.request_id for a in answers] == [f"r{i}" for i in range(12)]
    assert all(a.accepted for a in answers) and again.accepted
    # each answer names the blocks its own prompt (16 + i tokens) lands in, none shared
    assert [len(a.target.block_ids) for a in answers] == [
        -(-(16 + i) // stats.block_size) for i in range(12)]
    all_blocks = [b for a in answers for b in a.target.block_ids]
    assert len(set(all_blocks)) == len(all_blocks)


def test_an_invalid_request_is_refused_and_the_stream_goes_on(decode_worker):
    _, address = decode_worker

    async def scenario(stream: ReserveStream, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.reserve(reserve_request("bad", n_prompt=0))
        ok = await stream.reserve(reserve_request("good"))
        await stub.Cancel(pb.CancelRequest(request_id="good"))
        return refused.value, ok

    refused, ok = run(address, scenario)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in refused.details()
    assert ok.accepted


def test_a_dead_worker_fails_the_waiting_reservation_instead_of_hanging(decode_worker):
    launcher, address = decode_worker

    async def scenario(stream: ReserveStream, stub):
        assert (await stream.reserve(reserve_request("before"))).accepted
        launcher.kill("decode-0")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(stream.reserve(reserve_request("after")), 10)
        return failed.value

    failed = run(address, scenario)
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
