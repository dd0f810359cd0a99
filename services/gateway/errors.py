"""One error type for REST and gRPC, in OpenAI's shape: `{"error": {message, type, param, code}}`.

| status | type                  | gRPC                | when                                                |
|--------|-----------------------|---------------------|-----------------------------------------------------|
| 400    | invalid_request_error | INVALID_ARGUMENT    | schema, values, context length, router's INVALID_ARGUMENT |
| 401    | authentication_error  | UNAUTHENTICATED     | missing or unknown API key (when keys are configured) |
| 403    | permission_error      | PERMISSION_DENIED   | a traffic class the API key may not use             |
| 404    | not_found_error       | NOT_FOUND           | unknown model, unknown route, another tenant's job  |
| 413    | invalid_request_error | INVALID_ARGUMENT    | body over the configured limit                      |
| 429    | rate_limit_error      | RESOURCE_EXHAUSTED  | tenant quota, or fleet overload (code overloaded)   |
|        |                       |                     | or the tenant's share of the gateway (door.py)      |
| 502    | upstream_error        | INTERNAL            | a worker failed in an unexpected way                |
| 503    | service_unavailable   | UNAVAILABLE         | no healthy capacity: worker, router or Redis down   |
|        |                       |                     | or this gateway full (door.py, code gateway_full)   |

`retry_after` (seconds) becomes the `Retry-After` header / `retry-after` trailing metadata. Every
refusal (429 or 503) carries one, and its message names the reason.
"""
from __future__ import annotations

import math

import grpc

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.telemetry.tracing import TRACE_HEADER
from services.gateway.stage_view import STAGE_HEADER

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 502: "upstream_error", 503: "service_unavailable"}
_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED,
         404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        # for telemetry (kvfleet_rejections): why and in which overload stage the request was
        # refused; a CallStatus reason name or quota_* (None: a gateway-side client error)
        self.reason: str | None = None
        self.stage: str | None = None
        self.trace_id: str | None = None      # the request's trace, named in the response

    def tagged(self, reason: str, stage: str | None = None) -> GatewayError:
        self.reason, self.stage = reason, stage
        return self

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after is not None else {}
        if self.trace_id:
            headers[TRACE_HEADER] = self.trace_id
        if self.stage:
            headers[STAGE_HEADER] = self.stage
        return headers

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.retry_after or 0))

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC.get(self.status, grpc.StatusCode.INTERNAL)


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def context_too_long(message: str, param: str = "prompt") -> GatewayError:
    return GatewayError(400, message, code="context_length_exceeded", param=param)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def model_not_found(name: str, served: str) -> GatewayError:
    return GatewayError(404, f"The model `{name}` does not exist; this gateway serves `{served}`",
                        code="model_not_found", param="model")


def rate_limited(message: str, retry_after: float | None) -> GatewayError:
    return GatewayError(429, message, code="rate_limit_exceeded", retry_after=retry_after)


# Retry-After of a 503 whose cause named no time: a dead worker is restarted by `kvfleet up`, and a
# router re-reads the worker list, within a couple of seconds.
UNAVAILABLE_RETRY_S = 2.0


def overloaded(message: str, retry_after: float | None) -> GatewayError:
    """Load: the fleet is busy (admission refused it, or every replica's KV is committed). 429."""
    return GatewayError(429, f"overloaded: {message}", code="overloaded",
                        retry_after=retry_after if retry_after is not None else 1.0)


def unavailable(message: str, retry_after: float | None = None, code: str = "unavailable"
                ) -> GatewayError:
    """No healthy capacity (a worker, the router or Redis down). 503 with Retry-After."""
    return GatewayError(503, message, code=code,
                        retry_after=retry_after if retry_after is not None else UNAVAILABLE_RETRY_S)


def from_status(st: pb.CallStatus) -> GatewayError:
    """A fleet failure (router refusal, worker error; services/protocol/status.py) as a gateway
    error: the reason picks the status, the engine's code and field travel as they are. The
    error is tagged with the CallStatus's reason and stage names (telemetry)."""
    return _from_status(st).tagged(pb.Reason.Name(st.reason), pb.OverloadStage.Name(st.stage))


def _from_status(st: pb.CallStatus) -> GatewayError:
    retry = st.retry_after_s if st.HasField("retry_after_s") else None
    if st.reason == pb.INVALID_REQUEST:
        return GatewayError(400, st.message, code=st.code or "invalid_request",
                            param=st.param or None)
    if st.reason == pb.OVERLOADED:
        return overloaded(st.message, retry)
    if st.reason == pb.SHUTTING_DOWN:
        return unavailable(f"the fleet is shutting down: {st.message}", retry, "shutting_down")
    if st.reason in (pb.UNAVAILABLE, pb.ENGINE_FAILED, pb.KV_TRANSFER_FAILED):
        return unavailable(f"the fleet is unavailable: {st.message}", retry)
    return GatewayError(502, f"a worker failed: {pb.Reason.Name(st.reason)}: {st.message}",
                        code="upstream_error")
