"""What making the text costs the gateway: the output processor
(services/gateway/output_processor.py) on one token per chunk, as a decode worker streams them,
for a greedy completion of the model.

    python -m loadtests.bench_output_processor [--model tiny] [--tokens 256] [--runs 30]

Prints one JSON line per stop-string setting: microseconds per token (median and min over the
runs). Numbers go to docs/benchmarks.md, the section on the text the gateway makes (its output
processor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.gateway.output_processor import OutputProcessor
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

PROMPT = "Once upon a time there was a gateway that made the text of a whole fleet"
STOPS = {"none": [], "two stop strings": ["never seen", "END OF"]}


def worker_chunks(ids: list[int]) -> list[pb.TokenChunk]:
    chunks = [pb.TokenChunk(request_id="r", token_ids=[t]) for t in ids]
    chunks[-1].finish_reason, chunks[-1].finished = "length", True
    return chunks


def per_token_us(engine: LLMEngine, prompt: list[int], ids: list[int], stop: list[str]) -> float:
    processor = OutputProcessor(engine.tokenizer, prompt,
                                pb.SamplingParams(max_tokens=len(ids), stop=stop))
    chunks = worker_chunks(ids)
    start = time.perf_counter()
    for chunk in chunks:
        processor.process(chunk)
    return (time.perf_counter() - start) / len(ids) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    engine = LLMEngine(engine_config(args.model, kv_cache_mib=64))
    prompt = engine.tokenizer.encode(PROMPT)
    (ref,) = engine.generate([prompt], SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                      ignore_eos=True))
    for name, stop in STOPS.items():
        runs = [per_token_us(engine, prompt, ref.token_ids, stop) for _ in range(args.runs)]
        print(json.dumps({"model": args.model, "stop": name, "tokens": len(ref.token_ids),
                          "runs": args.runs,
                          "us_per_token_median": round(statistics.median(runs), 1),
                          "us_per_token_min": round(min(runs), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
