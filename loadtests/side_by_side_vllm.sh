#!/usr/bin/env bash
# kvfleet vs vLLM's OpenAI server on the same checkpoint, same seeded workload, one after the other:
# `kvfleet bench compare` with A = kvfleet (`kvfleet up`), B = `vllm serve`.
#
#   loadtests/side_by_side_vllm.sh [WORKLOAD] [RATE_SCALE] [DURATION_S] [MODE]
#   defaults:                       chat-only  4            30           colocated
#
# Needs a vLLM CPU venv (docs/vllm-check.md: VLLM_PY=/tmp/vllm-venv/bin/python). Both servers
# listen on 127.0.0.1 only and are stopped on exit. Output: loadtest-vllm/{A,B,compare.md}.
set -euo pipefail
WORKLOAD=${1:-chat-only}
RATE=${2:-4}
DURATION=${3:-30}
MODE=${4:-colocated}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
MODEL=${MODEL:-/tmp/tiny-vllm}
OUT=${OUT:-loadtest-vllm}
KV=.venv/bin/kvfleet

[ -d "$MODEL" ] || $KV make-tiny-model "$MODEL"
# kvfleet gets the workload's tenants, weights and classes (a key per tenant); vLLM has no such
# notion and serves every request alike (it ignores the keys).
read -r ENGINE_YAML KEYS_YAML < <(.venv/bin/python -m loadtests.local_fleet "$WORKLOAD" "$OUT.config")
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_http() {  # URL, seconds
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "no answer from $1" >&2; return 1
}

$KV up --model "$MODEL" --mode "$MODE" --http-port 18000 --grpc-port 18051 \
  --config "$ENGINE_YAML" --api-keys "$KEYS_YAML" >"$OUT.kvfleet.log" 2>&1 &
pids+=($!)
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
VLLM_HOST_IP=127.0.0.1 "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --served-model-name tiny --host 127.0.0.1 --port 18100 --dtype float32 --max-model-len 16384 \
  --enforce-eager --seed 0 >"$OUT.vllm.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:18000/health 120
wait_http http://127.0.0.1:18100/health 300

$KV bench compare --workload "$WORKLOAD" --rate-scale "$RATE" --duration "$DURATION" --api-keys "$KEYS_YAML" \
  --endpoint http://127.0.0.1:18000 --endpoint http://127.0.0.1:18100 --out "$OUT"
