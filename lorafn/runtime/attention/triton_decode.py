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

`paged_decode_attention_rope` (EngineConfig.rope_in_attention) runs the same split kernel on a decode step's
raw q/k/v projection rows: each program rotates its query heads and its KV head's new k itself, takes the new
k and v from registers for the token's position, and the program whose share of the context holds that
position stores them in the cache; the RoPE + K/V-write kernel before attention is then not launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafn.runtime.config import DECODE_ATTENTION_KERNELS as KERNELS
from lorafn.runtime.config import DEFAULT_DECODE_ATTENTION
from lorafn.runtime.triton_rounding import rope_sum

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
def _rotated(x, x_other, c, sn, sign, dt: tl.constexpr):
    """RoPE of head rows x [G, D] (float32) given rotate_half's source columns x_other and the position's
    cos / sin [D]: each product and the sum rounded to dt, as fused_decode._rope_half_pair does (the same
    rope_sum)."""
    return rope_sum(x, c[None, :], sign[None, :] * x_other, sn[None, :], dt)


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
    KNEW,
    VNEW,
    COS,
    SIN,
    POS,
    SLOTS,
    stride_knb,
    stride_vnb,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAD_G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr = False,  # kernel "dot": PAD_G ≥ DOT_ROWS query rows a tl.dot
    PRECISION: tl.constexpr = "ieee",  # the dots' (DOT_PRECISION)
    ROPE: tl.constexpr = False,  # paged_decode_attention_rope: Q, KNEW, VNEW are the projections' raw rows
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
    if ROPE:
        # this row's new token at position new_pos: q and its KV head's new k rotated (as fused_decode's
        # _rope_half_pair rounds them), v as it is; the program whose share of the context holds it stores k
        # and v at the row's slot, and every program reads them from registers, never from the cache
        dt = K.dtype.element_ty
        new_pos = tl.load(POS + b).to(tl.int64)
        half = HEAD_DIM // 2
        low = offs_d < half
        partner = tl.where(low, offs_d + half, offs_d - half)  # rotate_half's source column
        sign = tl.where(low, -1.0, 1.0)
        c = tl.load(COS + new_pos * HEAD_DIM + offs_d, mask=dmask, other=0.0).to(tl.float32)
        sn = tl.load(SIN + new_pos * HEAD_DIM + offs_d, mask=dmask, other=0.0).to(tl.float32)
        q_other = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + partner[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )
        q = _rotated(q.to(tl.float32), q_other.to(tl.float32), c, sn, sign, dt)
        k_row = KNEW + b * stride_knb + kvh * HEAD_DIM
        k_new = tl.load(k_row + offs_d, mask=dmask, other=0.0).to(tl.float32)
        k_other = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
        k_new = _rotated(k_new[None, :], k_other[None, :], c, sn, sign, dt)  # [1, D]
        v_new = tl.load(VNEW + b * stride_vnb + kvh * HEAD_DIM + offs_d, mask=dmask, other=0.0)[None, :]
        if (new_pos >= begin) & (new_pos < end):
            slot = tl.load(SLOTS + b).to(tl.int64)
            at = (slot // PAGE) * stride_kn + (slot % PAGE) * stride_kt + kvh * stride_kh
            tl.store(K + at + offs_d[None, :], k_new, mask=dmask[None, :])
            at = (slot // PAGE) * stride_vn + (slot % PAGE) * stride_vt + kvh * stride_vh
            tl.store(V + at + offs_d[None, :], v_new.to(dt), mask=dmask[None, :])
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
        if ROPE:  # the new token's k and v from registers (its cache slot may be stored just now)
            new = (pos == new_pos)[:, None]
            k = tl.where(new, k_new, k)
            v = tl.where(new, v_new, v)
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
    if q.dim() != 3:
        raise ValueError(f"paged decode attention: q [B, H, D], got {tuple(q.shape)}")
    q = q.contiguous()
    bsz, num_heads, head_dim = q.shape
    launch = dict(target_programs=target_programs, max_splits=max_splits, block_n=block_n)
    launch.update(num_warps=num_warps, num_stages=num_stages)
    return _split_attention(
        q, q.stride(0), q.stride(1), bsz, num_heads, head_dim, k_cache, v_cache, block_tables,
        context_lens, scale, kernel, None, **launch,
    )  # fmt: skip


def paged_decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kernel: str = DEFAULT_DECODE_ATTENTION,
    **launch: int | None,
) -> torch.Tensor:
    """A decode step's RoPE, K/V cache writes and attention in one split launch (+ the reduce), for
    EngineConfig.rope_in_attention: what fused_decode.rope_lora_kv without expands and then
    paged_decode_attention_triton compute, with the same roundings (the scores' float32 sums aside).

    q [B, H·D], k, v [B, Hkv·D]: the q/k/v projections' outputs for one new token a row (rows may be
    strided: views of one GEMM output); cos, sin [max_position, D]; positions, slot_mapping [B] (each row's
    new token: its position, which must be context_lens - 1, and its cache slot); caches [blocks, page, Hkv,
    D]. Stores every row's rotated k and its v at its slot; returns [B, H, D]. No row's slot may lie in
    another row's context (each sequence owns its blocks; the decode graphs' padding rows share the scratch
    slot, which no real row reads): a row reads its own new token from registers, the others' from the
    cache, whenever their programs have stored them. `launch`: paged_decode_attention_triton's keywords
    after `kernel`."""
    bsz = q.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if (
        q.dim() != 2
        or q.shape[1] % head_dim
        or k.shape != (bsz, num_kv_heads * head_dim)
        or v.shape != k.shape
        or any(t.stride(-1) != 1 for t in (q, k, v))
    ):
        raise ValueError(
            f"paged decode attention with RoPE: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            f"(rows of whole heads of {head_dim}, {num_kv_heads} KV heads, columns contiguous)"
        )
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"paged decode attention with RoPE: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if positions.shape != (bsz,) or slot_mapping.shape != (bsz,):
        raise ValueError(
            f"paged decode attention with RoPE: positions {tuple(positions.shape)}, slot_mapping "
            f"{tuple(slot_mapping.shape)} (one new token a row: {bsz})"
        )
    rope = (k, v, cos.contiguous(), sin.contiguous(), positions, slot_mapping, k.stride(0), v.stride(0))
    return _split_attention(
        q, q.stride(0), head_dim, bsz, q.shape[1] // head_dim, head_dim, k_cache, v_cache, block_tables,
        context_lens, scale, kernel, rope, **launch,
    )  # fmt: skip


def _split_attention(
    q: torch.Tensor,
    stride_qb: int,
    stride_qh: int,
    bsz: int,
    num_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kernel: str,
    rope: tuple | None,
    target_programs: int = TARGET_PROGRAMS,
    max_splits: int = MAX_SPLITS,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """The split and reduce launches of both entry points; `rope`: (k, v, cos, sin, positions, slots, k's
    and v's row strides) of paged_decode_attention_rope, or None (q already rotated, k and v cached)."""
    if kernel not in KERNELS:
        raise ValueError(f"paged decode attention: kernel {kernel!r}, not one of {KERNELS}")
    _, page, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode attention: the KV cache's last dimension must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged decode attention: {num_heads} query heads over {num_kv_heads} KV heads")
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
    if rope is not None:
        options["ROPE"] = True
    else:  # unused pointers (the kernel's ROPE branch is compiled out)
        rope = (q, q, q, q, q, q, 0, 0)
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
        stride_qb,
        stride_qh,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        *rope,
        NUM_SPLITS=splits,
        GROUP=group,
        PAD_G=pad_g,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        **options,
    )
    out = torch.empty(bsz, num_heads, head_dim, device=q.device, dtype=q.dtype)
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
