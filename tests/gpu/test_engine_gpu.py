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
from lorafn.runtime.config import DEFAULT_DECODE_ATTENTION, ModelConfig, expand_modes
from lorafn.runtime.lora import write_random_adapter
from tests.integration.runtime.engine_helpers import (
    drive,
    engine_greedy,
    hf_greedy,
    mixed_arrivals,
    mixed_prompts,
)

pytestmark = pytest.mark.gpu


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,page",
    [(1, 32, 32, 128, 16), (7, 32, 8, 128, 16), (64, 32, 32, 128, 16), (3, 4, 2, 64, 8), (2, 14, 2, 64, 32)],
)
@pytest.mark.parametrize("kernel", ["simt", "dot"])
def test_triton_decode_matches_reference(batch, heads, kv_heads, head_dim, page, kernel) -> None:
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
    lens[-1] = max_blocks * page  # one sequence fills its table: every split of it has tokens
    ref = paged_decode_attention_ref(q, k, v, tables, lens, head_dim**-0.5)
    out = paged_decode_attention_triton(q, k, v, tables, lens, head_dim**-0.5, kernel=kernel)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # in a CUDA graph, replayed with new queries (what the engine's decode graphs do)
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_decode_attention_triton(
            static_q, k, v, tables, lens, head_dim**-0.5, kernel=kernel
        )
    for sign in (1.0, -1.0, 0.5):
        static_q.copy_(q * sign)
        graph.replay()
        want = paged_decode_attention_ref(static_q, k, v, tables, lens, head_dim**-0.5)
        torch.testing.assert_close(static_out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_rope_in_attention_matches_rope_kernel_then_attention(heads: int, kv_heads: int, batch: int) -> None:
    """triton_decode.paged_decode_attention_rope on 7B / 8B head shapes, bf16, against what it replaces
    (fused_decode.rope_lora_kv, then the split attention): the same output and new K/V bit for bit, eagerly
    and replayed in a CUDA graph with new projection rows (on the GPU the programs run concurrently: a row
    reads its own new token from registers while another program stores it)."""
    from lorafn.runtime.attention.triton_decode import (
        paged_decode_attention_rope,
        paged_decode_attention_triton,
    )
    from lorafn.runtime.models import fused_decode as fd

    gen = torch.Generator(device="cuda").manual_seed(batch)
    dim, page, per_seq = 128, 16, 40
    blocks = batch * per_seq + 1
    k_cache = torch.randn(blocks, page, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks - 1, device="cuda", generator=gen)[: batch * per_seq] + 1
    tables = perm.view(batch, per_seq).int().contiguous()  # each sequence owns its blocks
    lens = torch.randint(1, per_seq * page + 1, (batch,), device="cuda", generator=gen).int()
    lens[0], lens[-1] = 1, per_seq * page
    positions = (lens - 1).long()
    slots = tables[torch.arange(batch, device="cuda"), positions // page].long() * page + positions % page
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.cat([torch.outer(torch.arange(per_seq * page, device="cuda").float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    cut = (heads * dim, (heads + kv_heads) * dim)
    out = torch.randn(batch, cut[1] + kv_heads * dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    q, k, v = out[:, : cut[0]], out[:, cut[0] : cut[1]], out[:, cut[1] :]

    def two_launches(kc, vc):
        qr, _k, _v = fd.rope_lora_kv(q, k, v, None, heads, kv_heads, cos, sin, positions, kc, vc, slots)
        return paged_decode_attention_triton(qr, kc, vc, tables, lens, dim**-0.5)

    def one_launch(kc, vc):
        return paged_decode_attention_rope(
            q, k, v, cos, sin, positions, slots, kc, vc, tables, lens, dim**-0.5
        )

    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("two", "one")}
    want, got = two_launches(*caches["two"]), one_launch(*caches["one"])
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(caches["one"], caches["two"], strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = one_launch(*caches["one"])
    for _ in range(3):  # new projection rows: the graph stores and reads the new tokens anew
        out.copy_(torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        want = two_launches(*caches["two"])
        assert torch.equal(static, want)
        assert all(torch.equal(a, b) for a, b in zip(caches["one"], caches["two"], strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_kernels_round_as_the_torch_ops(dtype: torch.dtype) -> None:
    """The decode RoPE kernels (fused_decode.rope_lora_kv without expands, and the RoPE form of the split
    attention) against the torch ops they replace, `x * cos + rotate_half(x) * sin` in the activation
    dtype, bit for bit. Compiled with Triton's FMA contraction, `round(x·c) + round(y·s)` had become one
    fma: on an H200 21% of the bf16 q elements differed, and the two kernels from each other
    (triton_rounding's module doc)."""
    from lorafn.runtime.attention.triton_decode import paged_decode_attention_rope
    from lorafn.runtime.models import fused_decode as fd

    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, batch, dim, page, per_seq = 32, 8, 7, 128, 16, 40
    k_cache = torch.zeros(batch * per_seq + 1, page, kv_heads, dim, device="cuda", dtype=dtype)
    caches = [(k_cache.clone(), k_cache.clone()) for _ in range(2)]
    tables = (torch.arange(batch * per_seq, device="cuda").view(batch, per_seq) + 1).int()
    lens = torch.randint(1, per_seq * page + 1, (batch,), device="cuda", generator=gen).int()
    positions = (lens - 1).long()
    block = tables[torch.arange(batch, device="cuda"), positions // page].long()
    slots = block * page + positions % page
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.cat([torch.outer(torch.arange(per_seq * page, device="cuda").float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = torch.randn(batch, (heads + 2 * kv_heads) * dim, device="cuda", generator=gen).mul(4).to(dtype)
    q, k, v = out.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)

    def torch_rope(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.reshape(batch, n, dim)
        rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
        return x * cos[positions][:, None] + rotated * sin[positions][:, None]

    q_want, k_want = torch_rope(q, heads), torch_rope(k, kv_heads)
    step = (cos, sin, positions, *caches[0], slots)
    q_got, k_got, v_got = fd.rope_lora_kv(q, k, v, None, heads, kv_heads, *step)
    assert torch.equal(q_got, q_want)
    assert torch.equal(k_got, k_want)
    assert torch.equal(caches[0][0][block, positions % page], k_want)
    paged_decode_attention_rope(q, k, v, cos, sin, positions, slots, *caches[1], tables, lens, dim**-0.5)
    assert torch.equal(caches[1][0][block, positions % page], k_want)
    assert torch.equal(caches[1][1][block, positions % page], v_got)


def test_tiny_rope_in_attention_same_tokens_fp32(tiny_model_dir: Path, tiny_gpu_adapter: Path) -> None:
    """fp32 tiny engine, base and LoRA, graphs on and off: rope_in_attention gives the greedy tokens of the
    default, over decode batches of 1-40 sequences (graph buckets up to 64)."""
    prompts = mixed_prompts(seed=11, lengths=tuple(3 + (5 * i) % 40 for i in range(40)), vocab=1000)
    for adapter in (None, tiny_gpu_adapter):
        outs = {}
        for on in (False, True):
            for graphs in (True, False):
                engine = Engine(
                    EngineConfig(
                        model=tiny_model_dir, adapter=adapter, device="cuda", dtype="float32",
                        use_cuda_graphs=graphs, max_num_seqs=48, num_kv_blocks=512, rope_in_attention=on,
                    )
                )  # fmt: skip
                model = engine.runner.model
                assert model.rope_in_attention is on and model.fused is not None  # the path that uses it
                outs[(on, graphs)] = engine_greedy(engine, prompts, 12)
                del engine
                _free()
        assert all(o == outs[(False, False)] for o in outs.values()), adapter


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


def test_tiny_lazy_graphs_capture_on_need_and_when_idle_with_the_same_tokens(
    tiny_model_dir: Path, tiny_gpu_adapter: Path, tmp_path: Path
) -> None:
    # a fresh worker's engine (EngineConfig.lazy_graphs): nothing captured at start; a decode step captures
    # its bucket first; idle time captures the rest; tokens as without graphs and as with all captured
    prompts = mixed_prompts(seed=5, lengths=(3, 17, 40, 9, 1, 26, 5, 60, 12), vocab=1000)
    outs = {}
    for lazy in (None, True, False):
        engine = Engine(
            EngineConfig(
                model=tiny_model_dir,
                adapter=tiny_gpu_adapter,
                device="cuda",
                dtype="bfloat16",
                use_cuda_graphs=lazy is not None,
                lazy_graphs=bool(lazy),
                cache_dir=tmp_path,
                max_num_seqs=16,
            )
        )
        graphs = engine.runner.graphs
        if lazy:
            assert graphs is not None and graphs.pending == list(graphs.buckets)  # none before serving
            assert engine.runner.startup_s["graphs"] == 0.0
            first = engine_greedy(engine, prompts[:1], 24)  # one sequence: bucket 1 only
            assert 1 in graphs.graphs and graphs.pending == [b for b in graphs.buckets if b != 1]
            assert first == [engine_greedy(engine, prompts[:1], 24)[0]]
            while engine.capture_pending_graph():
                pass
            assert graphs.pending == []
        outs[lazy] = engine_greedy(engine, prompts, 24)
        del engine
        _free()
    assert outs[True] == outs[None] == outs[False]


def _tiny_fp32(model: Path, adapter: Path, **overrides) -> Engine:
    """A CUDA engine of the tiny model in float32 (16 sequences at most), with ``overrides``."""
    config = EngineConfig(
        model=model, adapter=adapter, device="cuda", dtype="float32", max_num_seqs=16, **overrides
    )
    return Engine(config)


def _alone(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt generated by itself: its first chunk is a step of its own (the step a
    prefill graph takes)."""
    return [engine_greedy(engine, [p], max_new_tokens)[0] for p in prompts]


def test_tiny_prefill_graphs_same_tokens_as_eager_also_lazy_and_after_park(
    tiny_model_dir: Path, tiny_gpu_adapter: Path, tmp_path: Path
) -> None:
    # fp32: padding a chunk to its bucket changes GEMM shapes, not the math (causal attention: no real
    # row sees a padding row), so greedy tokens must equal the eager prefill's. 1 token: the decode path;
    # 90: above every bucket (eager); the others replay a graph, whose K/V the decode steps then read.
    prompts = mixed_prompts(seed=7, lengths=(3, 17, 40, 9, 1, 26, 64, 90, 2), vocab=1000)
    buckets = (8, 32, 64)
    graphed = sum(1 for p in prompts if 2 <= len(p) <= 64)

    def engine(prefill: bool, lazy: bool = False) -> Engine:
        return _tiny_fp32(
            tiny_model_dir,
            tiny_gpu_adapter,
            cache_dir=tmp_path,
            lazy_graphs=lazy,
            prefill_graph_tokens=buckets if prefill else (),
        )

    eager = engine(prefill=False)
    assert eager.runner.prefill_graphs is None
    want_alone, want_together = _alone(eager, prompts, 12), engine_greedy(eager, prompts, 12)
    del eager
    _free()

    e = engine(prefill=True)
    pg = e.runner.prefill_graphs
    assert pg is not None and pg.pending == [] and "prefill_graphs" in e.runner.startup_s
    assert _alone(e, prompts, 12) == want_alone
    assert pg.replays == graphed
    assert engine_greedy(e, prompts, 12) == want_together  # steps of several chunks: eager
    assert pg.replays == graphed
    e.park()  # the graphs name the KV cache: released with it, pending again after unpark
    assert e.runner.prefill_graphs is None
    e.unpark()
    pg = e.runner.prefill_graphs
    assert pg is not None and pg.pending == list(buckets)
    assert _alone(e, prompts[:2], 12) == want_alone[:2] and pg.replays == 0  # pending: eager
    while e.capture_pending_graph():
        pass
    assert pg.pending == [] and _alone(e, prompts, 12) == want_alone and pg.replays == graphed
    del e, pg
    _free()

    lazy = engine(prefill=True, lazy=True)  # a fresh worker's: nothing captured before serving
    pg = lazy.runner.prefill_graphs
    assert pg is not None and pg.pending == list(buckets) and lazy.runner.graphs_pending
    assert _alone(lazy, prompts[:1], 12) == want_alone[:1] and pg.replays == 0
    while lazy.capture_pending_graph():  # decode graphs first, then the prefill ones
        pass
    assert pg.pending == [] and not lazy.runner.graphs_pending
    assert _alone(lazy, prompts, 12) == want_alone and pg.replays == graphed


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_tiny_overlapped_steps_give_the_outputs_of_steps_one_at_a_time(
    tiny_model_dir: Path, tiny_gpu_adapter: Path, graphs: bool
) -> None:
    """fp32, CUDA: overlapped steps (the default here) against steps one at a time, on a trace of requests
    joining a running batch with every kind of sampling and stop; with graphs, the decode steps replay
    decode graphs (their input ids filled on the device from the queued step's tokens) and a first chunk
    alone a prefill graph; eager, every step is a flattened forward."""
    prompts = mixed_prompts(seed=12, lengths=(3, 40, 11, 26, 1, 19, 50, 7, 33), vocab=1000)

    def engine(overlap: bool) -> Engine:
        return _tiny_fp32(
            tiny_model_dir,
            tiny_gpu_adapter,
            max_num_batched_tokens=48,
            use_cuda_graphs=graphs,
            prefill_graph_tokens=(16, 64) if graphs else (),
            overlap_steps=overlap,
        )

    free = engine(False).generate(
        [prompts[2]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    stop = free.text.strip()[1:3] if len(free.text.strip()) >= 4 else None
    # a prompt alone first (its prefill a graph's, with graphs), the trace after it
    arrivals = {k + 3: v for k, v in mixed_arrivals(prompts, free.token_ids[4], stop).items()}
    arrivals[0] = [("alone", prompts[3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    got = {}
    for overlap in (False, True):
        e = engine(overlap)
        assert e.overlap_steps is overlap
        got[overlap] = {rid: (g["tokens"], g["text"], g["reason"]) for rid, g in drive(e, arrivals).items()}
        if graphs:
            assert e.runner.prefill_graphs.replays > 0
        del e
        _free()
    assert got[True] == got[False]
    assert Engine(EngineConfig(model=tiny_model_dir, device="cuda", dtype="float32")).overlap_steps is True


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


@pytest.fixture(scope="module")
def hf_reference7b() -> dict:
    """transformers + peft greedy tokens (and bf16 margins) per dtype, computed once for the module."""
    return {}


def _hf7b(cache: dict, model: Path, adapter: Path, prompts: list, dtype: torch.dtype) -> tuple[list, list]:
    if dtype not in cache:
        margins: list[list[float]] = []
        tokens = hf_greedy(model, adapter, prompts, 32, device="cuda", dtype=dtype, margins=margins)
        cache[dtype] = (tokens, margins)
        _free()
    return cache[dtype]


def _engine7b(
    model: Path,
    adapter: Path,
    graphs: bool,
    dtype: str = "bfloat16",
    prefill_graph_tokens: tuple = (),
    decode_attention: str = DEFAULT_DECODE_ATTENTION,
    overlap_steps: bool | None = None,
    **overrides,
) -> Engine:
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
            prefill_graph_tokens=prefill_graph_tokens,
            decode_attention=decode_attention,
            overlap_steps=overlap_steps,
            **overrides,
        )
    )


@pytest.mark.parametrize("kernel", ["simt", "dot"])
def test_llama7b_lora_fp32_matches_transformers_peft(
    llama7b_dir, adapter7b, prompts7b, hf_reference7b, kernel
) -> None:
    """fp32 on the GPU: the first 32 greedy tokens equal transformers + peft exactly (CUDA graphs on),
    with either decode attention kernel (the dot one's float32 dots are IEEE)."""
    reference, _ = _hf7b(hf_reference7b, llama7b_dir, adapter7b, prompts7b, torch.float32)
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True, dtype="float32", decode_attention=kernel)
    got = engine_greedy(engine, prompts7b, 32)
    del engine
    _free()
    assert got == reference
    # each prompt alone, its prefill a graph of a padded bucket (24 -> 32, 131 -> 256, 7 -> 32)
    if kernel != DEFAULT_DECODE_ATTENTION:  # prefill graphs attend with SDPA: the same with either kernel
        return
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True, dtype="float32", prefill_graph_tokens=(32, 256))
    alone = _alone(engine, prompts7b, 32)
    replays = engine.runner.prefill_graphs.replays
    del engine
    _free()
    assert (alone, replays) == (reference, len(prompts7b))


def test_llama7b_rope_in_attention_fp32_matches_transformers_peft_and_bf16_its_own_tokens(
    llama7b_dir, adapter7b, prompts7b, hf_reference7b
) -> None:
    """EngineConfig.rope_in_attention: fp32 greedy tokens equal transformers + peft (graphs on), and bf16
    tokens equal those of the same engine without it (the same roundings: every token, not up to a tie)."""
    reference, _ = _hf7b(hf_reference7b, llama7b_dir, adapter7b, prompts7b, torch.float32)
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True, dtype="float32", rope_in_attention=True)
    assert engine.runner.model.rope_in_attention
    got = engine_greedy(engine, prompts7b, 32)
    del engine
    _free()
    assert got == reference
    bf16 = {}
    for on in (False, True):
        engine = _engine7b(llama7b_dir, adapter7b, graphs=True, rope_in_attention=on)
        bf16[on] = engine_greedy(engine, prompts7b, 32)
        del engine
        _free()
    assert bf16[True] == bf16[False]


# bf16 keeps 8 bits of mantissa: on random weights the top two logits are often a few ulps apart
# (measured: gaps of 0.03 at logits near 8), where two correct bf16 implementations may pick either.
# So bf16 tokens must agree until the reference's first near-tie; fp32 (above) must agree everywhere.
BF16_NEAR_TIE = 0.25


@pytest.mark.parametrize("kernel", ["simt", "dot"])
def test_llama7b_lora_bf16_matches_transformers_peft(
    llama7b_dir, adapter7b, prompts7b, hf_reference7b, kernel
) -> None:
    reference, margins = _hf7b(hf_reference7b, llama7b_dir, adapter7b, prompts7b, torch.bfloat16)
    engine = _engine7b(llama7b_dir, adapter7b, graphs=True, decode_attention=kernel)
    got = engine_greedy(engine, prompts7b, 32)
    del engine
    _free()
    for ref, out, gaps in zip(reference, got, margins, strict=True):
        tie = next((i for i, g in enumerate(gaps) if g < BF16_NEAR_TIE), len(gaps))
        assert out[:tie] == ref[:tie], (tie, out, ref, gaps)
    print(
        f"bf16 tokens equal to transformers + peft ({kernel}):",
        [
            next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
            for r, o in zip(reference, got, strict=True)
        ],
    )


def test_llama7b_graphs_on_off_identical(llama7b_dir, adapter7b, prompts7b) -> None:
    """Graphs on and off, and (graphs on) steps one at a time instead of overlapped, the default here."""
    outs = {}
    for graphs, overlap in ((True, True), (False, True), (True, False)):
        engine = _engine7b(llama7b_dir, adapter7b, graphs, overlap_steps=overlap)
        outs[graphs, overlap] = engine_greedy(engine, prompts7b, 32)
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
        outs[graphs, overlap, "sampled"] = [o.token_ids for o in engine.generate(prompts7b, params)]
        del engine
        _free()
    assert outs[True, True] == outs[False, True] == outs[True, False]
    assert outs[True, True, "sampled"] == outs[False, True, "sampled"] == outs[True, False, "sampled"]


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


# --- LoRA expands of large steps (EngineConfig.lora_expand; triton_ops.lora_expand) -------------------------
#
# Every Triton kernel that adds an expand y += t·Bᵀ sums it in float32 (tl.dot), adds it to y in float32 and
# rounds once (`_round_once`; the compiled sm_90 code is wgmma, add.f32, cvt.rn.bf16x2.f32). On the H100
# (3351cf9) these tests, then written against `addmm_`, failed for every bf16 case and passed for every
# float32 one: cuBLAS's bf16 addmm_ there differed from the kernels on 28% of the outputs, the share on which
# rounding t·Bᵀ to bf16 before the add changes the sum (28.5% on these shapes; CPU addmm_ rounds once). So
# the kernels are checked against the round-once reference, within one bf16 step of addmm_, and
# test_bf16_addmm_rounding_on_this_gpu records what cuBLAS does (run it with -rA to see the shares).


def _round_once(y: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """y + t·b_t summed exactly (float64), then float32 (what a float32 accumulator holds, up to its order),
    rounded once to y's dtype."""
    return (y.double() + t.double() @ b_t.double()).float().to(y.dtype)


def _round_twice(y: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """y + bf16(t·b_t): the product rounded to y's dtype before the add."""
    return (y.float() + (t.double() @ b_t.double()).float().to(y.dtype).float()).to(y.dtype)


def _assert_rounds_once(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16: equal on >= 99.9% (float32 summation order may move a value across a rounding boundary now and
    then), the rest at most one bf16 step apart; float32: within 1e-5."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    equal = (got == want).float().mean().item()
    assert equal >= 0.999, f"{what}: {equal:.4%} equal to the round-once reference"
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2**-7)


_BF16_U = 2.0**-8  # bf16 unit roundoff: half a step, relative


def _product_first_bound(prod: torch.Tensor, got: torch.Tensor, cublas: torch.Tensor) -> torch.Tensor:
    """How far bf16 `y.addmm_(t, b_t)` with t·b_t rounded to bf16 before the add (what cuBLAS does on the
    H100: test_bf16_addmm_rounding_on_this_gpu) may lie from a sum rounded once, per element: half a step
    of the product, of each side's sum, and one more of `got` for a float32 summation order that moves a
    value across a rounding boundary: u·(|t·b_t| + 2|got| + 2|cublas|). One bf16 step of the result is not
    a bound: where y and t·b_t cancel, the product's half step is larger than the sum's (the H100 run of
    e7c913f failed 1-5 of ~5.6M outputs against 1 step)."""
    return _BF16_U * (prod.abs() + 2 * got.float().abs() + 2 * cublas.float().abs()) * 1.01 + 1e-30


def _assert_within(diff: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    ratio = diff / bound
    worst = int(ratio.argmax())
    assert ratio.max().item() <= 1.0, (
        f"{what}: {ratio.max().item():.2f}x its double-rounding bound at flat index {worst} "
        f"(diff {diff.flatten()[worst].item():.4g}, bound {bound.flatten()[worst].item():.4g})"
    )


@pytest.mark.parametrize("rows", [17, 64, 512, 513])
@pytest.mark.parametrize("widths,rank", [((4096, 1024), 16), ((11008,), 16), ((4096,), 80)])
def test_bf16_addmm_rounding_on_this_gpu(rows, widths, rank) -> None:
    """What cuBLAS's bf16 `y.addmm_(t, b_t)` (the per_projection expand) computes here: rounded once, or with
    t·b_t rounded to bf16 before the add. Either is accepted (>= 99.9% of the outputs equal to one of the
    two); anything else fails. `-rA` shows which one (the kernels above round once in every case)."""
    gen = torch.Generator(device="cuda").manual_seed(rows + rank)
    t = torch.randn(rows, rank, device="cuda", generator=gen, dtype=torch.bfloat16)
    shares = []
    for n in widths:
        y = torch.randn(rows, n, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = torch.randn(rank, n, device="cuda", generator=gen, dtype=torch.bfloat16) / 4
        got = y.clone().addmm_(t, b)
        once = (got == _round_once(y, t, b)).float().mean().item()
        twice = (got == _round_twice(y, t, b)).float().mean().item()
        shares.append(f"N={n}: equal to round-once {once:.2%}, to product-rounded {twice:.2%}")
        assert max(once, twice) >= 0.999, shares[-1]
    print(f"bf16 addmm_ rows={rows} rank={rank}:", "; ".join(shares))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [17, 32, 64, 512, 513])
@pytest.mark.parametrize(
    "widths,ranks",
    [
        ((4096, 4096, 4096), (16, 16, 16)),  # llama-2-7b q/k/v
        ((4096, 1024, 1024), (8, 16, 4)),  # GQA q/k/v, mixed ranks
        ((11008, 11008), (16, 16)),  # gate/up
        ((4096, 4096), (8, 8)),  # q and v only (k absent)
        ((4096,), (80,)),  # o or down, a rank above the 64-wide rank block
    ],
)
def test_lora_expand_kernel_matches_addmm(dtype, rows, widths, ranks) -> None:
    """One launch per group adds what addmm_ per projection adds: the products summed in float32, added in
    float32 and rounded once (the round-once reference: bf16 equal on >= 99.9%, float32 within 1e-5), and
    within the double-rounding bound of cuBLAS's addmm_ (`_product_first_bound`)."""
    from lorafn.runtime.models import triton_ops

    gen = torch.Generator(device="cuda").manual_seed(rows)
    t = torch.randn(rows, sum(ranks), device="cuda", generator=gen, dtype=dtype)
    offs = [sum(ranks[:i]) for i in range(len(ranks))]
    wide = torch.randn(rows, sum(widths) + 64, device="cuda", generator=gen, dtype=dtype)
    ys = [wide[:, sum(widths[:i]) : sum(widths[: i + 1])] for i in range(len(widths))]  # strided rows
    bs = [
        torch.randn(r, n, device="cuda", generator=gen, dtype=dtype) / 4
        for r, n in zip(ranks, widths, strict=True)
    ]
    members = list(zip(ys, offs, ranks, bs, strict=True))
    want = [_round_once(y, t[:, o : o + r], b) for y, o, r, b in members]
    cublas = [y.clone().addmm_(t[:, o : o + r], b) for y, o, r, b in members]
    prods = [(t[:, o : o + r].double() @ b.double()).float() for _y, o, r, b in members]
    untouched = wide[:, sum(widths) :].clone()
    triton_ops.lora_expand(t, members)
    for i, (y, w, c, prod) in enumerate(zip(ys, want, cublas, prods, strict=True)):
        _assert_rounds_once(y, w, f"member {i}")
        if dtype == torch.float32:
            torch.testing.assert_close(y, c, atol=1e-5, rtol=1e-5)
        else:  # whichever way cuBLAS rounds, within what rounding the product first can move a value
            _assert_within((y.float() - c.float()).abs(), _product_first_bound(prod, y, c), f"member {i}")
    assert torch.equal(wide[:, sum(widths) :], untouched)  # nothing written beyond the outputs


def test_tiny_lora_expand_modes_same_tokens_fp32(tiny_model_dir: Path, tiny_gpu_adapter: Path) -> None:
    """fp32: grouped, per-projection and in-kernel expands, and the per-step pairs (hybrid: per_projection
    for the prefill step, in_kernels for the decode steps; per_projection/grouped) give the same greedy
    tokens, with decode batches above 16 rows (40 sequences: the large path, replayed from the bucket-64
    graph, captured in the decode mode) and without graphs."""
    prompts = mixed_prompts(seed=9, lengths=tuple(3 + (7 * i) % 50 for i in range(40)), vocab=1000)
    outs = {}
    for mode in ("grouped", "per_projection", "in_kernels", "hybrid", "per_projection/grouped"):
        for graphs in (True, False):
            engine = Engine(
                EngineConfig(
                    model=tiny_model_dir,
                    adapter=tiny_gpu_adapter,
                    device="cuda",
                    dtype="float32",
                    use_cuda_graphs=graphs,
                    max_num_seqs=48,
                    num_kv_blocks=512,
                    lora_expand=mode,
                )
            )
            model = engine.runner.model
            assert model.lora_expand == mode
            assert (model.prefill_expand, model.decode_expand) == expand_modes(mode)
            outs[(mode, graphs)] = engine_greedy(engine, prompts, 16)
            del engine
            _free()
    assert all(o == outs[("per_projection", False)] for o in outs.values())


class _Resident:
    """A WeightSource over tensors already on the GPU: several models of one test share one copy."""

    def __init__(self, model_dir: Path) -> None:
        from lorafn.runtime.local_weights import SafetensorsWeightSource

        files = SafetensorsWeightSource(model_dir)
        self.tensors = {n: files.get(n, torch.device("cuda"), torch.bfloat16) for n in files.names()}
        files.close()

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[name].to(device=device, dtype=dtype)

    def read_only(self) -> bool:
        return True

    def close(self) -> None:
        self.tensors.clear()


def test_llama7b_lora_expand_modes_prefill_bf16(llama7b_dir, adapter7b) -> None:
    """bf16, llama-2-7b, r16 all-linear: a 512-token prefill, a step of one decode beside a 100-token prefill
    (both large steps with a prefill chunk), then a step of 32 decodes only (a large decode step, as the
    bucket-32 graph runs it). bf16 roundings differ in order between the modes, so each is compared with
    the float32 forward (per projection), as test_fused_decode_gpu does: grouped, in-kernel and hybrid
    expands may not be further from it than per-projection ones (x1.5 + 1e-3), and the adapter must change
    the logits far more than that distance (a member left out or added twice then fails)."""
    from lorafn.runtime.kv_cache import KVCache
    from lorafn.runtime.lora import load_lora
    from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan

    cfg = ModelConfig.from_dir(llama7b_dir)
    dev = torch.device("cuda")
    source = _Resident(llama7b_dir)
    lora = load_lora(adapter7b, cfg, dev, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(10, 31000, (612,), device=dev, generator=gen)
    steps = [
        ForwardBatch(ids[:512], torch.arange(512, device=dev), torch.arange(512, device=dev), 0, None, None,
                     [PrefillSpan(0, 512, 0)], torch.tensor([511], device=dev)),
        ForwardBatch(ids[511:612], torch.cat([torch.tensor([512]), torch.arange(100)]).to(dev),
                     torch.cat([torch.tensor([512]), 528 + torch.arange(100)]).to(dev), 1,
                     torch.arange(33, dtype=torch.int32, device=dev)[None, :],
                     torch.tensor([513], dtype=torch.int32, device=dev), [PrefillSpan(1, 100, 0)], None),
        # 32 decodes: row i at position i of blocks 40-41 (slot 640 + i), attending to rows 0..i of the step
        ForwardBatch(ids[:32], torch.arange(32, device=dev), 640 + torch.arange(32, device=dev), 32,
                     torch.tensor([[40, 41]] * 32, dtype=torch.int32, device=dev),
                     torch.arange(1, 33, dtype=torch.int32, device=dev), [], None),
    ]  # fmt: skip

    def run(adapter, mode: str, dtype: torch.dtype = torch.bfloat16):
        model = LlamaModel(cfg, source, dev, dtype, adapter, max_position=1024,
                           use_triton_attention=True, fused_decode=True, lora_expand=mode)  # fmt: skip
        kv = KVCache(cfg, 48, 16, dev, dtype)
        logits = [model.forward(s, kv.layers).float() for s in steps]
        out = logits, kv.data.float()
        del model, kv
        _free()
        return out

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    ref = run(load_lora(adapter7b, cfg, dev, torch.float32), "per_projection", torch.float32)
    base = run(None, "per_projection", torch.float32)
    plain = run(lora, "per_projection")
    plain_dist = [rel(a, r) for a, r in zip(plain[0], ref[0], strict=True)]
    for i, (r, b) in enumerate(zip(ref[0], base[0], strict=True)):
        assert rel(r, b) > 2 * plain_dist[i] + 1e-3, f"step {i}: the adapter changes too little to tell modes"
    for mode in ("grouped", "in_kernels", "hybrid"):
        got = run(lora, mode)
        for i, (a, r) in enumerate(zip(got[0], ref[0], strict=True)):
            assert rel(a, r) <= 1.5 * plain_dist[i] + 1e-3, (
                f"{mode} step {i}: {rel(a, r):.4f} vs {plain_dist[i]:.4f}"
            )
        assert rel(got[1], ref[1]) <= 1.5 * rel(plain[1], ref[1]) + 1e-3, mode
    source.close()
    _free()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [17, 64, 512, 513])
@pytest.mark.parametrize("ranks", [(16, 16), (8, 0), (0, 80)])
def test_silu_mul_expand_matches_addmm_then_silu_mul(dtype, rows, ranks) -> None:
    """gate/up expands inside SiLU·up (a large step's grouped path; and the per-row silu_mul_lora of small
    steps and in_kernels) = each expand added in float32 and rounded once, then the torch SiLU·up: bf16 equal
    on >= 99% (the kernel's exp may round the SiLU differently now and then) and within one bf16 step of the
    product, float32 within 1e-5; and within the double-rounding bound of addmm_ + SiLU·up (cuBLAS rounds
    t·Bᵀ first: `_product_first_bound` for gate and up, carried through SiLU·up, |SiLU'| <= 1.1)."""
    import torch.nn.functional as F

    from lorafn.runtime.models import fused_decode as fd
    from lorafn.runtime.models import triton_ops
    from lorafn.runtime.models.fused_decode import Expand

    gen = torch.Generator(device="cuda").manual_seed(rows)
    n = 11008
    t = torch.randn(rows, sum(ranks) + 8, device="cuda", generator=gen, dtype=dtype)
    gate_up = torch.randn(rows, 2 * n, device="cuda", generator=gen, dtype=dtype)
    gate, up = gate_up[:, :n], gate_up[:, n:]  # strided rows, as two GEMM outputs of one buffer would be
    bs = [torch.randn(r, n, device="cuda", generator=gen, dtype=dtype) / 4 for r in ranks]
    expands = (
        Expand(t, 0, ranks[0], bs[0]) if ranks[0] else None,
        Expand(t, ranks[0], ranks[1], bs[1]) if ranks[1] else None,
    )

    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (F.silu(g.float()).to(dtype).float() * u.float()).to(dtype)

    once = [y if e is None else _round_once(y, t[:, e.offset : e.offset + e.rank], e.b_t)
            for y, e in ((gate, expands[0]), (up, expands[1]))]  # fmt: skip
    cublas = [y.clone() for y in (gate, up)]
    for y, e in zip(cublas, expands, strict=True):
        if e is not None:
            y.addmm_(t[:, e.offset : e.offset + e.rank], e.b_t)
    want = silu_mul(*once)
    # how far cuBLAS's gate and up may lie from the round-once ones, carried through SiLU(g)·u: 1.1·Δg·|u| +
    # |SiLU(g)|·Δu + Δg·Δu, plus the SiLU's and the product's roundings on both sides (and one for the
    # kernel's exp): 5 half steps of the output
    deltas = []
    for y_once, y_cublas, e in zip(once, cublas, expands, strict=True):
        if e is None:
            deltas.append(torch.zeros(y_once.shape, device=y_once.device))
            continue
        prod = (t[:, e.offset : e.offset + e.rank].double() @ e.b_t.double()).float()
        deltas.append(_product_first_bound(prod, y_once, y_cublas))
    via_cublas = silu_mul(*cublas)
    silu_bound = (
        1.1 * deltas[0] * cublas[1].float().abs()
        + F.silu(once[0].float()).abs() * deltas[1]
        + 1.1 * deltas[0] * deltas[1]
        + 5 * _BF16_U * via_cublas.float().abs()
    ) * 1.01 + 1e-30
    for got in (triton_ops.silu_mul_expand(gate, up, expands), fd.silu_mul_lora(gate, up, expands)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, silu_mul(*cublas), atol=1e-5, rtol=1e-5)
            continue
        equal = (got == want).float().mean().item()
        assert equal >= 0.99, f"{equal:.4%} equal to the round-once reference"
        # the reference rounds SiLU(g) to bf16 before the product (as eager torch does); the kernels keep it
        # in float32: at most half a step of SiLU(g) times |u| plus the product's rounding, under two steps
        # (H100, 944e850: 1 of 5.6M outputs two steps apart, none more)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-6)
        _assert_within((got.float() - via_cublas.float()).abs(), silu_bound, "SiLU·up vs addmm_")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [17, 512, 513])
@pytest.mark.parametrize("heads,kv_heads,ranks", [(32, 32, (16, 16, 16)), (32, 8, (8, 0, 64))])
def test_rope_expand_kv_matches_rope_lora_kv(dtype, rows, heads, kv_heads, ranks) -> None:
    """q/k/v expands on row tiles inside RoPE + cache writes (a large step's grouped path) = fused_decode's
    per-row rope_lora_kv (the small-step kernel): outputs and both caches; float32 within 1e-5, bf16
    within one bf16 rounding step (summation order only)."""
    from lorafn.runtime.models import fused_decode as fd
    from lorafn.runtime.models import triton_ops
    from lorafn.runtime.models.fused_decode import Expand

    gen = torch.Generator(device="cuda").manual_seed(rows)
    d = 128
    widths = (heads * d, kv_heads * d, kv_heads * d)
    t = torch.randn(rows, sum(ranks) + 4, device="cuda", generator=gen, dtype=dtype)
    qkv = torch.randn(rows, sum(widths), device="cuda", generator=gen, dtype=dtype)
    q, k, v = qkv.split(widths, dim=1)  # strided rows, as one buffer's columns
    offs = (0, ranks[0], ranks[0] + ranks[1])
    lora = tuple(
        Expand(t, o, r, torch.randn(r, n, device="cuda", generator=gen, dtype=dtype) / 4) if r else None
        for o, r, n in zip(offs, ranks, widths, strict=True)
    )
    cos = torch.randn(1024, d, device="cuda", generator=gen).to(dtype)
    sin = torch.randn(1024, d, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, 1024, (rows,), device="cuda", generator=gen)
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:rows]
    caches = [torch.zeros(64, 16, kv_heads, d, device="cuda", dtype=dtype) for _ in range(4)]
    want = fd.rope_lora_kv(q, k, v, lora, heads, kv_heads, cos, sin, positions, caches[0], caches[1], slots)
    got = triton_ops.rope_expand_kv(
        q, k, v, lora, heads, kv_heads, cos, sin, positions, caches[2], caches[3], slots
    )
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2**-6)
    for a, b in [*zip(got, want, strict=True), (caches[2], caches[0]), (caches[3], caches[1])]:
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert caches[2].abs().sum() > 0 and caches[3].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [17, 512, 513])
@pytest.mark.parametrize("rank", [16, 80])
def test_add_rms_norm_expand_matches_add_rms_norm(dtype, rows, rank) -> None:
    """o/down expands on row tiles inside add + RMSNorm (a large step's grouped path) = the per-row
    add_rms_norm with the same expand (the small-step kernel): residual and normed output; float32 within
    1e-5, bf16 within one bf16 rounding step (summation order only)."""
    from lorafn.runtime.models import triton_ops
    from lorafn.runtime.models.fused_decode import Expand

    gen = torch.Generator(device="cuda").manual_seed(rows + rank)
    n = 4096
    t = torch.randn(rows, rank + 16, device="cuda", generator=gen, dtype=dtype)
    lora = Expand(t, 16, rank, torch.randn(rank, n, device="cuda", generator=gen, dtype=dtype) / 8)
    h = torch.randn(rows, n, device="cuda", generator=gen, dtype=dtype)
    delta = torch.randn(rows, n, device="cuda", generator=gen, dtype=dtype)
    weight = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    want = triton_ops.add_rms_norm(h, delta, weight, 1e-5, lora=lora)
    got = triton_ops.add_rms_norm_expand(h, delta, weight, 1e-5, lora)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2**-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
