"""Many requests on one long-lived call (services/protocol/shared_call.py), over real gRPC: each
request gets its own answer, its own deadline and its own cancellation, a typed refusal arrives
typed, and a peer that goes away fails every request waiting on it, after which the next request
opens a new call.

The server is a stand-in router (`GatedRouter`, named as such): its Admit waits until the story
lets each request through, so the stories control the order of answers; the transport around it
is the real one (answer_asks, StreamedContext, SharedCall, grpc.aio). The real router's
AdmitStream and the decode worker's ReserveStream run in the fleet stories (tests/fleet)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.protocol import shared_call, status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.typed_stub import TypedStub

WAIT_S = 10.0                     # the most a story waits for an event before it fails
REFUSAL = status.failed(pb.OVERLOADED, "all busy", retry_after_s=3)


class GatedRouter(pb_grpc.RouterServicer):
    """A stand-in router: Admit answers a request once the story opens its gate (or refuses it,
    for a request id starting "refuse"), and records how each request's handling ended."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.ended: dict[str, asyncio.Future] = {}      # request id -> context.cancelled()
        self.late_cancels: asyncio.Queue[str] = asyncio.Queue()
        self.calls = 0
        self.seen_trace: dict[str, dict] = {}
        self.arrived = asyncio.Condition()              # notified as each request arrives

    async def seen(self, count: int) -> None:
        """Until `count` requests have arrived here."""
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.seen_trace) >= count),
                                   WAIT_S)

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    def ending(self, rid: str) -> asyncio.Future:
        return self.ended.setdefault(rid, asyncio.get_running_loop().create_future())

    async def Admit(self, request: pb.WorkRequest, context) -> pb.Plan:
        rid = request.request_id
        ending = self.ending(rid)
        context.add_done_callback(lambda ctx: ending.done() or ending.set_result(ctx.cancelled()))
        self.seen_trace[rid] = dict(context.invocation_metadata())
        async with self.arrived:
            self.arrived.notify_all()
        if rid.startswith("refuse"):
            await status.abort(context, REFUSAL)
        await self.gate(rid).wait()
        return pb.Plan(request_id=rid, router_id="stand-in")

    async def AdmitStream(self, asks, context):
        self.calls += 1
        async for answer in shared_call.answer_asks(asks, lambda ask, ctx: self.Admit(
                ask.request, ctx), shared_call.ADMIT, late_cancel=self.late_cancels.put_nowait):
            yield answer


