"""Many calls over one connection (services/protocol/mux.py), on real sockets over loopback, over
both transports: a plain TCP mux connection (what the fleet uses) and the Mux gRPC RPC.

Most stories use a small in-process Router service whose `generate` handler (written here, named
`story_generate`) echoes the prompt's tokens as chunks and follows instructions hidden in the
request: abort, raise, or wait until cancelled. Its servers ask for a fleet token (`AUTH`), as the
real services do, and the handshake stories show what a TCP caller without it gets. The last
stories reserve KV on a real decode worker process over its mux, as the router does.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.protocol import fleet_token, mux
from services.protocol.aio import internal_channel
from services.protocol.fleet_token import FleetAuth
from services.cli.launcher import Launcher
from services.protocol.mux import MuxChannel, MuxListener, MuxServer, connect_to
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc


AUTH = FleetAuth(fleet_token.generate())       # the story fleet's token
WRONG = FleetAuth(fleet_token.generate())


class StoryRouter(pb_grpc.RouterServicer):
    """A Router whose Mux runs `story_generate`; it records which calls ran their `finally`."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.started: dict[str, asyncio.Event] = {}
        self.release = asyncio.Event()
        self.mux = MuxServer({"generate": self.story_generate})
        self.mux_address = ""

    async def Mux(self, frames, context):
        async for replies in self.mux.serve(frames, context):
            yield replies

    async def Health(self, request, context):
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, mux_address=self.mux_address)

    async def story_generate(self, request: pb.RouteRequest, context):
        rid = request.request_id
        self.started.setdefault(rid, asyncio.Event()).set()
        try:
            if request.tenant == "abort":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid} is invalid")
            if request.tenant == "raise":
                raise RuntimeError(f"{rid} broke the handler")
            if request.tenant == "together":
                await self.release.wait()
            for token in request.prompt_token_ids:
                yield pb.TokenChunk(request_id=rid, token_ids=[token])
            if request.tenant == "hang":
                await asyncio.Event().wait()
        finally:
            self.finished.append(rid)


def route(rid: str, tokens=(1, 2, 3), tenant: str = "") -> pb.RouteRequest:
    return pb.RouteRequest(request_id=rid, tenant=tenant, prompt_token_ids=list(tokens))


class CountingCall:
    """A mux stream (TCP or the Mux RPC), counting the messages that come back."""

    def __init__(self, call) -> None:
        self.call = call
        self.messages = 0

    async def write(self, message):
        await self.call.write(message)

    def cancel(self):
        return self.call.cancel()

    async def __aiter__(self):
        async for message in self.call:
            self.messages += 1
            yield message


class StoryServer:
    """The story Router on gRPC, and (transport "tcp") its MuxListener, as the real services run."""

    def __init__(self, servicer: StoryRouter, transport: str) -> None:
        self.servicer = servicer
        self.transport = transport

    async def start(self, port: int = 0, mux_port: int = 0) -> str:
        self.grpc = grpc.aio.server(interceptors=fleet_token.server_interceptors(AUTH))
        pb_grpc.add_RouterServicer_to_server(self.servicer, self.grpc)
        self.port = self.grpc.add_insecure_port(f"127.0.0.1:{port}")
        await self.grpc.start()
        self.listener = MuxListener(self.servicer.mux, AUTH)
        if self.transport == "tcp":
            self.servicer.mux_address = await self.listener.start("127.0.0.1", mux_port)
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.listener.close()
        await self.grpc.stop(0)


class Streams(list):
    """The mux streams a story's channel connected, and how many times it tried."""
    attempts = 0


TRANSPORTS = pytest.mark.parametrize("transport", ["tcp", "grpc"])


def story(scenario, transport: str, channel_auth: FleetAuth = AUTH, mux_auth: FleetAuth = AUTH):
    """Run scenario(servicer, mux_channel, server, counting_streams) against a fresh server, as a
    caller whose gRPC calls present `channel_auth` and whose mux handshake presents `mux_auth`."""
    async def main():
        servicer = StoryRouter()
        server = StoryServer(servicer, transport)
        address = await server.start()
        channel = internal_channel(address, channel_auth)
        connect = connect_to(pb_grpc.RouterStub(channel), address, mux_auth)
        calls = Streams()

        async def counting_connect():
            calls.attempts += 1
            calls.append(CountingCall(await connect()))
            return calls[-1]
        muxed = MuxChannel(counting_connect, address)
        try:
            return await scenario(servicer, muxed, server, calls)
        finally:
            await muxed.close()
            await channel.close()
            await server.stop()
    return asyncio.run(main())


