"""The kvfleet.v1 Gateway gRPC service: the REST API's semantics over protobuf.

Authentication: metadata `authorization: Bearer <key>`. Errors are gRPC statuses with the REST
messages (errors.py maps them); a quota refusal carries `retry-after` (seconds) in the trailing
metadata. Initial metadata names what serves the request: `x-kvfleet-model`,
`x-kvfleet-quality-version`, `x-request-id`, `x-kvfleet-traffic-class`, and `x-kvfleet-output-cap` when the class's output cap
clamped `params.max_tokens`, and `x-kvfleet-trace-id` when tracing is on. Cancelling the call
cancels the request everywhere.

Telemetry: a `traceparent` in the call's metadata is continued (services/gateway/telemetry.py).
The last chunk's `timing` holds the request's phase times (gateway queue included; earlier chunks
carry none), and the trailing metadata `x-kvfleet-timing` the whole timing object as JSON, with
ttft_s and e2e_s, which RequestTiming has no field for. The trailing metadata also names the
overload stage the request was decided in (`x-kvfleet-stage`, refusals too) and a stage's output
cap (`x-kvfleet-output-cap`, S2 and up).

Differences from proto3 defaults, stated once: `model` empty means the served model;
`params.max_tokens` 0 is an error (there is no "unset" for it); `params.top_p` 0 means 1.0 (off);
`traffic_class` empty means the key's class (`auto`: by prompt length); another class is served
if the key allows it (`allowed_classes`), else PERMISSION_DENIED naming the classes it may use
(services/gateway/classes.py). The initial metadata's `x-kvfleet-traffic-class` names the class.
A client-chosen `request_id` is namespaced by tenant on the way to the router (so one tenant's
ids can never collide with, or cancel, another's); chunks come back under the client's id.

A request protobuf cannot parse (a string field holding invalid UTF-8, a truncated message) is
INVALID_ARGUMENT saying so: the methods are registered with deserializers that hand such a
request to the method as `Undecodable` (`add_to_server`), where grpc alone would answer UNKNOWN.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.gateway import errors
from services.gateway.classes import CLASS_HEADER, choose
from services.gateway.config import ApiKey

RETRY_AFTER = "retry-after"       # trailing metadata of a refusal: seconds, as HTTP's header
from services.gateway.core import (GatewayCore, build_generation, internal_request_id,
                                   new_request_id)
from services.gateway.telemetry import TIMING_HEADER
from services.gateway.validation import Generation
from services.telemetry.tracing import TRACE_HEADER
from services.gateway.stage_view import STAGE_HEADER, admission_headers

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SERVICE = "kvfleet.v1.Gateway"


class Undecodable:
    """A request body that did not parse as its message; `message` says why."""

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(message_cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def deserialize(raw: bytes) -> Message | Undecodable:
        try:
            return message_cls.FromString(raw)
        except DecodeError as e:
            return Undecodable(f"the request is not a valid {message_cls.DESCRIPTOR.full_name} "
                               f"(string fields must hold valid UTF-8): {e}")
    return deserialize


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """What the generated add_GatewayServicer_to_server does, with lenient deserializers."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, _lenient(pb.GenerateRequest), pb.TokenChunk.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel, _lenient(pb.CancelRequest), pb.CancelResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, _lenient(pb.ListModelsRequest),
            pb.ListModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, _lenient(pb.HealthRequest), pb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest | Undecodable, context):
        telemetry = self.core.request("text_completion", context.invocation_metadata())
        seat = None
        try:
            _check_decoded(request)            # before the key, as for every method
            with telemetry.phase("gateway.auth"):
                key = self._authenticate(context)
                rid = internal_request_id(request.request_id, key.tenant) or new_request_id("cmpl")
                telemetry.named(rid, key.tenant, key.traffic_class)
                self.core.quotas.refuse_early(key)     # before the prompt is tokenized
                seat = self.core.door.enter(key.tenant)
            with telemetry.phase("gateway.validate"):
                gen = await build_generation(request.ByteSize(), self._generation, request, key,
                                             rid)
            session = await self.core.open(gen, telemetry, request.request_id or gen.request_id,
                                           seat)
        except errors.GatewayError as e:
            if seat is not None:
                seat.leave()
            telemetry.rejected(e)
            e.trace_id = telemetry.trace_id
            await _abort(context, e)
        except BaseException:
            if seat is not None:
                seat.leave()
            telemetry.end("cancelled", 0)
            raise
        try:
            chunk = await session.first()       # the plan names the quality version that serves
            await context.send_initial_metadata(self._served_by(gen, telemetry.trace_id,
                                                                telemetry.quality_version))
            while chunk is not None:
                chunk.request_id = request.request_id or gen.request_id
                if chunk.finished:
                    timing = telemetry.timing()
                    chunk.timing.CopyFrom(telemetry.timing_pb(timing))
                    context.set_trailing_metadata(
                        ((TIMING_HEADER, telemetry.timing_json(timing)),
                         *admission_headers(session.run.plan).items()))
                else:
                    chunk.ClearField("timing")
                yield chunk
                session.sent(chunk)
                chunk = None if chunk.finished else await session.next()
        except errors.GatewayError as e:
            await _abort(context, e)
        finally:
            session.close()

    async def Cancel(self, request: pb.CancelRequest | Undecodable, context) -> pb.CancelResponse:
        key = await self._authenticate_or_abort(request, context)
        return pb.CancelResponse(cancelled=self.core.cancel(request.request_id, key.tenant))

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        await self._authenticate_or_abort(request, context)
        m = self.core.model
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=m.name, max_model_len=m.max_model_len, quality_version=m.quality_version)])

    async def Health(self, request, context) -> pb.HealthResponse:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        serving, detail = await self.core.health()
        return pb.HealthResponse(status=pb.HealthResponse.SERVING if serving else
                                 pb.HealthResponse.NOT_SERVING, detail=detail)

    # ----------------------------------------------------------------- helpers
    def _authenticate(self, context) -> ApiKey:
        metadata = {k: v for k, v in context.invocation_metadata() or ()}
        return self.core.authenticate(metadata.get("authorization"))

    async def _authenticate_or_abort(self, request, context) -> ApiKey:
        try:
            _check_decoded(request)
            return self._authenticate(context)
        except errors.GatewayError as e:
            await _abort(context, e)

    def _generation(self, request: pb.GenerateRequest, key: ApiKey, rid: str) -> Generation:
        """Validate and tokenize (in a thread for a large request: tokenizing a long prompt takes
        a while)."""
        v = self.core.validator
        if request.model:
            v.check_model(request.model)
        classes = choose(self.core.config, key, request.traffic_class)
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise errors.bad_request("request_id must be 1-128 characters of [A-Za-z0-9._:-]",
                                     "request_id")
        which = request.WhichOneof("prompt")
        if which is None:
            raise errors.bad_request("missing prompt: set text or token_ids", "prompt")
        ids = (v.encode_text(request.text, classes.widest) if which == "text"
               else v.check_ids(list(request.token_ids.ids)))
        cls = classes.pick(len(ids))
        params = pb.SamplingParams()
        params.CopyFrom(request.params)
        if params.max_tokens == 0:
            raise errors.bad_request("params.max_tokens must be a positive integer, got 0",
                                     "max_tokens", "invalid_max_tokens")
        requested = params.max_tokens
        params.max_tokens = v.max_tokens(requested, len(ids), cls, None)
        v.check_params(params)
        return Generation(rid, key, cls, tuple(ids), params, requested)

    def _served_by(self, gen: Generation, trace_id: str | None,
                   quality_version: str = "") -> tuple[tuple[str, str], ...]:
        """The response's initial metadata; `quality_version`: the serving worker's (its pool's
        model), else the gateway's own model's."""
        m = self.core.model
        cap = (("x-kvfleet-output-cap", str(gen.output_cap)),) if gen.output_cap else ()
        traced = ((TRACE_HEADER, trace_id),) if trace_id else ()
        return (("x-kvfleet-model", m.name), ("x-kvfleet-quality-version",
                                               quality_version or m.quality_version),
                ("x-request-id", gen.request_id), (CLASS_HEADER, gen.traffic_class.name), *cap,
                *traced)


def _check_decoded(request: Message | Undecodable) -> None:
    if isinstance(request, Undecodable):
        raise errors.bad_request(request.message, None, "invalid_protobuf")


async def _abort(context, e: errors.GatewayError) -> None:
    trailing = ((RETRY_AFTER, str(e.retry_after_s)),) if e.retry_after is not None else ()
    if e.trace_id:
        trailing += ((TRACE_HEADER, e.trace_id),)
    if e.stage:
        trailing += ((STAGE_HEADER, e.stage),)
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(e.grpc_code, e.message)
