"""triton_ops.lora_shrink (EngineConfig.lora_shrink "triton": a large step's LoRA shrink t = x·A_catᵀ in one
launch, its K splits summed by the last to arrive): interpreted on CPU against torch with one split and
several, strided rows, row counts that end mid-tile, a second launch reusing the tickets (which must be back
at zero), and bad inputs refused; and the kernel compiles for an H100 (sm_90) with the release/acquire of its
tickets at GPU scope and tensor-core products for bf16, which the interpreter (numpy) never checks."""

from __future__ import annotations

import pytest

from tests.unit.runtime.interpreted import require_triton, run_interpreted

_CHECK = """
import torch
import tests.integration.runtime.triton_bf16  # GPU-like bf16 under the interpreter
from lorafn.runtime.models import triton_ops as ops

gen = torch.Generator().manual_seed(0)
tickets = ops.shrink_tickets(torch.device("cpu"), 4096)
seen = set()
# (rows, K, ranks summed): one split (1 row, K of one block) and several (K over many blocks), rows past a
# whole tile, the qkv group of r16 (48), ranks above 64 (A's tile halved), the widest taken (128)
cases = [(1, 64, 16), (40, 200, 48), (100, 1000, 24), (513, 384, 16), (70, 2000, 96), (33, 300, 128)]
for rows, k, r in cases:
    splits, _per_split, _block_k, _block_r = ops.shrink_plan(rows, k, r)
    seen.add(splits > 1)
    for trial in range(2):  # a second launch: the first must have left its tickets at zero
        base = torch.randn(rows, k + 8, generator=gen)
        x = base[:, 8:]  # rows strided (k + 8), columns contiguous
        a = torch.randn(r, k, generator=gen)
        t = ops.lora_shrink(x, a, tickets)
        assert t.shape == (rows, r) and t.is_contiguous()
        torch.testing.assert_close(t, x @ a.T, atol=1e-3, rtol=1e-4)
        assert int(tickets.abs().sum()) == 0, (rows, k, r, tickets.nonzero())
assert seen == {False, True}, seen
# bf16: products exact, float32 sums rounded once, as cuBLAS's F.linear (in another order of the sums)
for rows, k, r in [(40, 1000, 48), (65, 300, 16)]:
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    a = (torch.randn(r, k, generator=gen) / 16).to(torch.bfloat16)
    t = ops.lora_shrink(x, a, tickets)
    want = (x.float() @ a.float().T).to(torch.bfloat16)
    assert t.dtype == torch.bfloat16
    torch.testing.assert_close(t.float(), want.float(), rtol=2**-7, atol=1e-3)  # within a bf16 step
x, a = torch.randn(8, 64), torch.randn(16, 64)
for bad in (
    (x.T.contiguous().T, a, tickets),  # columns strided
    (x, a[:, :32], tickets),  # widths differ
    (x, torch.randn(ops.SHRINK_MAX_RANKS + 1, 64), tickets),  # too many ranks
    (x, a.double(), tickets),  # dtypes differ
    (torch.randn(4096 * ops.SHRINK_BLOCK_M + 1, 64), a, tickets),  # more row tiles than tickets
    (x, a, tickets.long()),  # tickets not int32
):
    try:
        ops.lora_shrink(*bad)
    except ValueError as e:
        assert "lora_shrink" in str(e), e
    else:
        raise AssertionError("accepted a bad input")
print("ok")
"""


def test_lora_shrink_interpreted_matches_torch() -> None:
    run_interpreted(_CHECK)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp32", "ieee")])
def test_lora_shrink_kernel_compiles_for_sm90(splits: int, dtype: str, precision: str) -> None:
    require_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lorafn.runtime.models import triton_ops as ops

    fn = ops._lora_shrink_kernel
    constexprs = dict(
        BLOCK_M=ops.SHRINK_BLOCK_M, BLOCK_K=ops.SHRINK_BLOCK_K, BLOCK_R=64, SPLITS=splits, PRECISION=precision
    )
    kinds = {"X": f"*{dtype}", "A": f"*{dtype}", "T": f"*{dtype}", "PART": "*fp32", "TICKETS": "*i32"}
    signature = {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_stages": 3})
    ptx = compiled.asm["ptx"]
    assert ("mma" in ptx) == (dtype == "bf16")
    # the ticket: an add at GPU scope that releases the partials and acquires the others' (several splits)
    ordered = [line for line in ptx.splitlines() if ".gpu." in line and "atom" in line]
    assert any(".acq_rel." in line for line in ordered) == (splits > 1), ordered
