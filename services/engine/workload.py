"""Seeded synthetic workloads for the demo and the benchmark: chats and documents as token ids."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    at_s: float          # offset from the start of the run
    tenant: str
    traffic_class: str
    prompt_ids: list[int]
    max_tokens: int


def random_prompt(rng: random.Random, n: int, vocab: int, low: int = 10) -> list[int]:
    """n token ids from the ordinary (non-special) range of the vocabulary."""
    return [rng.randrange(low, vocab - 256) for _ in range(n)]


def mixed_workload(*, vocab: int, chats: int, documents: int, doc_tokens: int, rate: float,
                   tenants: list[str], seed: int = 0, chat_output: int = 64,
                   doc_output: int = 32) -> list[Arrival]:
    """Poisson chat arrivals (lognormal prompt lengths around 200 tokens) from several tenants,
    plus `documents` long prompts arriving early, while chats are streaming."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(chats):
        t += rng.expovariate(rate)
        n = max(16, min(1024, int(rng.lognormvariate(5.3, 0.35))))
        out.append(Arrival(t, tenants[i % len(tenants)], "interactive",
                           random_prompt(rng, n, vocab), chat_output))
    span = max(t, 1.0)
    for j in range(documents):
        out.append(Arrival(span * (0.15 + 0.5 * j / max(1, documents)), "docs", "document",
                           random_prompt(rng, doc_tokens, vocab), doc_output))
    return sorted(out, key=lambda a: a.at_s)
