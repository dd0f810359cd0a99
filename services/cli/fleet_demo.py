"""`kvfleet demo --fleet` (what `make demo` runs): `kvfleet up` on SmolLM2-135M-Instruct (`--model
smollm2`, the default; made into the cache once, about a minute), then a short open-loop mixed run
through the OpenAI REST API, every request a streamed (SSE) /v1/chat/completions:

  chats      short real questions (QUESTIONS) from three tenants, Poisson arrivals, class interactive
  documents  a long real text (DOCUMENT repeated to --doc-tokens) to summarize, from a fourth
             tenant, arriving while chats stream, class document

Prints a few question -> answer pairs, then TTFT and ITL p50/p99 per class, then stops the fleet
cleanly. TTFT is from the send to the first event that carries text; ITL is between such events.

Sizes depend on the model (SIZES): SmolLM2 in fp32 on a small CPU box gets fewer, slower chats and
shorter documents than the tiny model (`--model tiny`, the tests' model), and the demo says so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from services.cli.launcher import Launcher
from services.state.redis_server import EmbeddedRedis, RedisNotInstalledError, RedisServerProcess
from services.cli.up import model_dir, start_fleet
from services.protocol.timeouts import Timeouts
from services.cli.engine_demo import SIZES, DemoSize, demo_size, model_kind, pct
from services.engine import config as engine_config
from services.engine.config import KV_CACHE_MIB, SIM_FLAGS

TENANTS = {"acme": "interactive", "globex": "interactive", "initech": "interactive",
           "docs": "document"}
CHAT_TENANTS = [t for t, c in TENANTS.items() if c == "interactive"]
DEFAULT_MODEL = "smollm2"
SHOWN_ANSWERS = 6

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Give me a synonym for the word happy.",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about the sea.",
    "Why is the sky blue? Answer in one sentence.",
    "What is photosynthesis?",
    "Suggest a name for a pet goldfish.",
    "How do I boil an egg?",
    "Explain what a CPU does in one sentence.",
    "Give me two tips for sleeping better.",
    "At what temperature does water boil, in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest ocean on Earth?",
    "Describe a cat in one sentence.",
    "What does HTTP stand for?",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
    "What is the opposite of the word ancient?",
    "Write a short greeting for a birthday card.",
    "What is gravity?",
    "Recommend a kind of book for a long train ride.",
    "What language is spoken in Brazil?",
    "How do plants get water?",
    "What is a good way to start learning to cook?",
    "Why do we have seasons?",
]

DOCUMENT = (
    "Lighthouses were built along dangerous coasts to warn ships of rocks and shallow water. "
    "Early lighthouses burned wood or coal in an open fire at the top of a stone tower, and the "
    "keeper had to carry fuel up the stairs several times a night. Later, oil lamps with "
    "polished reflectors made the light brighter, and in the nineteenth century the Fresnel lens "
    "focused the light of a single lamp into a beam that could be seen more than twenty miles "
    "away. Each lighthouse had its own pattern of flashes, so that sailors could tell which one "
    "they were looking at. Keepers lived in small houses beside the tower with their families, "
    "cleaned the lens every day and wrote the weather in a log. Today most lighthouses are "
    "automatic, run by electricity and checked by engineers a few times a year.\n\n")
DOCUMENT_ASK = "Summarize the text above in one sentence."


@dataclass(frozen=True)
class Ask:
    """One chat request of the run."""
    at_s: float                  # offset from the start of the run
    tenant: str
    text: str                    # the user message (a document: the text and DOCUMENT_ASK)
    max_tokens: int

    @property
    def traffic_class(self) -> str:
        return TENANTS[self.tenant]


@dataclass
class Result:
    ask: Ask
    sent: float
    times: list[float] = field(default_factory=list)    # arrival of each event carrying text
    answer: str = ""
    status: int = 200


def document_text(tokens: int, count_tokens) -> str:
    """DOCUMENT repeated until it is about `tokens` tokens long, then the question."""
    per_copy = max(1, count_tokens(DOCUMENT))
    return DOCUMENT * max(1, round(tokens / per_copy)) + DOCUMENT_ASK


def workload(size: DemoSize, doc: str, seed: int) -> list[Ask]:
    """Poisson chat arrivals cycling through QUESTIONS (in order: the first asks for the
    capital of France) and the chat tenants, plus `size.documents` documents arriving early,
    while chats are streaming."""
    rng = random.Random(seed)
    t, asks = 0.0, []
    for i in range(size.chats):
        t += rng.expovariate(size.rate)
        asks.append(Ask(t, CHAT_TENANTS[i % len(CHAT_TENANTS)], QUESTIONS[i % len(QUESTIONS)],
                        size.chat_tokens))
    span = max(t, 1.0)
    asks += [Ask(span * (0.15 + 0.5 * j / max(1, size.documents)), "docs", doc, size.doc_output)
             for j in range(size.documents)]
    return sorted(asks, key=lambda a: a.at_s)


@dataclass(frozen=True)
class FleetTuning:
    """The fleet's knobs that depend on how long one engine step takes."""
    token_budget: int
    chunk_size: int
    max_running: int
    heartbeat_ttl_s: float
    reservation_s: float         # a document's decode KV is reserved before it queues to prefill
    ttft_scale: float = 1.0      # the classes' TTFT targets times this (DESIGN's are for a GPU)

    def timeouts(self) -> Timeouts:
        return Timeouts(heartbeat_ttl_s=self.heartbeat_ttl_s, reservation_s=self.reservation_s).check()


