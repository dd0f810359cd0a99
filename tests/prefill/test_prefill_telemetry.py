"""What a prefill worker's telemetry says of a KV write that fails (a prefill worker in process
over real gRPC, its engine core a real process on the tiny model): the first token still goes
out, carrying its queue and prefill times; the write, whose reservation expires before it could
move, is counted as a transfer failure by reason (deadline), its `kv_transfer` span ends with an
error status under the request's `prefill` span, and the request ends here as an error."""
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
from tests.kv_transfer.conftest import fleet_token_env  # noqa: F401 - the tcp transports' token
from tests.worker.test_worker_telemetry import PROMPT, params, start_worker


def test_a_write_past_its_reservation_is_a_deadline_failure_in_an_error_span(tiny_model_dir,
                                                                             in_memory_spans):
    async def story():
        prefill = await start_worker(str(tiny_model_dir), "prefill")
        target = make_transport("tcp", "decode-x")
        try:
            target.register(make_cache(KVLayout.of(prefill.engine.kv_cache), 16))
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for reply in prefill.stub.Prefill(pb.PrefillRequest(
                        request_id="late", prompt_token_ids=PROMPT, params=params(),
                        target=target.descriptor(range(5)), decode_worker="127.0.0.1:1",
                        kv_deadline_unix_s=time.time() + 0.001), timeout=30):
                    chunks.append(reply.chunk)
            assert status.of(failed.value).reason == pb.KV_TRANSFER_FAILED
            assert len(chunks) == 1 and chunks[0].timing.prefill_s > 0
            registry = prefill.telemetry.metrics.registry
            labels = {"role": "prefill", "worker": "prefill-0"}
            assert registry.get_sample_value("kvfleet_kv_transfer_failures_total",
                                             {**labels, "backend": "tcp", "reason": "deadline"}) == 1
            assert registry.get_sample_value("kvfleet_worker_requests_total",
                                             {**labels, "outcome": "error"}) == 1
        finally:
            target.close()
            await prefill.close()
    asyncio.run(story())
    by_name = {s.name: s for s in in_memory_spans.get_finished_spans()}
    kv, prefill_span = by_name["kv_transfer"], by_name["prefill"]
    assert kv.status.status_code == StatusCode.ERROR and "expires" in kv.status.description
    assert kv.parent.span_id == prefill_span.context.span_id
    assert prefill_span.status.status_code == StatusCode.UNSET     # the prefill itself went fine