async def finished(servicer: StoryRouter, n: int, within_s: float = 2.0) -> list[str]:
    """The calls whose handler ran its `finally`, once n have (or within_s has passed)."""
    for _ in range(int(within_s / 0.01)):
        if len(servicer.finished) >= n:
            break
        await asyncio.sleep(0.01)
    return servicer.finished


async def hanging_calls(muxed: MuxChannel, n: int) -> list:
    """n calls h0..h{n-1}, each past its first chunk and then waiting until cancelled."""
    calls = [muxed.call("generate", route(f"h{i}", [i], tenant="hang")) for i in range(n)]
    for c in calls:
        await c.read()
    return calls


async def collect(call) -> list[int]:
    return [t for chunk in [c async for c in call] for t in chunk.token_ids]


@TRANSPORTS
def test_many_calls_share_one_mux_call_and_each_gets_its_own_messages(transport):
    async def scenario(servicer, muxed, server, calls):
        results = await asyncio.gather(*(
            collect(muxed.call("generate", route(f"r{i}", range(i, i + 5)))) for i in range(20)))
        assert results == [list(range(i, i + 5)) for i in range(20)]
        assert len(calls) == 1                         # one gRPC call carried all twenty
        assert sorted(servicer.finished) == sorted(f"r{i}" for i in range(20))
    story(scenario, transport)


@TRANSPORTS
def test_messages_ready_together_travel_as_one_grpc_message(transport):
    async def scenario(servicer, muxed, server, calls):
        muxed_calls = [muxed.call("generate", route(f"r{i}", [i], tenant="together"))
                       for i in range(32)]
        for i in range(32):                            # all 32 handlers wait at the same point
            await servicer.started.setdefault(f"r{i}", asyncio.Event()).wait()
        before = calls[0].messages
        servicer.release.set()                         # ... and all produce their chunk at once
        assert [await c.read() for c in muxed_calls] == [
            pb.TokenChunk(request_id=f"r{i}", token_ids=[i]) for i in range(32)]
        assert calls[0].messages - before < 8          # not one message per call
    story(scenario, transport)


