"""The decode kernel (fp8 cache, split partitions, and its reduction) compiles for sm_90 (H100/H200)
through Triton's bundled ptxas, with no GPU: what the interpreter cannot check (tl.dot shapes, casts),
and its K/V loads are pipelined (cp.async), which decode bandwidth depends on.
`python -m kernels.compile_check` compiles every kernel's specialisations the same way (~2 min)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.kernels.helpers import ON_GPU


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile every kernel")
def test_decode_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--only", "decode fp8 cache split"],
                          env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["kernel"] for r in rows if r.get("ok")} == {"_decode_kernel", "_reduce_kernel"}
    decode = next(r for r in rows if r.get("kernel") == "_decode_kernel")
    assert decode["cp_async"] > 0  # the K/V loads through the block table are software-pipelined
    assert rows[-1] == {"arch": 90, "compiled": 2, "failed": 0}
