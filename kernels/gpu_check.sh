#!/usr/bin/env bash
# The Triton kernels on a real GPU: correctness (tests/kernels compiled on CUDA), decode bandwidth,
# prefill TFLOP/s, and the model runner's tokens/s on a ~1B-parameter Llama, torch vs triton.
# Sized for one H200 in at most ~8 minutes (BUDGET_S, default 470 s, counts from the start).
#
#   OUT=/some/dir bash kernels/gpu_check.sh
#
# Writes into $OUT (each step's log beside it, so a step cut short still leaves what it had):
#   result.json        everything below in one document (written last, also after failures)
#   steps.jsonl        one line per step: name, exit code, seconds
#   env.json           how Python was set up, torch / triton versions, the GPU
#   junit.xml          the kernel tests (KVFLEET_KERNELS_ON_GPU=1: no interpreter, tensors on CUDA)
#   bench_*.json       python -m kernels.bench_gpu, one file per section (decode, prefill, backends, e2e)
# Python: the one on PATH ($PY, default python3) if it already has CUDA torch and triton; else a
# venv (system site packages visible) where `pip install torch==2.13.0 triton==3.9.0` runs with
# the machine's pip settings, then, if that torch has no CUDA, from the default index (PyPI).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the directory for results}"
mkdir -p "$OUT"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
STEPS="$OUT/steps.jsonl"
: > "$STEPS"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }   # min(limit, time left)
step() {  # step NAME LIMIT_S CMD...: run with a timeout, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit t0 rc; limit=$(cap "$2"); shift 2; t0=$(date +%s)
  if [ "$limit" -le 5 ]; then echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"out of time\"}" >> "$STEPS"; return 124; fi
  # SIGINT first: pytest then stops cleanly and still writes junit.xml for the tests it ran
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"limit_s\": $limit}" >> "$STEPS"
  return $rc
}
has_cuda_triton() { "$1" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

# 1. Python with CUDA torch and triton
PY=${PY:-python3}
SETUP=path
if ! has_cuda_triton "$PY"; then
  if [ -x .venv/bin/python ] && has_cuda_triton .venv/bin/python; then
    PY=.venv/bin/python; SETUP=repo-venv
  else
    VENV=${GPU_VENV:-/tmp/kvfleet-gpu-venv}
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    PY=$VENV/bin/python; SETUP=venv
    has_cuda_triton "$PY" || step pip_torch 240 "$PY" -m pip install "torch==2.13.0" "triton==3.9.0"
    if ! has_cuda_triton "$PY"; then  # e.g. local wheel settings gave a CPU torch: the default index
      SETUP=venv-default-index
      step pip_torch_default_index 240 env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install \
        --index-url https://pypi.org/simple --force-reinstall "torch==2.13.0" "triton==3.9.0"
    fi
  fi
fi
# what the kernel tests, the runner and make-tiny-model import (quick when already there)
step pip_deps 120 "$PY" -m pip install -q numpy safetensors tokenizers jinja2 pyyaml msgspec \
  pytest pytest-timeout hypothesis
"$PY" - > "$OUT/env.json" 2>> "$OUT/env.log" <<PYEOF
import json, platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = repr(e)
cuda = torch.cuda.is_available()
print(json.dumps({"setup": "$SETUP", "python": platform.python_version(), "torch": torch.__version__,
                  "triton": tv, "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None}))
PYEOF

if has_cuda_triton "$PY"; then
  # 2. the kernel tests, compiled (the flag tests are CPU-only parsing: CI covers them)
  step tests 170 env KVFLEET_KERNELS_ON_GPU=1 "$PY" -m pytest -q -p no:cacheprovider tests/kernels \
    --ignore=tests/kernels/test_backend_flags.py --junitxml="$OUT/junit.xml" --durations=15
  # 3. kernel benchmarks, one section at a time (each writes its own JSON)
  step bench_decode 60 "$PY" -m kernels.bench_gpu --sections decode --out "$OUT/bench_decode.json"
  step bench_prefill 40 "$PY" -m kernels.bench_gpu --sections prefill --out "$OUT/bench_prefill.json"
  step bench_backends 40 "$PY" -m kernels.bench_gpu --sections backends --out "$OUT/bench_backends.json"
  # 4. a ~1B-parameter Llama (16 x hidden 2048, 32/8 heads, MLP 8192, vocab 4096: ~1.0B), bf16
  MODEL=${MODEL_DIR:-/tmp/kvfleet-llama-1b}
  [ -f "$MODEL/config.json" ] || step make_model 120 "$PY" -m services.cli.cli make-tiny-model "$MODEL" \
    --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 4096 --max-positions 8192
  [ -f "$MODEL/config.json" ] && step bench_e2e 150 "$PY" -m kernels.bench_gpu --sections e2e \
    --model-dir "$MODEL" --out "$OUT/bench_e2e.json"
fi

# 5. one document
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
doc = {"env": load("env.json"), "steps": [json.loads(l) for l in open(os.path.join(out, "steps.jsonl")) if l.strip()]}
try:
    suite = ET.parse(os.path.join(out, "junit.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    doc["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    doc["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError, IndexError):
    doc["tests"] = None
for section in ("decode", "prefill", "backends", "e2e"):
    doc[f"bench_{section}"] = load(f"bench_{section}.json")
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(doc, f, indent=2)
print(json.dumps({"tests": doc["tests"], "steps": doc["steps"]}, indent=1))
PYEOF
