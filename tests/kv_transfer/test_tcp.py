"""tcp backend: what the receiver checks, and how a broken connection ends (in-process, real sockets)."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from services.protocol import fleet_token
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer import KVLayout, KVTransferError, make_transport, tcp
from services.kv_transfer.base import KVFailure
from services.kv_transfer.peer import make_cache
from tests.kv_transfer.helpers import DST, LAYOUT, SOURCE_BLOCKS, SRC, Pair, expected_target, new_id


@pytest.fixture
def pair():
    pair = Pair("tcp")
    yield pair
    pair.close()


def test_the_staged_path_for_device_pools_moves_the_same_bytes(pair):
    """A GPU pool is sent from one read_blocks copy and received into one staging copy; there is no GPU here,
    so take that path with CPU pools by dropping the in-place byte views on both sides."""
    pair.source._flat = pair.target._flat = None
    before = pair.refill(seed=19)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=5.0)
    pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=5.0, checksum=True).wait(5.0)
    target.wait(5.0)
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


def test_the_receiver_refuses_a_layout_it_does_not_have(pair):
    other = Pair("tcp", KVLayout(3, 4, 2, 16, "float32"))
    try:
        tid = new_id()
        target = pair.target.expect(tid, [1], timeout_s=5.0)
        descriptor = pair.target.descriptor([1])
        descriptor.layout.CopyFrom(KVLayout.of(other.source_kv).to_pb())  # lies to get past the source's check
        with pytest.raises(KVTransferError, match="target refused the transfer: layout mismatch"):
            other.source.write(tid, [1], descriptor, timeout_s=5.0).wait(5.0)
        with pytest.raises(KVTransferError, match="layout mismatch"):
            target.wait(5.0)
    finally:
        other.close()


def test_a_payload_corrupted_in_flight_is_caught_by_the_checksum(pair, monkeypatch):
    pair.refill(seed=11)
    send_views = tcp._send_views

    def corrupting(sock, views, deadline):
        first = bytearray(views[0])
        first[0] ^= 0x01  # one flipped bit on the wire; the source's pool is untouched
        send_views(sock, [memoryview(first), *views[1:]], deadline)

    monkeypatch.setattr(tcp, "_send_views", corrupting)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=5.0)
    with pytest.raises(KVTransferError, match="target failed the transfer: checksum mismatch") as source:
        pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=5.0, checksum=True).wait(5.0)
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        target.wait(5.0)
    # the reason is typed on both sides: the target's reply carries it to the writer
    assert source.value.failure == target.failure == KVFailure.CHECKSUM_MISMATCH


def test_the_receiver_writes_only_into_the_blocks_it_expects(pair):
    before = pair.refill(seed=13)
    tid = new_id()
    target = pair.target.expect(tid, [1, 2], timeout_s=5.0)
    with pytest.raises(KVTransferError, match="not the ones expected"):
        pair.source.write(tid, [1, 2], pair.target.descriptor([3, 4]), timeout_s=5.0).wait(5.0)
    with pytest.raises(KVTransferError, match="not the ones expected"):
        target.wait(5.0)
    assert torch.equal(pair.target_kv.data, before)


def test_a_transfer_nobody_expects_is_refused_and_writes_nothing(pair):
    before = pair.refill(seed=17)
    with pytest.raises(KVTransferError, match="expects no transfer"):
        pair.source.write(new_id(), [1], pair.target.descriptor([2]), timeout_s=0.5).wait(5.0)
    assert torch.equal(pair.target_kv.data, before)


def test_a_source_that_dies_mid_payload_fails_the_target_at_once(pair):
    tid = new_id()
    target = pair.target.expect(tid, [1, 2], timeout_s=30.0)
    layout = pair.target.descriptor([1, 2]).layout
    nbytes = 2 * KVLayout.from_pb(layout).bytes_per_block
    deadline = time.monotonic() + 5.0
    host, port = pair.target.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        header = pb.KVTransferHeader(token=fleet_token.active().presented().decode(), transfer_id=tid,
                                     layout=layout, block_ids=[1, 2], nbytes=nbytes, timeout_s=30.0)
        tcp._send_frame(sock, header, deadline)
        assert tcp._recv_reply(sock, deadline) == pb.KVTransferReply()
        sock.sendall(bytes(nbytes // 2))
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="peer closed the connection mid-transfer"):
        target.wait(10.0)
    assert time.monotonic() - start < 5.0   # at once, not at the 10 s wait


def test_a_writer_without_the_fleet_token_is_refused_and_claims_nothing(pair):
    """Another local process writing into a worker's reserved blocks: with a wrong token, or none,
    the target refuses it before it touches the expect(), and the fleet's own write still lands."""
    before = pair.refill(seed=23)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=10.0)
    for auth, why in ((FleetAuth(fleet_token.generate()), "wrong fleet token"),
                      (FleetAuth(), "no fleet token presented")):
        intruder = tcp.TcpTransport(new_id("intruder"), auth)
        intruder.register(make_cache(LAYOUT, SOURCE_BLOCKS))
        try:
            with pytest.raises(KVTransferError, match=f"target refused the transfer: unauthenticated: {why}"):
                intruder.write(tid, SRC, pair.target.descriptor(DST), timeout_s=5.0).wait(5.0)
        finally:
            intruder.close()
    assert torch.equal(pair.target_kv.data, before)
    pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=5.0, checksum=True).wait(5.0)
    target.wait(5.0)
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


