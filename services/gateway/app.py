"""The OpenAI-compatible REST API (FastAPI over uvicorn).

  POST /v1/completions         prompt (text or token ids) -> text
  POST /v1/chat/completions    messages -> the chat template -> text
  GET  /v1/models, /v1/models/{id}   one card per --served-model-name, vLLM's fields
  POST /tokenize               vLLM's: {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"}
                               (text over 8 characters per context token: 413; over max_model_len ids: 400)
  POST /detokenize             vLLM's: {"tokens"} -> {"prompt"}
  GET  /version                {"version": kvfleet's}
  GET|POST /ping               vLLM's liveness probe: 200 or 503 as /health, no body
  GET  /health                 the routers' health and the quota store's (no key needed)
  GET  /metrics                Prometheus text: the gateway's GatewayMetrics (open, or with
                               --metrics-key-file / KVFLEET_METRICS_KEY: `Bearer <that key>`)
  GET  /v1/jobs/{id}           an asynchronous job (`Prefer: respond-async`; jobs_api.py)
  GET  /openapi.json           the OpenAPI document of these (request bodies with their ranges)

A generation request, in order (through FastAPI's routing and middleware, like every request):
API key -> the front door (door.py: this gateway's bound on requests in progress and the
tenant's fair share of it; 429 / 503 at once) ->
body (size limit, UTF-8) -> strict schema -> model -> tokenize + lengths (in a thread
when the body is large) -> quotas -> Router.Admit and the plan's worker calls (fleet_run.py) -> first
chunk (errors before it get a real status) -> JSON body or SSE stream. The client going away at
any point after admission cancels it
(`_until_disconnect` before the stream, StreamingResponse's disconnect listener during it) and the
session's close releases the quota slot.

Telemetry (services/gateway/telemetry.py): a `gateway.request` span per generation request
continues the client's `traceparent`, with `gateway.auth` / `gateway.validate` / `gateway.quota`
children; its trace id comes back in `x-kvfleet-trace-id` (tracing on). The final chunk of a
stream (and the usage chunk) and a non-streamed body carry a top-level `timing` object
(queue_s, prefill_s, transfer_s, decode_s, ttft_s, e2e_s); a non-streamed response also has it
as the `x-kvfleet-timing` header (compact JSON).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import logging
import time
from collections.abc import Awaitable

import jinja2
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.gateway import openai_schema as schema
from services.gateway import jobs_api
from services.gateway.auth import check_metrics_key
from services.gateway.classes import CLASS_HEADER, choose
from services.gateway.config import ApiKey
from services.gateway.core import GatewayCore, Session, build_generation, new_request_id
from services.gateway.door import Seat
from services.gateway.errors import GatewayError, bad_request
from services.gateway.jobs import JobRunner
from services.gateway.openai_responses import Collected, Shaper
from services.gateway.streaming import DisconnectSeen, openai_events
from services.gateway.telemetry import TIMING_HEADER, RequestTelemetry
from services.telemetry.tracing import TRACE_HEADER
from services.gateway.stage_view import admission_fields, admission_headers

log = logging.getLogger(__name__)

KVFLEET_VERSION = importlib.metadata.version("kvfleet")
CLIENT_CLOSED = 499   # nginx's status for "client closed the request"; nobody reads it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}   # no proxy buffering


# Recent FastAPI makes HTTP server spans (and OTel metrics) of its own whenever a tracer provider
# is installed: off, since the gateway's SERVER span is `gateway.request`, the root of the
# request's trace under the client's traceparent (a second root would split the trace).
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


class ClientGone(Exception):
    pass


def create_app(core: GatewayCore, jobs: JobRunner | None = None) -> FastAPI:
    app = FastAPI(title="kvfleet gateway", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", **_NO_NATIVE_TELEMETRY)
    started = int(time.time())
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    jobs_api.register(app, core, jobs)

    async def completions(request: Request) -> Response:
        return await _generate(core, request, schema.CompletionRequest, schema.completion, "cmpl",
                               "text_completion")

    async def chat_completions(request: Request) -> Response:
        return await _generate(core, request, schema.ChatCompletionRequest, schema.chat, "chatcmpl",
                               "chat")

    # the handlers parse the bodies themselves (size limit, UTF-8, strict schema); the routes
    # document them. Every request, generation included, passes the app's middleware.
    app.post("/v1/completions", **_documented(schema.CompletionRequest))(completions)
    app.post("/v1/chat/completions", **_documented(schema.ChatCompletionRequest))(chat_completions)
    app.openapi = lambda: _openapi(app, (schema.CompletionRequest, schema.ChatCompletionRequest,
                                         schema.TokenizeRequest, schema.DetokenizeRequest))

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        core.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(core, name, started)
                                           for name in core.model.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        core.authenticate(request.headers.get("authorization"))
        core.validator.check_model(model_id)
        return _model_card(core, model_id, started)

    @app.post("/tokenize", **_documented(schema.TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        """vLLM's: {"prompt"} (completion form) or {"messages"} (chat form) -> the ids."""
        core.authenticate(request.headers.get("authorization"))
        body = await read_body(request, core.config.max_body_bytes)
        chat = _is_chat_tokenize(body)
        req = schema.parse(schema.TokenizeChatRequest if chat else schema.TokenizeRequest, body)
        core.validator.check_model(req.model)
        tok = _tokenizer(core)
        if chat:
            messages = [m.as_template_input() for m in req.messages]
            core.validator.check_text_chars(sum(len(m["content"]) for m in messages), "messages")
            ids = await asyncio.to_thread(_encode_chat, tok, messages, req.add_generation_prompt,
                                          req.add_special_tokens)
        else:
            core.validator.check_text_chars(len(req.prompt), "prompt")
            ids = await asyncio.to_thread(tok.encode_user_text, req.prompt, req.add_special_tokens)
        core.validator.check_token_count(len(ids), "messages" if chat else "prompt")
        return {"count": len(ids), "max_model_len": core.model.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.post("/detokenize", **_documented(schema.DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        """vLLM's: {"tokens"} -> {"prompt"} (special tokens skipped, as vLLM does)."""
        core.authenticate(request.headers.get("authorization"))
        req = schema.parse(schema.DetokenizeRequest, await read_body(request, core.config.max_body_bytes))
        core.validator.check_model(req.model)
        ids = core.validator.check_ids(req.tokens, "tokens") if req.tokens else []
        return {"prompt": await asyncio.to_thread(_tokenizer(core).decode, ids)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": KVFLEET_VERSION}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's status, no body."""
        serving, _ = await core.health()
        return Response(status_code=200 if serving else 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        serving, detail = await core.health()
        return JSONResponse({"status": "ok" if serving else "unavailable", "detail": detail,
                             "model": core.model.name}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_metrics_key(core.config.metrics_key, request.headers.get("authorization"))
        return Response(generate_latest(core.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _generate(core: GatewayCore, request: Request, model_cls, build, prefix: str,
                    operation: str) -> Response:
    """One generation request, its telemetry ended however it ends (the session's close ends it
    once a session is open; before that, here)."""
    telemetry = core.request(operation, request.headers.items())
    try:
        return await _generation(core, request, model_cls, build, prefix, telemetry)
    except GatewayError as e:
        telemetry.rejected(e)
        e.trace_id = telemetry.trace_id
        raise
    except (ClientGone, asyncio.CancelledError):
        telemetry.end("cancelled", 0)
        raise
    except BaseException:
        telemetry.end("error", 0)
        raise


async def _generation(core: GatewayCore, request: Request, model_cls, build, prefix: str,
                      telemetry: RequestTelemetry) -> Response:
    request_id = new_request_id(prefix)
    with telemetry.phase("gateway.auth"):
        key = core.authenticate(request.headers.get("authorization"))
        telemetry.named(request_id, key.tenant, key.traffic_class)
        core.quotas.refuse_early(key)          # before the body is read
        seat = core.door.enter(key.tenant)     # ... and the front door's bounds (door.py)
    try:
        return await _seated(core, request, model_cls, build, prefix, telemetry, request_id,
                             key, seat)
    except BaseException:
        seat.leave()         # refused or gone before a session had it (idempotent after one)
        raise


async def _seated(core: GatewayCore, request: Request, model_cls, build, prefix: str,
                  telemetry: RequestTelemetry, request_id: str, key: ApiKey,
                  seat: Seat) -> Response:
    """The request past the front door: its session leaves `seat` when it closes."""
    with telemetry.phase("gateway.validate"):
        body = await read_body(request, core.config.max_body_bytes)
        req = schema.parse(model_cls, body)
        classes = choose(core.config, key, request.headers.get(CLASS_HEADER))
        gen, shape = await build_generation(len(body), build, req, key, classes, core.validator,
                                           request_id)
    session = await core.open(gen, telemetry, shape.request_id, seat)
    shaper = Shaper(shape, core.model, gen.prompt_ids)
    headers = {"x-kvfleet-model": core.model.name,
               "x-kvfleet-quality-version": core.model.quality_version, "x-request-id": gen.request_id,
               CLASS_HEADER: gen.traffic_class.name}
    if gen.output_cap is not None:          # max_tokens was clamped to the class's output cap
        headers["x-kvfleet-output-cap"] = str(gen.output_cap)
    if telemetry.trace_id:
        headers[TRACE_HEADER] = telemetry.trace_id
    streaming = False
    try:
        first = await _until_disconnect(request, session.first())
        if telemetry.quality_version:     # the worker that serves (the fallback pool's, at S3)
            shaper.quality_version = headers["x-kvfleet-quality-version"] = telemetry.quality_version
        headers.update(admission_headers(session.run.plan))
        if shape.stream:
            streaming = True      # from here the stream's own close (and its background) owns it
            # a client that disconnects cancels the stream (Starlette's disconnect listener),
            # and the events' own `finally` closes the session; after a normal end, too
            gone = DisconnectSeen(request.receive)
            return StreamingResponse(openai_events(session, first, shaper, gone),
                                     media_type="text/event-stream",
                                     headers={**headers, **SSE_HEADERS},
                                     background=BackgroundTask(session.close))
        collected = await _until_disconnect(request, _collect(session, first))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except GatewayError as e:        # refused for time: a job, if the client prefers one
        accepted = None if session.sent_tokens else await jobs_api.offer(
            request, core, e, key, gen, shape.stream, body, prefix)
        if accepted is None:
            raise
        return accepted
    finally:
        if not streaming:
            session.close()
    timing = telemetry.timing()
    headers[TIMING_HEADER] = telemetry.timing_json(timing)
    body = shaper.body(collected, session.prompt_tokens, session.sent_tokens)
    return JSONResponse({**body, "timing": timing, **admission_fields(session.run.plan)},
                        headers=headers)


async def _collect(session: Session, first) -> Collected:
    """The whole generation; each chunk counts as sent once collected for the client's body."""
    collected = Collected()
    chunk = first
    while chunk is not None:
        collected.add(chunk)
        session.sent(chunk)
        chunk = None if chunk.finished else await session.next()
    return collected


async def _until_disconnect(request: Request, work: Awaitable):
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first.
    The body has been read by now, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> str:
    """The body as text, refused (413) as soon as it is known to exceed `limit` bytes: from its
    Content-Length before reading any of it, or while reading a chunked body. A client that goes
    away before the end of its body is ClientGone."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(declared, limit)
    buf = bytearray()
    try:
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise _too_large(f"more than {len(buf)}", limit)
    except ClientDisconnect:
        raise ClientGone(f"after {len(buf)} bytes of its body") from None
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"body is not valid UTF-8 (byte {e.start}: {e.reason})", None,
                          "invalid_utf8") from None


def _too_large(size: str, limit: int) -> GatewayError:
    return GatewayError(413, f"request body is {size} bytes; the limit is {limit} bytes",
                        code="body_too_large")


def _model_card(core: GatewayCore, name: str, created: int) -> dict:
    """vLLM's card (`root` the checkpoint, `parent` null, one permission entry) and the quality
    version that serves it."""
    return {"id": name, "object": "model", "created": created, "owned_by": "kvfleet",
            "root": core.model.path, "parent": None, "max_model_len": core.model.max_model_len,
            "permission": [{"id": f"modelperm-{name}", "object": "model_permission",
                            "created": created, "allow_create_engine": False,
                            "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}],
            "quality_version": core.model.quality_version}


def _is_chat_tokenize(body: str) -> bool:
    """vLLM tells its two /tokenize forms apart by `messages`."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False        # the schema's parse names the problem
    return isinstance(parsed, dict) and "messages" in parsed


def _tokenizer(core: GatewayCore):
    if core.model.tokenizer is None:
        raise bad_request("this model has no tokenizer: send and read token ids", None,
                          "no_tokenizer")
    return core.model.tokenizer


def _encode_chat(tok, messages: list[dict], add_generation_prompt: bool,
                 add_special_tokens: bool) -> list[int]:
    if tok.chat_template is None:
        raise bad_request("this model has no chat template: tokenize a prompt", "messages")
    try:
        ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise bad_request(f"messages do not fit the chat template: {e}", "messages") from None
    bos = tok.bos_token_id if add_special_tokens else None
    return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids


def _documented(body: type[BaseModel]) -> dict:
    """Route options stating the JSON body `body` (its schema is added by `_openapi`) and the
    error answers."""
    ref = {"$ref": f"#/components/schemas/{body.__name__}"}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
        "schema": ref}}}},
            "responses": {200: {"description": "the answer (a completion: JSON, or an SSE stream "
                                               "of chunks when `stream` is true)"},
                          **{s: {"description": d, **error} for s, d in _ERRORS.items()}}}


_ERRORS = {400: "invalid request: the message names the field and its limits",
           401: "missing or unknown API key", 404: "unknown model", 413: "body too large",
           429: "quota or overload, with Retry-After", 503: "no capacity or fleet unavailable"}
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _openapi(app: FastAPI, bodies: tuple[type[BaseModel], ...]) -> dict:
    """FastAPI's document, plus the generation bodies and OpenAI's error shape as components."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for body in bodies:
            own = body.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(own.pop("$defs", {}))
            schemas[body.__name__] = own
        schemas["Error"] = _ERROR_SCHEMA
        app.openapi_schema = doc
    return app.openapi_schema


async def _client_gone(request: Request, e: ClientGone) -> Response:
    """Nobody is left to answer: a line in the log, no traceback."""
    log.info("client went away %s on %s", e, request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    err = GatewayError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path)
    err = GatewayError(500, f"internal error: {type(e).__name__}", code="internal_error")
    return JSONResponse(err.body(), status_code=500)
