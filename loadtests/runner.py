"""The open-loop load generator: sends a planned request list to an OpenAI-compatible endpoint.

Open loop: request i is sent at its planned arrival time whether or not earlier ones finished, so
a slow server sees its queue grow (a closed loop would slow down with it and hide the overload).
Each request is a streamed `/v1/completions` over httpx (`stream_options.include_usage`,
`ignore_eos` so outputs run to their planned length, as vLLM's benchmarks do); its record keeps
the send time, TTFT, every gap between token events (a token the server holds back, such as
part of a UTF-8 character, arrives with the next: that gap spans two tokens, as in vLLM's
benchmark_serving), end-to-end time, token counts, the overload stage kvfleet decided it in
(`x-kvfleet-stage`, refusals too), and for a failure the HTTP status, the reason (the OpenAI
error's code or type) and `Retry-After`.

The generator's own lateness (sent later than planned: the client is the bottleneck) is measured
and reported as `meta.send_lag_p99_s` rather than silently charged to the server.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

from loadtests.prompts import PromptBuilder, make_prompt_builder
from loadtests.records import RequestRecord, RunResult
from loadtests.workload import PlannedRequest, WorkloadSpec, plan_requests, slo_table

STAGE_HEADER = "x-kvfleet-stage"     # the overload stage kvfleet decided a request in


@dataclass(frozen=True)
class RunConfig:
    endpoint: str                        # http://host:port (no trailing /v1)
    model: str | None = None             # None: the first of /v1/models
    api_key: str | None = None           # for tenants without a key of their own
    tenant_keys: dict[str, str] = field(default_factory=dict)
    prompt_mode: str = "auto"            # auto | ids | text (loadtests/prompts.py)
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    progress: bool = False


async def run_workload(spec: WorkloadSpec, cfg: RunConfig) -> RunResult:
    planned = plan_requests(spec)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=cfg.endpoint.rstrip("/"), limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0)) as client:
        headers = _headers(cfg, spec.tenants[0].name if spec.tenants else "")
        model = cfg.model or await discover_model(client, headers)
        builder = await make_prompt_builder(client, model, headers, cfg.prompt_mode)
        records = [RequestRecord(p.index, p.traffic_class, p.tenant, p.at_s, prompt_tokens=p.prompt_tokens,
                                 max_tokens=p.max_tokens) for p in planned]
        progress = Progress(records, enabled=cfg.progress)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        t0 = time.perf_counter() + 0.05          # a moment for every task to be scheduled
        ticker = asyncio.create_task(progress.run(t0))
        await asyncio.gather(*(_one(client, cfg, model, builder, p, r, t0) for p, r in zip(planned, records)))
        duration = time.perf_counter() - t0
        ticker.cancel()
        progress.finish(duration)
    lags = sorted(r.send_s - r.scheduled_s for r in records if r.send_s is not None)
    meta = {"workload": spec.name, "workload_path": spec.path, "seed": spec.seed,
            "scale": {"rate": spec.scale.rate, "prompt": spec.scale.prompt, "output": spec.scale.output},
            "duration_s": duration, "planned_duration_s": spec.duration_s, "requests": len(records),
            "endpoint": cfg.endpoint, "model": model, "prompt_mode": builder.mode, "started_at": started_at,
            "client": f"httpx {httpx.__version__}",
            "send_lag_p99_s": lags[int(0.99 * (len(lags) - 1))] if lags else None}
    return RunResult(meta, slo_table(spec), {t.name: t.weight for t in spec.tenants}, records)


async def discover_model(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    r = await client.get("/v1/models", headers=headers)
    if r.status_code != 200 or not r.json().get("data"):
        raise RuntimeError(f"GET /v1/models failed (HTTP {r.status_code}: {r.text[:200]}); pass --model")
    return r.json()["data"][0]["id"]


async def _one(client: httpx.AsyncClient, cfg: RunConfig, model: str, builder: PromptBuilder,
               p: PlannedRequest, rec: RequestRecord, t0: float) -> None:
    body = {"model": model, "prompt": builder.build(p.prompt_tokens, p.prompt_seed), "max_tokens": p.max_tokens,
            "temperature": cfg.temperature, "stream": True, "stream_options": {"include_usage": True},
            "user": p.tenant}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    await asyncio.sleep(max(0.0, t0 + p.at_s - time.perf_counter()))
    sent = time.perf_counter()
    rec.send_s = sent - t0
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            await _stream(client, _headers(cfg, p.tenant), body, rec, sent)
    except TimeoutError:
        rec.error = "timeout"
    except httpx.ConnectError:
        rec.error = "connect"
    except httpx.HTTPError as e:
        rec.error = f"transport:{type(e).__name__}"
    rec.e2e_s = time.perf_counter() - sent


async def _stream(client: httpx.AsyncClient, headers: dict[str, str], body: dict,
                  rec: RequestRecord, sent: float) -> None:
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        rec.status = resp.status_code
        rec.stage = resp.headers.get(STAGE_HEADER)
        if resp.status_code != 200:
            await resp.aread()
            rec.error, rec.detail = _reason(resp), resp.text[:300]
            if "retry-after" in resp.headers:
                rec.retry_after_s = _float(resp.headers["retry-after"])
            return
        last, done = None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            now = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                rec.error = f"stream_error:{_error_kind(event['error'])}"
                rec.detail = str(event["error"].get("message") if isinstance(event["error"], dict)
                                 else event["error"])[:300]
                return
            if isinstance(event.get("timing"), dict):
                rec.timing = {k: float(v) for k, v in event["timing"].items()
                              if isinstance(v, (int, float))}
            if event.get("usage"):
                rec.prompt_tokens = event["usage"].get("prompt_tokens", rec.prompt_tokens)
                rec.output_tokens = event["usage"].get("completion_tokens", rec.output_tokens)
            for choice in event.get("choices") or []:
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                if choice.get("text"):
                    if last is None:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    if not event.get("usage"):
                        rec.output_tokens += 1
        if not done:
            rec.error = "truncated"          # the stream ended without [DONE]


def _headers(cfg: RunConfig, tenant: str) -> dict[str, str]:
    key = cfg.tenant_keys.get(tenant) or cfg.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _reason(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error") or {}
    except (json.JSONDecodeError, AttributeError):
        return f"http_{resp.status_code}"
    return f"http_{resp.status_code}:{_error_kind(err)}"


def _error_kind(err: object) -> str:
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "error")
    return "error"


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


class Progress:
    """A one-line live progress bar on stderr: sent / done / errors / in flight."""

    def __init__(self, records: list[RequestRecord], enabled: bool) -> None:
        self.records, self.enabled = records, enabled

    async def run(self, t0: float) -> None:
        while self.enabled:
            self._draw(time.perf_counter() - t0)
            await asyncio.sleep(0.5)

    def finish(self, elapsed: float) -> None:
        if self.enabled:
            self._draw(elapsed)
            sys.stderr.write("\n")

    def _draw(self, elapsed: float) -> None:
        n = len(self.records)
        sent = sum(r.send_s is not None for r in self.records)
        done = sum(r.e2e_s is not None for r in self.records)
        errors = sum(r.error is not None for r in self.records)
        width = 30
        bar = "#" * (width * done // max(1, n))
        sys.stderr.write(f"\r[{bar:<{width}}] {done}/{n} done  sent {sent}  in flight {sent - done}"
                         f"  errors {errors}  {elapsed:6.1f}s")
        sys.stderr.flush()
