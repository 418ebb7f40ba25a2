"""lorafn.runtime.triton_rounding interpreted on CPU: rope_sum rounds each product and the sum to the
activation dtype as the torch ops do (the GPU form, inline `mul.rn.f32`, is tested by
tests/gpu/test_engine_gpu.py::test_rope_kernels_round_as_the_torch_ops); and the interpreter switch follows
TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.unit.runtime.interpreted import ROOT, require_triton, run_interpreted

ROPE_SUM_CHECK = """
import torch, triton, triton.language as tl
import tests.integration.runtime.triton_bf16  # bf16 casts round to nearest even, as on the GPU
from lorafn.runtime.triton_rounding import INTERPRETED, rope_sum
assert INTERPRETED.value is True

@triton.jit
def kernel(X, C, Y, S, O, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i).to(tl.float32)
    c = tl.load(C + i).to(tl.float32)
    y = tl.load(Y + i).to(tl.float32)
    s = tl.load(S + i).to(tl.float32)
    tl.store(O + i, rope_sum(x, c, y, s, O.dtype.element_ty))

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    x, c, y, s = (torch.randn(4096, generator=gen).mul(4).to(dtype) for _ in range(4))
    out = torch.empty_like(x)
    kernel[(1,)](x, c, y, s, out, N=4096)
    want = x * c + y * s  # each product rounded to dtype, then the sum
    assert torch.equal(out, want), (dtype, int((out != want).sum()))
    # the single-rounding form (one fma) that rope_sum must not compute differs on these inputs
    assert not torch.equal(out, (x.float() * c.float() + y.float() * s.float()).to(dtype)), dtype
print("ok")
"""


def test_rope_sum_rounds_each_product_and_the_sum() -> None:
    run_interpreted(ROPE_SUM_CHECK)


def test_compiled_form_when_triton_is_not_interpreted() -> None:
    require_triton()
    env_free = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "from lorafn.runtime import triton_rounding as r; print(r.INTERPRETED.value)"],
        env=env_free,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
