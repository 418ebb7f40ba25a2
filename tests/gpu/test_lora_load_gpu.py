"""The packed `load_lora` on CUDA (host-built tensors, one pinned buffer, one copy to the device) equals, bit
for bit, the same load on CPU moved to the device and the old per-tensor device algorithm
(tests/unit/runtime/lora_reference.py); the grouped `copy_lora` / `clear_lora` equal the old ones on the
device. Llama-2-7b shapes (32 layers, 4096 / 11008), rank 16 all-linear and a rank-8 q/v adapter, bf16 and
fp16 and fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import (
    _ALIGN_BYTES,
    clear_lora,
    copy_lora,
    load_lora,
    write_random_adapter,
    zero_lora,
)
from tests.unit.runtime.lora_reference import assert_bitwise, assert_same, reference_copy, reference_load

pytestmark = pytest.mark.gpu

CFG = ModelConfig.from_dict(
    dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
)
ALL_LINEAR_16 = "q_proj:16,k_proj:16,v_proj:16,o_proj:16,gate_proj:16,up_proj:16,down_proj:16"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r16-all-linear": write_random_adapter(CFG, root / "a", rank=16, lora_alpha=32.0, b_std=0.5),
        "r8-qv-fp32-file": write_random_adapter(
            CFG, root / "b", rank=8, lora_alpha=3.0, target_modules=["q_proj", "v_proj"], dtype=torch.float32
        ),
    }


def _to(lora, device: str):
    for groups in lora.layers:
        for g in groups.values():
            g.a_cat = g.a_cat.to(device)
            g.targets = [(p, off, r, b.to(device)) for p, off, r, b in g.targets]
    return lora


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["r16-all-linear", "r8-qv-fp32-file"])
def test_cuda_load_equals_cpu_load_and_old_algorithm(name: str, dtype: torch.dtype, adapters) -> None:
    new = load_lora(adapters[name], CFG, "cuda", dtype)
    assert_same(new, _to(load_lora(adapters[name], CFG, "cpu", dtype), "cuda"))
    assert_same(new, reference_load(adapters[name], CFG, "cuda", dtype))
    for groups in new.layers:  # views of one allocation, each aligned as an allocation of its own
        for g in groups.values():
            for t in (g.a_cat, *(b for *_, b in g.targets)):
                assert t.data_ptr() % _ALIGN_BYTES == 0


@pytest.mark.parametrize("name", ["r16-all-linear", "r8-qv-fp32-file"])
def test_cuda_copy_and_clear_equal_old_ones(name: str, adapters) -> None:
    adapter = load_lora(adapters[name], CFG, "cuda", torch.bfloat16)
    new = zero_lora(ALL_LINEAR_16, CFG, "cuda", torch.bfloat16)
    ref = zero_lora(ALL_LINEAR_16, CFG, "cuda", torch.bfloat16)
    for buffers in (new, ref):
        clear_lora(buffers)
        for groups in buffers.layers:
            for g in groups.values():
                g.a_cat.fill_(3.0)
    copy_lora(new, adapter)
    reference_copy(ref, adapter)
    torch.cuda.synchronize()
    assert_same(new, ref)
    clear_lora(new)
    for groups in new.layers:
        for g in groups.values():
            for t in (g.a_cat, *(b for *_, b in g.targets)):
                assert_bitwise(t, torch.zeros_like(t))
