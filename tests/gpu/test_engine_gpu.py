"""GPU engine tests (bf16): Triton paged decode vs the torch reference, CUDA graphs on/off, KV-init reuse, and
the llama-2-7b random preset + a rank-16 all-linear adapter against transformers + peft.

The 7B model is written once per run (about 13.5 GB); point LORAFN_LLAMA2_7B_DIR at an existing copy
(`lorafn model random --preset llama-2-7b --dtype bfloat16 --out DIR --seed 0`) to skip that.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import write_random_adapter
from tests.integration.runtime.engine_helpers import engine_greedy, hf_greedy, mixed_prompts

pytestmark = pytest.mark.gpu


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,page",
    [(1, 32, 32, 128, 16), (7, 32, 8, 128, 16), (64, 32, 32, 128, 16), (3, 4, 2, 64, 8), (2, 14, 2, 64, 32)],
)
def test_triton_decode_matches_reference(batch, heads, kv_heads, head_dim, page) -> None:
    from lorafn.runtime.attention.reference import paged_decode_attention_ref
    from lorafn.runtime.attention.triton_decode import paged_decode_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, max_blocks = 600, 64
    k = torch.randn(num_blocks, page, kv_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    tables = torch.stack(
        [torch.randperm(num_blocks, device="cuda", generator=gen)[:max_blocks] for _ in range(batch)]
    ).int()
    lens = torch.randint(1, max_blocks * page + 1, (batch,), device="cuda", generator=gen).int()
    lens[0] = 1
    ref = paged_decode_attention_ref(q, k, v, tables, lens, head_dim**-0.5)
    out = paged_decode_attention_triton(q, k, v, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def tiny_gpu_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_adapter(
        ModelConfig.from_dir(tiny_model_dir),
        tmp_path_factory.mktemp("a") / "a",
        rank=8,
        b_std=0.5,
        dtype=torch.float32,
    )


def test_tiny_graphs_on_off_and_kv_init_reuse(
    tiny_model_dir: Path, tiny_gpu_adapter: Path, tmp_path: Path
) -> None:
    prompts = mixed_prompts(seed=5, lengths=(3, 17, 40, 9, 1, 26, 5, 60, 12), vocab=1000)
    outs = {}
    for graphs in (False, True):
        engine = Engine(
            EngineConfig(
                model=tiny_model_dir,
                adapter=tiny_gpu_adapter,
                device="cuda",
                dtype="bfloat16",
                use_cuda_graphs=graphs,
                cache_dir=tmp_path,
                max_num_seqs=16,
            )
        )
        assert engine.runner.kv_blocks_from == ("saved" if graphs else "profiled")
        outs[graphs] = engine_greedy(engine, prompts, 24)
        del engine
        _free()
    assert outs[True] == outs[False]
    again = Engine(
        EngineConfig(
            model=tiny_model_dir,
            adapter=tiny_gpu_adapter,
            device="cuda",
            dtype="bfloat16",
            use_cuda_graphs=False,
            cache_dir=tmp_path,
            max_num_seqs=16,
        )
    )
    assert again.runner.kv_blocks_from == "saved"  # no profiling forward on the second start


@pytest.fixture(scope="module")
def adapter7b(llama7b_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_adapter(
        ModelConfig.from_dir(llama7b_dir),
        tmp_path_factory.mktemp("a7") / "a",
        rank=16,
        lora_alpha=32,
        target_modules="all-linear",
        dtype=torch.bfloat16,
    )


@pytest.fixture(scope="module")
def prompts7b() -> list[list[int]]:
    return mixed_prompts(seed=11, lengths=(24, 131, 7), vocab=31000)


def _engine7b(model: Path, adapter: Path, graphs: bool, dtype: str = "bfloat16") -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            adapter=adapter,
            device="cuda",
            dtype=dtype,
            use_cuda_graphs=graphs,
            max_num_seqs=8,
            max_model_len=512,
            kv_cache_memory_bytes=4 << 30,
        )
    )


def test_llama7b_lora_fp32_matches_transformers_peft(llama7b_dir, adapter7b, prompts7b) -> None:
    """fp32 on the GPU: the first 32 greedy tokens equal transformers + peft exactly (CUDA graphs on)."""
    reference = hf_greedy(llama7b_dir, adapter7b, prompts7b, 32, device="cuda", dtype=torch.float32)
    _free()
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True, dtype="float32")
    got = engine_greedy(engine, prompts7b, 32)
    del engine
    _free()
    assert got == reference


# bf16 keeps 8 bits of mantissa: on random weights the top two logits are often a few ulps apart
# (measured: gaps of 0.03 at logits near 8), where two correct bf16 implementations may pick either.
# So bf16 tokens must agree until the reference's first near-tie; fp32 (above) must agree everywhere.
BF16_NEAR_TIE = 0.25


def test_llama7b_lora_bf16_matches_transformers_peft(llama7b_dir, adapter7b, prompts7b) -> None:
    margins: list[list[float]] = []
    reference = hf_greedy(
        llama7b_dir, adapter7b, prompts7b, 32, device="cuda", dtype=torch.bfloat16, margins=margins
    )
    _free()
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True)
    got = engine_greedy(engine, prompts7b, 32)
    del engine
    _free()
    for ref, out, gaps in zip(reference, got, margins, strict=True):
        tie = next((i for i, g in enumerate(gaps) if g < BF16_NEAR_TIE), len(gaps))
        assert out[:tie] == ref[:tie], (tie, out, ref, gaps)
    print(
        "bf16 tokens equal to transformers + peft:",
        [
            next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
            for r, o in zip(reference, got, strict=True)
        ],
    )


def test_llama7b_graphs_on_off_identical(llama7b_dir, adapter7b, prompts7b) -> None:
    outs = {}
    for graphs in (True, False):
        engine = _engine7b(llama7b_dir, adapter7b, graphs)
        outs[graphs] = engine_greedy(engine, prompts7b, 32)
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
        outs[(graphs, "sampled")] = [o.token_ids for o in engine.generate(prompts7b, params)]
        del engine
        _free()
    assert outs[True] == outs[False]
    assert outs[(True, "sampled")] == outs[(False, "sampled")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_ops_equal_torch_ops(dtype) -> None:
    import torch.nn.functional as F

    from lorafn.runtime.models import triton_ops
    from lorafn.runtime.models.llama import apply_rope, rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    # at most about one ulp apart (a reduction order or an FMA may round the other way); atol covers
    # RoPE's cancellations (a difference of two rounded products near zero)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    tol = {"atol": ulp, "rtol": ulp}
    x, d, w = randn(7, 4096), randn(7, 4096), 1 + 0.1 * randn(4096)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **tol)
    res, normed = triton_ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(res, x + d)
    torch.testing.assert_close(normed, rms_norm(x + d, w, 1e-5), **tol)
    q, cos, sin = randn(7, 32 * 128), randn(600, 128), randn(600, 128)
    pos = torch.tensor([0, 5, 599, 17, 17, 300, 1], device="cuda")
    ref = apply_rope(q.view(7, 32, 128), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    torch.testing.assert_close(triton_ops.rope(q, 32, cos, sin, pos), ref, **tol)
    g, u = randn(7, 11008), randn(7, 11008)
    torch.testing.assert_close(triton_ops.silu_mul(g, u), F.silu(g) * u, **tol)


def test_engine_turns_cudnn_attention_off_and_prefill_matches_math(tiny_model_dir: Path) -> None:
    """cuDNN SDPA builds a plan per exact shape (~65 ms of host time for each new prefill length on the
    H100): a CUDA engine turns it off unless asked, and the flash / memory-efficient prefill it then gets
    matches the math backend for lengths never seen before."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lorafn.runtime.attention import prefill_attention

    torch.backends.cuda.enable_cudnn_sdp(True)
    config = EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16", use_cuda_graphs=False)
    engine = Engine(config)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, start in ((37, 0), (515, 0), (64, 200)):
        q = torch.randn(n, 8, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(start + n, 2, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = prefill_attention(q, k, v, start, 64**-0.5)
        with sdpa_kernel(SDPBackend.MATH):
            ref = prefill_attention(q, k, v, start, 64**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    del engine
    _free()
