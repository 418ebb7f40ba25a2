"""Unmerged LoRA: load and validate a PEFT adapter, keep A and B privately, apply y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ.

The backbone W is never touched. At load time the scale s (lora_alpha / r, or lora_alpha / sqrt(r)
with rslora) is folded into this worker's private copy of B, so the forward pays two small GEMMs per
target and nothing else: a shrink x·Aᵀ (shared by the projections that read the same input: q/k/v
and gate/up, whose A matrices are concatenated — a private copy, so that is free) and an expand
`addmm(y, t, Bᵀ)` that adds into the base output in the GEMM's epilogue.

Anything this math cannot express exactly is refused at load time with a ValueError naming the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorafn.runtime.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input and so share one shrink GEMM.
SHRINK_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)
_REFUSED_FLAGS = {
    # field: (value that is fine, why the others are refused)
    "use_dora": (False, "DoRA is not supported (only plain LoRA)"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D layout) is not supported by the Llama family"),
    "lora_bias": (False, "LoRA bias is not supported"),
    "use_qalora": (False, "QALoRA is not supported"),
}


@dataclass
class LoRAGroup:
    """One shrink GEMM and its expands, for one layer: t = x·A_catᵀ; y_p += t[:, off_p:off_p+r_p]·B_pᵀ."""

    a_cat: torch.Tensor  # [sum of ranks, in_features]
    targets: list[tuple[str, int, int, torch.Tensor]]  # (projection, offset, rank, B scaled [out, r])


@dataclass
class LoRAWeights:
    """A loaded adapter: per layer, per shrink group (keyed by the group's first projection)."""

    layers: list[dict[str, LoRAGroup]] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)  # projection -> rank (max over layers)
    target_modules: tuple[str, ...] = ()

    @property
    def shape_key(self) -> str:
        """The adapter shape (DESIGN §2): what CUDA graph archives of this adapter depend on."""
        return ",".join(f"{m}:{self.ranks[m]}" for m in self.target_modules)


def _refuse(field_name: str, detail: str) -> ValueError:
    return ValueError(f"adapter: {field_name}: {detail}")


