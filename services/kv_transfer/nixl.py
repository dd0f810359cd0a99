"""nixl backend: one-sided RDMA-style WRITEs through NIXL's UCX backend (cma / shared memory / tcp / RDMA).

One agent per process (the name is worker_id plus a random suffix, so a restarted worker is a new peer), its
progress thread OFF (it busy-spins a core) and its listener OFF (it binds 0.0.0.0): metadata travels in the
descriptor instead, over the workers' own gRPC. UCX still listens: its tcp transport opens one socket on lo
(UCX_NET_DEVICES) when the agent starts; `listeners` names it (the worker prints it, `kvfleet up` lists it).
The pool is registered once and prepared as a list of
regions, indexed like KVCache.data itself:

    region r = (layer * 2 + kv) * num_blocks + block     at  base + r * region_bytes,  region_bytes long

so a transfer is one make_prepped_xfer(WRITE) from local regions to the same-position remote regions, in wire
order (base.py), with a Notice as its notification (delivered after the data): the transfer id, the crc32
if asked for, the writer's pb.HandOff, as a serialized kvfleet.v1.KVNotice. The target's pool geometry travels in descriptor.nixl (a kvfleet.v1.NixlTarget).

Ownership (base.py): receiver_stops_writes is False. The WRITE is one-sided: the target's finish() cannot
stop it. The decode worker holds the blocks until its expect() handle is done by landing or by its deadline,
and gives the writer a shorter timeout: the writer's poller releases (cancels) a request still in flight
within a poll of the writer's deadline.

Without a progress thread both sides must keep calling into their agent while a transfer runs (the source
stalls until the target polls). A poller thread owned by the transport does that: every POLL_BUSY_S while a
write is pending or someone waits for an expected transfer (the decode worker's DecodeStream subscription, which comes
once the prefill is done and its write is about to start), every POLL_IDLE_S otherwise (so a write that
beats its wait still lands). Polling fast from expect() on instead would spin through the whole prefill,
taking the GIL 5,000 times a second on a worker that shares the host's cores with the prefill.
It is the only reader of notifications (get_new_notifs drains them). The agent is not thread-safe in this
mode (sync NONE), so every agent call holds self._cv's lock.
"""
from __future__ import annotations

import os

from services.protocol import env  # noqa: E402 - before the libraries it configures

env.UCX_NET_DEVICES.set_default("lo")  # else UCX also advertises the external interface
env.NIXL_LOG_LEVEL.set_default("WARN")  # NIXL's INFO logs go to stdout

import threading  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Sequence  # noqa: E402

import numpy as np  # noqa: E402
from nixl import _bindings  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402

from services.protocol.listeners import listening_sockets  # noqa: E402
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb  # noqa: E402
from services.kv_transfer.base import (Completion, KVFailure, KVLayout, KVTransferError,  # noqa: E402
                                       PoolTransport, blocks_checksum, check_write,
                                       make_descriptor, on_host)

