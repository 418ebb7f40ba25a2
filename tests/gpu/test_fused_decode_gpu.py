"""The fused decode kernels (models/fused_decode.py) against the cuBLAS + addmm path they replace.

- `seg_linear` equals F.linear for every segment, 1..16 rows, bf16 and fp32, every output element written;
- a whole forward (prefill chunks of at most 16 tokens and decodes) gives the same logits and the same KV
  cache fused and unfused, for the base model, an all-linear adapter and one that targets some
  projections only (absent projections: rank 0 in the fused kernels);
- greedy tokens of an fp32 engine are identical fused and unfused (the 7B fp32/bf16 checks against
  transformers + peft in test_engine_gpu.py run the fused path too: it is the default).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lorafn.runtime import Engine, EngineConfig
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.kv_cache import KVCache
from lorafn.runtime.local_weights import SafetensorsWeightSource
from lorafn.runtime.lora import load_lora, write_random_adapter
from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan
from tests.integration.runtime.engine_helpers import engine_greedy, mixed_prompts

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_seg_linear_matches_linear(dtype, tol, rows) -> None:
    from lorafn.runtime.models import fused_decode as fd

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen, dtype=dtype)
    weights = [
        torch.randn(n, 4096, device="cuda", generator=gen, dtype=dtype) / 64 for n in (48, 4096, 1024, 1024)
    ]
    outs = fd.seg_linear(x, weights)
    for w, y in zip(weights, outs, strict=True):
        assert y.shape == (rows, w.shape[0]) and torch.isfinite(y).all()
        assert _rel(y, x.float() @ w.float().t()) < tol
    # a strided input (a view of a wider buffer) and K = 11008 (down_proj)
    wide = torch.randn(rows, 11008 + 64, device="cuda", generator=gen, dtype=dtype)[:, :11008]
    w = torch.randn(4096, 11008, device="cuda", generator=gen, dtype=dtype) / 100
    (y,) = fd.seg_linear(wide, [w])
    assert _rel(y, F.linear(wide.float(), w.float())) < tol


@pytest.fixture(scope="module")
def tiny_setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    root = tmp_path_factory.mktemp("fused")
    adapters = {
        "all-linear": write_random_adapter(cfg, root / "all", rank=8, b_std=0.5, dtype=torch.float32),
        "some": write_random_adapter(
            cfg,
            root / "some",
            rank=4,
            b_std=0.5,
            dtype=torch.float32,
            target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        ),
    }
    return tiny_model_dir, cfg, adapters


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("adapter", [None, "all-linear", "some"])
def test_fused_forward_matches_unfused(tiny_setup, dtype, tol, adapter) -> None:
    model_dir, cfg, adapters = tiny_setup
    dev = torch.device("cuda")
    source = SafetensorsWeightSource(model_dir)
    lora = load_lora(adapters[adapter], cfg, dev, dtype) if adapter else None
    ref = LlamaModel(cfg, source, dev, dtype, lora, max_position=512, use_triton_attention=True)
    fused = LlamaModel(
        cfg, source, dev, dtype, lora, max_position=512, use_triton_attention=True, fused_decode=True
    )
    assert fused.fused is not None and ref.fused is None
    kv_ref, kv_fused = (KVCache(cfg, 32, 16, dev, dtype) for _ in range(2))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # two prompts of 7 and 9 tokens in one step (16 rows: the fused limit), sequences 0 and 1
    ids = torch.randint(5, cfg.vocab_size - 5, (16,), device=dev, generator=gen)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).to(dev)
    slots = torch.cat([torch.arange(7), 16 + torch.arange(9)]).to(dev)
    prefill = ForwardBatch(
        ids,
        positions,
        slots,
        0,
        None,
        None,
        [PrefillSpan(0, 7, 0), PrefillSpan(7, 9, 0)],
        torch.tensor([6, 15], device=dev),
    )
    a, b = ref.forward(prefill, kv_ref.layers), fused.forward(prefill, kv_fused.layers)
    assert _rel(b, a) < tol and _rel(kv_fused.data, kv_ref.data) < tol
    for step in range(3):  # decodes of both sequences
        dec = ForwardBatch(
            torch.randint(5, cfg.vocab_size - 5, (2,), device=dev, generator=gen),
            torch.tensor([7 + step, 9 + step], device=dev),
            torch.tensor([7 + step, 16 + 9 + step], device=dev),
            2,
            torch.tensor([[0], [1]], dtype=torch.int32, device=dev),
            torch.tensor([8 + step, 10 + step], dtype=torch.int32, device=dev),
            [],
            None,
        )
        a, b = ref.forward(dec, kv_ref.layers), fused.forward(dec, kv_fused.layers)
        assert _rel(b, a) < tol, f"decode step {step}"
    assert _rel(kv_fused.data, kv_ref.data) < tol


def test_fused_engine_tokens_equal_unfused_fp32(tiny_setup) -> None:
    model_dir, _cfg, adapters = tiny_setup
    prompts = mixed_prompts(6)
    tokens = {}
    for fused in (False, True):
        engine = Engine(
            EngineConfig(
                model=model_dir,
                adapter=adapters["all-linear"],
                device="cuda",
                dtype="float32",
                max_num_seqs=8,
                num_kv_blocks=256,
                fused_decode=fused,
            )
        )
        assert (engine.runner.model.fused is not None) == fused
        tokens[fused] = engine_greedy(engine, prompts, 24)
    assert tokens[True] == tokens[False]
