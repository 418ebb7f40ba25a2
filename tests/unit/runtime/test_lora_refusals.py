"""Adapter validation: each unsupported adapter is refused at load time, a ValueError naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import load_lora, write_random_adapter

CFG = ModelConfig.from_dict(
    dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
)
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(tmp_path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    out = write_random_adapter(
        CFG, tmp_path / "a", rank=4, target_modules=["q_proj", "v_proj"], dtype=torch.float32
    )
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        from safetensors.torch import load_file

        current = load_file(str(out / "adapter_model.safetensors"))
        current.update(tensors)
        for k in [k for k, v in tensors.items() if v is None]:
            current.pop(k)
        save_file({k: v for k, v in current.items() if v is not None}, str(out / "adapter_model.safetensors"))
    return out


def _load(path: Path):
    return load_lora(path, CFG, "cpu", torch.float32)


def test_valid_adapter_loads(tmp_path: Path) -> None:
    lora = _load(_adapter(tmp_path))
    assert lora.target_modules == ("q_proj", "v_proj")
    assert lora.ranks == {"q_proj": 4, "v_proj": 4}
    group = lora.layers[0]["q_proj"]
    assert group.a_cat.shape == (8, 32)  # q and v share one shrink GEMM
    assert [t[0] for t in group.targets] == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "config,field",
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"peft_type": "ADALORA"}, "peft_type"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"target_modules": ["lm_head"]}, "target_modules"),
        ({"target_modules": ["c_attn"]}, "target_modules"),
        ({"target_modules": []}, "target_modules"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"lora_bias": True}, "lora_bias"),
        ({"layer_replication": [[0, 1]]}, "layer_replication"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"use_qalora": True}, "use_qalora"),
        ({"target_parameters": ["mlp.experts"]}, "target_parameters"),
        ({"alora_invocation_tokens": [5]}, "alora_invocation_tokens"),
        ({"peft_type": None}, "peft_type"),
        ({"target_modules": r"model\.layers\.9\..*"}, "target_modules"),  # the base has 2 layers
        ({"r": 8}, "r"),  # the tensors have rank 4
        ({"r": 0}, "r"),
        ({"rank_pattern": {"v_proj": 2}}, "rank_pattern"),  # the tensors have rank 4
        ({"rank_pattern": {"v_proj": 0}}, "rank_pattern"),
        ({"alpha_pattern": {"v_proj": "big"}}, "alpha_pattern"),
    ],
)
def test_refused_configs(tmp_path: Path, config: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _load(_adapter(tmp_path, config=config))


@pytest.mark.parametrize(
    "tensors,field,detail",
    [
        (
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 64)},
            "target_modules",
            "embedding",
        ),
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, "target_modules", "lm_head"),
        ({PREFIX + ".lora_magnitude_vector": torch.zeros(32)}, "use_dora", "DoRA"),
        ({PREFIX + ".lora_B.bias": torch.zeros(32)}, "bias", "bias"),
        ({PREFIX + ".lora_A.weight": torch.zeros(4, 31)}, "shape", r"lora_A \(4, 31\)"),
        ({PREFIX + ".lora_B.weight": torch.zeros(33, 4)}, "shape", r"\[32, 32\]"),
        ({PREFIX + ".lora_B.weight": torch.zeros(32, 3)}, "r", "share one rank"),
        ({PREFIX + ".lora_B.weight": None}, "adapter_model.safetensors", "lora_B.weight is missing"),
        (
            {
                "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
                "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
            },
            "adapter_model.safetensors",
            "layer 5",
        ),
    ],
)
def test_refused_tensors(tmp_path: Path, tensors: dict, field: str, detail: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        _load(_adapter(tmp_path, tensors=tensors))
    assert re.search(detail, str(err.value)), str(err.value)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        _load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        _load(tmp_path / "empty")
    out = _adapter(tmp_path)
    (out / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors"):
        _load(out)


def test_scale_folded_into_private_b(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = _adapter(tmp_path, config={"lora_alpha": 12, "use_rslora": True})
    raw = load_file(str(out / "adapter_model.safetensors"))
    lora = _load(out)
    _, _, rank, b_t = lora.layers[0]["q_proj"].targets[0]  # kept transposed, [r, out]
    torch.testing.assert_close(b_t, raw[PREFIX + ".lora_B.weight"].t() * (12 / rank**0.5))
