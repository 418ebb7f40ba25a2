"""The model with its GEMM inputs computed inside the skinny GEMMs (EngineConfig.gemm_prologue_rows: the
residual add + RMSNorm before q/k/v and gate/up, SiLU·up before down) against the plain torch forward: the
CUDA model code run on CPU tensors with Triton's interpreter, float32, base model and two adapter shapes
(all-linear r16, q/v only r8: groups without an adapter beside ones with). gemm_prologue_check.py does the
work in a child (TRITON_INTERPRET must be set before triton is imported); ~3-5 minutes on a 2-core VM."""

from __future__ import annotations

import pytest

from tests.integration.runtime.interpreted import ModelCheck, ModelChecks

pytestmark = pytest.mark.timeout(1200)  # interpreted Triton, CPU-bound (as test_lora_grouped.py)

ADAPTERS = {
    "r16-all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "r8-qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}


MODEL_CHECKS = {
    "test_gemm_prologue_equals_torch": ModelCheck(
        "tests.integration.runtime.gemm_prologue_check", ADAPTERS, seed=31, cost_s=105
    ),
}


def test_gemm_prologue_equals_torch(model_checks: ModelChecks) -> None:
    stdout = model_checks.stdout("test_gemm_prologue_equals_torch")
    for name in ("base", *ADAPTERS):
        assert f"{name} gemm_prologue_rows=64: as the torch forward" in stdout, stdout
        assert f"{name} gemm_prologue_rows=1: as the torch forward (the one-row step alone" in stdout
    for name in ADAPTERS:
        line = f"{name} gemm_prologue_rows=64, expands in the per-row kernels: as the torch forward, none"
        assert line in stdout, stdout