def _matches(pattern_key: str, module_name: str) -> bool:
    # PEFT's rule for rank_pattern / alpha_pattern keys: a suffix match on the module path.
    return re.match(rf"(.*\.)?{pattern_key}$", module_name) is not None


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """adapter_config.json, checked field by field; raises ValueError naming the first bad field."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise _refuse("path", f"{adapter_dir} is not a directory")
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise _refuse("adapter_config.json", f"missing in {adapter_dir}")
    cfg = json.loads(cfg_path.read_text())
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse("peft_type", f"{peft_type!r} is not supported; only LORA")
    for name, (fine, why) in _REFUSED_FLAGS.items():
        if bool(cfg.get(name, fine)) != fine:
            raise _refuse(name, why)
    if cfg.get("bias", "none") != "none":
        raise _refuse("bias", f"{cfg['bias']!r} is not supported; only 'none'")
    if cfg.get("modules_to_save"):
        raise _refuse(
            "modules_to_save", f"{cfg['modules_to_save']} would replace backbone modules; not supported"
        )
    for name in (
        "trainable_token_indices",
        "layer_replication",
        "target_parameters",
        "alora_invocation_tokens",
    ):
        if cfg.get(name):
            raise _refuse(name, f"{cfg[name]!r} is not supported")
    targets = cfg.get("target_modules")
    if not targets:
        raise _refuse("target_modules", "missing or empty")
    if isinstance(targets, str) and targets not in ("all-linear",):
        # A regex string: resolve against the projections we know.
        targets = [t for t in TARGETS if re.fullmatch(targets, t) or re.search(rf"\.{t}$", targets)]
        if not targets:
            raise _refuse("target_modules", f"{cfg['target_modules']!r} matches no Llama projection")
    if isinstance(targets, list):
        for t in targets:
            short = t.rsplit(".", 1)[-1]
            if short in ("embed_tokens", "lm_head", "wte", "embed", "word_embeddings"):
                raise _refuse("target_modules", f"{t!r}: embedding/lm_head LoRA is not supported")
            if short not in TARGETS:
                raise _refuse("target_modules", f"{t!r} is not a Llama projection {TARGETS}")
    if not isinstance(cfg.get("r", 8), int) or cfg.get("r", 8) < 1:
        raise _refuse("r", f"must be a positive integer, got {cfg.get('r')!r}")
    return cfg


def load_lora(
    adapter_dir: str | Path, model_cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> LoRAWeights:
    """Load, validate and lay out an adapter for the forward (private tensors on `device`)."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    weights_path = adapter_dir / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise _refuse("adapter_model.safetensors", f"missing in {adapter_dir}")
    raw = load_file(str(weights_path))
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern: dict[str, int] = cfg.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
    shapes = model_cfg.linear_shapes

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                raise _refuse("target_modules", f"tensor {key}: embedding/lm_head LoRA is not supported")
            if "lora_magnitude_vector" in key:
                raise _refuse("use_dora", f"tensor {key}: DoRA is not supported")
            if key.endswith(".bias"):
                raise _refuse("bias", f"tensor {key}: LoRA bias is not supported")
            raise _refuse("adapter_model.safetensors", f"unexpected tensor {key}")
        layer, _, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if proj not in TARGETS:
            raise _refuse("target_modules", f"tensor {key}: {proj!r} is not a Llama projection")
        if layer >= model_cfg.num_layers:
            raise _refuse(
                "adapter_model.safetensors",
                f"tensor {key}: layer {layer} >= the base's {model_cfg.num_layers}",
            )
        pairs.setdefault((layer, proj), {})[ab] = tensor
    if not pairs:
        raise _refuse("adapter_model.safetensors", "holds no LoRA tensors")

    out = LoRAWeights(layers=[{} for _ in range(model_cfg.num_layers)])
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(model_cfg.num_layers)]
    for (layer, proj), ab in sorted(pairs.items()):
        prefix = (
            f"base_model.model.model.layers.{layer}.{'self_attn' if proj in TARGETS[:4] else 'mlp'}.{proj}"
        )
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _refuse("adapter_model.safetensors", f"{prefix}.lora_{missing}.weight is missing")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(
                "r", f"{prefix}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not share one rank"
            )
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise _refuse(
                "shape",
                f"{prefix}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"weight [{out_f}, {in_f}] (lora_A must be [r, {in_f}], lora_B [{out_f}, r])",
            )
        rank = a.shape[0]
        module_name = prefix.removeprefix("base_model.model.")
        expected_r = next(
            (v for k, v in rank_pattern.items() if _matches(k, module_name)), cfg.get("r", rank)
        )
        if expected_r != rank:
            raise _refuse("r", f"{prefix}: tensors have rank {rank}, adapter_config says {expected_r}")
        mod_alpha = float(next((v for k, v in alpha_pattern.items() if _matches(k, module_name)), alpha))
        scale = mod_alpha / math.sqrt(rank) if rslora else mod_alpha / rank
        b_scaled = (b.to(torch.float32) * scale).to(device=device, dtype=dtype)
        per_layer[layer][proj] = (a.to(device=device, dtype=dtype), b_scaled)
        out.ranks[proj] = max(out.ranks.get(proj, 0), rank)

    for layer, mods in enumerate(per_layer):
        for group in SHRINK_GROUPS:
            present = [p for p in group if p in mods]
            if not present:
                continue
            a_cat = torch.cat([mods[p][0] for p in present], dim=0).contiguous()
            targets, off = [], 0
            for p in present:
                r = mods[p][0].shape[0]
                targets.append((p, off, r, mods[p][1].contiguous()))
                off += r
            out.layers[layer][group[0]] = LoRAGroup(a_cat=a_cat, targets=targets)
    out.target_modules = tuple(t for t in TARGETS if t in out.ranks)
    return out


def write_random_adapter(
    model_cfg: ModelConfig,
    out: str | Path,
    *,
    rank: int = 16,
    lora_alpha: float = 32.0,
    target_modules: list[str] | str = "all-linear",
    seed: int = 0,
    b_std: float = 0.01,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A PEFT-format LoRA adapter with random A and random non-zero B for `model_cfg` (benchmarks, GPU tests).

    PeftModel.from_pretrained loads it as it loads one written by save_pretrained.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    targets = list(TARGETS) if target_modules == "all-linear" else list(target_modules)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model_cfg.num_layers):
        for proj in targets:
            out_f, in_f = model_cfg.linear_shapes[proj]
            block = "self_attn" if proj in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[prefix + ".lora_A.weight"] = (
                torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
            ).to(dtype)
            tensors[prefix + ".lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * b_std).to(dtype)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": lora_alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
