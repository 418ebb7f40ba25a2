"""Run by test_expand_rounding.py in a child with TRITON_INTERPRET=1: the bf16 roundings of every kernel that
adds a LoRA expand y += t·Bᵀ (triton_ops' grouped kernels for large steps, fused_decode's per-row kernels for
small steps and `in_kernels`), interpreted on CPU tensors with triton_bf16's GPU-like bf16 (exact products,
float32 accumulation, round to nearest even).

The semantics they promise: the expand accumulated in float32, added to the projection's output in float32 and
rounded once to bf16 (`round_once` below; what `addmm_` does on a CPU, checked here too), then the next op
(RoPE, SiLU·up, add + RMSNorm) with torch's roundings. A kernel that rounds t·Bᵀ to bf16 before adding it
(`round_twice`) differs from that on ~28% of outputs of these shapes, and this check fails.

    python -m tests.integration.runtime.expand_rounding_check

Prints one line per check and `ok` last; exits non-zero (an AssertionError) on the first difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tests.integration.runtime.triton_bf16  # noqa: F401  (patches the interpreter's bf16)
from lorafn.runtime.models import fused_decode as fd
from lorafn.runtime.models import triton_ops
from lorafn.runtime.models.fused_decode import Expand
from lorafn.runtime.models.llama import apply_rope, rms_norm

BF16 = torch.bfloat16
# outputs equal to the reference at least this often (float32 summation order may move a value across a
# rounding boundary now and then); the rest at most one bf16 step apart
MIN_EQUAL = 0.999


def round_once(y: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """bf16(y + t·b_t): the product summed exactly (float64), then float32 (what a float32 accumulator holds,
    up to its summation order), then one rounding to bf16."""
    return (y.double() + t.double() @ b_t.double()).float().to(y.dtype)


def round_twice(y: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """bf16(y + bf16(t·b_t)): the product rounded to bf16 before the add (not what the kernels promise)."""
    return (y.float() + (t.double() @ b_t.double()).float().to(y.dtype).float()).to(y.dtype)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """Asserts got == want on at least MIN_EQUAL of the outputs and within one bf16 step elsewhere; returns
    the equal fraction."""
    got, want = got.float(), want.float()
    equal = (got == want).float().mean().item()
    step = want.abs().clamp_min(2.0**-100) * 2.0**-7  # a bf16 step is at most 2^-7 of the value
    worst = ((got - want).abs() / step).max().item()
    assert equal >= MIN_EQUAL and worst <= 1.0, f"{name}: {equal:.4%} equal, worst {worst:.2f} steps apart"
    print(f"{name}: {equal:.4%} equal to the round-once reference (worst {worst:.2f} step)")
    return equal


def main() -> None:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(BF16)

    rows = 40  # above 16: two row tiles of the grouped kernels
    # the reference semantics is addmm_'s on a CPU; the twice-rounded one differs from it on many outputs
    t, b, y = randn(rows, 16), randn(16, 512, scale=0.25), randn(rows, 512)
    assert torch.equal(y.clone().addmm_(t, b), round_once(y, t, b)), "CPU addmm_ does not round once"
    differ = (round_twice(y, t, b) != round_once(y, t, b)).float().mean().item()
    assert differ > 0.1, differ
    print(f"CPU addmm_ rounds once; rounding the product first changes {differ:.1%} of the outputs")

    # lora_expand: three members (mixed ranks; one above the 64-wide rank block), strided outputs
    ranks, widths = (8, 80, 16), (512, 256, 256)
    offs = [sum(ranks[:i]) for i in range(3)]
    t = randn(rows, sum(ranks) + 4)
    wide = randn(rows, sum(widths) + 32)
    ys = [wide[:, sum(widths[:i]) : sum(widths[: i + 1])] for i in range(3)]
    bs = [randn(r, n, scale=0.25) for r, n in zip(ranks, widths, strict=True)]
    want = [round_once(y, t[:, o : o + r], bb) for y, o, r, bb in zip(ys, offs, ranks, bs, strict=True)]
    triton_ops.lora_expand(t, list(zip(ys, offs, ranks, bs, strict=True)))
    for i, (y, w) in enumerate(zip(ys, want, strict=True)):
        check(f"lora_expand member {i} (rank {ranks[i]})", y, w)

    # SiLU·up with the gate/up expands: grouped (row tiles) and per row (a small step; in_kernels)
    n = 384
    t = randn(rows, 40)
    gate_up = randn(rows, 2 * n)
    gate, up = gate_up[:, :n], gate_up[:, n:]
    eg, eu = Expand(t, 0, 16, randn(16, n, scale=0.25)), Expand(t, 16, 24, randn(24, n, scale=0.25))
    g, u = round_once(gate, t[:, :16], eg.b_t), round_once(up, t[:, 16:40], eu.b_t)
    want = (F.silu(g.float()).to(BF16).float() * u.float()).to(BF16)
    check("silu_mul_expand (grouped)", triton_ops.silu_mul_expand(gate, up, (eg, eu)), want)
    check("silu_mul_lora (per row: small steps, in_kernels)", fd.silu_mul_lora(gate, up, (eg, eu)), want)

    # RoPE + K/V cache writes with the q/k/v expands: grouped and per row
    heads, kv_heads, d = 4, 2, 64
    widths = (heads * d, kv_heads * d, kv_heads * d)
    t = randn(rows, 48)
    qkv = randn(rows, sum(widths))
    q, k, v = qkv.split(widths, dim=1)
    lora = tuple(Expand(t, 16 * i, 16, randn(16, w, scale=0.25)) for i, w in enumerate(widths))
    cos, sin = randn(256, d), randn(256, d)
    positions = torch.randint(0, 256, (rows,), generator=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:rows]
    qe, ke, ve = (
        round_once(x, t[:, e.offset : e.offset + e.rank], e.b_t)
        for x, e in zip(qkv.split(widths, 1), lora, strict=True)
    )
    cs, sn = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want = (apply_rope(qe.view(rows, heads, d), cs, sn), apply_rope(ke.view(rows, kv_heads, d), cs, sn),
            ve.view(rows, kv_heads, d))  # fmt: skip
    for label, fn in (("rope_expand_kv (grouped)", triton_ops.rope_expand_kv),
                      ("rope_lora_kv (per row: small steps, in_kernels)", fd.rope_lora_kv)):  # fmt: skip
        caches = [torch.zeros(8, 16, kv_heads, d, dtype=BF16) for _ in range(2)]
        got = fn(q, k, v, lora, heads, kv_heads, cos, sin, positions, caches[0], caches[1], slots)
        for part, a, w in zip("qkv", got, want, strict=True):
            check(f"{label} {part}", a, w)
        check(f"{label} K cache", caches[0].view(-1, kv_heads, d)[slots], want[1])
        check(f"{label} V cache", caches[1].view(-1, kv_heads, d)[slots], want[2])

    # residual add + RMSNorm with the o/down expand: grouped (row tiles) and per row
    n = 512
    t = randn(rows, 24)
    e = Expand(t, 8, 16, randn(16, n, scale=0.25))
    h, delta, weight = randn(rows, n), randn(rows, n), randn(n)
    res = (h.float() + round_once(delta, t[:, 8:24], e.b_t).float()).to(BF16)
    want = (res, rms_norm(res, weight, 1e-5))
    for label, got in (
        ("add_rms_norm_expand (grouped)", triton_ops.add_rms_norm_expand(h, delta, weight, 1e-5, e)),
        ("add_rms_norm + expand (per row: small steps, in_kernels)",
         triton_ops.add_rms_norm(h, delta, weight, 1e-5, lora=e)),
    ):  # fmt: skip
        check(f"{label} residual", got[0], want[0])
        check(f"{label} normed", got[1], want[1])
    print("ok")


if __name__ == "__main__":
    main()
