"""Random-model presets: shapes match the published configs; shard planning; no weights written."""

from __future__ import annotations

import math

import pytest

from lorafn.models._outdir import AssetError
from lorafn.models.random_model import (
    DTYPES,
    PRESETS,
    config_dict,
    get_preset,
    plan_shards,
    tensor_specs,
)

# Copied from the published config.json files (meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B).
PUBLISHED = {
    "llama-2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        num_hidden_layers=32,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
    ),
}
PUBLISHED_PARAMS = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_match_published_config(name: str) -> None:
    config = config_dict(get_preset(name), "bfloat16")
    for key, value in PUBLISHED[name].items():
        assert config[key] == value, key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_act"] == "silu"
    assert config["head_dim"] == 128


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_have_the_published_parameter_count(name: str) -> None:
    total = sum(math.prod(shape) for _, shape in tensor_specs(get_preset(name)))
    assert total == PUBLISHED_PARAMS[name]


def test_llama3_tensor_shapes_use_gqa() -> None:
    shapes = dict(tensor_specs(get_preset("llama-3-8b")))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert len(shapes) == 2 + 1 + 32 * 9


def test_tiny_is_a_small_gqa_llama() -> None:
    p = PRESETS["tiny"]
    assert p.num_key_value_heads < p.num_attention_heads
    assert p.num_attention_heads % p.num_key_value_heads == 0
    params = sum(math.prod(shape) for _, shape in tensor_specs(p))
    assert params * 4 < 10 * 2**20  # a few MB in float32


def test_plan_shards_respects_the_limit_and_keeps_order() -> None:
    specs = tensor_specs(get_preset("llama-3-8b"))
    limit = 2 * 10**9
    shards = plan_shards(specs, DTYPES["bfloat16"], limit)
    assert [name for shard in shards for name, _ in shard] == [name for name, _ in specs]
    for shard in shards:
        size = sum(math.prod(shape) * 2 for _, shape in shard)
        assert size <= limit or len(shard) == 1
    assert len(shards) == 9  # 16.06 GB in ≤ 2 GB shards


def test_plan_shards_puts_an_oversized_tensor_alone() -> None:
    specs = [("a", (10,)), ("big", (100,)), ("c", (10,))]
    assert plan_shards(specs, 4, 80) == [[("a", (10,))], [("big", (100,))], [("c", (10,))]]


def test_unknown_preset_and_dtype_are_refused(tmp_path) -> None:
    from lorafn.models.random_model import write_random_model

    with pytest.raises(AssetError, match="unknown preset 'huge'"):
        write_random_model("huge", tmp_path / "m", seed=0)
    with pytest.raises(AssetError, match="unknown dtype 'int8'"):
        write_random_model("tiny", tmp_path / "m", seed=0, dtype="int8")
