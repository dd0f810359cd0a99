"""The KVTransport interface, the pool layout both sides must share, and the pieces every backend uses.

Wire order (every backend, and the checksum): for layer in range(num_layers), for kv in (K, V), for i, block
in enumerate(block_ids): the region data[layer, kv, block], i.e. block_size * kv_heads * head_dim * itemsize
contiguous bytes of KVCache.data [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]. The source's
i-th block lands in the target's i-th block, every layer, K and V; no other target block is touched.

A handle (Completion) is finished once: landed (with the writer's pb.HandOff, if it sent one), failed, timed
out at its deadline, or finish()ed by its owner. Ownership, what the decode worker relies on:

    receiver_stops_writes = True (tcp, local): the receiver copies chunk by chunk, each chunk under the
        expect() handle's lock after checking it is still open (Completion.writing). Once the handle is
        done, by any outcome, no byte of that transfer is written into the pool afterwards: its blocks may
        be reused the moment the handle is done.
    receiver_stops_writes = False (nixl): the writer's one-sided RDMA WRITE lands without the receiver;
        finish() on the receiver cannot stop it. The decode worker holds the blocks until the expect()
        handle is done by landing (the notification follows the data) or by its own deadline, and gives
        the writer a shorter timeout: the writer releases its request (cancels it) at its deadline.
"""
from __future__ import annotations

import asyncio
import enum
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import numpy as np

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.kv_array import kv_dtype_name, kv_itemsize

if TYPE_CHECKING:   # a model's pool is a torch tensor; a simulated core's a numpy array
    import torch

EARLY_TTL_S = 60.0  # how long an outcome that came before its expect() is kept
MAX_ID_BYTES = 1024  # a transfer id, UTF-8


class KVFailure(enum.StrEnum):
    """Why a transfer failed, set where it fails (its value is the failures metric's reason label)."""
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the received bytes differ from the source's
    LAYOUT_MISMATCH = "layout_mismatch"      # the pools' layouts differ: nothing moved
    CLOSED = "closed"                        # this side's transport closed
    TIMEOUT = "timeout"                      # the transfer's own timeout passed
    DEADLINE = "deadline"                    # the reservation's deadline: too late to move, or to land
    PEER_GONE = "peer_gone"                  # the other side is unreachable, or left mid-transfer
    REFUSED = "refused"                      # the target refused it (no such expect(), over, a bad header)
    OTHER = "other"


# Every reason label (the metric's children are made at zero up front, so Prometheus's rate() sees a
# failure's first increment).
FAILURE_REASON_NAMES = tuple(f.value for f in KVFailure)


class KVTransferError(RuntimeError):
    """A transfer failed; `failure` says why (typed), the message says it for people."""

    def __init__(self, message: str, failure: KVFailure = KVFailure.OTHER):
        super().__init__(message)
        self.failure = failure


def checksum_result(checksum: bool, failure: KVFailure | None, landed: bool) -> str | None:
    """What a transfer's checksum said: off (not asked for), ok (landed, checked), mismatch, or
    None (it failed before the checksum was compared)."""
    if not checksum:
        return "off"
    if landed:
        return "ok"
    return "mismatch" if failure == KVFailure.CHECKSUM_MISMATCH else None


