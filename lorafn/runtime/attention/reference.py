"""Torch attention over the paged KV cache: the CPU path, and the reference for the Triton kernel.

KV layout: per layer, k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; token
position p of a sequence lives at slot block_table[p // block_size] * block_size + p % block_size of
the flattened [num_blocks * block_size, num_kv_heads, head_dim] view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at slots [T] (int64) of the caches; graph-capturable (no host sync)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Causal attention of one prefill chunk.

    q [n, H, D] are the chunk's queries at positions start..start+n-1; k, v [start+n, Hkv, D] are the keys
    and values of positions 0..start+n-1 (the cached prefix followed by the chunk). Returns [n, H, D].
    """
    n, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1), v.transpose(0, 1)
    if num_kv_heads != num_heads:
        group = num_heads // num_kv_heads
        kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh[None], vh[None], is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(start, start + n, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh[None], vh[None], attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its cached context.

    q [B, H, D]; k_cache/v_cache [N, bs, Hkv, D]; block_tables [B, M] int32/int64 (entries past a
    sequence's blocks may hold anything valid); context_lens [B] (>= 1). Returns [B, H, D].
    Static shapes only (no host sync), so it can be captured in a CUDA graph.
    """
    bsz, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    idx = block_tables.long()
    k = k_cache[idx].reshape(bsz, max_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[idx].reshape(bsz, max_blocks * block_size, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    qg = q.view(bsz, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    valid = torch.arange(max_blocks * block_size, device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.float())
    return out.reshape(bsz, num_heads, head_dim).to(q.dtype)
