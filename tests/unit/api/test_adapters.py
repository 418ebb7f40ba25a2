import json
import struct
from pathlib import Path

import numpy as np
import pytest

from lorafn.api import adapters
from lorafn.api.adapters import (
    AdapterProblem,
    check_adapter_config,
    pattern_matches,
    resolve_local_path,
    validate_adapter,
)
from tests.unit.operator._peft import TINY_CONFIG, write_adapter, write_backbone


@pytest.fixture
def backbone(tmp_path: Path) -> Path:
    return write_backbone(tmp_path / "tiny")


def test_valid_adapter_reports_its_shape(tmp_path: Path, backbone: Path) -> None:
    info = validate_adapter(write_adapter(tmp_path / "a", rank=8, modules=("q_proj", "down_proj")), backbone)
    assert (info.rank, info.alpha, info.dtype) == (8, 16.0, "float32")
    assert info.target_modules == ["q_proj", "down_proj"]
    assert info.num_tensors == 2 * 2 * TINY_CONFIG["num_hidden_layers"]
    assert info.layers == [0, 1]


def test_all_linear_and_regex_targets(tmp_path: Path, backbone: Path) -> None:
    all_mods = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = write_adapter(tmp_path / "all", modules=all_mods, config_overrides={"target_modules": "all-linear"})
    assert validate_adapter(a, backbone).target_modules == list(all_mods)
    r = write_adapter(
        tmp_path / "re",
        modules=("q_proj", "v_proj"),
        config_overrides={"target_modules": r".*\.(q_proj|v_proj)"},
    )
    assert validate_adapter(r, backbone).target_modules == ["q_proj", "v_proj"]


def test_bfloat16_dtype_is_read_from_the_header(tmp_path: Path, backbone: Path) -> None:
    a = write_adapter(tmp_path / "a", dtype=np.float16)
    assert validate_adapter(a, backbone).dtype == "float16"


@pytest.mark.parametrize(
    ("overrides", "reason", "words"),
    [
        ({"use_dora": True}, "UnsupportedAdapterFeature", "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "UnsupportedAdapterFeature", "modules_to_save"),
        ({"bias": "all"}, "UnsupportedAdapterFeature", "bias"),
        ({"peft_type": "IA3"}, "NotLoRA", "IA3"),
        ({"r": 0}, "InvalidRank", "positive"),
        ({"target_modules": ["embed_tokens"]}, "TargetModuleMismatch", "embed_tokens"),
        ({"target_modules": 7}, "AdapterConfigInvalid", "target_modules"),
        ({"target_modules": []}, "AdapterConfigInvalid", "target_modules"),
        ({"target_modules": r"model\.layers\.9\..*"}, "TargetModuleMismatch", "target_modules"),
        # refused by the runtime's loader before the check was shared
        ({"fan_in_fan_out": True}, "UnsupportedAdapterFeature", "fan_in_fan_out"),
        ({"lora_bias": True}, "UnsupportedAdapterFeature", "lora_bias"),
        ({"use_qalora": True}, "UnsupportedAdapterFeature", "use_qalora"),
        ({"layer_replication": [[0, 1]]}, "UnsupportedAdapterFeature", "layer_replication"),
        ({"trainable_token_indices": [1, 2]}, "UnsupportedAdapterFeature", "trainable_token_indices"),
        ({"target_parameters": ["mlp.experts"]}, "UnsupportedAdapterFeature", "target_parameters"),
        ({"alora_invocation_tokens": [5]}, "UnsupportedAdapterFeature", "alora_invocation_tokens"),
        ({"bias": "lora_only"}, "UnsupportedAdapterFeature", "bias"),
        ({"peft_type": None}, "NotLoRA", "peft_type"),
        ({"rank_pattern": {"v_proj": 0}}, "InvalidRank", "rank_pattern"),
        ({"rank_pattern": {"(v_proj": 2}}, "AdapterConfigInvalid", "rank_pattern"),
        ({"rank_pattern": ["v_proj"]}, "AdapterConfigInvalid", "rank_pattern"),
        ({"alpha_pattern": {"v_proj": "big"}}, "AdapterConfigInvalid", "alpha_pattern"),
        ({"lora_alpha": "16"}, "AdapterConfigInvalid", "lora_alpha"),
    ],
)
def test_refused_configs_name_the_field(
    tmp_path: Path, backbone: Path, overrides: dict, reason: str, words: str
) -> None:
    a = write_adapter(tmp_path / "a", config_overrides=overrides)
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(a, backbone)
    assert info.value.reason == reason
    assert words in info.value.message


def test_config_check_names_the_field_and_lists_every_refused_one() -> None:
    config = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "use_dora": True, "lora_bias": True}
    with pytest.raises(AdapterProblem) as info:
        check_adapter_config(config)
    assert info.value.field == "use_dora"
    assert info.value.message.startswith("adapter_config.json use_dora: DoRA is not supported")
    assert "lora_bias: LoRA bias is not supported" in info.value.message
    assert isinstance(info.value, ValueError)  # what the runtime's loader raises, too


