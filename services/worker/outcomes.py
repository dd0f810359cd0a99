"""How a worker ends a call that failed: the engine's typed errors as typed CallStatus."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from services.engine.errors import InvalidRequestError
from services.engine.outputs import TokenOutput
from services.protocol import status
from services.protocol.convert import params_from_pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.worker.telemetry import outcome_of


@dataclass
class Ending:
    """How one request ended on this worker, for its metrics and span: `cancelled` until a
    handler records otherwise (a call that just stops, the caller gone, ended it)."""
    outcome: str = "cancelled"
    error: str | None = None

    def failed(self, st: pb.CallStatus) -> pb.CallStatus:
        self.outcome, self.error = outcome_of(st.reason), st.message
        return st


async def invalid_request(context, e: InvalidRequestError, ending: Ending | None = None) -> NoReturn:
    """400: the engine's code, message and field travel typed (no "code: message" text)."""
    st = status.failed(pb.INVALID_REQUEST, e.message, code=e.code,
                       param=getattr(e, "param", None) or "")
    await status.abort(context, ending.failed(st) if ending else st)


async def add_request(engine, request, context, ending: Ending | None = None) -> None:
    """Queue a Prefill's or Generate's request on the engine core; a request the engine finds
    invalid ends the call INVALID_REQUEST with the engine's code, message and field."""
    try:
        await engine.add_request(
            request.request_id, list(request.prompt_token_ids), params_from_pb(request.params),
            request.tenant or None, request.traffic_class or None)
    except InvalidRequestError as e:
        await invalid_request(context, e, ending)


async def engine_failed(context, e: Exception, ending: Ending | None = None) -> NoReturn:
    """A call that met a dead engine core: UNAVAILABLE, so a prefill is retried elsewhere and
    the gateway answers 503 (or an SSE error event once tokens were sent)."""
    st = status.failed(pb.ENGINE_FAILED, str(e))
    await status.abort(context, ending.failed(st) if ending else st)


def output_failure(out: TokenOutput) -> pb.CallStatus | None:
    """The engine's own non-client endings ("rejected", "error") as the typed failure the call
    ends with, or None for an output a client may see (stop, length, abort, or still running)."""
    if out.finish_reason == "rejected":
        return status.failed(pb.OVERLOADED, out.error or "rejected by admission",
                             retry_after_s=out.retry_after_s)
    if out.finish_reason == "error":
        return status.failed(pb.ENGINE_FAILED, out.error or "the engine failed the request")
    return None