@TRANSPORTS
def test_an_abort_ends_only_its_own_call_with_its_status(transport):
    async def scenario(servicer, muxed, server, calls):
        bad = muxed.call("generate", route("bad", tenant="abort"))
        good = muxed.call("generate", route("good"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await bad.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "bad is invalid"
        with pytest.raises(grpc.aio.AioRpcError):      # and every later read says the same
            await bad.read()
        assert await collect(good) == [1, 2, 3]
        assert await collect(muxed.call("generate", route("after"))) == [1, 2, 3]
        assert len(calls) == 1
    story(scenario, transport)


@TRANSPORTS
def test_a_handler_that_raises_fails_its_call_as_unknown_and_the_mux_lives(transport):
    async def scenario(servicer, muxed, server, calls):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(muxed.call("generate", route("boom", tenant="raise")))
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        assert "boom broke the handler" in e.value.details()
        assert await collect(muxed.call("generate", route("after"))) == [1, 2, 3]
    story(scenario, transport)


@TRANSPORTS
def test_a_method_the_callee_lacks_is_unimplemented(transport):
    async def scenario(servicer, muxed, server, calls):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await muxed.unary("reserve", pb.ReserveRequest(request_id="r"))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    story(scenario, transport)


@TRANSPORTS
def test_cancel_stops_the_handler_and_runs_its_finally(transport):
    async def scenario(servicer, muxed, server, calls):
        call = muxed.call("generate", route("slow", [7], tenant="hang"))
        assert (await call.read()).token_ids == [7]
        assert call.cancel() and not call.cancel()     # idempotent
        with pytest.raises(asyncio.CancelledError):
            await call.read()                          # as a cancelled grpc.aio call
        assert await finished(servicer, 1) == ["slow"]
    story(scenario, transport)


@TRANSPORTS
def test_leaving_an_async_for_early_cancels_the_call(transport):
    async def scenario(servicer, muxed, server, calls):
        async def first_token():
            async for chunk in muxed.call("generate", route("early", [5], tenant="hang")):
                return chunk.token_ids[0]
        assert await first_token() == 5
        assert await finished(servicer, 1) == ["early"]
    story(scenario, transport)


@TRANSPORTS
def test_a_caller_that_goes_away_cancels_every_call_it_had_open(transport):
    async def scenario(servicer, muxed, server, calls):
        await hanging_calls(muxed, 5)
        await muxed.close()
        assert sorted(await finished(servicer, 5)) == [f"h{i}" for i in range(5)]
    story(scenario, transport)


@TRANSPORTS
def test_a_dead_callee_fails_every_open_call_and_the_next_call_opens_a_new_mux(transport):
    async def scenario(servicer, muxed, server, calls):
        waiting = await hanging_calls(muxed, 3)
        await server.stop()                            # the callee goes away mid-stream
        for c in waiting:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(c.read(), 5)    # an error, never a hang
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing answers: the call fails fast
            await asyncio.wait_for(collect(muxed.call("generate", route("x"))), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert calls.attempts == 2                     # the broken mux was not reused
    story(scenario, transport)


@TRANSPORTS
def test_after_a_callee_restarts_on_its_address_calls_work_again(transport):
    async def main():
        server = StoryServer(StoryRouter(), transport)
        address = await server.start()
        channel = internal_channel(address, AUTH)
        muxed = MuxChannel(connect_to(pb_grpc.RouterStub(channel), address, AUTH), address)
        try:
            assert await collect(muxed.call("generate", route("a"))) == [1, 2, 3]
            await server.stop()
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(collect(muxed.call("generate", route("b"))), 5)
            server = StoryServer(StoryRouter(), transport)   # on the same port, a new mux port
            await server.start(int(address.rsplit(":", 1)[1]))
            for _ in range(100):                       # the channel reconnects with backoff
                try:
                    assert await collect(muxed.call("generate", route("c"))) == [1, 2, 3]
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("no call succeeded after the callee came back")
        finally:
            await muxed.close()
            await channel.close()
            await server.stop()
    asyncio.run(main())


def test_frames_ready_together_are_cut_into_messages_below_the_size_cap(monkeypatch):
    monkeypatch.setattr(mux, "MAX_BATCH_BYTES", 1000)
    queue: asyncio.Queue = asyncio.Queue()
    frames = [pb.ReplyFrame(call_id=i, chunk=pb.TokenChunk(text="x" * 400)) for i in range(5)]
    for f in frames[1:]:
        queue.put_nowait(f)
    batch, ended = mux._drain(queue, frames[0])
    assert batch == frames[:3] and not ended           # 3 x ~410 bytes reaches the cap
    queue.put_nowait(None)
    batch, ended = mux._drain(queue, queue.get_nowait())
    assert batch == frames[3:] and ended


def handshake(token: bytes) -> bytes:
    body = mux.HANDSHAKE_MAGIC + token
    return len(body).to_bytes(4, "big") + body


def call_frames(*frames: pb.CallFrame) -> bytes:
    return mux._encode(pb.CallFrames(frames=list(frames)))


async def answer_and_end(reader: asyncio.StreamReader) -> tuple[pb.CallStatus | None, bytes]:
    """The handshake's answer (None if there was none), and what came after it until the end."""
    status = await asyncio.wait_for(mux._read_message(reader, pb.CallStatus), 5)
    try:
        rest = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        rest = b""
    return status, rest


def test_garbage_on_the_mux_port_drops_that_connection_only():
    async def scenario(servicer, muxed, server, calls):
        assert await collect(muxed.call("generate", route("before"))) == [1, 2, 3]
        host, port = servicer.mux_address.rsplit(":", 1)
        for garbage in (b"\x00\x00\x00\x05hello",               # not a CallFrames
                        (1 << 30).to_bytes(4, "big"),            # a 1 GiB message announced
                        b"\x00\x00"):                            # cut off mid-header
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(handshake(AUTH.presented()) + garbage)
            if garbage == b"\x00\x00":
                writer.write_eof()
            status, rest = await answer_and_end(reader)
            assert status.code == grpc.StatusCode.OK.value[0]
            assert rest == b""                                   # dropped, nothing answered
            writer.close()
        assert await collect(muxed.call("generate", route("after"))) == [1, 2, 3]
        assert len(calls) == 1                         # the good connection never noticed
    story(scenario, "tcp")


def test_a_tcp_mux_connection_serves_nothing_until_it_presents_the_fleet_token(monkeypatch):
    """Its first message must be the handshake with the token: a caller that starts with a call,
    presents a wrong or no token, is answered UNAUTHENTICATED and closed; a silent one is closed
    after HANDSHAKE_TIMEOUT_S. No handler ever starts."""
    monkeypatch.setattr(mux, "HANDSHAKE_TIMEOUT_S", 0.3)

    async def scenario(servicer, muxed, server, calls):
        host, port = servicer.mux_address.rsplit(":", 1)
        generate = call_frames(pb.CallFrame(call_id=1, generate=route("sneaky")))
        for opening, why in ((generate, "not a fleet-token handshake"),
                             (handshake(WRONG.presented()) + generate, "wrong fleet token"),
                             (handshake(b""), "no fleet token presented")):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(opening)
            status, rest = await answer_and_end(reader)
            assert status.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert why in status.details and rest == b""
            writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))   # says nothing at all
        assert await answer_and_end(reader) == (None, b"")
        writer.close()
        assert servicer.started == {} and servicer.finished == []
        assert await collect(muxed.call("generate", route("owner"))) == [1, 2, 3]
    story(scenario, "tcp")


@TRANSPORTS
def test_a_caller_with_a_wrong_token_fails_at_once_with_unauthenticated_in_the_error(transport):
    """The gRPC calls (Health, the Mux RPC) carry a wrong token: refused by the interceptor."""
    async def scenario(servicer, muxed, server, calls):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(collect(muxed.call("generate", route("x"))), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "UNAUTHENTICATED" in e.value.details() and "wrong fleet token" in e.value.details()
        assert servicer.started == {}
    story(scenario, transport, channel_auth=WRONG, mux_auth=WRONG)


def test_a_mux_handshake_with_a_wrong_token_fails_the_calls_at_once():
    """Health passes (the right token on gRPC), the TCP handshake presents a wrong one."""
    async def scenario(servicer, muxed, server, calls):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(collect(muxed.call("generate", route("x"))), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refused the mux connection" in e.value.details()
        assert "UNAUTHENTICATED" in e.value.details() and "wrong fleet token" in e.value.details()
        assert servicer.started == {}
    story(scenario, "tcp", mux_auth=WRONG)


# ------------------------------------------------------------- a real decode worker's mux
@pytest.fixture
def decode_worker(tiny_model_dir):
    """(address, the fleet token its launcher gave it)."""
    launcher = Launcher()
    try:
        yield launcher.start("decode-0", [
            "services.cli.cli", "serve", "decode", "--model", str(tiny_model_dir),
            "--worker-id", "decode-0", "--kv-cache-mib", "16"]), FleetAuth.from_env(launcher.env)
    finally:
        launcher.stop_all()


def reserve_request(rid: str, n_prompt: int = 40, max_tokens: int = 8) -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)),
                             params=pb.SamplingParams(max_tokens=max_tokens, temperature=0))


