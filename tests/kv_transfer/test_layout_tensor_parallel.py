"""The KV layout names its tensor-parallel size (kv_heads is one rank's), and KV never crosses
tensor-parallel sizes: kvfleet refuses rather than re-shards. A TP > 1 worker serves colocated only."""
from __future__ import annotations

import pytest

from services.kv_transfer import KVLayout, KVTransferError
from services.kv_transfer.base import layout_mismatch
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.worker.config import WorkerConfig
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


def test_a_disaggregated_worker_with_tensor_parallel_2_is_refused_at_start():
    assert WorkerConfig("m", "mixed", tensor_parallel_size=2).tensor_parallel_size == 2
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=rf"a {role} worker cannot run tensor parallel size 2.*"
                                             "serve TP > 1 as role mixed"):
            WorkerConfig("w", role, tensor_parallel_size=2)