@dataclass(frozen=True)
class KVLayout:
    """What one pool's blocks look like. num_blocks is not part of it: pools of any size may exchange blocks.

    tensor_parallel_size N: the ranks the model is sharded over. The pool is then every rank's cache,
    rank-major: num_layers counts N * (model layers) rows, rows [r L, (r + 1) L) are rank r's, and
    kv_heads is one rank's (rank r holds the model's KV heads [r kv_heads, (r + 1) kv_heads):
    `shard`). The wire order above therefore ships rank r's part of each block into the target's
    rank r part: a prefill rank's KV shard lands in the matching decode rank's cache. Pools of
    different tensor-parallel sizes never exchange blocks: kvfleet refuses rather than re-shards
    (layout_mismatch; docs/engine.md, Tensor parallelism)."""
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "fp8" (e4m3fn; shipped as its bytes)
    tensor_parallel_size: int = 1
    # fp8: stored = k / k_scale. Blocks stored with other scales would be read wrong, silently:
    # pools whose scales differ never exchange blocks (layout_mismatch). 1.0 for other dtypes.
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def of(cls, kv_cache, tensor_parallel_size: int | None = None) -> KVLayout:
        """tensor_parallel_size: the cache's own (KVCache.over) unless given."""
        layers, _, _, block_size, kv_heads, head_dim = kv_cache.data.shape
        tp = tensor_parallel_size or getattr(kv_cache, "tensor_parallel_size", 1)
        return cls(layers, block_size, kv_heads, head_dim, kv_dtype_name(kv_cache.data.dtype),
                   tp, float(getattr(kv_cache, "k_scale", 1.0)),
                   float(getattr(kv_cache, "v_scale", 1.0)))

    def to_pb(self) -> pb.KVLayout:
        return pb.KVLayout(num_layers=self.num_layers, block_size=self.block_size, kv_heads=self.kv_heads,
                           head_dim=self.head_dim, dtype=self.dtype,
                           tensor_parallel_size=self.tensor_parallel_size, k_scale=self.k_scale,
                           v_scale=self.v_scale)

    @classmethod
    def from_pb(cls, message: pb.KVLayout) -> KVLayout:
        """-> the layout (tensor_parallel_size 0, i.e. unset, reads as 1); ValueError naming what is wrong
        (a zero size, an unknown dtype)."""
        layout = cls(message.num_layers, message.block_size, message.kv_heads, message.head_dim, message.dtype,
                     message.tensor_parallel_size or 1, message.k_scale or 1.0, message.v_scale or 1.0)
        if min(layout.num_layers, layout.block_size, layout.kv_heads, layout.head_dim) < 1:
            raise ValueError(f"bad KV layout {layout}: every size must be at least 1")
        try:
            kv_itemsize(layout.dtype)
        except ValueError as e:
            raise ValueError(f"bad KV layout {layout}: {e}") from None
        return layout

    def shard(self, rank: int) -> tuple[range, range]:
        """Rank `rank`'s part of the pool: (its layer rows, the model's KV heads it holds)."""
        if not 0 <= rank < self.tensor_parallel_size:
            raise ValueError(f"rank {rank} is not in [0, {self.tensor_parallel_size})")
        layers = self.num_layers // self.tensor_parallel_size
        return (range(rank * layers, (rank + 1) * layers),
                range(rank * self.kv_heads, (rank + 1) * self.kv_heads))

    @property
    def itemsize(self) -> int:
        return kv_itemsize(self.dtype)

    @property
    def region_bytes(self) -> int:
        """One (layer, K or V, block) region: contiguous in KVCache.data."""
        return self.block_size * self.kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """All layers, K and V."""
        return self.num_layers * 2 * self.region_bytes


class TransferHandle(Protocol):
    what: str
    deadline: float               # time.monotonic() at which it fails, if nothing finished it before
    error: str | None
    failure: KVFailure | None     # with error: why, typed
    hand_off: pb.HandOff | None   # an expect() handle that landed: what the writer handed over
    def done(self) -> bool: ...
    def wait(self, timeout_s: float) -> None: ...
    def finish(self, error: str | None = None, hand_off: pb.HandOff | None = None,
               failure: KVFailure = KVFailure.OTHER) -> bool: ...
    def add_done_callback(self, fn: Callable[[], None]) -> None: ...
    def remove_done_callback(self, fn: Callable[[], None]) -> None: ...


class KVTransport(Protocol):
    name: str
    receiver_stops_writes: bool  # see the module docstring: may the target reuse blocks once its handle is done
    def register(self, kv_cache) -> None: ...
    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor: ...
    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> TransferHandle: ...
    def write(self, transfer_id: str, src_block_ids: Sequence[int], target: pb.KVDescriptor,
              timeout_s: float, checksum: bool = False, hand_off: pb.HandOff | None = None) -> TransferHandle: ...
    def close(self) -> None: ...


