#!/usr/bin/env python3
"""Check that vLLM (CPU build) loads a kvfleet HF-format checkpoint offline and that its greedy
tokens equal kvfleet's own engine.

Run it with the *vLLM* venv's python, never kvfleet's: kvfleet is driven through its CLI in a
subprocess (`--kvfleet-python`), so nothing from vLLM is imported into kvfleet or vice versa.

    /tmp/vllm-venv/bin/python loadtests/check_vllm_loads_tiny.py --model /tmp/tiny-vllm \
        --kvfleet-python .venv/bin/python

What it does, for each prompt (defaults: three short prompts, 16 greedy tokens):
  1. vLLM `LLM.generate` on the prompt text (temperature 0, ignore_eos, logprobs of the chosen
     token), and again on kvfleet's prompt token ids (vLLM's token-id input path);
  2. `kvfleet generate --json` on the prompt text, and again on vLLM's prompt token ids
     (`--prompt-ids`);
  3. compares prompt token ids, generated ids (kvfleet's CLI stops at EOS and keeps the EOS id;
     vLLM runs with ignore_eos, so only the common prefix is compared), chosen-token logprobs
     (max |diff| against --logprob-tol) and decoded text (when both produced the same ids).

With `--chat TEXT` (repeatable; instead of --prompt) each prompt is one user message rendered
through the checkpoint's chat template: vLLM renders it itself (`LLM.chat`), kvfleet with
`Tokenizer.encode_chat` (run in a subprocess with --kvfleet-python), whose ids then go to
`kvfleet generate --prompt-ids`.

`--record FILE` also writes vLLM's side (messages or prompt text, prompt ids, greedy ids, text,
chosen-token logprobs, versions) as JSON test data, e.g.
tests/engine/model/data/smollm2_vllm_greedy.json.

Prints one JSON object; exit 0 when everything agrees, 1 on any mismatch, 2 when a side failed
to run. Needs no network: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set, vLLM usage stats are
off, and vLLM's host ip is pinned to loopback (all set only when not already in the env).
See docs/vllm-check.md for the install that this was checked with.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ["The quick brown fox", "Once upon a time", "def main():"]

# Set before vllm is imported (and inherited by its engine-core / worker processes).
_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's CPU default would reserve far more
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint dir (e.g. from "
                   "`kvfleet make-tiny-model DIR`)")
    default_py = REPO_ROOT / ".venv" / "bin" / "python"
    p.add_argument("--kvfleet-python", default=str(default_py),
                   help="python that has kvfleet installed (default: %(default)s)")
    p.add_argument("--kvfleet-root", default=str(REPO_ROOT),
                   help="working dir for kvfleet's CLI (default: %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable); default: "
                     + ", ".join(repr(x) for x in DEFAULT_PROMPTS))
    src.add_argument("--chat", action="append", help="a user message, rendered through the "
                     "checkpoint's chat template with the generation prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--logprob-tol", type=float, default=1e-3,
                   help="max allowed |logprob diff| of the chosen tokens (default: %(default)s)")
    p.add_argument("--no-ids-pass", dest="ids_pass", action="store_false",
                   help="skip the second pass that feeds each side the other's prompt ids")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--record", help="also write vLLM's prompt and greedy ids here (test data)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- kvfleet


def run_kvfleet(args: argparse.Namespace, *, prompts: list[str] | None = None,
                prompt_ids: list[list[int]] | None = None) -> list[dict]:
    cmd = [args.kvfleet_python, "-m", "services.cli.cli", "generate",
           "--model", args.model, "--dtype", args.dtype, "--temperature", "0",
           "--max-tokens", str(args.max_tokens), "--json"]
    if prompts is not None:
        for text in prompts:
            cmd += ["--prompt", text]
        n = len(prompts)
    else:
        assert prompt_ids is not None
        for ids in prompt_ids:
            cmd += ["--prompt-ids", ",".join(str(t) for t in ids)]
        n = len(prompt_ids)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run(cmd, cwd=args.kvfleet_root, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"kvfleet exited {proc.returncode}: {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(rows) != n:
        raise RuntimeError(f"kvfleet printed {len(rows)} JSON rows for {n} prompts:\n"
                           f"{proc.stdout[-2000:]}")
    return rows


def kvfleet_chat_ids(args: argparse.Namespace, messages: list[list[dict]]) -> list[list[int]]:
    """kvfleet's chat prompt ids (Tokenizer.encode_chat), computed by kvfleet's own python."""
    code = ("import json, sys\n"
            "from services.engine.tokenizer import Tokenizer\n"
            "tok = Tokenizer.from_dir(sys.argv[1])\n"
            "print(json.dumps([tok.encode_chat(m) for m in json.loads(sys.argv[2])]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run([args.kvfleet_python, "-c", code, args.model, json.dumps(messages)],
                          cwd=args.kvfleet_root, env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kvfleet encode_chat exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- vLLM


def load_vllm(args: argparse.Namespace):
    from vllm import LLM  # noqa: PLC0415 - imported after the env defaults are set

    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               enforce_eager=True, seed=0)


def greedy_params(args: argparse.Namespace):
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                          logprobs=0)


def run_vllm(llm, args: argparse.Namespace, inputs: list) -> list[dict]:
    return _vllm_rows(llm.generate(inputs, greedy_params(args), use_tqdm=False))


def run_vllm_chat(llm, args: argparse.Namespace, messages: list[list[dict]]) -> list[dict]:
    """vLLM's own chat path: its tokenizer renders the checkpoint's chat template."""
    return _vllm_rows(llm.chat(messages, greedy_params(args), use_tqdm=False))


def _vllm_rows(outputs) -> list[dict]:
    rows = []
    for out in outputs:
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = None
        if c.logprobs is not None:
            lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, ids)]
        rows.append({"prompt_token_ids": list(out.prompt_token_ids), "token_ids": ids,
                     "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason})
    return rows


# ---------------------------------------------------------------------------------- compare


def compare(vl: dict, kv: dict, tol: float) -> dict:
    v_ids, k_ids = vl["token_ids"], kv["token_ids"]
    n = min(len(v_ids), len(k_ids))
    diverge = next((i for i in range(n) if v_ids[i] != k_ids[i]), None)
    res = {
        "prompt_ids_equal": vl["prompt_token_ids"] == kv["prompt_token_ids"],
        "vllm_tokens": len(v_ids),
        "kvfleet_tokens": len(k_ids),
        "kvfleet_finish_reason": kv.get("finish_reason"),
        "compared_tokens": n,
        "token_ids_equal": diverge is None,
        "first_divergence": diverge,
    }
    if diverge is not None:
        res["vllm_at_divergence"] = v_ids[diverge]
        res["kvfleet_at_divergence"] = k_ids[diverge]
    # kvfleet may stop early only on EOS / stop; anything else shorter is a mismatch.
    short_ok = len(k_ids) >= len(v_ids) or kv.get("finish_reason") == "stop"
    res["length_ok"] = short_ok
    if vl.get("logprobs") and kv.get("logprobs"):
        m = min(n if diverge is None else diverge, len(vl["logprobs"]), len(kv["logprobs"]))
        diffs = [abs(a - b) for a, b in zip(vl["logprobs"][:m], kv["logprobs"][:m])]
        res["max_abs_logprob_diff"] = max(diffs) if diffs else 0.0
        res["logprobs_ok"] = res["max_abs_logprob_diff"] <= tol
    if len(v_ids) == len(k_ids) and diverge is None:
        res["text_equal"] = vl["text"] == kv["text"]
    res["ok"] = bool(res["prompt_ids_equal"] and res["token_ids_equal"] and short_ok
                     and res.get("logprobs_ok", True) and res.get("text_equal", True))
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = str(Path(args.model).resolve())
    prompts = args.chat or args.prompt or DEFAULT_PROMPTS
    messages = [[{"role": "user", "content": c}] for c in args.chat] if args.chat else None
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)

    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "dtype": args.dtype,
                    "chat": messages is not None, "prompts": prompts}
    # vLLM (and the engine-core / worker processes it spawns, which inherit fd 1) logs to
    # stdout; send all of that to stderr so stdout carries only the JSON report.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        llm = None
        t0 = time.perf_counter()
        if messages is not None:
            kv_text = run_kvfleet(args, prompt_ids=kvfleet_chat_ids(args, messages))
        else:
            kv_text = run_kvfleet(args, prompts=prompts)
        report["kvfleet_s"] = round(time.perf_counter() - t0, 2)

        t0 = time.perf_counter()
        import vllm  # noqa: PLC0415

        report["vllm_version"] = vllm.__version__
        report["vllm_import_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        llm = load_vllm(args)
        report["vllm_load_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        vl_text = (run_vllm_chat(llm, args, messages) if messages is not None
                   else run_vllm(llm, args, prompts))
        report["vllm_generate_s"] = round(time.perf_counter() - t0, 3)

        vl_ids = kv_ids = None
        if args.ids_pass:
            # Each side gets the *other* side's tokenization, so a tokenizer mismatch cannot
            # hide a model mismatch (and the token-id input paths get exercised).
            t0 = time.perf_counter()
            vl_ids = run_vllm(llm, args, [{"prompt_token_ids": r["prompt_token_ids"]}
                                          for r in kv_text])
            report["vllm_generate_ids_s"] = round(time.perf_counter() - t0, 3)
            kv_ids = run_kvfleet(args, prompt_ids=[r["prompt_token_ids"] for r in vl_text])
        if llm is not None:
            _shutdown(llm)
    except Exception as exc:  # noqa: BLE001 - report, don't traceback
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["ok"] = False
        _restore_stdout(real_stdout)
        _emit(report, args.out)
        return 2
    _restore_stdout(real_stdout)

    results = []
    for i, text in enumerate(prompts):
        row = {"prompt": text, "text": compare(vl_text[i], kv_text[i], args.logprob_tol),
               "vllm_prompt_token_ids": vl_text[i]["prompt_token_ids"],
               "kvfleet_prompt_token_ids": kv_text[i]["prompt_token_ids"],
               "vllm_token_ids": vl_text[i]["token_ids"],
               "kvfleet_token_ids": kv_text[i]["token_ids"]}
        if vl_ids is not None and kv_ids is not None:
            row["ids"] = compare(vl_ids[i], kv_ids[i], args.logprob_tol)
            # The two vLLM runs (text vs ids) must also agree with each other.
            row["vllm_text_vs_ids_equal"] = vl_ids[i]["token_ids"] == vl_text[i]["token_ids"]
        row["ok"] = bool(row["text"]["ok"] and row.get("ids", {"ok": True})["ok"]
                         and row.get("vllm_text_vs_ids_equal", True))
        results.append(row)
    report["results"] = results
    report["ok"] = all(r["ok"] for r in results)
    _emit(report, args.out)
    if args.record:
        _record(args, report, messages, vl_text)
    return 0 if report["ok"] else 1


def _restore_stdout(fd: int) -> None:
    sys.stdout.flush()
    os.dup2(fd, 1)
    os.close(fd)


def _shutdown(llm) -> None:
    """Stop vLLM's engine-core process now rather than at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; exit cleans up anyway
        pass


