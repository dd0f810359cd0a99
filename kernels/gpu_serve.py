"""One model served end to end on one device, for the prepared GPU run (kernels/gpu_run.py):

    python -m kernels.gpu_serve --model DIR --device cuda|cpu --out serve.json [--small]

  1. reference: the in-process engine on the CPU (fp32 as the checkpoint is), greedy, with each
     token's top-2 logprob margin;
  2. engine: the in-process engine on --device: the same greedy tokens, then a burst of
     --chats prompts at once (output tokens/s, as `kvfleet bench burst` counts them);
     graphs: the in-process engine with --cuda-graphs off, then on: decode tokens/s of
     --chats sequences decoding together (short prompts, long outputs) and greedy tokens equal
     between the two (on CUDA: graphs replayed vs eager steps; on the CPU the padded steps);
  3. for mode in disagg (1 prefill + 1 decode, KV over tcp: on CUDA the device path, pinned host
     staging) and colocated (1 mixed worker): `kvfleet up --device DEVICE`, the same greedy
     prompts through the openai client, then `kvfleet bench burst` (tok/s, TTFT, ITL).

Greedy tokens are compared as the equivalence tests compare them (tests/engine/test_engine.py):
position by position until the reference's top-2 margin falls under NEAR_TIE (a near-tie, where
rounding may pick either token); `equal` is whether every compared token matched.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

NEAR_TIE = 1e-4          # the equivalence tests' margin (logprob units)


@dataclass(frozen=True)
class Sizes:
    """How much each phase runs: the GPU run's sizes, or --small (a CPU test)."""

    prompts: int = 8             # greedy equivalence prompts
    prompt_tokens: int = 64
    greedy_tokens: int = 32
    chats: int = 64              # the burst: chats at once
    chat_tokens: int = 256
    output_tokens: int = 128
    kv_cache_mib: int = 8192     # per worker (the in-process engine too)
    ready_s: float = 240.0       # `kvfleet up` to READY


SMALL = Sizes(prompts=2, prompt_tokens=16, greedy_tokens=6, chats=4, chat_tokens=24,
              output_tokens=6, kv_cache_mib=64, ready_s=240.0)


def prompt_ids(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random  # noqa: PLC0415
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def make_engine(model: str, device: str, sizes: Sizes, cuda_graphs: str = "auto"):
    from services.engine.engine import LLMEngine, engine_config  # noqa: PLC0415
    return LLMEngine(engine_config(model, device=device, kv_cache_mib=sizes.kv_cache_mib,
                                   reject_late=False, protect_itl=False, token_budget=2048,
                                   chunk_size=512, cuda_graphs=cuda_graphs))


def greedy(engine, prompts: list[list[int]], n: int, logprobs: int = 0):
    from services.engine.sampling_params import SamplingParams  # noqa: PLC0415
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                   logprobs=logprobs))


def reference(model: str, prompts: list[list[int]], sizes: Sizes) -> dict:
    """CPU greedy tokens and, per token, the margin between its top-2 logprobs."""
    engine = make_engine(model, "cpu", sizes)
    outs = greedy(engine, prompts, sizes.greedy_tokens, logprobs=2)
    ref = {"tokens": [list(o.token_ids) for o in outs],
           "margins": [[_margin(lp) for lp in out.logprobs] for out in outs]}
    ref["prefix_texts"], ref["compared_tokens"] = prefix_texts(engine, ref)
    return ref


def _margin(lp) -> float:
    top = sorted((x[1] for x in lp.top), reverse=True)
    return float(top[0] - top[1]) if len(top) >= 2 else float("inf")


def compare(ref: dict, got: list[list[int]]) -> dict:
    """Position by position while the reference is not at a near-tie."""
    compared = mismatched = 0
    first_diff = None
    for i, (want, have, margins) in enumerate(zip(ref["tokens"], got, ref["margins"])):
        for pos, (w, m) in enumerate(zip(want, margins)):
            if m < NEAR_TIE:
                break
            compared += 1
            if pos >= len(have) or have[pos] != w:
                mismatched += 1
                first_diff = first_diff or {"prompt": i, "position": pos, "want": w,
                                            "got": have[pos] if pos < len(have) else None}
                break
    return {"equal": mismatched == 0 and compared > 0, "compared": compared,
            "mismatched": mismatched, "first_difference": first_diff, "near_tie": NEAR_TIE}


