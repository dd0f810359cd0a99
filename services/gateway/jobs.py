"""Asynchronous jobs (DESIGN section 5, step 6: a request refused for time is "offered
asynchronous processing"): a non-streamed request that asked for it (`Prefer: respond-async`,
RFC 7240) and that the router refused as OVERLOADED, in a class other than the interactive one,
is answered 202 with a job; the job runs here in the background.

A job runs through the same path as any request (validate, quotas, Router.Admit, the plan's
workers: GatewayCore.open), under the API key that created it. A refusal that may pass later
(429 overloaded or quota, 503) is retried after its Retry-After hint (at least MIN_RETRY_S, at
most MAX_RETRY_S) until the job's deadline; anything else, or the deadline, fails the job with
the error as the client would have had it. Its tokens are charged to the tenant like any
request's (the session's close).

Jobs live in Redis (services/state/jobs.py). The gateway that accepts a job owns it and renews
its lease every `lease_s / 3`; each renewal also claims jobs whose owner's lease lapsed (a
gateway that died: the job restarts from the beginning here). A gateway that stops lets its
jobs' leases lapse at once, so the next gateway to look takes them over.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from services.gateway import errors
from services.gateway import openai_schema as schema
from services.gateway.auth import key_id
from services.gateway.classes import ClassChoice
from services.gateway.config import ApiKey
from services.gateway.core import GatewayCore, build_generation, new_request_id
from services.gateway.openai_responses import Collected, Shaper
from services.gateway.validation import Generation
from services.state.jobs import Job, JobStore

log = logging.getLogger(__name__)

MIN_RETRY_S = 0.05
MAX_RETRY_S = 30.0
DEFAULT_LEASE_S = 10.0
RETRYABLE_STATUSES = (429, 503)


@dataclass(frozen=True)
class Kind:
    """One kind of request a job may hold: its schema, builder, id prefix and operation."""
    request: type
    build: object
    prefix: str
    operation: str


KINDS = {"completion": Kind(schema.CompletionRequest, schema.completion, "cmpl", "text_completion"),
         "chat": Kind(schema.ChatCompletionRequest, schema.chat, "chatcmpl", "chat")}


def _error_json(e: errors.GatewayError) -> str:
    return json.dumps({**e.body()["error"], "status": e.status})


def job_view(job: Job) -> dict:
    """What GET /v1/jobs/{id} answers (and the 202's body)."""
    return {"id": job.id, "object": "kvfleet.job", "status": job.state,
            "created_at": int(job.created_s), "traffic_class": job.traffic_class,
            "attempts": job.attempts,
            "result": json.loads(job.result) if job.result else None,
            "error": json.loads(job.error) if job.error else None}


class JobRunner:
    def __init__(self, core: GatewayCore, store: JobStore, holder: str,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.core = core
        self.store = store
        self.holder = holder
        self.lease_s = lease_s
        self._tasks: dict[str, asyncio.Task] = {}

    # ------------------------------------------------------------------- accept
    async def submit(self, kind: str, body: str, key: ApiKey, gen: Generation,
                     first_wait_s: float) -> Job:
        """Store a new job for a request just refused, and start it after `first_wait_s`."""
        now = time.time()
        job = Job(id=f"job-{uuid.uuid4().hex}", tenant=key.tenant, key_id=key_id(key), kind=kind,
                  traffic_class=gen.traffic_class.name, body=body, created_s=now,
                  deadline_s=now + self.core.config.job_deadline_s, owner=self.holder,
                  updated_s=now)
        await self.store.create(job, self.lease_s, self.core.config.job_ttl_s)
        self._start(job.id, first_wait_s)
        return job

    async def read(self, job_id: str, tenant: str) -> Job | None:
        """The job, if it exists and `tenant` created it."""
        job = await self.store.get(job_id)
        return job if job is not None and job.tenant == tenant else None

    # ----------------------------------------------------------------- running
    def _start(self, job_id: str, wait_s: float = 0.0) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job_id, wait_s))
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    async def _run(self, job_id: str, wait_s: float) -> None:
        try:
            await self._until_done(job_id, wait_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:      # a bug or Redis gone: the lease lapses, another takes over
            log.exception("job %s stopped: %s", job_id, e)

    async def _until_done(self, job_id: str, wait_s: float) -> None:
        while True:
            job = await self.store.get(job_id)
            if job is None or job.state not in ("queued", "running"):
                return
            left = job.deadline_s - time.time()
            if wait_s >= left:
                await self._fail(job, self._deadline_error())
                return
            await asyncio.sleep(wait_s)
            await self.store.update(job_id, state="running", attempts=job.attempts + 1,
                                    updated_s=time.time())
            try:
                result = await self._attempt(job)
            except errors.GatewayError as e:
                if e.status not in RETRYABLE_STATUSES:
                    await self._fail(job, e)
                    return
                wait_s = min(MAX_RETRY_S, max(MIN_RETRY_S, e.retry_after or MIN_RETRY_S))
                await self.store.update(job_id, state="queued", updated_s=time.time(),
                                        error=json.dumps(e.body()["error"]))
                continue
            await self.store.finish(job_id, "completed", self.core.config.job_ttl_s,
                                    result=json.dumps(result), error="")
            return

    async def _fail(self, job: Job, e: errors.GatewayError) -> None:
        await self.store.finish(job.id, "failed", self.core.config.job_ttl_s,
                                error=_error_json(e))

    def _deadline_error(self) -> errors.GatewayError:
        return errors.GatewayError(
            504, f"the job was not completed before its deadline "
            f"({self.core.config.job_deadline_s:g} s after it was accepted)",
            code="job_deadline_exceeded")

    async def _attempt(self, job: Job) -> dict:
        """One run of the job's request; its OpenAI response body."""
        key = self.core.keys.find(job.key_id)
        if key is None:
            raise errors.GatewayError(401, "the API key that created this job is no longer "
                                      "configured", code="invalid_api_key")
        kind = KINDS[job.kind]
        telemetry = self.core.request(kind.operation, ())
        try:
            req = schema.parse(kind.request, job.body)
            classes = ClassChoice.fixed(self.core.config.traffic_class(job.traffic_class))
            gen, shape = await build_generation(len(job.body), kind.build, req, key, classes,
                                               self.core.validator, new_request_id(kind.prefix))
            session = await self.core.open(gen, telemetry, shape.request_id)
        except errors.GatewayError as e:
            telemetry.rejected(e)
            raise
        try:
            chunk = await session.first()
            collected = Collected()
            while chunk is not None:
                collected.add(chunk)
                session.sent(chunk)
                chunk = None if chunk.finished else await session.next()
        finally:
            session.close()
        shaper = Shaper(shape, self.core.model, gen.prompt_ids)
        shaper.quality_version = telemetry.quality_version or shaper.quality_version
        body = shaper.body(collected, session.prompt_tokens, session.sent_tokens)
        return {**body, "timing": telemetry.timing()}

    # ---------------------------------------------------------------- leases
    async def maintain_forever(self) -> None:
        """Renew this gateway's jobs' leases and take over lapsed ones, every lease_s / 3."""
        while True:
            try:
                await self.maintain()
            except Exception as e:     # Redis down: the next round tries again
                log.warning("job leases: %s", e)
            await asyncio.sleep(self.lease_s / 3)

    async def maintain(self) -> None:
        lost = await self.store.renew(self.holder, list(self._tasks), self.lease_s)
        for job_id in lost:            # another gateway took it over: stop ours
            task = self._tasks.pop(job_id, None)
            if task is not None:
                task.cancel()
        claimed = await self.store.claim(self.holder, self.lease_s, self.core.keys.ids(),
                                         self.core.config.job_ttl_s,
                                         _error_json(self._deadline_error()))
        for job_id in claimed:
            if job_id not in self._tasks:
                log.info("taking over job %s", job_id)
                self._start(job_id)

    async def close(self) -> None:
        """Stop running jobs and let their leases lapse, so another gateway resumes them."""
        tasks, self._tasks = dict(self._tasks), {}
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        try:
            await self.store.release(list(tasks))
        except Exception as e:
            log.warning("could not release job leases (they lapse within %s s): %s",
                        self.lease_s, e)
