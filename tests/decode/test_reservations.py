"""The decode worker owns its blocks (R2, item 3): a reservation's blocks go back to the engine only
once no write into them can land, whatever order anyone cancels in.

A real engine core process behind an EngineClient (the simulated core: every claim here is about
blocks, bytes written or refused, and counts of tokens, which the real scheduler, block pool and
transports decide whatever makes the tokens; its KV pool is a numpy array the transports move real
bytes into), the decode role over it, and a real KV source (a second pool with its own transport)
writing into the reservation, over tcp and nixl:
  - tcp (the receiver copies): ending a reservation stops its transfer at once and frees the
    blocks; a write that comes afterwards is refused and changes none of them; the same with the
    receiver staging through host memory as it does for a CUDA pool ("tcp-staged": a CPU pool
    on the device path, up to the device copy);
  - nixl (one-sided writes): ending a reservation holds its blocks until the write lands, or until
    the reservation's deadline when none comes;
  - a landed transfer starts decode by itself, from the HandOff's first token: nobody relays it;
  - one DecodeStream call carries many requests: their chunks come batched, each request's end
    after its last chunk, and a request nobody holds a reservation for ends NO_RESERVATION.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from services.decode.reservations import DecodeRole
from services.engine.engine import engine_config
from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout, KVTransferError, wait_done
from services.kv_transfer.peer import fill_random, make_cache
from services.kv_transfer.tcp import TcpTransport
from services.protocol.convert import params_to_pb
from services.engine.sampling_params import SamplingParams
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts
from services.worker.capacity import CapacityNotifier
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.role import RoleParts
from services.worker.telemetry import WorkerTelemetry
from tests.harness import sim_config
from tests.waiting import eventually

PROMPT = list(range(100, 166))          # 66 tokens: 5 blocks of 16
RESERVATION_S = 3.0


class Rig:
    """The decode side (engine core, transport, DecodeRole) and a KV source of the same layout."""

    def __init__(self, model_dir: str, backend: str, timeouts: Timeouts | None = None) -> None:
        self.model_dir, self.backend = model_dir, backend
        self.timeouts = timeouts or Timeouts(reservation_s=RESERVATION_S, reservation_per_target=0.0)

    async def __aenter__(self) -> Rig:
        self.engine = EngineClient(engine_config(self.model_dir, kv_cache_mib=8, sim=sim_config(8)))
        await self.engine.start()
        self.transport = self._transport(f"decode-{self.backend}")
        self.transport.register(self.engine.kv_cache)
        config = WorkerConfig("decode-0", "decode", self.backend, self.timeouts)
        self.role = DecodeRole()
        await self.role.start(RoleParts(config, self.engine, self.transport,
                                        WorkerTelemetry("decode", "decode-0"),
                                        CapacityNotifier(None)))
        layout = KVLayout.of(self.engine.kv_cache)
        self.source_kv = make_cache(layout, 16)
        fill_random(self.source_kv, seed=7)
        self.source = self._transport(f"source-{self.backend}")
        self.source.register(self.source_kv)
        return self

    def _transport(self, worker_id: str):
        if self.backend == "tcp-staged":
            return TcpTransport(worker_id, staged=True)
        return make_transport(self.backend, worker_id)

    async def __aexit__(self, *exc) -> None:
        self.role.stop()
        self.source.close()
        self.transport.close()
        await self.engine.close()

    async def reserve(self, rid: str, max_tokens: int = 8,
                      traffic_class: str = "") -> pb.ReserveResponse:
        resp = await self.role.reserve(pb.ReserveRequest(
            request_id=rid, prompt_token_ids=PROMPT, traffic_class=traffic_class,
            params=params_to_pb(SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True))), context=None)
        assert resp.accepted, resp.reason
        return resp

    def write(self, rid: str, target: pb.KVDescriptor, first_token: int = 42):
        return self.source.write(rid, list(range(len(target.block_ids))), target, 10.0,
                                 hand_off=pb.HandOff(request_id=rid, first_token=first_token))

    async def reserved(self) -> int:
        """Blocks the engine holds for requests (a remote reservation allocates its blocks)."""
        s = await self.engine.stats()
        return s.kv_blocks_used + s.kv_blocks_reserved

    def target_bytes(self, target: pb.KVDescriptor):
        return self.engine.kv_cache.data[:, :, list(target.block_ids)]    # indexing copies


@pytest.mark.parametrize("backend", ["tcp", "tcp-staged"])
def test_tcp_ending_a_reservation_frees_it_at_once_and_a_late_write_lands_nowhere(tiny_model_dir,
                                                                                  backend):
    async def story():
        async with Rig(str(tiny_model_dir), backend) as rig:
            resp = await rig.reserve("tcp-1")
            assert await rig.reserved() > 0
            before = rig.target_bytes(resp.target)
            assert rig.role.end("tcp-1")
            assert rig.role.held_blocks == 0                 # the receiver stops writes itself
            assert await eventually(lambda: _is(rig.reserved(), 0))
            with pytest.raises(KVTransferError):
                await wait_done(rig.write("tcp-1", resp.target))
            assert (rig.target_bytes(resp.target) == before).all()
    asyncio.run(story())


def test_nixl_an_ended_reservation_holds_its_blocks_until_the_write_lands(tiny_model_dir):
    async def story():
        async with Rig(str(tiny_model_dir), "nixl") as rig:
            resp = await rig.reserve("nixl-1")
            rig.role.end("nixl-1")                           # cancelled before its KV came
            assert rig.role.held_blocks == len(resp.target.block_ids)
            assert await rig.reserved() > 0                  # not handed to anyone meanwhile
            await wait_done(rig.write("nixl-1", resp.target))    # the write lands after all
            assert await eventually(lambda: _is(rig.reserved(), 0))
            assert rig.role.held_blocks == 0
    asyncio.run(story())


def test_nixl_an_ended_reservation_with_no_write_is_freed_at_its_deadline(tiny_model_dir):
    async def story():
        async with Rig(str(tiny_model_dir), "nixl") as rig:
            started = time.monotonic()
            await rig.reserve("nixl-2")
            rig.role.end("nixl-2")
            assert rig.role.held_blocks > 0
            assert await eventually(lambda: _is(rig.reserved(), 0), RESERVATION_S + 5)
            assert time.monotonic() - started >= RESERVATION_S - 0.5   # not before the deadline
            assert rig.role.held_blocks == 0
    asyncio.run(story())


# a document's reservation: 1 s base + 0.3 x its 10 s TTFT target = 4 s; a chat's: 1.3 s
LONG_PREFILL = Timeouts(reservation_s=1.0, reservation_per_target=0.3, kv_deadline_margin_s=0.2)


def test_a_documents_kv_that_comes_after_the_base_lifetime_still_lands_and_decodes(tiny_model_dir):
    """A document's prefill outlasts the fleet's base reservation_s: its reservation lives by its
    class's target, so the late KV lands and decode runs."""
    async def story():
        async with Rig(str(tiny_model_dir), "tcp", LONG_PREFILL) as rig:
            reserved_at = time.time()
            resp = await rig.reserve("doc-late", max_tokens=4, traffic_class="document")
            lifetime = resp.expires_at_unix_s - reserved_at
            assert 3.5 <= lifetime <= 4.5
            chat = await rig.reserve("chat", traffic_class="interactive")
            assert chat.expires_at_unix_s - reserved_at <= 2.0      # a chat's stays short
            # the prefill runs on until the chat's reservation (1.3 s) has ended by itself: past
            # the base lifetime, which alone would have freed the document's too
            assert await eventually(lambda: "chat" not in rig.role._reservations)
            assert time.time() > reserved_at + LONG_PREFILL.reservation_s
            await wait_done(rig.write("doc-late", resp.target, first_token=42))
            chunks = [c async for c in rig.role.decode("doc-late")]
            assert chunks[-1].finished and chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 3      # tokens 2..4
            assert await eventually(lambda: _is(rig.reserved(), 0))
    asyncio.run(story())


