"""What a (query, key) pair of attention costs next to a token, on the real in-process engine: the
ratio a worker's prefill cost fit keeps until it has measured deep steps
(services/worker/rates.py, `CostFit`, and the tiny model's `TINY` prior).

    python -m loadtests.attention_ratio [--model tiny] [--repeats 2]

Runs, on one engine of the fleet's prefill shape (2,048-token budget, 512-token chunks), bursts
of 200-token chats, one 8K prompt alone and four side by side, `--repeats` times; fits step
seconds = a + b x tokens + c x pairs over every step that ran prefill (least squares, a >= 0),
and prints one JSON line: the coefficients, c / b, each kind of step's median, and the load
average. The figures go to docs/benchmarks.md (section "a9doc").
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import attention_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args.model, enable_prefix_caching=False, token_budget=2048,
                                     chunk_size=512, max_running=128, reject_late=False,
                                     max_prefill_attention=0))
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    rows: list[tuple[str, int, int, float]] = []     # (kind, tokens, pairs, seconds)

    def burst(kind: str, lengths: list[int]) -> None:
        for n in lengths:
            engine.add_request(rng.integers(16, vocab, size=n).tolist(),
                               SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished():
            computed = {rid: r.num_computed_tokens for rid, r in engine.scheduler.requests.items()}
            engine.step()
            rec = engine.last_step
            if rec is None or not rec.prefill_chunks:
                continue
            pairs = sum(attention_pairs(computed.get(rid, 0), n) for rid, n in rec.prefill_chunks)
            pairs += rec.kv_read_bytes // max(1, engine.kv_bytes_per_token)   # decodes' context
            tokens = sum(n for _, n in rec.prefill_chunks) + rec.num_decode_seqs
            rows.append((kind, tokens, pairs, rec.duration_s))

    burst("warm-up", [300] * 3)
    rows.clear()
    for _ in range(args.repeats):
        burst("chats", [200] * 10)
        burst("one 8K", [8000])
        burst("four 8K", [8000] * 4)
    x = np.array([(1.0, t, p) for _, t, p, _ in rows])
    y = np.array([s for *_, s in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if coef[0] < 0:                       # a step takes no negative time: refit through 0
        coef = np.array([0.0, *np.linalg.lstsq(x[:, 1:], y, rcond=None)[0]])
    kinds = {}
    for kind in ("chats", "one 8K", "four 8K"):
        sel = [i for i, r in enumerate(rows) if r[0] == kind]
        kinds[kind] = {"steps": len(sel), "tokens": float(np.median(x[sel, 1])),
                       "pairs": float(np.median(x[sel, 2])), "median_s": float(np.median(y[sel]))}
    print(json.dumps({"step_s": coef[0], "s_per_token": coef[1], "s_per_pair": coef[2],
                      "pair_over_token": coef[2] / coef[1], "steps": kinds,
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