# A worker's heartbeat takes its stats from the engine core, which answers between steps: a step
# longer than heartbeat_ttl_s takes a busy, live worker out of the fleet (503 "no healthy prefill
# worker"). SmolLM2 in fp32 on one CPU thread runs a 256-token prefill step in 1.2-2 s (more on a
# loaded host), so the real model gets 64-token steps and a 6-s heartbeat expiry. Its documents
# wait 20-25 s for their first token behind the chats, near the default 30-s reservation: 90 s.
# Its chats cannot make the interactive class's 1-s TTFT target here (one prefill step alone takes
# about a second on a loaded host), and the routers refuse a request whose own prefill breaks its
# target, so the real model's demo runs the classes with CPU-sized targets (x10).
TUNING = {"tiny": FleetTuning(token_budget=256, chunk_size=128, max_running=256,
                              heartbeat_ttl_s=Timeouts().heartbeat_ttl_s,
                              reservation_s=Timeouts().reservation_s),
          "real": FleetTuning(token_budget=64, chunk_size=64, max_running=32, heartbeat_ttl_s=6.0,
                              reservation_s=90.0, ttft_scale=10.0)}


def write_configs(tmp: Path, tuning: FleetTuning) -> tuple[str, str]:
    """An engine config naming the tenants, and one API key per tenant."""
    classes = [{**asdict(c), "ttft_target_s": c.ttft_target_s * tuning.ttft_scale}
               for c in (engine_config.INTERACTIVE, engine_config.DOCUMENT, engine_config.BATCH)]
    engine = {"scheduler": {"token_budget": tuning.token_budget, "chunk_size": tuning.chunk_size,
                            "max_running": tuning.max_running, "reject_late": False,
                            "default_tenant": "acme", "classes": classes,
                            "tenants": [{"name": t, "classes": [c]} for t, c in TENANTS.items()]}}
    keys = [{"key": f"sk-demo-{t}", "tenant": t, "traffic_class": c, "max_concurrent_streams": 64,
             "requests_per_minute": 10_000, "tokens_per_minute": 10_000_000}
            for t, c in TENANTS.items()]
    (tmp / "engine.yaml").write_text(yaml.safe_dump(engine))
    (tmp / "keys.yaml").write_text(yaml.safe_dump(keys))
    return str(tmp / "engine.yaml"), str(tmp / "keys.yaml")


class StreamError(RuntimeError):
    """A generation answered something other than 200 (the status and the start of the body)."""


async def sse_events(client: httpx.AsyncClient, path: str, body: dict,
                     headers: dict[str, str] | None = None) -> AsyncIterator[tuple[float, dict]]:
    """POST `body` on `client` (its connections kept alive between requests, as the OpenAI client
    does); yield (seconds since the send, event) per SSE `data:` event until [DONE]."""
    t0 = time.perf_counter()
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}")
        async for line in r.aiter_lines():
            if line.startswith("data: [DONE]"):
                return
            if line.startswith("data: "):
                yield time.perf_counter() - t0, json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, model: str, ask: Ask, start: float) -> Result:
    await asyncio.sleep(max(0.0, start + ask.at_s - time.perf_counter()))
    result = Result(ask, time.perf_counter())
    body = {"model": model, "messages": [{"role": "user", "content": ask.text}],
            "max_tokens": ask.max_tokens, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer sk-demo-{ask.tenant}"}
    try:
        async for _, event in sse_events(client, "/v1/chat/completions", body, headers):
            if "error" in event:                         # a failure after the 200 was sent
                raise StreamError(f"mid-stream: {event['error'].get('message')}")
            text = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if text:
                result.times.append(time.perf_counter())
                result.answer += text
    except (StreamError, httpx.HTTPError) as e:
        result.status, result.answer = 500, str(e)
    return result


async def drive(address: str, asks: list[Ask]) -> list[Result]:
    limits = httpx.Limits(max_connections=len(asks) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models", headers={
            "Authorization": "Bearer sk-demo-acme"})).json()["data"][0]["id"]
        start = time.perf_counter()
        return await asyncio.gather(*(one_request(client, model, a, start) for a in asks))


def one_line(text: str, width: int = 150) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def show_answers(results: list[Result], n: int = SHOWN_ANSWERS) -> None:
    chats = [r for r in results if r.ask.traffic_class == "interactive"][:n]
    docs = [r for r in results if r.ask.traffic_class == "document"][:1]
    print()
    for r in chats:
        print(f"Q: {r.ask.text}\nA: {one_line(r.answer)}\n")
    for r in docs:
        print(f"Q: [{len(r.ask.text)} characters of text] {DOCUMENT_ASK}\nA: {one_line(r.answer)}")


