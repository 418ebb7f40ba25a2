"""The grouped-expand kernels of triton_ops (lora_expand, silu_mul_expand, rope_expand_kv,
add_rms_norm_expand) compile for an H100 (sm_90) on a machine without a GPU: Triton's interpreter
(test_lora_grouped.py) runs their math in numpy and never lowers them, so this is the CPU check that the
code generator accepts them (every row-tile height, bf16 and float32, one rank block and several)."""

from __future__ import annotations

import platform
import sys

import pytest

KERNELS = (
    "_lora_expand_kernel",
    "_silu_mul_expand_kernel",
    "_rope_expand_kv_kernel",
    "_add_rms_norm_expand_kernel",
)
POINTERS = {
    "T",
    "Y0",
    "Y1",
    "Y2",
    "B0",
    "B1",
    "B2",
    "G",
    "U",
    "OUT",
    "BG",
    "BU",
    "Q",
    "K",
    "V",
    "QO",
    "KO",
    "VO",
}
POINTERS |= {"KC", "VC", "COS", "SIN", "BQ", "BK", "BV", "H", "D", "W", "RES_OUT", "B"}
INDICES = {"SLOTS", "POS"}  # int64 tensors
FLOATS = {"eps"}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp32", "ieee")])
@pytest.mark.parametrize("block_m,block_r", [(16, 16), (32, 16), (64, 64)])
def test_expand_kernels_compile_for_sm90(
    kernel: str, dtype: str, precision: str, block_m: int, block_r: int
) -> None:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lorafn.runtime.models import triton_ops

    fn = getattr(triton_ops, kernel)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=block_r, PRECISION=precision, HALF=64, BLOCK=64)
    constexprs["N"] = 4096
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}

    def kind(name: str) -> str:
        if name in POINTERS:
            return f"*{dtype}"
        if name in INDICES:
            return "*i64"
        if name in constexprs:
            return "constexpr"
        return "fp32" if name in FLOATS else "i32"

    signature = {n: kind(n) for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.metadata.num_warps == 4
    # bf16: tl.dot on the tensor cores; float32 "ieee" (the exactness tests' dtype) is plain FMAs
    assert ("mma" in compiled.asm["ptx"]) == (dtype == "bf16")
