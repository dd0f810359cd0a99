"""`kvfleet bench fleet`: what the fleet adds over the in-process engine, on loopback.

  added TTFT        one ~200-token prompt at a time: median TTFT through the gateway (REST, SSE)
                    minus the median in-process TTFT of the same prompts
  added per token   one 128-token stream at a time: (last - first token) / 127, median, fleet minus
                    engine (the inter-token latency the serving path adds)
  tok/s             32 concurrent 200-in/64-out streams: output tokens/s, fleet and engine
The fleet is `kvfleet up`'s (services/cli/up.py: same processes, same flags, a real redis-server
when one is installed). The client keeps its connections open (httpx keep-alive), as the OpenAI
client does. Fleet and engine samples alternate (the engine sits in this process, idle while the
fleet serves), so the machine's drift lands on both sides alike. Printed, never asserted; the
figures live in docs/benchmarks.md. KV transfer GB/s: `python -m services.cli.kv_bench`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.cli.fleet_demo import sse_events

PROMPT_TOKENS = 200
TTFT_OUTPUT = 16
ITL_OUTPUT, ITL_REPEATS = 128, 5
CONCURRENT, CONCURRENT_OUTPUT = 32, 64
# one scheduler for both sides (the fleet's workers get it as `kvfleet up --config`); no late
# rejection, so that a loaded small host measures the path instead of refusing the batch
SCHEDULER = {"token_budget": 2048, "chunk_size": 512, "reject_late": False}


@dataclass(frozen=True)
class Side:
    """One side's samples: TTFT of each lone request, time per token of each lone long stream,
    and the output tokens/s of the concurrent batch."""

    ttft_s: list[float]
    per_token_s: list[float]
    tok_s: float

    def summary(self) -> dict:
        return {"ttft_ms": 1e3 * statistics.median(self.ttft_s),
                "per_token_ms": 1e3 * statistics.median(self.per_token_s), "tok_s": self.tok_s,
                "samples": {"ttft": len(self.ttft_s), "per_token": len(self.per_token_s)}}


def bench_result(fleet: Side, engine: Side, **about) -> dict:
    """The one JSON object `--json` prints: the headline differences first, then both sides.
    `about` names the run (mode, kv_backend, model, threads ...)."""
    f, e = fleet.summary(), engine.summary()
    return {"added_ttft_ms": f["ttft_ms"] - e["ttft_ms"],
            "added_per_token_ms": f["per_token_ms"] - e["per_token_ms"],
            "fleet_tok_s": f["tok_s"], "engine_tok_s": e["tok_s"],
            "fleet_over_engine_tok_s": f["tok_s"] / e["tok_s"] if e["tok_s"] else None,
            **about, "fleet": f, "engine": e}


# ----------------------------------------------------------------------------- one side each

async def fleet_times(client: httpx.AsyncClient, model: str, ids: list[int], n: int) -> list[float]:
    """One streaming completion through the gateway: [first token s, last token s, tokens]."""
    first = last = None
    tokens = 0
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async for t, event in sse_events(client, "/v1/completions", body):
        if event.get("choices"):
            last = t
            first = t if first is None else first
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return [first, last, tokens]


def engine_times(engine, ids: list[int], n: int) -> list[float]:
    """The same [first token s, last token s, tokens] for the in-process engine."""
    from services.engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = last = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                last = time.perf_counter() - t0
                first = last if first is None else first
                tokens += len(out.new_token_ids)
    return [first, last, tokens]


def per_token(times: list[float]) -> float:
    first, last, tokens = times
    return (last - first) / max(1, tokens - 1)


def engine_tok_s(engine, prompts: list[list[int]]) -> float:
    from services.engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=CONCURRENT_OUTPUT, temperature=0,
                                                   ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


@dataclass(frozen=True)
class Prompts:
    """Distinct random prompts for each phase, so that no measured prompt is a prefix-cache hit
    in the fleet (the in-process engine runs without prefix caching)."""

    warm_up: list[list[int]]
    lone: list[list[int]]                 # one per TTFT repeat
    long: list[int]                       # the ITL stream's (a hit after its first run: ITL only)
    concurrent: list[list[int]]

    @classmethod
    def draw(cls, repeats: int, vocab: int, seed: int = 0) -> Prompts:
        from services.engine.workload import random_prompt
        rng = random.Random(seed)
        some = lambda n: [random_prompt(rng, PROMPT_TOKENS, vocab) for _ in range(n)]  # noqa: E731
        return cls(some(CONCURRENT), some(repeats), some(1)[0], some(CONCURRENT))


async def paired_sides(address: str, engine, prompts: Prompts) -> tuple[Side, Side]:
    """Fleet and engine samples taken in turns: one fleet request, then the same prompt in the engine."""
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # warm-up: every pooled connection opened, both sides past their first request
        await asyncio.gather(*(fleet_times(client, model, p, 4) for p in prompts.warm_up))
        engine_times(engine, prompts.warm_up[0], 4)
        ttft: dict[str, list[float]] = {"fleet": [], "engine": []}
        for ids in prompts.lone:
            ttft["fleet"].append((await fleet_times(client, model, ids, TTFT_OUTPUT))[0])
            ttft["engine"].append(engine_times(engine, ids, TTFT_OUTPUT)[0])
        itl: dict[str, list[float]] = {"fleet": [], "engine": []}
        for _ in range(ITL_REPEATS):
            itl["fleet"].append(per_token(await fleet_times(client, model, prompts.long, ITL_OUTPUT)))
            itl["engine"].append(per_token(engine_times(engine, prompts.long, ITL_OUTPUT)))
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(fleet_times(client, model, p, CONCURRENT_OUTPUT)
                                      for p in prompts.concurrent))
        fleet_tps = sum(r[2] for r in runs) / (time.perf_counter() - t0)
    return (Side(ttft["fleet"], itl["fleet"], fleet_tps),
            Side(ttft["engine"], itl["engine"], engine_tok_s(engine, prompts.concurrent)))


# ----------------------------------------------------------------------------- the fleet, the engine

def up_args(args: argparse.Namespace, config: str) -> argparse.Namespace:
    """`kvfleet up`'s own arguments for this bench (its defaults for everything else), on ports
    the OS picks, with the engine config file `config`."""
    from services.cli.up import add_up_args
    from services.engine.config import sim_args
    parser = argparse.ArgumentParser(prog="kvfleet up")
    add_up_args(parser)
    device = ["--device", args.device] if getattr(args, "device", None) else []
    if getattr(args, "cuda_graphs", None):
        device += ["--cuda-graphs", args.cuda_graphs]
    return parser.parse_args(["--model", args.model, "--mode", args.mode, "--kv-backend",
                              args.kv_backend, "--http-port", "0", "--grpc-port", "0",
                              "--config", config, *device, *sim_args(args)])


def write_config() -> str:
    path = Path(tempfile.mkdtemp(prefix="kvfleet-bench-")) / "engine.yaml"
    path.write_text(json.dumps({"scheduler": SCHEDULER}))        # JSON is YAML
    return str(path)


def bench_engine(model: str, threads: int, device: str = "auto", sim=None,
                 cuda_graphs: str = "auto"):
    """The in-process engine with the same torch threads as one fleet worker, so that the
    difference is the serving path, not the core split. It sits idle while the fleet serves.
    `sim` (a SimConfig, --engine sim): the simulated core, each step paced on the wall clock to
    its modelled time as the fleet's engine core paces it."""
    from services.engine.engine import LLMEngine, engine_config
    engine = LLMEngine(engine_config(model, **SCHEDULER, enable_prefix_caching=False, device=device,
                                     sim=sim, cuda_graphs=cuda_graphs, torch_threads=threads))
    if sim is not None:
        engine.step = paced(engine)
    return engine


