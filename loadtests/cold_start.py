"""A cold fleet's first requests: a fresh `kvfleet up --model smollm2 --mode disagg` at the
production targets (1-s chat TTFT), 8 ~200-token chats one after another, each refused (why) or
served (its TTFT at the client). Prints one JSON line per chat, then all of them; run with
PYTHONPATH at the tree to measure (docs/benchmarks.md, "A cold SmolLM2 fleet's first chats"):

    python -m loadtests.cold_start LABEL
"""
from __future__ import annotations

import json
import sys
import time

import httpx

from loadtests.local_fleet import kvfleet_up

PROMPT = " ".join(["Tell me about the history of the harbour town and its boats."] * 16)


def main(label: str) -> None:
    rows = []
    with kvfleet_up("smollm2", mode="disagg", ready_s=600) as fleet:
        with httpx.Client(timeout=120) as client:
            for i in range(8):
                t0 = time.perf_counter()
                first, body = None, ""
                with client.stream("POST", f"{fleet.url}/v1/completions", json={
                        "model": fleet.model, "prompt": PROMPT, "max_tokens": 8, "stream": True,
                        "ignore_eos": True}) as r:
                    status = r.status_code
                    if status == 200:
                        for line in r.iter_lines():
                            if line.startswith("data: {") and first is None:
                                first = time.perf_counter() - t0
                    else:
                        body = r.read().decode()[:200]
                rows.append({"i": i, "status": status, "ttft_s": first, "why": body})
                print(rows[-1], flush=True)
    print(json.dumps({"tree": label, "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
