"""What a prefill worker's telemetry says of a KV write that fails (a prefill worker in process
over real gRPC, its engine core a real process on the tiny model): the first token still goes
out, carrying its queue and prefill times; the write, whose reservation expires before it could
move, is counted as a transfer failure by reason (deadline), its `kv_transfer` span ends with an
error status under the request's `prefill` span, and the request ends here as an error.
A write whose request the caller cancelled meanwhile is abandoned, not failed: the decode side
drops it, and no failure is counted (the KV failure alert must not fire on cancels)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from opentelemetry.trace import StatusCode

from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout
from services.kv_transfer.peer import make_cache
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.prefill.handler import ABANDONED
from tests.kv_transfer.conftest import fleet_token_env  # noqa: F401 - the tcp transports' token
from tests.waiting import eventually
from tests.harness import in_process_worker
from tests.worker.test_worker_telemetry import PROMPT, params


def test_a_write_past_its_reservation_is_a_deadline_failure_in_an_error_span(tiny_model_dir,
                                                                             in_memory_spans):
    async def story():
        prefill = await in_process_worker(str(tiny_model_dir), "prefill")
        target = make_transport("tcp", "decode-x")
        try:
            target.register(make_cache(KVLayout.of(prefill.engine.kv_cache), 16))
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for reply in prefill.stub.Prefill(pb.PrefillRequest(
                        request_id="late", prompt_token_ids=PROMPT, params=params(),
                        target=target.descriptor(range(5)),
                        kv_deadline_unix_s=time.time() + 0.001), timeout=30):
                    chunks.append(reply.chunk)
            assert status.of(failed.value).reason == pb.KV_TRANSFER_FAILED
            assert len(chunks) == 1 and chunks[0].timing.prefill_s > 0
            registry = prefill.telemetry.metrics.registry
            labels = {"role": "prefill", "worker": "prefill-0"}
            assert registry.get_sample_value("kvfleet_kv_transfer_failures_total",
                                             {**labels, "backend": "tcp", "reason": "deadline"}) == 1
            # the handler counts the request's ending after its status went out: the caller can
            # read the status first
            assert await eventually(lambda: registry.get_sample_value(
                "kvfleet_worker_requests_total", {**labels, "outcome": "error"}) == 1)
        finally:
            target.close()
            await prefill.close()
    asyncio.run(story())
    by_name = {s.name: s for s in in_memory_spans.get_finished_spans()}
    kv, prefill_span = by_name["kv_transfer"], by_name["prefill"]
    assert kv.status.status_code == StatusCode.ERROR and "expires" in kv.status.description
    assert kv.parent.span_id == prefill_span.context.span_id
    assert prefill_span.status.status_code == StatusCode.UNSET     # the prefill itself went fine


def test_a_write_whose_request_was_cancelled_is_abandoned_not_counted_as_a_failure(
        tiny_model_dir, in_memory_spans):
    async def story():
        prefill = await in_process_worker(str(tiny_model_dir), "prefill")
        target = make_transport("tcp", "decode-x")
        target.register(make_cache(KVLayout.of(prefill.engine.kv_cache), 16))
        prefill.telemetry.expect_kv("tcp")     # as serve.py does: the series exist at zero
        closed = False
        try:
            async def writes() -> int:
                return (await prefill.stub.Stats(pb.StatsRequest(), timeout=5)).kv_writes_in_flight

            # the target never expects this transfer, so the write waits on it, in flight
            call = prefill.stub.Prefill(pb.PrefillRequest(
                request_id="gone", prompt_token_ids=PROMPT, params=params(),
                target=target.descriptor(range(5)),
                kv_deadline_unix_s=time.time() + 30), timeout=30)
            first = await call.read()
            assert first.chunk.token_ids
            assert await eventually(lambda: _eq(writes(), 1))
            # the client goes away: the gateway cancels the call and the request here...
            call.cancel()
            await prefill.stub.Cancel(pb.CancelRequest(request_id="gone"), timeout=5)
            # ...and the decode side ends its reservation, dropping the connection
            target.close()
            closed = True
            assert await eventually(lambda: _eq(writes(), 0), timeout_s=20)
            registry = prefill.telemetry.metrics.registry
            labels = {"role": "prefill", "worker": "prefill-0", "backend": "tcp"}
            failures = {reason: registry.get_sample_value(
                "kvfleet_kv_transfer_failures_total", {**labels, "reason": reason})
                for reason in ("peer_gone", "closed", "refused", "timeout", "other")}
            assert failures == dict.fromkeys(failures, 0.0), failures
            assert registry.get_sample_value("kvfleet_worker_requests_total",
                                             {"role": "prefill", "worker": "prefill-0",
                                              "outcome": "cancelled"}) == 1
        finally:
            if not closed:
                target.close()
            await prefill.close()
    asyncio.run(story())
    kv = next(s for s in in_memory_spans.get_finished_spans() if s.name == "kv_transfer")
    assert kv.attributes[ABANDONED] is True
    assert kv.status.status_code != StatusCode.ERROR


async def _eq(value, expected) -> bool:
    return (await value) == expected
