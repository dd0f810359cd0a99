"""What the decode worker relies on to reuse a reservation's blocks: once its expect() handle is done (landed,
failed, timed out, or finished by the worker itself), no byte of that transfer is written into its pool
afterwards. tcp and local copy on the receiver's side and stop (receiver_stops_writes); nixl's one-sided
writes cannot be stopped by the receiver, and say so."""
from __future__ import annotations

import pytest
import torch

from services.kv_transfer import KVTransferError, tcp
from tests.kv_transfer.helpers import DST, LAYOUT, SRC, Pair, expected_target, new_id

STOPPING = ["tcp", "local"]


@pytest.fixture(params=STOPPING)
def pair(request):
    pair = Pair(request.param)
    yield pair
    pair.close()


def wire_bytes(data: torch.Tensor, block_ids: list[int]) -> bytes:
    """The blocks' bytes in wire order (base.py): layer, K/V, then the blocks as listed."""
    return b"".join(data[layer, kv, b].numpy().tobytes()
                    for layer in range(data.shape[0]) for kv in (0, 1) for b in block_ids)


def test_who_stops_writes_is_part_of_each_backend():
    for backend, stops in (("tcp", True), ("local", True), ("nixl", False)):
        pair = Pair(backend)
        try:
            assert pair.target.receiver_stops_writes is stops
        finally:
            pair.close()


def test_tcp_a_receiver_that_finishes_mid_transfer_gets_no_later_chunk(monkeypatch):
    """Chunks of one region: the decode worker gives up after two have landed; the rest of the payload is
    still on the wire, and none of it reaches the pool."""
    pair = Pair("tcp")
    try:
        before = pair.refill(seed=31)
        monkeypatch.setattr(tcp, "RECV_CHUNK", LAYOUT.region_bytes)
        landed = [0]
        receive = tcp._recv_guarded

        def give_up_after_two_regions(sock, batch, deadline, guard):
            got = receive(sock, batch, deadline, guard)
            landed[0] += got
            if landed[0] >= 2 * LAYOUT.region_bytes:
                guard.finish("the decode worker gave up")
            return got

        monkeypatch.setattr(tcp, "_recv_guarded", give_up_after_two_regions)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        source = pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0)
        with pytest.raises(KVTransferError):  # the target dropped the connection
            source.wait(10.0)
        with pytest.raises(KVTransferError, match="the decode worker gave up"):
            target.wait(1.0)
        cut = landed[0]
        sent, old = wire_bytes(pair.source_kv.data, SRC), wire_bytes(before, DST)
        assert 0 < cut < len(sent)
        assert wire_bytes(pair.target_kv.data, DST) == sent[:cut] + old[cut:]
        others = [b for b in range(before.shape[2]) if b not in DST]
        assert torch.equal(pair.target_kv.data[:, :, others], before[:, :, others])
    finally:
        pair.close()


def finish_before_the_third_block(target) -> None:
    """The receiver gives up (finishes its handle) as it is about to write its third block."""
    writing, entered = target.writing, [0]

    def gated():
        entered[0] += 1
        if entered[0] == 3:
            target.finish("the decode worker gave up")
        return writing()

    target.writing = gated


def test_tcp_staged_a_receiver_that_finishes_mid_commit_gets_no_later_block(monkeypatch):
    """A device pool is received into staging, then written into the pool a block at a time (here: a CPU pool
    taking that path); the decode worker gives up before the third."""
    pair = Pair("tcp", staged=True)
    try:
        before = pair.refill(seed=47)
        monkeypatch.setattr(tcp, "RECV_CHUNK", LAYOUT.bytes_per_block)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        finish_before_the_third_block(target)
        with pytest.raises(KVTransferError):
            pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0).wait(10.0)
        with pytest.raises(KVTransferError, match="the decode worker gave up"):
            target.wait(1.0)
        after = pair.target_kv.data
        assert torch.equal(after[:, :, DST[:2]], pair.source_kv.data[:, :, SRC[:2]])
        assert torch.equal(after[:, :, DST[2:]], before[:, :, DST[2:]])
    finally:
        pair.close()


def test_local_a_receiver_that_finishes_mid_transfer_gets_no_later_block():
    pair = Pair("local")
    try:
        before = pair.refill(seed=37)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        finish_before_the_third_block(target)
        with pytest.raises(KVTransferError, match="the target finished the transfer before it landed"):
            pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0).wait(10.0)
        after = pair.target_kv.data
        assert torch.equal(after[:, :, DST[:2]], pair.source_kv.data[:, :, SRC[:2]])
        assert torch.equal(after[:, :, DST[2:]], before[:, :, DST[2:]])
    finally:
        pair.close()


@pytest.mark.parametrize("how", ["finished", "timed out"])
def test_a_write_that_comes_after_the_handle_is_done_writes_nothing(pair, how):
    before = pair.refill(seed=41)
    tid = new_id()
    target = pair.target.expect(tid, DST, timeout_s=0.2 if how == "timed out" else 10.0)
    if how == "finished":
        target.finish("the decode worker gave up")
    else:
        with pytest.raises(KVTransferError, match="timed out"):
            target.wait(5.0)
    source = pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=1.0)
    with pytest.raises(KVTransferError):
        source.wait(5.0)
    assert torch.equal(pair.target_kv.data, before)


def test_a_write_past_its_own_deadline_does_not_land_when_the_expect_comes():
    """local parks a write that came first; if the writer's deadline passes before the expect(), the parked
    write is dropped, not copied into blocks the target has since reserved for it."""
    pair = Pair("local")
    try:
        before = pair.refill(seed=43)
        tid = new_id()
        source = pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=0.1)
        with pytest.raises(KVTransferError, match="timed out"):
            source.wait(5.0)
        target = pair.target.expect(tid, DST, timeout_s=5.0)
        with pytest.raises(KVTransferError, match="the writer's deadline passed"):
            target.wait(5.0)
        assert torch.equal(pair.target_kv.data, before)
    finally:
        pair.close()


def test_tcp_staged_both_ends_land_the_blocks_in_order():
    """A device pool's path (here on CPU pools): the source gathers its blocks into host staging,
    the target receives into staging and writes its blocks from it; the result is the in-place
    path's."""
    pair = Pair("tcp", staged=True)
    try:
        assert pair.source._flat is None and pair.target._flat is None
        before = pair.refill(seed=53)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True).wait(10.0)
        target.wait(1.0)
        assert torch.equal(pair.target_kv.data, expected_target(before, pair.source_kv.data, SRC, DST))
    finally:
        pair.close()


def test_host_staging_is_pinned_exactly_for_a_cuda_pool():
    from services.kv_transfer.base import host_staging, staging_is_pinned
    assert staging_is_pinned(torch.device("cuda", 0))
    assert not staging_is_pinned(torch.device("cpu"))
    pool = torch.zeros(3, 2, 5, 4, 2, 8, dtype=torch.bfloat16)
    staged = host_staging(pool, 2)
    assert staged.shape == (3, 2, 2, 4, 2, 8) and staged.dtype == torch.bfloat16
    assert not staged.is_pinned()
