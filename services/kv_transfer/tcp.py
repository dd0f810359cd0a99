"""tcp backend: plain sockets, the payload streamed from pool memory into pool memory.

The target listens on its worker's host (127.0.0.1 unless the worker was started with another --host and
--allow-external-bind: a Ray node's or a pod's address) at <chosen port>, and advertises that host:port as
descriptor.address, so a source on another node connects there; one connection = one transfer. One gate
thread (tcp_gate.py) accepts and reads every header without trusting it: bounded in count, size and time, and
the token checked there; an admitted transfer is received on a bounded pool of threads (TcpReceiverConfig).
The source sends from its own thread, so write() returns at once.

    source -> target  HEADER (kvfleet.v1.KVTransferHeader: token, transfer_id, layout, block_ids, nbytes,
                      crc32, timeout_s, hand_off)
                      target checks the fleet token (else refuses, claiming nothing), claims its
                      expect(id) (waiting for it if need be), checks that it is still open, layout, ids, size
    source <- target  REPLY (kvfleet.v1.KVTransferReply: error empty | why refused)
    source -> target  PAYLOAD in wire order (base.py), recvmsg_into the destination regions
    source <- target  REPLY (error empty | "checksum mismatch ...")
                      target finishes its expect() handle: landed, with the hand-off

Frames are a 4-byte big-endian length + a serialized protobuf message, at most MAX_FRAME bytes (a header: the
config's max_header_bytes); the payload's size is checked against the expect()'s blocks before a byte of it is
read. A CPU pool is sent and received in place: each run of consecutive block ids is one contiguous region per
(layer, K/V), gathered by sendmsg, scattered by recvmsg_into; a device pool (CUDA, whose memory the engine core
owns and shares by CUDA IPC) is staged through one host copy in pinned memory (base.host_staging). Every socket op
is bounded by what is left of the transfer's timeout; a closed or reset peer fails the transfer on both sides
at once. `token` is the fleet token (services/protocol/fleet_token.py): a writer without this process's is
refused before it touches an expect(). The target writes only into the blocks of its own expect() for that id,
once; a failed transfer may leave those half written.

Ownership (base.py): the payload is taken off the socket at most RECV_CHUNK bytes at a time, each
non-blocking recvmsg_into straight into the pool under the expect() handle's writing() guard (a device pool:
write_blocks from staging, about RECV_CHUNK at a time, each synchronized, under it). Once the handle is done,
whoever finished it, nothing more is copied; the target drops the connection and the writer sees the peer go.
"""
from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Sequence

from google.protobuf.message import DecodeError, Message

from services.protocol import fleet_token
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer.base import (Completion, KVFailure, KVLayout, KVTransferError, PoolTransport,
                                       byte_view, check_write, copy_into, host_staging, layout_mismatch,
                                       make_descriptor, on_host)
from services.kv_transfer.tcp_gate import GateCounts, HeaderGate, TcpReceiverConfig

HOST = "127.0.0.1"
MAX_FRAME = TcpReceiverConfig.max_header_bytes  # the most a reply frame may claim
IOV_BATCH = 256          # buffers per sendmsg / recvmsg_into call (Linux IOV_MAX is 1024)
SOCK_BUF = 4 << 20
RECV_CHUNK = 1 << 20     # the most copied into the pool under one hold of the handle's lock
CLAIM_SHARE = 0.8        # wait for the expect() this share of the source's time, so a refusal still reaches it


