"""Every backend, source and target in this process: bytes arrive exactly where the descriptor says.

The nixl pair here is two agents in one process talking over UCX, the tcp pair talks over 127.0.0.1; the
two-process versions are in test_two_processes.py.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer import KVLayout, KVTransferError, wait_done
from services.kv_transfer.base import KVFailure
from tests.kv_transfer.helpers import DST, SRC, Pair, expected_target, new_id

BACKENDS = ["local", "tcp", "nixl"]


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    pair = Pair(request.param)
    yield pair
    pair.close()


def test_shuffled_blocks_arrive_bit_exact_and_no_other_block_changes(pair):
    before = pair.refill(seed=1)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=10.0)
    source = pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True)
    source.wait(10.0)
    target.wait(10.0)
    assert source.done() and target.done()
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_bf16_blocks_arrive_bit_exact(backend):
    pair = Pair(backend, KVLayout(2, 4, 2, 8, "bfloat16"))
    try:
        before = pair.refill(seed=3)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True).wait(10.0)
        target.wait(10.0)
        assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))
    finally:
        pair.close()


def test_the_first_token_arrives_with_the_kv_and_both_sides_can_await_it(pair):
    """The prefill worker hands the first token over inside the transfer; the decode worker's expect()
    handle has it once done, awaited in asyncio without a thread."""
    before = pair.refill(seed=2)
    tid = new_id()
    hand_off = pb.HandOff(request_id=tid, first_token=42, num_prompt_tokens=23,
                          first_logprob=pb.TokenLogprob(token_id=42, logprob=-0.25))

    async def both():
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        source = pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True,
                                   hand_off=hand_off)
        await asyncio.wait_for(asyncio.gather(wait_done(source), wait_done(target)), 10.0)
        return source, target

    source, target = asyncio.run(both())
    assert target.hand_off == hand_off and source.hand_off is None
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))


def test_a_transfer_without_a_hand_off_lands_with_none(pair):
    tid = new_id()
    target = pair.target.expect(tid, [3], timeout_s=10.0)
    pair.source.write(tid, [4], pair.target.descriptor([3]), timeout_s=10.0).wait(10.0)
    target.wait(10.0)
    assert target.hand_off is None


def test_the_write_may_come_before_the_targets_expect(pair):
    before = pair.refill(seed=5)
    tid = new_id()
    arrived = threading.Event()
    if pair.backend == "tcp":  # the receiver holds the connection until the expect() comes
        claim = pair.target._inbox.claim
        pair.target._inbox.claim = lambda *args: (arrived.set(), claim(*args))[1]
    hand_off = pb.HandOff(request_id=tid, first_token=9)
    source = pair.source.write(tid, SRC[:2], pair.target.descriptor(DST[:2]), timeout_s=10.0, hand_off=hand_off)
    if pair.backend == "tcp":
        assert arrived.wait(10.0)
        del pair.target._inbox.claim
    elif pair.backend == "nixl":
        source.wait(10.0)                    # landed (one-sided) before anyone expected it
    else:
        assert not source.done()             # local: parked until the expect()
    target = pair.target.expect(tid, DST[:2], timeout_s=10.0)
    source.wait(10.0)
    target.wait(10.0)
    assert target.hand_off == hand_off
    assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC[:2], DST[:2]))


def test_a_transfer_that_never_comes_fails_the_target_at_its_deadline(pair):
    target = pair.target.expect(new_id("never"), [1, 2], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out after 0.2s") as failed:
        target.wait(10.0)
    assert time.monotonic() - start < 5.0  # at 0.2 s, not at the 10 s wait
    assert failed.value.failure == target.failure == KVFailure.TIMEOUT   # typed where it failed


def test_an_awaited_transfer_that_never_comes_fails_at_its_deadline(pair):
    target = pair.target.expect(new_id("never"), [1, 2], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out after 0.2s") as failed:
        asyncio.run(asyncio.wait_for(wait_done(target), 10.0))
    assert failed.value.failure == KVFailure.TIMEOUT
    assert time.monotonic() - start < 5.0  # at 0.2 s, not at the 10 s wait


@pytest.mark.parametrize("backend", ["local", "tcp"])  # a nixl target hears only of writes that landed
def test_a_refused_transfer_fails_its_awaiting_target(backend):
    pair = Pair(backend)
    try:
        tid = new_id()
        target = pair.target.expect(tid, [1, 2], timeout_s=10.0)
        descriptor = pair.target.descriptor([1, 5])  # not the blocks the target expects for this id
        source = pair.source.write(tid, [1, 2], descriptor, timeout_s=10.0)
        with pytest.raises(KVTransferError, match="not the ones expected") as failed:
            asyncio.run(asyncio.wait_for(wait_done(target), 10.0))
        assert failed.value.failure == KVFailure.REFUSED
        with pytest.raises(KVTransferError) as refused:       # the writer hears why, typed
            source.wait(10.0)
        assert refused.value.failure == KVFailure.REFUSED
    finally:
        pair.close()


def test_a_short_wait_raises_but_the_transfer_still_completes(pair):
    pair.refill(seed=7)
    tid = new_id()
    target = pair.target.expect(tid, [5], timeout_s=10.0)
    with pytest.raises(KVTransferError, match="still running"):
        target.wait(0.05)
    pair.source.write(tid, [6], pair.target.descriptor([5]), timeout_s=10.0).wait(10.0)
    target.wait(10.0)
    assert torch.equal(pair.target_kv.data[:, :, 5], pair.source_kv.data[:, :, 6])


def test_a_pool_of_another_layout_is_refused_with_both_layouts_named(pair):
    other = Pair(pair.backend, KVLayout(3, 4, 2, 16, "float32"))
    try:
        with pytest.raises(KVTransferError, match="layout mismatch: source .*head_dim=16.*target .*head_dim=8") \
                as refused:
            other.source.write(new_id(), [1], pair.target.descriptor([1]), timeout_s=5.0)
        assert refused.value.failure == KVFailure.LAYOUT_MISMATCH
    finally:
        other.close()


def test_block_lists_that_do_not_fit_are_refused(pair):
    descriptor = pair.target.descriptor([1, 2])
    with pytest.raises(KVTransferError, match="3 source blocks for 2 target blocks"):
        pair.source.write(new_id(), [1, 2, 3], descriptor, timeout_s=5.0)
    with pytest.raises(KVTransferError, match=r"source block ids must lie in \[0, 16\)"):
        pair.source.write(new_id(), [1, 16], descriptor, timeout_s=5.0)
    with pytest.raises(KVTransferError, match=r"target block ids must lie in \[0, 24\)"):
        pair.target.descriptor([24])
    with pytest.raises(KVTransferError, match="distinct"):
        pair.target.expect(new_id(), [3, 3], timeout_s=5.0)
    with pytest.raises(KVTransferError, match="no blocks"):
        pair.source.write(new_id(), [], pair.target.descriptor([]), timeout_s=5.0)
    with pytest.raises(KVTransferError, match="one line"):
        pair.source.write("a\nb", [1, 2], descriptor, timeout_s=5.0)


def test_a_descriptor_of_another_backend_is_refused(pair):
    descriptor = pair.target.descriptor([1])
    descriptor.backend = "tcp" if pair.backend != "tcp" else "nixl"
    with pytest.raises(KVTransferError, match="descriptor is for backend"):
        pair.source.write(new_id(), [1], descriptor, timeout_s=5.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_fails_what_is_pending_and_leaves_no_thread_behind(backend):
    pair = Pair(backend)
    target = pair.target.expect(new_id(), [1], timeout_s=30.0)
    pair.close()
    with pytest.raises(KVTransferError, match="transport closed") as closed:
        target.wait(1.0)
    assert closed.value.failure == KVFailure.CLOSED
    ours = (pair.source.worker_id, pair.target.worker_id)
    assert not [t.name for t in threading.enumerate() if any(w in t.name for w in ours)]


def test_a_nixl_notice_carries_id_crc_and_hand_off_and_garbage_is_not_one():
    from services.kv_transfer.nixl import Notice
    for notice in (Notice("req-1"), Notice("req-ü", crc=0), Notice("r", 123, pb.HandOff(first_token=5))):
        assert Notice.decode(notice.encode()) == notice
    for garbage in (b"", b"req-1\n123", Notice("req-1").encode()[:-1], b"KVN1" + bytes(7) + b"\xff"):
        with pytest.raises(ValueError, match="not a kvfleet notice"):
            Notice.decode(garbage)


def test_a_nixl_descriptor_without_its_target_pool_is_refused():
    pair = Pair("nixl")
    try:
        descriptor = pair.target.descriptor([1])
        descriptor.ClearField("nixl")
        with pytest.raises(KVTransferError, match="no usable nixl target"):
            pair.source.write(new_id(), [1], descriptor, timeout_s=5.0).wait(5.0)
    finally:
        pair.close()
