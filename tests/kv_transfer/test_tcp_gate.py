"""The tcp receiver's front door under hostile connections (in-process, real sockets): what a peer without the
fleet token can make it spend is bounded by TcpReceiverConfig, in memory, threads and time."""
from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import pytest
import torch

from services.kv_transfer import KVLayout, tcp
from services.kv_transfer.peer import make_cache
from services.kv_transfer.tcp_gate import TcpReceiverConfig
from services.protocol import fleet_token
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.kv_transfer.helpers import DST, LAYOUT, SRC, TARGET_BLOCKS, Pair, expected_target, new_id

CONFIG = TcpReceiverConfig(header_timeout_s=0.3, max_pending=8, max_transfers=2)
PATIENCE_S = 10.0  # how long a test waits for an event that should come far sooner


@pytest.fixture
def pair():
    pair = Pair("tcp")
    pair.target.close()  # the same pair, with a receiver of small bounds
    pair.target = tcp.TcpTransport(new_id("target"), config=CONFIG)
    pair.target_kv = make_cache(LAYOUT, TARGET_BLOCKS)
    pair.target.register(pair.target_kv)
    yield pair
    pair.close()


def connect(pair) -> socket.socket:
    host, port = pair.target.address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=PATIENCE_S)
    return sock


def closed_by_target(sock: socket.socket) -> bool:
    """Waits (at most PATIENCE_S) for the target to close; -> True when it did, having sent nothing else."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(what, deadline_s: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, "the receiver did not get there in time"
        time.sleep(0.01)


def receiver_threads(pair) -> list[str]:
    return [t.name for t in threading.enumerate() if pair.target.worker_id in t.name]


def a_real_write_lands(pair) -> None:
    before = pair.refill(seed=41)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=10.0)
    pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True).wait(10.0)
    target.wait(10.0)
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


def test_a_header_claiming_60_mib_is_closed_without_allocating_it(pair):
    tracemalloc.start()
    try:
        with connect(pair) as sock:
            sock.sendall(struct.pack(">I", 60 << 20))  # under the old 64 MiB frame limit
            assert closed_by_target(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # what this process allocated meanwhile, every thread included
    assert pair.target.gate_counts.bad_header == 1
    a_real_write_lands(pair)


def test_idle_connections_past_the_bound_are_closed_at_once_and_spend_no_thread(pair):
    threads_before = threading.active_count()
    idle = [connect(pair) for _ in range(CONFIG.max_pending)]
    extra = [connect(pair) for _ in range(30)]
    try:
        assert all(closed_by_target(sock) for sock in extra)
        wait_for(lambda: pair.target.gate_counts.busy == len(extra))
        assert threading.active_count() <= threads_before
        assert receiver_threads(pair) == [f"kv-tcp-gate-{pair.target.worker_id}"]
    finally:
        for sock in idle + extra:
            sock.close()
    wait_for(lambda: pair.target.gate_counts.slow == len(idle))  # each left (or timed out) mid-header
    a_real_write_lands(pair)


def test_a_slow_header_is_dropped_after_the_header_timeout(pair):
    with connect(pair) as sock:
        sock.sendall(b"\x00\x00")  # half a length, then nothing
        assert closed_by_target(sock)
    assert pair.target.gate_counts.slow == 1


def test_a_bad_token_is_refused_before_any_payload_is_read(pair):
    """A header with a wrong token and a payload of the whole pool's size: refused, and the expect() for that id
    is not touched: the fleet's own write of it still lands."""
    tid = new_id()
    layout = pair.target.descriptor(DST).layout
    header = pb.KVTransferHeader(token=fleet_token.generate(), transfer_id=tid, layout=layout, block_ids=DST,
                                 nbytes=TARGET_BLOCKS * KVLayout.from_pb(layout).bytes_per_block, timeout_s=30.0)
    expected = pair.target.expect(tid, DST, timeout_s=10.0)
    with connect(pair) as sock:
        tcp._send_frame(sock, header, time.monotonic() + PATIENCE_S)
        reply = tcp._recv_reply(sock, time.monotonic() + PATIENCE_S)
        assert reply.error.startswith("unauthenticated: wrong fleet token")
        assert closed_by_target(sock)
    assert pair.target.gate_counts.unauthenticated == 1
    assert not expected.done()
    before = pair.refill(seed=43)
    pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0).wait(10.0)
    expected.wait(10.0)
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_header_that_is_not_a_header_message_is_closed(pair, body):
    with connect(pair) as sock:
        sock.sendall(struct.pack(">I", len(body)) + body)
        assert closed_by_target(sock)
    assert pair.target.gate_counts.bad_header == 1


def test_a_header_with_a_timeout_that_is_no_number_of_seconds_fails_nothing_it_did_not_claim(pair):
    tid = new_id()
    expected = pair.target.expect(tid, DST, timeout_s=10.0)
    header = pb.KVTransferHeader(token=fleet_token.active().presented().decode(), transfer_id=tid,
                                 timeout_s=float("inf"))
    with connect(pair) as sock:
        tcp._send_frame(sock, header, time.monotonic() + PATIENCE_S)
        assert closed_by_target(sock)
    assert not expected.done()
