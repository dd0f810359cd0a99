"""The KV layout names its tensor-parallel size (kv_heads is one rank's; a TP N pool holds the N ranks'
caches rank-major, so rank r's part lands in the target's rank r part), and KV never crosses
tensor-parallel sizes: kvfleet refuses rather than re-shards."""
from __future__ import annotations

import pytest

from services.kv_transfer import KVLayout, KVTransferError, make_transport
from services.kv_transfer.base import layout_mismatch
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.model.kv_cache import KVCache
import torch
from tests.kv_transfer.helpers import LAYOUT, Pair, new_id


def test_an_unset_tensor_parallel_size_reads_as_1_and_a_set_one_round_trips():
    old_sender = pb.KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype="float32")
    assert KVLayout.from_pb(old_sender).tensor_parallel_size == 1
    assert KVLayout.from_pb(old_sender) == LAYOUT
    tp2 = KVLayout(3, 4, 1, 8, "float32", tensor_parallel_size=2)
    assert tp2.to_pb().tensor_parallel_size == 2 and KVLayout.from_pb(tp2.to_pb()) == tp2


@pytest.mark.parametrize("backend", ["local", "tcp"])
def test_a_decode_pool_of_another_tensor_parallel_size_is_refused_naming_both(backend):
    pair = Pair(backend)
    try:
        descriptor = pair.target.descriptor([1, 2])
        descriptor.layout.tensor_parallel_size = 2   # same bytes per rank, another sharding
        with pytest.raises(KVTransferError, match=r"tensor_parallel_size 1 .* tensor_parallel_size 2 .*"
                                                  r"refuses .* rather than re-sharding"):
            pair.source.write(new_id(), [3, 4], descriptor, timeout_s=5.0)
    finally:
        pair.close()


def test_layouts_that_differ_only_in_tensor_parallel_size_do_not_match():
    tp2 = KVLayout(3, 4, 2, 8, "float32", tensor_parallel_size=2)
    assert layout_mismatch(LAYOUT, LAYOUT) is None
    assert "source (prefill) has tensor_parallel_size 1" in layout_mismatch(LAYOUT, tp2)
    assert "target (decode) has tensor_parallel_size 1" in layout_mismatch(tp2, LAYOUT)


def test_a_tp2_pool_names_each_rank_its_layer_rows_and_its_kv_heads():
    data = torch.zeros(2 * 3, 2, 5, 4, 1, 8)            # 2 ranks x 3 layers, 1 KV head per rank
    layout = KVLayout.of(KVCache.over(data, tensor_parallel_size=2))
    assert (layout.num_layers, layout.kv_heads, layout.tensor_parallel_size) == (6, 1, 2)
    assert layout.shard(0) == (range(0, 3), range(0, 1))
    assert layout.shard(1) == (range(3, 6), range(1, 2))
    with pytest.raises(ValueError, match="cannot hold 4 tensor-parallel ranks"):
        KVCache.over(data, tensor_parallel_size=4)


def test_a_tp2_transfer_lands_each_ranks_part_in_the_same_ranks_part():
    source, target = make_transport("tcp", new_id("source")), make_transport("tcp", new_id("target"))
    try:
        src, dst = (torch.zeros(2 * 3, 2, 8, 4, 1, 8) for _ in range(2))
        src[3:].fill_(7.0)                             # rank 1's part of every block
        src[:3].fill_(1.0)                             # rank 0's
        source.register(KVCache.over(src, tensor_parallel_size=2))
        target.register(KVCache.over(dst, tensor_parallel_size=2))
        tid = new_id()
        landed = target.expect(tid, [5, 6], timeout_s=10.0)
        source.write(tid, [1, 2], target.descriptor([5, 6]), timeout_s=10.0).wait(10.0)
        landed.wait(10.0)
        assert (dst[:3, :, [5, 6]] == 1.0).all() and (dst[3:, :, [5, 6]] == 7.0).all()
        assert not dst[:, :, [0, 1, 2, 3, 4, 7]].any()
    finally:
        source.close()
        target.close()
