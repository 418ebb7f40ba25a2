"""Roundings that the GPU compiler must not change, shared by the Triton kernels that promise "rounded as
the torch ops round".

Triton compiles with FMA contraction on (its `enable_fp_fusion` option). For bf16 operands, LLVM first
narrows `round(x·c)` to a bf16 multiply, and the backend then fuses that multiply with the following add
into one `fma.rn.bf16`: the product is no longer rounded before the sum. Measured on an H200 (Triton 3.6),
a rotary embedding written as `((x1*c1).to(bf16) + (-x2*s1).to(bf16)).to(bf16)` differed from torch's
`x*cos + rotate_half(x)*sin` in 21% of the q elements, and two kernels holding the same expression
rounded differently from each other (the compiler fused one and not the other). `mul_rn` is a float32
multiply that no pass can fuse: inline PTX `mul.rn.f32`, which LLVM cannot see into and which ptxas never
contracts (an explicit rounding modifier). libdevice's `__nv_fmul_rn` would not do: LLVM's InstCombine
rewrites its intrinsic into a plain fmul, which the backend may fuse again. Under TRITON_INTERPRET (numpy,
which never fuses, and which runs no inline assembly) it is the plain product. So these roundings hold
whatever Triton's fusion default is (Triton 3.9 warns that 3.10 turns it off)."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, read as Triton reads it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED = tl.constexpr(_interpreted())


@triton.jit
def mul_rn(a, b):
    """a * b in float32, rounded once and never fused into an FMA with what consumes it."""
    if INTERPRETED:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def rope_sum(x, c, y, s, dt: tl.constexpr):
    """One rotary-embedding output x·c + y·s (y: rotate_half's signed source) as the torch ops round it:
    each product rounded to dt, then their sum rounded to dt. Float32 inputs holding dt values."""
    return (mul_rn(x, c).to(dt).to(tl.float32) + mul_rn(y, s).to(dt).to(tl.float32)).to(dt)
