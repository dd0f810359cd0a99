"""SiLU-and-mul: the SwiGLU activation over the fused gate/up projection's output.

    gate_up  [T, 2 * I]  = cat(gate, up) along the last dim (SwiGLU.gate_up_proj's output)
    out      [T, I]      = silu(gate).to(dtype) * up    (torch's rounding: silu, then the product)
Grid (ceil(T / BLOCK_T), ceil(I / BLOCK)), BLOCK_T = common.rows_per_program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import COMPUTE_DTYPES, rows_per_program, to_dtype

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, num_rows, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    offs = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (t < num_rows) & (offs < INTER)
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = to_dtype(gate / (1.0 + tl.exp(-gate)), dt).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, to_dtype(act * up, dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, gate_up.stride()
    assert gate_up.dtype in COMPUTE_DTYPES, gate_up.dtype
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK, triton.next_power_of_2(inter))
    if t:
        rows = rows_per_program(t)
        _silu_mul_kernel[(triton.cdiv(t, rows), triton.cdiv(inter, block))](
            gate_up, out, t, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, BLOCK_T=rows)
    return out
