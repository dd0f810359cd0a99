"""A simulated engine core's KV pool is a numpy array (services/engine/kv_array.py), not a torch
tensor: every backend moves its blocks bit-exact, checksum included, as it moves a tensor pool's,
and ArrayKVCache's block API behaves as KVCache's."""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.kv_array import ArrayKVCache, kv_bytes_per_token
from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout
from services.kv_transfer.tcp import TcpTransport
from tests.kv_transfer.helpers import DST, SOURCE_BLOCKS, SRC, TARGET_BLOCKS, new_id


class Shape:           # the fields of a model config a cache reads
    num_layers, num_kv_heads, head_dim = 2, 1, 2


def random_cache(num_blocks: int, seed: int) -> ArrayKVCache:
    cache = ArrayKVCache(Shape, num_blocks, block_size=4)
    cache.data[...] = np.random.default_rng(seed).standard_normal(cache.data.shape)
    return cache


def transport(backend: str, worker_id: str):
    return TcpTransport(worker_id, staged=True) if backend == "tcp-staged" \
        else make_transport(backend, worker_id)


@pytest.mark.parametrize("backend", ["local", "tcp", "tcp-staged", "nixl"])
def test_a_numpy_pools_blocks_arrive_bit_exact_on_every_backend(backend):
    source_kv, target_kv = random_cache(SOURCE_BLOCKS, 1), random_cache(TARGET_BLOCKS, 2)
    source, target = transport(backend, new_id("source")), transport(backend, new_id("target"))
    try:
        source.register(source_kv)
        target.register(target_kv)
        expected = target_kv.data.copy()
        expected[:, :, DST] = source_kv.data[:, :, SRC]
        tid = new_id()
        landed = target.expect(tid, DST, timeout_s=10.0)
        source.write(tid, SRC, target.descriptor(DST), timeout_s=10.0, checksum=True).wait(10.0)
        landed.wait(10.0)
        assert landed.done() and landed.error is None
        assert np.array_equal(target_kv.data, expected)
    finally:
        source.close()
        target.close()


def test_an_array_caches_layout_is_the_one_a_transfer_names():
    cache = ArrayKVCache(Shape, 5, block_size=4)
    assert KVLayout.of(cache) == KVLayout(2, 4, 1, 2, "float16")
    assert cache.bytes_per_block == 4 * kv_bytes_per_token(Shape, "float16") == KVLayout.of(cache).bytes_per_block


def test_read_then_write_round_trips_and_bad_input_is_refused():
    src, dst = random_cache(6, 3), ArrayKVCache(Shape, 9, block_size=4)
    blocks = src.read_blocks([5, 0, 2])
    dst.write_blocks([8, 1, 3], blocks)
    assert np.array_equal(dst.read_blocks([8, 1, 3]), blocks)
    assert not dst.read_blocks([0, 2, 4, 5, 6, 7]).any()
    blocks[...] = 0                                        # read_blocks returned a copy
    assert src.read_blocks([5]).any()
    with pytest.raises(ValueError, match="distinct"):
        dst.write_blocks([1, 1, 2], dst.read_blocks([0, 1, 2]))
    with pytest.raises(ValueError, match="shape"):
        dst.write_blocks([1], dst.read_blocks([0, 1]))
    with pytest.raises(ValueError, match="dtype"):
        dst.write_blocks([0], dst.read_blocks([0]).astype(np.float32))
    with pytest.raises(ValueError, match="block ids"):
        dst.read_blocks([9])
    with pytest.raises(ValueError, match="num_blocks"):
        ArrayKVCache(Shape, 0, block_size=4)