class TcpTransport(PoolTransport):
    name = "tcp"
    receiver_stops_writes = True

    def __init__(self, worker_id: str, auth: fleet_token.FleetAuth | None = None, port: int = 0,
                 config: TcpReceiverConfig = TcpReceiverConfig(), staged: bool | None = None,
                 host: str = HOST):
        """`auth`: the fleet token writers present and this target asks for (else this process's);
        `host`, `port`: where the receiver listens and what its descriptors name (0: a free port;
        the worker checked a host off loopback against its opt-in); `config`: the receiver's bounds;
        `staged`: move blocks through host staging (None: exactly when the pool is not on the
        CPU; True on a CPU pool runs a device pool's path up to the device copy, for tests)."""
        super().__init__(worker_id)
        self._staged = staged
        self._host, self._port, self.config = host, port, config
        self._gate: HeaderGate | None = None
        self._receivers = ThreadPoolExecutor(config.max_transfers, thread_name_prefix=f"kv-tcp-recv-{worker_id}")
        self._auth = auth if auth is not None else fleet_token.active()
        self._flat: memoryview | None = None  # the whole CPU pool as bytes; None for a device pool
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # guards the two sets below
        self._threads: set[threading.Thread] = set()
        self._socks: set[socket.socket] = set()

    def register(self, kv_cache) -> None:
        if self._kv is not None:
            raise ValueError(f"worker {self.worker_id!r} already registered a pool")
        self._kv, self._layout = kv_cache, KVLayout.of(kv_cache)
        staged = self._staged if self._staged is not None else not on_host(kv_cache.data)
        if not staged:
            self._flat = byte_view(kv_cache.data)
        self._listener = socket.create_server((self._host, self._port),
                                               family=_family(self._host))
        self._gate = HeaderGate(self._listener, self._auth, self.config, self._admit,
                                f"kv-tcp-gate-{self.worker_id}")

    @property
    def gate_counts(self) -> GateCounts:
        """Connections the receiver closed before any payload, by why."""
        return self._gate.counts if self._gate else GateCounts()

    @property
    def address(self) -> str:
        """host:port where sources reach this receiver ([host]:port for IPv6)."""
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor:
        return make_descriptor(self.worker_id, self.name, self._layout, self._target_ids(block_ids),
                               address=self.address)

    def write(self, transfer_id: str, src_block_ids: Sequence[int], target: pb.KVDescriptor,
              timeout_s: float, checksum: bool = False, hand_off: pb.HandOff | None = None) -> Completion:
        src = check_write(self.name, self._layout, self._pool().num_blocks, transfer_id,
                          src_block_ids, target)
        handle = Completion(f"tcp write {transfer_id!r} to {target.worker_id}", timeout_s)
        self._spawn(self._send, "kv-tcp-send", transfer_id, src, target, checksum, hand_off, handle)
        return handle

    def close(self) -> None:
        self._closed.set()
        if self._gate:
            self._gate.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            except OSError:
                pass
        self._inbox.close()  # fails what is expected, and wakes a receiver waiting to claim
        for thread in threads:
            thread.join(timeout=2.0)
        self._receivers.shutdown(wait=True, cancel_futures=True)
        for sock in socks:
            sock.close()  # one still queued for the pool, never served
        if self._listener:
            self._listener.close()

    # ---- source side -------------------------------------------------------------------------------------

    def _send(self, transfer_id: str, src: list[int], target: pb.KVDescriptor, checksum: bool,
              hand_off: pb.HandOff | None, handle: Completion) -> None:
        deadline = handle.deadline
        try:
            host, port = target.address.rsplit(":", 1)
            host = host.removeprefix("[").removesuffix("]")
            with socket.create_connection((host, int(port)), timeout=_left(deadline)) as sock, self._tracked(sock):
                _tune(sock)
                views = self._source_views(src)
                header = pb.KVTransferHeader(
                    token=self._auth.presented().decode(), transfer_id=transfer_id,
                    layout=self._layout.to_pb(), block_ids=list(target.block_ids),
                    nbytes=len(src) * self._layout.bytes_per_block,
                    crc32=_crc(views) if checksum else None, timeout_s=_left(deadline), hand_off=hand_off)
                _send_frame(sock, header, deadline)
                _check_reply(_recv_reply(sock, deadline), "refused the transfer")
                _send_views(sock, views, deadline)
                _check_reply(_recv_reply(sock, deadline), "failed the transfer")
            handle.finish()
        except Exception as e:  # a thread's last word: everything becomes the handle's error
            handle.finish(f"{handle.what}: {self._describe(e)}", failure=self._failure(e))

    def _source_views(self, ids: list[int]) -> list[memoryview]:
        if self._flat is not None:
            return self._pool_views(ids)
        blocks = self._kv.read_blocks(ids)            # device pool: gathered on the device,
        staged = host_staging(self._kv.data, len(ids))  # then one copy into pinned host memory
        copy_into(staged, blocks)                     # (synchronous: staging is read next)
        return [byte_view(staged)]

    def _pool_views(self, ids: list[int]) -> list[memoryview]:
        """Wire-order views into a CPU pool; consecutive ids merge into one region per (layer, K/V)."""
        runs: list[list[int]] = []  # [first block, count]
        for b in ids:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
        size, nb = self._layout.region_bytes, self._kv.num_blocks  # plane = layer * 2 + kv: nb regions each
        return [self._flat[(plane * nb + first) * size:(plane * nb + first + count) * size]
                for plane in range(self._layout.num_layers * 2) for first, count in runs]

    # ---- target side -------------------------------------------------------------------------------------

    def _admit(self, conn: socket.socket, header: pb.KVTransferHeader) -> None:
        """The gate passed this connection (its header carried the fleet token): receive it on the pool."""
        with self._lock:
            if self._closed.is_set():
                return conn.close()
            self._socks.add(conn)
        self._receivers.submit(self._serve, conn, header)

    def _serve(self, conn: socket.socket, header: pb.KVTransferHeader) -> None:
        transfer_id, claimed = None, None
        with conn:
            try:
                _tune(conn)
                transfer_id, deadline = header.transfer_id, time.monotonic() + _timeout(header.timeout_s)
                claimed = self._inbox.claim(transfer_id, CLAIM_SHARE * _left(deadline))
                refusal, failure, hand_off = self._check_header(header, claimed)
                _send_frame(conn, reply(refusal, failure), deadline)
                if refusal:
                    if claimed is not None:
                        self._inbox.finish(transfer_id, refusal, failure=failure)
                    return
                views = self._receive_payload(conn, *claimed, deadline)
                error = None
                if header.HasField("crc32") and _crc(views) != header.crc32:
                    error = "checksum mismatch: the received bytes differ from the source's"
                _send_frame(conn, reply(error, KVFailure.CHECKSUM_MISMATCH), deadline)
                self._inbox.finish(transfer_id, error, hand_off=hand_off, failure=KVFailure.CHECKSUM_MISMATCH)
            except Exception as e:  # a thread's last word: a claimed expect always hears it
                if claimed is not None:
                    self._inbox.finish(transfer_id, f"receive failed: {self._describe(e)}",
                                       failure=self._failure(e))
            finally:
                with self._lock:
                    self._socks.discard(conn)

    def _check_header(self, header: pb.KVTransferHeader,
                      claimed) -> tuple[str | None, KVFailure, pb.HandOff | None]:
        """-> (why the transfer is refused, or None; the failure that is; the hand-off it carries)."""
        tid, refused = header.transfer_id, KVFailure.REFUSED
        if claimed is None:
            return f"{self.worker_id} expects no transfer {tid!r} (no expect() in time, or already taken)", \
                refused, None
        ids, handle = claimed
        if handle.done():
            return f"the target's expect() of {tid!r} is over: {handle.error}", refused, None
        try:
            layout = KVLayout.from_pb(header.layout)
        except ValueError as e:
            return f"bad header: {e}", refused, None
        mismatch = layout_mismatch(layout, self._layout)
        if mismatch is not None:
            return mismatch, KVFailure.LAYOUT_MISMATCH, None
        if list(header.block_ids) != ids:
            return f"blocks {list(header.block_ids)} are not the ones expected for {tid!r}: {ids}", refused, None
        if header.nbytes != len(ids) * self._layout.bytes_per_block:
            return f"payload of {header.nbytes} bytes does not fill {len(ids)} blocks", refused, None
        return None, refused, header.hand_off if header.HasField("hand_off") else None

    def _receive_payload(self, conn: socket.socket, ids: list[int], handle: Completion,
                         deadline: float) -> list[memoryview]:
        """Take the payload into the pool while the handle is open; -> the views it landed in, in wire order."""
        if self._flat is not None:
            views = self._pool_views(ids)
            _recv_views(conn, views, deadline, guard=handle)
            return views
        data = self._kv.data  # device pool: receive into pinned host staging, then write_blocks
        staged = host_staging(data, len(ids))
        views = [byte_view(staged)]
        _recv_views(conn, views, deadline)
        step = max(1, RECV_CHUNK // self._layout.bytes_per_block)
        for i in range(0, len(ids), step):
            with handle.writing() as still_open:
                if not still_open:
                    raise KVTransferError(_OVER, KVFailure.DEADLINE)
                self._kv.write_blocks(ids[i:i + step], staged[:, :, i:i + step])
                if not on_host(data):  # copied, not just queued, before finish() may return
                    import torch  # noqa: PLC0415 - a device pool: torch is loaded
                    torch.cuda.current_stream(data.device).synchronize()
        return views

    # ---- plumbing ----------------------------------------------------------------------------------------

    def _spawn(self, fn, name: str, *args) -> None:
        def run():
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())
        thread = threading.Thread(target=run, name=f"{name}-{self.worker_id}", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    @contextmanager
    def _tracked(self, sock: socket.socket):
        with self._lock:
            self._socks.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._socks.discard(sock)

    def _failure(self, e: Exception) -> KVFailure:
        """Why a socket thread's exception failed its transfer."""
        if self._closed.is_set():
            return KVFailure.CLOSED
        if isinstance(e, TimeoutError):
            return KVFailure.TIMEOUT
        if isinstance(e, ConnectionError):
            return KVFailure.PEER_GONE
        if isinstance(e, KVTransferError):
            return e.failure
        return KVFailure.OTHER

    def _describe(self, e: Exception) -> str:
        if self._closed.is_set():
            return "transport closed"
        if isinstance(e, TimeoutError):
            return "timed out"
        if isinstance(e, ConnectionError):
            return f"peer gone ({type(e).__name__}: {e})"
        if isinstance(e, (OSError, KVTransferError)):
            return str(e) or type(e).__name__
        return f"{type(e).__name__}: {e}"


_OVER = "the target's expect() is over (finished or past its deadline): nothing more is written"


def reply(error: str | None, failure: KVFailure) -> pb.KVTransferReply:
    """A reply frame: accepted / landed (no error), or the error and, typed, why."""
    if not error:
        return pb.KVTransferReply()
    return pb.KVTransferReply(error=error, failure=pb.KVFailure.Value(f"KV_{failure.name}"))


def reply_failure(message: pb.KVTransferReply) -> KVFailure:
    """A reply's failure (a target that named none: refused)."""
    if message.failure == pb.KV_FAILURE_UNSPECIFIED:
        return KVFailure.REFUSED
    return KVFailure[pb.KVFailure.Name(message.failure).removeprefix("KV_")]


def _timeout(value) -> float:
    """A header's timeout_s: a positive finite number of seconds."""
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise KVTransferError(f"bad header: timeout_s {value!r} is not a positive number of seconds")
    return seconds


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _crc(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


def _check_reply(message: pb.KVTransferReply, verb: str) -> None:
    if message.error:
        raise KVTransferError(f"target {verb}: {message.error}", reply_failure(message))


def _send_frame(sock: socket.socket, message: Message, deadline: float) -> None:
    body = message.SerializeToString()
    sock.settimeout(_left(deadline))
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_reply(sock: socket.socket, deadline: float) -> pb.KVTransferReply:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if size > MAX_FRAME:
        raise KVTransferError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
    try:
        return pb.KVTransferReply.FromString(_recv_exact(sock, size, deadline))
    except DecodeError as e:
        raise KVTransferError(f"a reply that is no KVTransferReply: {e}") from None


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    if size == 0:
        return b""  # an empty message (a reply with no error) is 0 bytes on the wire
    buf = bytearray(size)
    _recv_views(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def _send_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    for start in range(0, len(views), IOV_BATCH):
        batch = views[start:start + IOV_BATCH]
        while batch:
            sock.settimeout(_left(deadline))
            batch = _advance(batch, sock.sendmsg(batch))


def _recv_views(sock: socket.socket, views: list[memoryview], deadline: float,
                guard: Completion | None = None) -> None:
    """Fill the views from the socket; with a guard, each non-blocking recvmsg_into (at most RECV_CHUNK bytes)
    runs under guard.writing(), and waiting for data happens outside it."""
    for start in range(0, len(views), IOV_BATCH):
        batch = views[start:start + IOV_BATCH]
        while batch:
            got = (_recv_some(sock, batch, deadline) if guard is None else
                   _recv_guarded(sock, batch, deadline, guard))
            if got == 0:
                raise KVTransferError("peer closed the connection mid-transfer", KVFailure.PEER_GONE)
            batch = _advance(batch, got)


def _recv_some(sock: socket.socket, batch: list[memoryview], deadline: float) -> int:
    sock.settimeout(_left(deadline))
    return sock.recvmsg_into(batch)[0]


def _recv_guarded(sock: socket.socket, batch: list[memoryview], deadline: float, guard: Completion) -> int:
    sock.settimeout(0.0)
    while True:
        with guard.writing() as still_open:
            if not still_open:
                raise KVTransferError(_OVER, KVFailure.DEADLINE)
            try:
                return sock.recvmsg_into(_first_bytes(batch, RECV_CHUNK))[0]
            except BlockingIOError:
                pass
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(1000 * _left(min(deadline, guard.deadline))):
            raise TimeoutError("timed out")


def _first_bytes(views: list[memoryview], n: int) -> list[memoryview]:
    """The first n bytes of a buffer list (all of it when shorter)."""
    out = []
    for view in views:
        if n <= 0:
            break
        out.append(view[:n])
        n -= len(view)
    return out


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes of a buffer list."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest
