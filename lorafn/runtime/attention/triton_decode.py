"""Paged decode attention in Triton (flash-decoding: the context is split across programs, then reduced).

Grid of the main kernel: (batch, kv_head, split). Each program takes the GROUP query heads that share
one KV head, walks its share of the context BLOCK_N tokens at a time (each token's page looked up in
the block table, so BLOCK_N need not equal the page size), and keeps an online softmax in float32.
It writes a partial (max, sum, acc) per query head; the reduce kernel (grid: batch, head) combines
the splits. No host sync and shapes fixed by (batch, splits), so it is captured in CUDA graphs.

The number of splits depends only on the batch size and head counts (never on context lengths), so a
graph captured for a bucket stays valid for every context length.

Two forms of the split kernel (EngineConfig.decode_attention): "simt" builds [G, N, D] float32 products
and reduces them across threads every block; "dot" (the default) pads the GROUP query heads to 16 rows and
runs two tl.dot per block on tensor cores, which Triton's pipeliner overlaps with the next block's loads.
Measured on an H200 (bench/decode_attention.py, docs/benchmarks.md): simt read the KV cache at only
0.8-1.6 TB/s on llama-2-7b shapes (0.15-0.6 on llama-3-8b's GQA), the device copies at ~4.2; dot took
0.18-0.83x its time everywhere, up to 95% of the copy bandwidth (batch 64, 512 tokens: 133.6 vs 311.5 µs a
layer). A reduce fused into the split kernel (the last split combines) gained at most 2% (18% lost on GQA
at batch 1), so it was not kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafn.runtime.config import DECODE_ATTENTION_KERNELS as KERNELS
from lorafn.runtime.config import DEFAULT_DECODE_ATTENTION

TARGET_PROGRAMS = 264  # about two waves on an H100 (132 SMs)
MAX_SPLITS = 16
DOT_ROWS = 16  # tl.dot's smallest M: the dot kernel pads a KV head's query heads to this many rows
# Warps a program of the dot kernel when the grid is small (at most target_programs programs: batch x KV
# heads x splits, i.e. every batch that splits its context, and batch 8 of llama-2-7b), else Triton's 4.
# H200, bench/decode_attention.py --variants "dot 4 warps,dot", µs a layer 4 -> 8 warps: llama-2-7b batch 1
# 8.1 -> 7.6 (512 tokens), 17.8 -> 16.3 (2048); batch 8 27.7 -> 27.2, 91.7 -> 86.8; llama-3-8b batch 1
# 7.1 -> 6.8, 10.1 -> 9.8; batch 16 17.1 -> 16.7, 49.2 -> 47.1. On large grids 8 warps lose (batch 64, 512
# tokens: 133.5 -> 150.1 and 39.3 -> 50.1 µs), so they keep 4.
SMALL_GRID_DOT_WARPS = 8
# tl.dot's precision per cache dtype: float32 engines (the exactness tests) get IEEE float32, not tf32
DOT_PRECISION = {torch.bfloat16: "tf32", torch.float16: "tf32", torch.float32: "ieee"}


def num_splits(
    batch: int, num_kv_heads: int, target_programs: int = TARGET_PROGRAMS, max_splits: int = MAX_SPLITS
) -> int:
    return max(1, min(max_splits, target_programs // max(1, batch * num_kv_heads)))


def dot_launch_warps(programs: int, target_programs: int = TARGET_PROGRAMS) -> dict[str, int]:
    """The dot kernel's launch option for a grid of `programs` split programs: SMALL_GRID_DOT_WARPS on a
    small grid, nothing (Triton's 4 warps) on a larger one."""
    return {"num_warps": SMALL_GRID_DOT_WARPS} if programs <= target_programs else {}


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BT,
    CL,
    M_OUT,
    L_OUT,
    ACC_OUT,
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_btb,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAD_G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr = False,  # kernel "dot": PAD_G ≥ DOT_ROWS query rows a tl.dot
    PRECISION: tl.constexpr = "ieee",  # the dots' (DOT_PRECISION)
):
    """Per BLOCK_N tokens: scores s = q·kᵀ [G, N] and acc += p·v [G, D], in float32 elementwise products
    and sums ("simt"), or as two tl.dot ("dot"; p rounded to the cache's dtype for the second, as flash
    attention does; float32 caches: IEEE dots, nothing rounded)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, ctx)

    offs_g = tl.arange(0, PAD_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < GROUP
    dmask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [G, D]
    if not USE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([PAD_G], float("-inf"), tl.float32)
    l_i = tl.zeros([PAD_G], tl.float32)
    acc = tl.zeros([PAD_G, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + offs_n
        nmask = pos < end
        page = tl.load(BT + b * stride_btb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        within = (pos % PAGE).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(
            K + page[:, None] * stride_kn + within[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [N, D]
        v = tl.load(
            V + page[:, None] * stride_vn + within[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N] float32
        else:
            k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # partial results: [B, H, NUM_SPLITS] for m, l; [B, H, NUM_SPLITS, D] for acc
    num_heads = tl.num_programs(1) * GROUP
    row = (b * num_heads + heads) * NUM_SPLITS + split
    tl.store(M_OUT + row, m_i, mask=gmask)
    tl.store(L_OUT + row, l_i, mask=gmask)
    tl.store(ACC_OUT + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(
    M_IN,
    L_IN,
    ACC_IN,
    Out,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    PAD_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, PAD_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(M_IN + row, mask=smask, other=float("-inf"))
    l_ = tl.load(L_IN + row, mask=smask, other=0.0)
    acc = tl.load(
        ACC_IN + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=smask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # empty splits weigh nothing
    total = tl.sum(l_ * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kernel: str = DEFAULT_DECODE_ATTENTION,
    target_programs: int = TARGET_PROGRAMS,
    max_splits: int = MAX_SPLITS,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: q [B, H, D] -> [B, H, D].

    `kernel`: "simt" or "dot" (EngineConfig.decode_attention); the other keywords are those of
    bench/decode_attention.py (module doc): the split heuristic's `target_programs` / `max_splits`, the
    tokens a block (`block_n`), and Triton's launch options for the split kernel (the dot kernel's warps:
    SMALL_GRID_DOT_WARPS on a small grid unless given)."""
    if kernel not in KERNELS:
        raise ValueError(f"paged decode attention: kernel {kernel!r}, not one of {KERNELS}")
    bsz, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode attention: the KV cache's last dimension must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged decode attention: {num_heads} query heads over {num_kv_heads} KV heads")
    q = q.contiguous()
    group = num_heads // num_kv_heads
    splits = num_splits(bsz, num_kv_heads, target_programs, max_splits)
    m = torch.empty(bsz, num_heads, splits, device=q.device, dtype=torch.float32)
    lse = torch.empty_like(m)
    acc = torch.empty(bsz, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(head_dim)
    pad_g = max(triton.next_power_of_2(group), 1)
    # Triton's launch options where given, and the dot kernel's constexprs
    options = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
    if kernel == "dot":
        if k_cache.dtype not in DOT_PRECISION or q.dtype != k_cache.dtype:
            raise ValueError(f"paged decode attention: kernel 'dot' takes {list(DOT_PRECISION)} q and cache")
        pad_g = max(pad_g, DOT_ROWS)
        options.update(USE_DOT=True, PRECISION=DOT_PRECISION[k_cache.dtype])
        block_n = block_n or 64
        if num_warps is None:
            options.update(dot_launch_warps(bsz * num_kv_heads * splits, target_programs))
    else:
        block_n = block_n or max(16, min(64, 8192 // (pad_g * block_d)))
    _decode_split_kernel[(bsz, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        m,
        lse,
        acc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        NUM_SPLITS=splits,
        GROUP=group,
        PAD_G=pad_g,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        **options,
    )
    out = torch.empty_like(q)
    _decode_reduce_kernel[(bsz, num_heads)](
        m,
        lse,
        acc,
        out,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        PAD_S=triton.next_power_of_2(splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
    )
    return out
