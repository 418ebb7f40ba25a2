"""The skinny GEMM with its group's LoRA expands inside (fused_decode.seg_linear(..., expands=...), what
EngineConfig.expand_in_gemm runs): interpreted on CPU against torch (float32: the product rounded, the
expand summed rank by rank and added, as the per-row kernels do), with several shrink programs, a member
without LoRA, mixed ranks, adapter slots, each launch's counter left at its shrink-program count and a
second launch on new inputs; and the kernel compiles for an H100 (sm_90) with every switch and every prologue
(tests/integration/runtime/test_seg_prologue.py checks their math), which the interpreter (numpy) never
checks."""

from __future__ import annotations

import pytest

from tests.unit.runtime.interpreted import require_triton, run_interpreted

_CHECK = """
import torch
from lorafn.runtime.models import fused_decode as fd

def reference(x, a_cat, weights, expands, row_slots):
    t = x @ a_cat.T
    outs = []
    for w, e in zip(weights, expands):
        y = x @ w.T
        if e is not None:
            off, rank, b_t = e
            rows = []
            for i in range(x.shape[0]):
                s = int(row_slots[i]) if row_slots is not None else 0
                cols = t[i, off + s * rank: off + (s + 1) * rank]
                rows.append(y[i] + cols @ b_t[s * rank: (s + 1) * rank])
            y = torch.stack(rows)
        outs.append(y)
    return t, outs

gen = torch.Generator().manual_seed(0)
flags = fd.seg_flags("cpu")
K = 64
# (rows, slots, ranks per member: 0 = no LoRA, widths per member); the shrink's programs take 16 rows of
# A_cat: 40 and 36 of them are three programs, 16 and 4 one
cases = [(3, 1, (16, 0, 24), (96, 40, 64)), (5, 3, (8, 4), (64, 32)), (1, 1, (16,), (96,)),
         (17, 2, (2,), (40,))]
for rows, slots, ranks, widths in cases:
    for trial in range(2):  # a second launch on new inputs, its counter zeroed again
        x = torch.randn(rows, K, generator=gen)
        weights = [torch.randn(n, K, generator=gen) for n in widths]
        expands, off = [], 0
        for r, n in zip(ranks, widths):
            expands.append((off, r, torch.randn(slots * r, n, generator=gen)) if r else None)
            off += slots * r
        a_cat = torch.randn(off, K, generator=gen)
        row_slots = torch.randint(0, slots, (rows,), generator=gen) if slots > 1 else None
        flags.zero_()
        t, *outs = fd.seg_linear(x, [a_cat, *weights], expands, row_slots, flags)
        want_t, want = reference(x, a_cat, weights, expands, row_slots)
        torch.testing.assert_close(t, want_t, atol=1e-4, rtol=1e-5)
        for got, ref in zip(outs, want):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
        # the launch counted its shrink programs (16 rows of A_cat each) into its counter
        assert flags.tolist() == [fd.shrink_programs(off)] == [-(-off // 16)], (flags, off)
        plain = fd.seg_linear(x, weights)  # no expands: the products alone
        for got, w in zip(plain, weights):
            torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-5)
for bad in ({"expands": [None]}, {"flags": None}, {"flags": torch.zeros(1, dtype=torch.int64)}):
    kw = {"expands": [None, None], "flags": flags, **bad}
    try:
        fd.seg_linear(x, [a_cat, weights[0], weights[0]], kw["expands"], None, kw["flags"])
    except ValueError as e:
        assert "seg_linear" in str(e), e
    else:
        raise AssertionError(f"accepted {bad}")
print("ok")
"""


def test_seg_linear_with_expands_interpreted_matches_torch() -> None:
    run_interpreted(_CHECK)


@pytest.mark.parametrize("expand,slotted", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp32", "ieee")])
@pytest.mark.parametrize("prologue", [0, 1, 2, 3])
def test_seg_gemm_kernel_compiles_for_sm90(
    expand: bool, slotted: bool, dtype: str, precision: str, prologue: int
) -> None:
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lorafn.runtime.models import fused_decode as fd

    fn = fd._seg_gemm_kernel
    constexprs = dict(
        BLOCK_M=16,
        BLOCK_N=fd.BLOCK_N,
        BLOCK_K=128,
        PRECISION=precision,
        EXPAND=expand,
        R=16,
        SLOTTED=slotted,
        RP=16,
        PROLOGUE=prologue,  # fd.PRO_NONE .. fd.PRO_SILU_MUL
        SHRINK_N=fd.SHRINK_N if expand else fd.BLOCK_N,
    )
    pointers = {
        "X",
        "W0",
        "W1",
        "W2",
        "W3",
        "Y0",
        "Y1",
        "Y2",
        "Y3",
        "BT1",
        "BT2",
        "BT3",
        "X2",
        "NORM_W",
        "H_OUT",
    }

    def kind(name: str) -> str:
        if name in pointers:
            return f"*{dtype}"
        if name == "FLAGS":
            return "*i32"
        if name == "ROW_SLOTS":
            return "*i64"
        if name == "EPS":
            return "fp32"
        return "constexpr" if name in constexprs else "i32"

    signature = {n: kind(n) for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_stages": 4})
    ptx = compiled.asm["ptx"]
    assert ("mma" in ptx) == (dtype == "bf16")
    # the shrink's release and the others' acquire at GPU scope (Triton makes the acquiring add of 0 a
    # load): only where the expands are inside
    ordered = [line for line in ptx.splitlines() if ".gpu." in line]
    assert any(".release." in line for line in ordered) == expand
    assert any(".acquire." in line for line in ordered) == expand
    # the residual add's store to H_OUT is guarded to one program; the norms take a reciprocal square root
    assert ("rsqrt" in ptx) == (prologue in (fd.PRO_NORM.value, fd.PRO_ADD_NORM.value))
