"""A step trace of a running engine core: one JSON line per engine step that ran the model, so a
profile of the engine can be fitted from a fleet under load (`kvfleet sim calibrate --in-fleet`,
services/planner/overhead.py), contention with the fleet's other processes included.

Off unless KVFLEET_STEP_TRACE names a directory; each engine core started with it set writes
`steps-<pid>.jsonl` there. A line holds the step's shape (the terms services/planner/profile.py
fits), its start on the host's monotonic clock, its duration, and whether work was left after it
(then the core went straight on to its next step, and the time between the two starts is what a
step costs the core: the step, sending its outputs, running the commands that came meanwhile).
"""
from __future__ import annotations

import json
import os
import time

from services.protocol import env


def install(engine, environ=None) -> None:
    """Wrap the engine's step() to trace it, if the environment asks (no-op otherwise)."""
    folder = env.STEP_TRACE.get(environ)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    out = open(os.path.join(folder, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    real_step, per_token = engine.step, max(1, engine.kv_bytes_per_token)

    def step():
        started = time.monotonic()
        outputs = real_step()
        rec = engine.last_step
        if rec is not None:
            contexts = rec.kv_read_bytes // per_token
            out.write(json.dumps({
                "t0": started, "dur": rec.duration_s, "prefill_tokens": rec.prefill_tokens,
                "prefill_seqs": rec.num_prefill_seqs, "decodes": rec.num_decode_seqs,
                "decode_context_tokens": contexts,
                "prefill_attention_pairs": rec.attention_pairs - contexts,
                "busy_after": engine.has_unfinished()}) + "\n")
        return outputs

    engine.step = step
