"""Compile every kernel for an NVIDIA GPU (default sm_90, H100/H200) on a machine without one.

    python -m kernels.compile_check [--arch 90] [--quick] [--only CASE ...]

Each launcher runs on small CPU tensors with the kernel swapped for a recorder, so the
specialisations compiled (dtypes, constexprs, num_warps, num_stages) are exactly the ones the
launcher would launch; each is then compiled ahead of time with `triton.compile(ASTSource,
GPUTarget("cuda", arch, 32))` through Triton's bundled ptxas down to a cubin. This catches what the
interpreter lets through (tl.dot shapes, dtype rules, unsupported casts) but says nothing of speed or
of numerics on the GPU (kernels/gpu_check.sh). Arguments get the divisibility-by-16 attributes
Triton's JIT would give them at launch, so loads vectorise and pipeline as they would on the GPU;
`cp_async` in the output counts the pipelined (asynchronous) copies. Needs TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time

import torch

TL_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records the call instead of launching."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextlib.contextmanager
def recording(module_name: str, kernel_names: tuple[str, ...]):
    module = importlib.import_module(module_name)
    recorders = {n: Recorder(getattr(module, n)) for n in kernel_names}
    try:
        for n, r in recorders.items():
            setattr(module, n, r)
        yield recorders
    finally:
        for n, r in recorders.items():
            setattr(module, n, r.kernel)


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TL_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_call(kernel, args, kwargs, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = kernel.arg_names
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    constexprs = {p.name: bound[p.name] for p in kernel.params if p.is_constexpr}
    signature = {n: "constexpr" if n in constexprs else _type(bound[n]) for n in names}
    # what Triton's JIT specialises on at launch: pointers 16-byte aligned, ints divisible by 16
    # (without it loads are not vectorised or pipelined, and the code is not what a GPU would run)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and _divisible_by_16(bound[n])}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def _divisible_by_16(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def launches(quick: bool):
    """(label, module, kernel names, launcher call) for each specialisation worth compiling."""
    from kernels import (chunked_prefill_attention, paged_decode_attention, rmsnorm, rope, silu_mul,
                         store_kvcache)
    t, heads, kv_heads, d, bs = 6, 32, 8, 128, 16

    def qkv(dtype):
        x = torch.zeros(t, heads + 2 * kv_heads, d, dtype=dtype)
        return x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]

    def cache(dtype):
        return torch.zeros(8, bs, kv_heads, d, dtype=dtype), torch.zeros(8, bs, kv_heads, d, dtype=dtype)

    i32 = dict(dtype=torch.int32)
    # contexts of 200 tokens: long enough that num_splits > 1 survives the 64-token partition rounding
    rows, tables, lens = torch.arange(2, **i32), torch.zeros(3, 13, **i32), torch.full((3,), 200, **i32)
    cu = torch.tensor([0, 1, 2, 6], **i32)

    def decode(q_dtype, c_dtype, splits):
        q, _, _ = qkv(q_dtype)
        kc, vc = cache(c_dtype)
        return lambda: paged_decode_attention.paged_decode_attention(
            q, kc, vc, torch.empty(q.shape, dtype=q_dtype), rows, rows, lens, tables, 200, num_splits=splits)

    def prefill(q_dtype, c_dtype):
        q, _, _ = qkv(q_dtype)
        kc, vc = cache(c_dtype)
        return lambda: chunked_prefill_attention.chunked_prefill_attention(
            q, kc, vc, torch.empty(q.shape, dtype=q_dtype), torch.tensor([2], **i32), cu, lens, tables, 4)

    def store(q_dtype, c_dtype):
        _, k, v = qkv(q_dtype)
        kc, vc = cache(c_dtype)
        return lambda: store_kvcache.store_kvcache(k, v, kc, vc, torch.arange(t), 0.5, 0.5)

    def norm(dtype, residual):
        x = torch.zeros(t, 2048, dtype=dtype)
        return lambda: rmsnorm.rmsnorm(x, torch.ones(2048, dtype=dtype), 1e-5, x if residual else None)

    def rotary(dtype):
        q, _, _ = qkv(dtype)
        x = torch.zeros(t, heads + kv_heads, d, dtype=dtype)
        return lambda: rope.apply_rope(x, torch.zeros(t, d // 2, dtype=dtype), torch.zeros(t, d // 2, dtype=dtype))

    def silu(dtype):
        return lambda: silu_mul.silu_and_mul(torch.zeros(t, 2 * 8192, dtype=dtype))

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    dec, pre = "kernels.paged_decode_attention", "kernels.chunked_prefill_attention"
    specs = [
        ("decode bf16", dec, ("_decode_kernel", "_reduce_kernel"), decode(bf16, bf16, 1)),
        ("decode bf16 split", dec, ("_decode_kernel", "_reduce_kernel"), decode(bf16, bf16, 3)),
        ("decode fp8 cache split", dec, ("_decode_kernel", "_reduce_kernel"), decode(bf16, fp8, 3)),
        ("prefill bf16", pre, ("_prefill_kernel",), prefill(bf16, bf16)),
        ("prefill fp8 cache", pre, ("_prefill_kernel",), prefill(bf16, fp8)),
        ("store bf16", "kernels.store_kvcache", ("_store_kvcache_kernel",), store(bf16, bf16)),
        ("store fp8", "kernels.store_kvcache", ("_store_kvcache_kernel",), store(bf16, fp8)),
        ("rmsnorm bf16 + residual", "kernels.rmsnorm", ("_rmsnorm_kernel",), norm(bf16, True)),
        ("rope bf16", "kernels.rope", ("_rope_kernel",), rotary(bf16)),
        ("silu_mul bf16", "kernels.silu_mul", ("_silu_mul_kernel",), silu(bf16)),
    ]
    if not quick:
        specs += [
            ("decode fp32", dec, ("_decode_kernel", "_reduce_kernel"), decode(torch.float32, torch.float32, 1)),
            ("decode fp16 split", dec, ("_decode_kernel", "_reduce_kernel"), decode(torch.float16, torch.float16, 2)),
            ("prefill fp32", pre, ("_prefill_kernel",), prefill(torch.float32, torch.float32)),
            ("prefill fp16", pre, ("_prefill_kernel",), prefill(torch.float16, torch.float16)),
            ("rmsnorm fp32", "kernels.rmsnorm", ("_rmsnorm_kernel",), norm(torch.float32, False)),
        ]
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--quick", action="store_true", help="the bf16 / fp8 specialisations only")
    p.add_argument("--only", nargs="+", metavar="CASE", help="just these cases (labels as printed)")
    args = p.parse_args(argv)
    from kernels.common import interpreted
    if interpreted():
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled", file=sys.stderr)
        return 2
    results, failed = [], 0
    for label, module, kernel_names, launch in launches(args.quick):
        if args.only and label not in args.only:
            continue
        with recording(module, kernel_names) as recorders:
            launch()
        for name, rec in recorders.items():
            for call_args, call_kwargs in rec.calls:
                start = time.perf_counter()
                try:
                    compiled = compile_call(rec.kernel, call_args, call_kwargs, args.arch)
                    # cp_async: asynchronous global->shared copies, i.e. the loop's loads are pipelined
                    row = {"kernel": name, "case": label, "ok": True, "s": round(time.perf_counter() - start, 1),
                           "shared_bytes": compiled.metadata.shared,
                           "cp_async": compiled.asm["ptx"].count("cp.async.c")}
                except Exception as e:  # noqa: BLE001 (report every failure, keep going)
                    failed += 1
                    row = {"kernel": name, "case": label, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
                results.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"arch": args.arch, "compiled": len(results) - failed, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
