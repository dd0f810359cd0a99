"""The REST side of asynchronous jobs (services/gateway/jobs.py runs them).

  Prefer: respond-async     on POST /v1/completions or /v1/chat/completions (RFC 7240): if the
                            fleet refuses the request for time (the router's OVERLOADED), it is
                            accepted as a job: 202, `Location: /v1/jobs/{id}`,
                            `Preference-Applied: respond-async`, the job as the body. Only
                            non-streamed requests of a class other than the interactive one; any
                            other request, or another refusal, is answered as without the header.
  GET /v1/jobs/{id}         the job: {"id", "object": "kvfleet.job", "status": queued | running |
                            completed | failed, "created_at", "traffic_class", "attempts",
                            "result": the completion body once completed, "error": the error
                            object once failed (while queued: the last refusal)}. Only the
                            tenant that created it may read it: 404 for anyone else.
"""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.classes import CLASS_HEADER
from services.gateway.config import ApiKey
from services.gateway.core import GatewayCore
from services.gateway.errors import GatewayError
from services.gateway.jobs import JobRunner, job_view
from services.gateway.validation import Generation

PREFER_ASYNC = re.compile(r"(^|[,;\s])respond-async($|[,;\s=])", re.IGNORECASE)
KIND_OF_PREFIX = {"cmpl": "completion", "chatcmpl": "chat"}


def register(app: FastAPI, core: GatewayCore, jobs: JobRunner | None) -> None:
    app.state.jobs = jobs

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> JSONResponse:
        key = core.authenticate(request.headers.get("authorization"))
        job = await jobs.read(job_id, key.tenant) if jobs is not None else None
        if job is None:
            raise GatewayError(404, f"no job {job_id!r}", code="not_found", param="job_id")
        return JSONResponse(job_view(job), headers={CLASS_HEADER: job.traffic_class})


def wants_async(request: Request) -> bool:
    return any(PREFER_ASYNC.search(v) for v in request.headers.getlist("prefer"))


async def offer(request: Request, core: GatewayCore, refusal: GatewayError, key: ApiKey,
                gen: Generation, stream: bool, body: str, prefix: str) -> JSONResponse | None:
    """The 202 of a job for a request the fleet just refused, or None (answer the refusal)."""
    jobs: JobRunner | None = getattr(request.app.state, "jobs", None)
    if (jobs is None or stream or refusal.reason != "OVERLOADED" or not wants_async(request)
            or gen.traffic_class.name == core.config.scheduler.interactive_class):
        return None
    try:
        job = await jobs.submit(KIND_OF_PREFIX[prefix], body, key, gen,
                                refusal.retry_after or 0.0)
    except Exception as e:         # the job store is down: the refusal stands, and says so
        refusal.message += f" (asynchronous processing unavailable: {type(e).__name__})"
        return None
    return JSONResponse(job_view(job), status_code=202, headers={
        "Location": f"/v1/jobs/{job.id}", "Preference-Applied": "respond-async",
        "Retry-After": str(refusal.retry_after_s),   # when polling may first find a change
        CLASS_HEADER: gen.traffic_class.name, "x-request-id": gen.request_id})
