"""GPU, fp32: an engine with adapter slots (EngineConfig.adapter_slots) on the CUDA path (fused decode
kernels, decode and prefill CUDA graphs with the slot input) gives every row the greedy tokens of
transformers + peft with its own adapter, in batches that mix the slots (above and below the 16 rows where
the per-row expand kernels stop)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.integration.runtime.engine_helpers import (
    hf_greedy,
    mixed_prompts,
    write_hf_model,
    write_peft_adapter,
)

pytestmark = pytest.mark.gpu
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("slots")
    model = write_hf_model(root / "m", tiny_model_dir, "llama")
    adapters = {
        "a": write_peft_adapter(model, root / "a", r=8, lora_alpha=16, target_modules="all-linear", seed=1),
        "b": write_peft_adapter(model, root / "b", r=8, lora_alpha=8, target_modules="all-linear", seed=2),
        "kv": write_peft_adapter(
            model, root / "kv", r=4, lora_alpha=12, target_modules=["k_proj", "v_proj"], seed=3
        ),
    }
    prompts = mixed_prompts()
    refs = {None: hf_greedy(model, None, prompts, MAX_NEW, device="cuda", dtype=torch.float32)}
    for name, path in adapters.items():
        refs[name] = hf_greedy(model, path, prompts, MAX_NEW, device="cuda", dtype=torch.float32)
        assert refs[name] != refs[None], name
    gc.collect()
    torch.cuda.empty_cache()
    return model, adapters, prompts, refs


def _engine(model: Path, adapters, prefill_graph_tokens: tuple = ()) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            adapters=(adapters["a"], adapters["b"], adapters["kv"]),
            adapter_slots=4,
            device="cuda",
            dtype="float32",
            max_num_seqs=32,
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            prefill_graph_tokens=prefill_graph_tokens,
        )
    )


@pytest.mark.parametrize("num_prompts", [3, 6])  # 12 rows (per-row expand kernels), 24 rows (above 16)
def test_slots_on_cuda_match_peft_per_row(setup, num_prompts: int) -> None:
    model, adapters, prompts, refs = setup
    names = ["a", "b", "kv", None]
    engine = _engine(model, adapters)
    jobs = [(p, s) for p in range(num_prompts) for s in range(4)]
    outs = engine.generate([prompts[p] for p, _ in jobs], GREEDY, adapter_slots=[s for _, s in jobs])
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # decode steps replayed graphs
    for (p, s), out in zip(jobs, outs, strict=True):
        assert out.token_ids == refs[names[s]][p], (p, names[s])


def test_prefill_graphs_take_the_prompts_slot(setup) -> None:
    """Each prompt alone: its first chunk replays a prefill graph with the slot input filled."""
    model, adapters, prompts, refs = setup
    engine = _engine(model, adapters, prefill_graph_tokens=(8, 64))
    names = ["a", "b", "kv", None]
    for s in range(4):
        for p, prompt in enumerate(prompts):
            out = engine.generate([prompt], GREEDY, adapter_slots=[s])[0]
            assert out.token_ids == refs[names[s]][p], (p, names[s])
    assert engine.runner.prefill_graphs.replays >= 4 * sum(1 < len(p) <= 64 for p in prompts)
