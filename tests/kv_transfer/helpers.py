"""Shared by the kv_transfer tests: a small layout, two pools with their transports, the expected result."""
from __future__ import annotations

import uuid

import torch

from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout
from services.kv_transfer.peer import fill_random, make_cache

LAYOUT = KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype="float32")  # 256-byte regions
SOURCE_BLOCKS, TARGET_BLOCKS = 16, 24
# Non-contiguous and shuffled on both sides, with runs that do not line up (2,3,4 -> 7,8,1): exercises the
# tcp backend's run merging and the nixl region indexing.
SRC = [9, 2, 3, 4, 14, 0]
DST = [20, 7, 8, 1, 16, 12]


def new_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def expected_target(before: torch.Tensor, source: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """The target pool after a correct transfer: before, with dst[i] replaced by source's src[i]."""
    after = before.clone()
    after[:, :, dst] = source[:, :, src]
    return after


class Pair:
    """A source and a target transport of one backend in this process, each with its own pool."""

    def __init__(self, backend: str, layout: KVLayout = LAYOUT, staged: bool = False):
        """staged (tcp): both ends move blocks through host staging, as for a CUDA pool."""
        self.backend = backend
        self.source_kv, self.target_kv = make_cache(layout, SOURCE_BLOCKS), make_cache(layout, TARGET_BLOCKS)
        self.source, self.target = (self._tcp_staged(new_id("source")), self._tcp_staged(new_id("target"))) \
            if staged else (make_transport(backend, new_id("source")), make_transport(backend, new_id("target")))
        self.source.register(self.source_kv)
        self.target.register(self.target_kv)

    @staticmethod
    def _tcp_staged(worker_id: str):
        from services.kv_transfer.tcp import TcpTransport
        return TcpTransport(worker_id, staged=True)

    def refill(self, seed: int) -> torch.Tensor:
        """Random values in both pools; -> a copy of the target pool before any transfer."""
        fill_random(self.source_kv, seed)
        fill_random(self.target_kv, seed + 1)
        return self.target_kv.data.clone()

    def close(self) -> None:
        self.source.close()
        self.target.close()
