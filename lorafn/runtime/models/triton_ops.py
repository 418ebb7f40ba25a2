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

from lorafn.runtime.models.fused_decode import (
    DOT_PRECISION,
    Expand,
    _rope_half_pair,
    lora_add_tile,
    lora_args,
    slot_args,
)

MAX_EXPAND_OUTPUTS = 3  # a projection group's members: q/k/v (gate/up: 2, o and down: 1)


def _next_pow2(n: int) -> int:
    """triton.next_power_of_2 in plain Python: that one costs ~3 µs a call from the host, and an eager
    prefill calls these wrappers several times per layer."""
    return 1 << (n - 1).bit_length()


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
    ROW_SLOTS,
    SLOTTED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * N + offs, mask=mask, other=0.0)
    if HAS_RES:  # h = h + delta, rounded to the activation dtype as torch does
        delta = tl.load(R + row * N + offs, mask=mask, other=0.0)
        if HAS_LORA:  # delta + t·Bᵀ, rounded once (the unfused path's addmm_ epilogue)
            delta = lora_add_tile(
                delta.to(tl.float32), T, row, stride_t, lora_off, lora_rank, BT, N, offs, mask, LORA_R,
                ROW_SLOTS, SLOTTED,
            )  # fmt: skip
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
        BLOCK=_next_pow2(n),
        HAS_RES=False,
        HAS_LORA=False,
        LORA_R=0,
        ROW_SLOTS=x,
        SLOTTED=False,
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
    row_slots, slotted = slot_args(lora, h)
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
        BLOCK=_next_pow2(n),
        HAS_RES=True,
        HAS_LORA=lora is not None,
        LORA_R=lora.rank if lora is not None else 0,
        ROW_SLOTS=row_slots,
        SLOTTED=slotted,
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
        BLOCK=_next_pow2(half),
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
    _silu_mul_kernel[(-(-n // block),)](gate, up, out, n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _expand_tile(
    acc, T, rm, m_ok, stride_t, off, rank, B, rn, n_ok, n, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr
):
    """acc + t[rm, off:off+rank] · B[:, rn] (B: [rank, n] contiguous) in float32 (tl.dot: the tensor cores
    for bf16/fp16; float32 models get IEEE FMAs, see fused_decode.DOT_PRECISION)."""
    rr = tl.arange(0, BLOCK_R)
    for r0 in range(0, rank, BLOCK_R):
        r_ok = (r0 + rr) < rank
        t = tl.load(
            T + rm[:, None] * stride_t + off + r0 + rr[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0
        )
        b = tl.load(B + (r0 + rr)[:, None] * n + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(t, b, input_precision=PRECISION)
    return acc


# Not specialized: M, the offsets and the ranks. Triton compiles a variant per integer argument equal to 1
# or divisible by 16; each is compiled (or read from its cache) and loaded on first use, which for M would
# be inside a request of a new prefill length, and for ranks/offsets per adapter shape. (Checked: this
# compiles for sm_90 ahead of time on a CPU machine, triton.compile with GPUTarget("cuda", 90, 32).)
@triton.jit(do_not_specialize=["M", "OFF0", "OFF1", "OFF2", "R0", "R1", "R2"])
def _lora_expand_kernel(
    T,
    Y0,
    Y1,
    Y2,
    B0,
    B1,
    B2,
    N0,
    N1,
    N2,
    OFF0,
    OFF1,
    OFF2,
    R0,
    R1,
    R2,
    STRIDE_Y0,
    STRIDE_Y1,
    STRIDE_Y2,
    M,
    stride_t,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # axis 0: the output column tiles of every member, member after member (as seg_gemm lays out its
    # segments); axis 1: row tiles. An absent member has N = 0 and owns no program.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    end0 = tl.cdiv(N0, BLOCK_N)
    end1 = end0 + tl.cdiv(N1, BLOCK_N)
    y = Y0
    b = B0
    n = N0
    off = OFF0
    rank = R0
    stride_y = STRIDE_Y0
    first = 0
    if pid_n >= end0:
        y = Y1
        b = B1
        n = N1
        off = OFF1
        rank = R1
        stride_y = STRIDE_Y1
        first = end0
    if pid_n >= end1:
        y = Y2
        b = B2
        n = N2
        off = OFF2
        rank = R2
        stride_y = STRIDE_Y2
        first = end1
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _expand_tile(acc, T, rm, m_ok, stride_t, off, rank, b, rn, n_ok, n, BLOCK_R, PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = y + rm[:, None] * stride_y + rn[None, :]
    c = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (c + acc).to(y.dtype.element_ty), mask=mask)  # rounded once


def lora_expand(t: torch.Tensor, targets: list[tuple[torch.Tensor, int, int, torch.Tensor]]) -> None:
    """y += t[:, off:off+rank] · b_t for each (y, off, rank, b_t) of one projection group, in place and in
    ONE launch (the members share the group's shrink t [M, sum of ranks]): the products accumulated in
    float32, added to y in float32 and rounded once to its dtype (what addmm_ per member computes on a CPU;
    cuBLAS's bf16 addmm_ on the H100 appears to round the product first, docs/runtime.md).

    y: [M, N_i] (rows may be strided, columns contiguous: the base GEMMs' outputs); b_t: [rank_i, N_i]
    contiguous, the adapter's own buffers (LoRAGroup.targets): a bind's copy_lora / clear_lora refresh
    them in place, so CUDA graphs over this launch stay valid. 1..3 members."""
    # host time matters here (an eager prefill calls this 3x per layer): plain int arithmetic (see
    # _next_pow2), one pass over the members, checks that cost no copies
    if not 1 <= len(targets) <= MAX_EXPAND_OUTPUTS:
        raise ValueError(f"lora_expand: 1..{MAX_EXPAND_OUTPUTS} targets, got {len(targets)}")
    m, width = t.shape
    if t.stride(1) != 1:
        raise ValueError(f"lora_expand: t {tuple(t.shape)} stride {t.stride()}: columns must be contiguous")
    ys, bs, ns, offs, ranks, strides = [], [], [], [], [], []
    tiles = 0
    block_n = 128
    for y, off, rank, b_t in targets:
        rows, n = y.shape
        y_stride, y_col = y.stride()
        if rows != m or y_col != 1 or tuple(b_t.shape) != (rank, n) or not 0 <= off <= width - rank:
            raise ValueError(
                f"lora_expand: output {tuple(y.shape)} stride {y.stride()} does not fit its expand "
                f"(t {tuple(t.shape)}, offset {off}, rank {rank}, b_t {tuple(b_t.shape)})"
            )
        ys.append(y)
        bs.append(b_t)
        ns.append(n)
        offs.append(off)
        ranks.append(rank)
        strides.append(y_stride)
        tiles += -(-n // block_n)
    pad = MAX_EXPAND_OUTPUTS - len(targets)
    ys += [ys[0]] * pad
    bs += [bs[0]] * pad
    ns += [0] * pad
    offs += [0] * pad
    ranks += [0] * pad
    strides += [0] * pad
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    # tl.dot needs K >= 16; ranks above 64 loop over blocks of 64
    block_r = 16 if max(ranks) <= 16 else 32 if max(ranks) <= 32 else 64
    grid = (tiles, -(-m // block_m))
    _lora_expand_kernel[grid](
        t,
        *ys,
        *bs,
        *ns,
        *offs,
        *ranks,
        *strides,
        m,
        t.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=DOT_PRECISION[t.dtype],
        num_warps=4,
    )


@triton.jit(do_not_specialize=["M", "off_g", "off_u", "rank_g", "rank_u"])
def _silu_mul_expand_kernel(
    G,
    U,
    OUT,
    T,
    BG,
    BU,
    stride_g,
    stride_u,
    stride_t,
    off_g,
    off_u,
    rank_g,
    rank_u,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    mask = m_ok[:, None] & n_ok[None, :]
    dt = OUT.dtype.element_ty
    eg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    eg = _expand_tile(eg, T, rm, m_ok, stride_t, off_g, rank_g, BG, rn, n_ok, N, BLOCK_R, PRECISION)
    eu = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    eu = _expand_tile(eu, T, rm, m_ok, stride_t, off_u, rank_u, BU, rn, n_ok, N, BLOCK_R, PRECISION)
    g = tl.load(G + rm[:, None] * stride_g + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rm[:, None] * stride_u + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    g = (g + eg).to(dt).to(tl.float32)  # each expand added in float32 and rounded once, as addmm_
    u = (u + eu).to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + rm[:, None] * N + rn[None, :], (act * u).to(dt), mask=mask)


def silu_mul_expand(
    gate: torch.Tensor,
    up: torch.Tensor,
    lora: tuple[Expand | None, Expand | None],
    block_m: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """silu(gate + t·B_gateᵀ) * (up + t·B_upᵀ) for a large step: the gate/up group's expands on the tensor
    cores, inside the SiLU·up kernel (no extra launch, and gate/up are not written back and read again as
    after `lora_expand`); the same roundings as `lora_expand` + `silu_mul` and as
    fused_decode.silu_mul_lora, whose per-row programs re-read B for every row (fine for a decode step of
    <= 16 rows, not for a prefill). gate, up [M, N] (rows may be strided); [M, N] contiguous. `block_m`,
    `num_warps`: the tile's rows (default by M) and its warps (bench/prefill_lora_probe.py sweeps them)."""
    m, n = gate.shape
    present = [e for e in lora if e is not None]
    if (
        not present
        or any(e.t is not present[0].t for e in present)
        or gate.stride(1) != 1
        or up.stride(1) != 1
    ):
        raise ValueError("silu_mul_expand: expands of one group (one t) and outputs with contiguous columns")
    t = present[0].t
    out = torch.empty(m, n, device=gate.device, dtype=gate.dtype)
    eg, eu = lora
    # 32-row tiles: with 64 rows and 4 warps a thread held four 64-value float32 tiles (the two expands, gate,
    # up): 23.9 µs a launch at 512 rows on the H200 against 16.3 (bench/prefill_lora_probe.py)
    block_m = block_m or (16 if m <= 16 else 32)
    block_n = 128
    widest = max(e.rank for e in present)
    block_r = 16 if widest <= 16 else 32 if widest <= 32 else 64
    _silu_mul_expand_kernel[(-(-n // block_n), -(-m // block_m))](
        gate,
        up,
        out,
        t,
        eg.b_t if eg is not None else gate,
        eu.b_t if eu is not None else gate,
        gate.stride(0),
        up.stride(0),
        t.stride(0),
        eg.offset if eg is not None else 0,
        eu.offset if eu is not None else 0,
        eg.rank if eg is not None else 0,
        eu.rank if eu is not None else 0,
        m,
        n,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=DOT_PRECISION[t.dtype],
        num_warps=num_warps,
    )
    return out


@triton.jit
def _head_tile(X, stride_x, T, stride_t, off, rank, B, out_f, rm, m_ok, cols, c_ok, dt: tl.constexpr,
               BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """A [rows, half-head] tile of a projection's output with its LoRA expand added in float32 and rounded
    once to the activation dtype (as addmm_); float32 values. rank 0: no expand (nothing read from B)."""
    mask = m_ok[:, None] & c_ok[None, :]
    x = tl.load(X + rm[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    e = tl.zeros(x.shape, dtype=tl.float32)
    e = _expand_tile(e, T, rm, m_ok, stride_t, off, rank, B, cols, c_ok, out_f, BLOCK_R, PRECISION)
    return (x + e).to(dt).to(tl.float32)


@triton.jit(do_not_specialize=["M", "off_q", "off_k", "off_v", "rank_q", "rank_k", "rank_v"])
def _rope_expand_kv_kernel(
    Q,
    K,
    V,
    QO,
    KO,
    VO,
    KC,
    VC,
    SLOTS,
    COS,
    SIN,
    POS,
    T,
    BQ,
    BK,
    BV,
    stride_q,
    stride_k,
    stride_v,
    stride_t,
    off_q,
    off_k,
    off_v,
    rank_q,
    rank_k,
    rank_v,
    num_heads,
    num_kv_heads,
    M,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # programs: (row tile, head); q heads first, then the k/v heads (as fused_decode's rope_lora_kv)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m_ok = rm < M
    c_ok = offs < HALF
    mask = m_ok[:, None] & c_ok[None, :]
    dt = QO.dtype.element_ty
    head_dim = 2 * HALF
    pos = tl.load(POS + rm, mask=m_ok, other=0).to(tl.int64)
    table = pos[:, None] * head_dim + offs[None, :]
    c1 = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + table + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + table + HALF, mask=mask, other=0.0).to(tl.float32)
    if h < num_heads:
        out_f = num_heads * head_dim
        cols = h * head_dim + offs
        x1 = _head_tile(Q, stride_q, T, stride_t, off_q, rank_q, BQ, out_f, rm, m_ok, cols, c_ok, dt, BLOCK_R,
                        PRECISION)  # fmt: skip
        x2 = _head_tile(Q, stride_q, T, stride_t, off_q, rank_q, BQ, out_f, rm, m_ok, cols + HALF, c_ok, dt,
                        BLOCK_R, PRECISION)  # fmt: skip
        o1, o2 = _rope_half_pair(x1, x2, c1, c2, s1, s2, dt)
        out = QO + rm[:, None] * out_f + cols[None, :]
        tl.store(out, o1, mask=mask)
        tl.store(out + HALF, o2, mask=mask)
    else:
        out_f = num_kv_heads * head_dim
        cols = (h - num_heads) * head_dim + offs
        k1 = _head_tile(K, stride_k, T, stride_t, off_k, rank_k, BK, out_f, rm, m_ok, cols, c_ok, dt, BLOCK_R,
                        PRECISION)  # fmt: skip
        k2 = _head_tile(K, stride_k, T, stride_t, off_k, rank_k, BK, out_f, rm, m_ok, cols + HALF, c_ok, dt,
                        BLOCK_R, PRECISION)  # fmt: skip
        v1 = _head_tile(V, stride_v, T, stride_t, off_v, rank_v, BV, out_f, rm, m_ok, cols, c_ok, dt, BLOCK_R,
                        PRECISION)  # fmt: skip
        v2 = _head_tile(V, stride_v, T, stride_t, off_v, rank_v, BV, out_f, rm, m_ok, cols + HALF, c_ok, dt,
                        BLOCK_R, PRECISION)  # fmt: skip
        o1, o2 = _rope_half_pair(k1, k2, c1, c2, s1, s2, dt)
        slot = tl.load(SLOTS + rm, mask=m_ok, other=0).to(tl.int64)
        k_out = KO + rm[:, None] * out_f + cols[None, :]
        k_cached = KC + slot[:, None] * out_f + cols[None, :]
        tl.store(k_out, o1, mask=mask)
        tl.store(k_out + HALF, o2, mask=mask)
        tl.store(k_cached, o1, mask=mask)
        tl.store(k_cached + HALF, o2, mask=mask)
        v_out = VO + rm[:, None] * out_f + cols[None, :]
        v_cached = VC + slot[:, None] * out_f + cols[None, :]
        tl.store(v_out, v1.to(dt), mask=mask)
        tl.store(v_out + HALF, v2.to(dt), mask=mask)
        tl.store(v_cached, v1.to(dt), mask=mask)
        tl.store(v_cached + HALF, v2.to(dt), mask=mask)


def rope_expand_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lora: tuple[Expand | None, Expand | None, Expand | None],
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_decode.rope_lora_kv for a large step (same arguments, same roundings): the q/k/v expands on
    the tensor cores over tiles of rows, inside the RoPE + K/V-cache-write kernel, so the q/k/v group's
    expand costs no launch of its own and q/k/v are not written back and read again (rope_lora_kv's
    programs are one row each, and each re-reads its rank rows of B: fine for <= 16 rows, not a prefill).
    q [T, H·D], k, v [T, Hkv·D] (rows may be strided, columns contiguous) -> (q, k, v) as [T, heads, D]."""
    tokens = q.shape[0]
    head_dim = cos.shape[-1]
    present = [e for e in lora if e is not None]
    if not present or any(e.t is not present[0].t for e in present):
        raise ValueError("rope_expand_kv: the expands of one group (one t), at least one")
    t = present[0].t
    qo = torch.empty(tokens, num_heads, head_dim, device=q.device, dtype=q.dtype)
    ko = torch.empty(tokens, num_kv_heads, head_dim, device=q.device, dtype=q.dtype)
    vo = torch.empty_like(ko)
    eq, ek, ev = lora
    half = head_dim // 2
    block_m = 16 if tokens <= 16 else 32
    widest = max(e.rank for e in present)
    block_r = 16 if widest <= 16 else 32 if widest <= 32 else 64
    _rope_expand_kv_kernel[(-(-tokens // block_m), num_heads + num_kv_heads)](
        q,
        k,
        v,
        qo,
        ko,
        vo,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        positions,
        t,
        eq.b_t if eq is not None else q,
        ek.b_t if ek is not None else q,
        ev.b_t if ev is not None else q,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        t.stride(0),
        eq.offset if eq is not None else 0,
        ek.offset if ek is not None else 0,
        ev.offset if ev is not None else 0,
        eq.rank if eq is not None else 0,
        ek.rank if ek is not None else 0,
        ev.rank if ev is not None else 0,
        num_heads,
        num_kv_heads,
        tokens,
        HALF=half,
        BLOCK=max(16, _next_pow2(half)),  # tl.dot needs tiles at least 16 wide
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        PRECISION=DOT_PRECISION[t.dtype],
        num_warps=4,
    )
    return qo, ko, vo


@triton.jit(do_not_specialize=["M", "off", "rank"])
def _add_rms_norm_expand_kernel(
    H,
    D,
    W,
    OUT,
    RES_OUT,
    T,
    B,
    stride_t,
    off,
    rank,
    eps,
    M,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # two passes over the row tile's columns: (1) delta + its expand (rounded once), + h (rounded), stored
    # as the residual, sum of squares; (2) the residual read back (this program's own writes, after a
    # barrier) and normalized. Roundings as _add_rms_norm_kernel with an expand.
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = rm < M
    dt = RES_OUT.dtype.element_ty
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        mask = m_ok[:, None] & n_ok[None, :]
        at = rm[:, None] * N + rn[None, :]
        delta = tl.load(D + at, mask=mask, other=0.0).to(tl.float32)
        delta = _expand_tile(delta, T, rm, m_ok, stride_t, off, rank, B, rn, n_ok, N, BLOCK_R, PRECISION)
        x = tl.load(H + at, mask=mask, other=0.0).to(tl.float32) + delta.to(dt).to(tl.float32)
        x = x.to(dt)
        tl.store(RES_OUT + at, x, mask=mask)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
    tl.debug_barrier()  # pass 2 reads what other threads of this program stored in pass 1
    inv = tl.rsqrt(sumsq / N + eps)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        mask = m_ok[:, None] & n_ok[None, :]
        at = rm[:, None] * N + rn[None, :]
        xf = tl.load(RES_OUT + at, mask=mask, other=0.0).to(tl.float32)
        normed = (xf * inv[:, None]).to(dt).to(tl.float32)
        w = tl.load(W + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(OUT + at, (w[None, :] * normed).to(dt), mask=mask)


# add_rms_norm_expand runs one program per 16 rows (a row's norm needs all its columns): below ~128
# programs most of an H100's 132 SMs would idle, and a separate lora_expand launch (programs over rows and
# columns) + the per-row add_rms_norm is the better choice. A guess until measured (bench/engine.py
# --profile-prefill): a 2048-token prefill chunk has 128 row tiles, a 512-token prompt 32.
TILED_NORM_MIN_ROWS = 2048


def add_rms_norm_expand(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, lora: Expand
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(h, delta, weight, eps, lora)` for a large step: (h + delta + t·Bᵀ, its RMSNorm) with the
    expand on the tensor cores over tiles of rows, so the o/down expand costs no launch of its own and
    delta is not written back and read again (add_rms_norm's programs are one row each and read all of B:
    fine for <= 16 rows, not for a prefill). h, delta [T, N] contiguous."""
    m, n = h.shape
    if delta.shape != (m, n) or not (h.is_contiguous() and delta.is_contiguous()) or lora.b_t.shape[1] != n:
        raise ValueError(
            f"add_rms_norm_expand: h {tuple(h.shape)}, delta {tuple(delta.shape)} (contiguous) and b_t "
            f"{tuple(lora.b_t.shape)} must share their width"
        )
    res = torch.empty_like(h)
    out = torch.empty_like(h)
    block_m = 16  # the most programs tl.dot allows (see TILED_NORM_MIN_ROWS)
    _add_rms_norm_expand_kernel[(-(-m // block_m),)](
        h,
        delta,
        weight,
        out,
        res,
        lora.t,
        lora.b_t,
        lora.t.stride(0),
        lora.offset,
        lora.rank,
        eps,
        m,
        N=n,
        BLOCK_M=block_m,
        BLOCK_N=128,
        BLOCK_R=16 if lora.rank <= 16 else 32 if lora.rank <= 32 else 64,
        PRECISION=DOT_PRECISION[lora.t.dtype],
        num_warps=4,
    )
    return res, out


# A large step's LoRA shrink t = x·A_catᵀ ([M, K] x [R, K] -> [M, R], R the group's ranks summed: 16-64 for
# r16) through cuBLAS is two kernels on Hopper: a GEMM split over K (its output has too few tiles for the
# SMs) and a reduce (`cublasLt::splitKreduce_kernel`), ~5 + 1.7 µs at 512 rows on the H200, 4 a layer.
# `lora_shrink` is one launch: programs over (row tile, K split); each split's float32 partial goes to a
# workspace and the split that arrives last for its row tile sums them in split order (so the result does
# not depend on which finished first) and stores t rounded once. One int32 ticket per row tile counts the
# arrivals; the last resets it, so the tickets are zero between launches (eager or replayed).
SHRINK_BLOCK_M = 32
SHRINK_BLOCK_K = 128
SHRINK_MAX_SPLITS = 8
SHRINK_TARGET_PROGRAMS = 256  # ~2 per SM on an H100 / H200 (132 SMs)
SHRINK_MAX_RANKS = 128  # a group's ranks summed past this (r64 on q/k/v: 192): cuBLAS (llama.py)
SHRINK_MAX_ROWS = 65536  # the rows the model's tickets cover (one per SHRINK_BLOCK_M); a larger step: cuBLAS


def shrink_tickets(device: torch.device, rows: int) -> torch.Tensor:
    """The zeroed int32 tickets `lora_shrink` needs for steps of up to `rows` rows (one per row tile): made
    once per model, before any capture (graphs hold their address). Launches that share them must run in
    stream order, as one model's do (two at once on two streams would count into the same tickets)."""
    return torch.zeros(max(1, -(-rows // SHRINK_BLOCK_M)), dtype=torch.int32, device=device)


def shrink_plan(m: int, k: int, r: int) -> tuple[int, int, int, int]:
    """(splits, K per split, BLOCK_K, BLOCK_R) of `lora_shrink` for x [m, k], a_cat [r, k]: enough programs
    for the SMs (SHRINK_TARGET_PROGRAMS), at most SHRINK_MAX_SPLITS splits and one per SHRINK_BLOCK_K of K,
    each a whole number of BLOCK_K blocks; A's tile [BLOCK_K, BLOCK_R] halves its K for ranks above 64."""
    block_r = max(16, _next_pow2(r))  # tl.dot needs N >= 16
    block_k = SHRINK_BLOCK_K if block_r <= 64 else SHRINK_BLOCK_K // 2
    blocks = -(-k // block_k)
    want = max(1, -(-SHRINK_TARGET_PROGRAMS // -(-m // SHRINK_BLOCK_M)))
    per_split = -(-blocks // min(want, SHRINK_MAX_SPLITS, -(-k // SHRINK_BLOCK_K))) * block_k
    return -(-k // per_split), per_split, block_k, block_r


@triton.jit(do_not_specialize=["M"])
def _lora_shrink_kernel(
    X,
    A,
    T,
    PART,
    TICKETS,
    M,
    K,
    R,
    stride_x,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    r_ok = rr < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):  # K_PER_SPLIT: a multiple of BLOCK_K
        k_ok = (k0 + rk) < K
        x = tl.load(
            X + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(A + rr[None, :] * K + (k0 + rk)[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    out = T + rm[:, None] * R + rr[None, :]
    out_mask = m_ok[:, None] & r_ok[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(T.dtype.element_ty), mask=out_mask)
    else:
        # PART [SPLITS, row tiles, BLOCK_M, BLOCK_R] float32: this program's partial, then its arrival
        tiles = tl.num_programs(0)
        tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + rr[None, :]  # [BLOCK_M, BLOCK_R]
        tl.store(PART + (pid_k * tiles + pid_m) * (BLOCK_M * BLOCK_R) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(TICKETS + pid_m, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last of this row tile: sum the partials in split order
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(
                    PART + (s * tiles + pid_m) * (BLOCK_M * BLOCK_R) + tile, cache_modifier=".cg"
                )
            tl.store(out, total.to(T.dtype.element_ty), mask=out_mask)
            tl.store(TICKETS + pid_m, 0)  # zero for the next launch (stream order makes it visible)


def lora_shrink(x: torch.Tensor, a_cat: torch.Tensor, tickets: torch.Tensor) -> torch.Tensor:
    """t = x·a_catᵀ for a large step in one launch: x [M, K] (rows may be strided, columns contiguous), a_cat
    [R, K] contiguous (LoRAGroup.a_cat, R <= SHRINK_MAX_RANKS), tickets from `shrink_tickets` (zero, at least
    one per SHRINK_BLOCK_M rows) -> t [M, R] contiguous in x's dtype: products accumulated in float32 (the
    tensor cores for bf16/fp16, IEEE FMAs for float32), rounded once, as cuBLAS's GEMM + split-K reduce do
    (in another order of the sums)."""
    m, k = x.shape
    r = a_cat.shape[0]
    if (
        x.stride(1) != 1
        or not a_cat.is_contiguous()
        or a_cat.shape[1] != k
        or a_cat.dtype != x.dtype
        or not 1 <= r <= SHRINK_MAX_RANKS
    ):
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} stride {x.stride()} (columns contiguous) and a_cat "
            f"{tuple(a_cat.shape)} {a_cat.dtype}: a_cat contiguous, 1..{SHRINK_MAX_RANKS} rows of x's width "
            "and dtype"
        )
    tiles = -(-m // SHRINK_BLOCK_M)
    if tickets.dtype != torch.int32 or tickets.device != x.device or tickets.numel() < tiles:
        raise ValueError(
            f"lora_shrink: {m} rows need {tiles} int32 tickets on {x.device}, got {tickets.numel()} "
            f"{tickets.dtype} on {tickets.device}"
        )
    splits, k_per_split, block_k, block_r = shrink_plan(m, k, r)
    t = torch.empty(m, r, device=x.device, dtype=x.dtype)
    # the splits' float32 partials (none for one split: then t is passed in its place and not read)
    part = t
    if splits > 1:
        part = torch.empty(splits * tiles * SHRINK_BLOCK_M * block_r, device=x.device, dtype=torch.float32)
    _lora_shrink_kernel[(tiles, splits)](
        x,
        a_cat,
        t,
        part,
        tickets,
        m,
        k,
        r,
        x.stride(0),
        k_per_split,
        BLOCK_M=SHRINK_BLOCK_M,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        SPLITS=splits,
        PRECISION=DOT_PRECISION[x.dtype],
        num_warps=4,
    )
    return t
