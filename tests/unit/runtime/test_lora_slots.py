"""Adapter-slot buffers (lora.zero_lora(num_slots=K)): layout, one slot's copy and clear, the row masks."""

from __future__ import annotations

import pytest
import torch

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import (
    LoRAGroup,
    LoRAWeights,
    clear_lora_slot,
    copy_lora,
    copy_lora_slot,
    slot_masks,
    zero_lora,
)

CFG = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 32,
    }
)
SHAPE = "q_proj:2,v_proj:2,up_proj:3"


def _adapter(seed: int, shape: str = SHAPE) -> LoRAWeights:
    """An adapter of `shape` with random values (the one-slot layout, as load_lora makes it)."""
    out = zero_lora(shape, CFG, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for t in out.tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    return out


def test_layout_is_projection_major_slot_minor() -> None:
    slots = zero_lora(SHAPE, CFG, "cpu", torch.float32, num_slots=3)
    assert slots.num_slots == 3 and slots.shape_key == "q_proj:2,v_proj:2,up_proj:3"
    qkv = slots.layers[0]["q_proj"]
    assert qkv.a_cat.shape == (3 * 4, 8)
    assert [(p, off, r) for p, off, r, _ in qkv.targets] == [("q_proj", 0, 6), ("v_proj", 6, 6)]
    assert slots.col_slots["q_proj"].tolist() == [0, 0, 1, 1, 2, 2] * 2
    assert slots.col_slots["gate_proj"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # up_proj alone in its group
    with pytest.raises(ValueError, match="num_slots: 0"):
        zero_lora(SHAPE, CFG, "cpu", torch.float32, num_slots=0)


def test_copy_fills_one_slot_and_clear_empties_it() -> None:
    slots = zero_lora(SHAPE, CFG, "cpu", torch.float32, num_slots=3)
    a, b = _adapter(1), _adapter(2, "q_proj:1")  # b: a lower rank, one projection (padded with zeros)
    copy_lora_slot(slots, a, 1)
    copy_lora_slot(slots, b, 2)
    g: LoRAGroup = slots.layers[1]["q_proj"]
    ga, gb = a.layers[1]["q_proj"], b.layers[1]["q_proj"]
    assert torch.equal(g.a_cat[2:4], ga.a_cat[0:2]) and torch.equal(g.a_cat[8:10], ga.a_cat[2:4])  # q, v of 1
    assert torch.equal(g.targets[0][3][2:4], ga.targets[0][3])
    assert torch.equal(g.a_cat[4:5], gb.a_cat[0:1]) and not g.a_cat[5].any() and not g.a_cat[10:12].any()
    assert not g.a_cat[0:2].any() and not g.targets[1][3][0:2].any()  # slot 0 untouched: zeros
    clear_lora_slot(slots, 1)
    assert not g.a_cat[2:4].any() and not g.targets[0][3][2:4].any() and g.a_cat[4].any()
    with pytest.raises(ValueError, match="adapter slot: 3 is not one of the buffers' 3 slots"):
        copy_lora_slot(slots, a, 3)
    with pytest.raises(ValueError, match="does not fit"):
        copy_lora_slot(slots, _adapter(3, "q_proj:4"), 0)
    with pytest.raises(ValueError, match="copy_lora_slot"):
        copy_lora(slots, a)


def test_masked_slots_equal_each_adapter_alone() -> None:
    """x·A_allᵀ masked per row, then ·B_allᵀ: row i gets exactly its own slot's adapter output."""
    slots = zero_lora(SHAPE, CFG, "cpu", torch.float64, num_slots=3)
    adapters = [_adapter(10 + s) for s in range(3)]
    for s, a in enumerate(adapters):
        copy_lora_slot(slots, a, s)  # float32 values into float64 buffers: exact
    x = torch.randn(5, 8, dtype=torch.float64)
    row_slots = torch.tensor([2, 0, 1, 1, 2])
    mask = slot_masks(slots, row_slots, torch.float64)["q_proj"]
    g = slots.layers[0]["q_proj"]
    t = (x @ g.a_cat.T) * mask
    for p_index, (_p, off, rank, b_t) in enumerate(g.targets):
        got = t[:, off : off + rank] @ b_t
        for i, s in enumerate(row_slots.tolist()):
            ga = adapters[s].layers[0]["q_proj"]
            _, a_off, a_rank, a_b = ga.targets[p_index]
            want = (x[i] @ ga.a_cat[a_off : a_off + a_rank].double().T) @ a_b.double()
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
