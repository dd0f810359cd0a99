"""kv_transfer: copy a request's KV blocks from a prefill worker's pool into a decode worker's reserved blocks.

One small interface (base.KVTransport), one file per backend: `nixl` (UCX: cma / shared memory / tcp / RDMA),
`tcp` (plain sockets, on 127.0.0.1 unless its worker opted in to another host) and `local` (same process). The sequence, target = decode worker,
source = prefill worker:

    1. target.register(kv_cache); source.register(kv_cache)          once per process, the whole pool
    2. desc = target.descriptor(reserved_blocks)                      a kvfleet.v1.KVDescriptor
    3. desc travels to the source inside the workers' gRPC (Reserve reply -> PrefillRequest.target)
    4. t = target.expect(request_id, reserved_blocks, timeout_s)      the target starts waiting (and polling)
       s = source.write(request_id, prompt_blocks, desc, timeout_s,   returns at once; the first token (a
                        hand_off=pb.HandOff(...))                     kvfleet.v1.HandOff) travels with the KV
    5. await wait_done(s) on the source, await wait_done(t) on the target (asyncio; or s.wait(...) in a
       thread): both return, or both raise KVTransferError; then t.hand_off is the source's HandOff

expect() may come before or after the bytes arrive. The source must not free or overwrite its blocks until s
is done; the target must not read its blocks until t is done (a failed transfer may leave them half
written). When may the target reuse its blocks: transport.receiver_stops_writes (base.py, Ownership). Both
pools must have the same KVLayout (layers, block size, kv heads, head dim, dtype); their num_blocks may
differ. Byte order and checksums: base.py. See docs/kv_transfer.md.
"""
from __future__ import annotations

from services.kv_transfer.base import KVLayout, KVTransferError, KVTransport, TransferHandle, wait_done

BACKENDS = ("nixl", "tcp", "local")
# What a worker process may serve: `local` moves blocks between pools of one process (tests, the KV
# benchmark), so no two workers could share it.
PROCESS_BACKENDS = ("nixl", "tcp")

__all__ = ["BACKENDS", "PROCESS_BACKENDS", "KVLayout", "KVTransferError", "KVTransport", "TransferHandle", "make_transport",
           "wait_done"]


def make_transport(backend: str, worker_id: str, port: int = 0, host: str = "127.0.0.1") -> KVTransport:
    """A transport for this worker; nixl is imported only when asked for (it loads UCX). `host`,
    `port`: the tcp backend's receiver (port 0: a free one); the others have none of their own."""
    if backend == "local":
        from services.kv_transfer.local import LocalTransport
        return LocalTransport(worker_id)
    if backend == "tcp":
        from services.kv_transfer.tcp import TcpTransport
        return TcpTransport(worker_id, port=port, host=host)
    if backend == "nixl":
        from services.kv_transfer.nixl import NixlTransport
        return NixlTransport(worker_id)
    raise ValueError(f"unknown kv_transfer backend {backend!r}; expected one of {', '.join(BACKENDS)}")
