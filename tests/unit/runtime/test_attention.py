"""Attention over the paged KV cache: the torch reference against plain per-sequence attention, and the
Triton kernel (interpreted on CPU when TRITON_INTERPRET=1 works) against the reference."""

from __future__ import annotations

import pytest
import torch

from lorafn.runtime.attention.reference import paged_decode_attention_ref, prefill_attention, write_kv
from tests.unit.runtime.interpreted import require_triton, run_interpreted


def _dense(q, k, v, scale):
    """q [n, H, D] at the last n positions of k, v [ctx, Hkv, D]; plain causal softmax attention."""
    n, h, _ = q.shape
    ctx, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("start,n", [(0, 9), (5, 7), (16, 1), (31, 20)])
def test_prefill_attention_with_cached_prefix(start: int, n: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(n, 4, 16)
    k, v = torch.randn(start + n, 2, 16), torch.randn(start + n, 2, 16)
    torch.testing.assert_close(prefill_attention(q, k, v, start, 0.25), _dense(q, k, v, 0.25))


def _paged_case(
    seed: int = 0, batch: int = 3, heads: int = 4, kv_heads: int = 2, dim: int = 32, page: int = 4
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, max_blocks = 40, 9
    k = torch.randn(num_blocks, page, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, page, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(batch)]).int()
    lens = torch.randint(1, max_blocks * page + 1, (batch,), generator=gen).int()
    lens[0] = 1
    return q, k, v, tables, lens


def test_paged_reference_equals_gathered_dense() -> None:
    q, k, v, tables, lens = _paged_case()
    out = paged_decode_attention_ref(q, k, v, tables, lens, 0.2)
    page = k.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = [int(tables[b, p // page]) * page + p % page for p in range(n)]
        kk = k.view(-1, *k.shape[2:])[slots]
        vv = v.view(-1, *v.shape[2:])[slots]
        torch.testing.assert_close(out[b : b + 1], _dense(q[b : b + 1], kk, vv, 0.2))


def test_write_kv_puts_tokens_at_their_slots() -> None:
    kc, vc = torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(kc, vc, k, v, torch.tensor([0, 7, 19]))
    torch.testing.assert_close(kc[1, 3], k[1])
    torch.testing.assert_close(vc[4, 3], v[2])
    torch.testing.assert_close(kc.abs().sum(), k.abs().sum())  # nothing else was written


def test_sdpa_prefill_matches_reference_decode_on_last_token() -> None:
    # The prefill and decode paths agree: the last query of a prefill equals a decode at that position.
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    kc, vc = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    write_kv(kc, vc, k, v, torch.arange(6))
    dec = paged_decode_attention_ref(
        q[-1:], kc, vc, torch.tensor([[0, 1]]).int(), torch.tensor([6]).int(), 0.25
    )
    torch.testing.assert_close(dec[0], prefill_attention(q, k, v, 0, 0.25)[-1])


_TRITON_CHECK = """
import torch
from lorafn.runtime.attention.reference import paged_decode_attention_ref
from lorafn.runtime.attention.triton_decode import paged_decode_attention_triton
import tests.unit.runtime.test_attention as t
# (batch, heads, kv_heads, dim, page, target programs): 16, 16, 16, 1 and 3 splits; 16-token blocks, so
# that contexts of up to 36 tokens span several splits (with the default 64 one split held them all)
cases = [(3, 4, 2, 32, 4, 264), (2, 8, 8, 16, 16, 264), (1, 6, 2, 48, 8, 264), (5, 4, 2, 32, 4, 8),
         (3, 4, 2, 32, 4, 18)]
for seed, (batch, heads, kv_heads, dim, page, programs) in enumerate(cases):
    q, k, v, tables, lens = t._paged_case(seed, batch, heads, kv_heads, dim, page)
    lens[-1] = tables.shape[1] * page  # one sequence fills its table: every split of it has tokens
    ref = paged_decode_attention_ref(q, k, v, tables, lens, 0.2)
    for kernel in ("simt", "dot"):
        # the queries alternate so that partials left in reused memory by the call before cannot pass
        for sign in (1.0, -1.0):
            out = paged_decode_attention_triton(
                sign * q, k, v, tables, lens, 0.2, kernel=kernel, target_programs=programs, block_n=16
            )
            expected = ref if sign > 0 else paged_decode_attention_ref(-q, k, v, tables, lens, 0.2)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
out = paged_decode_attention_triton(q, k, v, tables, lens, 0.2)  # the engine's defaults
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
for bad in ({"kernel": "mma"}, {"kernel": "dot", "q": q.double()}):
    try:
        paged_decode_attention_triton(bad.pop("q", q), k, v, tables, lens, 0.2, **bad)
    except ValueError as e:
        assert "paged decode attention" in str(e), e
    else:
        raise AssertionError(f"accepted {bad}")
print("ok")
"""


def test_triton_kernel_interpreted_matches_reference() -> None:
    run_interpreted(_TRITON_CHECK, timeout=300)


def test_dot_kernel_takes_more_warps_only_on_small_grids() -> None:
    """8 warps a program where the grid has at most TARGET_PROGRAMS programs (every batch that splits its
    context); larger grids keep Triton's default, where 8 warps measured slower (triton_decode's comment)."""
    require_triton()
    from lorafn.runtime.attention import triton_decode as td

    # (batch, KV heads) -> 8 warps?: llama-2-7b (32 KV heads) up to batch 8, llama-3-8b (8) up to 32
    cases = {(1, 32): True, (8, 32): True, (16, 32): False, (1, 8): True, (32, 8): True, (64, 8): False}
    for (batch, kv_heads), small in cases.items():
        programs = batch * kv_heads * td.num_splits(batch, kv_heads)
        assert td.dot_launch_warps(programs) == ({"num_warps": 8} if small else {}), (batch, kv_heads)
    assert td.dot_launch_warps(2048) == {}  # batch 64 of llama-2-7b: 32 KV heads, one split


_ROPE_CHECK = """
import torch
import tests.integration.runtime.triton_bf16  # GPU-like bf16 under the interpreter
from lorafn.runtime.attention.triton_decode import paged_decode_attention_rope, paged_decode_attention_triton
from lorafn.runtime.models import fused_decode as fd

gen = torch.Generator().manual_seed(0)
# (batch, heads, KV heads, head dim, page, target programs): GQA and MHA, one split and several (16-token
# blocks over contexts of up to 36 tokens), a head dim that is not a power of two
cases = [(3, 4, 2, 32, 4, 264), (2, 8, 8, 16, 16, 264), (1, 6, 2, 48, 8, 264), (4, 4, 2, 32, 4, 8)]
for dtype in (torch.float32, torch.bfloat16):
    for batch, heads, kv, dim, page, programs in cases:
        num_blocks, per_seq = 40, 9
        # each sequence owns its blocks (the engine's contract): one permutation dealt out
        tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).int()
        lens = torch.randint(1, per_seq * page + 1, (batch,), generator=gen).int()
        lens[0], lens[-1] = 1, per_seq * page  # a first token; a full table (every split has tokens)
        positions = (lens - 1).long()  # each row's new token is the last of its context
        slots = (tables[torch.arange(batch), positions // page].long() * page + positions % page).contiguous()
        k_cache = torch.randn(num_blocks, page, kv, dim, generator=gen).to(dtype)
        v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        emb = torch.cat([torch.outer(torch.arange(per_seq * page).float(), inv)] * 2, dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        # q, k, v: views of one projection output, rows strided past its width
        width = (heads + 2 * kv) * dim
        out = torch.randn(batch, width + 8, generator=gen).to(dtype)
        q, k = out[:, : heads * dim], out[:, heads * dim : (heads + kv) * dim]
        v = out[:, (heads + kv) * dim : width]
        for kernel in ("simt", "dot"):
            launch = dict(kernel=kernel, target_programs=programs, block_n=16)
            kc1, vc1 = k_cache.clone(), v_cache.clone()
            qr, _kr, _vr = fd.rope_lora_kv(q, k, v, None, heads, kv, cos, sin, positions, kc1, vc1, slots)
            want = paged_decode_attention_triton(qr, kc1, vc1, tables, lens, 0.2, **launch)
            kc2, vc2 = k_cache.clone(), v_cache.clone()
            got = paged_decode_attention_rope(
                q, k, v, cos, sin, positions, slots, kc2, vc2, tables, lens, 0.2, **launch
            )
            case = (dtype, batch, heads, kv, dim, page, programs, kernel)
            assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1), case  # the same K/V stored, nothing else
            assert torch.equal(got, want), (case, (got.float() - want.float()).abs().max())
# bad inputs are refused with the argument named
q = torch.randn(2, 4 * 32)
k_cache = torch.randn(40, 4, 2, 32)
good = dict(k=torch.randn(2, 64), v=torch.randn(2, 64), cos=torch.randn(64, 32), sin=torch.randn(64, 32),
            positions=torch.zeros(2, dtype=torch.long), slot_mapping=torch.zeros(2, dtype=torch.long))
bads = [{"k": torch.randn(2, 96)}, {"cos": torch.randn(64, 16)}, {"positions": torch.zeros(3).long()}]
for bad in bads + [{"q": torch.randn(2, 4, 32)}]:
    args = {**good, **bad}
    try:
        paged_decode_attention_rope(
            bad.get("q", q), args["k"], args["v"], args["cos"], args["sin"], args["positions"],
            args["slot_mapping"], k_cache, k_cache.clone(), torch.zeros(2, 9, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 0.2,
        )
    except ValueError as e:
        assert "RoPE" in str(e), e
    else:
        raise AssertionError(f"accepted {list(bad)}")
print("ok")
"""


def test_rope_in_attention_interpreted_equals_rope_kernel_then_attention() -> None:
    """paged_decode_attention_rope (EngineConfig.rope_in_attention) against what it replaces: fused_decode's
    RoPE + K/V-write kernel, then the split attention. The same K/V in the cache and the same output, bit for
    bit, in float32 and GPU-like bf16, both kernel forms, one split and several."""
    run_interpreted(_ROPE_CHECK, timeout=600)


@pytest.mark.parametrize("use_dot", [False, True])
def test_rope_in_attention_compiles_for_sm90(use_dot: bool) -> None:
    """The split kernel with ROPE compiles for an H100 (sm_90; what the interpreter never checks): bf16 with
    tensor-core products in the dot form, and the new token's K/V stores under a scalar condition."""
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lorafn.runtime.attention import triton_decode as td

    fn = td._decode_split_kernel
    constexprs = dict(
        NUM_SPLITS=8, GROUP=1, PAD_G=16 if use_dot else 1, PAGE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
        USE_DOT=use_dot, PRECISION="tf32", ROPE=True,
    )  # fmt: skip
    pointers = {"Q", "K", "V", "KNEW", "VNEW", "COS", "SIN"}
    kinds = {"BT": "*i32", "CL": "*i32", "POS": "*i64", "SLOTS": "*i64", "scale": "fp32"}
    kinds |= {n: "*fp32" for n in ("M_OUT", "L_OUT", "ACC_OUT")} | {n: "*bf16" for n in pointers}
    signature = {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert ("mma" in ptx) == use_dot
    assert "st.global" in ptx
