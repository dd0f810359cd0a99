"""`kvfleet demo` (without --fleet): a mixed workload through the in-process engine, on the tiny
model unless --model names another (sizes: DemoSize).

Many ~200-token chats from several tenants arrive open-loop (Poisson) while a few long documents
are chunked in. Prints TTFT and ITL p50/p99 and tokens/s per class, and shows that every running
chat advanced in every iteration in which a document was prefilling.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace

from services.engine.config import Tenant
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.workload import Arrival, mixed_workload

CHAT_TENANTS = ["acme", "globex", "initech"]


@dataclass(frozen=True)
class DemoSize:
    """How much a demo sends (this one and the fleet's); --chats ... override each field."""
    chats: int
    documents: int
    doc_tokens: int
    rate: float                  # chat arrivals per second
    chat_tokens: int = 64        # max_tokens of a chat (a real model usually stops before)
    doc_output: int = 32         # max_tokens of a document's summary


SIZES = {"tiny": DemoSize(chats=48, documents=2, doc_tokens=8192, rate=12.0),
         # SmolLM2-135M in fp32 (30 layers) on 2 CPU cores: about a minute of load (README, "Demo")
         "real": DemoSize(chats=16, documents=2, doc_tokens=512, rate=0.75, doc_output=48)}


def model_kind(model: str) -> str:
    """"tiny" (the seeded random model: fast, answers are noise) or "real" (anything else)."""
    return "tiny" if model == "tiny" else "real"


def demo_size(args: argparse.Namespace) -> DemoSize:
    base = SIZES[model_kind(args.model)]
    given = {f.name: getattr(args, f.name) for f in fields(DemoSize)
             if getattr(args, f.name, None) is not None}
    return replace(base, **given)


@dataclass
class Trace:
    cls: str
    sent: float
    token_times: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def drive(engine: LLMEngine, arrivals: list[Arrival]) -> tuple[dict[str, Trace], dict]:
    """Open loop: requests are added when their arrival time passes, whatever is running."""
    traces: dict[str, Trace] = {}
    pending, start = list(arrivals), time.perf_counter()
    doc_iters = stalled = 0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].at_s <= now:
            a = pending.pop(0)
            rid = engine.add_request(a.prompt_ids, SamplingParams(max_tokens=a.max_tokens,
                                     temperature=0.0, ignore_eos=True),
                                     tenant=a.tenant, traffic_class=a.traffic_class)
            traces[rid] = Trace(a.traffic_class, time.perf_counter())
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[0].at_s - now)))
            continue
        decoding = {r.request_id for r in engine.scheduler.running.values() if r.is_decoding}
        doc_prefilling = any(r.traffic_class.name == "document" and not r.is_decoding
                             for r in engine.scheduler.running.values())
        outs = engine.step()
        t = time.perf_counter()
        advanced = set()
        for o in outs:
            traces[o.request_id].token_times += [t] * len(o.new_token_ids)
            advanced.add(o.request_id)
        if doc_prefilling:
            doc_iters += 1
            stalled += len(decoding - advanced)
    return traces, {"doc_prefill_iterations": doc_iters, "missed_decode_slots": stalled,
                    "wall_s": time.perf_counter() - start}


def summarize(traces: dict[str, Trace]) -> dict[str, dict[str, float]]:
    by_cls: dict[str, list[Trace]] = defaultdict(list)
    for tr in traces.values():
        by_cls[tr.cls].append(tr)
    table = {}
    for cls, trs in sorted(by_cls.items()):
        ttft = [tr.token_times[0] - tr.sent for tr in trs if tr.token_times]
        itl = [b - a for tr in trs for a, b in zip(tr.token_times, tr.token_times[1:])]
        toks = sum(len(tr.token_times) for tr in trs)
        span = max(tr.token_times[-1] for tr in trs if tr.token_times) - min(tr.sent for tr in trs)
        table[cls] = {"requests": len(trs), "ttft_p50_ms": 1e3 * pct(ttft, 50),
                      "ttft_p99_ms": 1e3 * pct(ttft, 99), "itl_p50_ms": 1e3 * pct(itl, 50),
                      "itl_p99_ms": 1e3 * pct(itl, 99), "tokens_per_s": toks / span}
    return table


def run_once(args: argparse.Namespace, size: DemoSize, budget: int, chunk: int,
             attention_cap: bool = True) -> tuple[dict, dict, LLMEngine]:
    tenants = tuple(Tenant(n) for n in CHAT_TENANTS) + (Tenant("docs", classes=("document",)),)
    cap = {} if attention_cap else {"max_prefill_attention": 0}
    engine = LLMEngine(engine_config(args.model, tenants=tenants, default_tenant="acme",
                                     token_budget=budget, chunk_size=chunk, reject_late=False, **cap))
    arrivals = mixed_workload(vocab=engine.model_config.vocab_size, chats=size.chats,
                              documents=size.documents, doc_tokens=size.doc_tokens,
                              rate=size.rate, tenants=CHAT_TENANTS, seed=args.seed,
                              chat_output=size.chat_tokens, doc_output=size.doc_output)
    traces, info = drive(engine, arrivals)
    return summarize(traces), info, engine


def print_table(title: str, table: dict) -> None:
    print(f"\n{title}\n{'class':<12}{'reqs':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'tok/s':>8}")
    for cls, row in table.items():
        print(f"{cls:<12}{row['requests']:>5}{row['ttft_p50_ms']:>8.0f}ms{row['ttft_p99_ms']:>8.0f}ms"
              f"{row['itl_p50_ms']:>7.1f}ms{row['itl_p99_ms']:>7.1f}ms{row['tokens_per_s']:>8.0f}")


def run_demo(args: argparse.Namespace) -> int:
    args = argparse.Namespace(**{**vars(args), "model": args.model or "tiny"})
    size = demo_size(args)
    print(f"kvfleet demo: {size.chats} chats (~200-token prompts of random token ids, "
          f"{size.chat_tokens} output tokens, Poisson {size.rate}/s, tenants "
          f"{', '.join(CHAT_TENANTS)}) + {size.documents} documents of {size.doc_tokens} tokens, "
          f"through the in-process engine on model {args.model}")
    table, info, engine = run_once(args, size, args.budget, args.chunk)
    print_table(f"chunked prefill (token budget {args.budget}, chunk {args.chunk}):", table)
    print(f"while documents were prefilling: {info['doc_prefill_iterations']} iterations; running "
          f"chats that missed a decode iteration: {info['missed_decode_slots']}")
    print(f"KV blocks at the end: {engine.pool.num_free}/{engine.pool.num_blocks} free, "
          f"{engine.pool.num_reserved} reserved; wall time {info['wall_s']:.1f}s")
    if args.compare:
        whole = size.doc_tokens + args.budget
        base, _, _ = run_once(args, size, whole, whole, attention_cap=False)
        print_table(f"baseline, prefills go whole (token budget {whole}):", base)
        chat, ref = table.get("interactive"), base.get("interactive")
        if chat and ref:
            print(f"\nchat ITL p99: {chat['itl_p99_ms']:.0f} ms chunked vs {ref['itl_p99_ms']:.0f} ms "
                  f"whole ({ref['itl_p99_ms'] / chat['itl_p99_ms']:.1f}x)")
    return 0 if info["missed_decode_slots"] == 0 else 1