def test_a_documents_reservation_whose_kv_never_comes_is_freed_at_its_own_deadline(tiny_model_dir):
    """The prefill worker that was to write a document's KV is gone (its transport closed before
    writing): the longer reservation still ends by itself, at its deadline and not before."""
    async def story():
        async with Rig(str(tiny_model_dir), "tcp", LONG_PREFILL) as rig:
            resp = await rig.reserve("doc-orphan", traffic_class="document")
            rig.source.close()                                      # the writer died
            assert await rig.reserved() > 0
            assert await eventually(lambda: _is(rig.reserved(), 0), 10.0)
            assert time.time() >= resp.expires_at_unix_s - 0.5     # not before its deadline
            assert rig.role.held_blocks == 0 and not rig.role._reservations
    asyncio.run(story())


@pytest.mark.parametrize("backend", ["tcp", "tcp-staged", "nixl"])
def test_a_landed_transfer_starts_decode_from_its_hand_off(tiny_model_dir, backend):
    async def story():
        async with Rig(str(tiny_model_dir), backend) as rig:
            resp = await rig.reserve(f"land-{backend}", max_tokens=6)
            await wait_done(rig.write(f"land-{backend}", resp.target, first_token=42))
            chunks = [c async for c in rig.role.decode(f"land-{backend}")]
            assert chunks[-1].finished and chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 5    # tokens 2..6
            assert await eventually(lambda: _is(rig.reserved(), 0))
    asyncio.run(story())


