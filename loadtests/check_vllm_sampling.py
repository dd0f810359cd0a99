#!/usr/bin/env python3
"""Record what vLLM's sampling parameters do on a checkpoint, as test data kvfleet must reproduce.

Run it with the *vLLM* venv's python (like check_vllm_loads_tiny.py); kvfleet is only driven in a
subprocess with kvfleet's own python (`--kvfleet-python`), never imported here:

    /tmp/vllm-venv/bin/python loadtests/check_vllm_sampling.py \
        --model ~/.cache/kvfleet/tiny-model-v1 --record tests/engine/data/vllm_sampling_params.json

Only deterministic cases are recorded: greedy with penalties / logit_bias / min_tokens, stop
strings and special-token options, and two random rows whose filters leave one token (top_k=1,
min_p=1), so that token ids can be compared across engines; seeded draws cannot.

1. One vLLM `LLM` (one start-up: 20-100 s on a loaded CPU box), started with
   `logprobs_mode="processed_logprobs"`, runs every case in one `generate` call: token ids, text,
   finish reason and the *processed* logprobs (after min_tokens, logit_bias, penalties,
   temperature, min_p, top-k/top-p) of the chosen token and the top 2.
2. The *raw* logprobs (vLLM's default mode, `raw_logprobs`: log_softmax of the model's logits
   before any processing) come from the same instance: prompt logprobs are raw in every mode, so
   each case's prompt + generated ids go back in as a prompt with `prompt_logprobs=2`.
3. `--record FILE` writes both, with the versions; then kvfleet's replay (LLMEngine in both
   logprobs modes, `kvfleet_replay` below, run by --kvfleet-python) is compared, and the report
   says per case whether ids, text and logprobs agree (--logprob-tol).

Prints one JSON report; exit 0 when kvfleet agrees on every case, 1 on a mismatch, 2 when a side
failed to run. Offline: the env defaults of check_vllm_loads_tiny.py are set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from loadtests.check_vllm_loads_tiny import (  # noqa: E402
    _ENV_DEFAULTS, _restore_stdout, _shutdown)

PROMPTS = ["Once upon a time", "The quick brown fox", "def main():"]
EOS = "<|eot_id|>"          # the tiny checkpoint's eos token (and SmolLM2's is <|im_end|>)
SPECIAL = "<|reserved_special_token_0|>"
TOP_N = 2


def cases(tok) -> list[dict]:
    """(name, prompt, vLLM SamplingParams kwargs). Ids are looked up in the checkpoint's own
    tokenizer so the cases force what they mean to force."""
    eos = tok.convert_tokens_to_ids(EOS)
    special = tok.convert_tokens_to_ids(SPECIAL)
    word = tok.encode(" the", add_special_tokens=False)
    assert len(word) == 1, f"' the' is {word} here; pick another one-token word"
    the = word[0]
    greedy = dict(temperature=0.0, max_tokens=20, logprobs=TOP_N)
    p0, p1, p2 = PROMPTS
    return [
        ("greedy_plain", p0, dict(greedy, ignore_eos=True)),
        ("greedy_repetition_1.3", p0, dict(greedy, ignore_eos=True, repetition_penalty=1.3)),
        ("greedy_repetition_0.7", p1, dict(greedy, ignore_eos=True, repetition_penalty=0.7)),
        ("greedy_presence_frequency", p1,
         dict(greedy, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6)),
        ("greedy_negative_penalties", p2,
         dict(greedy, ignore_eos=True, presence_penalty=-1.0, frequency_penalty=-0.4)),
        ("greedy_logit_bias", p2, dict(greedy, ignore_eos=True,
                                       logit_bias={the: 3.0, 100: 2.0, 1000: -100.0})),
        ("greedy_all_processors", p0, dict(greedy, ignore_eos=True, repetition_penalty=1.2,
                                           presence_penalty=0.5, frequency_penalty=0.3,
                                           logit_bias={the: 1.5})),
        ("min_tokens_bars_eos", p1, dict(greedy, min_tokens=6, logit_bias={eos: 100.0})),
        ("min_tokens_bars_stop_token_ids", p2,
         dict(greedy, min_tokens=5, stop_token_ids=[the], logit_bias={the: 100.0})),
        ("min_tokens_bars_stop_strings", p0,
         dict(greedy, min_tokens=3, stop=["the"], logit_bias={the: 100.0})),
        ("include_stop_str_in_output", p0,
         dict(greedy, min_tokens=3, stop=["the"], include_stop_str_in_output=True,
              logit_bias={the: 100.0})),
        ("eos_text_excluded", p1, dict(greedy, min_tokens=2, skip_special_tokens=False,
                                       logit_bias={eos: 100.0})),
        ("eos_text_included", p1, dict(greedy, min_tokens=2, skip_special_tokens=False,
                                       include_stop_str_in_output=True, logit_bias={eos: 100.0})),
        ("special_tokens_kept_no_spaces", p2,
         dict(greedy, max_tokens=4, ignore_eos=True, skip_special_tokens=False,
              spaces_between_special_tokens=False, logit_bias={special: 100.0})),
        ("special_tokens_kept_spaces", p2,
         dict(greedy, max_tokens=4, ignore_eos=True, skip_special_tokens=False,
              logit_bias={special: 100.0})),
        ("top_k_1_with_temperature", p1,
         dict(temperature=0.7, top_k=1, seed=1, max_tokens=16, ignore_eos=True, logprobs=TOP_N,
              repetition_penalty=1.3)),
        ("min_p_1_with_temperature", p2,
         dict(temperature=1.0, min_p=1.0, seed=2, max_tokens=16, ignore_eos=True,
              logprobs=TOP_N, presence_penalty=0.5)),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint dir")
    p.add_argument("--kvfleet-python", default=str(REPO_ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--logprob-tol", type=float, default=1e-4)
    p.add_argument("--record", help="write vLLM's side here (test data)")
    p.add_argument("--no-kvfleet", dest="kvfleet", action="store_false",
                   help="record only; skip kvfleet's replay")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- vLLM


def run_vllm(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams  # noqa: PLC0415 - after the env defaults

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=True, seed=0, logprobs_mode="processed_logprobs")
    try:
        specs = cases(llm.get_tokenizer())
        prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(text)} for _, text, _ in specs]
        outs = llm.generate(prompts, [SamplingParams(**kw) for *_, kw in specs], use_tqdm=False)
        recorded = [_case(name, text, kw, out) for (name, text, kw), out in zip(specs, outs)]
        # Raw logprobs: the prompt + generated ids as a prompt, scored (prompt logprobs are raw).
        rescore = [{"prompt_token_ids": c["prompt_token_ids"] + c["vllm_token_ids"]}
                   for c in recorded]
        scored = llm.generate(rescore, SamplingParams(max_tokens=1, temperature=0.0,
                                                      prompt_logprobs=TOP_N), use_tqdm=False)
        for c, out in zip(recorded, scored):
            at = out.prompt_logprobs[len(c["prompt_token_ids"]):]
            c["raw_logprobs"], c["raw_top"] = _logprobs(at, c["vllm_token_ids"])
        return {"cases": recorded}
    finally:
        _shutdown(llm)


def _case(name: str, text: str, kw: dict, out) -> dict:
    c = out.outputs[0]
    ids = list(c.token_ids)
    processed, top = _logprobs(c.logprobs, ids)
    params = dict(kw)
    if "logit_bias" in params:          # JSON keys are strings; keep pairs
        params["logit_bias"] = [[int(t), float(b)] for t, b in params["logit_bias"].items()]
    return {"name": name, "prompt": text, "params": params,
            "prompt_token_ids": list(out.prompt_token_ids), "vllm_token_ids": ids,
            "vllm_text": c.text, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "processed_logprobs": processed,
            "processed_top": top}


def _logprobs(positions, ids: list[int]) -> tuple[list[float], list[list[list[float]]]]:
    """Chosen-token logprobs and the top-N (id, logprob) per position, best first."""
    chosen, top = [], []
    for pos, t in zip(positions, ids):
        chosen.append(float(pos[t].logprob))
        ranked = sorted(((lp.rank, i, float(lp.logprob)) for i, lp in pos.items()
                         if lp.rank is not None and lp.rank <= TOP_N))
        top.append([[i, v] for _, i, v in ranked][:TOP_N])
    return chosen, top


# ---------------------------------------------------------------------------------- kvfleet


def kvfleet_params(case: dict, max_model_len: int = 1024):
    """The kvfleet SamplingParams for a recorded case (same names as vLLM's)."""
    from services.engine.sampling_params import SamplingParams  # noqa: PLC0415

    kw = dict(case["params"])
    for name in ("stop", "stop_token_ids"):
        if name in kw:
            kw[name] = tuple(kw[name])
    if "logit_bias" in kw:
        kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
    return SamplingParams(**kw)


def kvfleet_replay(model: str, data: dict, dtype: str = "float32") -> dict[str, list[dict]]:
    """kvfleet's LLMEngine on every recorded case, all in one batch, in both logprobs modes:
    {mode: [{token_ids, text, finish_reason, logprobs, top}, ...]} in case order."""
    from services.engine.engine import LLMEngine, engine_config  # noqa: PLC0415

    runs = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        engine = LLMEngine(engine_config(model, dtype=dtype, logprobs_mode=mode,
                                         num_blocks=256))
        outs = engine.generate([c["prompt_token_ids"] for c in data["cases"]],
                               [kvfleet_params(c) for c in data["cases"]])
        runs[mode] = [{"token_ids": o.token_ids, "text": o.text,
                       "finish_reason": o.finish_reason,
                       "logprobs": [lp.logprob for lp in o.logprobs],
                       "top": [[[t, v] for t, v in lp.top] for lp in o.logprobs]}
                      for o in outs]
    return runs


def compare(case: dict, kv: dict, mode: str, tol: float) -> dict:
    """One case, one mode: ids, text, finish reason, chosen and top-N logprobs."""
    key = "raw" if mode == "raw_logprobs" else "processed"
    want, want_top = case[f"{key}_logprobs"], case[f"{key}_top"]
    res = {"token_ids_equal": kv["token_ids"] == case["vllm_token_ids"],
           "text_equal": kv["text"] == case["vllm_text"],
           "finish_reason_equal": kv["finish_reason"] == case["finish_reason"]}
    if res["token_ids_equal"]:
        res["max_abs_logprob_diff"] = max(
            (_diff(a, b) for a, b in zip(kv["logprobs"], want)), default=0.0)
        res["max_abs_top_diff"] = max(
            (_diff(a[1], b[1]) for ka, wa in zip(kv["top"], want_top) for a, b in zip(ka, wa)),
            default=0.0)
    res["ok"] = bool(all(v for k, v in res.items() if k.endswith("equal"))
                     and res.get("max_abs_logprob_diff", 0.0) <= tol
                     and res.get("max_abs_top_diff", 0.0) <= tol)
    return res


def _diff(a: float, b: float) -> float:
    """|a - b|, with -inf == -inf (a token a filter removed has logprob -inf in both)."""
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    return abs(a - b)


def run_kvfleet(args: argparse.Namespace, record: Path) -> dict:
    code = ("import json, sys\n"
            "from loadtests.check_vllm_sampling import kvfleet_replay\n"
            "data = json.load(open(sys.argv[2]))\n"
            "print(json.dumps(kvfleet_replay(sys.argv[1], data, sys.argv[3])))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run([args.kvfleet_python, "-c", code, args.model, str(record), args.dtype],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"kvfleet replay exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = str(Path(args.model).expanduser().resolve())
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    report: dict = {"model": args.model, "dtype": args.dtype}
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)   # vLLM and its children log to stdout; keep stdout for the report
    try:
        t0 = time.perf_counter()
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
        import vllm  # noqa: PLC0415

        data = run_vllm(args)
        report["vllm_s"] = round(time.perf_counter() - t0, 1)
        source = Path(args.model) / "kvfleet_source.json"
        data = {"checkpoint": json.loads(source.read_text()) if source.is_file() else
                Path(args.model).name,
                "vllm": {"version": vllm.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "logprobs_mode": "processed_logprobs (raw from prompt_logprobs)"},
                "dtype": args.dtype, **data}
        record = Path(args.record or "/tmp/vllm_sampling_params.json")
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(data, indent=1) + "\n")
        report["record"] = str(record)
        if args.kvfleet:
            t0 = time.perf_counter()
            runs = run_kvfleet(args, record)
            report["kvfleet_s"] = round(time.perf_counter() - t0, 1)
    except Exception as exc:  # noqa: BLE001 - report, don't traceback
        report["error"] = f"{type(exc).__name__}: {exc}"
        _restore_stdout(real_stdout)
        print(json.dumps(report, indent=2))
        return 2
    _restore_stdout(real_stdout)
    if not args.kvfleet:
        print(json.dumps(report, indent=2))
        return 0
    report["results"] = [
        {"name": c["name"], **{mode: compare(c, runs[mode][i], mode, args.logprob_tol)
                               for mode in runs}}
        for i, c in enumerate(data["cases"])]
    report["ok"] = all(r[m]["ok"] for r in report["results"] for m in runs)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # required: vLLM's engine core starts with multiprocessing 'spawn'
    sys.exit(main())
