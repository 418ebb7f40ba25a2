"""The model with a decode step's RoPE and K/V cache writes inside its attention launch
(EngineConfig.rope_in_attention) against the same model without: the CUDA model code run on CPU tensors with
Triton's interpreter, float32, base model and an all-linear r16 adapter (its expands inside the skinny GEMMs,
and in the per-row kernels, where the fused launch must not run). rope_attention_check.py does the work in a
child (TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import pytest

from tests.integration.runtime.interpreted import ModelCheck, ModelChecks

pytestmark = pytest.mark.timeout(1200)  # interpreted Triton, CPU-bound (as test_lora_grouped.py)

ADAPTERS = {"r16-all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear")}


MODEL_CHECKS = {
    "test_rope_in_attention_equals_rope_kernel_then_attention": ModelCheck(
        "tests.integration.runtime.rope_attention_check", ADAPTERS, seed=41, cost_s=47
    ),
}


def test_rope_in_attention_equals_rope_kernel_then_attention(model_checks: ModelChecks) -> None:
    stdout = model_checks.stdout("test_rope_in_attention_equals_rope_kernel_then_attention")
    for name in ("base", *ADAPTERS):
        assert f"{name} rope_in_attention: the same logits and KV cache, bit for bit" in stdout, stdout
    assert "r16-all-linear rope_in_attention, expands in the per-row kernels: the RoPE kernel" in stdout
