"""How much GPU memory one worker of a function reserves: torch-free arithmetic the controller, the
worker and `lorafn status` share, so the account the controller keeps is the budget the worker uses.

A worker's reservation = its process overhead (CUDA context, cuBLAS workspace, graph pool; measured,
see docs/benchmarks.md "Per-worker memory") + its KV cache (the function's `spec.resources`, or the
controller's default) + its LoRA tensors (rank x (in + out) per targeted projection per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafn.api.adapters import LINEAR_MODULES, linear_shapes
from lorafn.api.specs import Resources

MiB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "F32": 4, "BF16": 2, "F16": 2}


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int:
    """K and V of one token over every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
    try:
        layers = int(model_config["num_hidden_layers"])
        heads = int(model_config["num_attention_heads"])
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.json: cannot size the KV cache ({e!r} missing or not a number)") from None
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_budget_bytes(resources: Resources, per_token: int, default_bytes: int) -> int:
    """The KV-cache budget of one worker: the spec's, in MiB or as sequences x context, else the default."""
    if resources.kv_cache_mib is not None:
        return resources.kv_cache_mib * MiB
    if resources.max_concurrent_sequences is not None and resources.max_context_tokens is not None:
        return resources.max_concurrent_sequences * resources.max_context_tokens * per_token
    return default_bytes


def parse_shape_key(shape: str) -> dict[str, int]:
    """`"q_proj:16,v_proj:8"` (an adapter shape key) -> {"q_proj": 16, "v_proj": 8}; ValueError naming the
    bad part."""
    ranks: dict[str, int] = {}
    for part in shape.split(","):
        module, sep, rank = part.partition(":")
        if not sep or module not in LINEAR_MODULES or not rank.isdigit() or int(rank) < 1:
            raise ValueError(
                f"shape: {part!r} of {shape!r} is not <projection>:<rank> (projections {LINEAR_MODULES})"
            )
        ranks[module] = int(rank)
    return ranks


def lora_bytes(ranks: Mapping[str, int], model_config: dict[str, Any], dtype: str) -> int:
    """Bytes of A and B at these ranks (projection -> rank: an adapter's `AdapterInfo.ranks`, or a shape's
    `parse_shape_key`) over every layer: what a worker's LoRA tensors or a standby's buffers take."""
    shapes = linear_shapes(model_config)
    layers = int(model_config.get("num_hidden_layers", 0))
    per_layer = sum(r * (shapes[m][0] + shapes[m][1]) for m, r in ranks.items())
    return per_layer * layers * DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class WorkerSize:
    """One worker's reservation, by part (bytes)."""

    overhead: int
    kv_cache: int
    lora: int

    @property
    def total(self) -> int:
        return self.overhead + self.kv_cache + self.lora
