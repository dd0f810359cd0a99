"""kernels/bench_gpu.py runs end to end at toy sizes under the interpreter, so the GPU check's
benchmark code cannot rot between GPU runs."""
from __future__ import annotations

import json

import pytest

from tests.kernels.helpers import ON_GPU


@pytest.mark.skipif(ON_GPU, reason="gpu_check.sh runs the real benchmark")
def test_bench_gpu_toy_run_writes_every_section(tmp_path):
    from kernels.bench_gpu import main
    from services.engine.engine import resolve_model_dir
    out = tmp_path / "bench.json"
    assert main(["--toy", "--out", str(out), "--model-dir", resolve_model_dir("tiny")]) == 0
    doc = json.loads(out.read_text())
    assert doc["toy"] and doc["device"] == "cpu (interpreter)"
    assert doc["decode"][0]["kv_bytes"] == 2 * 40 * 2 * 32 * 2 * 2          # batch x context x kv_heads x d x K,V x bf16
    assert doc["decode_fp8"][0]["kv_bytes"] == doc["decode"][0]["kv_bytes"] // 2
    assert doc["decode"][0]["GB_per_s"] > 0 and doc["prefill"][0]["TFLOP_per_s"] > 0
    assert doc["backends"]["mixed"]["triton_ms"] > 0 and doc["backends"]["decode"]["torch_ms"] > 0
    e2e = doc["e2e"]
    assert e2e["params"] > 1_000_000 and e2e["torch"]["decode_tok_per_s"] > 0 and e2e["triton"]["prefill_s"] > 0