class Completion:
    """A TransferHandle: finished once, by whoever sees the outcome first (a poller, a socket thread, a timeout,
    its owner). Its deadline is the transfer's (timeout_s from write/expect); wait(t) gives up after t without
    failing it. Callbacks run once, on the thread that finished it; wait_done() awaits it in asyncio.
    """

    def __init__(self, what: str, timeout_s: float):
        self.what = what
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.error: str | None = None
        self.failure: KVFailure | None = None
        self.hand_off: pb.HandOff | None = None
        self.on_wait: Callable[[], None] | None = None   # a backend's hook: someone waits now
        self._callbacks: list[Callable[[], None]] = []
        self._event = threading.Event()
        self._lock = threading.Lock()

    def finish(self, error: str | None = None, hand_off: pb.HandOff | None = None,
               failure: KVFailure = KVFailure.OTHER) -> bool:
        """Record the outcome (error None = success; else `failure` says why) unless one was recorded
        already; -> whether this call did. Waits for a chunk being copied under writing() to end."""
        with self._lock:
            if self._event.is_set():
                return False
            self.error = error
            self.failure = None if error is None else failure
            self.hand_off = hand_off if error is None else None
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()
        return True

    def done(self) -> bool:
        """True once finished, successfully or not (a passed deadline counts as finished: failed)."""
        if not self._event.is_set() and time.monotonic() >= self.deadline:
            self.finish(f"{self.what}: timed out after {self.timeout_s:g}s", failure=KVFailure.TIMEOUT)
        return self._event.is_set()

    def wait(self, timeout_s: float) -> None:
        """Return when it succeeded; raise KVTransferError when it failed, or is still running after timeout_s."""
        if self.on_wait is not None:
            self.on_wait()
        limit = min(timeout_s, self.deadline - time.monotonic())
        if not self._event.wait(max(0.0, limit)) and not self.done():
            raise KVTransferError(f"{self.what}: still running after wait({timeout_s:g}s)", KVFailure.TIMEOUT)
        if self.error is not None:
            raise KVTransferError(self.error, self.failure)

    @contextmanager
    def writing(self) -> Iterator[bool]:
        """A receiver about to copy one chunk into the pool: -> whether it may (not finished, deadline not
        passed). finish() waits for the block to end, so once done() no chunk is being copied, none will be."""
        self.done()  # a passed deadline finishes it first
        with self._lock:
            yield not self._event.is_set() and time.monotonic() < self.deadline

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """fn() once finished: at once (here) if it is already, else on the finishing thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def remove_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._callbacks:
                self._callbacks.remove(fn)


async def wait_done(handle: TransferHandle) -> None:
    """Await a handle in asyncio: return when it succeeded, raise KVTransferError when it failed or its deadline
    passed. No thread waits: the finishing thread wakes the loop (call_soon_threadsafe), and a timer on the
    loop finishes the handle at its deadline (taking its lock: at most one chunk copy's wait)."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()

    def wake() -> None:
        loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))

    if getattr(handle, "on_wait", None) is not None:
        handle.on_wait()
    handle.add_done_callback(wake)
    timer = None

    def expire() -> None:  # the loop's clock may fire a hair early: re-arm until done() agrees
        nonlocal timer
        if not handle.done():
            timer = loop.call_later(max(0.001, handle.deadline - time.monotonic()), expire)

    expire()
    try:
        await woken
    finally:
        if timer is not None:
            timer.cancel()
        handle.remove_done_callback(wake)
    if handle.error is not None:
        raise KVTransferError(handle.error, handle.failure)


class PoolTransport:
    """What every backend shares: the registered pool and its layout, the target-side Inbox, and
    expect() on it. Subclasses register(kv_cache) by setting `_kv` and `_layout`."""

    receiver_stops_writes = True

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._kv = None
        self._layout: KVLayout | None = None
        self._inbox = Inbox(worker_id, lambda ids: blocks_checksum(self._kv.data, ids))

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> Completion:
        return self._inbox.expect(transfer_id, self._target_ids(block_ids), timeout_s)

    def _target_ids(self, block_ids: Sequence[int]) -> list[int]:
        return check_block_ids(block_ids, self._pool().num_blocks, "target")

    def _pool(self):
        if self._kv is None:
            raise KVTransferError(f"worker {self.worker_id!r}: register(kv_cache) first")
        return self._kv


@dataclass
class _Early:
    """An outcome that came before its expect()."""
    at: float
    error: str | None
    checksum: int | None
    hand_off: pb.HandOff | None
    failure: KVFailure


