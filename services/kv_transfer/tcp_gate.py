"""The tcp receiver's front door: one thread accepts connections and reads their headers, none of them trusted.

    accept ──> pending (at most max_pending; the next is closed at once, counted `busy`)
                 │  non-blocking reads: a 4-byte length (over max_header_bytes: closed, `bad_header`),
                 │  then the header's bytes, as they come, within header_timeout_s (else closed, `slow`)
                 ▼
               token check (wrong or missing: the refusal is sent, closed, `unauthenticated`)
                 ▼
               hand_off(conn, header) on a bounded pool of threads (tcp.py receives the payload there)

Nothing is allocated by what a peer claims: a header buffer grows only with bytes that arrived, and never past
max_header_bytes; a payload is read by tcp.py only after the token and the reservation's size are checked.
So memory and threads are bounded by the config, whatever connects to the port.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from google.protobuf.message import DecodeError

from services.protocol import fleet_token
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

log = logging.getLogger(__name__)
LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class TcpReceiverConfig:
    header_timeout_s: float = 1.0        # a new connection must send its whole header within this
    max_header_bytes: int = 256 << 10    # a serialized header (its block ids dominate: <= 5 bytes each)
    max_pending: int = 64                # connections not yet past the token check
    max_transfers: int = 32              # threads receiving authenticated transfers (more wait in a queue)


@dataclass
class GateCounts:
    """Connections the gate closed, by why. Read from any thread (ints: each update is one store)."""
    busy: int = 0             # max_pending were already waiting
    bad_header: int = 0       # a length over the limit, or bytes that are not a KVTransferHeader
    slow: int = 0             # no whole header within header_timeout_s, or the peer left mid-header
    unauthenticated: int = 0  # wrong or missing fleet token
    admitted: int = 0         # handed on to receive a payload


@dataclass
class _Pending:
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    size: int | None = None  # the header's length, once its 4 bytes are in


class HeaderGate:
    """Owns the listener; `hand_off(conn, header)` is called on the gate's thread with a blocking socket whose
    header carried this fleet's token; it must return at once (submit to a pool)."""

    def __init__(self, listener: socket.socket, auth: fleet_token.FleetAuth, config: TcpReceiverConfig,
                 hand_off: Callable[[socket.socket, pb.KVTransferHeader], None], name: str):
        self.config, self.counts = config, GateCounts()
        self._listener, self._auth, self._hand_off = listener, auth, hand_off
        self._pending: dict[socket.socket, _Pending] = {}
        self._selector = selectors.DefaultSelector()
        self._closed = threading.Event()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the selector
        except OSError:
            pass
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read_or_drop(key.fileobj)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()

    def _next_timeout(self) -> float:
        if not self._pending:
            return 1.0  # nothing to expire; close() wakes the selector anyway
        soonest = min(p.deadline for p in self._pending.values())
        return max(0.0, min(1.0, soonest - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:
                self._closed.set()  # the listener was shut down
                return
            if len(self._pending) >= self.config.max_pending:
                self.counts.busy += 1
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn] = _Pending(time.monotonic() + self.config.header_timeout_s)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read_or_drop(self, conn: socket.socket) -> None:
        """One connection's bug must not stop the door for the others."""
        try:
            self._read(conn)
        except Exception:  # noqa: BLE001 - logged; that connection is dropped
            log.exception("kv tcp receiver: dropping a connection")
            if conn in self._pending:
                self._drop(conn)
            else:
                conn.close()

    def _read(self, conn: socket.socket) -> None:
        p = self._pending[conn]
        want = (LENGTH.size if p.size is None else LENGTH.size + p.size) - len(p.buf)
        try:
            got = conn.recv(min(want, 1 << 16))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:
            self.counts.slow += 1
            return self._drop(conn)
        p.buf += got
        if p.size is None and len(p.buf) == LENGTH.size:
            (p.size,) = LENGTH.unpack(p.buf)
            if p.size > self.config.max_header_bytes:
                self.counts.bad_header += 1
                return self._drop(conn)
        if p.size is not None and len(p.buf) == LENGTH.size + p.size:
            self._admit(conn, bytes(p.buf[LENGTH.size:]))

    def _admit(self, conn: socket.socket, body: bytes) -> None:
        self._forget(conn)
        try:
            header = pb.KVTransferHeader.FromString(body)
        except DecodeError:
            self.counts.bad_header += 1
            return conn.close()
        refusal = self._auth.refusal(header.token)
        if refusal is not None:
            self.counts.unauthenticated += 1
            return _refuse(conn, f"unauthenticated: {refusal}", self.config.header_timeout_s)
        self.counts.admitted += 1
        conn.setblocking(True)
        self._hand_off(conn, header)

    def _expire(self, now: float) -> None:
        for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
            self.counts.slow += 1
            self._drop(conn)

    def _forget(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()


def _refuse(conn: socket.socket, why: str, timeout_s: float) -> None:
    """The refusal is one small frame: it fits the socket's buffer, so this does not wait on the peer."""
    body = pb.KVTransferReply(error=why, failure=pb.KV_REFUSED).SerializeToString()
    try:
        conn.settimeout(timeout_s)
        conn.sendall(LENGTH.pack(len(body)) + body)
    except OSError:
        pass
    finally:
        conn.close()
