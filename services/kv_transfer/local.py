"""local backend: source and target pools live in the same process (tests, co-located workers).

A process-wide registry maps worker_id -> the transport that registered that worker's pool. write() hands the
target a _Write: copied on the spot when the target expects the id, else parked until its expect() (or until
the writer's deadline drops it), so no block is written that the target has not reserved for that id. The
copy is one copy_ per block of the strided view data[:, :, block] (every layer, K and V), each under both
handles' writing() guard, so finish() on either side stops it between blocks; the hand-off is passed as is.
(per-block copy_ rather than KVCache.read_blocks' index_select: docs/benchmarks.md, "Where the figures in code went".)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer.base import (Completion, KVFailure, KVLayout, KVTransferError, PoolTransport,
                                       blocks_checksum, check_block_ids, check_write,
                                       copy_block, make_descriptor)

_REGISTRY: dict[str, LocalTransport] = {}  # worker_id -> its transport, this process only
_REGISTRY_LOCK = threading.Lock()


@dataclass
class _Write:
    transfer_id: str
    source: object              # the source pool's data (a torch tensor or a numpy array)
    src: list[int]
    dst: list[int]
    crc: int | None
    hand_off: pb.HandOff | None
    handle: Completion          # the writer's


class LocalTransport(PoolTransport):
    name = "local"
    receiver_stops_writes = True

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self._lock = threading.Lock()  # makes "expected yet? else park" and expect() atomic
        self._parked: dict[str, _Write] = {}

    def register(self, kv_cache) -> None:
        with _REGISTRY_LOCK:
            if self._kv is not None or self.worker_id in _REGISTRY:
                raise ValueError(f"worker {self.worker_id!r} already registered a pool in this process")
            self._kv, self._layout = kv_cache, KVLayout.of(kv_cache)
            _REGISTRY[self.worker_id] = self

    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor:
        return make_descriptor(self.worker_id, self.name, self._layout, self._target_ids(block_ids),
                               address=f"local:{self.worker_id}")

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> Completion:
        with self._lock:
            handle = super().expect(transfer_id, block_ids, timeout_s)
            parked = self._parked.pop(transfer_id, None)
        if parked is not None:
            self._copy(parked, self._target_ids(block_ids), handle)
        return handle

    def write(self, transfer_id: str, src_block_ids: Sequence[int], target: pb.KVDescriptor,
              timeout_s: float, checksum: bool = False, hand_off: pb.HandOff | None = None) -> Completion:
        src = check_write(self.name, self._layout, self._pool().num_blocks, transfer_id,
                          src_block_ids, target)
        handle = Completion(f"local write {transfer_id!r} to {target.worker_id}", timeout_s)
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get(target.worker_id)
        if peer is None:
            handle.finish(f"{handle.what}: no worker {target.worker_id!r} registered in this process",
                          failure=KVFailure.PEER_GONE)
            return handle
        crc = blocks_checksum(self._kv.data, src) if checksum else None
        peer._receive(_Write(transfer_id, self._kv.data, src, list(target.block_ids), crc, hand_off, handle))
        return handle

    def close(self) -> None:
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.worker_id) is self:
                del _REGISTRY[self.worker_id]
        with self._lock:
            parked, self._parked = list(self._parked.values()), {}
        for write in parked:
            write.handle.finish(f"{write.handle.what}: target transport closed", failure=KVFailure.CLOSED)
        self._inbox.close()

    # ---- target side -------------------------------------------------------------------------------------

    def _receive(self, write: _Write) -> None:
        """Check the write against this pool, then copy it now (expected) or park it until its expect()."""
        error, failure = self._refusal(write)
        if error is not None:
            self._fail(write, error, failure)  # the target hears it too
            return
        with self._lock:
            expected = self._inbox.lookup(write.transfer_id)
            if expected is None:
                self._parked = {t: w for t, w in self._parked.items() if not w.handle.done()}
                self._parked[write.transfer_id] = write
                return
        self._copy(write, *expected)

    def _refusal(self, write: _Write) -> tuple[str | None, KVFailure]:
        mine, source = self._kv.data, write.source
        try:
            check_block_ids(write.dst, self._pool().num_blocks, "target")
        except KVTransferError as e:
            return str(e), KVFailure.REFUSED
        if (*source.shape[:2], *source.shape[3:], source.dtype) != (*mine.shape[:2], *mine.shape[3:], mine.dtype):
            return f"layout mismatch: target is {self._layout}", KVFailure.LAYOUT_MISMATCH
        return None, KVFailure.OTHER

    def _fail(self, write: _Write, error: str, failure: KVFailure) -> None:
        """Both sides hear it: the target's expect() (or its early outcome) and the writer's handle."""
        self._inbox.finish(write.transfer_id, error, failure=failure)
        write.handle.finish(f"{write.handle.what}: {error}", failure=failure)

    def _copy(self, write: _Write, expected: list[int], target: Completion) -> None:
        """Source blocks src[i] -> this pool's dst[i], every layer, K and V; block by block, each while both
        handles are still open (target first, then source: the one lock order)."""
        if write.dst != expected:
            error = f"blocks {write.dst} are not the ones expected for {write.transfer_id!r}: {expected}"
            self._fail(write, error, KVFailure.REFUSED)
            return
        mine = self._kv.data
        for s, d in zip(write.src, write.dst):
            with target.writing() as target_open, write.handle.writing() as source_open:
                if target_open and source_open:
                    copy_block(mine, d, write.source, s)
                    continue
            if not target_open:
                self._fail(write, "the target finished the transfer before it landed", KVFailure.REFUSED)
            else:
                self._fail(write, "the writer's deadline passed before it landed", KVFailure.TIMEOUT)
            return
        self._inbox.finish(write.transfer_id, checksum=write.crc, hand_off=write.hand_off)
        write.handle.finish()