def engine_phase(model: str, device: str, prompts, ref: dict, sizes: Sizes, vocab: int) -> dict:
    """The in-process engine on the device: greedy tokens, then the burst's output tok/s."""
    engine = make_engine(model, device, sizes)
    tokens = [list(o.token_ids) for o in greedy(engine, prompts, sizes.greedy_tokens)]
    burst = prompt_ids(sizes.chats, sizes.chat_tokens, vocab, seed=1)
    greedy(engine, burst[:2], 2)                               # warm-up (CUDA: Triton compiles its kernels)
    started = time.perf_counter()
    outs = greedy(engine, burst, sizes.output_tokens)
    wall = time.perf_counter() - started
    tokens_out = sum(len(o.token_ids) for o in outs)
    device_name = str(engine.kv_cache.device)
    backend = type(engine.executor.runner.backend).__name__
    engine.close()
    del engine
    free_device_memory()             # the fleets that follow get the GPU's memory
    return {"greedy": compare(ref, tokens), "device": device_name, "attention_backend": backend,
            "burst": {"chats": sizes.chats, "output_tokens_per_s": round(tokens_out / wall, 1),
                      "wall_s": round(wall, 2)}}


def graphs_phase(model: str, device: str, prompts, sizes: Sizes, vocab: int) -> dict:
    """--cuda-graphs off, then on: greedy tokens (on's compared with off's as `compare` does) and
    the decode rate of a batch of short prompts with long outputs."""
    sides: dict = {}
    for setting in ("off", "on"):
        engine = make_engine(model, device, sizes, cuda_graphs=setting)
        outs = greedy(engine, prompts, sizes.greedy_tokens, logprobs=2)
        sides[setting] = {"tokens": [list(o.token_ids) for o in outs],
                          "margins": [[_margin(lp) for lp in o.logprobs] for o in outs],
                          "decode": [decode_rate(engine, batch, sizes.output_tokens, vocab)
                                     for batch in sorted({1, sizes.chats})]}
        sides[setting]["padded_steps"] = getattr(engine.executor.runner, "padded_steps", 0)
        sides[setting]["capture_error"] = getattr(engine.executor.runner, "capture_error", None)
        engine.close()
        del engine
        free_device_memory()
    for off, on in zip(sides["off"]["decode"], sides["on"]["decode"]):
        on["speedup_over_off"] = (round(on["tokens_per_s"] / off["tokens_per_s"], 3)
                                  if on["tokens_per_s"] and off["tokens_per_s"] else None)
    return {"greedy": compare(sides["off"], sides["on"]["tokens"]),
            "off": sides["off"]["decode"], "on": sides["on"]["decode"],
            "padded_steps_on": sides["on"]["padded_steps"],
            "capture_error": sides["on"]["capture_error"]}


def decode_rate(engine, batch: int, output_tokens: int, vocab: int) -> dict:
    """Output tokens/s of `batch` sequences decoding together: timed from the step after the
    last prompt's prefill to the end, so the figure is decode steps only."""
    from services.engine.sampling_params import SamplingParams  # noqa: PLC0415
    greedy(engine, prompt_ids(2, 8, vocab, seed=3), 4)           # warm-up (Triton compiles)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for p in prompt_ids(batch, 8, vocab, seed=2):
        engine.add_request(p, params)
    for _ in range(batch + 8):                                   # every prompt prefilled
        if engine.stats().num_decoding >= batch:
            break
        engine.step()
    tokens, started = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - started
    return {"batch": batch, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None}


