"""Typed call outcomes between the fleet's services (no control state in strings).

A failed call carries a `CallStatus` (reason enum, engine error code, retry hint, message) in the
`x-kvfleet-status-bin` trailing metadata, next to the gRPC status code the reason maps to:

    handler:  await status.abort(context, status.failed(Reason.OVERLOADED, "...", retry_after_s=1))
    caller:   except status.CallFailed as e: st = e.status   # always a CallStatus

A caller's stub raises CallFailed (services/protocol/typed_stub.py converts grpc's AioRpcError
there, once), and so does code that fails a request locally the way a remote failure would.

A failure that carries no CallStatus (a transport error, a deadline, a peer that died mid-call) is
read from its code (`_UNTYPED`; UNAVAILABLE when nothing fits or the transport broke, INTERNAL
included; REASON_UNSPECIFIED for a handler's uncaught exception, UNKNOWN), so callers switch on
`reason` only.
"""
from __future__ import annotations

from typing import NoReturn

import grpc

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

Reason = pb.Reason
STATUS_KEY = "x-kvfleet-status-bin"

GRPC_CODE: dict[int, grpc.StatusCode] = {
    pb.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    pb.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    pb.ENGINE_FAILED: grpc.StatusCode.UNAVAILABLE,
    pb.KV_TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
    pb.NO_RESERVATION: grpc.StatusCode.NOT_FOUND,
    pb.WRONG_ROLE: grpc.StatusCode.FAILED_PRECONDITION,
    pb.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    pb.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
}

# A status code with no CallStatus beside it: what it means to a caller.
_UNTYPED: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: pb.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: pb.OVERLOADED,
    grpc.StatusCode.NOT_FOUND: pb.NO_RESERVATION,
    grpc.StatusCode.FAILED_PRECONDITION: pb.WRONG_ROLE,
    grpc.StatusCode.UNAUTHENTICATED: pb.UNAUTHENTICATED,
    # grpc's core ends a call whose peer died mid-stream (its HTTP/2 stream reset, the process
    # SIGKILLed) INTERNAL "Internal error from Core": the transport failed, as with UNAVAILABLE.
    # A kvfleet handler never ends a call INTERNAL itself: `abort` sends a CallStatus, and a
    # handler's uncaught exception reaches the caller UNKNOWN (502 at the gateway).
    grpc.StatusCode.INTERNAL: pb.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN: pb.REASON_UNSPECIFIED,
}


def failed(reason: int, message: str, *, code: str = "", param: str = "",
           retry_after_s: float | None = None) -> pb.CallStatus:
    st = pb.CallStatus(reason=reason, code=code, param=param, message=message)
    if retry_after_s is not None:
        st.retry_after_s = retry_after_s
    return st


class CallFailed(Exception):
    """A failed call or request, as a CallStatus: raised inside a service (turned into a gRPC
    status by `abort`), by a caller's typed stub for a call that failed, or by code that fails a
    request locally. `untyped_code`: a failed call's bare gRPC code when it carried no CallStatus
    (the peer did not answer: a transport error, a deadline), else None."""

    def __init__(self, st: pb.CallStatus, untyped_code: grpc.StatusCode | None = None) -> None:
        super().__init__(st.message)
        self.status = st
        self.untyped_code = untyped_code


def trailing(st: pb.CallStatus) -> tuple[tuple[str, bytes], ...]:
    return ((STATUS_KEY, st.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, st: pb.CallStatus) -> NoReturn:
    """End the call with `st`: its gRPC code, its message as details, itself in the trailers."""
    context.set_trailing_metadata(trailing(st))
    await context.abort(GRPC_CODE.get(st.reason, grpc.StatusCode.UNKNOWN), st.message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def of(error: grpc.aio.AioRpcError) -> pb.CallStatus:
    """The CallStatus a failed call carries, or one read from its bare status code."""
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_KEY and isinstance(value, bytes):
            st = pb.CallStatus()
            try:
                st.ParseFromString(value)
            except Exception:  # noqa: BLE001 - a garbled trailer is read like an untyped failure
                break
            return st
    reason = _UNTYPED.get(error.code(), pb.UNAVAILABLE)
    return failed(reason, error.details() or error.code().name)

