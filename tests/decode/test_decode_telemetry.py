"""What a decode worker's telemetry says of its reservations (the decode role over a real engine
core, a real KV source writing into the reservation over tcp; the metrics read from the role's
own registry):
  - a landed transfer counts its bytes as received, and the request's last chunk says how long
    the KV took from the writer's start (HandOff.sent_at_unix_s) and how long decode took;
  - a reservation whose KV never comes counts a transfer failure by reason (timeout) and ends
    as an error, in a `decode` span with an error status.
"""
from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import StatusCode

from services.kv_transfer.base import wait_done
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.decode.test_reservations import RESERVATION_S, Rig
from tests.waiting import eventually


def sample(rig: Rig, name: str, **labels) -> float:
    return rig.role.telemetry.metrics.registry.get_sample_value(
        name, {"role": "decode", "worker": "decode-0", **labels}) or 0.0


def test_a_landed_transfer_counts_its_bytes_and_times_the_last_chunk(tiny_model_dir):
    async def story():
        async with Rig(str(tiny_model_dir), "tcp") as rig:
            resp = await rig.reserve("landed", max_tokens=6)
            sent_at = time.time()
            await wait_done(rig.source.write(
                "landed", list(range(len(resp.target.block_ids))), resp.target, 10.0,
                hand_off=pb.HandOff(request_id="landed", first_token=42, sent_at_unix_s=sent_at)))
            chunks = [c async for c in rig.role.decode("landed")]
            decoded_s = time.time() - sent_at
            last = chunks[-1]
            assert last.finished and 0 < last.timing.transfer_s
            assert 0 < last.timing.decode_s and last.timing.transfer_s + last.timing.decode_s <= decoded_s
            assert all(not c.HasField("timing") for c in chunks[:-1])
            kv_bytes = len(resp.target.block_ids) * resp.target.bytes_per_block
            assert sample(rig, "kvfleet_kv_transfer_bytes_total", backend="tcp",
                          direction="received") == kv_bytes
            assert sample(rig, "kvfleet_worker_requests_total", outcome="finished") == 1
    asyncio.run(story())


def test_a_reservation_whose_kv_never_comes_counts_a_timeout_and_ends_as_an_error(
        tiny_model_dir, in_memory_spans):
    async def story():
        async with Rig(str(tiny_model_dir), "tcp") as rig:
            await rig.reserve("never")
            assert await eventually(
                lambda: sample(rig, "kvfleet_worker_requests_total", outcome="error"),
                RESERVATION_S + 5), "the reservation never ended"
            assert sample(rig, "kvfleet_kv_transfer_failures_total", backend="tcp",
                          reason="timeout") == 1
            assert sample(rig, "kvfleet_kv_transfer_bytes_total", backend="tcp",
                          direction="received") == 0
    asyncio.run(story())
    (decode,) = [s for s in in_memory_spans.get_finished_spans() if s.name == "decode"]
    assert decode.status.status_code == StatusCode.ERROR and "timed out" in decode.status.description
