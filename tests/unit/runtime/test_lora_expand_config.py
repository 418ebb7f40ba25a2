"""EngineConfig.lora_expand: the three modes, the "hybrid" alias and "PREFILL/DECODE" pairs are accepted and
name (prefill-step mode, decode-step mode); anything else is refused naming the field. The model picks a
step's mode by its kind: a step with a prefill chunk (mixed ones too) the prefill mode, decodes only the
decode mode (what every decode CUDA graph is captured from)."""

from __future__ import annotations

import pytest
import torch

from lorafn.runtime.config import (
    DEFAULT_LORA_EXPAND,
    LORA_EXPANDS,
    EngineConfig,
    ModelConfig,
    expand_modes,
)
from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan


def test_lora_expand_modes() -> None:
    assert EngineConfig(model="m").lora_expand == DEFAULT_LORA_EXPAND  # the default, a valid name
    expand_modes(DEFAULT_LORA_EXPAND)
    for mode in LORA_EXPANDS:
        assert EngineConfig(model="m", lora_expand=mode).lora_expand == mode
        assert expand_modes(mode) == (mode, mode)
    assert expand_modes("hybrid") == ("per_projection", "in_kernels")
    assert expand_modes("per_projection/grouped") == ("per_projection", "grouped")
    assert EngineConfig(model="m", lora_expand="grouped/in_kernels").lora_expand == "grouped/in_kernels"
    for bad in ("fused", "per_projection/", "/grouped", "hybrid/grouped", "grouped/in_kernels/x", ""):
        with pytest.raises(ValueError, match=f"lora_expand: '{bad}'"):
            EngineConfig(model="m", lora_expand=bad)


class _NoWeights:
    """A WeightSource of zeros: the step classification needs a model, not its values."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.shapes = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (8,),
        }
        for i in range(cfg.num_layers):
            for name in ("input_layernorm", "post_attention_layernorm"):
                self.shapes[f"model.layers.{i}.{name}.weight"] = (8,)
            for proj, shape in cfg.linear_shapes.items():
                part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                self.shapes[f"model.layers.{i}.{part}.{proj}.weight"] = shape

    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.shapes[name], dtype=dtype)


def test_step_kind_picks_the_mode() -> None:
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "vocab_size": 32,
        }
    )
    model = LlamaModel(cfg, _NoWeights(cfg), torch.device("cpu"), torch.float32, lora_expand="hybrid")

    def step(num_decodes: int, prefills: list[PrefillSpan]) -> ForwardBatch:
        rows = num_decodes + sum(p.num_tokens for p in prefills)
        ids = torch.zeros(rows, dtype=torch.int64)
        return ForwardBatch(ids, ids, ids, num_decodes, None, None, prefills, None)

    assert model.expand_mode(step(0, [PrefillSpan(0, 512, 0)])) == "per_projection"  # a prompt (TTFT)
    assert (
        model.expand_mode(step(40, [PrefillSpan(40, 100, 0)])) == "per_projection"
    )  # mixed: chunk + decodes
    assert model.expand_mode(step(64, [])) == "in_kernels"  # decodes only: a decode graph's batch
    assert model.expand_mode(step(3, [])) == "in_kernels"  # (<= 16 rows: the fused decode path either way)
    with pytest.raises(ValueError, match="lora_expand: 'nope'"):
        LlamaModel(cfg, _NoWeights(cfg), torch.device("cpu"), torch.float32, lora_expand="nope")
