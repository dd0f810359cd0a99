"""Kernel tests run on CPU under Triton's interpreter.

Triton decides whether a kernel is interpreted when its `@triton.jit` runs, i.e. when the kernels.*
module is imported: this conftest sets TRITON_INTERPRET=1, imports every kernel module, and puts the
environment back, so that other test packages (and the processes they start) never see the
variable. An autouse fixture sets it again around each test here, for the launchers' own checks
(kernels.common.interpreted) and Triton's runtime.

With KVFLEET_KERNELS_ON_GPU=1 (kernels/gpu_check.sh) the same tests run compiled on CUDA instead:
no interpreter, and tensors are made on the GPU (torch.set_default_device, helpers.DEVICE).
"""
from __future__ import annotations

import importlib
import os

import pytest

KERNEL_MODULES = ("kernels.store_kvcache", "kernels.paged_decode_attention", "kernels.chunked_prefill_attention",
                  "kernels.rmsnorm", "kernels.rope", "kernels.silu_mul")


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if os.environ.get("KVFLEET_KERNELS_ON_GPU") == "1":  # kernels/gpu_check.sh runs these tests compiled
    import torch
    torch.set_default_device("cuda")
else:
    _import_interpreted()


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    if os.environ.get("KVFLEET_KERNELS_ON_GPU") == "1":
        yield "cuda"
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield "cpu"
