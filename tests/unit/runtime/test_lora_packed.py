"""The packed `load_lora` (host-built, one buffer, one copy to the device) and the grouped `copy_lora` /
`clear_lora` equal the old per-tensor algorithm (tests/unit/runtime/lora_reference.py) bit for bit, on CPU,
for several adapter shapes and dtypes."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import (
    _ALIGN_BYTES,
    TARGETS,
    clear_lora,
    copy_lora,
    load_lora,
    write_random_adapter,
    zero_lora,
)
from tests.unit.runtime.lora_reference import assert_bitwise, assert_same, reference_copy, reference_load

CFG = ModelConfig.from_dict(
    dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
)


def _custom_adapter(
    out: Path,
    modules: dict[tuple[int, str], int],
    config: dict,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """An adapter with tensors for exactly `modules` ((layer, projection) -> rank) and `config` over the
    defaults; B large enough that scaling and rounding matter."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, proj), r in modules.items():
        out_f, in_f = CFG.linear_shapes[proj]
        block = "self_attn" if proj in TARGETS[:4] else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
        tensors[prefix + ".lora_A.weight"] = (torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)).to(dtype)
        tensors[prefix + ".lora_B.weight"] = (torch.randn(out_f, r, generator=gen) * 0.7).to(dtype)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    base = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": sorted({p for _, p in modules}),
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    base.update(config)
    (out / "adapter_config.json").write_text(json.dumps(base))
    return out


def _all(rank: int, projs: tuple[str, ...] = TARGETS) -> dict[tuple[int, str], int]:
    return {(layer, p): rank for layer in range(CFG.num_layers) for p in projs}


ADAPTERS = {
    "all-linear-r8": lambda d: write_random_adapter(CFG, d, rank=8, lora_alpha=16.0, b_std=0.7),
    "qv-r4-fp32-file": lambda d: write_random_adapter(
        CFG, d, rank=4, lora_alpha=3.0, target_modules=["q_proj", "v_proj"], dtype=torch.float32, b_std=0.7
    ),
    "all-linear-r16-rslora": lambda d: _custom_adapter(
        d, _all(16), {"r": 16, "lora_alpha": 7, "use_rslora": True}
    ),
    "regex-layer1-qv": lambda d: _custom_adapter(
        d,
        {(1, "q_proj"): 8, (1, "v_proj"): 8},
        {"target_modules": r"model\.layers\.1\.self_attn\.(q_proj|v_proj)"},
    ),
    "rank-alpha-pattern": lambda d: _custom_adapter(
        d,
        {**_all(8), **{(layer, "o_proj"): 2 for layer in range(3)}, (2, "gate_proj"): 5},
        {
            "target_modules": list(TARGETS),
            "rank_pattern": {"o_proj": 2, "model.layers.2.mlp.gate_proj": 5},
            "alpha_pattern": {"up_proj": 3, "k_proj": 11},
        },
    ),
    "mlp-subset-fp16-file": lambda d: _custom_adapter(
        d, _all(4, ("gate_proj", "down_proj")), {"r": 4, "lora_alpha": 12}, dtype=torch.float16
    ),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make(root / name) for name, make in ADAPTERS.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_packed_load_equals_per_tensor_load(name: str, dtype: torch.dtype, adapters: dict[str, Path]) -> None:
    new = load_lora(adapters[name], CFG, "cpu", dtype)
    ref = reference_load(adapters[name], CFG, "cpu", dtype)
    assert_same(new, ref)
    assert any(g.a_cat.abs().sum() > 0 for groups in new.layers for g in groups.values())  # not all zeros


def test_packed_tensors_are_aligned_views_of_one_buffer(adapters: dict[str, Path]) -> None:
    lora = load_lora(adapters["rank-alpha-pattern"], CFG, "cpu", torch.bfloat16)
    tensors = [
        t for groups in lora.layers for g in groups.values() for t in (g.a_cat, *(b for *_, b in g.targets))
    ]
    storage = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)  # one allocation
    assert all(t.storage_offset() * t.element_size() % _ALIGN_BYTES == 0 for t in tensors)
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # no two overlap
    # the layout the regex adapter exercises: layer 0 and 2 hold no groups at all
    regex = load_lora(adapters["regex-layer1-qv"], CFG, "cpu", torch.float32)
    assert [list(g) for g in regex.layers] == [[], ["q_proj"], []]


@pytest.mark.parametrize(
    "shape", ["q_proj:16,k_proj:16,v_proj:16,o_proj:16,gate_proj:16,up_proj:16,down_proj:16"]
)
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_grouped_copy_and_clear_equal_per_tensor_ones(
    name: str, shape: str, adapters: dict[str, Path]
) -> None:
    adapter = load_lora(adapters[name], CFG, "cpu", torch.bfloat16)
    for buffer_shape in (shape, adapter.shape_key):  # padded (wider buffers) and exact (the adapter's own)
        new = zero_lora(buffer_shape, CFG, "cpu", torch.bfloat16)
        ref = zero_lora(buffer_shape, CFG, "cpu", torch.bfloat16)
        for buffers in (new, ref):  # stale values from an earlier adapter must all be overwritten
            for groups in buffers.layers:
                for g in groups.values():
                    g.a_cat.fill_(3.0)
                    for *_, b in g.targets:
                        b.fill_(-5.0)
        addresses = [g.a_cat.data_ptr() for groups in new.layers for g in groups.values()]
        copy_lora(new, adapter)
        reference_copy(ref, adapter)
        assert_same(new, ref)
        assert [g.a_cat.data_ptr() for groups in new.layers for g in groups.values()] == addresses  # in place
        clear_lora(new)
        for groups in new.layers:
            for g in groups.values():
                for t in (g.a_cat, *(b for *_, b in g.targets)):
                    assert_bitwise(t, torch.zeros_like(t))


def test_copy_lora_refuses_an_adapter_that_does_not_fit(adapters: dict[str, Path]) -> None:
    adapter = load_lora(adapters["all-linear-r8"], CFG, "cpu", torch.float32)
    buffers = zero_lora("q_proj:16,v_proj:16", CFG, "cpu", torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        copy_lora(buffers, adapter)