POLL_BUSY_S = 0.0002
POLL_IDLE_S = 0.02
NIXL_ERRORS = tuple(getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error"))


@dataclass(frozen=True)
class Notice:
    """A write's notification, as a kvfleet.v1.KVNotice: which transfer landed, its crc32 (None: not asked
    for), the writer's hand-off."""
    transfer_id: str
    crc: int | None = None
    hand_off: pb.HandOff | None = None

    def encode(self) -> bytes:
        msg = pb.KVNotice(transfer_id=self.transfer_id)
        if self.crc is not None:
            msg.crc32 = self.crc
        if self.hand_off is not None:
            msg.hand_off.CopyFrom(self.hand_off)
        return msg.SerializeToString()

    @classmethod
    def decode(cls, raw: bytes) -> Notice:
        """ValueError when it is not one."""
        try:
            msg = pb.KVNotice.FromString(raw)
        except DecodeError as e:
            raise ValueError(f"not a kvfleet notice: {e}") from None
        if not msg.transfer_id:
            raise ValueError("not a kvfleet notice: no transfer id")
        return cls(msg.transfer_id, msg.crc32 if msg.HasField("crc32") else None,
                   msg.hand_off if msg.HasField("hand_off") else None)


@dataclass
class _Peer:
    name: str
    num_blocks: int
    dlist: object  # nixl_prepped_dlist_handle of the peer's whole pool


@dataclass
class _Sending:
    xfer: object  # nixl_xfer_handle
    handle: Completion
    peer: str


class NixlTransport(PoolTransport):
    name = "nixl"
    receiver_stops_writes = False  # one-sided writes: see the module docstring

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self._agent_name = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        self._cv = threading.Condition()  # its lock guards the agent and everything below
        self._agent = None
        self._peers: dict[str, _Peer] = {}
        self._sending: list[_Sending] = []
        self._closed = False
        self._awaited: set[str] = set()   # expected transfers someone waits for: polled fast
        self._poller: threading.Thread | None = None
        self.listeners: list[str] = []    # host:port UCX listens on for this agent, once registered

    def register(self, kv_cache) -> None:
        if self._kv is not None:
            raise ValueError(f"worker {self.worker_id!r} already registered a pool")
        data = kv_cache.data
        self._kv, self._layout = kv_cache, KVLayout.of(kv_cache)
        self._mem, self._dev = ("DRAM", 0) if on_host(data) else ("VRAM", data.get_device())
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        before = listening_sockets([os.getpid()])
        self._agent = nixl_agent(self._agent_name, config)
        # UCX's tcp transport listens on lo (UCX_NET_DEVICES) for its connections; NIXL's own listener is
        # off. There is no turning UCX's off: without tcp (UCX_TLS=^tcp) the backend does not start.
        self.listeners = sorted(f"{ip}:{port}" for ip, port in listening_sockets([os.getpid()]) - before)
        self._registered = self._agent.register_memory(*_registration(data))
        table = _region_table(_address(data), self._layout, kv_cache.num_blocks, self._dev)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self._mem)
        self._metadata = self._agent.get_agent_metadata()
        self._poller = threading.Thread(target=self._poll_loop, name=f"kv-nixl-{self.worker_id}", daemon=True)
        self._poller.start()

    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor:
        ids = self._target_ids(block_ids)
        target = pb.NixlTarget(agent=self._agent_name, base=_address(self._kv.data),
                               num_blocks=self._kv.num_blocks, mem=self._mem, device=self._dev)
        return make_descriptor(self.worker_id, self.name, self._layout, ids, agent_metadata=self._metadata,
                               nixl=target)

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> Completion:
        handle = super().expect(transfer_id, block_ids, timeout_s)
        handle.on_wait = lambda: self._hurry(transfer_id)
        return handle

    def _hurry(self, transfer_id: str) -> None:
        """Someone waits for an expected transfer: it is about to run (the source writes once its
        prefill is done), so poll fast until it lands or times out."""
        with self._cv:
            self._awaited.add(transfer_id)
            self._cv.notify()

    def write(self, transfer_id: str, src_block_ids: Sequence[int], target: pb.KVDescriptor,
              timeout_s: float, checksum: bool = False, hand_off: pb.HandOff | None = None) -> Completion:
        src = check_write(self.name, self._layout, self._pool().num_blocks, transfer_id,
                          src_block_ids, target)
        handle = Completion(f"nixl write {transfer_id!r} to {target.worker_id}", timeout_s)
        crc = blocks_checksum(self._kv.data, src) if checksum else None
        notif = Notice(transfer_id, crc, hand_off).encode()
        with self._cv:
            peer = xfer = None
            try:
                peer = self._peer(target)
                local = _indices(self._layout, self._kv.num_blocks, src)
                remote = _indices(self._layout, peer.num_blocks, list(target.block_ids))
                xfer = self._agent.make_prepped_xfer("WRITE", self._local, local, peer.dlist, remote, notif)
                if self._agent.transfer(xfer) == "ERR":
                    raise KVTransferError("NIXL refused to post the transfer", KVFailure.REFUSED)
                self._sending.append(_Sending(xfer, handle, peer.name))
            except (KVTransferError, ValueError, *NIXL_ERRORS) as e:
                gone = peer.name if peer and isinstance(e, _bindings.nixlRemoteDisconnectError) else None
                self._settle(xfer, handle, f"{handle.what}: {_describe(e)}", gone, _failure(e))
            self._cv.notify()
        return handle

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._poller:
            self._poller.join(timeout=5.0)
        with self._cv:
            for sending in self._sending:
                self._settle(sending.xfer, sending.handle, f"{sending.handle.what}: transport closed",
                             failure=KVFailure.CLOSED)
            self._sending = []
            if self._agent is not None:
                for peer in list(self._peers.values()):
                    self._forget(peer)
                _quietly(self._local.release)
                _quietly(self._agent.deregister_memory, self._registered)
            self._agent = None  # the agent goes with its last reference
        self._inbox.close()

    # ---- inside the lock ---------------------------------------------------------------------------------

    def _peer(self, target: pb.KVDescriptor) -> _Peer:
        """The target's agent and prepared region list, loaded once per peer."""
        info = _nixl_target(target)
        if info.agent in self._peers:
            return self._peers[info.agent]
        try:
            name = self._agent.add_remote_agent(target.agent_metadata)
        except NIXL_ERRORS as e:  # UCX connects here: a dead or unreachable peer fails now
            raise KVTransferError(f"cannot reach agent {info.agent!r} ({_describe(e)})",
                                  KVFailure.PEER_GONE) from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != info.agent:
            raise KVTransferError(f"descriptor names agent {info.agent!r} but its metadata is {name!r}")
        table = _region_table(info.base, self._layout, info.num_blocks, info.device)
        peer = _Peer(name, info.num_blocks, self._agent.prep_xfer_dlist(name, table, info.mem))
        self._peers[name] = peer
        return peer

    def _poll_loop(self) -> None:
        with self._cv:
            while not self._closed:
                busy = self._poll_once()
                self._cv.wait(POLL_BUSY_S if busy else POLL_IDLE_S)

    def _poll_once(self) -> bool:
        """Advance every write, take in the notifications; -> whether anything is still pending."""
        for sending in list(self._sending):
            try:
                state = self._agent.check_xfer_state(sending.xfer)
                error = "NIXL reported a failed transfer" if state == "ERR" else None
                failure = KVFailure.OTHER
            except NIXL_ERRORS as e:
                state, error, failure = "ERR", _describe(e), _failure(e)
            if state == "PROC" and not sending.handle.done():
                continue
            self._sending.remove(sending)
            self._settle(sending.xfer, sending.handle, error and f"{sending.handle.what}: {error}",
                         sending.peer if error else None, failure)
        try:
            notifs = self._agent.get_new_notifs()
        except NIXL_ERRORS:
            notifs = {}
        for messages in notifs.values():
            for message in messages:
                try:
                    notice = Notice.decode(message)
                except ValueError:
                    continue  # not ours: it names no transfer to fail
                self._inbox.finish(notice.transfer_id, checksum=notice.crc, hand_off=notice.hand_off)
        self._awaited = self._inbox.still_expected(self._awaited)
        return bool(self._sending) or bool(self._awaited)

    def _settle(self, xfer, handle: Completion, error: str | None, failed_peer: str | None = None,
                failure: KVFailure = KVFailure.OTHER) -> None:
        """Finish a write's handle and free its NIXL request; a peer that failed (it may be gone) is dropped
        once no other write to it is in flight, so a restarted or recovered peer is loaded afresh."""
        handle.finish(error, failure=failure)
        if xfer is not None:
            _quietly(xfer.release)  # cancels a request still in flight (timeout)
        if failed_peer in self._peers and not any(s.peer == failed_peer for s in self._sending):
            self._forget(self._peers[failed_peer])

    def _forget(self, peer: _Peer) -> None:
        self._peers.pop(peer.name, None)
        _quietly(peer.dlist.release)
        _quietly(self._agent.remove_remote_agent, peer.name)