class Inbox:
    """Target-side bookkeeping shared by the backends: the transfers this worker expects, by id.

    A backend reports an outcome with finish(id, error, checksum, hand_off). An outcome for an id not expected
    yet is kept for EARLY_TTL_S and settles the expect() that follows. claim() hands an expected id to exactly
    one incoming connection (tcp), waiting for the expect() if the source was quicker than the target.
    """

    def __init__(self, worker_id: str, checksum_of: Callable[[Sequence[int]], int]):
        self.worker_id = worker_id
        self._checksum_of = checksum_of  # the target's blocks, in wire order
        self._cv = threading.Condition()
        self._expected: dict[str, tuple[list[int], Completion]] = {}
        self._claimed: set[str] = set()
        self._early: dict[str, _Early] = {}
        self._closed = False

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> Completion:
        handle = Completion(f"transfer {transfer_id!r} into {self.worker_id}", timeout_s)
        with self._cv:
            self._prune()
            if transfer_id in self._expected:
                raise KVTransferError(f"transfer {transfer_id!r} is already expected")
            self._expected[transfer_id] = (list(block_ids), handle)
            early = self._early.pop(transfer_id, None)
            self._cv.notify_all()
        if early is not None:
            self.finish(transfer_id, early.error, early.checksum, early.hand_off, early.failure)
        return handle

    def claim(self, transfer_id: str, timeout_s: float) -> tuple[list[int], Completion] | None:
        """-> the expected block ids and handle (once per id), or None when no expect() came within timeout_s."""
        with self._cv:
            ready = self._cv.wait_for(lambda: self._closed or transfer_id in self._expected, max(0.0, timeout_s))
            if not ready or self._closed or transfer_id in self._claimed:
                return None
            self._claimed.add(transfer_id)
            ids, handle = self._expected[transfer_id]
            return list(ids), handle

    def lookup(self, transfer_id: str) -> tuple[list[int], Completion] | None:
        """The block ids and handle of an expected transfer, or None when none is expected (yet, or any more)."""
        with self._cv:
            entry = self._expected.get(transfer_id)
            return (list(entry[0]), entry[1]) if entry else None

    def finish(self, transfer_id: str, error: str | None = None, checksum: int | None = None,
               hand_off: pb.HandOff | None = None, failure: KVFailure = KVFailure.OTHER) -> None:
        with self._cv:
            entry = self._expected.pop(transfer_id, None)
            if entry is None and transfer_id not in self._claimed:  # (a claimed one timed out: drop it)
                self._early[transfer_id] = _Early(time.monotonic(), error, checksum, hand_off, failure)
            self._claimed.discard(transfer_id)
            if entry is None:
                return
        block_ids, handle = entry
        if error is None and checksum is not None and self._checksum_of(block_ids) != checksum:
            error, failure = "checksum mismatch: the received blocks differ from the source's", \
                KVFailure.CHECKSUM_MISMATCH
        handle.finish(error if error is None else f"{handle.what}: {error}", hand_off, failure)

    def still_expected(self, transfer_ids: set[str]) -> set[str]:
        """Those of `transfer_ids` that are expected and have not landed (nor timed out) yet."""
        with self._cv:
            self._prune()
            return {t for t in transfer_ids if t in self._expected}

    def close(self) -> None:
        with self._cv:
            entries, self._expected, self._closed = list(self._expected.values()), {}, True
            self._cv.notify_all()  # a claim() waiting for an expect() gives up
        for _, handle in entries:
            handle.finish(f"{handle.what}: transport closed", failure=KVFailure.CLOSED)

    def _prune(self) -> None:
        """Drop expects that are done (timed out, or finished by their owner) and early outcomes nobody asked for."""
        for tid in [t for t, (_, h) in self._expected.items() if h.done()]:
            del self._expected[tid]  # stays in _claimed until its connection finishes
        now = time.monotonic()
        for tid in [t for t, early in self._early.items() if now - early.at > EARLY_TTL_S]:
            del self._early[tid]


def check_block_ids(block_ids: Sequence[int], num_blocks: int, who: str) -> list[int]:
    ids = [int(b) for b in block_ids]
    if any(b < 0 or b >= num_blocks for b in ids):
        raise KVTransferError(f"{who} block ids must lie in [0, {num_blocks}): {ids}")
    if len(set(ids)) != len(ids):
        raise KVTransferError(f"{who} block ids must be distinct: {ids}")
    return ids


def layout_of(target: pb.KVDescriptor) -> KVLayout:
    """The descriptor's layout; KVTransferError when it has none, or a bad one."""
    if not target.HasField("layout"):
        raise KVTransferError(f"descriptor from {target.worker_id!r} carries no layout")
    try:
        return KVLayout.from_pb(target.layout)
    except ValueError as e:
        raise KVTransferError(str(e)) from None


def layout_mismatch(source: KVLayout, target: KVLayout) -> str | None:
    """Why the source's blocks cannot land in the target's pool, or None when the layouts match."""
    if source == target:
        return None
    s, t = source, target
    if s.tensor_parallel_size != t.tensor_parallel_size:
        return (f"layout mismatch: tensor parallel size differs: source (prefill) has tensor_parallel_size "
                f"{s.tensor_parallel_size} ({s.kv_heads} KV heads per rank), target (decode) has "
                f"tensor_parallel_size {t.tensor_parallel_size} ({t.kv_heads} KV heads per rank); kvfleet "
                "refuses KV across tensor-parallel sizes rather than re-sharding it")
    if s.dtype != t.dtype:
        return (f"layout mismatch: KV cache dtype differs: source (prefill) {s.dtype}, target (decode) "
                f"{t.dtype}; start every worker with the same --kv-cache-dtype (fp8: and --kv-cache-scales)")
    if (s.k_scale, s.v_scale) != (t.k_scale, t.v_scale):
        return (f"layout mismatch: fp8 KV scales differ: source (prefill) k_scale {s.k_scale:g}, v_scale "
                f"{s.v_scale:g}, target (decode) k_scale {t.k_scale:g}, v_scale {t.v_scale:g}; start every "
                "worker with the same --kv-cache-scales")
    return f"layout mismatch: source {source}, target {target}"


