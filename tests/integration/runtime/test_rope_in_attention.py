"""The model with a decode step's RoPE and K/V cache writes inside its attention launch
(EngineConfig.rope_in_attention) against the same model without: the CUDA model code run on CPU tensors with
Triton's interpreter, float32, base model and an all-linear r16 adapter (its expands inside the skinny GEMMs,
and in the per-row kernels, where the fused launch must not run). rope_attention_check.py does the work in a
child (TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runtime.interpreted import run_model_check

pytestmark = pytest.mark.timeout(1200)  # interpreted Triton, CPU-bound (as test_lora_grouped.py)

ADAPTERS = {"r16-all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear")}


def test_rope_in_attention_equals_rope_kernel_then_attention(tiny_model_dir: Path, tmp_path: Path) -> None:
    module = "tests.integration.runtime.rope_attention_check"
    stdout = run_model_check(module, tiny_model_dir, tmp_path, ADAPTERS, [], seed=41)
    for name in ("base", *ADAPTERS):
        assert f"{name} rope_in_attention: the same logits and KV cache, bit for bit" in stdout, stdout
    assert "r16-all-linear rope_in_attention, expands in the per-row kernels: the RoPE kernel" in stdout
