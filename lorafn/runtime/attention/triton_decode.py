"""Paged decode attention in Triton (flash-decoding: the context is split across programs, then reduced).

Grid: (batch, kv_head, split). Each program takes the GROUP query heads that share one KV head, walks its
share of the context BLOCK_N tokens at a time (each token's page looked up in the block table, so BLOCK_N
need not equal the page size), and keeps an online softmax in float32. With one split it writes the
output itself. With several it writes a partial (max, sum, acc) per query head, and the splits of one
(sequence, KV head) are combined by whichever of their programs finishes last: each takes a ticket from an
int32 counter (`decode_tickets`, one per sequence × KV head) after its partials are written, and the one
that draws the last ticket reduces them and sets the counter back to 0 for the next call. That saves the
second launch (and its wait) of a reduce kernel per layer, which at batch 1 was about a third of the
attention's time on the H100 (`bench/decode_attention.py` measures both). `fused_reduce=False` keeps the
two-kernel form as the benchmark's baseline.

No host sync and shapes fixed by (batch, splits), so it is captured in CUDA graphs. The number of splits
depends only on the batch size and head counts (never on context lengths), so a graph captured for a
bucket stays valid for every context length. The ticket counters must not be shared by two launches in
flight at once: one buffer per model, whose kernels run in stream order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264  # about two waves on an H100 (132 SMs)
MAX_SPLITS = 16
# counters a call with several splits needs: batch × KV heads ≤ TARGET_PROGRAMS // 2 whenever splits ≥ 2
NUM_TICKETS = TARGET_PROGRAMS


def num_splits(batch: int, num_kv_heads: int, target_programs: int = TARGET_PROGRAMS) -> int:
    return max(1, min(MAX_SPLITS, target_programs // max(1, batch * num_kv_heads)))


def decode_tickets(device: torch.device | str, count: int = NUM_TICKETS) -> torch.Tensor:
    """The zeroed int32 counters of the fused reduce ([count]); allocate them before any graph capture
    (a model does at its start) and keep them for every call of that model."""
    return torch.zeros(count, dtype=torch.int32, device=device)


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
    Out,
    Tickets,
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
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    REDUCE: tl.constexpr,  # 0: partials only (a reduce kernel follows); 1: the last split reduces
    GROUP: tl.constexpr,
    PAD_G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
    gd_mask = gmask[:, None] & dmask[None, :]
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0).to(
        tl.float32
    )  # [G, D]

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
        ).to(tl.float32)  # [N, D]
        v = tl.load(
            V + page[:, None] * stride_vn + within[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:  # the whole context in this program (every decode has ≥ 1 token: l_i > 0)
        tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=gd_mask)
    else:
        # partial results: [B, H, NUM_SPLITS] for m, l; [B, H, NUM_SPLITS, D] for acc
        num_heads = tl.num_programs(1) * GROUP
        base = (b * num_heads + heads) * NUM_SPLITS  # [G]: this sequence's heads' split 0
        tl.store(M_OUT + base + split, m_i, mask=gmask)
        tl.store(L_OUT + base + split, l_i, mask=gmask)
        tl.store(ACC_OUT + (base + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gd_mask)
        if REDUCE:
            # every thread's partials are written before one thread releases them with its ticket (the
            # pattern of a grid-wide barrier: a CTA barrier, then a release at GPU scope)
            tl.debug_barrier()
            ticket = tl.atomic_add(Tickets + b * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:  # the others' partials are visible (acquire): combine them
                m_max = tl.full([PAD_G], float("-inf"), tl.float32)
                for s_ in range(NUM_SPLITS):
                    m_s = tl.load(M_OUT + base + s_, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                    m_max = tl.maximum(m_max, m_s)
                total = tl.zeros([PAD_G], tl.float32)
                out = tl.zeros([PAD_G, BLOCK_D], tl.float32)
                for s_ in range(NUM_SPLITS):
                    m_s = tl.load(M_OUT + base + s_, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(L_OUT + base + s_, mask=gmask, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(
                        ACC_OUT + (base + s_)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=gd_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))  # empty splits weigh 0
                    total += l_s * w
                    out += a_s * w[:, None]
                total = tl.where(gmask, total, 1.0)
                tl.store(out_ptrs, (out / total[:, None]).to(Out.dtype.element_ty), mask=gd_mask)
                tl.atomic_xchg(Tickets + b * tl.num_programs(1) + kvh, 0, sem="relaxed", scope="gpu")


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
    tickets: torch.Tensor | None = None,
    fused_reduce: bool = True,
    target_programs: int = TARGET_PROGRAMS,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: q [B, H, D] -> [B, H, D].

    tickets: `decode_tickets` counters, zero between calls ([≥ B·Hkv] int32), for the fused reduce; None
    allocates them for this call (not while a CUDA graph is being captured: the model passes its own).
    fused_reduce=False, target_programs, block_n and num_warps are for bench/decode_attention.py."""
    bsz, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode attention: the KV cache's last dimension must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged decode attention: {num_heads} query heads over {num_kv_heads} KV heads")
    q = q.contiguous()
    group = num_heads // num_kv_heads
    splits = num_splits(bsz, num_kv_heads, target_programs)
    block_d = triton.next_power_of_2(head_dim)
    pad_g = max(triton.next_power_of_2(group), 1)
    block_n = block_n or max(16, min(64, 8192 // (pad_g * block_d)))
    out = torch.empty_like(q)
    reduce_in_kernel = fused_reduce and splits > 1
    if reduce_in_kernel:
        if tickets is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError("paged decode attention: pass the model's tickets when capturing a graph")
            tickets = decode_tickets(q.device, bsz * num_kv_heads)
        if tickets.dtype != torch.int32 or tickets.numel() < bsz * num_kv_heads:
            raise ValueError(
                f"paged decode attention: tickets must be ≥ {bsz * num_kv_heads} int32 counters, got "
                f"{tickets.numel()} {tickets.dtype}"
            )
    if splits > 1:
        m = torch.empty(bsz, num_heads, splits, device=q.device, dtype=torch.float32)
        lse = torch.empty_like(m)
        acc = torch.empty(bsz, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    else:  # the kernel writes `out` itself; the partial pointers are never read
        m = lse = acc = out
    extra = {"num_warps": num_warps} if num_warps else {}
    _decode_split_kernel[(bsz, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        m,
        lse,
        acc,
        out,
        tickets if reduce_in_kernel else out,
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
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        REDUCE=int(reduce_in_kernel),
        GROUP=group,
        PAD_G=pad_g,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        **extra,
    )
    if splits > 1 and not reduce_in_kernel:
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
