"""Fused elementwise kernels of the Llama decoder for CUDA (Triton), within an ulp of the torch ops.

A decode step at small batch is bound by weight reads, and every extra kernel costs a few µs even
inside a CUDA graph: RMSNorm as torch ops is ~6 kernels, RoPE ~8 per tensor, SiLU·up 2. These fuse each
into one kernel. They round intermediates to the activation dtype exactly where transformers does
(e.g. `weight * normed.to(dtype)`, `q*cos + rotate_half(q)*sin` as three rounded bf16 ops), so the
GPU path stays comparable with transformers (tests/gpu: fp32 tokens equal, fused ops within an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafn.runtime.models.fused_decode import Expand, lora_add_tile, lora_args


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    OUT,
    RES_OUT,
    T,
    BT,
    stride_t,
    lora_off,
    lora_rank,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_LORA: tl.constexpr,
    LORA_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * N + offs, mask=mask, other=0.0)
    if HAS_RES:  # h = h + delta, rounded to the activation dtype as torch does
        delta = tl.load(R + row * N + offs, mask=mask, other=0.0)
        if HAS_LORA:  # delta + t·Bᵀ, rounded once (the unfused path's addmm_ epilogue)
            delta = lora_add_tile(
                delta.to(tl.float32), T, row, stride_t, lora_off, lora_rank, BT, N, offs, mask, LORA_R
            )
            delta = delta.to(RES_OUT.dtype.element_ty)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + offs, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> [T, N]; as models.llama.rms_norm."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _add_rms_norm_kernel[(x.shape[0],)](
        x,
        x,
        weight,
        out,
        out,
        x,
        x,
        0,
        0,
        0,
        eps,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        HAS_RES=False,
        HAS_LORA=False,
        LORA_R=0,
        num_warps=4,
    )
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, lora: Expand | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one kernel; h, delta [T, N] contiguous. With `lora`, delta is
    a projection's output and its LoRA expand is added to it first (fused_decode.py)."""
    res = torch.empty_like(h)
    out = torch.empty_like(h)
    n = h.shape[-1]
    t, b_t, stride_t, off, rank = lora_args(lora, h)
    _add_rms_norm_kernel[(h.shape[0],)](
        h,
        delta,
        weight,
        out,
        res,
        t,
        b_t,
        stride_t,
        off,
        rank,
        eps,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        HAS_RES=True,
        HAS_LORA=lora is not None,
        LORA_R=lora.rank if lora is not None else 0,
        num_warps=16 if lora is not None else 4,  # one program per row reads all of B: more loads in flight
    )
    return res, out


@triton.jit
def _rope_kernel(X, OUT, COS, SIN, POS, stride_xt, num_heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(POS + t).to(tl.int64)
    base = X + t * stride_xt + h * (2 * HALF)
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + pos * (2 * HALF) + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + pos * (2 * HALF) + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + pos * (2 * HALF) + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + pos * (2 * HALF) + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    # out = x*cos + rotate_half(x)*sin, each product and the sum rounded like the torch ops
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    out = OUT + t * (num_heads * 2 * HALF) + h * (2 * HALF)
    tl.store(out + offs, o1, mask=mask)
    tl.store(out + HALF + offs, o2, mask=mask)


def rope(
    x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """x [T, num_heads * D] (rows may be strided) -> rotated [T, num_heads, D].

    cos, sin: tables [max_pos, D]; positions [T] int64."""
    tokens = x.shape[0]
    head_dim = cos.shape[-1]
    out = torch.empty(tokens, num_heads, head_dim, device=x.device, dtype=x.dtype)
    half = head_dim // 2
    _rope_kernel[(tokens, num_heads)](
        x,
        out,
        cos,
        sin,
        positions,
        x.stride(0),
        num_heads,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1,
    )
    return out


@triton.jit
def _silu_mul_kernel(G, U, OUT, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + offs, (act * u).to(dt), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate/up contiguous of one shape."""
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 2048
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=4)
    return out