def test_reservations_over_a_decode_workers_mux_each_get_their_own_answer(decode_worker):
    async def main():
        address, auth = decode_worker
        channel = internal_channel(address, auth)
        stub = pb_grpc.WorkerStub(channel)
        muxed = MuxChannel(connect_to(stub, address, auth), address)
        try:
            answers = await asyncio.gather(*(muxed.unary("reserve", reserve_request(f"r{i}", 16 + i))
                                             for i in range(12)))
            assert all(a.accepted for a in answers)
            assert [a.request_id for a in answers] == [f"r{i}" for i in range(12)]
            assert all(len(a.target.block_ids) >= 1 for a in answers)
            with pytest.raises(grpc.aio.AioRpcError) as e:   # invalid: refused, the mux lives on
                await muxed.unary("reserve", reserve_request("huge", n_prompt=10**6))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await muxed.unary("reserve", reserve_request("r-last"))).accepted
            stats = await stub.Stats(pb.StatsRequest())
            assert stats.kv_blocks_reserved > 0
            for rid in [f"r{i}" for i in range(12)] + ["r-last"]:
                await stub.Cancel(pb.CancelRequest(request_id=rid))
            assert (await stub.Stats(pb.StatsRequest())).kv_blocks_reserved == 0
        finally:
            await muxed.close()
            await channel.close()
    asyncio.run(main())


def test_a_release_sent_right_behind_a_reserve_always_frees_it(decode_worker):
    """The router's Cancel travels on the same connection as the request's Reserve, so it can
    never overtake it: a reservation made just before its Cancel is always freed."""
    async def main():
        address, auth = decode_worker
        channel = internal_channel(address, auth)
        stub = pb_grpc.WorkerStub(channel)
        muxed = MuxChannel(connect_to(stub, address, auth), address)
        try:
            for i in range(20):
                reserve = muxed.call("reserve", reserve_request(f"q{i}"))   # its frame is queued
                released = await muxed.unary("release", pb.CancelRequest(request_id=f"q{i}"))
                assert (await reserve.read()).accepted and released.cancelled
            stats = await stub.Stats(pb.StatsRequest())
            assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0
        finally:
            await muxed.close()
            await channel.close()
    asyncio.run(main())
