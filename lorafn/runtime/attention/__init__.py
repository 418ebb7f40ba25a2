"""Attention over the paged KV cache: SDPA for prefill chunks, paged decode (Triton on GPU, else torch)."""

from lorafn.runtime.attention.reference import paged_decode_attention_ref, prefill_attention, write_kv
from lorafn.runtime.config import DEFAULT_DECODE_ATTENTION

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "prefill_attention", "write_kv"]


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    use_triton: bool,
    kernel: str = DEFAULT_DECODE_ATTENTION,
):
    """q [B, H, D] attends to its sequence's cached keys/values; returns [B, H, D]. See reference.py.
    `kernel`: the Triton kernel's form (EngineConfig.decode_attention); the torch reference ignores it."""
    if use_triton:
        from lorafn.runtime.attention.triton_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, kernel=kernel
        )
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