def test_config_check_types_the_values() -> None:
    checked = check_adapter_config(
        {
            "peft_type": "LORA",
            "r": 4,
            "lora_alpha": 8,
            "target_modules": r".*\.(q_proj|o_proj)",
            "rank_pattern": {"o_proj": 2, "layers.1.self_attn.q_proj": 6},
            "alpha_pattern": {"q_proj": 3},
        }
    )
    assert checked.target_modules is None  # a regex needs the backbone's layers
    assert check_adapter_config(checked.raw, num_layers=2).target_modules == ["q_proj", "o_proj"]
    assert checked.rank_of("model.layers.0.self_attn.o_proj") == 2
    assert checked.rank_of("model.layers.1.self_attn.q_proj") == 6
    assert checked.rank_of("model.layers.11.self_attn.q_proj") == 4
    assert checked.alpha_of("model.layers.0.self_attn.q_proj") == 3.0
    assert checked.alpha_of("model.layers.0.self_attn.o_proj") == 8.0


@pytest.mark.parametrize(
    ("key", "module", "matches"),
    [
        ("o_proj", "model.layers.0.self_attn.o_proj", True),
        ("self_attn.o_proj", "model.layers.3.self_attn.o_proj", True),
        ("layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj", True),
        ("layers.1.mlp.down_proj", "model.layers.11.mlp.down_proj", False),
        ("proj", "model.layers.0.self_attn.o_proj", False),  # a dotted suffix, not a substring
        ("(q|v)_proj", "model.layers.0.self_attn.v_proj", True),
        (r"layers\.[01]\.self_attn\.k_proj", "model.layers.1.self_attn.k_proj", True),
    ],
)
def test_pattern_keys_follow_peft(key: str, module: str, matches: bool) -> None:
    assert pattern_matches(key, module) is matches


def _rank_2_tensors(layers: range, module: str = "v_proj") -> dict[str, np.ndarray]:
    kv = TINY_CONFIG["num_key_value_heads"] * TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    out = {}
    for layer in layers:
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        out[f"{prefix}.lora_A.weight"] = np.zeros((2, TINY_CONFIG["hidden_size"]), np.float32)
        out[f"{prefix}.lora_B.weight"] = np.zeros((kv, 2), np.float32)
    return out


