"""A KV transport at a modelled speed, for the simulated engine core (docs/engine.md, "Simulated
engine"): the real backend (tcp, nixl, local) moves the simulated cache's small blocks, and each
write starts only once the modelled time for the REAL bytes has passed:

    delay = transfer_s(prompt tokens)     (the target's KV bytes over --sim-network-gbps:
                                           services/engine/sim_engine.py transfer_timer)

so both ends see the transfer complete no earlier than its start + the modelled time (the source
holds its blocks, the target's reservation waits, as they would for the real bytes). Prompt tokens:
the HandOff's num_prompt_tokens, else the blocks written x block size. Everything else (register,
descriptor, expect, ownership, timeouts) is the wrapped backend's.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from services.kv_transfer.base import Completion, KVFailure, KVTransport, KVTransferError
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


class PacedTransport:
    def __init__(self, inner: KVTransport, transfer_s: Callable[[int], float]) -> None:
        self.inner = inner
        self.transfer_s = transfer_s
        self._timers: set[threading.Timer] = set()
        self._lock = threading.Lock()
        self._block_size = 0

    def __getattr__(self, name: str):        # address, receiver_stops_writes, backend, ...
        return getattr(self.inner, name)

    def register(self, kv_cache) -> None:
        self._block_size = kv_cache.block_size
        self.inner.register(kv_cache)

    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor:
        return self.inner.descriptor(block_ids)

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float):
        return self.inner.expect(transfer_id, block_ids, timeout_s)

    def write(self, transfer_id: str, src_block_ids: Sequence[int], target: pb.KVDescriptor,
              timeout_s: float, checksum: bool = False, hand_off: pb.HandOff | None = None):
        tokens = (hand_off.num_prompt_tokens if hand_off is not None and hand_off.num_prompt_tokens
                  else len(src_block_ids) * self._block_size)
        delay = self.transfer_s(tokens)
        outer = Completion(f"KV write {transfer_id}", timeout_s)
        args = (transfer_id, list(src_block_ids), target)

        def start() -> None:
            with self._lock:
                self._timers.discard(timer)
            if outer.done():                 # timed out (or closed) while waiting: write nothing
                return
            try:
                inner = self.inner.write(*args, max(0.001, outer.deadline - time.monotonic()),
                                         checksum=checksum, hand_off=hand_off)
            except Exception as e:  # noqa: BLE001 - reported on the handle, as the backends do
                failure = e.failure if isinstance(e, KVTransferError) else KVFailure.OTHER
                outer.finish(f"KV write {transfer_id}: {type(e).__name__}: {e}", failure=failure)
                return
            outer.on_wait = getattr(inner, "on_wait", None)
            inner.add_done_callback(lambda: outer.finish(inner.error, inner.hand_off, inner.failure))

        timer = threading.Timer(delay, start)
        timer.daemon = True
        with self._lock:
            self._timers.add(timer)
        timer.start()
        return outer

    def close(self) -> None:
        with self._lock:
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()
        self.inner.close()

