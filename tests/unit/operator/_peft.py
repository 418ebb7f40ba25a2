"""Real PEFT-layout directories for the operator tests: a Llama config.json and LoRA safetensors.

Written with safetensors + numpy (no torch), with the key names and shapes PEFT writes:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `lora_B.weight` [out, r].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
}

_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_backbone(path: Path, config: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    return path


def _dims(config: dict[str, Any], module: str) -> tuple[int, int]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv, inter = config.get("num_key_value_heads", heads), config["intermediate_size"]
    head_dim = hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def write_adapter(
    path: Path,
    *,
    rank: int = 4,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    backbone_config: dict[str, Any] | None = None,
    config_overrides: dict[str, Any] | None = None,
    dtype: Any = np.float32,
    tensor_overrides: dict[str, np.ndarray] | None = None,
    write_weights: bool = True,
) -> Path:
    cfg = backbone_config or TINY_CONFIG
    path.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": "tiny",
        **(config_overrides or {}),
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    if write_weights:
        rng = np.random.default_rng(0)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in modules:
                in_f, out_f = _dims(cfg, module)
                prefix = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, in_f)).astype(dtype)
                tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_f, rank), dtype=dtype)
        tensors.update(tensor_overrides or {})
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