def test_a_header_with_a_bad_layout_is_refused_and_writes_nothing(pair):
    before = pair.refill(seed=29)
    tid = new_id()
    target = pair.target.expect(tid, [1], timeout_s=5.0)
    layout = pair.target.descriptor([1]).layout
    deadline = time.monotonic() + 5.0
    host, port = pair.target.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        header = pb.KVTransferHeader(token=fleet_token.active().presented().decode(), transfer_id=tid,
                                     layout=pb.KVLayout(dtype="float32"), block_ids=[1],
                                     nbytes=KVLayout.from_pb(layout).bytes_per_block, timeout_s=5.0)
        tcp._send_frame(sock, header, deadline)
        assert "bad header" in tcp._recv_reply(sock, deadline).error
    with pytest.raises(KVTransferError, match="bad header"):
        target.wait(5.0)
    assert torch.equal(pair.target_kv.data, before)


@pytest.mark.parametrize("failure", list(KVFailure))
def test_every_failure_reason_survives_the_reply_frame(failure):
    """The target's reply names why it refused or failed a transfer, typed, for every reason."""
    assert tcp.reply_failure(tcp.reply("why", failure)) == failure
    assert tcp.reply(None, failure) == pb.KVTransferReply()           # no error: no failure


def test_a_receiver_binds_the_host_its_worker_gives_and_its_descriptors_name_it():
    """A worker on a Ray node or in a pod gives its node's address. An address this machine does
    not have fails the bind (so the given host is the one bound; nothing listens anywhere), and
    with the worker's 127.0.0.1 the descriptors name the listener a source then reaches."""
    elsewhere = make_transport("tcp", new_id("target"), host="203.0.113.7")   # TEST-NET-3
    with pytest.raises(OSError):
        elsewhere.register(make_cache(LAYOUT, 24))
    elsewhere.close()
    target = make_transport("tcp", new_id("target"), host="127.0.0.1")
    source = tcp.TcpTransport(new_id("source"))
    source_kv, target_kv = make_cache(LAYOUT, SOURCE_BLOCKS), make_cache(LAYOUT, 24)
    try:
        source.register(source_kv)
        target.register(target_kv)
        assert target.address == "127.0.0.1:{}".format(target._listener.getsockname()[1])
        assert target.descriptor(DST).address == target.address
        torch.manual_seed(5)
        source_kv.data.copy_(torch.randn_like(source_kv.data))
        before = target_kv.data.clone()
        tid = new_id()
        landed = target.expect(tid, DST, timeout_s=5.0)
        source.write(tid, SRC, target.descriptor(DST), timeout_s=5.0, checksum=True).wait(5.0)
        landed.wait(5.0)
        assert torch.equal(target_kv.data, expected_target(before, source_kv.data, SRC, DST))
    finally:
        source.close()
        target.close()
