"""tcp and nixl across two real processes: the target (decode side) runs in a spawned child with its own pool,
gets its descriptor to us through a Pipe (standing in for gRPC), and reports back what landed."""
from __future__ import annotations

import time

import pytest
import torch

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer import KVTransferError, make_transport
from services.kv_transfer.peer import TargetProcess, fill_random, make_cache, pool_from_bytes
from tests.kv_transfer.helpers import DST, LAYOUT, SOURCE_BLOCKS, SRC, TARGET_BLOCKS, expected_target, new_id

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def source(request):
    """The source (prefill side) in this process: (transport, its pool)."""
    kv = make_cache(LAYOUT, SOURCE_BLOCKS)
    transport = make_transport(request.param, new_id("prefill"))
    transport.register(kv)
    yield transport, kv
    transport.close()


@pytest.fixture(scope="module")
def target(source):
    with TargetProcess(source[0].name, LAYOUT, TARGET_BLOCKS, worker_id=new_id("decode")) as target:
        yield target


def transfer(target: TargetProcess, source, src: list[int], dst: list[int]) -> None:
    """One transfer the way the workers do it: descriptor, expect on the target, write with the first token,
    both handles done, the first token in the target's hands."""
    transport, _ = source
    tid = new_id()
    hand_off = pb.HandOff(request_id=tid, first_token=len(src), num_prompt_tokens=4 * len(src))
    descriptor = target.descriptor(dst)
    assert target.call("expect", tid, dst, 10.0) == "ok"
    transport.write(tid, src, descriptor, timeout_s=10.0, checksum=True, hand_off=hand_off).wait(10.0)
    status, detail = target.call("wait", tid, 10.0)
    assert (status, pb.HandOff.FromString(detail)) == ("ok", hand_off)


def target_pool(target: TargetProcess) -> torch.Tensor:
    return pool_from_bytes(target.call("pool"), LAYOUT, TARGET_BLOCKS)


def test_shuffled_blocks_arrive_bit_exact_in_the_other_process(source, target):
    fill_random(source[1], seed=21)
    target.call("fill", 22)
    before = target_pool(target)
    transfer(target, source, SRC, DST)
    assert torch.equal(target_pool(target), expected_target(before, source[1].data, SRC, DST))


def test_a_killed_target_fails_the_write_at_once_and_the_source_carries_on(source, target):
    with TargetProcess(source[0].name, LAYOUT, TARGET_BLOCKS, worker_id=new_id("doomed")) as doomed:
        transfer(doomed, source, [1, 2], [3, 4])  # connected first: the peer is known and cached
        descriptor = doomed.descriptor([5, 6])
        doomed.kill()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="peer gone"):
        source[0].write(new_id(), [1, 2], descriptor, timeout_s=30.0).wait(30.0)
    assert time.monotonic() - start < 10.0  # at once, not at the 30 s timeout
    transfer(target, source, [7], [9])  # other peers are unaffected


def test_a_target_killed_before_any_transfer_fails_the_write_at_once(source):
    with TargetProcess(source[0].name, LAYOUT, TARGET_BLOCKS, worker_id=new_id("doomed")) as doomed:
        descriptor = doomed.descriptor([5, 6])
        doomed.kill()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="peer gone|cannot reach"):
        source[0].write(new_id(), [1, 2], descriptor, timeout_s=30.0).wait(30.0)
    assert time.monotonic() - start < 10.0  # at once, not at the 30 s timeout
