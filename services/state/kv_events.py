"""The prefix-cache events a worker publishes on `{ns}kv-events` (services/state/fleet_state.py) and
the routers' prefix index follows (services/router/prefix_index.py).

One `KVEventBatch` per worker per publish interval: the block hashes its prefix cache stored and
evicted since its previous batch (the tenant-salted hash chain of services/engine/block_pool.py:
the router learns no tokens, and a hash names one tenant's prefix only), or, every few batches and
whenever its change log overflowed, a full snapshot of what it holds. `seq` counts the worker's
batches from 1 within one `epoch` (a random id per worker process): a reader that sees a gap, or a
new epoch, knows it missed changes and treats the worker as holding nothing until its next
snapshot. `stale_after_s`: a reader that hears nothing from the worker for this long treats it as
holding nothing (the worker publishes every interval, changes or not).
"""
from __future__ import annotations

import msgspec

MAX_LEN = 10_000              # batches the stream keeps (all workers together), about


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    worker_id: str
    epoch: str
    seq: int
    block_size: int
    snapshot: bool                # True: `stored` is everything the worker holds
    stored: list[int]
    evicted: list[int]
    stale_after_s: float


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """The batch, or ValueError when the payload is not one."""
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a KV event batch: {e}") from None
    if batch.seq < 1 or batch.block_size < 1 or not batch.stale_after_s > 0:
        raise ValueError(f"KV event batch of {batch.worker_id!r}: seq, block_size and "
                         "stale_after_s must be positive")
    if any(not 0 <= h < 1 << 64 for h in batch.stored) or any(
            not 0 <= h < 1 << 64 for h in batch.evicted):
        raise ValueError(f"KV event batch of {batch.worker_id!r}: a hash is not 64-bit unsigned")
    return batch
