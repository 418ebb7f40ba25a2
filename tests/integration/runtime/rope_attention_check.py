"""Run by test_rope_in_attention.py in a child with TRITON_INTERPRET=1: the model's forward with a decode
step's RoPE and K/V cache writes inside its attention launch (EngineConfig.rope_in_attention;
triton_decode.paged_decode_attention_rope) against the same model without (fused_decode's RoPE kernel, then
the split attention), float32, over steps that keep the engine's contract: two sequences in blocks of their
own, prefilled together, then decoded together twice and one of them once more.

    python -m tests.integration.runtime.rope_attention_check MODEL_DIR NAME=ADAPTER_DIR ...

What must hold, for the base model and each adapter: logits and KV cache equal bit for bit with
rope_in_attention on and off (skinny_gemm_rows 64, the expands inside the GEMMs: nothing is left to add to
q/k/v), with one fused launch a layer in each decode-only step and none in the prefill; with the expands in
the per-row kernels (expand_in_gemm off) the q/k/v expands still need the RoPE kernel: no fused launch, the
same logits. Prints one line per check and `ok` last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lorafn.runtime.attention import triton_decode
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import LoRAWeights
from lorafn.runtime.models.llama import ForwardBatch, PrefillSpan
from tests.integration.runtime.lora_grouped_check import _forward, check_base_and_adapters

DECODE_STEPS = 3


def _steps(cfg: ModelConfig) -> list[ForwardBatch]:
    """Sequence 0 (20 tokens, blocks 0-1) and sequence 1 (13 tokens, block 3) prefilled in one step; both
    decoded in each of the next two steps; sequence 1 once more alone."""
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(5, cfg.vocab_size - 5, (n,), generator=gen)

    def decodes(positions: list[int], slots: list[int], tables: list[list[int]]) -> ForwardBatch:
        lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        table = torch.tensor(tables, dtype=torch.int32)
        return ForwardBatch(
            ids(len(positions)),
            torch.tensor(positions),
            torch.tensor(slots),
            len(positions),
            table,
            lens,
            [],
            None,
        )

    prefill = ForwardBatch(
        ids(33),
        torch.cat([torch.arange(20), torch.arange(13)]),
        torch.cat([torch.arange(20), 48 + torch.arange(13)]),
        0,
        None,
        None,
        [PrefillSpan(0, 20, 0), PrefillSpan(20, 13, 0)],
        None,
    )
    return [
        prefill,
        decodes([20, 13], [20, 61], [[0, 1], [3, 7]]),
        decodes([21, 14], [21, 62], [[0, 1], [3, 7]]),
        decodes([15], [63], [[3, 7]]),
    ]


def _run(model_dir: Path, cfg: ModelConfig, lora: LoRAWeights | None, on: bool, in_gemm: bool = True):
    """(_forward's result, the row counts of the fused RoPE + attention launches)."""
    real, fused_rows = triton_decode.paged_decode_attention_rope, []

    def counted(q, *rest, **kw):
        fused_rows.append(q.shape[0])
        return real(q, *rest, **kw)

    triton_decode.paged_decode_attention_rope = counted
    try:
        got = _forward(
            model_dir, cfg, lora, triton=True, fused=True, mode="hybrid", skinny=64, in_gemm=in_gemm,
            rope_in_attention=on, steps=_steps(cfg),
        )  # fmt: skip
    finally:
        triton_decode.paged_decode_attention_rope = real
    return got, fused_rows


def _equal(name: str, got, want) -> None:
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"{name}: step {i} logits differ by {(a - b).abs().max():.3g}"
    assert torch.equal(got[1], want[1]), f"{name}: KV cache differs by {(got[1] - want[1]).abs().max():.3g}"


def _check(model_dir: Path, cfg: ModelConfig, name: str, lora: LoRAWeights | None) -> None:
    layers = cfg.num_layers
    off, rows = _run(model_dir, cfg, lora, on=False)
    assert rows == [], rows
    on, rows = _run(model_dir, cfg, lora, on=True)
    _equal(f"{name} rope_in_attention", on, off)
    assert rows == [2] * layers + [2] * layers + [1] * layers, rows
    print(f"{name} rope_in_attention: the same logits and KV cache, bit for bit ({len(rows)} fused launches)")
    if lora is not None:
        off, _ = _run(model_dir, cfg, lora, on=False, in_gemm=False)
        on, rows = _run(model_dir, cfg, lora, on=True, in_gemm=False)
        assert rows == [], f"{name}: expands in the per-row kernels, yet fused launches {rows}"
        _equal(f"{name} rope_in_attention in_gemm=False", on, off)
        print(f"{name} rope_in_attention, expands in the per-row kernels: the RoPE kernel, the same logits")
    assert len(off[0]) == 1 + DECODE_STEPS


def main(argv: list[str]) -> None:
    check_base_and_adapters(argv, _check)


if __name__ == "__main__":
    main(sys.argv[1:])
