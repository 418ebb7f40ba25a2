"""Worker sizing: KV bytes per token, the budget from spec.resources, LoRA bytes, the shape key."""

from __future__ import annotations

import pytest

from lorafn.api import LoRAFunctionSpec, Resources
from lorafn.api.adapters import AdapterInfo
from lorafn.api.sizing import MiB, kv_budget_bytes, kv_bytes_per_token, lora_bytes

LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}


def test_kv_bytes_per_token_of_published_shapes() -> None:
    assert kv_bytes_per_token(LLAMA2_7B, "bfloat16") == 512 * 1024  # 2 x 32 x 32 x 128 x 2
    gqa = {**LLAMA2_7B, "num_key_value_heads": 8}
    assert kv_bytes_per_token(gqa, "float32") == 2 * 32 * 8 * 128 * 4
    with pytest.raises(ValueError, match="cannot size the KV cache"):
        kv_bytes_per_token({"hidden_size": 8}, "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        kv_bytes_per_token(LLAMA2_7B, "int3")


def test_budget_from_the_spec_or_the_default() -> None:
    per_token = 1000
    assert kv_budget_bytes(Resources(), per_token, 7) == 7
    assert kv_budget_bytes(Resources(kv_cache_mib=3), per_token, 7) == 3 * MiB
    both = Resources(max_concurrent_sequences=4, max_context_tokens=512)
    assert kv_budget_bytes(both, per_token, 7) == 4 * 512 * 1000


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"kvCacheMiB": 64, "maxConcurrentSequences": 2, "maxContextTokens": 64}, "not both"),
        ({"maxConcurrentSequences": 2}, "go together"),
        ({"kvCacheMiB": 0}, "kvCacheMiB"),
        ({"gpuMiB": 5}, "gpuMiB"),
    ],
)
def test_resources_refusals(resources: dict, message: str) -> None:
    body = {"backbone": "b", "adapter": {"uri": "file:///a"}, "resources": resources}
    with pytest.raises(ValueError, match=message):
        LoRAFunctionSpec.model_validate(body)


def test_lora_bytes_and_shape_key() -> None:
    info = AdapterInfo(
        path="/a", rank=16, alpha=32, target_modules=["q_proj", "v_proj"], dtype="BF16", num_tensors=128,
        ranks={"v_proj": 16, "q_proj": 8},
    )  # fmt: skip
    assert info.shape_key == "q_proj:8,v_proj:16"  # projection order, not insertion order
    per_layer = 8 * (4096 + 4096) + 16 * (4096 + 4096)
    assert lora_bytes(info.ranks, LLAMA2_7B, "bfloat16") == per_layer * 32 * 2