def paced(engine):
    """engine.step, ending no earlier than its start + its modelled time (the engine core's pace)."""
    step = engine.step

    def run():
        started = time.monotonic()
        outputs = step()
        left = started + engine.last_step_modelled_s - time.monotonic()
        if left > 0:
            time.sleep(left)
        return outputs
    return run


def _redis():
    """A real redis-server when installed (as in production); the embedded one otherwise. The
    embedded server runs Lua through lupa inside this process and adds its own latency."""
    from services.state.redis_server import EmbeddedRedis, RedisNotInstalledError, RedisServerProcess
    try:
        return RedisServerProcess().start()
    except RedisNotInstalledError:
        return EmbeddedRedis().start()


def run_fleet_bench(args: argparse.Namespace) -> int:
    from services.cli.launcher import Launcher
    from services.cli.up import start_fleet, worker_threads
    from services.engine.config import sim_config_from_args

    from services.engine.device import check_device
    check_device(getattr(args, "device", None), "kvfleet bench fleet")
    up = up_args(args, write_config())
    threads = worker_threads(up)
    sim = sim_config_from_args(args)
    engine = bench_engine(args.model, threads, getattr(args, "device", None) or "auto", sim,
                          getattr(args, "cuda_graphs", None) or "auto")
    prompts = Prompts.draw(args.repeats, vocab=engine.model_config.vocab_size)
    redis, launcher = _redis(), Launcher()
    try:
        endpoints = start_fleet(up, launcher, redis.url)
        fleet, local = asyncio.run(paired_sides(endpoints["gateway"], engine, prompts))
    finally:
        launcher.stop_all()
        redis.stop()
    result = bench_result(fleet, local, mode=args.mode, kv_backend=args.kv_backend, model=args.model,
                          threads_per_worker=threads, repeats=args.repeats,
                          engine_kind="real" if sim is None else "sim")
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def render(r: dict) -> str:
    f, e = r["fleet"], r["engine"]
    return "\n".join([
        f"fleet ({r['mode']}, KV over {r['kv_backend']}) vs in-process engine, model {r['model']}, "
        f"{r['threads_per_worker']} torch thread(s) per worker and for the engine:",
        f"  TTFT            fleet {f['ttft_ms']:7.2f} ms   engine {e['ttft_ms']:7.2f} ms   "
        f"added {r['added_ttft_ms']:.2f} ms",
        f"  time per token  fleet {f['per_token_ms']:7.2f} ms   engine {e['per_token_ms']:7.2f} ms   "
        f"added {r['added_per_token_ms']:.2f} ms",
        f"  {CONCURRENT} concurrent {PROMPT_TOKENS}-in/{CONCURRENT_OUTPUT}-out: fleet "
        f"{r['fleet_tok_s']:.0f} tok/s, engine {r['engine_tok_s']:.0f} tok/s"])
