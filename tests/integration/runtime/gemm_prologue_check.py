"""Run by test_gemm_prologue.py in a child with TRITON_INTERPRET=1: the model's forward with the residual add
+ RMSNorm and SiLU·up inside the skinny GEMMs (EngineConfig.gemm_prologue_rows) against the plain torch CPU
forward (float32), over lora_grouped_check's four steps (24, 22, 1 and 18 rows; skinny_gemm_rows 64, so that
every step's GEMMs are skinny ones); the segmented-GEMM launches that carry a prologue are counted, so the
check also shows which steps used it.

    python -m tests.integration.runtime.gemm_prologue_check MODEL_DIR NAME=ADAPTER_DIR ...

What must hold, for the base model and each adapter (its expands inside the GEMMs, expand_in_gemm):
gemm_prologue_rows 64 gives the torch forward's logits and KV cache (relative difference < TOL: float32
summation order) with 3 prologue launches a layer in every step (the norm before q/k/v and gate/up, SiLU·up
before down); gemm_prologue_rows 1 only in the one-row step. With the expands in the per-row kernels
(expand_in_gemm off) no step takes a prologue: those kernels add o's, down's and gate/up's expands to the
GEMMs' outputs, which a prologue would read before them. Prints one line per check and `ok` last.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import LoRAWeights
from lorafn.runtime.models import fused_decode
from tests.integration.runtime.lora_grouped_check import _forward, _same, _steps, check_base_and_adapters

PER_LAYER = 3  # prologue launches a layer: q/k/v (norm), gate/up (add + norm), down (SiLU·up)


def _run(model_dir: Path, cfg: ModelConfig, lora: LoRAWeights | None, rows: int, in_gemm: bool = True):
    """(_forward's result, the row counts of the seg_linear launches with a prologue) of the fused model
    with gemm_prologue_rows = rows."""
    real, with_prologue = fused_decode.seg_linear, []

    def counted(x, weights, expands=None, row_slots=None, flags=None, prologue=None):
        if prologue is not None:
            with_prologue.append(x.shape[0])
        return real(x, weights, expands, row_slots, flags, prologue)

    fused_decode.seg_linear = counted
    try:
        got = _forward(
            model_dir, cfg, lora, triton=True, fused=True, mode="hybrid", skinny=64, in_gemm=in_gemm,
            prologue_rows=rows,
        )  # fmt: skip
    finally:
        fused_decode.seg_linear = real
    return got, with_prologue


def _check(model_dir: Path, cfg: ModelConfig, name: str, lora: LoRAWeights | None) -> None:
    ref = _forward(model_dir, cfg, lora, triton=False, fused=False, mode="per_projection")
    rows = [s.input_ids.shape[0] for s in _steps(cfg)]
    layers = cfg.num_layers
    got, launches = _run(model_dir, cfg, lora, 64)
    _same(f"{name} gemm_prologue_rows=64", got, ref)
    want = sorted(r for r in rows for _ in range(PER_LAYER * layers))
    assert sorted(launches) == want, f"{name}: prologue launches {sorted(launches)}, want {want}"
    print(f"{name} gemm_prologue_rows=64: as the torch forward ({len(launches)} GEMMs with a prologue)")
    got, launches = _run(model_dir, cfg, lora, 1)
    _same(f"{name} gemm_prologue_rows=1", got, ref)
    assert launches == [1] * (PER_LAYER * layers), f"{name}: prologue launches {launches} at 1 row"
    print(f"{name} gemm_prologue_rows=1: as the torch forward (the one-row step alone: {len(launches)})")
    if lora is not None:
        got, launches = _run(model_dir, cfg, lora, 64, in_gemm=False)
        _same(f"{name} gemm_prologue_rows=64 in_gemm=False", got, ref)
        assert launches == [], f"{name}: expands in the per-row kernels, yet prologue launches {launches}"
        print(f"{name} gemm_prologue_rows=64, expands in the per-row kernels: as the torch forward, none")


def main(argv: list[str]) -> None:
    check_base_and_adapters(argv, _check)


if __name__ == "__main__":
    main(sys.argv[1:])