def _nixl_target(target: pb.KVDescriptor) -> pb.NixlTarget:
    """The descriptor's target pool; KVTransferError when it has none, or an incomplete one."""
    info = target.nixl
    if not target.HasField("nixl") or not info.agent or not info.num_blocks or info.mem not in ("DRAM", "VRAM"):
        raise KVTransferError(f"descriptor from {target.worker_id!r} has no usable nixl target: {info}")
    return info


def _address(pool) -> int:
    """Where a pool's memory starts: a torch tensor's, or a simulated core's numpy array's."""
    return pool.ctypes.data if isinstance(pool, np.ndarray) else pool.data_ptr()


def _registration(pool) -> tuple:
    """register_memory's arguments for a pool: a tensor as is, a numpy array (host memory) as its
    one (address, bytes, device, meta) region of DRAM."""
    if isinstance(pool, np.ndarray):
        return [(_address(pool), pool.nbytes, 0, "")], "DRAM"
    return (pool,)


def _region_table(base: int, layout: KVLayout, num_blocks: int, dev: int) -> np.ndarray:
    """[(addr, len, dev)] for every (layer, kv, block) region of a pool, in memory order."""
    count = layout.num_layers * 2 * num_blocks
    table = np.empty((count, 3), dtype=np.uint64)
    table[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(layout.region_bytes)
    table[:, 1], table[:, 2] = layout.region_bytes, dev
    return table


def _indices(layout: KVLayout, num_blocks: int, block_ids: list[int]) -> np.ndarray:
    """Region indices of the blocks in wire order: layer, then K/V, then the blocks as listed."""
    rows = np.arange(layout.num_layers * 2, dtype=np.int64)[:, None] * num_blocks
    return (rows + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


def _describe(e: Exception) -> str:
    if isinstance(e, _bindings.nixlRemoteDisconnectError):
        return f"peer gone (NIXL: {e})"
    return f"{type(e).__name__}: {e}"


def _failure(e: Exception) -> KVFailure:
    if isinstance(e, _bindings.nixlRemoteDisconnectError):
        return KVFailure.PEER_GONE
    return e.failure if isinstance(e, KVTransferError) else KVFailure.OTHER


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except (*NIXL_ERRORS, ValueError, RuntimeError):
        pass
