"""Run by test_seg_prologue.py in a child with TRITON_INTERPRET=1: the skinny GEMM with its input's residual
add + RMSNorm or SiLU·up inside (fused_decode.seg_linear(..., prologue=...), EngineConfig.gemm_prologue_rows)
against the kernels it replaces run first (triton_ops.rms_norm, add_rms_norm, silu_mul, then seg_linear on
their output), interpreted on CPU tensors with triton_bf16's GPU-like bf16; and in float32 against torch.

    python -m tests.integration.runtime.seg_prologue_check

What must hold: the residual the GEMM writes equals add_rms_norm's bit for bit; the outputs equal the
two-kernel path's on at least MIN_EQUAL of them in bf16 and are within one bf16 step elsewhere (the norm's
float32 sum runs tile by tile in the GEMM, over the whole row in add_rms_norm: a normed value at a rounding
boundary may land one step apart, and the GEMM carries that on); float32 within 1e-5 of torch. With the LoRA
expands inside (`expands=`) too, and the counters left at zero. Prints one line per check and `ok` last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tests.integration.runtime.triton_bf16  # noqa: F401  (patches the interpreter's bf16)
from lorafn.runtime.models import fused_decode as fd
from lorafn.runtime.models import triton_ops

MIN_EQUAL = 0.99
EPS = 1e-5


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        print(f"{name}: within 1e-5")
        return
    equal = (got == want).float().mean().item()
    step = want.abs().clamp_min(2.0**-100) * 2.0**-7  # a bf16 step is at most 2^-7 of the value
    worst = ((got - want).abs() / step).max().item()
    assert equal >= MIN_EQUAL and worst <= 1.0, f"{name}: {equal:.4%} equal, worst {worst:.2f} steps apart"
    print(f"{name}: {equal:.4%} equal to the two-kernel path (worst {worst:.2f} step)")


def zeroed(flags: torch.Tensor | None) -> torch.Tensor | None:
    """The counter of a launch with expands, zeroed first (seg_linear's contract); None stays None."""
    return flags.zero_() if flags is not None else None


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    flags = fd.seg_flags("cpu")
    # (rows, K, output widths, LoRA rank or 0): one row (a batch-1 decode), a 16-row tile's last row, K of
    # several reduction tiles, a group with its shrink and expands inside
    cases = [(1, 256, (96, 40), 8), (16, 128, (64, 32, 32), 16), (5, 384, (64,), 0)]
    for dtype in (torch.bfloat16, torch.float32):

        def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(dtype)

        for rows, k, widths, rank in cases:
            h, delta, up = randn(rows, k), randn(rows, k), randn(rows, k)
            norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
            weights = [randn(n, k, scale=k**-0.5) for n in widths]
            if rank:
                a_cat = randn(rank * len(widths), k, scale=k**-0.5)
                expands = [(i * rank, rank, randn(rank, n, scale=0.25)) for i, n in enumerate(widths)]
                ws, fl = [a_cat, *weights], flags
            else:
                ws, expands, fl = weights, None, None
            res, normed = triton_ops.add_rms_norm(h, delta, norm_w, EPS)
            paths = [
                ("rms_norm", fd.NormPrologue(norm_w, EPS), triton_ops.rms_norm(h, norm_w, EPS)),
                ("add_rms_norm", fd.NormPrologue(norm_w, EPS, delta, torch.full_like(h, 7.0)), normed),
                ("silu_mul", fd.SiluMulPrologue(up), triton_ops.silu_mul(h, up)),
            ]
            for name, prologue, x in paths:
                label = f"{name} in the GEMM, {dtype}, {rows} rows, K {k}, rank {rank}"
                got = fd.seg_linear(h, ws, expands, None, zeroed(fl), prologue=prologue)
                if fl is not None:  # the launch counted its shrink programs into the counter
                    assert fl.item() == fd.shrink_programs(ws[0].shape[0]), f"{label}: counter {fl.item()}"
                want = fd.seg_linear(x, ws, expands, None, zeroed(fl))
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    check(f"{label}, output {i}", g, w, dtype)
                if isinstance(prologue, fd.NormPrologue) and prologue.residual is not None:
                    assert torch.equal(prologue.residual, res), f"{label}: the residual differs"
                    print(f"{label}: the residual equals add_rms_norm's")
            if dtype == torch.float32:  # and against torch itself
                hd = h + delta
                ref = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_w
                got = fd.seg_linear(
                    h, weights, prologue=fd.NormPrologue(norm_w, EPS, delta, torch.empty_like(h))
                )
                check(
                    f"add_rms_norm in the GEMM against torch, {rows} rows", got[0], ref @ weights[0].T, dtype
                )
                got = fd.seg_linear(h, weights, prologue=fd.SiluMulPrologue(up))
                check(
                    f"silu_mul in the GEMM against torch, {rows} rows",
                    got[0],
                    (F.silu(h) * up) @ weights[0].T,
                    dtype,
                )

    # bad prologues are refused with the field named
    h = torch.randn(2, 64)
    w = torch.randn(32, 64)
    bad = [
        (fd.NormPrologue(torch.ones(32), EPS), "weight"),
        (fd.NormPrologue(torch.ones(64), EPS, torch.randn(2, 64)), "delta and residual together"),
        (fd.NormPrologue(torch.ones(64), EPS, torch.randn(3, 64), torch.empty(3, 64)), "delta"),
        (fd.SiluMulPrologue(torch.randn(2, 64).bfloat16()), "up"),
        (fd.NormPrologue(torch.ones(64), EPS, torch.randn(2, 64), torch.empty(64, 2).T), "residual"),
    ]
    for prologue, word in bad:
        try:
            fd.seg_linear(h, [w], prologue=prologue)
        except ValueError as err:
            assert "seg_linear" in str(err) and word in str(err), err
        else:
            raise AssertionError(f"accepted {prologue}")
    print("bad prologues refused")
    print("ok")


if __name__ == "__main__":
    main()