def check_write(backend: str, layout: KVLayout, num_blocks: int, transfer_id: str,
                src_block_ids: Sequence[int], target: pb.KVDescriptor) -> list[int]:
    """Source-side checks before anything moves; -> the source ids as ints."""
    if not transfer_id or "\n" in transfer_id or len(transfer_id.encode()) > MAX_ID_BYTES:
        raise KVTransferError(f"transfer id {transfer_id!r} must be non-empty, one line, "
                              f"at most {MAX_ID_BYTES} bytes")
    if not src_block_ids:
        raise KVTransferError("no blocks to transfer")
    if target.backend != backend:
        raise KVTransferError(f"descriptor is for backend {target.backend!r}, this transport is {backend!r}")
    mismatch = layout_mismatch(layout, layout_of(target))
    if mismatch is not None:
        raise KVTransferError(mismatch, KVFailure.LAYOUT_MISMATCH)
    if len(src_block_ids) != len(target.block_ids):
        raise KVTransferError(f"{len(src_block_ids)} source blocks for {len(target.block_ids)} target blocks")
    return check_block_ids(src_block_ids, num_blocks, "source")


def make_descriptor(worker_id: str, backend: str, layout: KVLayout, block_ids: Sequence[int], address: str = "",
                    agent_metadata: bytes = b"", nixl: pb.NixlTarget | None = None) -> pb.KVDescriptor:
    return pb.KVDescriptor(worker_id=worker_id, backend=backend, agent_metadata=agent_metadata, address=address,
                           block_ids=list(block_ids), bytes_per_block=layout.bytes_per_block,
                           layout=layout.to_pb(), nixl=nixl)


def staging_is_pinned(pool_device: torch.device) -> bool:
    """A device pool's host staging is pinned (page-locked): the copy to or from the GPU is one DMA,
    with no bounce through a driver buffer. A CPU pool's staging (a test's) is plain memory."""
    return pool_device.type == "cuda"


def on_host(pool) -> bool:
    """Whether a pool (a torch tensor, or a simulated core's numpy array) is in host memory."""
    return isinstance(pool, np.ndarray) or pool.device.type == "cpu"


def host_staging(pool, num_blocks: int):
    """Host memory for `num_blocks` of `pool` in read_blocks' layout, on their way to or from a
    socket (the tcp backend's device path)."""
    shape = (*pool.shape[:2], num_blocks, *pool.shape[3:])
    if isinstance(pool, np.ndarray):
        return np.empty(shape, dtype=pool.dtype)
    import torch  # noqa: PLC0415 - the pool is a tensor: torch is loaded
    return torch.empty(shape, dtype=pool.dtype, pin_memory=staging_is_pinned(pool.device))


def byte_view(pool) -> memoryview:
    """A flat writable byte view sharing memory with a contiguous CPU tensor (any dtype, bf16
    included) or numpy array."""
    if isinstance(pool, np.ndarray):
        if not pool.flags.c_contiguous:
            raise ValueError("byte_view needs a contiguous array")
        return memoryview(pool.reshape(-1).view(np.uint8))
    if pool.device.type != "cpu" or not pool.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    import torch  # noqa: PLC0415 - the pool is a tensor: torch is loaded
    return memoryview(pool.reshape(-1).view(torch.uint8).numpy())


def blocks_checksum(data, block_ids: Sequence[int]) -> int:
    """crc32 of the blocks' bytes in wire order, region by region (no gathered copy of a CPU pool)."""
    crc = 0
    for layer in range(data.shape[0]):
        for kv in (0, 1):
            plane = data[layer, kv]  # [num_blocks, block_size, kv_heads, head_dim], contiguous
            for block in block_ids:
                region = plane[block]
                crc = zlib.crc32(byte_view(region if on_host(region) else region.cpu()), crc)
    return crc


def copy_into(target, source) -> None:
    """source's values into target's memory (same shape and dtype): torch tensors (a device's
    included) or numpy arrays alike."""
    if isinstance(target, np.ndarray):
        target[...] = source
    else:
        target.copy_(source)


def copy_block(target, dst: int, source, src: int) -> None:
    """Block `src` of the `source` pool into block `dst` of `target` (same layout), every layer,
    K and V."""
    copy_into(target[:, :, dst], source[:, :, src])
