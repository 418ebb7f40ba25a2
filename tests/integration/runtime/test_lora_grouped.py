"""Grouped LoRA expands (one launch per projection group, triton_ops.lora_expand) against one addmm_ per
projection: the CUDA model code run on CPU tensors with Triton's interpreter, float32, for adapters of
several shapes (all-linear r16, q/v only r8: a group with a member missing, mixed ranks through
rank_pattern, rslora, a rank above the kernel's 64-wide rank block), the unfused and the fused forward
(every `lora_expand` mode for the first adapter, and the per-step pairs "hybrid" and
"per_projection/grouped", over steps with a prefill chunk and a large step of decodes only); and a
standby's prepared buffers: copy_lora of an adapter gives its output through the grouped launches,
clear_lora the base model's; and adapter slots (a second child, `--slots`). lora_grouped_check.py does the
work in a child process (TRITON_INTERPRET must be set before triton is imported); ~5 minutes on a 2-core VM,
and a few more for the slots."""

from __future__ import annotations

import re

import pytest

from tests.integration.runtime.interpreted import ModelCheck, ModelChecks

# The interpreted check is CPU-bound (each Triton kernel run by numpy): on a loaded 2-core machine it ran past
# its old 580 s once (a CI run here, 2026-12-01, beside other tests), so it gets a bound of its own.
pytestmark = pytest.mark.timeout(1200)

ADAPTERS = {
    "r16-all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "r8-qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mixed-ranks": dict(
        r=8,
        lora_alpha=16,
        target_modules="all-linear",
        rank_pattern={"k_proj": 4, "v_proj": 2, "up_proj": 12, "o_proj": 1},
        alpha_pattern={"down_proj": 5},
    ),
    "r16-rslora": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True),
    "r80-qkv": dict(r=80, lora_alpha=40, target_modules=["q_proj", "k_proj", "v_proj"]),
}


SLOTS = ("r16-all-linear", "r8-qv", "mixed-ranks")
MODEL_CHECKS = {
    "test_grouped_expands_equal_per_projection": ModelCheck(
        "tests.integration.runtime.lora_grouped_check", ADAPTERS, seed=11, cost_s=320
    ),
    "test_adapter_slots_on_the_cuda_code": ModelCheck(
        "tests.integration.runtime.lora_grouped_check",
        {n: ADAPTERS[n] for n in SLOTS},
        ("--slots",),
        seed=11,
        cost_s=135,
    ),
}


def test_grouped_expands_equal_per_projection(model_checks: ModelChecks) -> None:
    stdout = model_checks.stdout("test_grouped_expands_equal_per_projection")
    for i, name in enumerate(ADAPTERS):  # the first adapter in every mode, each in one, fused and not
        assert stdout.count(f"{name} fused=") == (10 if i == 0 else 2), stdout
    # hybrid (fused): the two prefill-bearing large steps per projection, the 18-decode step in_kernels (its
    # q/k/v expands inside the per-row RoPE kernel, one per layer): a third of in_kernels' large-step count
    counts = {
        mode: tuple(map(int, found))
        for mode, *found in re.findall(
            r"r16-all-linear fused=True (\S+): same as per-projection torch \((\d+) grouped launches, (\d+) "
            r"in-kernel",
            stdout,
        )
    }
    assert counts["hybrid"][0] == 0 and counts["hybrid"][1] > 0, counts
    assert counts["in_kernels"] == (0, 3 * counts["hybrid"][1]), counts
    assert counts["per_projection/grouped"][0] * 3 == counts["grouped"][0], counts
    assert "o/down expands inside add + RMSNorm: same" in stdout
    # the skinny GEMM's steps, their expands in the per-row kernels and inside the GEMMs (expand_in_gemm)
    assert "r16-all-linear skinny_gemm_rows=64: as per-projection torch" in stdout
    assert "clear_lora: the base model's output" in stdout


def test_adapter_slots_on_the_cuda_code(model_checks: ModelChecks) -> None:
    """Adapter slots (r16 all-linear slots: r16, q/v r8 and mixed ranks in three, the fourth empty): the
    per-row kernels reading each row's slot and the masked settled steps, every lora_expand mode and the
    skinny GEMM (its expands in the per-row kernels, and inside the GEMMs), against the torch forward of the
    same slots."""
    stdout = model_checks.stdout("test_adapter_slots_on_the_cuda_code")
    for mode in ("hybrid", "grouped", "in_kernels"):
        assert f"adapter slots, {mode}: as the torch forward of the same slots" in stdout, stdout
    for in_gemm in (False, True):  # the skinny GEMM's steps, expands in the per-row kernels / in the GEMMs
        assert f"adapter slots, skinny_gemm_rows=64, expands in the GEMMs {in_gemm}: as the torch" in stdout
