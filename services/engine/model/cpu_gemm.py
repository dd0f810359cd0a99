"""oneDNN matmuls with weights packed once at start-up, for the model on a CPU.

`F.linear` on a CPU goes to MKL (float32) or oneDNN (bfloat16) and lays the weight out for the
kernel on every call. vLLM's CPU build packs each projection's weight into oneDNN's blocked
layout once, at load (`create_onednn_mm`); torch exposes the same two oneDNN calls that its
inductor uses for frozen CPU linears:

    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)     once, per projection
    y      = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")   per call

Measured on this 2-core AMD EPYC (AVX-512, avx512_bf16), bfloat16: the matmuls are most of a
step, and the packed ones took ~20% less time at decode batch 16 and ~15% less at 2,048-token
prefill steps (docs/benchmarks.md, "The engine next to vLLM").

The packed copy is an opaque oneDNN tensor beside the plain weight, which stays (the embedding,
tensor-parallel sharding and tests read plain weights): a packed model holds its projection
weights twice.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)
# "auto" packs bfloat16 only: F.linear already runs bfloat16 on oneDNN, and the packed weight gives
# the same bits (checked on SmolLM2: max |log_softmax diff| 0.0). float32 F.linear runs MKL, and
# oneDNN's float32 kernel sums in another order, which moved SmolLM2's log-probs by up to 1.3e-4
# against transformers' (the equivalence test's bound is 1e-4): float32 is packed only when asked
# ("onednn"), as vLLM's CPU build always does.
MODES = {"auto": (torch.bfloat16,), "onednn": (torch.float32, torch.bfloat16), "torch": ()}


def can_pack(device: torch.device, dtype: torch.dtype, mode: str = "auto") -> bool:
    """oneDNN is in this torch build and `mode` packs this dtype on this device."""
    return device.type == "cpu" and dtype in MODES[mode] and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> oneDNN's packed copy (for packed_linear only)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T -> [..., out], through the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def prepack(model: nn.Module, mode: str = "auto") -> int:
    """Give every bias-free layers.Linear of `model` (and a LlamaForward's tied head) its packed
    weight, as `mode` (MODES) says; a no-op off the CPU, and for layers packed already. -> how
    many weights were packed now."""
    if mode not in MODES:
        raise ValueError(f"unknown cpu_gemm {mode!r} ({'|'.join(MODES)})")
    from services.engine.model.layers import Linear
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None and module.bias is None \
                and can_pack(module.weight.device, module.weight.dtype, mode):
            module.packed = pack_weight(module.weight)
            packed += 1
    tied = hasattr(model, "head_packed") and getattr(model, "lm_head", None) is None
    if tied and model.head_packed is None:
        weight = model.head_weight()
        if can_pack(weight.device, weight.dtype, mode):
            model.head_packed = pack_weight(weight)
            packed += 1
    if packed:
        log.info("packed %d weights for oneDNN", packed)
    return packed