def test_one_decode_stream_carries_many_requests_batched(tiny_model_dir):
    async def story():
        async with Rig(str(tiny_model_dir), "tcp") as rig:
            rids = [f"many-{i}" for i in range(4)]
            for rid in rids:
                resp = await rig.reserve(rid, max_tokens=6)
                await wait_done(rig.write(rid, resp.target))
            subs = asyncio.Queue()
            for rid in [*rids, "nobody"]:
                subs.put_nowait(pb.DecodeSubscribe(request_id=rid))

            async def subscriptions():
                while True:
                    yield await subs.get()

            tokens, ends, batches = {}, {}, 0
            stream = rig.role.decode_stream(subscriptions())
            async for batch in stream:
                batches += 1
                for c in batch.chunks:
                    assert c.request_id not in ends          # no chunk after its end
                    tokens[c.request_id] = tokens.get(c.request_id, 0) + len(c.token_ids)
                for e in batch.ends:
                    ends[e.request_id] = e
                if len(ends) == 5:
                    break
            await stream.aclose()
            assert tokens == {rid: 5 for rid in rids}
            assert all(not ends[rid].HasField("failure") for rid in rids)
            assert ends["nobody"].failure.reason == pb.NO_RESERVATION
            assert batches < sum(tokens.values())            # steps' chunks travel together
            assert await eventually(lambda: _is(rig.reserved(), 0))
    asyncio.run(story())


async def _is(value, expected) -> bool:
    return (await value) == expected


def test_n_samples_reserve_the_prompt_once_and_fork_when_the_kv_lands(tiny_model_dir):
    """n = 3 over a 66-token prompt (4 full blocks of 16, then 2 tokens) with 20 output tokens:
    4 shared prompt blocks + 3 x (the copied partial block and the output: 2 blocks) = 10, not
    3 x 6 = 18. The HandOff's three first tokens start three samples, one stream, indexed."""
    async def story():
        async with Rig(str(tiny_model_dir), "tcp") as rig:
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=3)
            resp = await rig.role.reserve(pb.ReserveRequest(
                request_id="n3", prompt_token_ids=PROMPT, params=params_to_pb(params)), None)
            assert resp.accepted and len(resp.target.block_ids) == 5
            assert await rig.reserved() == 4 + 3 * 2
            await wait_done(rig.source.write(
                "n3", list(range(5)), resp.target, 10.0,
                hand_off=pb.HandOff(request_id="n3", first_token=42, more_first_tokens=[43, 44])))
            chunks = [c async for c in rig.role.decode("n3")]
            per_index = {i: sum(len(c.token_ids) for c in chunks if c.index == i) for i in range(3)}
            assert per_index == {0: 19, 1: 19, 2: 19}                # tokens 2..20 of each
            ends = [c for c in chunks if c.finish_reason]
            assert sorted(c.index for c in ends) == [0, 1, 2]
            assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
            assert await eventually(lambda: _is(rig.reserved(), 0))
    asyncio.run(story())


def test_a_reader_cancelled_while_it_waits_for_the_kv_leaves_the_start_to_the_watcher(
        tiny_model_dir):
    """Cancelling a Decode reader (a gateway's cancel at the first token) must not cancel the
    reservation's `started`, which the watcher sets when the KV lands: the cancel takes effect
    in the reader's next step, and a landing in between would find `started` cancelled
    (InvalidStateError). The request then ends as a cancel does: its blocks go back."""
    async def story():
        async with Rig(str(tiny_model_dir), "tcp") as rig:
            await rig.reserve("early-1")
            started = rig.role._reservations["early-1"].started
            reader = asyncio.create_task(anext(rig.role.decode("early-1")))
            assert await eventually(lambda: rig.role._reservations["early-1"].attached.is_set())
            reader.cancel()
            assert not started.cancelled()              # the reader's cancel stops at its shield
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert await eventually(lambda: _is(rig.reserved(), 0))
    asyncio.run(story())
