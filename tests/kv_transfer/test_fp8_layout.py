"""fp8 KV blocks over KV transfer: the layout names "fp8", blocks ship as their bytes (half of bf16's),
and a pool of another dtype is refused, by the source and by a tcp receiver, saying why."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer import KVLayout, KVTransferError, make_transport
from services.kv_transfer.base import layout_mismatch
from services.kv_transfer.peer import make_cache
from tests.kv_transfer.helpers import DST, SRC, Pair, new_id

FP8 = KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype="fp8")
BF16 = dataclasses.replace(FP8, dtype="bfloat16")


def test_an_fp8_pool_has_an_fp8_layout_of_half_the_bytes():
    cache = make_cache(FP8, 5)
    assert cache.data.dtype == torch.float8_e4m3fn
    layout = KVLayout.of(cache)
    assert layout.dtype == "fp8" and layout == FP8
    assert KVLayout.from_pb(pb.KVLayout.FromString(layout.to_pb().SerializeToString())) == layout
    assert layout.bytes_per_block == cache.bytes_per_block == BF16.bytes_per_block // 2 == 3 * 2 * 4 * 2 * 8


@pytest.mark.parametrize("backend", ["local", "tcp"])
def test_fp8_blocks_arrive_bit_exact(backend):
    pair = Pair(backend, FP8)
    try:
        before = pair.refill(seed=5).view(torch.uint8)
        source = pair.source_kv.data.view(torch.uint8)
        tid = new_id()
        target = pair.target.expect(tid, DST, timeout_s=10.0)
        pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=10.0, checksum=True).wait(10.0)
        target.wait(10.0)
        expected = before.clone()
        for s, d in zip(SRC, DST):   # (no float8 index_put on CPU: compare bytes)
            expected[:, :, d] = source[:, :, s]
        assert torch.equal(pair.target_kv.data.view(torch.uint8), expected)
        assert not torch.equal(expected, before)
    finally:
        pair.close()


def test_a_decode_pool_of_another_dtype_is_refused_saying_so():
    why = layout_mismatch(FP8, BF16)
    assert "KV cache dtype differs" in why and "fp8" in why and "bfloat16" in why and "--kv-cache-dtype" in why
    _refused_by_the_source_and_by_the_receiver(
        FP8, BF16, "layout mismatch: KV cache dtype differs: source .prefill. fp8, target .decode. bfloat16")


def test_fp8_pools_stored_with_other_scales_are_refused_saying_so():
    """Blocks stored as k / 0.5 read back with scale 1.0 would be half what they were, silently."""
    halved = dataclasses.replace(FP8, k_scale=0.5, v_scale=0.25)
    assert KVLayout.of(make_cache(halved, 2)) == halved
    assert KVLayout.from_pb(pb.KVLayout.FromString(halved.to_pb().SerializeToString())) == halved
    why = layout_mismatch(halved, FP8)
    assert "fp8 KV scales differ" in why and "k_scale 0.5" in why and "--kv-cache-scales" in why
    _refused_by_the_source_and_by_the_receiver(halved, FP8, "fp8 KV scales differ")


def _refused_by_the_source_and_by_the_receiver(source_layout: KVLayout, target_layout: KVLayout,
                                               match: str) -> None:
    """A tcp write from a `source_layout` pool to a `target_layout` one is refused by the source;
    a descriptor that lies about the target's layout gets past it, and the receiver refuses."""
    source, target = make_cache(source_layout, 8), make_cache(target_layout, 8)
    src, dst = make_transport("tcp", new_id("prefill")), make_transport("tcp", new_id("decode"))
    try:
        src.register(source)
        dst.register(target)
        with pytest.raises(KVTransferError, match=match):
            src.write(new_id(), [1, 2], dst.descriptor([3, 4]), timeout_s=5.0)
        tid, lying = new_id(), dst.descriptor([3, 4])
        lying.layout.CopyFrom(source_layout.to_pb())
        expected = dst.expect(tid, [3, 4], timeout_s=5.0)
        with pytest.raises(KVTransferError, match=match):
            src.write(tid, [1, 2], lying, timeout_s=5.0).wait(5.0)
        with pytest.raises(KVTransferError, match=match):
            expected.wait(5.0)
        assert not target.data.view(torch.uint8).any()   # nothing landed
    finally:
        src.close()
        dst.close()