def test_rank_pattern_is_accepted(tmp_path: Path, backbone: Path) -> None:
    every_layer = write_adapter(
        tmp_path / "a",
        rank=4,
        config_overrides={"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"v_proj": 1}},
        tensor_overrides=_rank_2_tensors(range(2)),
    )
    info = validate_adapter(every_layer, backbone)
    assert (info.rank, info.ranks) == (4, {"q_proj": 4, "v_proj": 2})
    one_layer = write_adapter(
        tmp_path / "b",
        rank=4,
        config_overrides={"rank_pattern": {"model.layers.1.self_attn.v_proj": 2}},
        tensor_overrides=_rank_2_tensors(range(1, 2)),
    )
    assert validate_adapter(one_layer, backbone).ranks == {"q_proj": 4, "v_proj": 4}


def test_rank_pattern_must_match_the_tensors(tmp_path: Path, backbone: Path) -> None:
    # the pattern selects layer 0 only, but both layers' v_proj have rank 2
    a = write_adapter(
        tmp_path / "a",
        rank=4,
        config_overrides={"rank_pattern": {"layers.0.self_attn.v_proj": 2}},
        tensor_overrides=_rank_2_tensors(range(2)),
    )
    with pytest.raises(AdapterProblem, match=r"layer 1 v_proj.*rank 4") as info:
        validate_adapter(a, backbone)
    # the backbone's side of the shapes fits: the refusal blames adapter_config.json, not the backbone
    assert info.value.reason == "InvalidRank" and info.value.field == "r"
    assert "adapter_config.json gives rank 4" in info.value.message and "has rank 2" in info.value.message


def test_shapes_of_another_backbone_are_refused(tmp_path: Path, backbone: Path) -> None:
    bigger = {**TINY_CONFIG, "hidden_size": 128}
    a = write_adapter(tmp_path / "a", backbone_config=bigger)
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(a, backbone)
    assert info.value.reason == "ShapeMismatch"
    assert "[4, 64]" in info.value.message


def test_rank_in_config_must_match_tensors(tmp_path: Path, backbone: Path) -> None:
    a = write_adapter(tmp_path / "a", rank=4, config_overrides={"r": 8})
    with pytest.raises(AdapterProblem, match="rank 8") as info:
        validate_adapter(a, backbone)
    assert info.value.reason == "InvalidRank"
    assert "adapter_config.json gives rank 8" in info.value.message and "backbone" not in info.value.message


def test_too_many_layers_and_foreign_tensors(tmp_path: Path, backbone: Path) -> None:
    extra = {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32)}
    with pytest.raises(AdapterProblem, match="layer 9"):
        validate_adapter(write_adapter(tmp_path / "a", tensor_overrides=extra), backbone)
    emb = {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 256), np.float32)}
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(write_adapter(tmp_path / "b", tensor_overrides=emb), backbone)
    assert info.value.reason == "UnsupportedAdapterFeature"
    assert info.value.field == "target_modules"
    dora = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.zeros(64, np.float32)
    }
    with pytest.raises(AdapterProblem, match="use_dora") as info:
        validate_adapter(write_adapter(tmp_path / "c", tensor_overrides=dora), backbone)
    assert info.value.reason == "UnsupportedAdapterFeature"


def test_missing_pieces(tmp_path: Path, backbone: Path) -> None:
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(tmp_path / "nowhere", backbone)
    assert info.value.reason == "AdapterNotFound"
    no_weights = write_adapter(tmp_path / "nw", write_weights=False)
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(no_weights, backbone)
    assert info.value.reason == "AdapterWeightsMissing"
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(write_adapter(tmp_path / "a"), tmp_path / "no-backbone")
    assert info.value.reason == "BackboneConfigNotFound"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(tmp_path / "bad", backbone)
    assert info.value.reason == "AdapterConfigInvalid"


def test_unsupported_architecture(tmp_path: Path) -> None:
    gpt2 = write_backbone(tmp_path / "gpt2", {"model_type": "gpt2", "n_embd": 64})
    with pytest.raises(AdapterProblem) as info:
        validate_adapter(write_adapter(tmp_path / "a"), gpt2)
    assert info.value.reason == "UnsupportedArchitecture"


def test_corrupt_safetensors_header(tmp_path: Path, backbone: Path) -> None:
    a = write_adapter(tmp_path / "a")
    weights = a / "adapter_model.safetensors"
    weights.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(AdapterProblem, match="header length"):
        validate_adapter(a, backbone)
    weights.write_bytes(struct.pack("<Q", 5) + b"nope!")
    with pytest.raises(AdapterProblem, match="not JSON"):
        validate_adapter(a, backbone)
    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 400]}}).encode()
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(AdapterProblem, match="bad entry"):
        validate_adapter(a, backbone)


def test_uri_resolution(tmp_path: Path) -> None:
    assert resolve_local_path("file:///adapters/x", str(tmp_path)) == Path("/adapters/x")
    (tmp_path / "claim-a").mkdir()
    assert resolve_local_path("pvc://claim-a/fr", str(tmp_path)) == tmp_path / "claim-a" / "fr"
    for uri, reason in [
        ("pvc://other/fr", adapters.REASON_CLAIM_NOT_MOUNTED),
        ("s3://bucket/fr", adapters.REASON_UNSUPPORTED_SCHEME),
        ("file://relative", adapters.REASON_INVALID_URI),
    ]:
        with pytest.raises(AdapterProblem) as info:
            resolve_local_path(uri, str(tmp_path))
        assert info.value.reason == reason, uri


def test_operator_package_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, lorafn.operator.handlers, lorafn.api.adapters; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