def show_errors(results: list[Result]) -> None:
    failed = [r for r in results if r.status != 200]
    for why in sorted({one_line(r.answer, 200) for r in failed}):
        print(f"error ({sum(one_line(r.answer, 200) == why for r in failed)}x): {why}")


def report(results: list[Result]) -> None:
    by = defaultdict(list)
    for r in results:
        by[r.ask.traffic_class].append(r)
    print(f"\n{'class':<12}{'reqs':>5}{'errors':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}")
    for cls, rs in sorted(by.items()):
        ok = [r for r in rs if r.status == 200 and r.times]
        ttft = [r.times[0] - r.sent for r in ok]
        itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
        print(f"{cls:<12}{len(rs):>5}{len(rs) - len(ok):>7}{1e3 * pct(ttft, 50):>8.0f}ms"
              f"{1e3 * pct(ttft, 99):>8.0f}ms{1e3 * pct(itl, 50):>7.1f}ms{1e3 * pct(itl, 99):>7.1f}ms")


def describe(model: str, size: DemoSize, tuning: FleetTuning) -> str:
    line = (f"{size.chats} chats (real questions, up to {size.chat_tokens} tokens out) + "
            f"{size.documents} documents of ~{size.doc_tokens} tokens, Poisson {size.rate}/s, "
            f"streamed over SSE (/v1/chat/completions)")
    if model_kind(model) == "real":
        tiny, fast = SIZES["tiny"], TUNING["tiny"]
        line += (f"\n(sized for a real model on a small CPU box: the tiny model's demo sends "
                 f"{tiny.chats} chats at {tiny.rate}/s and documents of {tiny.doc_tokens} tokens, "
                 f"with {fast.token_budget}-token steps; here steps are {tuning.token_budget} "
                 f"tokens, a worker's heartbeat lives {tuning.heartbeat_ttl_s:g} s and a decode "
                 f"reservation {tuning.reservation_s:g} s)")
    return line


def run_fleet_demo(args: argparse.Namespace) -> int:
    args = argparse.Namespace(**{**vars(args), "model": args.model or DEFAULT_MODEL})
    size = demo_size(args)
    path = checkpoint(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-demo-"))
    tuning = TUNING[model_kind(args.model)]
    engine_yaml, keys_yaml = write_configs(tmp, tuning)
    up = argparse.Namespace(model=path, mode=args.mode, prefill=1, decode=1,
                            host="127.0.0.1", http_port=0, grpc_port=0, redis_url=None,
                            api_keys=keys_yaml, kv_backend="tcp", kv_cache_mib=KV_CACHE_MIB,
                            insecure=False, config=engine_yaml,
                            **{flag: getattr(args, flag, None)
                               for flag in ("engine", *SIM_FLAGS, "sim_step_ms")})
    redis, launcher = start_redis(), Launcher()
    try:
        endpoints = start_fleet(up, launcher, redis.url, tuning.timeouts())
        engine = ", simulated engine core" if up.engine == "sim" else ""
        print(f"kvfleet up ({args.mode}, model {args.model}{engine}): gateway "
              f"http://{endpoints['gateway']}/v1; {len(launcher.children)} processes "
              f"({', '.join(launcher.children)})")
        asks = workload(size, document_text(size.doc_tokens, token_counter(path)), args.seed)
        print(describe(args.model, size, tuning), flush=True)
        t0 = time.perf_counter()
        results = asyncio.run(drive(endpoints["gateway"], asks))
        show_answers(results)
        show_errors(results)
        report(results)
        print(f"\nwall time {time.perf_counter() - t0:.1f}s")
        return 0 if all(r.status == 200 for r in results) else 1
    finally:
        launcher.stop_all()
        redis.stop()
        print("fleet stopped: every process it started has exited")


def start_redis() -> RedisServerProcess | EmbeddedRedis:
    """A redis-server child (`make` installs it), else the embedded one, which answers from a
    thread of this process, the one that also streams every request: with a real model keeping
    the cores busy, its replies came later than the workers' 1-s Redis command timeout."""
    try:
        return RedisServerProcess().start()
    except RedisNotInstalledError:
        return EmbeddedRedis().start()


def checkpoint(model: str) -> str:
    """The model's directory; a named model is made into the cache first if it is not there."""
    from services.engine.model_zoo import FILES, cache_root, named  # noqa: PLC0415
    known = named(model)
    if known is not None and not os.path.isdir(model) \
            and not all((cache_root() / known.name / f).is_file() for f in FILES):
        print(f"making {known.name} into {cache_root() / known.name} (once, about a minute)",
              flush=True)
    return model_dir(model)


def token_counter(path: str):
    from services.engine.tokenizer import Tokenizer  # noqa: PLC0415
    tok = Tokenizer.from_dir(path)
    return lambda text: len(tok.encode_user_text(text, add_special_tokens=False))