def free_device_memory() -> None:
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fleet_phase(model: str, device: str, mode: str, prompts, ref: dict, sizes: Sizes,
                vocab: int) -> dict:
    """`kvfleet up --device DEVICE --mode MODE`: greedy through the openai client, then a burst."""
    import openai  # noqa: PLC0415

    from loadtests.local_fleet import kvfleet_up  # noqa: PLC0415
    started = time.monotonic()
    with kvfleet_up(model, "--device", device, mode=mode, kv_cache_mib=sizes.kv_cache_mib,
                    ready_s=sizes.ready_s) as up:
        ready_s = time.monotonic() - started
        with openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                           timeout=300) as client:
            got = [client.completions.create(model=up.model, prompt=p, max_tokens=sizes.greedy_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})
                   for p in prompts]
        texts = [c.choices[0].text for c in got]
        burst = subprocess.run(
            [sys.executable, "-m", "services.cli.cli", "bench", "burst", "--endpoint", up.url,
             "--chats", str(sizes.chats), "--chat-tokens", str(sizes.chat_tokens),
             "--output-tokens", str(sizes.output_tokens), "--vocab", str(vocab), "--seed", "1"],
            capture_output=True, text=True, timeout=600)
        report = json.loads(burst.stdout) if burst.returncode == 0 else {"error": burst.stderr[-2000:]}
    return {"mode": mode, "ready_s": round(ready_s, 1), "greedy": compare_text(ref, texts),
            "burst": report}


def compare_text(ref: dict, texts: list[str]) -> dict:
    """The fleet's answer carries text, not ids: each completion must begin with the text of the
    reference's tokens up to its first near-tie (a prefix's trailing partial character aside)."""
    compared, first_diff = 0, None
    for i, (want, have) in enumerate(zip(ref["prefix_texts"], texts)):
        compared += 1
        if not have.startswith(want) and first_diff is None:
            first_diff = {"prompt": i, "want_prefix": want[:200], "got": have[:200]}
    return {"equal": first_diff is None and compared > 0, "compared_prompts": compared,
            "compared_tokens": ref["compared_tokens"], "first_difference": first_diff,
            "near_tie": NEAR_TIE, "by": "text"}


def prefix_texts(engine, ref: dict) -> tuple[list[str], int]:
    """Per prompt, the text of the reference's tokens before its first near-tie."""
    texts, total = [], 0
    for tokens, margins in zip(ref["tokens"], ref["margins"]):
        cut = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
        total += cut
        texts.append(engine.tokenizer.decode(tokens[:cut]).rstrip("\ufffd"))
    return texts, total


def run(args: argparse.Namespace, save=lambda doc: None) -> dict:
    """-> the model's results; save(doc) after each phase (a step stopped at its time limit
    keeps what it measured)."""
    from services.engine.model.config import ModelConfig  # noqa: PLC0415
    from services.engine.engine import resolve_model_dir  # noqa: PLC0415
    sizes = SMALL if args.small else Sizes()
    model = str(resolve_model_dir(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = prompt_ids(sizes.prompts, sizes.prompt_tokens, vocab)
    doc: dict = {"model": args.model, "device": args.device, "sizes": sizes.__dict__}
    ref = reference(model, prompts, sizes)
    doc["reference"] = {"device": "cpu", "tokens": ref["tokens"]}
    doc["engine"] = engine_phase(model, args.device, prompts, ref, sizes, vocab)
    save(doc)
    try:
        doc["cuda_graphs"] = graphs_phase(model, args.device, prompts, sizes, vocab)
    except Exception as e:  # noqa: BLE001 - a result; the fleets still run
        doc["cuda_graphs"] = {"error": f"{type(e).__name__}: {e}"[-4000:],
                              "greedy": {"equal": False}}
    save(doc)
    doc["fleets"] = {}
    for mode in args.modes.split(","):
        try:
            doc["fleets"][mode] = fleet_phase(model, args.device, mode, prompts, ref, sizes, vocab)
        except Exception as e:  # noqa: BLE001 - one fleet failing is a result, the next still runs
            doc["fleets"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[-4000:]}
        save(doc)
    engine_rate = doc["engine"]["burst"]["output_tokens_per_s"]
    for fleet in doc["fleets"].values():
        rate = (fleet.get("burst") or {}).get("output_tokens_per_s")
        if rate and engine_rate:
            fleet["tok_s_over_engine"] = round(rate / engine_rate, 3)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint directory or a named model")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--modes", default="disagg,colocated")
    p.add_argument("--small", action="store_true", help="CPU test sizes")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    save(args.out, run(args, save=lambda doc: save(args.out, doc)))
    return 0


def save(path: str, doc: dict) -> None:
    """Whole or not at all: a step stopped mid-write leaves the previous phase's file."""
    with open(f"{path}.part", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(f"{path}.part", path)


if __name__ == "__main__":
    sys.exit(main())