def _record(args: argparse.Namespace, report: dict, messages: list[list[dict]] | None,
            vl_rows: list[dict]) -> None:
    """vLLM's greedy ids as test data: what kvfleet's engine must reproduce."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    source = Path(args.model) / "kvfleet_source.json"
    cases = []
    for i, row in enumerate(vl_rows):
        case = ({"messages": messages[i]} if messages is not None
                else {"prompt": report["prompts"][i]})
        case.update(prompt_token_ids=row["prompt_token_ids"], vllm_token_ids=row["token_ids"],
                    vllm_text=row["text"], vllm_logprobs=row["logprobs"])
        cases.append(case)
    data = {"checkpoint": json.loads(source.read_text()) if source.is_file() else args.model,
            "vllm": {"version": report.get("vllm_version"), "torch": torch.__version__,
                     "transformers": transformers.__version__},
            "dtype": args.dtype, "temperature": 0.0, "ignore_eos": True,
            "max_tokens": args.max_tokens, "kvfleet_agreed": report["ok"], "cases": cases}
    Path(args.record).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1)  # then each list of numbers on one line:
    text = re.sub(r"\[\s*([-+\d.eE,\s]+?)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    Path(args.record).write_text(text + "\n")


def _emit(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":  # required: vLLM's engine core starts with multiprocessing 'spawn'
    sys.exit(main())
