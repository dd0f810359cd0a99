"""`kvfleet bench burst`: a burst of concurrent requests at once against any OpenAI-compatible
endpoint (kvfleet, vLLM): the check that nothing that would be served in time is refused.

  --chats N (200 prompt tokens each) and --documents M (--doc-tokens each), all sent at once,
  --output-tokens out each, streamed (with the usage event), ignore_eos; prompts are seeded random token ids, so both
  servers see the same lengths whatever their tokenizer does.
Prints one JSON report: served / refused (by status and code, with a sample message and its
Retry-After), TTFT p50/p99 per class, ITL p50/p99 (the gaps between the arrivals that brought
text: events read together count once), output tokens/s over the burst (the servers' usage counts), and, against
kvfleet, `prediction_error`: |predicted - actual| / actual TTFT (p50 / p90, median signed) of the
served requests, from the `timing` object of each stream's last chunk. `--per-request` adds one
row per request: its class, status, predicted and actual TTFT (a refusal's predicted TTFT is in
its message). Printed, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

# Body pieces parsed within this long of the previous one came in the same network read: httpx
# hands each HTTP chunk of one socket read over separately, microseconds apart, so a read that
# brought several of the gateway's chunks would otherwise count as several near-zero gaps.
# Far below any engine step (the emulated 70B decode step is ~15 ms).
SAME_ARRIVAL_S = 0.001


def add_burst_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--chat-tokens", type=int, default=200)
    p.add_argument("--documents", type=int, default=0)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4000, help="token ids are drawn from [100, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--per-request", action="store_true",
                   help="also list each request: class, status, predicted and actual TTFT")


@dataclass
class Outcome:
    kind: str
    status: int = 0
    code: str | None = None
    message: str = ""
    retry_after: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0                         # events that brought text
    usage_tokens: int | None = None         # the server's own count (its usage event)
    predicted_ttft: float | None = None     # kvfleet's `timing.predicted_ttft_s`, when it sends one
    started: float = 0.0
    last: float = 0.0

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count where it sent one (an event may carry more
        than one token), else the events that brought text."""
        return self.usage_tokens if self.usage_tokens is not None else self.tokens

    def read(self, events: list[dict], now: float) -> bool:
        """The events one piece of the body brought, at `now`; False on an error event. TTFT is
        the first arrival with text; each later arrival with text adds one inter-token gap, since
        the last one. Events that arrived together (in one piece, or in pieces parsed within
        SAME_ARRIVAL_S of the last) are no gap the client waited: counted, the microseconds
        between parsing them made the ITL p50 0 once the server's events coalesced under load."""
        texts = 0
        for event in events:
            if "error" in event:
                self.code, self.message = "error_event", str(event["error"].get("message"))[:200]
                return False
            self.predicted_ttft = event.get("timing", {}).get("predicted_ttft_s",
                                                              self.predicted_ttft)
            texts += bool(event.get("choices") and event["choices"][0].get("text"))
            if event.get("usage"):                   # the last event (stream_options)
                self.usage_tokens = event["usage"].get("completion_tokens")
        if texts:
            if self.ttft is None:
                self.ttft = now - self.started
            elif now - self.last >= SAME_ARRIVAL_S:
                self.itls.append(now - self.last)
            self.last = now
            self.tokens += texts
        return True


async def one(client: httpx.AsyncClient, model: str, kind: str, ids: list[int], out: int) -> Outcome:
    o = Outcome(kind)
    body = {"model": model, "prompt": ids, "max_tokens": out, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    o.started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        o.status = r.status_code
        if r.status_code != 200:
            error = json.loads(await r.aread()).get("error", {})
            o.code, o.message = error.get("code"), str(error.get("message", ""))[:200]
            o.retry_after = r.headers.get("retry-after")
            return o
        async for events in sse_reads(r.aiter_bytes()):
            now = time.perf_counter()
            if not o.read(events, now):
                return o
    return o


async def sse_reads(chunks) -> AsyncIterator[list[dict]]:
    """The stream's SSE events, grouped by the network read that brought them (a read may hold
    several events, and an event may span reads)."""
    pending = b""
    async for chunk in chunks:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
        if events:
            yield events


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4)


async def burst(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(100, args.vocab) for _ in range(n)]  # noqa: E731
    jobs = ([("chat", ids(args.chat_tokens)) for _ in range(args.chats)]
            + [("document", ids(args.doc_tokens)) for _ in range(args.documents)])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=len(jobs) + 8)
    async with httpx.AsyncClient(base_url=args.endpoint, timeout=300, limits=limits,
                                 headers=headers) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one(client, model, kind, p, args.output_tokens)
                                          for kind, p in jobs))
        wall = time.perf_counter() - started
    return report(outcomes, wall, args.per_request)


def prediction_error(served: list[Outcome]) -> dict | None:
    """|predicted - actual| / actual TTFT over the served requests that carried a prediction."""
    signed = [(o.predicted_ttft - o.ttft) / o.ttft for o in served
              if o.predicted_ttft is not None and o.ttft]
    if not signed:
        return None
    return {"n": len(signed), "p50": pct([abs(e) for e in signed], 50),
            "p90": pct([abs(e) for e in signed], 90), "median_signed": pct(signed, 50)}


def rows(outcomes: list[Outcome]) -> list[dict]:
    return [{"kind": o.kind, "status": o.status, "code": o.code,
             "predicted_ttft_s": o.predicted_ttft and round(o.predicted_ttft, 4),
             "ttft_s": o.ttft and round(o.ttft, 4),
             "message": o.message if o.code else None} for o in outcomes]


def report(outcomes: list[Outcome], wall: float, per_request: bool = False) -> dict:
    served = [o for o in outcomes if o.status == 200 and o.code is None]
    refused = [o for o in outcomes if o not in served]
    by_kind = {}
    for kind in sorted({o.kind for o in outcomes}):
        ttfts = [o.ttft for o in served if o.kind == kind and o.ttft is not None]
        by_kind[kind] = {"sent": sum(o.kind == kind for o in outcomes),
                         "served": sum(o.kind == kind for o in served),
                         "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99)}
    itls = [x for o in served for x in o.itls]
    return {
        "served": len(served), "refused": len(refused),
        "refused_by": dict(Counter(f"{o.status} {o.code}" for o in refused)),
        "refusal_sample": ({"message": refused[0].message, "retry_after": refused[0].retry_after}
                           if refused else None),
        "classes": by_kind, "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99),
        "output_tokens_per_s": round(sum(o.output_tokens for o in served) / wall, 1),
        "wall_s": round(wall, 2), "prediction_error": prediction_error(served),
        **({"requests": rows(outcomes)} if per_request else {})}


def run_burst(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(burst(args)), indent=1))
    return 0