class Peer:
    """The stand-in router served on a port, and a gateway's shared call to it."""

    def __init__(self) -> None:
        self.router = GatedRouter()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.channel: grpc.aio.Channel | None = None
        self.call: shared_call.SharedCall | None = None
        self.orphans: asyncio.Queue[pb.AdmitAnswer] = asyncio.Queue()   # answers to no one

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(self.router, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
            self.call = shared_call.admit_call(TypedStub(pb_grpc.RouterStub(self.channel)),
                                               f"127.0.0.1:{self.port}", self.orphans.put_nowait)

    async def kill(self) -> None:
        await self.server.stop(None)

    def admit(self, rid: str, timeout_s: float = WAIT_S, metadata=None):
        return shared_call.admit(self.call, pb.WorkRequest(request_id=rid), timeout_s, metadata)

    async def close(self) -> None:
        self.call.close()
        await self.channel.close()
        await self.server.stop(None)


def run(story) -> None:
    async def main():
        peer = Peer()
        await peer.start()
        try:
            await asyncio.wait_for(story(peer), 4 * WAIT_S)
        finally:
            await peer.close()
    asyncio.run(main())


def test_many_requests_share_one_call_and_each_gets_its_own_answer():
    async def story(peer: Peer):
        rids = [f"r{i}" for i in range(6)]
        asks = [asyncio.create_task(peer.admit(rid)) for rid in rids]
        for rid in reversed(rids):                 # answered in the reverse order of asking
            peer.router.gate(rid).set()
        plans = await asyncio.gather(*asks)
        assert [p.request_id for p in plans] == rids
        assert peer.call.opened == 1 and peer.router.calls == 1
    run(story)


def test_a_deadline_on_one_request_ends_it_alone_on_both_sides():
    async def story(peer: Peer):
        slow = asyncio.create_task(peer.admit("slow", timeout_s=0.3))   # never let through
        fast = asyncio.create_task(peer.admit("fast"))
        with pytest.raises(status.CallFailed) as late:
            await slow
        assert late.value.untyped_code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert late.value.status.reason == pb.UNAVAILABLE
        # the router's handling of it was cancelled, as grpc cancels a call past its deadline
        assert await asyncio.wait_for(peer.router.ending("slow"), WAIT_S) is True
        peer.router.gate("fast").set()
        assert (await fast).request_id == "fast"
        assert await peer.router.ending("fast") is False
        assert peer.call.opened == 1
    run(story)


def test_a_caller_that_gives_up_cancels_its_request_on_the_peer():
    async def story(peer: Peer):
        ask = asyncio.create_task(peer.admit("gone"))
        await peer.router.seen(1)                            # the router is handling it
        ask.cancel()
        assert await asyncio.wait_for(peer.router.ending("gone"), WAIT_S) is True
        peer.router.gate("next").set()
        assert (await peer.admit("next")).request_id == "next"
    run(story)


def test_a_cancel_after_the_answer_asks_the_peer_to_undo_it():
    async def story(peer: Peer):
        peer.router.gate("done").set()
        await peer.admit("done")
        peer.call.cancel("done")         # e.g. the answer came after its asker's deadline
        assert await asyncio.wait_for(peer.router.late_cancels.get(), WAIT_S) == "done"
    run(story)


def test_a_request_given_up_as_it_is_answered_is_undone_once_one_way_or_the_other():
    """The caller gives up in the very step the router is let answer: either the cancel reaches
    the router's handler (cancelled, no answer), or the answer was on its way and comes back to
    the caller's `orphaned` hook (which undoes it: the gateway releases the plan). Never both,
    never neither, whichever wins (here, one loop serving both ends, the answer mostly does)."""
    async def story(peer: Peer):
        for i in range(12):
            rid = f"race-{i}"
            ask = asyncio.create_task(peer.admit(rid))
            await peer.router.seen(2 * i + 1)
            peer.router.gate(rid).set()
            ask.cancel()
            handler_cancelled = await asyncio.wait_for(peer.router.ending(rid), WAIT_S)
            if not handler_cancelled:      # answered: it comes back to no one but the hook
                orphan = await asyncio.wait_for(peer.orphans.get(), WAIT_S)
                assert orphan.request_id == rid and orphan.HasField("plan")
            peer.router.gate(f"probe-{i}").set()       # answered after anything of rid's
            assert (await peer.admit(f"probe-{i}")).request_id == f"probe-{i}"
            assert peer.orphans.empty()
    run(story)


def test_a_typed_refusal_and_the_trace_context_travel_in_the_messages():
    async def story(peer: Peer):
        parent = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
        with pytest.raises(status.CallFailed) as refused:
            await peer.admit("refuse-1", metadata=parent)
        assert refused.value.status == REFUSAL
        assert refused.value.untyped_code is None     # the peer decided: not unreachable
        assert peer.router.seen_trace["refuse-1"] == dict(parent)
    run(story)


def test_a_peer_gone_fails_every_waiting_request_and_the_next_one_reopens_the_call():
    async def story(peer: Peer):
        waiting = [asyncio.create_task(peer.admit(f"w{i}")) for i in range(3)]
        await peer.router.seen(3)
        await peer.kill()
        for ask in waiting:
            with pytest.raises(status.CallFailed) as failed:
                await ask
            # what a unary call to a dead peer raises: the gateway asks its next router
            assert failed.value.status.reason == pb.UNAVAILABLE
            assert failed.value.untyped_code is not None
        peer.router = GatedRouter()
        await peer.start()                             # the peer comes back on its port
        peer.router.gate("after").set()
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:            # within the backoff after the break an ask fails at once
            try:
                plan = await peer.admit("after")
                break
            except status.CallFailed as e:
                assert e.untyped_code == grpc.StatusCode.UNAVAILABLE
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
        assert plan.request_id == "after"
        assert peer.call.opened >= 2 and peer.router.calls == 1
    run(story)


class GatedPrefill(pb_grpc.WorkerServicer):
    """A stand-in prefill worker: its Prefill accepts, sends a first token once the story opens
    the request's gate, then ends; it records how each request's handling ended."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.ended: dict[str, asyncio.Future] = {}

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    def ending(self, rid: str) -> asyncio.Future:
        return self.ended.setdefault(rid, asyncio.get_running_loop().create_future())

    async def prefill(self, request: pb.PrefillRequest, context):
        rid = request.request_id
        ending = self.ending(rid)
        context.add_done_callback(lambda ctx: ending.done() or ending.set_result(ctx.cancelled()))
        await context.send_initial_metadata((("x-kvfleet-accepted", "1"),))
        await self.gate(rid).wait()
        yield pb.PrefillReply(chunk=pb.TokenChunk(request_id=rid, token_ids=[7]))
        yield pb.PrefillReply(shipped=pb.KVShipped(request_id=rid, blocks=1))

    async def PrefillStream(self, asks, context):
        async def one(ask, ctx):
            async for reply in self.prefill(ask.request, ctx):
                ctx.send(pb.PrefillNote(request_id=ask.request.request_id, reply=reply))
        async for note in shared_call.answer_asks(asks, one, shared_call.PREFILL):
            yield note


def run_prefill(story) -> None:
    async def main():
        worker = GatedPrefill()
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = shared_call.prefill_call(TypedStub(pb_grpc.WorkerStub(channel)), f"port {port}")
        try:
            await asyncio.wait_for(story(worker, call), 4 * WAIT_S)
        finally:
            call.close()
            await channel.close()
            await server.stop(None)
    asyncio.run(main())


def prefill_of(call, rid: str, timeout_s: float = WAIT_S):
    return shared_call.prefill(call, pb.PrefillRequest(request_id=rid), timeout_s)


def test_a_streamed_request_is_accepted_then_read_to_its_end_like_its_own_call():
    async def story(worker: GatedPrefill, call):
        a, b = prefill_of(call, "a"), prefill_of(call, "b")
        await asyncio.wait_for(a.initial_metadata(), WAIT_S)      # accepted before any token
        await asyncio.wait_for(b.initial_metadata(), WAIT_S)
        worker.gate("b").set()
        worker.gate("a").set()
        for request in (a, b):
            replies = [r async for r in request]
            assert [r.WhichOneof("kind") for r in replies] == ["chunk", "shipped"]
            assert replies[0].chunk.request_id == request.request_id
        assert call.opened == 1
    run_prefill(story)


def test_a_cancel_mid_prefill_ends_that_request_alone_on_the_worker():
    async def story(worker: GatedPrefill, call):
        doomed, kept = prefill_of(call, "doomed"), prefill_of(call, "kept")
        await asyncio.wait_for(doomed.initial_metadata(), WAIT_S)
        assert doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await anext(aiter(doomed))
        assert await asyncio.wait_for(worker.ending("doomed"), WAIT_S) is True
        worker.gate("kept").set()
        assert [r.WhichOneof("kind") async for r in kept] == ["chunk", "shipped"]
    run_prefill(story)


def test_a_streamed_requests_deadline_ends_it_on_both_sides():
    async def story(worker: GatedPrefill, call):
        late = prefill_of(call, "late", timeout_s=0.3)          # its gate never opens
        with pytest.raises(status.CallFailed) as failed:
            await anext(aiter(late))
        assert failed.value.untyped_code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await asyncio.wait_for(worker.ending("late"), WAIT_S) is True
    run_prefill(story)
