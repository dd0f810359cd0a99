"""A cancel never frees a decode reservation while KV is still being written into it.

A prefill worker's Cancel answers only once the request's KV write is over (the router cancels
prefill workers first and decode workers after), so blocks freed on the decode worker cannot be
handed to another request while a write lands in them. The write is held up for real: the decode
worker is stopped (SIGSTOP) after it reserved and before the prefill ends, so the prefill worker's
write waits for an answer that never comes, until its deadline (reservation expiry less a margin).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc

from services.cli.launcher import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.fleet.fleet_helpers import route_request, running_fleet

PROMPT = [(i * 7919) % 3000 + 100 for i in range(3000)]   # long enough to stop decode meanwhile
RESERVE_TIMEOUT_S = 4.0      # the write must be over 1 s before: 3 s after the reservation


def test_a_prefill_workers_cancel_waits_for_its_kv_write_to_end(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg",
                       worker_args=("--reserve-timeout-s", str(RESERVE_TIMEOUT_S))) as fleet:
        assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status
                          == pb.HealthResponse.SERVING, 10)
        decode_pid = fleet.launcher.children["decode-0"].proc.pid
        chunks, errors = [], []

        def client():
            try:
                for chunk in fleet.router_stub().Generate(
                        route_request("held", PROMPT, 4, ignore_eos=True)):
                    chunks.append(chunk)
            except grpc.RpcError as e:
                errors.append(e.code())

        thread = threading.Thread(target=client)
        thread.start()
        try:
            assert wait_until(lambda: held(fleet.stats("decode-0")), 10), (chunks, errors)
            os.kill(decode_pid, signal.SIGSTOP)          # reserved; its KV can no longer land
            assert wait_until(lambda: fleet.stats("prefill-0").kv_writes_in_flight == 1, 10)
            assert chunks and len(chunks[0].token_ids) == 1   # the first token went out anyway

            with fleet.channel(fleet.workers["prefill-0"]) as ch:
                started = time.monotonic()
                pb_grpc.WorkerStub(ch).Cancel(pb.CancelRequest(request_id="held"), timeout=30)
                waited = time.monotonic() - started
            # the answer came once the write was over (it fails at its deadline), not before
            assert fleet.stats("prefill-0").kv_writes_in_flight == 0, f"answered after {waited:.2f}s"
        finally:
            os.kill(decode_pid, signal.SIGCONT)
            thread.join(30)
        assert errors == [grpc.StatusCode.UNAVAILABLE]   # the client hears of the failed write
        # and, the write over, nothing stays held on either worker
        assert wait_until(lambda: not any(
            held(fleet.stats(name)) for name in ("prefill-0", "decode-0")), RESERVE_TIMEOUT_S + 2)


def held(stats: pb.WorkerStats) -> int:
    """Blocks the worker holds for requests (a remote reservation allocates its target blocks)."""
    return stats.kv_blocks_used + stats.kv_blocks_reserved
